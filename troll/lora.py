"""LoRA adapters on a frozen base: the policy's trained weights are two small matrices per adapted layer (PEFT).

    W x  ->  W x + (alpha / r) B A x      W [out, in] frozen; A [r, in], B [out, r] trained, B = 0 at the start

    model = add_adapters(base, rank=32, alpha=32, targets="all-linear")   # a PeftModel: pi_theta = the base at first
    model = load_adapters(base, "runs/x/checkpoints/step-000250")         # a checkpoint's adapters, trainable
    base_weights(model)     # {name: tensor}: the frozen base under the base model's own names (the engine's first load)
    engine_weights(model)   # iterator of (name, tensor): what a sampler needs after an update
    merge(model)            # a plain transformers model, W + (alpha / r) B A: `save_pretrained` it to export

    troll export runs/x --out runs/x/merged   # a run's newest checkpoint (or a checkpoint folder), merged

TROLL does not care how the policy is parametrised: the projection bounds each token's output distribution,
KL(pi* || q) <= eps, whatever moved the logits (docs/algorithm.md, section 13). What LoRA changes is what trains,
what a checkpoint holds, what the sampler receives, and the memory budget (troll.models.memory).

Choices:
- PEFT's LoRA (`peft`, an optional extra like vLLM), not a hand-written one: its checkpoints are what the ecosystem
  loads. `all-linear` adapts every linear layer of the decoder and not the output layer (PEFT's rule), so the tied
  embedding stays frozen and has no [V, H] gradient.
- No dropout: the loss scores the policy that sampled; dropout would make the trainer's pi differ from the sampler's.
- The base is held in bfloat16 when the run computes under bf16 autocast (`Config.bf16`, the GPU presets): 2
  bytes a parameter instead of 4, nothing else to keep for a frozen weight. The adapters, their gradients and
  AdamW states are float32 (PEFT casts adapters up). On CPU (tests, the tiny task) everything is float32.
- The sampler gets `engine_weights`: every tensor under the base model's names, each adapted weight merged out of
  place in float32 (W + (alpha / r) B A), so the trainer's W is never rounded (merging in place and unmerging,
  TRL's way, adds the bf16 rounding of every merge to the base). Every tensor, not only the adapted ones: vLLM's
  in-place reload works layer by layer (a fused q/k/v projection, its bias) and warns for each layer a push
  leaves out, so a partial push leans on its internals for a saving of the embeddings alone (all-linear adapts
  the rest). In a
  bf16 engine the merged weight is rounded once: a sampler mismatch like any other, logged as `mismatch_*` and
  corrected by `--is_correction tis` (docs/algorithm.md, section 10).
- A checkpoint holds the adapters and the optimiser, not the base: the base is `Config.model`, or `<out>/base` for a
  base the run itself changed (the tiny task's supervised warm-start), written once before the first update.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

ADAPTER = "default"  # PEFT's name for a model's single adapter
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")


def import_peft() -> Any:
    """The `peft` package, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError:
        raise ImportError("LoRA (lora_rank > 0) needs the optional peft package: pip install -e '.[lora]'") from None
    return peft


def is_lora(model: Any) -> bool:
    """`model` is a PeftModel (adapters on a frozen base; the transformers model inside it is not)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def is_adapter_checkpoint(path: str | Path) -> bool:
    """`path` is a folder of adapters (PEFT's adapter_config.json), not of a whole model."""
    return (Path(path) / "adapter_config.json").is_file()


def targets(spec: str) -> str | list[str]:
    """`Config.lora_targets` for PEFT: "all-linear", or the comma-separated module names as a list."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    return "all-linear" if names == ["all-linear"] else names


def check_targets(model: Any, spec: str) -> None:
    """ValueError unless every comma-separated name in `spec` (Config.lora_targets) matches a layer of `model` that
    LoRA adapts, by PEFT's rule (a module named it, or whose name ends in "." + it). PEFT itself drops a name that
    matches nothing when another name matches, so a typo would train fewer layers in silence. all-linear always
    matches. The message lists the model's linear layer names."""
    names = targets(spec)
    if names == "all-linear":
        return
    adaptable = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)
    modules = [n for n, m in model.named_modules() if isinstance(m, adaptable) or type(m).__name__ == "Conv1D"]
    unmatched = [t for t in names if not any(m == t or m.endswith(f".{t}") for m in modules)]
    if unmatched:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ValueError(
            f"--lora_targets {spec}: {', '.join(unmatched)} matches no layer of the model; its linear layers are "
            f"{', '.join(linear)} (or pass all-linear)"
        )


