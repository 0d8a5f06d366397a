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

LoRA (troll.lora: rank-r adapters on a frozen base; `lora_peak_bytes`), the same N and s:

    peak  = lora_fixed + lora_extra + act x N + [unchunked only] s x N x V x LOGIT_BYTES
    lora_fixed = 2 x params      the frozen base in bf16 (policy.base_dtype; 4 x params without bf16)
          + 16 x adapters        float32 adapters, grads, AdamW exp_avg and exp_avg_sq
          + 2 x adapters         autocast's bf16 copies of the adapters (bf16 only; the base is bf16 already)
          + RUNTIME
    adapters = L x r x sum (in + out) over the adapted linears (`lora_params`; all-linear: q, k, v, o, gate, up,
                                 down, not the output layer, so no [V, H] gradient anywhere)
    lora_extra = 2 x rows x V x 4   the chunked head's forward buffers (work, shifted: troll.head), rows =
                                 min(chunk, s x N): measured, the update peak's intercept (1.26 GB at 1,024 rows of
                                 151,936, both widths measured; 2 x 1,024 x 151,936 x 4 = 1.245 GB); at 262 rows
                                 0.36 GB measured, 0.33 predicted. It is the whole extra: the base has no gradient
          + [bf16] 4 x V x H + 2 x rows x V   derived, not measurable on CPU: the head's backward makes a float32
                                 copy of the bf16 output layer (weight.to(float32)), its forward a bf16 chunk of
                                 logits before the float32 copy
    act (`lora_act_bytes`) = L x H x 4 + other + layer   with checkpointing: the layer inputs kept for the
                                 recompute, the rest of the forward (embedding output, last hidden states, the head's
                                 input: `other`), and the saved activations of the one layer being recomputed in
                                 backward (`layer`); without: L x layer + other
    LoRA measured (CPU, float32, rank 32, the model cut to 2 layers at the full width, 1,274 and 2,548 tokens):
        other = slope(ckpt on) - 2 x H x 4; layer = (slope(ckpt off) - other) / 2: qwen3-0.6b and qwen3-1.7b
    LoRA derived: the 4B and 8B widths (too large for float32 on this machine) scale the measured widths'
        figures per unit of width (`LORA`'s comment); every depth adds H x 4 per layer (a checkpointed input).
        Checked at the whole Qwen3-1.7B (28 layers, 1,274 tokens): 1.60 GB over the fixed cost measured, 1.58
        GB extrapolated from 2 layers without the recompute layer, 1.82 GB by the model (measured / model 0.88)

Like full fine-tuning's, the peak is an upper bound: the head's buffers peak in the forward, one layer's
recompute in the backward, and the model adds both. The adapters' rank changes only the r-wide A x outputs among
the activations (7 x r x 4 B a layer a token: 0.9 kB at r = 32).

vLLM colocated, sleeping (`phases`, `Run`, `colocated_micro_batch_tokens`): after each rollout the engine sleeps at
level 1 (its weights to CPU memory, its KV cache freed) until the next push, so a step has two phases:
    generation  the trainer's resident state (`trainer_resident_bytes`: LoRA base + 12 B per adapter, full FT
                12 B/param; + RUNTIME) + vLLM's share (gpu_memory_utilization x GPU) <= GPU
    vLLM        its share >= `vllm_min_bytes`: bf16 weights (2 B/param) + VLLM_RUNTIME (2 GiB; assumed) + a KV
                cache of KV_TOKENS (one prompt's 8 samples at max_model_len 1,536) x `kv_bytes_per_token`
                (2 x L x kv_heads x head_dim x 2 B)
    update      the trainer's peak + VLLM_ASLEEP (1 GiB; assumed) <= (1 - margin) x GPU; vLLM awake (no sleep):
                the trainer's peak <= (1 - margin) x (1 - fraction) x GPU, micro_batch_tokens' rule
`vllm_fractions` gives the range of fractions that hold the first two; `fits_table` (troll memory) the
table of docs/results.md#what-fits-where. The generation phase assumes the trainer's allocator returned the
update's cached blocks before the engine wakes (torch.cuda.empty_cache). `micro_batch_tokens` (full fine-tuning,
vLLM awake) is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
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
        "Qwen/Qwen3-1.7B": "qwen3-1.7b",
        "Qwen/Qwen3-4B": "qwen3-4b",
        "Qwen/Qwen3-8B": "qwen3-8b",
        "meta-llama/Llama-3.1-8B-Instruct": "llama3.1-8b",
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


