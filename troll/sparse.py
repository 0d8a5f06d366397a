"""Sparse top-mass supports with a tail: how one policy over V tokens is stored in O(K) per token.

For each token position (row) and one policy with log-probs l over the vocabulary (ALGORITHM.md section 3):

    kept S   = the smallest prefix of tokens sorted by probability with mass >= 1 - delta, at most K of
               them, plus the sampled token y (always kept, so a row holds at most K + 1 entries)
    tail     = the c = V - |S| dropped entries; each gets the same default probability tau (1e-12)
    renorm   : log p_hat(v) = l(v) - log Z  for v in S,   log p_hat(tail) = log tau - log Z,
               Z = sum_{v in S} exp(l(v)) + c * tau

Stored as a `SparseDist` (row count N, slot count W = K + 1):
    idx [N, W] long, logp [N, W] float, mask [N, W] bool, tail_logp [N], tail_count [N] long.
No [N, V] tensor is ever kept. Masked slots hold the tail value (so every stored number is finite);
the current policy's kept values keep their autograd graph (gradients reach the logits through the
gather and the log-normaliser, and through Z).

Two supports are combined on their union (`union`): an entry kept by only one policy takes the other
policy's tail value; the remaining V - |S_new u S_old| entries are a shared tail with one value per
policy. `kl` on a `Support` counts that tail, so with nothing dropped it equals the dense KL. The union is
compacted to U = the largest union in the batch (live slots first, in id order), so everything downstream,
the dual solver included, works on a peaked policy's handful of tokens rather than 2K + 2 slots.

Approximation error (one policy): KL(p || p_hat) = log Z + sum_{v dropped} p(v) log(p(v) / tau)
    <= log(m + c tau) + (1 - m) log((1 - m) / tau),    m = kept mass >= 1 - delta,
about delta * log(delta / tau) = 1.6e-4 for the paper's delta = 1e-5, tau = 1e-12 (`tail_error_bound`).

Choices: sorting uses `topk` (never a full sort of V); with delta = 0 every entry of positive
probability among the top K is kept (the prefix test is `remaining mass > delta`); arithmetic is float32
for bf16/fp16/float32 inputs and float64 for float64 inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

TAIL_PROB = 1e-12


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class SparseDist:
    """One policy on a sparse support with a tail (module docstring). Shapes: [N, W] and [N].

    `log_norm` is log Z, so `logp + log_norm` are the exact (un-renormalised) log-probs of the kept entries:
    the baselines' ratio p(y) / q(y) uses those, TROLL works on the renormalised sparse distributions.
    """

    idx: Tensor
    logp: Tensor
    mask: Tensor
    tail_logp: Tensor
    tail_count: Tensor
    log_norm: Tensor
    vocab_size: int

    FIELDS = ("idx", "logp", "mask", "tail_logp", "tail_count", "log_norm")

    @property
    def size(self) -> Tensor:
        """[N] number of kept entries per row."""
        return self.mask.sum(-1)

    def to_dense(self) -> Tensor:
        """[N, V] log-probs: the kept values, the tail value everywhere else (small V only: tests, notebooks)."""
        out = self.tail_logp[:, None].expand(-1, self.vocab_size).clone()
        rows = torch.arange(self.idx.shape[0], device=self.idx.device)[:, None].expand_as(self.idx)
        out[rows[self.mask], self.idx[self.mask]] = self.logp[self.mask]
        return out

    def _map(self, fn) -> SparseDist:
        return SparseDist(*(fn(getattr(self, f)) for f in self.FIELDS), self.vocab_size)

    def select(self, rows: Tensor) -> SparseDist:
        """The rows `rows` ([n] long) of this distribution, e.g. one micro-batch."""
        return self._map(lambda x: x[rows])

    def to(self, device: torch.device | str) -> SparseDist:
        return self._map(lambda x: x.to(device))

    def detach(self) -> SparseDist:
        return self._map(lambda x: x.detach())


def cat_rows(dists: list[SparseDist]) -> SparseDist:
    """Stack the rows of several distributions over the same vocabulary (e.g. micro-batches)."""
    if len({(d.vocab_size, d.idx.shape[1]) for d in dists}) != 1:
        raise ValueError("cat_rows needs distributions with one vocabulary size and one slot count")
    return SparseDist(*(torch.cat([getattr(d, f) for d in dists]) for f in SparseDist.FIELDS), dists[0].vocab_size)


@dataclass
class Support:
    """Two policies ("new" p and "old" q) on the union of their kept supports.

    idx, mask, lp, lq: [N, U] (U = the largest union size in the batch); lp_tail, lq_tail, tail_count: [N].
    lp carries p's gradient.
    """

    idx: Tensor
    mask: Tensor
    lp: Tensor
    lq: Tensor
    lp_tail: Tensor
    lq_tail: Tensor
    tail_count: Tensor
    vocab_size: int

    def position(self, tokens: Tensor) -> Tensor:
        """[N] slot of each token id (tokens: [N]); raises if a token is not on the support."""
        hit = (self.idx == tokens[:, None]) & self.mask
        if not bool(hit.any(-1).all()):
            raise ValueError("a token is not on the support (sparsify with the sampled tokens)")
        return hit.long().argmax(-1)


def _check_logits(x: Tensor, tokens: Tensor) -> None:
    if x.dim() != 2 or tokens.shape != x.shape[:1]:
        raise ValueError(f"expected logits [N, V] and tokens [N]; got {tuple(x.shape)} and {tuple(tokens.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"logits must be floating point, got {x.dtype}")
    if tokens.dtype != torch.long:
        raise ValueError(f"tokens must be int64, got {tokens.dtype}")
    if tokens.numel() and not bool(((tokens >= 0) & (tokens < x.shape[1])).all()):
        raise ValueError(f"token ids must lie in [0, {x.shape[1]})")


class _GatherLogSoftmax(torch.autograd.Function):
    """log_softmax(x)[n, idx[n, j]] -> [N, W] without keeping a log-softmax copy for backward.

    Saves x itself; the gradient is built in one [N, V] buffer:  dL/dx = scatter_add(g at idx) - softmax(x) * sum_j g_j.
    (Autograd through logsumexp + topk + gather would hold four [N, V] buffers at once.)
    """

    @staticmethod
    def forward(ctx, x: Tensor, idx: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, idx)
        return x.log_softmax(-1, dtype=compute_dtype(x.dtype)).gather(-1, idx)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        x, idx = ctx.saved_tensors
        grad = x.softmax(-1, dtype=g.dtype).mul_(-g.sum(-1, keepdim=True)).scatter_add_(-1, idx, g)
        return grad.to(x.dtype), None


def sparsify(
    logits: Tensor, tokens: Tensor, k: int = 64, delta: float = 1e-5, tail_prob: float = TAIL_PROB
) -> SparseDist:
    """Sparse support of one policy from full logits or log-probs [N, V] and sampled tokens [N].

    Rows are normalised here (log-softmax), so logits and log-probs give the same result. -inf entries are
    allowed (masked tokens); NaN, +inf, an all -inf row or a sampled token of zero probability raise.
    """
    _check_logits(logits, tokens)
    top_idx = logits.detach().topk(min(k, logits.shape[-1]), dim=-1).indices
    lp = _GatherLogSoftmax.apply(logits, torch.cat([top_idx, tokens[:, None]], dim=-1))
    top_logp, tok_logp = lp[:, :-1], lp[:, -1]
    if not bool(torch.isfinite(torch.stack([top_logp[:, 0], tok_logp])).all()):
        bad = ~torch.isfinite(top_logp[:, 0])  # NaN / +inf / all -inf rows are NaN in every slot
        what = "NaN/+inf logits or an all -inf row" if bool(bad.any()) else "a sampled token of zero probability"
        rows = torch.nonzero(bad | ~torch.isfinite(tok_logp))[:5, 0].tolist()
        raise ValueError(f"cannot sparsify: {what} (rows {rows})")
    return _from_sorted(top_logp, top_idx, tok_logp, tokens, logits.shape[-1], delta, tail_prob)


def sparsify_topk(
    top_logp: Tensor,
    top_idx: Tensor,
    token_logp: Tensor,
    tokens: Tensor,
    vocab_size: int,
    delta: float = 1e-5,
    tail_prob: float = TAIL_PROB,
) -> SparseDist:
    """Sparse support from an engine's top-K log-probs ([N, K], normalised over V, any order) and the
    sampled tokens' log-probs [N]: the behaviour policy, without ever seeing its [N, V] logits."""
    if top_logp.shape != top_idx.shape or top_logp.dim() != 2 or token_logp.shape != top_logp.shape[:1]:
        raise ValueError(
            f"expected top_logp/top_idx [N, K] and token_logp [N]; got "
            f"{tuple(top_logp.shape)}, {tuple(top_idx.shape)}, {tuple(token_logp.shape)}"
        )
    if torch.isnan(top_logp).any() or torch.isnan(token_logp).any() or (top_logp > 1e-4).any():
        raise ValueError("top-K log-probs must be log-probabilities (<= 0, no NaN)")
    top_logp = top_logp.to(compute_dtype(top_logp.dtype))
    top_logp, order = top_logp.sort(dim=-1, descending=True)
    return _from_sorted(
        top_logp,
        top_idx.gather(-1, order),
        token_logp.to(top_logp.dtype),
        tokens,
        vocab_size,
        delta,
        tail_prob,
    )


