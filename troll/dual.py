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

An atom where p has no mass but q has some (a_j = -inf) gets none along the path either (t > 0): pi* must give it
zero mass, else KL(pi* || p) is infinite. The path then runs over the other atoms S, and KL(pi_t || q) starts at
-log q(S) > 0 for t -> 0, so the problem has a solution only where q(S) > exp(-eps); other rows are refused.
`path_atoms` drops such atoms (a = 0, b = -inf) while the KL keeps q's full normaliser A(0).

Solver choices (all batched over rows, no Python loop over tokens, no autograd):
- arithmetic in float64: the arrays are [N, U] with U <= 2K + 2, tiny next to the [N, V] logits;
- Newton on log(KL - KL(0+)) as a function of log t (near t = 0 the excess is ~ t^2 Var_q / 2, so this is almost
  linear), started at t0 = sqrt(eps / KL(p || q)) (exact in that quadratic regime), safeguarded by a bracket
  [lo, hi] that always holds the root; a step leaving the bracket is replaced by bisection in log t;
- the bracket starts at lo = sqrt(8 (eps - KL(0+))) / (max a - min a) (Popoviciu: Var_t[a] <= range^2 / 4, so
  KL(pi_lo || q) <= eps), so a root at t ~ 1e-20 (logits of 1e20) is reached in a few log-bisections;
- stop when |f(t)| <= rtol * eps (relative, so a tiny eps is met as tightly as a large one) or the bracket has
  shrunk to a few ulps; in the latter case return lo, whose KL is at most eps. Reported per row: iterations,
  convergence and KL(pi_t || q). Guarantee: |KL(pi_t* || q) - eps| <= rtol * eps + (float64 rounding of the KL,
  about 1e-16 * max|log q|), i.e. KL <= eps (1 + 1e-3) for eps down to 1e-12.

Inputs without a defined answer raise ValueError: NaN or +inf in a or b, a row with no atom, or a row where p
gives no mass to more than 1 - exp(-eps) of q.

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