# ----------------------------------------------------------------------------- the architectures' arithmetic

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # what all-linear adapts


def arch(model: str) -> dict:
    """The architecture (troll.models.standin.ARCHS) of a short name or hub name (`HUB_NAMES`)."""
    from troll.models.standin import ARCHS

    name = HUB_NAMES.get(model, model).lower()
    if name not in ARCHS:
        raise ValueError(f"no architecture for {model!r}: one of {sorted(ARCHS)} or a hub name in HUB_NAMES")
    return ARCHS[name]


def linear_shapes(model: str) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of one decoder layer: q = heads x head_dim, kv = kv_heads x head_dim,
    H = hidden, I = MLP width: q (H, q), k and v (H, kv), o (q, H), gate and up (H, I), down (I, H)."""
    a = arch(model)
    q, kv, h, i = a["heads"] * a["head_dim"], a["kv"] * a["head_dim"], a["hidden"], a["mlp"]
    return dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h), gate_proj=(h, i), up_proj=(h, i),
                down_proj=(i, h))  # fmt: skip


def arch_params(model: str, vocab: int | None = None) -> int:
    """Parameters of the architecture, a tied embedding counted once:
    V x H x (1 tied, 2 untied) + H (final norm) + L x (sum of in x out over the linears + 2 H (norms)
    + q + 2 kv (Qwen2's q/k/v bias) + 2 head_dim (Qwen3's q/k RMSNorm)). `vocab`: the output rows (None: the
    architecture's own)."""
    a = arch(model)
    lin = linear_shapes(model)
    q, kv = lin["q_proj"][1], lin["k_proj"][1]
    layer = sum(i * o for i, o in lin.values()) + 2 * a["hidden"]
    layer += (q + 2 * kv) * (a["arch"] == "qwen2") + 2 * a["head_dim"] * (a["arch"] == "qwen3")
    v = vocab or a["vocab"]
    return v * a["hidden"] * (1 if a["tied"] else 2) + a["hidden"] + a["layers"] * layer


def lora_params(model: str, rank: int, targets: str = "all-linear") -> int:
    """Adapter parameters: L x r x sum over the adapted linears of (in + out) (A is [r, in], B is [out, r]).
    `targets`: "all-linear" (every decoder linear, PEFT's rule: not the output layer) or comma-separated names."""
    lin = linear_shapes(model)
    names = [t.strip() for t in targets.split(",") if t.strip()]
    names = list(LINEARS) if names == ["all-linear"] else names
    if unknown := [n for n in names if n not in lin]:
        raise ValueError(f"lora targets {unknown} are not linear layers of {model!r}: {list(lin)}")
    return arch(model)["layers"] * rank * sum(sum(lin[n]) for n in names)


def kv_bytes_per_token(model: str, dtype_bytes: int = 2) -> int:
    """vLLM's KV cache per token: keys and values, every layer, every KV head: 2 x L x kv_heads x head_dim x 2 B."""
    a = arch(model)
    return 2 * a["layers"] * a["kv"] * a["head_dim"] * dtype_bytes


# ----------------------------------------------------------------------------- LoRA (troll.lora)


@dataclass(frozen=True)
class LoraShape:
    """A LoRA update's activations per padded token, float32 bytes (module docstring): `other`, what the forward
    holds besides the checkpointed layer inputs (embedding output, last hidden states, the head's input), and
    `layer`, one decoder layer's saved activations (all of them without checkpointing; with it, what the layer
    being recomputed in backward holds)."""

    other: float
    layer: float


CHUNK = 1024  # the presets' logits_chunk
HEAD_BUFFERS = 2  # the chunked head's [rows, V] float32 buffers in its forward (head._GatherLogprobs: work, shifted)
# Measured on CPU in float32 with rank-32 adapters on all-linear, checkpointing on and off, chunked head of 1,024
# rows, at 2 layers of the full width (bench/real_shapes.py --lora 32 --layers 2 --response 1024 --rows 1,2
# --ckpt on / off: 1,274 and 2,548 tokens): other = slope(ckpt on) - 2 x H x 4, layer = (slope(ckpt off) - other)
# / 2; slopes (kB/token) on / off: qwen3-0.6b 28.7 / 273.8, qwen3-1.7b 50.9 / 415.4. The runs:
# docs/results.md#real-shapes-without-a-gpu. Derived for the widths not measured: other = 5 x H x 4 (measured 5.0
# and 4.2 x H x 4), layer = 1.07 x 4 x (5 H + 3 (q + 2 kv) + 4 I), a count of one layer's saved tensors (norm
# inputs and outputs, q, k, v before and after RoPE and attention, gate, up, their product and the down input),
# scaled by the larger of the measured ratios (1.07 at qwen3-0.6b, 1.01 at qwen3-1.7b).
LORA: MappingProxyType[str, LoraShape] = MappingProxyType(
    {
        "qwen3-0.6b": LoraShape(other=28.7e3 - 2 * 1024 * 4, layer=(273.8e3 - (28.7e3 - 2 * 1024 * 4)) / 2),
        "qwen3-1.7b": LoraShape(other=50.9e3 - 2 * 2048 * 4, layer=(415.4e3 - (50.9e3 - 2 * 2048 * 4)) / 2),
        "qwen3-4b": LoraShape(other=5 * 2560 * 4, layer=1.07 * 4 * (5 * 2560 + 3 * (4096 + 2048) + 4 * 9728)),
        "qwen3-8b": LoraShape(other=5 * 4096 * 4, layer=1.07 * 4 * (5 * 4096 + 3 * (4096 + 2048) + 4 * 12288)),
        "llama3.1-8b": LoraShape(other=5 * 4096 * 4, layer=1.07 * 4 * (5 * 4096 + 3 * (4096 + 2048) + 4 * 14336)),
    }
)
LORA_MEASURED = ("qwen3-0.6b", "qwen3-1.7b")  # the rest of LORA is derived


def lora_shape(model: str) -> LoraShape:
    """The LoRA activation terms of a short or hub name (`LORA`)."""
    name = HUB_NAMES.get(model, model).lower()
    if name not in LORA:
        raise ValueError(f"no LoRA terms for {model!r}: one of {sorted(LORA)}")
    return LORA[name]


def lora_act_bytes(model: str, grad_checkpointing: bool = True) -> float:
    """Activation bytes per padded token of a LoRA update, float32: with checkpointing the layer inputs, the rest of
    the forward and one layer being recomputed, L x H x 4 + other + layer; without, L x layer + other."""
    a, s = arch(model), lora_shape(model)
    if grad_checkpointing:
        return a["layers"] * a["hidden"] * 4 + s.other + s.layer
    return a["layers"] * s.layer + s.other


def lora_fixed_bytes(model: str, rank: int = 32, targets: str = "all-linear", bf16: bool = True) -> float:
    """The frozen base (2 B/param in bf16, else 4), the adapters' float32 weights, grads, AdamW exp_avg and
    exp_avg_sq (16 B/param) and, under bf16 autocast, their bf16 copies (2 B/param), and RUNTIME."""
    base, adapters = arch_params(model), lora_params(model, rank, targets)
    return base * (2 if bf16 else 4) + adapters * (18 if bf16 else 16) + RUNTIME


def lora_extra_bytes(model: str, completion_rows: float = CHUNK, chunk: int = CHUNK, bf16: bool = True) -> float:
    """Per micro-batch: the chunked head's HEAD_BUFFERS float32 [rows, V] buffers, rows = min(chunk,
    completion_rows) (measured: the intercept); under bf16 (a bf16 output layer, GPU; derived) also the head's
    float32 copy of the output layer in backward (4 x V x H) and its bf16 chunk logits (2 x rows x V)."""
    a = arch(model)
    rows = min(chunk, completion_rows)
    out = HEAD_BUFFERS * rows * a["vocab"] * 4
    return out + (4 * a["vocab"] * a["hidden"] + 2 * rows * a["vocab"] if bf16 else 0.0)


def lora_peak_bytes(
    model: str,
    tokens: int,
    rank: int = 32,
    targets: str = "all-linear",
    bf16: bool = True,
    grad_checkpointing: bool = True,
    chunk: int = CHUNK,
    completion_share: float = GSM8K_COMPLETION_SHARE,
    activation_scale: float = 1.0,
) -> float:
    """Peak GPU bytes of one LoRA update on `tokens` padded tokens, the head in `chunk`-row chunks (0: full
    logits) (module docstring): lora_fixed + lora_extra + (act + [unchunked] share x V x LOGIT_BYTES) x tokens."""
    act = lora_act_bytes(model, grad_checkpointing) * activation_scale
    logits = 0.0 if chunk else completion_share * arch(model)["vocab"] * LOGIT_BYTES
    extra = lora_extra_bytes(model, completion_share * tokens if chunk else 0.0, chunk, bf16 and chunk > 0)
    return lora_fixed_bytes(model, rank, targets, bf16) + extra + (act + logits) * tokens


def lora_cpu_excess(
    model: str, tokens: int, completion_rows: int, rank: int = 32, first_step: bool = True, anchor_rows: int = 0
) -> float:
    """What `troll check` on CPU (float32, no autocast, chunked head of CHUNK rows, checkpointing on)
    measures of a LoRA step's update window (the end of a rollout to the push): its peak resident memory over what
    was resident when the window opened. The base, the adapters and, after step 1, their gradients (left by the
    previous step's last backward) and AdamW states are resident then and cancel. What is left is the larger of
    - the update: lora_extra (at min(CHUNK, completion_rows) head rows) + act_ckpt x tokens, + in step 1 the
      adapters' gradients and AdamW states (12 B/param), allocated for the first time;
    - the old policy's no-grad pass over the batch (troll.train.old_policy), `anchor_rows` completion rows in one
      micro-batch: the head's buffers at min(CHUNK, anchor_rows) rows (its activations are freed layer by layer).
    With short rows after step 1 the second is the larger (the dress rehearsal, docs/results.md)."""
    update = lora_extra_bytes(model, completion_rows, CHUNK, bf16=False) + lora_act_bytes(model) * tokens
    update += lora_params(model, rank) * 12 if first_step else 0.0
    return max(update, lora_extra_bytes(model, anchor_rows, CHUNK, bf16=False))


# ----------------------------------------------------------------------------- vLLM colocated: two phases

VLLM_ASLEEP = 1 * GIB  # what a sleeping engine (level 1) keeps on the GPU: CUDA graphs, unpooled blocks (assumed)
VLLM_RUNTIME = 2 * GIB  # inside vLLM's share besides weights and KV cache: its profiled activations (assumed)
MAX_MODEL_LEN = 1536  # the GSM8K presets' engine: max_prompt_len 512 + max_new_tokens 1,024
KV_TOKENS = 8 * MAX_MODEL_LEN  # the least KV cache sized here: one prompt's 8 samples at full length


def vllm_min_bytes(model: str, kv_tokens: int = KV_TOKENS) -> float:
    """The least vLLM's share (gpu_memory_utilization x GPU) must hold: bf16 weights (2 B/param) + VLLM_RUNTIME +
    a KV cache of `kv_tokens` tokens (kv_bytes_per_token each)."""
    return 2 * arch_params(model) + VLLM_RUNTIME + kv_tokens * kv_bytes_per_token(model)


def trainer_resident_bytes(model: str, lora_rank: int = 0, targets: str = "all-linear", bf16: bool = True) -> float:
    """What the trainer keeps on the GPU while vLLM generates: full fine-tuning 12 B/param (float32 weights, AdamW
    exp_avg and exp_avg_sq; the gradients are freed by zero_grad); LoRA the base (2 B/param in bf16, else 4) and
    12 B per adapter parameter; + RUNTIME. Assumes the trainer's allocator has returned its cached blocks (the
    update's activations) before the engine wakes (torch.cuda.empty_cache)."""
    if not lora_rank:
        return 12 * shape(model).params + RUNTIME
    return arch_params(model) * (2 if bf16 else 4) + 12 * lora_params(model, lora_rank, targets) + RUNTIME


@dataclass(frozen=True)
class Phases:
    """GPU bytes in each phase of a colocated step, and what must hold (`problems` empty):

    generation  trainer resident + vLLM's share (fraction x GPU) <= GPU
    vLLM        its share >= its weights + runtime + the least KV cache (vllm_min_bytes)
    update      asleep (level 1): trainer peak + VLLM_ASLEEP <= (1 - margin) x GPU
                awake: trainer peak <= (1 - margin) x (1 - fraction) x GPU (micro_batch_tokens' rule)
    """

    gpu: float
    generation: float
    vllm_share: float
    vllm_need: float
    update: float
    update_budget: float

    @property
    def problems(self) -> list[str]:
        gib = lambda x: f"{x / GIB:.1f} GiB"  # noqa: E731
        out = []
        if self.generation > self.gpu:
            out.append(f"generation: trainer + vLLM need {gib(self.generation)} of {gib(self.gpu)}")
        if self.vllm_share < self.vllm_need:
            out.append(f"vLLM: its share {gib(self.vllm_share)} < weights + runtime + KV {gib(self.vllm_need)}")
        if self.update > self.update_budget:
            out.append(f"update: {gib(self.update)} > {gib(self.update_budget)}")
        return out


@dataclass(frozen=True)
class Run:
    """What sizes a colocated run besides the micro-batch: vLLM's fraction of the GPU (0: no engine), LoRA rank (0:
    full fine-tuning) and targets, bf16 autocast (LoRA: a bf16 base), gradient checkpointing, the head's chunk rows
    (0: full logits), whether vLLM sleeps during the update, the margin left free, the least KV cache, and
    peak_bytes' two scale factors."""

    vllm_fraction: float = 0.3
    lora_rank: int = 0
    targets: str = "all-linear"
    bf16: bool = True
    grad_checkpointing: bool = True
    chunk: int = CHUNK
    sleep: bool = True
    margin: float = 0.1
    kv_tokens: int = KV_TOKENS
    completion_share: float = GSM8K_COMPLETION_SHARE
    activation_scale: float = 1.0


def phases(model: str, gpu_gb: float, tokens: int, run: Run = Run()) -> Phases:
    """The two phases of a step with vLLM colocated (`Phases`), for a micro-batch of `tokens`."""
    gpu, share = gpu_gb * GIB, run.vllm_fraction * gpu_gb * GIB
    per_token = (run.completion_share, run.activation_scale)
    if run.lora_rank:
        ckpt, chunk = run.grad_checkpointing, run.chunk
        trainer = lora_peak_bytes(model, tokens, run.lora_rank, run.targets, run.bf16, ckpt, chunk, *per_token)
    else:
        trainer = peak_bytes(model, tokens, run.grad_checkpointing, run.chunk > 0, *per_token)
    resident = trainer_resident_bytes(model, run.lora_rank, run.targets, run.bf16)
    engine = run.vllm_fraction > 0
    if run.sleep and engine:
        update, budget = trainer + VLLM_ASLEEP, (1 - run.margin) * gpu
    else:
        update, budget = trainer, (1 - run.margin) * (gpu - share)
    need = vllm_min_bytes(model, run.kv_tokens) if engine else 0.0
    return Phases(gpu, resident + share, share, need, update, budget)


def lora_run(
    rank: int,
    vllm_fraction: float,
    targets: str = "all-linear",
    bf16: bool = True,
    grad_checkpointing: bool = True,
    chunk: int = CHUNK,
) -> Run:
    """The Run of a LoRA config (Config's lora_rank, vllm_gpu_memory, lora_targets, bf16, grad_checkpointing,
    logits_chunk): vLLM, when there is one (fraction > 0), sleeps during the update, as VLLMGenerator does on a
    GPU (sleep_level 1)."""
    return Run(vllm_fraction, rank, targets, bf16, grad_checkpointing, chunk, sleep=vllm_fraction > 0)


def colocated_micro_batch_tokens(model: str, gpu_gb: float, run: Run = Run(), min_tokens: int = 1024) -> int:
    """The largest 2^k or 1.5 x 2^k tokens >= min_tokens at which both phases fit (`phases`). ValueError naming
    the phase that does not fit."""
    if not 0 <= run.vllm_fraction < 1 or not 0 <= run.margin < 1 or gpu_gb <= 0:
        raise ValueError(f"need gpu_gb > 0 and vllm_fraction, margin in [0, 1); got {gpu_gb}, {run.vllm_fraction}, "
                         f"{run.margin}")  # fmt: skip
    fits = [n for n in candidates(min_tokens) if not phases(model, gpu_gb, n, run).problems]
    if not fits:
        what = f"LoRA rank {run.lora_rank}" if run.lora_rank else "full fine-tuning"
        why = "; ".join(phases(model, gpu_gb, min_tokens, run).problems)
        raise ValueError(f"{model!r} ({what}) does not fit {gpu_gb} GiB at vLLM {run.vllm_fraction:.0%}, "
                         f"{min_tokens} tokens: {why}")  # fmt: skip
    return fits[-1]


def vllm_fractions(model: str, gpu_gb: float, run: Run = Run(), step: float = 0.05) -> tuple[float, float]:
    """(least, most) vLLM fraction in multiples of `step`: the least holds vLLM's weights, runtime and least KV
    cache (vllm_min_bytes), the most leaves the trainer's resident state room while vLLM generates. The least
    above the most: no fraction works."""
    need = vllm_min_bytes(model, run.kv_tokens) / (gpu_gb * GIB)
    room = 1 - trainer_resident_bytes(model, run.lora_rank, run.targets, run.bf16) / (gpu_gb * GIB)
    return round(math.ceil(need / step - 1e-9) * step, 4), round(math.floor(room / step + 1e-9) * step, 4)


# ----------------------------------------------------------------------------- the fits table

PAPER_MODELS = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "llama3.1-8b")


