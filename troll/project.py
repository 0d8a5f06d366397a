"""The token-level KL trust-region projection, dense (reference) and sparse (what training uses).

For each token with current policy p (log-probs l_p, with gradient) and old policy q (l_q, a constant):

    pi* = argmin_pi KL(pi || p)  s.t.  KL(pi || q) <= eps
        = p                                               if KL(p || q) <= eps   (inside: identity)
        = q^(1-t*) p^t* / Z,  t* = 1/(1+eta*) with KL(pi* || q) = eps             otherwise

    log pi*(v) = l_q(v) + t* a(v) - A(t*),   a = l_p - l_q,   A(t) = logsumexp(l_q + t a)

t* comes from `dual.solve_dual` (float64, no autograd) and receives its exact implicit gradient from
`dual.ImplicitT`, so autograd through the closed form above gives d pi* / d l_p exactly.
`detach_dual=True` drops the gradient through t* (the shortcut some ports take) to show its effect.

Shapes: `project_dense`: [..., V] -> [..., V]. `project_sparse`: a `Support` (sparse.py: N rows, U single-token
atoms and one atom for the rest of the vocabulary) -> projected log-masses [N, U + 1]. The same closed form and
dual hold atom by atom, because p and q are proportional inside a multi-token atom of either sparse model (the
paper's tail by construction; the rest atom because the projection keeps p's shape there, which is the exact
minimiser of KL(pi || p) given pi's mass on the atom). With the "rest" model this is the exact solution of

    min KL(pi || p)  s.t.  KL_c(pi || q) <= eps,      KL_c = KL of the coarse-grained pair on {S, rest},

whose result has true KL(pi* || q) = eps + pi*(rest) KL(p|rest || q|rest), and with nothing dropped it is
`project_dense`.

A token where p has no mass but q has some gets none in pi* either (KL(pi* || p) is finite only then): the
interpolation runs over the other tokens S, and a solution exists where q(S) > exp(-eps); elsewhere the input is
refused (dual.py). Tokens where q has no mass must have none in p either (-inf in both).

Precision (the solver's tolerance is relative to eps): float64 inputs give
|KL(pi* || q) - eps| <= 1e-11 eps + ~1e-16 (rounding) on active tokens, so KL <= eps (1 + 1e-3) down to
eps = 1e-12. For lower precision the solver aims a hair inside the ball (eps - min(2e-6, 1e-3 eps), to
min(1e-9, half that margin)) and t* is rounded down: the atoms' KL never exceeds eps, and the float32 log-probs
returned add their own rounding (about 1e-7 of KL); bf16/fp16 inputs are computed in float32.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import Tensor

from troll.dual import DualSolution, ImplicitT, path_atoms, solve_dual
from troll.sparse import Support, compute_dtype

FLOAT64_RTOL = 1e-11  # solver tolerance relative to eps in float64
FLOAT32_MARGIN = 2e-6  # below float64 the solver aims min(FLOAT32_MARGIN, FLOAT32_REL_MARGIN * eps) inside the ball
FLOAT32_REL_MARGIN = 1e-3
FLOAT32_TOL = 1e-9  # ... to min(FLOAT32_TOL, margin / 2): the atoms' KL stays below eps


def check_eps(eps: float) -> None:
    """The trust-region radius must be a positive finite number. Checked where eps comes in: the two public
    projections (project_dense, project_sparse), and troll_loss and TROLLConfig (troll.losses.check_troll_settings);
    the solvers (solve_t, dual.solve_dual) take it as valid."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")


