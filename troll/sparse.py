"""Sparse supports: one policy over V tokens in O(K) numbers per token, and two policies on shared atoms.

One policy, one row (a token position), log-probs l over the vocabulary (docs/algorithm.md, section 3):

    S        = the smallest prefix of tokens sorted by probability with mass >= 1 - delta, at most K of them,
               plus the sampled token y (always kept)
    logp(v)  = l(v) for v in S: exact log-probs, normalised over all V tokens (not renormalised on S)
    log_rest = log sum_{v not in S} exp(l(v)), the mass of everything dropped, computed in log space
               (a logsumexp over the dropped entries, never 1 - sum_S in float32)

Stored as a `SparseDist`: idx, logp, mask [N, W] (W = the batch's largest |S|; live slots first) and
log_rest [N]. Masked slots repeat slot 0's id and value, so every number is finite and every id distinct
per row. No [N, V] tensor is kept. The one pass over the vocabulary is `head.gather_logprobs` (log-probs at
the kept ids, the exact rest mass and the entropy, in row chunks, from full logits or from the output layer's
hidden states and weight): every function here takes either (`head.Logits`).

Two policies, p (current, with gradient) and q (old, a constant), on shared "atoms" (`Support`): U single
tokens plus one last atom for the rest of the vocabulary; lp, lq are the log p- and q-masses of each atom.
Two sparse models build it (`SUPPORTS`):

    "rest"  (default): the atoms are q's kept set S and R = V \\ S. p is gathered exactly at S from its full
            logits and its rest mass r_p = p(R) is exact too; r_q = q(R) likewise. Every atom mass is exact, so
            KL over the atoms is the KL of the coarse-grained pair, KL_c(p || q) <= KL(p || q) (log-sum
            inequality): no token is projected that is inside the trust region. No top-K of p is needed.
    "paper" (the paper's model, for reproduction and ablation): each policy keeps its own top-mass set; every
            dropped token gets the default probability tau = 1e-12 and each policy is renormalised,
                log p_hat(v) = l(v) - log Z (v kept),  log p_hat(v) = log tau - log Z (dropped),
                Z = sum_{v kept} exp(l(v)) + c tau,  c = V - |S|;
            the atoms are the union of both kept sets plus a tail atom of the V - |union| entries. A token kept
            by one policy only takes the other's tau / Z. Where the K cap binds, the supports differ at their
            boundary and this KL can far exceed the true KL.

Both models agree with the dense computation when nothing is dropped (K = V, delta = 0). The bound on one
policy's own sparsification error in the paper's model is `tail_error_bound` (about delta log(delta / tau)
= 1.6e-4 for delta = 1e-5); it does not bound the error of the KL between two such policies.

Choices: top-K selection uses `topk` (never a full sort of V); with delta = 0 every entry of positive probability
among the top K is kept (the test is `mass from this slot on > delta`); arithmetic is float32 for
bf16/fp16/float32 logits and float64 for float64 logits (`compute_dtype`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from troll.head import Logits, compute_dtype, gather_logprobs, topk

TAIL_PROB = 1e-12
SUPPORTS = ("rest", "paper")
TENSOR_FIELDS = ("idx", "logp", "mask", "log_rest")  # SparseDist's tensors, e.g. to store them in a batch dict


# ----------------------------------------------------------------------------- one policy


@dataclass
class SparseDist:
    """One policy on a sparse support (module docstring). idx, logp, mask: [N, W]; log_rest: [N]."""

    idx: Tensor
    logp: Tensor
    mask: Tensor
    log_rest: Tensor
    vocab_size: int

    @property
    def size(self) -> Tensor:
        """[N] number of kept entries per row."""
        return self.mask.sum(-1)

    def map(self, fn) -> SparseDist:
        """Apply `fn` to every tensor field (select rows, move, detach)."""
        return replace(self, **{f: fn(getattr(self, f)) for f in TENSOR_FIELDS})

    def select(self, rows: Tensor) -> SparseDist:
        """The rows `rows` ([n] long) of this distribution, e.g. one micro-batch."""
        return self.map(lambda x: x[rows])

    def logp_at(self, tokens: Tensor) -> Tensor:
        """[N] the log-prob of each row's token `tokens` [N], which must be in the row's support (a sampled one)."""
        return _at_tokens(self, tokens)

    def samples(self, idx: Tensor, per_sample: int) -> SparseDist:
        """The rows of samples `idx` ([b] long) when sample i holds the `per_sample` rows i * per_sample + t
        (a [B, T] batch flattened row-major): [b * per_sample] rows, in that order."""
        return self.select((idx[:, None] * per_sample + torch.arange(per_sample, device=idx.device)).reshape(-1))

    def to(self, device: torch.device | str) -> SparseDist:
        return self.map(lambda x: x.to(device))

    def detach(self) -> SparseDist:
        return self.map(lambda x: x.detach())

    def to_dense(self, tail_prob: float | None = None) -> Tensor:
        """[N, V] log-probs (small V only: tests, notebooks). Dropped entries share the rest mass equally, or
        with `tail_prob` get the paper's renormalised tail value."""
        if tail_prob is None:
            count = (self.vocab_size - self.size).to(self.logp.dtype)
            logp, fill = self.logp, self.log_rest - count.log()
        else:
            logp, fill, _ = paper_model(self, tail_prob)
        out = fill[:, None].expand(-1, self.vocab_size).clone()
        rows = torch.arange(self.idx.shape[0], device=self.idx.device)[:, None].expand_as(self.idx)
        out[rows[self.mask], self.idx[self.mask]] = logp[self.mask]
        return out


