"""The TROLL objective and the baselines behind one signature (docs/algorithm.md, sections 4-6 and 10).

Every loss takes the same inputs and returns (loss, metrics):

    logits  [B, T, V]  current policy at the completion positions (temperature applied), with grad; or a
                       `head.LMHead` over hidden states [B, T, H] (chunked output layer, same values and gradients)
    tokens  [B, T]     sampled token ids
    mask    [B, T]     True on real completion tokens
    adv     [B]        one advantage per response (advantages.py)
    old     SparseDist over the B*T rows (row-major): q, the policy the trust region is anchored to (section 4)

`support` ("rest" or "paper", section 3) puts p and q on shared atoms; `k` and `delta` shape p's own support under
"paper" only. With r = p(y) / q(y) (exact over V), to minimise:

    troll_loss  agg(-A pi*(y) / q(y)) + alpha agg(KL(p || sg(pi*)))   pi*: p projected onto KL(. || q) <= eps
    ppo_clip    agg(-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A))  eps_*: CLIP_RANGE[level] unless given
    dppo        agg(-A sg(min(r, ratio_cap)) M log p(y))              M = 0 where the update leaves the region
    cispo       agg(-A sg(min(r, 1 + eps_high)) log p(y))             no trust region: the control

Each baseline's defaults and where they come from: section 6 (DPPO's thresholds and c = 10, GSPO's range, CISPO's 0.2;
c = 10 is the fallback in the authors' code, which their config's 3 overrides there).

`level="sequence"` (troll_loss, ppo_clip) is GSPO: s_i = exp(mean_t log r_t) in the straight-through token form
sg(s_i) r_t / sg(r_t); TROLL's r_t are the projected ratios. `agg` (the same for every term) reduces x [B, T]:

    token-mean               sum(x m) / sum(m)
    seq-mean-token-mean      mean_i(sum_t(x m) / sum_t(m))
    seq-mean-token-sum-norm  mean_i(sum_t(x m) / T_norm)        (Dr.GRPO; T_norm = norm_len, or T)

with mean_i over the responses that have a real token. `agg` left None is DEFAULT_AGG[level]: token-mean per token;
seq-mean-token-mean per sequence, so GSPO is its paper's mean over the responses, each once whatever its length
(a response's tokens all carry s_i, and the mean of their gradients is the gradient of s_i):

    ppo_clip  -mean_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    troll     -mean_i A_i s_i + alpha mean_i(mean_t KL(p || sg(pi*)))       s_i from the projected ratios

dppo and cispo have no sequence level: token-mean. Off-policy data (section 10b): `behaviour_logp` [B, T], the
sampler's log mu(y), weighs each token's policy term by the constant w = sg(min(q(y) / mu(y), is_cap)), per response
(GSPO's geometric mean) at level="sequence"; the trust region stays around q. `is_weight` [B, T] hands in another
weight instead (TRL's modes: troll.integrations.is_weights). Without either, every loss is as above bit for bit.

Metrics (floats, section 9): policy, regression, kl_before/after_mean/max, frac_active (tokens projected / clipped /
masked), ratio_mean/min/max, entropy, frac_no_signal, TROLL's dual_* solver stats, and with behaviour_logp
is_weight_mean/max and is_frac_truncated. Every input is checked; an error names the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from troll.aggregate import AGGREGATIONS, aggregate, default_agg, response_mean
from troll.project import check_eps, project_sparse
from troll.sparse import SUPPORTS, SparseDist, Support, atom_kl, build_support, check_k_delta, support_kl
from troll.weights import capped_weight, check_weight, weigh, weight_metrics

LEVELS = ("token", "sequence")
DPPO_THRESHOLDS = {"binary_tv": 0.15, "binary_kl": 0.05, "topk_tv": 0.15, "topk_kl": 0.05}
# DPPO's divergence thresholds as its authors ship them, and its ratio cap c: 10, the fallback of sail-sg/Stable-RL's
# config.get("clip_ratio_c", 10.0) (verl's: 20), which their config's own clip_ratio_c = 3.0 overrides; verl's DPPO
# example sets 10000, no cap in effect. Why 10 stays the default: docs/algorithm.md, section 6
DPPO_RATIO_CAP = 10.0
# PPO-clip's (eps_low, eps_high) by level: PPO's 0.2 per token; GSPO's paper (section 5.1) per sequence
CLIP_RANGE = {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4)}
LossOut = tuple[Tensor, dict[str, float]]


def _sequence_ratio(log_r: Tensor, mask: Tensor) -> Tensor:
    """GSPO's straight-through token ratio [B, T]: value exp(mean_t log r), gradient of each token's log r."""
    return torch.exp(response_mean(log_r, mask).detach() + log_r - log_r.detach())


def _support(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    support: str,
    k: int,
    delta: float,
    agg: str,
    level: str,
    behaviour_logp: Tensor | None,
    is_cap: float,
    is_weight: Tensor | None,
) -> tuple[Support, Tensor | None, dict[str, float]]:
    """Check the common inputs and put p and q on shared atoms over the B*T rows (sparse.build_support); with them
    the constant weight w [B, T] of each token's policy term and its metrics: the given is_weight (its metrics are
    its maker's), or capped_weight from behaviour_logp, or (None, {}) without either."""
    b, t = tokens.shape if tokens.dim() == 2 else (-1, -1)
    if len(logits.shape) != 3 or logits.shape[:2] != (b, t) or mask.shape != (b, t) or adv.shape != (b,):
        raise ValueError(
            f"expected logits [B, T, V], tokens/mask [B, T], adv [B]; got {tuple(logits.shape)}, "
            f"{tuple(tokens.shape)}, {tuple(mask.shape)}, {tuple(adv.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True on real tokens), got {mask.dtype}")
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("adv (advantages) contains NaN or inf")
    if agg not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation agg={agg!r}; choose from {AGGREGATIONS}")
    if level not in LEVELS:
        raise ValueError(f"unknown level={level!r}; choose from {LEVELS}")
    check_weight(behaviour_logp, is_cap, is_weight, mask)
    s = build_support(logits.reshape(b * t, logits.shape[-1]), tokens.reshape(-1), old, support, k, delta)
    if is_weight is not None:  # a weight made elsewhere (TRL's modes): its metrics are its maker's
        return s, is_weight.detach().to(s.lq_y.dtype), {}
    if behaviour_logp is None:
        return s, None, {}
    lq_y = s.lq_y.view(mask.shape)
    w, capped = capped_weight(lq_y - behaviour_logp.detach().to(lq_y.dtype), mask, is_cap, level)
    return s, w, weight_metrics(w, capped, mask)