def fits_cell(model: str, gpu_gb: float, rank: int = 32) -> str:
    """One cell of `fits_table`: the micro-batch with vLLM asleep during the update at the least vLLM fraction,
    the fractions that work, and (in brackets) the micro-batch with vLLM awake; or why it does not fit."""
    lo, hi = vllm_fractions(model, gpu_gb, lora_run(rank, 0.5))
    if lo > hi:
        return f"does not fit (vLLM needs {lo:.2f}, the trainer leaves {hi:.2f})"
    try:
        n = colocated_micro_batch_tokens(model, gpu_gb, lora_run(rank, lo))
    except ValueError:
        return f"does not fit (update; vLLM {lo:.2f}-{hi:.2f})"
    try:
        awake = f"{colocated_micro_batch_tokens(model, gpu_gb, dataclasses.replace(lora_run(rank, lo), sleep=False)):,}"
    except ValueError:
        awake = "none"
    return f"{n:,} (awake: {awake}); vLLM {lo:.2f}-{hi:.2f}"


def fits_table(models: tuple[str, ...] = PAPER_MODELS, gpus: tuple[float, ...] = (24, 40, 80), rank: int = 32) -> str:
    """The markdown table of docs/results.md#what-fits-where for LoRA: `fits_cell` per model and GPU (GiB)."""
    lines = ["| model, LoRA rank " + str(rank) + " | " + " | ".join(f"{g:g} GB" for g in gpus) + " |"]
    lines.append("| --- |" + " --- |" * len(gpus))
    for m in models:
        lines.append(f"| {m} | " + " | ".join(fits_cell(m, g, rank) for g in gpus) + " |")
    return "\n".join(lines)


if __name__ == "__main__":  # troll memory: the table; it takes no flags
    from troll.base.cli import Parser, run_command

    Parser(prog="troll memory", description=__doc__.splitlines()[0]).parse_args()
    run_command("troll memory", lambda: print(fits_table()))
