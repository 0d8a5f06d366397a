"""The TROLL objective and the baselines behind one signature (ALGORITHM.md sections 4-5).

Every loss takes the same inputs and returns (loss, metrics):

    logits     [B, T, V]  current policy at the completion positions (temperature already applied), with grad
    tokens     [B, T]     sampled token ids
    mask       [B, T]     True on real completion tokens
    adv        [B]        one advantage per response (advantages.py)
    old        SparseDist over the B*T rows (row-major), the policy the trust region is anchored to

`old` is either the training model's own recomputation right before the update (the paper's choice and the
default in train.py: one extra no-grad forward pass, top-mass support of any size up to K) or the behaviour
policy's top-K log-probs returned by the rollout engine (DPPO's argument: free, and it anchors the update to
the distribution that actually produced the data, sampler numerics included; limited to the engine's K).
Both are built with troll.sparse (sparsify / sparsify_topk) and feed every loss unchanged.

    troll_loss  L = agg(-A * exp(log pi*(y) - log q(y))) + alpha * agg(KL(p || sg(pi*)))   no clipping;
              pi* = the KL projection of p onto {KL(. || q) <= eps} on the sparse support (project.py)
    ppo_clip  L = agg(-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)),  r = p(y) / q(y)
              (eps_high = 0.28 is Clip-Higher)
    dppo      L = agg(-A * sg(min(r, c)) * M * log p(y)); M = 0 only where the update moves further out:
              A > 0, D > thr, p(y) > q(y)   or   A < 0, D > thr, p(y) < q(y).  D is one of
              binary_tv |p(y) - q(y)| (thr 0.15), binary_kl KL(Bern p(y) || Bern q(y)) (thr 0.05),
              topk_tv / topk_kl on q's kept support plus one "rest" bucket (thr 0.15 / 0.05)
    cispo     L = agg(-A * sg(min(r, 1 + eps_high)) * log p(y))   (no mask: the no-trust-region control)

`level="sequence"` (troll and ppo_clip) is GSPO: per-token log-ratios are averaged over each response,
s_i = exp(mean_t log r_t), and used in GSPO's straight-through token form s_it = sg(s_i) * r_t / sg(r_t)
(value s_i, gradient of token t). With TROLL the per-token ratios are the projected ones.

Aggregation `agg` (identical for every term of a loss), x [B, T] -> scalar:
    token-mean               sum(x * m) / sum(m)
    seq-mean-token-mean      mean_i( sum_t(x * m) / sum_t(m) )
    seq-mean-token-sum-norm  mean_i( sum_t(x * m) / T_norm )      (Dr.GRPO; T_norm = T unless given)

Metrics (python floats; KL is of the current policy p to q on the sparse support, tail included):
    policy, regression, kl_before_mean/max, kl_after_mean/max (after projection; = kl_before for baselines),
    frac_active (tokens projected / clipped / masked), ratio_mean/min/max (the ratio in the policy term),
    entropy (of p on its kept support plus tail), and for troll the solver stats of Projection.stats().
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from troll.project import project_sparse
from troll.sparse import SparseDist, kl, sparsify, support_kl, union

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
DPPO_THRESHOLDS = {"binary_tv": 0.15, "binary_kl": 0.05, "topk_tv": 0.15, "topk_kl": 0.05}
LossOut = tuple[Tensor, dict[str, float]]


def aggregate(x: Tensor, mask: Tensor, mode: str = "token-mean", norm_len: int | None = None) -> Tensor:
    """Reduce per-token values x [B, T] over the real tokens (mask [B, T]) to a scalar."""
    m = mask.to(x.dtype)
    if mode == "token-mean":
        return (x * m).sum() / m.sum().clamp_min(1)
    if mode == "seq-mean-token-mean":
        return ((x * m).sum(-1) / m.sum(-1).clamp_min(1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return ((x * m).sum(-1) / (norm_len or x.shape[-1])).mean()
    raise ValueError(f"unknown aggregation {mode!r}; choose from {AGGREGATIONS}")


def _check(logits: Tensor, tokens: Tensor, mask: Tensor, adv: Tensor, old: SparseDist) -> None:
    b, t = tokens.shape
    if logits.shape[:2] != (b, t) or mask.shape != (b, t) or adv.shape != (b,):
        raise ValueError(
            f"expected logits [B, T, V], tokens/mask [B, T], adv [B]; got {tuple(logits.shape)}, "
            f"{tuple(tokens.shape)}, {tuple(mask.shape)}, {tuple(adv.shape)}"
        )
    if old.idx.shape[0] != b * t or old.vocab_size != logits.shape[-1]:
        raise ValueError(
            f"old policy has {old.idx.shape[0]} rows over {old.vocab_size} tokens; "
            f"expected B*T = {b * t} rows over V = {logits.shape[-1]}"
        )
    if not bool(torch.isfinite(adv).all()):
        raise ValueError("advantages contain NaN or inf")


def _entropy(d: SparseDist) -> Tensor:
    """Entropy [N] of a sparse distribution, tail included."""
    slots = torch.where(d.mask, -d.logp.exp() * d.logp, 0.0).sum(-1)
    return slots - d.tail_count.to(d.logp.dtype) * d.tail_logp.exp() * d.tail_logp


def _masked_stats(x: Tensor, mask: Tensor, prefix: str) -> dict[str, float]:
    v = x.detach().double()[mask]
    if v.numel() == 0:
        return {f"{prefix}_mean": 0.0, f"{prefix}_min": 0.0, f"{prefix}_max": 0.0}
    return {f"{prefix}_mean": float(v.mean()), f"{prefix}_min": float(v.min()), f"{prefix}_max": float(v.max())}


def _token_logp(d: SparseDist, tokens: Tensor) -> Tensor:
    """log d(y) [N] for token ids [N] on d's kept support (the sampled token is always kept)."""
    hit = (d.idx == tokens[:, None]) & d.mask
    if not bool(hit.any(-1).all()):
        raise ValueError("old policy does not hold the sampled tokens (build it with sparsify(..., tokens))")
    return torch.where(hit, d.logp, -math.inf).logsumexp(-1)