def _masked_stats(x: Tensor, mask: Tensor, prefix: str) -> dict[str, float]:
    v = x.detach().double()[mask]
    if v.numel() == 0:
        return {f"{prefix}_mean": 0.0, f"{prefix}_min": 0.0, f"{prefix}_max": 0.0}
    return {f"{prefix}_mean": float(v.mean()), f"{prefix}_min": float(v.min()), f"{prefix}_max": float(v.max())}


def _common(s: Support, mask: Tensor, adv: Tensor) -> dict[str, float]:
    """Entropy of p, and the share of real tokens without signal (their response's advantage is exactly 0)."""
    silent = (adv == 0)[:, None].expand(mask.shape).to(s.entropy.dtype)
    entropy = aggregate(s.entropy.view(mask.shape), mask)
    return {"entropy": float(entropy), "frac_no_signal": float(aggregate(silent, mask))}


def _shared_metrics(s: Support, mask: Tensor, adv: Tensor) -> dict[str, float]:
    """`_common` and KL(p || q) over the atoms, for the baselines (kl_after = kl_before: nothing projected)."""
    with torch.no_grad():
        kl = _masked_stats(support_kl(s).view(mask.shape), mask, "kl_before")
    out = {"kl_before_mean": kl["kl_before_mean"], "kl_before_max": kl["kl_before_max"]}
    return _common(s, mask, adv) | out | {"kl_after_mean": kl["kl_before_mean"], "kl_after_max": kl["kl_before_max"]}


# ----------------------------------------------------------------------------- the losses


def check_troll_settings(eps: float, alpha: float, k: int, delta: float, support: str = "rest") -> None:
    """troll_loss's rules for its settings, a ValueError naming the first it refuses: what TROLLConfig checks when
    it is made, so a setting the loss would refuse at the first step is refused when it is given."""
    check_eps(eps)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    check_k_delta(k, delta)
    if support not in SUPPORTS:
        raise ValueError(f"support={support!r} is an unknown sparse model; choose from {SUPPORTS}")


