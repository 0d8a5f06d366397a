"""How the policy network is built and loaded: the tiny local Llama, a transformers model or folder, a run's
checkpoint, LoRA adapters on their base.

    model, tokenizer = build_model(cfg, device)                   # tiny local Llama, or a HF model / directory
    model = adapt(cfg, model)                                     # with --lora_rank: new adapters on a frozen base
    cfg = run_config(run)                                         # a run's config.json, for a command loading it

Choices:
- `build_model` names what it cannot load (a UsageError: the file, and what to do): a damaged file of a local
  model, checkpoint or `<out>/base` folder (troll.base.checkpoint.damaged_file, then the loader's own error), a
  LoRA run's missing base, adapters PEFT refuses.
- `build_model` returns train mode (`from_pretrained` returns eval mode, in which gradient checkpointing does
  nothing) in float32; bf16 is autocast by the trainer. On CPU a model whose query heads share key/value heads
  runs troll.models.attention's `gqa_sdpa`: sdpa's values without copying the shared heads.
- The tiny model's tokenizer is trained on the addition task's corpus (troll.tasks.addition); troll.policy scores
  completions with whatever network this module builds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from troll import lora
from troll.base.checkpoint import TOKENIZER, WEIGHTS, damage_remedy, damaged_file
from troll.base.cli import UsageError
from troll.models import packaged
from troll.models.attention import use_gqa_attention

if TYPE_CHECKING:
    from troll.base.config import Config


class BaseMissing(UsageError, ValueError):
    """A LoRA run's own base folder is gone: one line at the command's boundary, and still the ValueError that
    troll.lora.base_source raises for it."""


TINY = dict(hidden=128, layers=2, heads=4)  # the tiny-cpu preset's model: 0.59M parameters


def build_model(cfg: Config, device: torch.device, path: str | Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): the tiny local Llama (`cfg.model == "tiny"`), or `path` / cfg.model via transformers.
    The tiny tokenizer keeps troll.models.tiny's ChatML template only where the run's prompts go through it (GSM8K with
    `cfg.chat`): the addition tasks prompt with raw text, so the checkpoints and exports of those runs carry no chat
    template and `apply_chat_template` fails rather than giving a format the model never saw.
    With `cfg.lora_rank` the base comes in `base_dtype(cfg)` and without adapters (`adapt` adds them after the
    warm-start), unless `path` is a LoRA checkpoint: then its adapters on the run's base (troll.lora)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapters = path if path is not None and lora.is_adapter_checkpoint(path) else None
    if adapters:  # a checkpoint's adapters on the run's base, which sits two folders up (troll.base.checkpoint)
        try:
            path = lora.base_source(cfg, Path(adapters).parent.parent)
        except ValueError as e:  # the run's own base lacks its config.json: `load` names it, or the folder is gone
            own = Path(adapters).parent.parent / "base"
            if not own.is_dir():
                raise BaseMissing(str(e)) from None
            path = own
    if path is None and cfg.model == "tiny":
        from troll.models.tiny import pad_vocab, tiny_llama, train_tokenizer
        from troll.tasks import addition

        tokenizer = train_tokenizer(addition.corpus(), vocab_size=64)  # 260 tokens: the 256 bytes + specials
        if cfg.vocab_size:  # a long-tailed softmax, as an LLM's: unused tokens up to vocab_size (troll.models.tiny)
            tokenizer = pad_vocab(tokenizer, cfg.vocab_size)
        if not (cfg.task in ("gsm8k", "words") and cfg.chat):  # raw prompts ("04+85="): no chat template it never saw
            tokenizer.chat_template = None
        model = tiny_llama(tokenizer, **TINY, seed=cfg.seed)
    else:
        src = path or cfg.model
        tokenizer = load(AutoTokenizer.from_pretrained, adapters or src, "tokenizer")
        model = load(lambda s: AutoModelForCausalLM.from_pretrained(s, dtype=base_dtype(cfg)), src, "model")
        use_gqa_attention(model, device)  # on CPU: shared key/value heads read in place, the same values
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable()
    if adapters:
        model = load(lambda a: lora.load_adapters(model, a), adapters, "adapters")
    model.train()
    return model.to(device), tokenizer


NEEDS = {  # what `load` needs in a local folder: each entry a file, or a tuple of which one is enough
    "tokenizer": ("tokenizer_config.json", TOKENIZER),
    "model": ("config.json", ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")),
    "adapters": lora.ADAPTER_FILES,
}


def load(loader: Callable[[str], Any], source: str | Path, kind: str) -> Any:
    """`loader(source)`, loading a `kind` of NEEDS; for a local folder, its missing (NEEDS) and damaged files
    (troll.base.checkpoint.damaged_file) and the loader's failure are a UsageError naming the file or folder and what
    to do (troll.base.checkpoint.damage_remedy). A hub name's failures pass."""
    source = packaged.resolve(str(source))  # a packaged model's name: its folder, made on first use
    folder = Path(source)
    if not folder.is_dir():
        return loader(source)
    names = [(n,) if isinstance(n, str) else n for n in NEEDS[kind]]
    missing = [" or ".join(n) for n in names if not any((folder / f).is_file() for f in n)]
    problem = f"{folder} lacks {', '.join(missing)}" if missing else damaged_file(folder)
    if problem:
        raise UsageError(f"{problem}: {damage_remedy(folder)}")
    try:
        loaded = loader(source)
    except ImportError:
        raise
    except Exception as e:  # transformers, tokenizers, safetensors and PEFT raise many types on a file they refuse
        first = (str(e).splitlines() or [""])[0][:200]
        raise UsageError(f"{folder} cannot be loaded ({type(e).__name__}: {first}): {damage_remedy(folder)}") from None
    if problem := loaded_problem(loaded, folder):
        raise UsageError(f"{problem}: {damage_remedy(folder)}")
    return loaded


