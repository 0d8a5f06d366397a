"""How far one update may raise a token's probability: PPO's ratio clip against TROLL's KL ball
(docs/algorithm.md, section 11).

A token y at old probability q (a tensor of any shape, values in (0, 1)) and its new probability x:

    ratio clip   x <= q (1 + eps_clip)                               (growth factor 1 + eps_clip for every q)
    KL ball      x <= x*(q, eps) = the largest x in [q, 1] with  kl_bern(x, q) <= eps,
                 kl_bern(x, q) = x log(x / q) + (1 - x) log((1 - x) / (1 - q))

The KL bound is the most a token can gain inside KL(pi || q) <= eps: for a given pi(y) = x the distribution
closest to q rescales every other token by (1 - x) / (1 - q), and its KL is kl_bern(x, q) (notebook 1); any other
way of moving the rest costs more. kl_bern(., q) increases on [q, 1] from 0 to -log q, so x* = 1 where
q >= exp(-eps) and otherwise the root of kl_bern(x, q) = eps. For small q, with x = q r,
kl_bern = q (r log r - r + 1) + O(x^2), so r log r - r + 1 = eps / q, i.e.

    x* ~ (eps - q) / W((eps / q - 1) / e)   ~   eps / log(eps / q)        (q -> 0; W: Lambert's W)

a growth factor x* / q of about (eps / q - 1) / W((eps / q - 1) / e): unbounded as q -> 0, where the clip allows
1 + eps_clip. At eps = 0.05 the root gives 8.1 at q = 0.005 and 129 at 1e-4, the Lambert-W form 8.2 and 129 (within
0.8%). The right-hand form's growth (eps / q) / log(eps / q) is only the leading order: 4.3 and 80 there (53% and
62% of the root), since W(z) = log z - log log z + ... and the log alone overstates the denominator unless q is far
smaller.

`kl_ball_growth` finds the root by bisection on log x in float64 (the function is monotone, so 200 halvings of
[log q, 0] pin it to float64 rounding); it takes the device from its input and keeps its shape.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

BISECTIONS = 200


def kl_bern(x: Tensor, q: Tensor) -> Tensor:
    """KL(Bernoulli(x) || Bernoulli(q)) elementwise, for x in [0, 1] and q in (0, 1); 0 log 0 = 0."""
    x, q = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(q, dtype=torch.float64)
    head = torch.where(x > 0, x * (x / q).log(), 0.0)
    tail = torch.where(x < 1, (1 - x) * ((1 - x) / (1 - q)).log(), 0.0)
    return head + tail


def _check(q: Tensor, eps: float, name: str) -> Tensor:
    q = torch.as_tensor(q, dtype=torch.float64)
    if not bool(((q > 0) & (q < 1)).all()):
        raise ValueError("q must hold probabilities in (0, 1)")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{name} must be a positive finite number, got {eps!r}")
    return q


def clip_growth(q: Tensor, eps_clip: float = 0.2) -> Tensor:
    """The most a ratio clip lets y's probability reach in one update: min(q (1 + eps_clip), 1), float64."""
    q = _check(q, eps_clip, "eps_clip")
    return (q * (1 + eps_clip)).clamp_max(1.0)


def kl_ball_growth(q: Tensor, eps: float = 0.05) -> Tensor:
    """The largest probability y can reach inside KL(pi || q) <= eps: x* of the module docstring, float64, q's shape."""
    q = _check(q, eps, "eps")
    lo, hi = q.log(), torch.zeros_like(q)  # kl_bern(q, q) = 0 <= eps; the root, where there is one, lies above
    reach_one = -q.log() <= eps  # kl_bern(1, q) = -log q: all of the mass fits in the ball
    for _ in range(BISECTIONS):
        mid = 0.5 * (lo + hi)
        inside = kl_bern(mid.exp(), q) <= eps
        lo, hi = torch.where(inside, mid, lo), torch.where(inside, hi, mid)
    return torch.where(reach_one, 1.0, lo.exp())