def _from_sorted(
    top_logp: Tensor,
    top_idx: Tensor,
    tok_logp: Tensor,
    tokens: Tensor,
    vocab_size: int,
    delta: float,
    tail_prob: float,
) -> SparseDist:
    """Apply the mass-prefix rule to sorted candidates [N, K], add the sampled token, renormalise."""
    with torch.no_grad():
        p = top_logp.exp()
        beyond = (1.0 - p.sum(-1, keepdim=True)).clamp_min(0.0)  # mass outside the K candidates
        remaining = p.flip(-1).cumsum(-1).flip(-1) + beyond  # mass from slot j on
        keep = (remaining > delta) & (p > 0)
        tok_kept = ((top_idx == tokens[:, None]) & keep).any(-1, keepdim=True)
    idx = torch.cat([top_idx, tokens[:, None]], dim=-1)
    logp = torch.cat([top_logp, tok_logp[:, None]], dim=-1)
    mask = torch.cat([keep, ~tok_kept], dim=-1)
    count = vocab_size - mask.sum(-1)
    kept = torch.logsumexp(logp.masked_fill(~mask, -math.inf), dim=-1)
    log_tail = torch.log(count.to(logp.dtype)) + math.log(tail_prob)
    log_z = torch.logaddexp(kept, log_tail)
    tail_logp = math.log(tail_prob) - log_z
    logp = torch.where(mask, logp - log_z[:, None], tail_logp[:, None])
    return SparseDist(idx, logp, mask, tail_logp, count, log_z, vocab_size)