def check_k_delta(k: int, delta: float, tail_prob: float = TAIL_PROB) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if not (isinstance(delta, (int, float)) and 0 <= delta < 1):
        raise ValueError(f"delta must be a number in [0, 1), got {delta!r}")
    if not (isinstance(tail_prob, (int, float)) and 0 < tail_prob < 1):
        raise ValueError(f"tail_prob must be a number in (0, 1), got {tail_prob!r}")


def _check_logits(x: Logits, tokens: Tensor) -> None:
    if len(x.shape) != 2 or tokens.shape != x.shape[:1]:
        raise ValueError(f"expected logits [N, V] and tokens [N]; got {tuple(x.shape)} and {tuple(tokens.shape)}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point, got {x.dtype}")
    _check_tokens(tokens, x.shape[1])


def _check_tokens(tokens: Tensor, vocab_size: int, what: str = "token ids") -> None:
    if tokens.dtype != torch.long:
        raise ValueError(f"{what} must be int64, got {tokens.dtype}")
    if tokens.numel() and not bool(((tokens >= 0) & (tokens < vocab_size)).all()):
        raise ValueError(f"{what} must lie in [0, {vocab_size})")


def sparsify(logits: Logits, tokens: Tensor, k: int = 64, delta: float = 1e-5) -> SparseDist:
    """Sparse support of one policy from full logits or log-probs [N, V] and sampled tokens [N].

    Rows are normalised here, so logits and log-probs give the same result; logp keeps the logits' gradient.
    -inf entries are allowed (masked tokens); NaN, +inf, an all -inf row or a sampled token of zero
    probability raise.
    """
    return sparsify_with_entropy(logits, tokens, k, delta)[0]


