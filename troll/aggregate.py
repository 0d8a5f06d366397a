"""How a loss reduces per-token values x [B, T] over the real tokens (mask [B, T] bool) to one scalar
(docs/algorithm.md, section 5):

    token-mean               sum(x m) / sum(m)
    seq-mean-token-mean      mean_i(sum_t(x m) / sum_t(m))
    seq-mean-token-sum-norm  mean_i(sum_t(x m) / T_norm)        (Dr.GRPO; T_norm = norm_len, or T)

with mean_i over the responses that have a real token. `aggregate_count` is what each mode divides by, so a batch
split into micro-batches sums to the whole's aggregate (troll.train); `response_mean` is one response's mean over its
real tokens, [B, T] -> [B, 1] (GSPO's per-sequence ratio, and the off-policy weight per sequence: troll.weights).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# the aggregation an unset agg takes, by level: a mean over tokens per token (GRPO / DAPO as TRL and verl default);
# GSPO's (1 / G) sum_i per sequence (GSPO paper, J_GSPO; verl's compute_policy_loss_gspo hard-codes it)
DEFAULT_AGG = {"token": "token-mean", "sequence": "seq-mean-token-mean"}


def aggregate(x: Tensor, mask: Tensor, mode: str = "token-mean", norm_len: int | None = None) -> Tensor:
    """Reduce per-token values x [B, T] over the real tokens (mask [B, T] bool) to a scalar.

    The per-sequence modes average over the sequences with at least one real token (as verl's agg_loss): an empty
    response neither adds a term nor counts in the denominator. No real token at all gives 0 (zero gradient).
    Values at masked positions are never read, so padding may hold anything, inf or NaN included.
    """
    if x.shape != mask.shape or x.dim() != 2:
        raise ValueError(f"x and mask must both be [B, T]; got {tuple(x.shape)} and {tuple(mask.shape)}")
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; choose from {AGGREGATIONS}")
    if norm_len is not None and (isinstance(norm_len, bool) or not isinstance(norm_len, int) or norm_len < 1):
        raise ValueError(f"norm_len must be a positive integer or None, got {norm_len!r}")
    mask = mask.bool()
    per_seq = torch.where(mask, x, 0.0).sum(-1)  # [B]
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(-1).clamp_min(1)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / (norm_len or max(x.shape[-1], 1))
    return per_seq.sum() / aggregate_count(mask, mode).clamp_min(1)


def aggregate_count(mask: Tensor, mode: str = "token-mean") -> Tensor:
    """What `aggregate` divides by for mask [B, T] (a long scalar): the real tokens (token-mean), or the responses
    with at least one real token (the per-sequence modes). Rows split into parts, the aggregate of the whole is the
    sum of each part's aggregate times count(part) / count(whole) (troll.train's micro-batches)."""
    mask = mask.bool()
    return mask.sum() if mode == "token-mean" else mask.any(-1).sum()


def default_agg(level: str) -> str:
    """The aggregation an unset `agg` takes at `level` (DEFAULT_AGG; an unknown level is refused later, naming it)."""
    return DEFAULT_AGG.get(level, "token-mean")


def response_mean(x: Tensor, mask: Tensor) -> Tensor:
    """mean_t x over each response's real tokens, [B, T] -> [B, 1] (0 for an empty response)."""
    m = mask.to(x.dtype)
    return (x * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