def path_atoms(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """The atoms the path runs on, [N, U] each: an atom where p has no mass (a = -inf) has none along the path for
    t > 0, so it is dropped (a = 0, b = -inf); every other atom is kept as it is."""
    dead = a == -math.inf
    return a.masked_fill(dead, 0.0), b.masked_fill(dead, -math.inf)


def kl_along_path(a: Tensor, b: Tensor, t: Tensor) -> Tensor:
    """KL(pi_t || q) for each row ([N]) at the interpolation parameter t: [N] (t > 0)."""
    log_z0 = torch.logsumexp(b, dim=-1)
    a, b = path_atoms(a, b)
    _, log_z, mean, _ = _moments(a, b, t)
    return t * mean - log_z + log_z0


def _rows(bad: Tensor) -> str:
    """The first few row indices where bad [N] is True, for error messages."""
    return f"rows {torch.nonzero(bad)[:5, 0].tolist()}"


@torch.no_grad()
def solve_dual(a: Tensor, b: Tensor, eps: float, *, max_iter: int = 50, rtol: float = 1e-11) -> DualSolution:
    """Find t* with KL(pi_t* || q) = eps (to rtol * eps) on active rows (see module docstring). a, b: [N, U]; eps
    a positive finite number, not checked here: the caller checks it (troll.project.check_eps)."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"a and b must both be [N, U]; got {tuple(a.shape)} and {tuple(b.shape)}")
    if not (a.dtype.is_floating_point and b.dtype.is_floating_point):
        raise ValueError(f"a and b must be floating point, got {a.dtype} and {b.dtype}")
    if not (isinstance(rtol, float) and 0 < rtol < 1):
        raise ValueError(f"rtol must be a float in (0, 1), got {rtol!r}")
    a, b = a.double(), b.double()
    log_z0 = torch.logsumexp(b, dim=-1)  # q's normaliser, over every atom
    # A row sum is NaN or +inf exactly where the row holds NaN or +inf (-inf alone gives -inf): one pass each.
    sum_a, sum_b = a.sum(-1), b.sum(-1)
    bad_a, bad_b = torch.isnan(sum_a) | (sum_a == math.inf), torch.isnan(sum_b) | (sum_b == math.inf)
    dead = (a == -math.inf).any(-1)  # rows where p has no mass on some atom
    flags = torch.stack([bad_a, bad_b, log_z0 == -math.inf, dead]).any(-1).tolist()  # one device sync
    if flags[0]:
        raise ValueError(f"a (log p - log q) contains NaN or +inf ({_rows(bad_a)})")
    if flags[1]:
        raise ValueError(f"b (log q) contains NaN or +inf ({_rows(bad_b)})")
    if flags[2]:
        raise ValueError(f"b (log q) has a row with no finite entry: q has no mass ({_rows(log_z0 == -math.inf)})")
    gap = torch.zeros_like(log_z0)  # KL(pi_0+ || q) = -log q(atoms where p has mass)
    if flags[3]:
        a, b = path_atoms(a, b)
        gap = log_z0 - torch.logsumexp(b, dim=-1)
        if bool((gap >= eps).any()):
            raise ValueError(
                "p gives zero probability (a = -inf) to atoms holding more than 1 - exp(-eps) of q's mass "
                f"({_rows(gap >= eps)}): no distribution with finite KL to p lies within eps = {eps} of q"
            )
    one = torch.ones(a.shape[0], dtype=a.dtype, device=a.device)
    kl_before = _kl_and_slope(a, b, log_z0, one)[0]
    active = kl_before > eps
    t, iters, kl_after = one.clone(), torch.zeros_like(one, dtype=torch.long), kl_before.clone()
    converged = torch.ones_like(active)
    rows = active.nonzero().squeeze(-1)  # only tokens outside the region are solved for
    if rows.numel():
        sub = _newton(a[rows], b[rows], log_z0[rows], gap[rows], kl_before[rows], eps, max_iter, rtol * eps)
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
    a: Tensor, b: Tensor, log_z0: Tensor, gap: Tensor, kl1: Tensor, eps: float, max_iter: int, tol: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Safeguarded Newton on log(KL - gap) vs log t for rows that are all active (gap = KL(pi_0+ || q) < eps).
    Returns t, iters, converged, KL."""
    spread = a.amax(-1) - a.amin(-1)  # padding atoms' a only widens the range, which keeps the bound valid
    lo = (torch.sqrt(8 * (eps - gap)) / spread).clamp(max=1.0)  # KL(pi_lo || q) <= eps (Popoviciu)
    lo = torch.where(lo < 1.0, lo, 0.0)  # a bound of 1 only comes from rounding: bracket [0, 1] then
    hi = torch.ones_like(kl1)
    t = ((eps - gap) / (kl1 - gap)).sqrt().clamp(lo, hi)  # exact where KL - gap ~ t^2 Var / 2
    iters = torch.zeros_like(kl1, dtype=torch.long)
    done = torch.zeros_like(kl1, dtype=torch.bool)
    tight = torch.zeros_like(done)  # stopped by the bracket's width, not by |f| <= tol: return lo
    tiny, ulp = torch.finfo(t.dtype).tiny, torch.finfo(t.dtype).eps
    for _ in range(max_iter):
        kl, slope = _kl_and_slope(a, b, log_z0, t)
        ft = kl - eps
        iters += (~done).long()
        done = done | (ft.abs() <= tol)
        hi = torch.where(~done & (ft > 0), t, hi)
        lo = torch.where(~done & (ft <= 0), t, lo)
        tight = tight | (~done & (hi - lo <= 4 * ulp * hi))
        done = done | tight
        if bool(done.all()):
            break
        # Newton on log g vs log t, g = KL - gap: log t_new = log t - (log g - log(eps - gap)) * g / (t * dg/dt).
        g = (kl - gap).clamp_min(tiny)
        t_newton = t * torch.exp(-(g.log() - (eps - gap).log()) * g / (t * slope))
        ok = torch.isfinite(t_newton) & (t_newton > lo) & (t_newton < hi)
        mid = torch.where(lo > 0, (lo * hi).sqrt(), 0.5 * hi)  # bisection in log t
        t = torch.where(done, t, torch.where(ok, t_newton, mid))
    if bool(done.all()) and not bool(tight.any()):
        return t, iters, done, kl  # every row's t was just evaluated
    t = torch.where(tight, lo, t)  # f(lo) <= 0: the side of the root inside the ball
    kl, _ = _kl_and_slope(a, b, log_z0, t)  # evaluate the returned t (also where max_iter was reached)
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
        if rows.numel():  # in float64: Var_t[a] of float32 atoms can exceed float32's range (logits of 1e20)
            a_r, b_r = path_atoms(a[rows].double(), b[rows].double())  # atoms without p-mass: pi_t(j) = 0
            t_r = t[rows].double()
            w, _, mean, var = _moments(a_r, b_r, t_r)
            coef = -grad_t[rows].double() * t_r / var.clamp_min(torch.finfo(var.dtype).tiny)
            grad_a[rows] = (coef[:, None] * w * (a_r - mean[:, None])).to(a.dtype)
        return None, grad_a, None, None