def sparsify_with_entropy(logits: Logits, tokens: Tensor, k: int, delta: float) -> tuple[SparseDist, Tensor]:
    """`sparsify`, plus the exact entropy [N] of each row's full distribution (no gradient)."""
    _check_logits(logits, tokens)
    check_k_delta(k, delta)
    top = topk(logits, k)  # sorted by probability
    y_apart = ~(top == tokens[:, None]).any(-1, keepdim=True)
    cand = torch.cat([top, tokens[:, None]], -1)
    live = torch.cat([torch.ones_like(top, dtype=torch.bool), y_apart], -1)
    cand_logp, cand_rest, entropy = gather_logprobs(logits, cand, live)  # one pass over [N, V]
    with torch.no_grad():
        beyond = cand_rest.exp() + torch.where(y_apart[:, 0], cand_logp[:, -1].exp(), 0.0)
        order, mask = _keep(cand_logp[:, :-1], beyond, top, tokens, delta)
        dropped = live & ~torch.zeros_like(live).scatter_(-1, order, mask)  # live candidates left out of S
    idx, logp = cand.gather(-1, order), cand_logp.gather(-1, order)
    log_rest = _logsumexp(torch.cat([cand_rest[:, None], cand_logp.masked_fill(~dropped, -math.inf)], -1))
    d = SparseDist(_fill(idx, mask), _fill(logp, mask), mask, log_rest, logits.shape[-1])
    _check_sampled(_at_tokens(d, tokens))
    return d, entropy


def sparsify_topk(
    top_logp: Tensor,
    top_idx: Tensor,
    token_logp: Tensor,
    tokens: Tensor,
    vocab_size: int,
    delta: float = 1e-5,
    tail_prob: float = TAIL_PROB,
) -> SparseDist:
    """Sparse support from an engine's top-K log-probs ([N, K], normalised over V, any order) and the sampled
    tokens' log-probs [N]: the behaviour policy, without its [N, V] logits.

    The rest mass is 1 - sum_S q, computed in float64 and floored at (V - |S|) * tail_prob: below the rounding
    of the engine's log-probs the remainder is unknown, and the floor is the paper's tail mass.
    """
    if top_logp.shape != top_idx.shape or top_logp.dim() != 2 or token_logp.shape != top_logp.shape[:1]:
        raise ValueError(
            f"expected top_logp/top_idx [N, K] and token_logp [N]; got "
            f"{tuple(top_logp.shape)}, {tuple(top_idx.shape)}, {tuple(token_logp.shape)}"
        )
    check_k_delta(max(top_idx.shape[1], 1), delta, tail_prob)
    _check_tokens(top_idx, vocab_size, "top-K ids")
    _check_distinct(top_idx, "top-K ids")
    if tokens.shape != token_logp.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and token_logp {tuple(token_logp.shape)} differ in shape")
    _check_tokens(tokens, vocab_size)
    for name, x in (("top_logp", top_logp), ("token_logp", token_logp)):
        if bool((torch.isnan(x) | (x > 1e-4)).any()):
            raise ValueError(f"{name} must hold log-probabilities (<= 0, no NaN)")
    dt = compute_dtype(top_logp.dtype)
    top_logp, order = top_logp.to(dt).sort(dim=-1, descending=True, stable=True)
    top_idx = top_idx.gather(-1, order)
    y_apart = ~(top_idx == tokens[:, None]).any(-1)
    p64 = top_logp.double().exp()
    beyond = (1.0 - p64.sum(-1) - torch.where(y_apart, token_logp.double().exp(), 0.0)).clamp_min(0.0)
    order, mask = _keep(top_logp, beyond.to(dt), top_idx, tokens, delta)
    idx = torch.cat([top_idx, tokens[:, None]], -1).gather(-1, order)
    logp = torch.cat([top_logp, token_logp.to(dt)[:, None]], -1).gather(-1, order)
    count = (vocab_size - mask.sum(-1)).double()
    rest = (1.0 - torch.where(mask, logp.double().exp(), 0.0).sum(-1)).clamp_min(count * tail_prob)
    log_rest = torch.where(count > 0, rest.log(), -math.inf).to(dt)
    d = SparseDist(_fill(idx, mask), _fill(logp, mask), mask, log_rest, vocab_size)
    _check_sampled(_at_tokens(d, tokens))
    return d


