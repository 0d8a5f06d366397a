"""The dual variable of the KL-ball projection, its solver, and its implicit gradient.

Per token (one row) the projection works on U "atoms" (vocabulary entries, or a group of equal entries
such as the sparse tail), each described by two numbers:

    b_j = log q-mass of atom j          (-inf marks padding: the atom does not exist)
    a_j = log p(v) - log q(v)           for any element v of atom j (0 on padding)

The projection  pi* = argmin KL(pi || p)  s.t.  KL(pi || q) <= eps  is the geometric interpolation

    log pi_t(v) = log q(v) + t * a(v) - A(t),      A(t) = logsumexp_j(b_j + t * a_j),

with t = 1 / (1 + eta) in (0, 1] and eta >= 0 the dual variable (docs/algorithm.md, sections 1-2). This is an
exponential family in t, so with E_t, Var_t taken under the atom masses pi_t(j) = exp(b_j + t a_j - A(t)):

    KL(pi_t || q) = t * E_t[a] - A(t) + A(0),        d/dt KL(pi_t || q) = t * Var_t[a] >= 0.

(A(0) = logsumexp(b) is q's log-normaliser; keeping it makes every formula exact for unnormalised q.)
KL is increasing in t, so t* is the root of f(t) = KL(pi_t || q) - eps on (0, 1]; tokens with
KL(p || q) <= eps are inside the region and keep t = 1 (eta = 0).

Solver choices (all batched over rows, no Python loop over tokens, no autograd):
- arithmetic in float64: the arrays are [N, U] with U <= 2K + 2, tiny next to the [N, V] logits;
- Newton on log KL as a function of log t (near t = 0, KL ~ t^2 Var_q / 2, so this is almost linear),
  started at t0 = sqrt(eps / KL(p || q)) (exact in that quadratic regime), safeguarded by a bracket
  [lo, hi] that always holds the root; a step leaving the bracket is replaced by bisection;
- stop when |f(t)| <= tol (default 1e-12) or the bracket has shrunk to a few ulps; report per row the
  iterations, convergence and the residual KL(pi_t || q) - eps.

Implicit gradient (implicit function theorem on F(t, a) = KL(pi_t || q) - eps = 0):

    dt*/da_j = -t * pi_t(j) * (a_j - E_t[a]) / Var_t[a]          (0 for inactive rows)

`ImplicitT` attaches exactly this to a solved t; a constant added to all a_j changes nothing.
Shapes: a, b: [N, U]; everything per row: [N].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class DualSolution:
    """Result of `solve_dual`, one entry per row. All float tensors are float64."""

    t: Tensor  # [N] in (0, 1]; exactly 1.0 where inactive
    active: Tensor  # [N] bool: KL(p || q) > eps, so the constraint binds
    iters: Tensor  # [N] long: Newton/bisection steps taken (0 where inactive)
    converged: Tensor  # [N] bool
    kl_before: Tensor  # [N] KL(p || q)
    kl_after: Tensor  # [N] KL(pi_t || q)

    @property
    def eta(self) -> Tensor:
        """[N] the dual variable eta = 1/t - 1 (0 where inactive)."""
        return 1.0 / self.t - 1.0


def _path(a: Tensor, b: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """exp(b + t a - max) [N, U] (pi_t up to the factor z, in a fresh buffer the caller may overwrite), z and
    A(t) = log Z(t), [N] each: a logsumexp that keeps its exponentials, with no other [N, U] temporaries."""
    s = torch.addcmul(b, t[:, None], a)
    top = s.amax(-1)
    e = s.sub_(top[:, None]).exp_()
    z = e.sum(-1)
    return e, z, top + z.log()


def _moments(a: Tensor, b: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Atom masses pi_t [N, U], A(t), E_t[a], Var_t[a] ([N] each) for t: [N]."""
    e, z, log_z = _path(a, b, t)
    w = e.div_(z[:, None])
    mean = (w * a).sum(-1)
    var = (a - mean[:, None]).square_().mul_(w).sum(-1)
    return w, log_z, mean, var


def kl_along_path(a: Tensor, b: Tensor, t: Tensor) -> Tensor:
    """KL(pi_t || q) for each row ([N]) at the interpolation parameter t: [N]."""
    _, log_z, mean, _ = _moments(a, b, t)
    return t * mean - log_z + torch.logsumexp(b, dim=-1)


