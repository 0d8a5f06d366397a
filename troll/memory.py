"""Peak GPU memory of one update step, and the largest micro-batch (`micro_batch_tokens`) that fits.

Model, for a micro-batch of N padded tokens (prompt + completion columns, what `Config.micro_batch_tokens`
counts), a share s of them completion positions (GSM8K presets: prompt <= 250, completion <= 1,024, s = 0.8):

    peak  = fixed + extra + act x N + [unchunked only] s x N x V x LOGIT_BYTES
    fixed = 16 x params          float32 weights, grads, AdamW exp_avg and exp_avg_sq (policy.build_model loads
                                 float32 and computes under bf16 autocast: no separate master copy)
          + 2 x params           autocast's bf16 copy of every weight, held from forward to backward
          + RUNTIME              CUDA context, cuBLAS workspaces, allocator slack (1 GiB; assumed, not measured)
    extra                        per micro-batch, independent of N: the dense [V, H] float32 gradients of the tied
                                 output layer and embedding before they are summed into .grad, the chunked head's
                                 [chunk, V] buffers. Measured: update peak (end of backward) - fixed - 4 B/param.
    act                          activation bytes per token saved for backward. Without checkpointing: measured,
                                 slope of the forward's peak (graph built, no grad yet) over tokens. With it: the
                                 layer inputs plus one layer being recomputed, L x H x 4 + act_full / L (derived:
                                 about 0.2 MB/token, below the CPU measurement's noise of ~0.1 GB at <= 1,024 tokens)
    LOGIT_BYTES = 12             the unchunked path's [N, V] float32 logits, their /temperature and padded-vocab
                                 copies alive at once (policy.packed_logits); measured 12.0 on CPU (forward and
                                 old-policy pass alike); on GPU the bf16 output + float32 copies give <= 12

The terms add up although the activation peak (end of forward) and the gradient peak (end of backward) come at
different times, so the model is an upper bound. Measured on CPU in float32 (bench/real_shapes.py: random-weight
models with the published shapes, rows of 512 tokens, 1 and 2 rows). Derivation to a GPU run with bf16
autocast: fixed, extra and LOGIT_BYTES do not scale (float32 either way); activations would (matmul outputs are
saved in bf16: about half) except RMSNorm inputs, the residual stream and softmax statistics, which stay float32.
`activation_scale` (default 1.0) keeps the float32 figure, an upper bound; 0.5 is the optimistic bound.

The GPU also holds vLLM (colocated rollouts): `vllm_fraction` (Config.vllm_gpu_memory) of the whole memory is
vLLM's, so the trainer gets (1 - vllm_fraction) x gpu_gb GiB, of which `margin` (10%) is left free. Candidate
sizes are 2^k and 1.5 x 2^k tokens; `micro_batch_tokens` returns the largest that fits and raises ValueError when
not even `min_tokens` (default 1,024: a single short GSM8K row) does.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

GIB = 1 << 30
RUNTIME = 1 * GIB
VOCAB = 151_936
LOGIT_BYTES = 12.0  # measured (module docstring)
GSM8K_COMPLETION_SHARE = 0.8  # 1,024 completion columns of a 1,274-column row (250-token prompts)


@dataclass(frozen=True)
class Shape:
    """What the memory model needs of a model: parameter count, output vocabulary, per-token activations with
    and without gradient checkpointing (bytes, float32), and the per-micro-batch extra (bytes)."""

    params: int
    vocab: int
    act_ckpt: float
    act_full: float
    extra: float


# Fitted on CPU in float32 from `python bench/real_shapes.py --models M --losses troll --heads chunked --ckpt on,off
# --rows 1,2` (512 and 1,024 tokens; its "fit" section): act_full = slope of the "fwd" peak with checkpointing off;
# extra = update peak - fixed - 4 x params (checkpointing on); act_ckpt derived (module docstring): L x H x 4 +
# act_full / L. LOGIT_BYTES from the same command with --heads chunked,full. The runs and the machine:
# docs/results.md#real-shapes-without-a-gpu; the sizes they give: docs/results.md#what-fits-where.
MEASURED: MappingProxyType[str, Shape] = MappingProxyType(
    {  # params (exact), V, act_ckpt = L x H x 4 + act_full / L, act_full (measured), extra (measured)
        "qwen2.5-0.5b": Shape(494_032_768, VOCAB, act_ckpt=24 * 896 * 4 + 3.084e6 / 24, act_full=3.084e6, extra=1.21e9),
        "qwen3-0.6b": Shape(596_049_920, VOCAB, act_ckpt=28 * 1024 * 4 + 4.229e6 / 28, act_full=4.229e6, extra=1.36e9),
        "qwen2.5-1.5b": Shape(
            1_543_714_304, VOCAB, act_ckpt=28 * 1536 * 4 + 6.057e6 / 28, act_full=6.057e6, extra=1.12e9
        ),
    }
)
HUB_NAMES = MappingProxyType(
    {
        "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b",
        "Qwen/Qwen3-0.6B": "qwen3-0.6b",
        "Qwen/Qwen2.5-1.5B-Instruct": "qwen2.5-1.5b",
    }
)


def shape(model: str | Shape) -> Shape:
    """A measured Shape by short name (`MEASURED`) or hub name (`HUB_NAMES`), or the Shape given."""
    if isinstance(model, Shape):
        return model
    name = HUB_NAMES.get(model, model).lower()
    if name not in MEASURED:
        raise ValueError(f"no measured shape for {model!r}: one of {sorted(MEASURED)} or a Shape")
    return MEASURED[name]


def fixed_bytes(params: int) -> float:
    """Weights, grads and AdamW states in float32 (16 B/param), autocast's bf16 copies (2 B/param), runtime."""
    return 18 * params + RUNTIME