def _keep(top_logp: Tensor, beyond: Tensor, top_idx: Tensor, tokens: Tensor, delta: float) -> tuple[Tensor, Tensor]:
    """The mass-prefix rule. Candidates: the C entries top_logp, top_idx [N, C] sorted by probability, then the
    sampled token (position C); beyond [N] is the mass outside the C. Keeps the smallest prefix whose mass
    reaches 1 - delta (`mass from this slot on > delta`) and y. Returns positions into the C + 1 candidates and
    the live mask, both [N, W] with live slots first and W = the batch's largest kept count."""
    p = top_logp.exp()
    remaining = p.flip(-1).cumsum(-1).flip(-1) + beyond[:, None]  # mass from slot j on
    is_y = top_idx == tokens[:, None]
    keep = ((remaining > delta) & (p > 0)) | is_y
    mask = torch.cat([keep, ~is_y.any(-1, keepdim=True)], -1)
    width = int(mask.sum(-1).max()) if mask.shape[0] else 1
    order = (~mask).to(torch.uint8).argsort(dim=-1, stable=True)[:, :width]
    return order, mask.gather(-1, order)


def _check_distinct(idx: Tensor, what: str) -> None:
    """Each row of idx [N, K] lists a token id at most once (a support holds each token once)."""
    ids = idx.sort(-1).values
    twice = ids[:, 1:] == ids[:, :-1]
    if bool(twice.any()):
        row, col = (int(i) for i in twice.nonzero()[0])
        raise ValueError(f"{what}: row {row} lists token id {int(ids[row, col])} twice; a support lists each once")


def _fill(x: Tensor, mask: Tensor) -> Tensor:
    """Masked slots repeat slot 0 (live), so stored numbers are finite and live ids stay distinct."""
    return torch.where(mask, x, x[:, :1])


def _logsumexp(x: Tensor) -> Tensor:
    """logsumexp over the last dim that is -inf (with a zero, not NaN, gradient) on rows with no finite entry."""
    some = (x > -math.inf).any(-1)
    return torch.where(some, torch.where(some[:, None], x, 0.0).logsumexp(-1), -math.inf)


def _check_sampled(at_y: Tensor) -> None:
    """The sampled tokens' log-probs [N] must be finite: a sampled token of zero probability is an error."""
    at_y = at_y.detach()
    if not bool(torch.isfinite(at_y).all()):
        rows = torch.nonzero(~torch.isfinite(at_y))[:5, 0].tolist()
        raise ValueError(
            f"a sampled token has zero probability (rows {rows}): masked in the logits, or p and q disagree on "
            "the vocabulary"
        )


def cat_rows(dists: list[SparseDist]) -> SparseDist:
    """Stack the rows of several distributions over one vocabulary (e.g. micro-batches); pads to the widest."""
    if not dists or len({d.vocab_size for d in dists}) != 1:
        raise ValueError("cat_rows needs at least one distribution, all over one vocabulary size")
    width = max(d.idx.shape[1] for d in dists)

    def widen(d: SparseDist) -> SparseDist:  # dead slots repeating slot 0, up to `width`
        extra = width - d.idx.shape[1]
        pad = d.mask.new_zeros(d.mask.shape[0], extra)
        return replace(
            d,
            idx=torch.cat([d.idx, d.idx[:, :1].expand(-1, extra)], -1),
            logp=torch.cat([d.logp, d.logp[:, :1].expand(-1, extra)], -1),
            mask=torch.cat([d.mask, pad], -1),
        )

    parts = [widen(d) for d in dists]
    return replace(parts[0], **{f: torch.cat([getattr(d, f) for d in parts]) for f in TENSOR_FIELDS})


def paper_model(d: SparseDist, tail_prob: float = TAIL_PROB) -> tuple[Tensor, Tensor, Tensor]:
    """The paper's renormalised values: kept log-probs [N, W], each dropped entry's log-prob [N], count [N]."""
    count = d.vocab_size - d.size
    kept = torch.where(d.mask, d.logp, -math.inf).logsumexp(-1)
    log_z = torch.logaddexp(kept, count.to(d.logp.dtype).log() + math.log(tail_prob))
    return d.logp - log_z[:, None], math.log(tail_prob) - log_z, count


# ----------------------------------------------------------------------------- two policies on shared atoms