def union(new: SparseDist, old: SparseDist) -> Support:
    """Both policies on the union of their supports; an entry missing from one takes its tail value."""
    if new.vocab_size != old.vocab_size or new.idx.shape[0] != old.idx.shape[0]:
        raise ValueError(
            f"supports disagree: vocab {new.vocab_size} vs {old.vocab_size}, "
            f"rows {new.idx.shape[0]} vs {old.idx.shape[0]}"
        )
    n, wo, wn = old.idx.shape[0], old.idx.shape[1], new.idx.shape[1]
    sentinel = new.vocab_size  # sorts after every real id
    idx = torch.cat([old.idx.masked_fill(~old.mask, sentinel), new.idx.masked_fill(~new.mask, sentinel)], -1)
    lq = torch.cat([old.logp.to(new.logp.dtype), old.tail_logp[:, None].to(new.logp.dtype).expand(n, wn)], -1)
    lp = torch.cat([new.tail_logp[:, None].expand(n, wo), new.logp], -1)
    idx, perm = idx.sort(dim=-1, stable=True)  # an id in both appears twice, the old copy first
    lq, lp = lq.gather(-1, perm), lp.gather(-1, perm)
    same = (idx[:, 1:] == idx[:, :-1]) & (idx[:, 1:] < sentinel)
    no = torch.zeros_like(same[:, :1])
    first, second = torch.cat([same, no], -1), torch.cat([no, same], -1)
    lp = torch.where(first, lp.roll(-1, dims=-1), lp)  # the old copy takes p's value from the new copy
    mask = (idx < sentinel) & ~second
    # Compact: live slots first (still in id order), then drop the columns that are padding in every row, so
    # U is the largest union size in the batch (a peaked policy's few tokens, not 2K + 2).
    width = int(mask.sum(-1).max()) if n else 0
    order = (~mask).to(torch.uint8).argsort(dim=-1, stable=True)[:, :width]
    idx, mask, lp, lq = (x.gather(-1, order) for x in (idx, mask, lp, lq))
    lq_tail = old.tail_logp.to(new.logp.dtype)
    return Support(
        idx.masked_fill(~mask, 0),  # a valid id everywhere, so gathers with idx never go out of range
        mask,
        torch.where(mask, lp, new.tail_logp[:, None]),
        torch.where(mask, lq, lq_tail[:, None]),
        new.tail_logp,
        lq_tail,
        new.vocab_size - mask.sum(-1),
        new.vocab_size,
    )


def kl(lp: Tensor, lq: Tensor, mask: Tensor, lp_tail: Tensor, lq_tail: Tensor, tail_count: Tensor) -> Tensor:
    """KL(p || q) per row [N] for two distributions on one support [N, U] plus a shared tail."""
    slots = torch.where(mask, lp.exp() * (lp - lq), 0.0).sum(-1)
    return slots + tail_count.to(lp.dtype) * lp_tail.exp() * (lp_tail - lq_tail)


def support_kl(s: Support) -> Tensor:
    """KL(new || old) per row [N] on a union support, tail included."""
    return kl(s.lp, s.lq, s.mask, s.lp_tail, s.lq_tail, s.tail_count)


def tail_error_bound(kept_mass: Tensor, tail_count: Tensor, tail_prob: float = TAIL_PROB) -> Tensor:
    """Upper bound on KL(p || p_hat) from sparsifying p (module docstring); kept_mass m, tail_count c: [N]."""
    dropped = (1.0 - kept_mass).clamp_min(0.0)
    xlogx = torch.where(dropped > 0, dropped * torch.log(dropped / tail_prob), 0.0)
    return torch.log(kept_mass + tail_count * tail_prob) + xlogx