def _baseline_setup(logits, tokens, mask, adv, old, k, delta) -> tuple[Tensor, dict[str, float]]:
    """log q(y) [B, T] and the shared metrics (KL(p || q) on the support, entropy of p); no gradient."""
    _check(logits, tokens, mask, adv, old)
    b, t, v = logits.shape
    tok = tokens.reshape(-1)
    with torch.no_grad():
        new = sparsify(logits.reshape(b * t, v), tok, k=k, delta=delta)
        kl_p = support_kl(union(new, old)).view(b, t)
        metrics = {"entropy": float(aggregate(_entropy(new).view(b, t), mask))}
        before = _masked_stats(kl_p, mask, "kl_before")
    metrics |= {"kl_before_mean": before["kl_before_mean"], "kl_before_max": before["kl_before_max"]}
    metrics |= {"kl_after_mean": before["kl_before_mean"], "kl_after_max": before["kl_before_max"]}
    lq_y = (_token_logp(old, tok) + old.log_norm).view(b, t)  # exact log q(y): not renormalised on the support
    return lq_y.to(logits.dtype if logits.dtype == torch.float64 else torch.float32), metrics


def _log_p_exact(logits: Tensor, tokens: Tensor) -> Tensor:
    """log p(y) [B, T] over the full vocabulary (no sparse tail), in float32 or better."""
    x = logits.float() if logits.dtype != torch.float64 else logits
    return x.gather(-1, tokens[..., None])[..., 0] - torch.logsumexp(x, dim=-1)


def _sequence_ratio(log_r: Tensor, mask: Tensor) -> Tensor:
    """GSPO's straight-through token ratio [B, T]: value exp(mean_t log r), gradient of each token's log r."""
    m = mask.to(log_r.dtype)
    seq = (log_r * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp_min(1)
    return torch.exp(seq.detach() + log_r - log_r.detach())


def troll_loss(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    eps: float = 0.05,
    alpha: float = 1.0,
    k: int = 64,
    delta: float = 1e-5,
    agg: str = "token-mean",
    norm_len: int | None = None,
    level: str = "token",
    detach_dual: bool = False,
) -> LossOut:
    """TROLL: importance ratio of the projected policy, plus the regression of p onto sg(pi*)."""
    _check(logits, tokens, mask, adv, old)
    b, t, v = logits.shape
    tok = tokens.reshape(-1)
    new = sparsify(logits.reshape(b * t, v), tok, k=k, delta=delta)
    proj = project_sparse(new, old, eps, detach_dual=detach_dual)
    s = proj.support
    log_pi_y, _, log_q_y = proj.at(tok)
    log_r = (log_pi_y - log_q_y).view(b, t)
    ratio = _sequence_ratio(log_r, mask) if level == "sequence" else log_r.exp()
    policy = aggregate(-adv[:, None] * ratio, mask, agg, norm_len)
    reg_tok = kl(s.lp, proj.logp.detach(), s.mask, s.lp_tail, proj.tail_logp.detach(), s.tail_count).view(b, t)
    regression = aggregate(reg_tok, mask, agg, norm_len)
    stats = proj.stats(mask.reshape(-1))
    metrics = {
        "policy": float(policy.detach()),
        "regression": float(regression.detach()),
        "frac_active": stats["frac_projected"],
        "entropy": float(aggregate(_entropy(new.detach()).view(b, t), mask)),
    }
    metrics |= {key: val for key, val in stats.items() if key.startswith("kl_")}
    metrics |= {f"dual_{key}": val for key, val in stats.items() if not key.startswith(("kl_", "frac_projected"))}
    return policy + alpha * regression, metrics | _masked_stats(ratio, mask, "ratio")


def ppo_clip(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    k: int = 64,
    delta: float = 1e-5,
    agg: str = "token-mean",
    norm_len: int | None = None,
    level: str = "token",
) -> LossOut:
    """PPO's clipped surrogate (Clip-Higher with eps_high = 0.28)."""
    lq_y, metrics = _baseline_setup(logits, tokens, mask, adv, old, k, delta)
    log_r = _log_p_exact(logits, tokens) - lq_y
    ratio = _sequence_ratio(log_r, mask) if level == "sequence" else log_r.exp()
    a = adv[:, None]
    unclipped, clipped = ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a
    policy = aggregate(-torch.minimum(unclipped, clipped), mask, agg, norm_len)
    frac = aggregate((clipped < unclipped).to(ratio.dtype), mask)
    metrics |= {"policy": float(policy.detach()), "regression": 0.0, "frac_active": float(frac)}
    return policy, metrics | _masked_stats(ratio, mask, "ratio")


def _bernoulli_kl(p: Tensor, q: Tensor) -> Tensor:
    p, q = p.clamp(1e-12, 1 - 1e-12), q.clamp(1e-12, 1 - 1e-12)
    return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))