def solve_t(a: Tensor, b: Tensor, eps: float, detach_dual: bool = False) -> tuple[Tensor, DualSolution]:
    """Solve the dual on atoms (a, b): [N, U] and return t* [N] in a's dtype, with its implicit gradient.

    For float64 the solver targets eps (to FLOAT64_RTOL * eps); otherwise eps - margin, margin =
    min(FLOAT32_MARGIN, FLOAT32_REL_MARGIN * eps), to min(FLOAT32_TOL, margin / 2), and t* is rounded down so the
    rounding can only move the result further inside the trust region. Warns (RuntimeWarning, with the count)
    where the solver did not converge; `DualSolution.converged` holds the rows. eps: checked by the caller.
    """
    if a.dtype == torch.float64:
        sol = solve_dual(a.detach(), b.detach(), eps, rtol=FLOAT64_RTOL)
    else:
        margin = min(FLOAT32_MARGIN, FLOAT32_REL_MARGIN * eps)
        target = eps - margin
        sol = solve_dual(a.detach(), b.detach(), target, rtol=min(FLOAT32_TOL, 0.5 * margin) / target)
    unconverged = int((~sol.converged).sum())
    if unconverged:
        warnings.warn(
            f"the KL projection's dual solver did not converge on {unconverged} of {a.shape[0]} tokens "
            "(dual_frac_unconverged > 0): their projected KL may exceed eps",
            RuntimeWarning,
            stacklevel=3,
        )
    t = sol.t.to(a.dtype)
    t = torch.where(t.double() > sol.t, torch.nextafter(t, torch.zeros_like(t)), t)
    if not detach_dual:
        t = ImplicitT.apply(t, a, b, sol.active)
    return t, sol


def project_dense(logp_new: Tensor, logp_old: Tensor, eps: float, detach_dual: bool = False) -> Tensor:
    """Exact projection over the full vocabulary: [..., V] log-probs (or logits) in, log-probs out.

    Differentiable with respect to `logp_new`; `logp_old` is a constant. -inf marks tokens without mass: where
    only p has none, pi* has none either (module docstring); where q has none, p must have none (-inf in both).
    """
    check_eps(eps)
    if logp_new.shape != logp_old.shape:
        raise ValueError(f"logp_new {tuple(logp_new.shape)} and logp_old {tuple(logp_old.shape)} differ in shape")
    shape = logp_new.shape
    if len(shape) == 0 or shape[-1] == 0:
        raise ValueError(f"logp_new must be [..., V] with V >= 1, got {tuple(shape)}")
    dtype = compute_dtype(torch.promote_types(logp_new.dtype, logp_old.dtype))
    lp = logp_new.reshape(-1, shape[-1]).to(dtype)
    lq = logp_old.reshape(-1, shape[-1]).to(dtype).detach()
    for name, x in (("logp_new", lp), ("logp_old", lq)):
        if torch.isnan(x).any() or (x == math.inf).any():
            raise ValueError(f"{name} contains NaN or +inf")
        if (x == -math.inf).all(-1).any():
            raise ValueError(f"{name} has a row with no finite entry (zero probability everywhere)")
    live = torch.isfinite(lq)
    if bool((~live & torch.isfinite(lp)).any()):
        raise ValueError("logp_new has mass where logp_old has none (-inf): KL(p || q) is infinite")
    lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    lq = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
    a = torch.where(live, lp - lq, 0.0)  # -inf where only p has no mass
    t, sol = solve_t(a, lq, eps, detach_dual)
    out = torch.where(sol.active[:, None], _interpolate(a, lq, t), lp)
    return out.reshape(shape)