def peak_bytes(
    model: str | Shape,
    tokens: int,
    grad_checkpointing: bool = True,
    chunked: bool = True,
    completion_share: float = GSM8K_COMPLETION_SHARE,
    activation_scale: float = 1.0,
) -> float:
    """Peak GPU bytes of one update on a micro-batch of `tokens` padded tokens (module docstring)."""
    s = shape(model)
    act = (s.act_ckpt if grad_checkpointing else s.act_full) * activation_scale
    logits = 0.0 if chunked else completion_share * s.vocab * LOGIT_BYTES
    return fixed_bytes(s.params) + s.extra + (act + logits) * tokens


def candidates(lo: int, hi: int = 1 << 22) -> list[int]:
    """2^k and 1.5 x 2^k in [lo, hi], ascending."""
    out, k = [], 1
    while k <= hi:
        out += [c for c in (k, 3 * k // 2) if lo <= c <= hi]
        k *= 2
    return sorted(set(out))


def micro_batch_tokens(
    model: str | Shape,
    gpu_gb: float,
    vllm_fraction: float = 0.3,
    grad_checkpointing: bool = True,
    chunked: bool = True,
    margin: float = 0.1,
    min_tokens: int = 1024,
    completion_share: float = GSM8K_COMPLETION_SHARE,
    activation_scale: float = 1.0,
) -> int:
    """The largest 2^k or 1.5 x 2^k tokens >= min_tokens whose peak fits in (1 - margin) of the trainer's share
    of a `gpu_gb` GiB GPU, (1 - vllm_fraction) x gpu_gb. ValueError when even min_tokens does not fit."""
    if not 0 <= vllm_fraction < 1 or not 0 <= margin < 1 or gpu_gb <= 0:
        raise ValueError(
            f"need gpu_gb > 0 and vllm_fraction, margin in [0, 1); got {gpu_gb}, {vllm_fraction}, {margin}"
        )
    budget = (1 - vllm_fraction) * gpu_gb * GIB * (1 - margin)
    fits = [
        n
        for n in candidates(min_tokens)
        if peak_bytes(model, n, grad_checkpointing, chunked, completion_share, activation_scale) <= budget
    ]
    if not fits:
        need = peak_bytes(model, min_tokens, grad_checkpointing, chunked, completion_share, activation_scale)
        raise ValueError(
            f"{model!r} does not fit: {min_tokens} tokens need {need / GIB:.1f} GiB, the trainer has "
            f"{budget / GIB:.1f} GiB of {gpu_gb} GiB (vLLM {vllm_fraction:.0%}, margin {margin:.0%})"
        )
    return fits[-1]
