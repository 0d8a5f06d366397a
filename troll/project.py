"""The token-level KL trust-region projection, dense (reference) and sparse (what training uses).

For each token with current policy p (log-probs l_p, with gradient) and old policy q (l_q, a constant):

    pi* = argmin_pi KL(pi || p)  s.t.  KL(pi || q) <= eps
        = p                                               if KL(p || q) <= eps   (inside: identity)
        = q^(1-t*) p^t* / Z,  t* = 1/(1+eta*) with KL(pi* || q) = eps             otherwise

    log pi*(v) = l_q(v) + t* a(v) - A(t*),   a = l_p - l_q,   A(t) = logsumexp(l_q + t a)

t* comes from `dual.solve_dual` (float64, no autograd) and receives its exact implicit gradient from
`dual.ImplicitT`, so autograd through the closed form above gives d pi* / d l_p exactly.
`detach_dual=True` drops the gradient through t* (the shortcut some ports take) to show its effect.

Shapes: `project_dense`: [..., V] -> [..., V]. `project_sparse`: a `Support` of N rows and U slots
(see sparse.py) -> projected log-probs [N, U] on the slots and [N] for each tail entry.

Precision: float64 inputs give |KL(pi* || q) - eps| <= 1e-9 on active tokens. For lower precision the
solver aims a hair inside the ball (eps - 2e-6, to 1e-9) and t* is rounded down, so float32 results land in
[eps - 1e-5, eps + 1e-6]; bf16/fp16 inputs are computed in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from troll.dual import DualSolution, ImplicitT, solve_dual
from troll.sparse import SparseDist, Support, compute_dtype, union

FLOAT32_MARGIN = 2e-6
FLOAT32_TOL = 1e-9  # solver tolerance below float64: float32 log-probs carry ~1e-7 of KL rounding anyway


def _check_eps(eps: float) -> None:
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")


def solve_t(a: Tensor, b: Tensor, eps: float, detach_dual: bool = False) -> tuple[Tensor, DualSolution]:
    """Solve the dual on atoms (a, b): [N, U] and return t* [N] in a's dtype, with its implicit gradient.

    For float64 the solver targets eps exactly (to 1e-12); otherwise eps - FLOAT32_MARGIN to FLOAT32_TOL, and
    t* is rounded down so the rounding can only move the result further inside the trust region.
    """
    _check_eps(eps)
    exact = a.dtype == torch.float64
    target = eps if exact else max(eps - FLOAT32_MARGIN, 0.5 * eps)
    sol = solve_dual(a.detach(), b.detach(), target, tol=1e-12 if exact else FLOAT32_TOL)
    t = sol.t.to(a.dtype)
    t = torch.where(t.double() > sol.t, torch.nextafter(t, torch.zeros_like(t)), t)
    if not detach_dual:
        t = ImplicitT.apply(t, a, b, sol.active)
    return t, sol


def project_dense(logp_new: Tensor, logp_old: Tensor, eps: float, detach_dual: bool = False) -> Tensor:
    """Exact projection over the full vocabulary: [..., V] log-probs (or logits) in, log-probs out.

    Differentiable with respect to `logp_new`; `logp_old` is a constant. -inf marks masked tokens and must
    sit on the same entries in both inputs.
    """
    if logp_new.shape != logp_old.shape:
        raise ValueError(f"logp_new {tuple(logp_new.shape)} and logp_old {tuple(logp_old.shape)} differ in shape")
    shape = logp_new.shape
    dtype = compute_dtype(torch.promote_types(logp_new.dtype, logp_old.dtype))
    lp = logp_new.reshape(-1, shape[-1]).to(dtype)
    lq = logp_old.reshape(-1, shape[-1]).to(dtype).detach()
    for name, x in (("logp_new", lp), ("logp_old", lq)):
        if torch.isnan(x).any() or (x == math.inf).any():
            raise ValueError(f"{name} contains NaN or +inf")
        if (x == -math.inf).all(-1).any():
            raise ValueError(f"{name} has a row with no finite entry (zero probability everywhere)")
    live = torch.isfinite(lq)
    if not torch.equal(live, torch.isfinite(lp)):
        raise ValueError("logp_new and logp_old must put -inf (masked tokens) on the same entries")
    lp = lp - torch.logsumexp(lp, dim=-1, keepdim=True)
    lq = lq - torch.logsumexp(lq, dim=-1, keepdim=True)
    a = torch.where(live, lp - lq, 0.0)
    b = lq
    t, sol = solve_t(a, b, eps, detach_dual)
    s = b + t[:, None] * a
    out = torch.where(sol.active[:, None], s - torch.logsumexp(s, dim=-1, keepdim=True), lp)
    return out.reshape(shape)


@dataclass
class Projection:
    """The sparse projection of one batch of N tokens. logp: [N, U]; tail_logp, t, ...: [N]."""

    support: Support  # both policies on the union support (lp carries the gradient)
    logp: Tensor  # projected log-prob of each slot (tail value where ~support.mask)
    tail_logp: Tensor  # projected log-prob of each of the tail_count tail entries
    t: Tensor  # interpolation parameter t* = 1 / (1 + eta*), 1 where inactive
    dual: DualSolution  # solver report: active, iters, converged, kl_before, kl_after (float64)
    eps: float  # the trust-region radius used

    def at(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """log pi*(y), log p(y), log q(y) for token ids [N] (each [N]; the first two carry gradient)."""
        pos = self.support.position(tokens)[:, None]
        s = self.support
        return self.logp.gather(-1, pos)[:, 0], s.lp.gather(-1, pos)[:, 0], s.lq.gather(-1, pos)[:, 0]

    def stats(self, valid: Tensor | None = None) -> dict[str, float]:
        """Scalar diagnostics over the rows where `valid` [N] is True (all rows by default)."""
        d = self.dual
        v = torch.ones_like(d.active) if valid is None else valid.bool()
        n = max(int(v.sum()), 1)
        act = d.active & v
        n_act = max(int(act.sum()), 1)

        def mean(x: Tensor, m: Tensor, k: int) -> float:
            return float(torch.where(m, x.double(), 0.0).sum() / k)

        def vmax(x: Tensor, m: Tensor) -> float:
            return float(torch.where(m, x.double(), -math.inf).max()) if bool(m.any()) else 0.0

        return {
            "kl_before_mean": mean(d.kl_before, v, n),
            "kl_before_max": vmax(d.kl_before, v),
            "kl_after_mean": mean(d.kl_after, v, n),
            "kl_after_max": vmax(d.kl_after, v),
            "frac_projected": float(act.sum()) / n,
            "eta_mean": mean(d.eta, act, n_act),
            "eta_max": vmax(d.eta, act),
            "t_mean": mean(d.t, act, n_act),
            "iters_mean": mean(d.iters.double(), act, n_act),
            "iters_max": vmax(d.iters.double(), act),
            "frac_unconverged": float((~d.converged & v).sum()) / n,
            "residual_max": vmax((d.kl_after - self.eps).abs(), act),
            "support_size_mean": mean(self.support.mask.sum(-1).double(), v, n),
        }


def atoms(s: Support) -> tuple[Tensor, Tensor]:
    """The dual's atoms for a union support: the U slots plus one tail atom of multiplicity tail_count.

    Returns a, b: [N, U + 1] (a = l_p - l_q per element, b = log q-mass of the atom; -inf = padding).
    """
    count = s.tail_count.to(s.lq.dtype)
    b_tail = torch.where(count > 0, torch.log(count) + s.lq_tail, -math.inf)
    a = torch.cat([torch.where(s.mask, s.lp - s.lq, 0.0), (s.lp_tail - s.lq_tail)[:, None]], -1)
    b = torch.cat([s.lq.masked_fill(~s.mask, -math.inf), b_tail[:, None]], -1)
    return a, b


def project_sparse(new: SparseDist, old: SparseDist, eps: float, detach_dual: bool = False) -> Projection:
    """Project the current policy `new` onto the KL ball around `old` on their union support."""
    s = union(new, old)
    a, b = atoms(s)
    t, sol = solve_t(a, b, eps, detach_dual)
    logp, tail = s.lp, s.lp_tail  # inside the region pi* = p (masked slots already hold the tail value)
    rows = sol.active.nonzero().squeeze(-1)
    if rows.numel():  # the closed form, built only on the rows outside the region (few, once trained)
        ta = t[rows, None] * a[rows]
        log_z = torch.logsumexp(b[rows] + ta, dim=-1, keepdim=True)
        tail_r = s.lq_tail[rows, None] + ta[:, -1:] - log_z
        logp = logp.index_put((rows,), torch.where(s.mask[rows], s.lq[rows] + ta[:, :-1] - log_z, tail_r))
        tail = tail.index_put((rows,), tail_r[:, 0])
    return Projection(support=s, logp=logp, tail_logp=tail, t=t, dual=sol, eps=eps)


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
