"""The TROLL objective and the baselines behind one signature (docs/algorithm.md, sections 4-5).

Every loss takes the same inputs and returns (loss, metrics):

    logits     [B, T, V]  current policy at the completion positions (temperature already applied), with grad;
                          or a `head.LMHead` over hidden states [B, T, H]: the chunked output layer, which never
                          builds the [B, T, V] logits (same values and gradients)
    tokens     [B, T]     sampled token ids
    mask       [B, T]     True on real completion tokens
    adv        [B]        one advantage per response (advantages.py)
    old        SparseDist over the B*T rows (row-major), the policy the trust region is anchored to

`old` is either the training model's own recomputation right before the update (the paper's choice and the
default in train.py: one extra no-grad forward pass, top-mass support of any size up to K) or the behaviour
policy's top-K log-probs returned by the rollout engine (DPPO's argument: free, and it anchors the update to
the distribution that actually produced the data, sampler numerics included; limited to the engine's K).
Both are built with troll.sparse (sparsify / sparsify_topk) and feed every loss unchanged.

`support` picks the sparse model that puts p and q on shared atoms (sparse.build_support): "rest" (default; q's
kept set plus one exact rest atom: every KL below is a lower bound of the true KL and exact where nothing is
dropped) or "paper" (each policy's own top-K with a 1e-12 tail, as in the paper). `k` and `delta` only shape p's
own support under "paper"; under "rest" p is gathered at q's support and needs no top-K.

    troll_loss  L = agg(-A * exp(log pi*(y) - log q(y))) + alpha * agg(KL(p || sg(pi*)))   no clipping;
              pi* = the KL projection of p onto {KL(. || q) <= eps} on the sparse support (project.py)
    ppo_clip  L = agg(-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)),  r = p(y) / q(y) exact over V
              (default 0.2 / 0.2; eps_high = 0.28 is Clip-Higher; under level="sequence" GSPO's 3e-4 / 4e-4)
    dppo      L = agg(-A * sg(min(r, c)) * M * log p(y)), c = ratio_cap (10); M = 0 only where the update moves
              further out: A > 0, D > thr, p(y) > q(y)   or   A < 0, D > thr, p(y) < q(y).  D is one of
              binary_tv |p(y) - q(y)| (thr 0.15), binary_kl KL(Bern q(y) || Bern p(y)) (thr 0.05),
              topk_tv / topk_kl (KL(q || p)) on the atoms of the support (rest model: q's kept set plus one
              "rest" bucket, DPPO's definition) (thr 0.15 / 0.05)
    cispo     L = agg(-A * sg(min(r, 1 + eps_high)) * log p(y))   (no mask: the no-trust-region control;
              eps_high 0.2 by default, as verl ships it and the trainer's --clip_high; the paper tunes only it)

Each baseline's defaults are its authors' (docs/algorithm.md, section 5, names the code or paper of each).

`level="sequence"` (troll and ppo_clip) is GSPO: per-token log-ratios are averaged over each response,
s_i = exp(mean_t log r_t), and used in GSPO's straight-through token form s_it = sg(s_i) * r_t / sg(r_t)
(value s_i, gradient of token t). With TROLL the per-token ratios are the projected ones.

Aggregation `agg` (identical for every term of a loss), x [B, T] -> scalar:
    token-mean               sum(x * m) / sum(m)
    seq-mean-token-mean      mean_i( sum_t(x * m) / sum_t(m) )
    seq-mean-token-sum-norm  mean_i( sum_t(x * m) / T_norm )      (Dr.GRPO; T_norm = T unless given)
where mean_i runs over the responses with at least one real token (an empty one is left out, as in verl).

Off-policy data (docs/algorithm.md, section 10). When the samples come from a behaviour policy mu other than the
anchor q (a stale or lower-precision sampler), `behaviour_logp` [B, T] (log mu(y_t), the sampler's log-prob of each
sampled token; padding is never read) turns on the decoupled objective: the policy-gradient term of each token is
weighted by the constant

    w_t = sg(min(q(y_t) / mu(y_t), is_cap))        (is_cap = inf: plain IS; finite, >= 1: truncated IS)

and the trust region (TROLL's projection and regression, PPO's clip, DPPO's mask, CISPO's cap) stays around q:

    troll_loss  agg(-w A pi*(y)/q(y)) + alpha agg(KL(p || sg(pi*)))
    ppo_clip    agg(-w min(r A, clip(r) A))
    dppo        agg(-w A sg(min(r, c)) M log p(y))
    cispo       agg(-w A sg(min(r, 1 + eps_high)) log p(y))

With level="sequence" the weight is per response and matches GSPO's ratio: w_i = min(exp(mean_t log(q(y_t) /
mu(y_t))), is_cap), so w_i s_i = exp(mean_t log(pi(y_t) / mu(y_t))), the sequence ratio against the sampler.
behaviour_logp=None (the default) leaves every loss as above, bit for bit.

`is_mode` picks how the ratio rho = q(y) / mu(y) becomes w (docs/algorithm.md, 10f); is_floor <= 1 <= is_cap:
    truncate           the above (default): min(rho_t, cap) (and >= floor), per response (geometric mean) under
                       level="sequence"
    token_truncate     clamp(rho_t, floor, cap) per token, at every level              (TRL's modes of the same name)
    token_mask         rho_t if floor <= rho_t <= cap else 0, per token
    sequence_truncate  clamp(R_i, floor, cap) on every token of response i, R_i = prod_t rho_it (exact, not GSPO's mean)
    sequence_mask      R_i if floor <= R_i <= cap else 0

Metrics (python floats; KL is of the current policy p to q over the support's atoms):
    policy, regression, kl_before_mean/max, kl_after_mean/max (after projection; = kl_before for baselines),
    frac_active (tokens projected / clipped / masked), ratio_mean/min/max (the ratio in the policy term),
    entropy (of p, exact, from its full logits), frac_no_signal (real tokens whose advantage is exactly 0: they
    add exactly nothing to the gradient, as TROLL's regression term adds nothing where nothing is projected), and
    for troll the solver stats of Projection.stats(); with
    behaviour_logp, is_weight_mean / is_weight_max (of w, over the real tokens) and is_frac_truncated (the share of
    real tokens whose ratio was outside [is_floor, is_cap]: capped, raised to the floor or masked).

Inputs are checked: shapes, a bool mask, finite advantages, a known level / aggregation / support, finite
alpha >= 0, behaviour_logp [B, T] and finite on real tokens, a known is_mode, 0 <= is_floor <= 1 <= is_cap; each
error names the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from troll.project import check_eps
from troll.project import project_sparse
from troll.sparse import SUPPORTS, SparseDist, Support, atom_kl, build_support, check_k_delta, support_kl

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DPPO_THRESHOLDS = {"binary_tv": 0.15, "binary_kl": 0.05, "topk_tv": 0.15, "topk_kl": 0.05}
# DPPO's divergence thresholds and ratio cap c as its authors ship them (sail-sg/Stable-RL: clip_ratio_c = 10)
DPPO_RATIO_CAP = 10.0
# PPO-clip's (eps_low, eps_high) by level: PPO's 0.2 per token; GSPO's paper (section 5.1) per sequence
CLIP_RANGE = {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4)}
LossOut = tuple[Tensor, dict[str, float]]


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
    if mode == "token-mean":
        return per_seq.sum() / mask.sum().clamp_min(1)
    length = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / length.clamp_min(1)
    else:  # seq-mean-token-sum-norm
        per_seq = per_seq / (norm_len or max(x.shape[-1], 1))
    return per_seq.sum() / (length > 0).sum().clamp_min(1)


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
    level: str = "token",
    behaviour_logp: Tensor | None = None,
    is_cap: float = math.inf,
    is_mode: str = "truncate",
    is_floor: float = 0.0,
) -> Support:
    """Check the common inputs and put p and q on shared atoms over the B*T rows (sparse.build_support)."""
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
    _check_behaviour(behaviour_logp, is_cap, tokens, mask, is_mode, is_floor)
    return build_support(logits.reshape(b * t, logits.shape[-1]), tokens.reshape(-1), old, support, k, delta)


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


def _sequence_ratio(log_r: Tensor, mask: Tensor) -> Tensor:
    """GSPO's straight-through token ratio [B, T]: value exp(mean_t log r), gradient of each token's log r."""
    m = mask.to(log_r.dtype)
    seq = (log_r * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    return torch.exp(seq.detach() + log_r - log_r.detach())


def _check_behaviour(
    behaviour_logp: Tensor | None,
    is_cap: float,
    tokens: Tensor,
    mask: Tensor,
    is_mode: str = "truncate",
    is_floor: float = 0.0,
) -> None:
    """Refuse an unusable behaviour log-prob [B, T], IS mode or bound, naming the argument."""
    if isinstance(is_cap, bool) or not isinstance(is_cap, (int, float)) or not is_cap >= 1:  # NaN fails >= 1
        raise ValueError(f"is_cap must be a number >= 1 (math.inf: no truncation), got {is_cap!r}")
    if isinstance(is_floor, bool) or not isinstance(is_floor, (int, float)) or not 0 <= is_floor <= 1:
        raise ValueError(f"is_floor must be a number in [0, 1] (0: no floor), got {is_floor!r}")
    if is_mode not in IS_MODES:
        raise ValueError(f"unknown is_mode={is_mode!r}; choose from {IS_MODES}")
    if behaviour_logp is None:
        if is_cap != math.inf or is_floor != 0 or is_mode != "truncate":
            raise ValueError(
                f"is_cap={is_cap!r}, is_floor={is_floor!r}, is_mode={is_mode!r} shape the IS weight, which needs "
                "behaviour_logp (got None)"
            )
        return
    if not isinstance(behaviour_logp, Tensor) or not behaviour_logp.is_floating_point():
        got = behaviour_logp.dtype if isinstance(behaviour_logp, Tensor) else type(behaviour_logp).__name__
        raise ValueError(f"behaviour_logp must be a float tensor [B, T] of log mu(y), got {got}")
    if behaviour_logp.shape != tokens.shape:
        raise ValueError(
            f"behaviour_logp must have the shape of tokens {tuple(tokens.shape)}, got {tuple(behaviour_logp.shape)}"
        )
    if not bool(torch.isfinite(behaviour_logp[mask]).all()):
        raise ValueError("behaviour_logp contains NaN or inf on a real token (log mu(y) of a sampled token is finite)")


def _is_weight(
    s: Support,
    behaviour_logp: Tensor | None,
    is_cap: float,
    mask: Tensor,
    level: str = "token",
    is_mode: str = "truncate",
    is_floor: float = 0.0,
) -> tuple[Tensor | None, dict[str, float]]:
    """The decoupled objective's weight w [B, T] from rho = q(y) / mu(y) (module docstring: is_mode; the default is
    sg(min(rho, is_cap)), per response as GSPO's ratio for level="sequence") and its metrics; (None, {}) without
    behaviour_logp."""
    if behaviour_logp is None:
        return None, {}
    with torch.no_grad():
        lq_y = s.lq_y.view(mask.shape)
        log_w = torch.where(mask, lq_y - behaviour_logp.to(lq_y.dtype), 0.0)  # padding may hold anything
        per_response = is_mode.startswith("sequence") or (is_mode == "truncate" and level == "sequence")
        if per_response:  # GSPO's geometric mean (truncate), or the exact product over the response (sequence_*)
            m = mask.to(log_w.dtype)
            total = (log_w * m).sum(-1, keepdim=True)
            log_w = (total / m.sum(-1, keepdim=True).clamp_min(1) if is_mode == "truncate" else total).expand_as(log_w)
        raw = log_w.exp()
        outside = (raw > is_cap) | (raw < is_floor)
        if is_mode.endswith("mask"):
            w = raw.masked_fill(outside, 0.0)
        else:  # a capped token's weight is the cap exactly (and a floored one's the floor)
            w = raw.clamp(min=is_floor, max=is_cap)
        real = w[mask].double()
        metrics = {
            "is_weight_mean": float(real.mean()) if real.numel() else 1.0,
            "is_weight_max": float(real.max()) if real.numel() else 1.0,
            "is_frac_truncated": float(aggregate(outside.to(w.dtype), mask)),
        }
    return w, metrics


def _weigh(x: Tensor, w: Tensor | None) -> Tensor:
    """x [B, T] times the IS weight w [B, T]; x itself (the same tensor, bit for bit) without one."""
    return x if w is None else w * x


def check_troll_settings(
    eps: float, alpha: float, k: int, delta: float, support: str = "rest", level: str = "token"
) -> None:
    """troll_loss's rules for its settings, a ValueError naming the first it refuses: what TROLLConfig checks when
    it is made, so a setting the loss would refuse at the first step is refused when it is given."""
    check_eps(eps)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (math.isfinite(alpha) and alpha >= 0):
        raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
    check_k_delta(k, delta)
    if support not in SUPPORTS:
        raise ValueError(f"support={support!r} is an unknown sparse model; choose from {SUPPORTS}")
    if level not in LEVELS:
        raise ValueError(f"level={level!r} is unknown; choose from {LEVELS}")


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
    agg: str = "token-mean",
    norm_len: int | None = None,
    level: str = "token",
    detach_dual: bool = False,
    behaviour_logp: Tensor | None = None,
    is_cap: float = math.inf,
    is_mode: str = "truncate",
    is_floor: float = 0.0,
) -> LossOut:
    """TROLL: importance ratio of the projected policy, plus the regression of p onto sg(pi*); with behaviour_logp
    the ratio term is weighted by w = sg(min(q(y) / mu(y), is_cap)) (module docstring)."""
    check_troll_settings(eps, alpha, k, delta, support, level)
    s = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, level, behaviour_logp, is_cap, is_mode, is_floor
    )
    w, is_metrics = _is_weight(s, behaviour_logp, is_cap, mask, level, is_mode, is_floor)
    proj = project_sparse(s, eps, detach_dual=detach_dual)
    log_r = (proj.log_pi_y - s.lq.gather(-1, s.y[:, None])[:, 0]).view(mask.shape)
    ratio = _sequence_ratio(log_r, mask) if level == "sequence" else log_r.exp()
    policy = aggregate(_weigh(-adv[:, None] * ratio, w), mask, agg, norm_len)
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
    agg: str = "token-mean",
    norm_len: int | None = None,
    level: str = "token",
    behaviour_logp: Tensor | None = None,
    is_cap: float = math.inf,
    is_mode: str = "truncate",
    is_floor: float = 0.0,
) -> LossOut:
    """PPO's clipped surrogate; eps_high = 0.28 gives Clip-Higher. A range left None is CLIP_RANGE[level]'s: 0.2
    per token, GSPO's 3e-4 / 4e-4 per sequence. With behaviour_logp: w times it (module docstring)."""
    default_low, default_high = CLIP_RANGE.get(level, CLIP_RANGE["token"])
    eps_low = default_low if eps_low is None else eps_low
    eps_high = default_high if eps_high is None else eps_high
    s = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, level, behaviour_logp, is_cap, is_mode, is_floor
    )
    w, is_metrics = _is_weight(s, behaviour_logp, is_cap, mask, level, is_mode, is_floor)
    log_r = (s.lp_y - s.lq_y).view(mask.shape)
    ratio = _sequence_ratio(log_r, mask) if level == "sequence" else log_r.exp()
    a = adv[:, None]
    unclipped, clipped = ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a
    policy = aggregate(_weigh(-torch.minimum(unclipped, clipped), w), mask, agg, norm_len)
    frac = aggregate((clipped < unclipped).to(ratio.dtype), mask)
    metrics = _shared_metrics(s, mask, adv) | {
        "policy": float(policy.detach()),
        "regression": 0.0,
        "frac_active": float(frac),
    }
    return policy, metrics | _masked_stats(ratio, mask, "ratio") | is_metrics


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
    is_mode: str = "truncate",
    is_floor: float = 0.0,
) -> LossOut:
    """DPPO: truncated-IS policy gradient with a one-sided divergence mask (old = the behaviour policy, or the
    recomputed one with behaviour_logp's weight w, module docstring).

    The mask's threshold is DPPO_THRESHOLDS[divergence]; the stop-gradient ratio is truncated at ratio_cap >= 1
    (math.inf: not truncated)."""
    if divergence not in DPPO_THRESHOLDS:
        raise ValueError(f"unknown DPPO divergence {divergence!r}; choose from {sorted(DPPO_THRESHOLDS)}")
    if isinstance(ratio_cap, bool) or not isinstance(ratio_cap, (int, float)) or not ratio_cap >= 1:
        raise ValueError(f"ratio_cap must be a number >= 1 (math.inf: no truncation), got {ratio_cap!r}")
    s = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, "token", behaviour_logp, is_cap, is_mode, is_floor
    )
    w, is_metrics = _is_weight(s, behaviour_logp, is_cap, mask, "token", is_mode, is_floor)
    thr = DPPO_THRESHOLDS[divergence]
    d = dppo_divergence(divergence, s).view(mask.shape)
    logp_y = s.lp_y.view(mask.shape)
    ratio = (logp_y - s.lq_y.view(mask.shape)).exp()
    a = adv[:, None]
    with torch.no_grad():
        out_up = (a > 0) & (d > thr) & (ratio > 1)
        out_down = (a < 0) & (d > thr) & (ratio < 1)
        keep = (~(out_up | out_down)).to(logp_y.dtype)
    policy = aggregate(_weigh(-a * ratio.detach().clamp_max(ratio_cap) * keep * logp_y, w), mask, agg, norm_len)
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
    is_mode: str = "truncate",
    is_floor: float = 0.0,
) -> LossOut:
    """CISPO: clamped stop-gradient ratio times log p(y); no trust region at all. With behaviour_logp: weighted by
    w (module docstring)."""
    s = _support(
        logits, tokens, mask, adv, old, support, k, delta, agg, "token", behaviour_logp, is_cap, is_mode, is_floor
    )
    w, is_metrics = _is_weight(s, behaviour_logp, is_cap, mask, "token", is_mode, is_floor)
    logp_y = s.lp_y.view(mask.shape)
    ratio = (logp_y - s.lq_y.view(mask.shape)).exp()
    capped = ratio.detach().clamp_max(1 + eps_high)
    policy = aggregate(_weigh(-adv[:, None] * capped * logp_y, w), mask, agg, norm_len)
    frac = aggregate((ratio.detach() > 1 + eps_high).to(ratio.dtype), mask)
    metrics = _shared_metrics(s, mask, adv) | {
        "policy": float(policy.detach()),
        "regression": 0.0,
        "frac_active": float(frac),
    }
    return policy, metrics | _masked_stats(ratio, mask, "ratio") | is_metrics


LOSSES: dict[str, Callable[..., LossOut]] = {"troll": troll_loss, "ppo_clip": ppo_clip, "dppo": dppo, "cispo": cispo}