def dppo_divergence(name: str, logits: Tensor, tokens: Tensor, old: SparseDist, lq_y: Tensor) -> Tensor:
    """DPPO's divergence D [B, T] between p and the behaviour policy q (no gradient)."""
    b, t, v = logits.shape
    with torch.no_grad():
        lp_full = torch.log_softmax(logits.reshape(b * t, v).float(), -1)
        tok = tokens.reshape(-1)
        p_y = lp_full.gather(-1, tok[:, None])[:, 0].exp()
        q_y = lq_y.reshape(-1).exp().float()
        if name == "binary_tv":
            d = (p_y - q_y).abs()
        elif name == "binary_kl":
            d = _bernoulli_kl(p_y, q_y)
        elif name in ("topk_tv", "topk_kl"):
            p_k = torch.where(old.mask, lp_full.gather(-1, old.idx).exp(), 0.0)
            q_k = torch.where(old.mask, (old.logp + old.log_norm[:, None]).exp(), 0.0).float()
            p_k = torch.cat([p_k, (1 - p_k.sum(-1, keepdim=True)).clamp_min(0)], -1)  # + the "rest" bucket
            q_k = torch.cat([q_k, (1 - q_k.sum(-1, keepdim=True)).clamp_min(0)], -1)
            if name == "topk_tv":
                d = 0.5 * (p_k - q_k).abs().sum(-1)
            else:
                d = torch.where(p_k > 0, p_k * (p_k.clamp_min(1e-30).log() - q_k.clamp_min(1e-30).log()), 0.0).sum(-1)
        else:
            raise ValueError(f"unknown DPPO divergence {name!r}; choose from {sorted(DPPO_THRESHOLDS)}")
    return d.view(b, t)


def dppo(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    divergence: str = "binary_tv",
    threshold: float | None = None,
    ratio_cap: float = 2.0,
    k: int = 64,
    delta: float = 1e-5,
    agg: str = "token-mean",
    norm_len: int | None = None,
) -> LossOut:
    """DPPO: truncated-IS policy gradient with a one-sided divergence mask (old = the behaviour policy)."""
    lq_y, metrics = _baseline_setup(logits, tokens, mask, adv, old, k, delta)
    thr = DPPO_THRESHOLDS.get(divergence) if threshold is None else threshold
    d = dppo_divergence(divergence, logits, tokens, old, lq_y)
    logp_y = _log_p_exact(logits, tokens)
    ratio = (logp_y - lq_y).exp()
    a = adv[:, None]
    with torch.no_grad():
        out_up = (a > 0) & (d > thr) & (ratio > 1)
        out_down = (a < 0) & (d > thr) & (ratio < 1)
        keep = (~(out_up | out_down)).to(logp_y.dtype)
    policy = aggregate(-a * ratio.detach().clamp_max(ratio_cap) * keep * logp_y, mask, agg, norm_len)
    metrics |= {"policy": float(policy.detach()), "regression": 0.0, "frac_active": float(aggregate(1 - keep, mask))}
    return policy, metrics | _masked_stats(ratio, mask, "ratio")


def cispo(
    logits: Tensor,
    tokens: Tensor,
    mask: Tensor,
    adv: Tensor,
    old: SparseDist,
    *,
    eps_high: float = 0.28,
    k: int = 64,
    delta: float = 1e-5,
    agg: str = "token-mean",
    norm_len: int | None = None,
) -> LossOut:
    """CISPO: clamped stop-gradient ratio times log p(y); no trust region at all."""
    lq_y, metrics = _baseline_setup(logits, tokens, mask, adv, old, k, delta)
    logp_y = _log_p_exact(logits, tokens)
    ratio = (logp_y - lq_y).exp()
    capped = ratio.detach().clamp_max(1 + eps_high)
    policy = aggregate(-adv[:, None] * capped * logp_y, mask, agg, norm_len)
    frac = aggregate((ratio.detach() > 1 + eps_high).to(ratio.dtype), mask)
    metrics |= {"policy": float(policy.detach()), "regression": 0.0, "frac_active": float(frac)}
    return policy, metrics | _masked_stats(ratio, mask, "ratio")


LOSSES: dict[str, Callable[..., LossOut]] = {"troll": troll_loss, "ppo_clip": ppo_clip, "dppo": dppo, "cispo": cispo}