def troll_loss(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    eps: float = 0.05,
    alpha: float = 1.0,
    support: str = "rest",
    k: int = 64,
    delta: float = 1e-5,
    agg: str | None = None,
    norm_len: int | None = None,
    level: str = "token",
    detach_dual: bool = False,
    behaviour_logp: Tensor | None = None,
    is_cap: float = math.inf,
    is_weight: Tensor | None = None,
) -> LossOut:
    """TROLL: importance ratio of the projected policy, plus the regression of p onto sg(pi*); with behaviour_logp
    (or is_weight) the ratio term is weighted by w = sg(min(q(y) / mu(y), is_cap)) (module docstring). agg left
    None is DEFAULT_AGG[level]: token-mean, or per sequence the mean over responses of both terms."""
    check_troll_settings(eps, alpha, k, delta, support)  # before any work (project_sparse checks eps again)
    agg = default_agg(level) if agg is None else agg
    s, w, is_metrics = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, level, behaviour_logp, is_cap, is_weight
    )
    proj = project_sparse(s, eps, detach_dual=detach_dual)
    log_r = (proj.log_pi_y - s.lq.gather(-1, s.y[:, None])[:, 0]).view(mask.shape)
    ratio = _sequence_ratio(log_r, mask) if level == "sequence" else log_r.exp()
    policy = aggregate(weigh(-adv[:, None] * ratio, w), mask, agg, norm_len)
    # an inactive token has pi* = p: its regression term is 0, and so is its gradient (not rounding noise of it)
    kl = torch.where(proj.dual.active, atom_kl(s.lp, proj.logp.detach(), s.mask), 0.0)
    regression = aggregate(kl.view(mask.shape), mask, agg, norm_len)
    stats = proj.stats(mask.reshape(-1))
    metrics = _common(s, mask, adv) | {key: val for key, val in stats.items() if key.startswith("kl_")}
    metrics |= {"policy": float(policy.detach()), "regression": float(regression.detach())}
    metrics |= {"frac_active": stats["frac_projected"]}
    metrics |= {f"dual_{key}": val for key, val in stats.items() if not key.startswith(("kl_", "frac_projected"))}
    return policy + alpha * regression, metrics | _masked_stats(ratio, mask, "ratio") | is_metrics


def ppo_clip(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    eps_low: float | None = None,
    eps_high: float | None = None,
    support: str = "rest",
    k: int = 64,
    delta: float = 1e-5,
    agg: str | None = None,
    norm_len: int | None = None,
    level: str = "token",
    behaviour_logp: Tensor | None = None,
    is_cap: float = math.inf,
    is_weight: Tensor | None = None,
) -> LossOut:
    """PPO's clipped surrogate; eps_high = 0.28 gives Clip-Higher. A range left None is CLIP_RANGE[level]'s: 0.2
    per token, GSPO's 3e-4 / 4e-4 per sequence; agg left None DEFAULT_AGG[level]'s: token-mean per token, GSPO's
    mean over responses (seq-mean-token-mean) per sequence. With behaviour_logp: w times it (module docstring)."""
    low, high = CLIP_RANGE.get(level, CLIP_RANGE["token"])
    eps_low, eps_high = low if eps_low is None else eps_low, high if eps_high is None else eps_high
    agg = default_agg(level) if agg is None else agg
    s, w, is_metrics = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, level, behaviour_logp, is_cap, is_weight
    )
    log_r = (s.lp_y - s.lq_y).view(mask.shape)
    ratio = _sequence_ratio(log_r, mask) if level == "sequence" else log_r.exp()
    a = adv[:, None]
    unclipped, clipped = ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a
    policy = aggregate(weigh(-torch.minimum(unclipped, clipped), w), mask, agg, norm_len)
    frac = aggregate((clipped < unclipped).to(ratio.dtype), mask)
    metrics = _shared_metrics(s, mask, adv) | {"policy": float(policy.detach()), "regression": 0.0}
    return policy, metrics | {"frac_active": float(frac)} | _masked_stats(ratio, mask, "ratio") | is_metrics