def add_adapters(model: Any, rank: int, alpha: float, target: str = "all-linear") -> Any:
    """New rank-`rank` adapters on `model`, whose own weights are frozen: a PeftModel that computes exactly `model`
    (B = 0) until it is trained. ValueError when `target` names no layer of the model."""
    peft = import_peft()
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets(target), lora_dropout=0.0, bias="none")
    return _trainable(peft.get_peft_model(model, config))


def load_adapters(model: Any, path: str | Path) -> Any:
    """The adapters saved in `path` (a checkpoint) on `model`, trainable, float32."""
    return _trainable(import_peft().PeftModel.from_pretrained(model, str(path), is_trainable=True))


def _trainable(model: Any) -> Any:
    """Gradient checkpointing's recomputed blocks need an input that requires grad; the frozen embedding gives none,
    so its output is made to (what PEFT's own training recipes do)."""
    if getattr(model.get_base_model(), "is_gradient_checkpointing", False):
        model.enable_input_require_grads()
    return model


def unwrap(model: Any) -> Any:
    """The transformers model inside a LoRA model (its linear layers carry the adapters), or `model` itself."""
    return model.get_base_model() if is_lora(model) else model


def base_weights(model: Any) -> dict[str, Tensor]:
    """The base's tensors under the base model's own names (no copies): a plain model's state dict, or a LoRA
    model's with the adapters left out and `.base_layer.` removed."""
    if not is_lora(model):
        return model.state_dict()
    state = model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if ".lora_" not in k}


@torch.no_grad()
def engine_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """Every tensor a sampler needs to compute `model`, under the base model's names, made one at a time: a plain
    model's state dict, or a LoRA model's base with each adapted weight merged, W + (alpha / r) B A in float32."""
    if not is_lora(model):
        yield from model.state_dict().items()
        return
    from peft.tuners.lora import LoraLayer

    adapted = {
        f"{name}.weight": module
        for name, module in unwrap(model).named_modules()
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A
    }
    for name, tensor in base_weights(model).items():
        layer = adapted.get(name)
        yield name, tensor if layer is None else tensor.float() + layer.get_delta_weight(ADAPTER).float()


def merge(model: Any) -> Any:
    """A plain transformers model computing `model` (merged: W + (alpha / r) B A in the base's dtype). A LoRA
    model is consumed (PEFT merges in place); a plain model is returned as it is."""
    return model.merge_and_unload() if is_lora(model) else model


def owns_base(cfg: Any) -> bool:
    """A LoRA run whose base is its own (the tiny model, or any base after a supervised warm-start): it keeps the
    base in `<out>/base`."""
    return cfg.model == "tiny" or cfg.sft_steps > 0


def base_source(cfg: Any, out: str | Path) -> str:
    """Where LoRA run `out`'s frozen base is: `<out>/base` (`owns_base`), else cfg.model. ValueError when the run's
    own base is missing."""
    if not owns_base(cfg):
        return cfg.model
    own = Path(out) / "base"
    config = own / "config.json"
    if not config.is_file():
        state = "not a file" if config.exists() else "missing"
        what = f"{own} is missing" if not own.exists() else f"{config} is {state}"
        raise ValueError(f"{what}: the LoRA run's adapters are trained on that base; restore it, or start a new run")
    return str(own)