def loaded_problem(loaded: Any, folder: Path) -> str | None:
    """What a whole-looking folder loaded as and must not be: a tokenizer without an EOS token (its
    tokenizer_config.json lost), weights with NaN or inf (garbled bytes load without complaint), named by file."""
    if hasattr(loaded, "eos_token_id") and not hasattr(loaded, "parameters") and loaded.eos_token_id is None:
        return f"{folder / 'tokenizer_config.json'} is missing or damaged: the tokenizer has no EOS token"
    if not isinstance(loaded, torch.nn.Module):
        return None
    lora_only = lora.is_adapter_checkpoint(folder)  # the adapters were loaded onto a base checked before
    with torch.no_grad():
        bad = next(
            (n for n, p in loaded.named_parameters() if (not lora_only or "lora_" in n) and not p.isfinite().all()),
            None,
        )
    if bad is None:
        return None
    files = [f for f in ("adapter_model.safetensors", *WEIGHTS) if (folder / f).is_file()]
    return f"{folder / files[0] if files else folder} holds NaN or infinite weights ({bad}): damaged bytes"


def run_config(run: Path) -> Config:
    """Run `run`'s config.json, for a command that loads its checkpoints (troll.tools.evaluate, troll.tools.export).
    Missing or not JSON: a UsageError saying that resume writes it again from the run's newest checkpoint
    (Config.resumed)."""
    from troll.base.config import Config

    path = run / "config.json"
    again = (
        f"troll train --out {run} --resume true writes it again from the run's newest checkpoint (a "
        "finished run is not trained further)"
    )
    if not path.is_file():
        raise UsageError(f"{path} is missing: {again}")
    try:
        json.loads(path.read_bytes().decode("utf-8"))
    except ValueError:  # not UTF-8, not JSON
        raise UsageError(f"{path} is damaged (not JSON): {again}") from None
    try:
        return Config.load(path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def base_dtype(cfg: Config) -> torch.dtype:
    """The weights' dtype: float32 (trained weights, and every weight of a full fine-tune), or bfloat16 for a LoRA
    run's frozen base under bf16 autocast (troll.lora)."""
    return torch.bfloat16 if cfg.lora_rank and cfg.bf16 else torch.float32


def adapt(cfg: Config, model: Any) -> Any:
    """`model` as the policy to train: itself (full fine-tuning), or with `cfg.lora_rank` new LoRA adapters on it,
    held frozen in `base_dtype(cfg)` (troll.lora)."""
    if not cfg.lora_rank:
        return model
    return lora.add_adapters(model.to(base_dtype(cfg)), cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
