"""The off-policy weight (docs/algorithm.md, section 10b): data sampled by a policy mu other than the old policy q
(stale rollouts, a bf16 sampler) weighs each token's policy term by the constant

    w = sg(min(rho, cap)),   rho = q(y) / mu(y)                        per token, [B, T]
                             rho_i = exp(mean_t log rho_t)             per response at level="sequence" (GSPO's)

while the trust region stays around q. `capped_weight` makes w from log rho; `weight_metrics` reports it
(is_weight_mean / is_weight_max, is_frac_truncated); `check_weight` refuses unusable inputs, naming the argument;
`weigh` applies it, or leaves the term as it is, bit for bit, without one. troll.losses takes either behaviour_logp
(log mu(y) [B, T], made into w here) or a weight made elsewhere (`is_weight`: TRL's modes, troll.integrations).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from troll.aggregate import aggregate, response_mean


def capped_weight(log_rho: Tensor, mask: Tensor, cap: float = math.inf, level: str = "token") -> tuple[Tensor, Tensor]:
    """The plain loop's IS weight w = min(rho, cap) [B, T] from log rho = log q(y) - log mu(y) [B, T] (padding never
    read), per response at level="sequence" (rho_i = exp(mean_t log rho_t), GSPO's ratio), and where the cap binds
    ([B, T] bool). A capped weight is the cap exactly. No gradient."""
    with torch.no_grad():
        log_rho = torch.where(mask, log_rho, 0.0)
        if level == "sequence":
            log_rho = response_mean(log_rho, mask).expand_as(log_rho)
        rho = log_rho.exp()
        return rho.clamp(max=cap), rho > cap


def weight_metrics(w: Tensor, bounded: Tensor, mask: Tensor) -> dict[str, float]:
    """is_weight_mean / is_weight_max of the weight w [B, T] over the real tokens, and is_frac_truncated: the share
    of real tokens whose ratio was bounded (bounded [B, T] bool: capped, floored or masked)."""
    real = w[mask].double()
    mean, top = (float(real.mean()), float(real.max())) if real.numel() else (1.0, 1.0)
    frac = float(aggregate(bounded.to(w.dtype), mask))
    return {"is_weight_mean": mean, "is_weight_max": top, "is_frac_truncated": frac}


def check_weight(behaviour_logp: Tensor | None, is_cap: float, is_weight: Tensor | None, mask: Tensor) -> None:
    """Refuse an unusable behaviour log-prob or weight [B, T], or cap, naming the argument."""
    if isinstance(is_cap, bool) or not isinstance(is_cap, (int, float)) or not is_cap >= 1:  # NaN fails >= 1
        raise ValueError(f"is_cap must be a number >= 1 (math.inf: no truncation), got {is_cap!r}")
    if behaviour_logp is None and is_cap != math.inf:
        raise ValueError(f"is_cap={is_cap!r} caps the IS weight q(y) / mu(y), which needs behaviour_logp (got None)")
    if behaviour_logp is not None and is_weight is not None:
        raise ValueError("behaviour_logp and is_weight each give the IS weight; pass one of them")
    for name, x in (("behaviour_logp", behaviour_logp), ("is_weight", is_weight)):
        if x is None:
            continue
        if not isinstance(x, Tensor) or not x.is_floating_point():
            got = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"{name} must be a float tensor [B, T], got {got}")
        if x.shape != mask.shape:
            raise ValueError(f"{name} must have the shape of tokens {tuple(mask.shape)}, got {tuple(x.shape)}")
        if not bool(torch.isfinite(x[mask]).all()):
            raise ValueError(f"{name} contains NaN or inf on a real token")
    if is_weight is not None and bool((is_weight[mask] < 0).any()):
        raise ValueError("is_weight is negative on a real token (a weight is >= 0)")


def weigh(x: Tensor, w: Tensor | None) -> Tensor:
    """x [B, T] times the IS weight w [B, T]; x itself (the same tensor, bit for bit) without one."""
    return x if w is None else w * x