@dataclass
class Projection:
    """The sparse projection of one batch of N tokens on the atoms of `support` (U tokens + the rest).

    logp [N, U + 1]: projected log-mass of each atom (= p's where the token is inside the region); y: [N].
    Inside the rest atom pi* keeps p's shape: pi*(v) = pi*(rest) p(v) / p(rest).
    """

    support: Support  # both policies on shared atoms (lp carries the gradient)
    logp: Tensor
    t: Tensor  # [N] interpolation parameter t* = 1 / (1 + eta*), 1 where inactive
    dual: DualSolution  # solver report: active, iters, converged, kl_before, kl_after (float64)
    eps: float  # the trust-region radius used

    @property
    def log_pi_y(self) -> Tensor:
        """[N] log pi*(y) of the sampled token (with gradient)."""
        return self.logp.gather(-1, self.support.y[:, None])[:, 0]

    def stats(self, valid: Tensor | None = None) -> dict[str, float]:
        """Scalar diagnostics over the rows where `valid` [N] is True (all rows by default)."""
        d = self.dual
        v = torch.ones_like(d.active) if valid is None else valid.bool()
        n = max(int(v.sum()), 1)
        act = d.active & v
        n_act = max(int(act.sum()), 1)

        def mean(x: Tensor, m: Tensor, k: int) -> Tensor:
            return torch.where(m, x.double(), 0.0).sum() / k

        def vmax(x: Tensor, m: Tensor) -> Tensor:
            return (
                torch.where(m, x.double(), -math.inf).max().clamp_min(0.0)
                if m.numel()
                else x.new_zeros((), dtype=torch.float64)
            )

        stats = {
            "kl_before_mean": mean(d.kl_before, v, n),
            "kl_before_max": vmax(d.kl_before, v),
            "kl_after_mean": mean(d.kl_after, v, n),
            "kl_after_max": vmax(d.kl_after, v),
            "frac_projected": act.sum().double() / n,
            "eta_mean": mean(d.eta, act, n_act),
            "eta_max": vmax(d.eta, act),
            "t_mean": mean(d.t, act, n_act),
            "iters_mean": mean(d.iters.double(), act, n_act),
            "iters_max": vmax(d.iters.double(), act),
            "frac_unconverged": (~d.converged & v).sum().double() / n,
            "residual_max": vmax((d.kl_after - self.eps).abs(), act),
            "support_size_mean": mean(self.support.mask[:, :-1].sum(-1).double(), v, n),
        }
        return dict(zip(stats, torch.stack(list(stats.values())).tolist(), strict=True))  # one copy to Python


def _interpolate(a: Tensor, b: Tensor, t: Tensor) -> Tensor:
    """The closed form log pi_t = b + t a - A(t) over the path's atoms, [N, U] (-inf on atoms without p- or
    q-mass); gradients reach a and t only through atoms with mass, so no 0 * inf appears in backward."""
    a_path, b_path = path_atoms(a, b)
    s = b_path + t[:, None] * a_path
    return s - torch.logsumexp(s, dim=-1, keepdim=True)


def atoms(s: Support) -> tuple[Tensor, Tensor]:
    """The dual's atoms: a = log p-mass - log q-mass, b = log q-mass, both [N, U + 1]; dead atoms: a = 0, b = -inf.

    For an atom of several tokens whose two policies are proportional inside it (the paper's tail; the rest atom
    after projection) the ratio of masses is the ratio of every member, so the dual of section 1 is unchanged.
    """
    a = torch.where(s.mask, s.lp - s.lq, 0.0)
    b = s.lq.masked_fill(~s.mask, -math.inf)
    return a, b


def project_sparse(s: Support, eps: float, detach_dual: bool = False) -> Projection:
    """Project p onto the KL ball of radius eps around q, atom by atom of the support `s` (sparse.build_support)."""
    check_eps(eps)  # a public entry: a NaN radius would otherwise project nothing, silently
    a, b = atoms(s)
    t, sol = solve_t(a, b, eps, detach_dual)
    logp = s.lp  # inside the region pi* = p
    rows = sol.active.nonzero().squeeze(-1)
    if rows.numel():  # the closed form, built only on the rows outside the region (few, once trained)
        proj = _interpolate(a[rows], b[rows], t[rows])
        proj = torch.where(s.mask[rows], proj, 0.0)
        logp = logp.index_put((rows,), proj)
    return Projection(support=s, logp=logp, t=t, dual=sol, eps=eps)


if __name__ == "__main__":  # python -m troll.project: the paper's three-token picture in numbers
    old = torch.tensor([0.70, 0.20, 0.10]).log()
    new = torch.tensor([0.10, 0.30, 0.60]).log()
    out = project_dense(new, old, eps=0.05)
    kl_old = (out.exp() * (out - old)).sum()
    print(f"old       {[round(x, 4) for x in old.exp().tolist()]}")
    print(
        f"new       {[round(x, 4) for x in new.exp().tolist()]}  KL(new||old) = {(new.exp() * (new - old)).sum():.3f}"
    )
    print(f"projected {[round(x, 4) for x in out.exp().tolist()]}  KL(projected||old) = {kl_old:.4f} (eps = 0.05)")
