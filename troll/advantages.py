"""Advantage estimators (docs/algorithm.md, section 7): one scalar per response, orthogonal to the trust region.

rewards [B] float, group [B] long (index of the prompt each response answers; ids in [0, G)) -> advantages [B]

    grpo          A_i = (r_i - mean_g r) / (std_g r + 1e-6)      std: unbiased; a group of size 1 gets 0
    dr_grpo       A_i =  r_i - mean_g r                          (no std; the loss must not length-normalise
                                                                  per sequence: use seq-mean-token-sum-norm)
    reinforce_pp  A_i = (d_i - mean_B d) / (std_B d + 1e-6),  d_i = r_i - mean_g r   (group baseline, then
                                                                  normalised over the whole batch)

A group whose rewards are all equal carries no signal and gets A = 0 exactly (never NaN); `has_signal` marks the
samples of the other groups (--filter_groups trains on those only: DAPO's dynamic sampling, troll.train).
GSPO uses GRPO's advantages with a sequence-level ratio; that is a loss mode (`level="sequence"` in losses.py),
not an estimator.
"""

from __future__ import annotations

import torch
from torch import Tensor

STD_EPS = 1e-6


def _groups(rewards: Tensor, group: Tensor) -> int:
    """The number of groups G, after checking that rewards and group are both [B] and every reward is finite."""
    if rewards.dim() != 1 or group.shape != rewards.shape:
        raise ValueError(f"rewards and group must both be [B]; got {tuple(rewards.shape)} and {tuple(group.shape)}")
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf")
    return int(group.max()) + 1 if group.numel() else 0


def _group_mean_std(rewards: Tensor, group: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-response group mean, unbiased group std and group size, each [B]."""
    n_groups = _groups(rewards, group)
    r = rewards.double()
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, torch.ones_like(r))
    total = torch.zeros_like(count).index_add_(0, group, r)
    mean = (total / count.clamp_min(1))[group]
    sq = torch.zeros_like(count).index_add_(0, group, (r - mean).square())
    var = sq / (count - 1).clamp_min(1)
    return mean, var.sqrt()[group], count[group]


def grpo(rewards: Tensor, group: Tensor) -> Tensor:
    mean, std, size = _group_mean_std(rewards, group)
    adv = (rewards.double() - mean) / (std + STD_EPS)
    return torch.where(size > 1, adv, 0.0).to(rewards.dtype)


def dr_grpo(rewards: Tensor, group: Tensor) -> Tensor:
    mean, _, _ = _group_mean_std(rewards, group)
    return (rewards.double() - mean).to(rewards.dtype)


def reinforce_pp(rewards: Tensor, group: Tensor) -> Tensor:
    mean, _, _ = _group_mean_std(rewards, group)
    d = rewards.double() - mean
    if d.numel() < 2:
        return torch.zeros_like(rewards)
    return ((d - d.mean()) / (d.std() + STD_EPS)).to(rewards.dtype)


def has_signal(rewards: Tensor, group: Tensor) -> Tensor:
    """[B] bool: each sample's group has rewards that differ (max > min), so its advantages can be other than 0."""
    n_groups = _groups(rewards, group)
    r = rewards.double()
    top = torch.full((n_groups,), -torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amax")
    low = torch.full((n_groups,), torch.inf, dtype=r.dtype).scatter_reduce(0, group, r, "amin")
    return (top > low)[group]


ESTIMATORS = {"grpo": grpo, "dr_grpo": dr_grpo, "reinforce_pp": reinforce_pp}


def advantages(name: str, rewards: Tensor, group: Tensor) -> Tensor:
    """Dispatch by name: one of ESTIMATORS."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose from {sorted(ESTIMATORS)}")
    return ESTIMATORS[name](rewards, group)