@dataclass
class Support:
    """p (with gradient) and q on shared atoms: U single tokens, then one atom for the rest of the vocabulary.

    idx [N, U]: the single atoms' token ids; mask [N, U + 1]: live atoms (the last one is live when it holds
    q-mass); lp, lq [N, U + 1]: log p- and q-mass of each atom (0.0 on dead atoms); count [N]: vocabulary
    entries in the last atom; y [N]: the sampled token's atom; lp_y, lq_y [N]: its exact log p(y), log q(y)
    (over all V, whichever model); entropy [N]: p's exact entropy (no gradient).
    """

    idx: Tensor
    mask: Tensor
    lp: Tensor
    lq: Tensor
    count: Tensor
    y: Tensor
    lp_y: Tensor
    lq_y: Tensor
    entropy: Tensor


def support_kl(s: Support) -> Tensor:
    """KL(p || q) over the atoms, per row [N] (rest model: the coarse KL, a lower bound of the true KL)."""
    return atom_kl(s.lp, s.lq, s.mask)


def atom_kl(lp: Tensor, lq: Tensor, mask: Tensor) -> Tensor:
    """KL(p || q) per row [N] for two distributions given as log-masses on the same atoms [N, A]; an atom without
    p-mass (lp = -inf) adds 0, as p log(p / q) -> 0."""
    mask = mask & (lp > -math.inf)
    w = torch.where(mask, lp, -math.inf).exp()  # no NaN gradients through dead atoms
    return (w * torch.where(mask, lp - lq, 0.0)).sum(-1)


def build_support(
    logits: Logits, tokens: Tensor, old: SparseDist, sparse_model: str = "rest", k: int = 64, delta: float = 1e-5
) -> Support:
    """p (full logits [N, V], with gradient) and q (`old`, a constant) on shared atoms, under `sparse_model`."""
    _check_logits(logits, tokens)
    if sparse_model not in SUPPORTS:
        raise ValueError(f"unknown sparse model {sparse_model!r}; choose from {SUPPORTS}")
    if old.vocab_size != logits.shape[1] or old.idx.shape[0] != logits.shape[0]:
        raise ValueError(
            f"old policy has {old.idx.shape[0]} rows over {old.vocab_size} tokens; expected "
            f"{logits.shape[0]} rows over V = {logits.shape[1]}"
        )
    for name, x, live in (("old.logp", old.logp, old.mask), ("old.log_rest", old.log_rest, None)):
        bad = torch.isnan(x) | (x == math.inf)
        if live is not None:
            bad = bad | (live & (x == -math.inf))  # a kept token of q-mass zero
        if bool(bad.any()):
            raise ValueError(f"{name} contains NaN, +inf or a kept entry of zero probability")
    old = old.detach().to(logits.device)
    if sparse_model == "paper":
        new, entropy = sparsify_with_entropy(logits, tokens, k, delta)
        return _union(new, old, tokens, entropy)
    lp, lp_rest, entropy = gather_logprobs(logits, old.idx, old.mask)
    lq = old.logp.to(lp.dtype)
    lq_rest = old.log_rest.to(lp.dtype)
    live_rest = lq_rest > -math.inf
    if bool((~live_rest & (lp_rest > -math.inf)).any()):
        raise ValueError("the current policy has mass outside the old policy's support where the old one has none")
    mask = torch.cat([old.mask, live_rest[:, None]], -1)
    lp_all = torch.where(mask, torch.cat([lp, lp_rest[:, None]], -1), 0.0)
    lq_all = torch.where(mask, torch.cat([lq, lq_rest[:, None]], -1), 0.0)
    y = _token_slot(old, tokens)
    lp_y, lq_y = lp.gather(-1, y[:, None])[:, 0], lq.gather(-1, y[:, None])[:, 0]
    _check_sampled(lp_y)  # p and q disagree on which ids exist (inconsistent vocabulary masks)
    return Support(old.idx, mask, lp_all, lq_all, old.vocab_size - old.size, y, lp_y, lq_y, entropy)