def _bernoulli_kl(p: Tensor, q: Tensor) -> Tensor:
    p, q = p.clamp(1e-12, 1 - 1e-12), q.clamp(1e-12, 1 - 1e-12)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def dppo_divergence(name: str, s: Support) -> Tensor:
    """DPPO's divergence D [N] of the current policy p from the behaviour policy q on a support (no gradient); the
    KL ones run from q to p, as the authors compute them."""
    with torch.no_grad():
        if name == "binary_tv":
            return (s.lp_y.exp() - s.lq_y.exp()).abs()
        if name == "binary_kl":
            return _bernoulli_kl(s.lq_y.exp(), s.lp_y.exp())
        if name == "topk_tv":
            return 0.5 * torch.where(s.mask, s.lp.exp() - s.lq.exp(), 0.0).abs().sum(-1)
        if name == "topk_kl":
            return atom_kl(s.lq, s.lp, s.mask)
    raise ValueError(f"unknown DPPO divergence {name!r}; choose from {sorted(DPPO_THRESHOLDS)}")


def dppo(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    divergence: str = "binary_tv",
    ratio_cap: float = DPPO_RATIO_CAP,
    support: str = "rest",
    k: int = 64,
    delta: float = 1e-5,
    agg: str = "token-mean",
    norm_len: int | None = None,
    behaviour_logp: Tensor | None = None,
    is_cap: float = math.inf,
    is_weight: Tensor | None = None,
) -> LossOut:
    """DPPO: truncated-IS policy gradient with a one-sided divergence mask (old = the behaviour policy, or the
    recomputed one with behaviour_logp's weight w, module docstring).

    M = 0 where A > 0, D > thr and p(y) > q(y), or A < 0, D > thr and p(y) < q(y): D = dppo_divergence(divergence),
    thr = DPPO_THRESHOLDS[divergence]. The stop-gradient ratio is truncated at ratio_cap >= 1 (math.inf: not)."""
    if divergence not in DPPO_THRESHOLDS:
        raise ValueError(f"unknown DPPO divergence {divergence!r}; choose from {sorted(DPPO_THRESHOLDS)}")
    if isinstance(ratio_cap, bool) or not isinstance(ratio_cap, (int, float)) or not ratio_cap >= 1:
        raise ValueError(f"ratio_cap must be a number >= 1 (math.inf: no truncation), got {ratio_cap!r}")
    s, w, is_metrics = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, "token", behaviour_logp, is_cap, is_weight
    )
    thr = DPPO_THRESHOLDS[divergence]
    d = dppo_divergence(divergence, s).view(mask.shape)
    logp_y = s.lp_y.view(mask.shape)
    ratio = (logp_y - s.lq_y.view(mask.shape)).exp()
    a = adv[:, None]
    with torch.no_grad():
        out_up = (a > 0) & (d > thr) & (ratio > 1)
        out_down = (a < 0) & (d > thr) & (ratio < 1)
        keep = (~(out_up | out_down)).to(logp_y.dtype)
    policy = aggregate(weigh(-a * ratio.detach().clamp_max(ratio_cap) * keep * logp_y, w), mask, agg, norm_len)
    metrics = _shared_metrics(s, mask, adv)
    metrics |= {"policy": float(policy.detach()), "regression": 0.0, "frac_active": float(aggregate(1 - keep, mask))}
    return policy, metrics | _masked_stats(ratio, mask, "ratio") | is_metrics


def cispo(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    eps_high: float = 0.2,
    support: str = "rest",
    k: int = 64,
    delta: float = 1e-5,
    agg: str = "token-mean",
    norm_len: int | None = None,
    behaviour_logp: Tensor | None = None,
    is_cap: float = math.inf,
    is_weight: Tensor | None = None,
) -> LossOut:
    """CISPO: clamped stop-gradient ratio times log p(y); no trust region at all. With behaviour_logp: weighted by
    w (module docstring)."""
    s, w, is_metrics = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, "token", behaviour_logp, is_cap, is_weight
    )
    logp_y = s.lp_y.view(mask.shape)
    ratio = (logp_y - s.lq_y.view(mask.shape)).exp()
    capped = ratio.detach().clamp_max(1 + eps_high)
    policy = aggregate(weigh(-adv[:, None] * capped * logp_y, w), mask, agg, norm_len)
    frac = aggregate((ratio.detach() > 1 + eps_high).to(ratio.dtype), mask)
    metrics = _shared_metrics(s, mask, adv) | {"policy": float(policy.detach()), "regression": 0.0}
    return policy, metrics | {"frac_active": float(frac)} | _masked_stats(ratio, mask, "ratio") | is_metrics


LOSSES: dict[str, Callable[..., LossOut]] = {"troll": troll_loss, "ppo_clip": ppo_clip, "dppo": dppo, "cispo": cispo}
