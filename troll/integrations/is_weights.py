"""TRL's sampler-correction modes as weights for troll.losses (docs/algorithm.md, 10f).

TROLLGRPOTrainer maps TRL's `vllm_importance_sampling_mode` to the constant weight w [B, T] on each token's policy
term, computed here from rho = q(y) / mu(y) and handed to the loss as `is_weight` (the trust region stays around q).
With floor f and cap c (0 <= f <= 1 <= c, so rho = 1 keeps weight 1) and R_i = prod_t rho_it over the real tokens
of response i:

    truncate           min(rho_t, c), raised to f: troll.weights.capped_weight (the plain loop's --is_cap), so
                       per response (GSPO's geometric mean) at level="sequence"
    token_truncate     clamp(rho_t, f, c) per token, at every level
    token_mask         rho_t if f <= rho_t <= c, else 0
    sequence_truncate  clamp(R_i, f, c) on every token of response i (the exact product, not GSPO's mean)
    sequence_mask      R_i if f <= R_i <= c, else 0

No TRL import: the modes are tested without it (tests/test_off_policy.py).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from troll.losses import LEVELS
from troll.weights import capped_weight, weight_metrics

IS_MODES = ("truncate", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def trl_is_weight(
    log_rho: Tensor,
    mask: Tensor,
    is_mode: str = "truncate",
    is_cap: float = math.inf,
    is_floor: float = 0.0,
    level: str = "token",
) -> tuple[Tensor, dict[str, float]]:
    """The weight w [B, T] of TRL's mode from log rho = log q(y) - log mu(y) [B, T] (padding never read), and its
    metrics (troll.weights.weight_metrics: is_frac_truncated counts the capped, floored and masked tokens)."""
    if is_mode not in IS_MODES:
        raise ValueError(f"unknown is_mode={is_mode!r}; choose from {IS_MODES}")
    if isinstance(is_cap, bool) or not isinstance(is_cap, (int, float)) or not is_cap >= 1:  # NaN fails >= 1
        raise ValueError(f"is_cap must be a number >= 1 (math.inf: no cap), got {is_cap!r}")
    if isinstance(is_floor, bool) or not isinstance(is_floor, (int, float)) or not 0 <= is_floor <= 1:
        raise ValueError(f"is_floor must be a number in [0, 1] (0: no floor), got {is_floor!r}")
    if level not in LEVELS:
        raise ValueError(f"unknown level={level!r}; choose from {LEVELS}")
    with torch.no_grad():
        if is_mode == "truncate":
            w, bounded = capped_weight(log_rho, mask, is_cap, level)
            bounded = bounded | (w < is_floor)  # w < f exactly where rho < f, as c >= 1 >= f
            w = w.clamp(min=is_floor)
        else:
            log_rho = torch.where(mask, log_rho, 0.0)
            if is_mode.startswith("sequence"):  # log R_i on every token of response i
                log_rho = (log_rho * mask.to(log_rho.dtype)).sum(-1, keepdim=True).expand_as(log_rho)
            rho = log_rho.exp()
            bounded = (rho > is_cap) | (rho < is_floor)
            w = rho.masked_fill(bounded, 0.0) if is_mode.endswith("mask") else rho.clamp(min=is_floor, max=is_cap)
    return w, weight_metrics(w, bounded, mask)