def check_eps(eps: float) -> None:
    """The trust-region radius must be a positive finite number."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")


@torch.no_grad()
def solve_dual(a: Tensor, b: Tensor, eps: float, *, max_iter: int = 50, tol: float = 1e-12) -> DualSolution:
    """Find t* with KL(pi_t* || q) = eps on active rows (see module docstring). a, b: [N, U]."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"a and b must both be [N, U]; got {tuple(a.shape)} and {tuple(b.shape)}")
    check_eps(eps)
    a, b = a.double(), b.double()
    one = torch.ones(a.shape[0], dtype=a.dtype, device=a.device)
    log_z0 = torch.logsumexp(b, dim=-1)
    kl_before = _kl_and_slope(a, b, log_z0, one)[0]
    active = kl_before > eps
    t, iters, kl_after = one.clone(), torch.zeros_like(one, dtype=torch.long), kl_before.clone()
    converged = torch.ones_like(active)
    rows = active.nonzero().squeeze(-1)  # only tokens outside the region are solved for
    if rows.numel():
        sub = _newton(a[rows], b[rows], log_z0[rows], kl_before[rows], eps, max_iter, tol)
        t[rows], iters[rows], converged[rows], kl_after[rows] = sub
    return DualSolution(t=t, active=active, iters=iters, converged=converged, kl_before=kl_before, kl_after=kl_after)


def _kl_and_slope(a: Tensor, b: Tensor, log_z0: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
    """KL(pi_t || q) and its derivative t * Var_t[a], each [N]: the solver's inner loop, in 9 passes over
    [N, U]. The slope takes Var = E[a^2] - E[a]^2 (no centring pass); it only sizes the Newton step, whose
    bracket and stopping rule use the KL itself, so its rounding cannot change the root."""
    e, z, log_z = _path(a, b, t)
    ea = e.mul_(a)
    mean = ea.sum(-1) / z
    second = ea.mul_(a).sum(-1) / z
    return t * mean - log_z + log_z0, t * (second - mean * mean).clamp_min(0.0)


def _newton(
    a: Tensor, b: Tensor, log_z0: Tensor, kl1: Tensor, eps: float, max_iter: int, tol: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Safeguarded Newton on log KL vs log t for rows that are all active. Returns t, iters, converged, KL."""
    lo, hi = torch.zeros_like(kl1), torch.ones_like(kl1)
    t = (eps / kl1).sqrt()  # exact where KL ~ t^2 Var / 2
    iters = torch.zeros_like(kl1, dtype=torch.long)
    done = torch.zeros_like(kl1, dtype=torch.bool)
    tiny, ulp = torch.finfo(t.dtype).tiny, torch.finfo(t.dtype).eps
    for _ in range(max_iter):
        kl, slope = _kl_and_slope(a, b, log_z0, t)
        ft = kl - eps
        iters += (~done).long()
        done = done | (ft.abs() <= tol)
        hi = torch.where(~done & (ft > 0), t, hi)
        lo = torch.where(~done & (ft <= 0), t, lo)
        done = done | (hi - lo <= 4 * ulp * hi)
        if bool(done.all()):
            return t, iters, done, kl  # every row's t was just evaluated
        # Newton on log KL vs log t: log t_new = log t - (log KL - log eps) * KL / (t * dKL/dt).
        kl = kl.clamp_min(tiny)
        t_newton = t * torch.exp(-(kl.log() - math.log(eps)) * kl / (t * slope))
        ok = torch.isfinite(t_newton) & (t_newton > lo) & (t_newton < hi)
        t = torch.where(done, t, torch.where(ok, t_newton, 0.5 * (lo + hi)))
    kl, _ = _kl_and_slope(a, b, log_z0, t)  # max_iter reached: evaluate the last step
    return t, iters, done, kl


class ImplicitT(torch.autograd.Function):
    """Identity on a solved t in the forward pass; the implicit-function gradient in the backward pass.

    forward(t [N], a [N, U], b [N, U], active [N] bool) -> t [N]
    backward: dL/da_j = dL/dt * (-t * pi_t(j) * (a_j - E_t[a]) / Var_t[a]) on active rows, else 0.
    b (the old policy) is treated as a constant.
    """

    @staticmethod
    def forward(ctx, t: Tensor, a: Tensor, b: Tensor, active: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(t, a, b, active)
        return t.clone()

    @staticmethod
    def backward(ctx, grad_t: Tensor):  # type: ignore[override]
        t, a, b, active = ctx.saved_tensors
        grad_a = torch.zeros_like(a)
        rows = active.nonzero().squeeze(-1)  # t is constant (= 1) on inactive rows
        if rows.numel():
            a_r, t_r = a[rows], t[rows]
            w, _, mean, var = _moments(a_r, b[rows], t_r)
            coef = -grad_t[rows] * t_r / var.clamp_min(torch.finfo(var.dtype).tiny)
            grad_a[rows] = coef[:, None] * w * (a_r - mean[:, None])
        return None, grad_a, None, None
