"""The one pass over the vocabulary: log-probs at a few ids, the exact rest mass and the entropy, in row chunks.

Everything the losses need from the current policy's [N, V] distribution comes out of one op:

    logp[n, j]  = log softmax(x_n)[idx[n, j]]                      at W ids per row (the kept support)
    log_rest[n] = log sum_{v not at a live id} softmax(x_n)[v]      exact, in log space
    entropy[n]  = - sum_v p log p                                    (a metric: no gradient)

where the logits x are either given ([N, V]) or produced by the output layer from the last hidden states,
`LMHead(hidden [N, H], weight [V_out, H], bias, temperature, vocab_size)`: x = (hidden @ weight.T + bias) / T,
with ids >= vocab_size (an output layer padded past the tokenizer, as Qwen's) at -inf. The head form is the
"chunked output layer": rows are processed `chunk_rows` at a time and each chunk's logits are recomputed in
backward, so no [N, V] tensor exists in forward or backward; only [chunk, V] at a time (and dL/dW, [V, H]).

Backward, with p = softmax(x), r = p(rest), G = sum of the live slots' gradients g_j and g_R the gradient
of log_rest (p_v / r = exp(x_v - lse_rest) <= 1 on the rest, so no division by a tiny r):

    dL/dx_v = g_v - p_v (G + g_R)               for v at a live slot
    dL/dx_v = (p_v / r) g_R - p_v (G + g_R)     for v in the rest
    head:  dL/dhidden = (dL/dx / T) @ W,   dL/dW = (dL/dx / T)^T @ hidden,   dL/dbias = sum_n dL/dx / T

Arithmetic is float32 for bf16/fp16/float32 inputs (the matmul runs in the inputs' dtype) and float64 for
float64. `topk` gives the K largest logits per row in the same chunks (no gradient), for the sparse supports.

`LMHead(..., compiled=True)`: each chunk's statistics (forward) and its dL/dx (backward) go through
`torch.compile` of `chunk_stats` / `chunk_grad`, the same formulas written as one function each, which the compiler
fuses into a few passes over [chunk, V] (Triton kernels on CUDA, C++ on CPU) where the eager path makes about seven;
the matmuls stay as they are. Its float32 sums run in another order, so it agrees with the eager path to rounding
(tests/test_head.py bounds its error against a float64 truth). The first call of each shape compiles (seconds).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

CHUNK_ELEMENTS = 1 << 24  # default chunk: about 16M logits (64 MB in float32)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class LMHead:
    """The output layer applied lazily to hidden states: logits = (hidden @ weight.T + bias) / temperature, ids >=
    vocab_size masked. hidden [..., H]; weight [V_out, H]; bias [V_out] or None. `chunk_rows` rows at a time
    (None: about CHUNK_ELEMENTS logits per chunk)."""

    hidden: Tensor
    weight: Tensor
    bias: Tensor | None = None
    temperature: float = 1.0
    vocab_size: int | None = None
    chunk_rows: int | None = None
    compiled: bool = False  # each chunk's pass through torch.compile (module docstring)

    def __post_init__(self) -> None:
        if self.weight.dim() != 2 or self.hidden.shape[-1] != self.weight.shape[1]:
            raise ValueError(
                f"hidden [..., H] and weight [V, H] disagree: {tuple(self.hidden.shape)}, {tuple(self.weight.shape)}"
            )
        if not (
            isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature > 0
        ):
            raise ValueError(f"temperature must be a positive finite number, got {self.temperature!r}")
        if self.vocab_size is not None and not 0 < self.vocab_size <= self.weight.shape[0]:
            raise ValueError(f"vocab_size {self.vocab_size} must lie in [1, {self.weight.shape[0]}] (the output rows)")
        if self.chunk_rows is not None and self.chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {self.chunk_rows}")

    @property
    def shape(self) -> torch.Size:
        """The shape of the logits this head stands for: [..., V_out]."""
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    @property
    def dtype(self) -> torch.dtype:
        return compute_dtype(self.hidden.dtype)

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def detach(self) -> LMHead:
        return replace(
            self,
            hidden=self.hidden.detach(),
            weight=self.weight.detach(),
            bias=None if self.bias is None else self.bias.detach(),
        )

    def reshape(self, *shape: int) -> LMHead:
        """Reshape the leading dims (the last one, V, must stay): e.g. [B, T, V] -> [B*T, V]."""
        return replace(self, hidden=self.hidden.reshape(*shape[:-1], self.hidden.shape[-1]))

    def logits(self, rows: slice | Tensor = slice(None), out: Tensor | None = None) -> Tensor:
        """Logits of some rows of a 2-D head, [n, V_out] in the compute dtype (into `out` if given).

        The matmul runs in the promoted dtype of hidden and weight with autocast off, so the op's forward and its
        backward (where autocast is not active) compute the same logits."""
        dt = torch.promote_types(self.hidden.dtype, self.weight.dtype)
        with torch.autocast(self.hidden.device.type, enabled=False):
            x = torch.matmul(self.hidden[rows].to(dt), self.weight.to(dt).T, out=out if dt == self.dtype else None)
        if self.bias is not None:
            x += self.bias.to(x.dtype)
        x = x.to(self.dtype) if out is None or x is out else out.copy_(x)
        x /= self.temperature
        if self.vocab_size is not None and self.vocab_size < x.shape[-1]:
            x[:, self.vocab_size :] = -math.inf
        return x


Logits = Tensor | LMHead  # what every function below takes: full logits [N, V] or a 2-D head


def _rows_per_chunk(x: Logits) -> int:
    """The head's chunk_rows, or about CHUNK_ELEMENTS logits per chunk."""
    return x.chunk_rows if isinstance(x, LMHead) and x.chunk_rows else max(1, CHUNK_ELEMENTS // max(x.shape[-1], 1))


def _chunks(n: int, per: int) -> list[slice]:
    return [slice(i, i + per) for i in range(0, n, per)]


def _chunk_logits(x: Tensor, head: LMHead | None, r: slice, buf: Tensor) -> Tensor:
    """Rows r of the logits in the compute dtype: a view of x (logits given), or the head's output in `buf`."""
    if head is None:
        return x[r] if x.dtype == buf.dtype else buf[: x[r].shape[0]].copy_(x[r])
    return head.logits(r, out=buf[: x[r].shape[0]])


def chunk_stats(x: Tensor, idx: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk's forward, as one function (the compiled path): logits x [m, V] (-inf on masked ids), ids [m, W]
    -> lse [m], logp [m, W], entropy [m], lse_rest [m] (module docstring; the eager path computes the same in place
    in `_GatherLogprobs.forward`)."""
    top = x.amax(-1, keepdim=True)
    d = x - top
    e = d.exp()
    log_z = e.sum(-1).log()
    entropy = log_z - torch.where(e > 0, d * e, 0.0).sum(-1) / e.sum(-1)
    rest = top[:, 0] + e.scatter(-1, idx, 0.0).sum(-1).log()
    return top[:, 0] + log_z, d.gather(-1, idx) - log_z[:, None], entropy, rest


def chunk_grad(x: Tensor, base: Tensor, coef: Tensor, idx: Tensor, at_s: Tensor) -> Tensor:
    """One chunk's dL/dx [m, V] (module docstring): exp(x - base) coef on every id, at_s at the slots idx."""
    return (x - base[:, None]).exp().mul(coef[:, None]).scatter(-1, idx, at_s)


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`torch.compile(fn)`, made once per function (dynamic shapes: one compilation serves every chunk size)."""
    return torch.compile(fn, dynamic=True)


class _GatherLogprobs(torch.autograd.Function):
    """(x or hidden, weight, bias, idx, live, temperature, vocab, per, fused) -> logp [N, W], log_rest [N], entropy [N]
    (module docstring), `per` rows at a time. weight None: x holds the logits [N, V]. Saves the inputs and three
    numbers per row. Each call allocates its [per, V] work buffers once and reuses them for every chunk: a fresh
    buffer per chunk costs the CPU more in page faults than the arithmetic."""

    @staticmethod
    def forward(ctx, x, weight, bias, idx, live, temp, vocab, per, fused):  # type: ignore[override]
        dt = compute_dtype(x.dtype)
        n, v = x.shape[0], (x.shape[-1] if weight is None else weight.shape[0])
        head = None if weight is None else LMHead(x, weight, bias, temp, vocab)
        lse = torch.empty(n, dtype=dt, device=x.device)
        lse_rest, entropy = torch.empty_like(lse), torch.empty_like(lse)
        logp = torch.empty(idx.shape, dtype=dt, device=x.device)
        rows = _chunks(n, per)
        work = torch.empty(min(per, n), v, dtype=dt, device=x.device)
        shifted = None if fused else torch.empty_like(work)
        for r in rows:
            xc = _chunk_logits(x, head, r, work)
            if fused:
                lse[r], logp[r], entropy[r], lse_rest[r] = compiled(chunk_stats)(xc, idx[r])
                continue
            m = xc.shape[0]
            top = xc.amax(-1, keepdim=True)
            d = torch.sub(xc, top, out=shifted[:m])  # log(p) + log z, -inf on masked ids
            e = torch.exp(d, out=work[:m])  # xc (a view of x, or the head's logits) is no longer needed
            z = e.sum(-1)
            lse[r] = top[:, 0] + z.log()
            logp[r] = d.gather(-1, idx[r]) - z.log()[:, None]
            entropy[r] = z.log() - d.mul_(e).nansum(-1) / z  # -inf * 0 = NaN on masked ids: nansum drops them
            lse_rest[r] = top[:, 0] + e.scatter_(-1, idx[r], 0.0).sum(-1).log()  # masked slots repeat a live id
        if not bool(torch.isfinite(lse).all()):
            bad = torch.nonzero(~torch.isfinite(lse))[:5, 0].tolist()
            raise ValueError(f"logits contain NaN/+inf or a row with no finite entry (rows {bad})")
        for i in torch.nonzero(lse_rest == -math.inf)[:, 0].tolist():  # a rest below float range: log space
            xc = _chunk_logits(x, head, slice(i, i + 1), work)
            lse_rest[i] = xc.scatter(-1, idx[i : i + 1], -math.inf).logsumexp(-1)[0]
        ctx.save_for_backward(x, weight, bias, idx, live, lse, lse_rest)
        ctx.temp, ctx.vocab, ctx.per, ctx.rows, ctx.fused = temp, vocab, per, rows, fused
        ctx.mark_non_differentiable(entropy)
        return logp, lse_rest - lse, entropy

    @staticmethod
    def backward(ctx, g, g_rest, _):  # type: ignore[override]
        x, weight, bias, idx, live, lse, lse_rest = ctx.saved_tensors
        dt = lse.dtype
        g = torch.where(live, g.to(dt), 0.0)
        total = g.sum(-1) + g_rest.to(dt)
        has_rest = torch.isfinite(lse_rest)
        base = torch.where(has_rest, lse_rest, lse)  # p_v / r on the rest (or p_v where there is no rest)
        coef = g_rest - total * torch.where(has_rest, (lse_rest - lse).exp(), 0.0)
        head = None if weight is None else LMHead(x, weight, bias, ctx.temp, ctx.vocab)
        n, v = x.shape[0], (x.shape[-1] if weight is None else weight.shape[0])
        work = torch.empty(min(ctx.per, n), v, dtype=dt, device=x.device)
        direct = weight is None and x.dtype == dt and not ctx.fused  # dL/dx straight into the gradient's rows
        grad_x = torch.empty_like(x) if weight is None else torch.empty(x.shape, dtype=dt, device=x.device)
        # a frozen output layer (LoRA's) gets no [V, H] gradient: neither its memory nor its matmul
        grad_w = torch.zeros(weight.shape, dtype=dt, device=x.device) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros(bias.shape, dtype=dt, device=x.device) if ctx.needs_input_grad[2] else None
        w = None if weight is None else weight.to(dt)
        for r in ctx.rows:
            xc = _chunk_logits(x, head, r, work)
            p_s = (xc.gather(-1, idx[r]) - lse[r, None]).exp()
            at_s = g[r] - p_s * total[r, None]
            at_s = torch.where(live[r], at_s, at_s[:, :1])  # masked slots repeat slot 0: write the same value
            if ctx.fused:
                gc = compiled(chunk_grad)(xc, base[r], coef[r], idx[r], at_s)
            else:
                out = grad_x[r] if direct else work[: xc.shape[0]]
                gc = torch.sub(xc, base[r, None], out=out).exp_().mul_(coef[r, None]).scatter_(-1, idx[r], at_s)
            if weight is None:
                if not direct:
                    grad_x[r] = gc
                continue
            gc /= ctx.temp  # masked (padded) ids: exp(-inf) = 0, no gradient
            grad_x[r] = gc @ w
            if grad_w is not None:
                grad_w.addmm_(gc.T, x[r].to(dt))
            if grad_b is not None:
                grad_b += gc.sum(0)
        return grad_x.to(x.dtype), _cast(grad_w, weight), _cast(grad_b, bias), None, None, None, None, None, None


def _cast(t: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if t is None or like is None else t.to(like.dtype)


def gather_logprobs(x: Logits, idx: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """log-softmax at idx, the log-mass of every id not at a live slot, and the entropy (module docstring).

    x: logits [N, V] (-inf allowed for masked tokens) or a 2-D `LMHead`; idx [N, W] long; mask [N, W] bool with
    slot 0 live and distinct live ids per row. Returns logp [N, W] (masked slots: slot 0's value, no gradient),
    log_rest [N] (-inf when nothing is left), entropy [N] (no gradient); float32, or float64 for float64 inputs.
    """
    idx = torch.where(mask, idx, idx[:, :1])
    per = _rows_per_chunk(x)
    if isinstance(x, LMHead):
        vocab = x.weight.shape[0] if x.vocab_size is None else x.vocab_size
        return _GatherLogprobs.apply(x.hidden, x.weight, x.bias, idx, mask, x.temperature, vocab, per, x.compiled)
    return _GatherLogprobs.apply(x, None, None, idx, mask, 1.0, x.shape[-1], per, False)


@torch.no_grad()
def topk(x: Logits, k: int) -> Tensor:
    """[N, min(k, V)] ids of the k largest logits per row, sorted by value (chunked; no gradient)."""
    k = min(k, x.shape[-1])
    if not isinstance(x, LMHead):
        return x.detach().topk(k, dim=-1).indices
    return torch.cat([x.logits(r).topk(k, dim=-1).indices for r in _chunks(x.shape[0], _rows_per_chunk(x))])