def _token_slot(d: SparseDist, tokens: Tensor) -> Tensor:
    """[N] slot of each sampled token on d's support; raises if one is missing."""
    hit = (d.idx == tokens[:, None]) & d.mask
    if not bool(hit.any(-1).all()):
        raise ValueError("old policy does not hold the sampled tokens (build it with sparsify(..., tokens))")
    return hit.to(torch.uint8).argmax(-1)


def _at_tokens(d: SparseDist, tokens: Tensor) -> Tensor:
    """[N] d's log-prob of each sampled token (exact, over V; with d's gradient)."""
    return d.logp.gather(-1, _token_slot(d, tokens)[:, None])[:, 0]


def _union(new: SparseDist, old: SparseDist, tokens: Tensor, entropy: Tensor) -> Support:
    """The paper's model: both renormalised policies on the union of their kept sets plus a shared tail atom;
    an entry kept by one policy only takes the other's tail value."""
    lp_y = _at_tokens(new, tokens)
    lq_y = _at_tokens(old, tokens).to(lp_y.dtype)
    lp_new, tail_p, _ = paper_model(new)
    lq_old, tail_q, _ = paper_model(old)
    lq_old, tail_q = lq_old.to(lp_new.dtype), tail_q.to(lp_new.dtype)
    n, wo, wn = old.idx.shape[0], old.idx.shape[1], new.idx.shape[1]
    sentinel = new.vocab_size  # sorts after every real id
    idx = torch.cat([old.idx.masked_fill(~old.mask, sentinel), new.idx.masked_fill(~new.mask, sentinel)], -1)
    lq = torch.cat([lq_old, tail_q[:, None].expand(n, wn)], -1)
    lp = torch.cat([tail_p[:, None].expand(n, wo), lp_new], -1)
    idx, perm = idx.sort(dim=-1, stable=True)  # an id in both appears twice, the old copy first
    lq, lp = lq.gather(-1, perm), lp.gather(-1, perm)
    same = (idx[:, 1:] == idx[:, :-1]) & (idx[:, 1:] < sentinel)
    no = torch.zeros_like(same[:, :1])
    first, second = torch.cat([same, no], -1), torch.cat([no, same], -1)
    lp = torch.where(first, lp.roll(-1, dims=-1), lp)  # the old copy takes p's value from the new copy
    mask = (idx < sentinel) & ~second
    width = int(mask.sum(-1).max()) if n else 1  # compact: live slots first, U = the batch's largest union
    order = (~mask).to(torch.uint8).argsort(dim=-1, stable=True)[:, :width]
    idx, mask, lp, lq = (x.gather(-1, order) for x in (idx, mask, lp, lq))
    idx = idx.masked_fill(~mask, 0)
    count = new.vocab_size - mask.sum(-1)
    log_c = count.to(lp.dtype).log()
    live_tail = count > 0
    mask = torch.cat([mask, live_tail[:, None]], -1)
    lp = torch.where(mask, torch.cat([lp, (log_c + tail_p)[:, None]], -1), 0.0)
    lq = torch.where(mask, torch.cat([lq, (log_c + tail_q)[:, None]], -1), 0.0)
    y = (idx == tokens[:, None]).to(torch.uint8).argmax(-1)
    return Support(idx, mask, lp, lq, count, y, lp_y, lq_y, entropy)


def tail_error_bound(kept_mass: Tensor, tail_count: Tensor, tail_prob: float = TAIL_PROB) -> Tensor:
    """The paper's model: upper bound on KL(p || p_hat) from sparsifying one policy p, with kept mass m and
    tail count c [N]:  KL <= log(m + c tau) + (1 - m) log((1 - m) / tau)."""
    dropped = (1.0 - kept_mass).clamp_min(0.0)
    xlogy = torch.where(dropped > 0, dropped * torch.log(dropped / tail_prob), 0.0)
    return torch.log(kept_mass + tail_count * tail_prob) + xlogy
