"""Where a model and its data come from: a packaged model's name, a local folder, a run directory or checkpoint,
a LoRA checkpoint on its run's base, or a name on the Hugging Face hub, each checked before anything loads.

    path, note = resolve_model("runs/tiny-cpu")       # the run's latest checkpoint, and a note saying so
    check_hub_data("openai/gsm8k")                    # a hub dataset answers at once, or one line says why not

A hub name is looked up once, with a short timeout (HUB_TIMEOUT_S): when the hub cannot be reached (or
HF_HUB_OFFLINE is set) a copy in the local cache is used, else the command stops at once instead of retrying. A
path that does not exist, a folder that lacks a model or tokenizer file (named) or holds a damaged one
(troll.base.checkpoint.damaged_file), a LoRA checkpoint whose run config or base is missing, or an unknown hub name
is a ValueError with a one-line message (the commands turn it into their usage error). Used by troll.tools.evaluate,
troll.tools.check and the run's start (troll.run.harness.check_sources).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from troll.base.checkpoint import TOKENIZER, complete_checkpoints, damage_remedy, damaged_file
from troll.tasks import gsm8k

HUB_TIMEOUT_S = 3.0  # the one hub lookup of a model name (resolve_model)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def is_adapters(folder: Path) -> bool:
    """A LoRA checkpoint: PEFT's adapters (troll.lora.ADAPTER_FILES, either one: a checkpoint that lost the other is
    named as a damaged LoRA checkpoint), without importing torch."""
    return any((folder / name).exists() for name in ("adapter_config.json", "adapter_model.safetensors"))


def _model_folder_problem(folder: Path) -> str | None:
    """What a local model folder (or LoRA checkpoint) lacks to load model and tokenizer, or None."""
    lora = is_adapters(folder)
    config = "adapter_config.json" if lora else "config.json"
    missing = [] if (folder / config).is_file() else [config]
    weights = ("adapter_model.safetensors",) if lora else WEIGHTS
    for kind, names in (("weights", weights), ("tokenizer", TOKENIZER)):
        if not any((folder / n).is_file() for n in names):
            missing.append(f"{kind} ({' or '.join(names)})")
    if not missing:
        return None
    hint = " (a run directory without checkpoints)" if (folder / "metrics.jsonl").is_file() else ""
    return f"{folder} is not a {'LoRA checkpoint' if lora else 'model folder'}{hint}: it lacks {', '.join(missing)}"


def lora_base(ckpt: Path) -> tuple[Any, str]:
    """A LoRA checkpoint's run config (for troll.models.build.build_model) and the base its adapters go on
    (troll.lora.base_source): the run directory is two folders up. ValueError naming what is missing."""
    from troll import lora  # imports torch: only for a LoRA checkpoint
    from troll.models.build import run_config

    if ckpt.parent.name != "checkpoints":
        raise ValueError(
            f"{ckpt} holds LoRA adapters, and it is not in a run directory, whose config.json names their base: "
            "evaluate it in its run directory, or pass a model that troll export merged there"
        )
    cfg = run_config(ckpt.parent.parent)  # a UsageError naming the file

    try:
        base = lora.base_source(cfg, ckpt.parent.parent)
    except ValueError:  # the run's own base lacks its config.json (named below), or the folder is gone
        if not (ckpt.parent.parent / "base").is_dir():
            raise
        base = str(ckpt.parent.parent / "base")
    if Path(base).is_dir():
        if problem := _model_folder_problem(Path(base)) or damaged_file(Path(base)):
            raise ValueError(f"{problem}: {damage_remedy(Path(base))}")
    return cfg, base


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE asks for no network (huggingface_hub reads it the same way)."""
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def hub_lookup(name: str, kind: str) -> str | None:
    """Ask the hub once (HUB_TIMEOUT_S) whether it holds the `kind` ("model" or "dataset") `name`: None when it
    does, why it could not be asked when it cannot (no network, a timeout); a ValueError when it does not."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    info = HfApi().model_info if kind == "model" else HfApi().dataset_info
    try:
        info(name, timeout=HUB_TIMEOUT_S)
    except GatedRepoError:
        raise ValueError(f"hub {kind} {name} is gated: accept its terms on the hub and log in") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{name} is neither a local path nor a {kind} on the hub") from None
    except Exception as e:  # no network, a timeout, a server error
        return f"the hub cannot be reached ({type(e).__name__})"
    return None


def resolve_model(name: str, adapters: bool = False) -> tuple[str, str | None]:
    """What to load for `--model NAME` (module docstring), and a note saying what was chosen, or None.

    Returns a local folder or a hub name; raises ValueError with a one-line message when there is nothing to load.
    A LoRA checkpoint is accepted with `adapters` (troll.tools.evaluate merges it), else refused naming
    troll.tools.export.
    """
    from troll.models import packaged

    path = Path(packaged.resolve(name)).expanduser()  # a packaged model's name: its folder, made on first use
    if path.exists():
        note = None
        if (path / "checkpoints").is_dir():  # a run directory: the checkpoint `latest` names, else the newest
            pointer, ckpts = path / "checkpoints" / "latest", complete_checkpoints(path)
            latest = pointer.read_bytes().decode("utf-8", "replace").strip() if pointer.is_file() else None
            if not ckpts:
                named = f" ({pointer} names {latest!r}, which is not a checkpoint)" if latest is not None else ""
                raise ValueError(f"{path} is a run directory without checkpoints{named}: pass a model folder")
            which = "latest" if latest == ckpts[0].name else f"newest ({pointer} is missing or names none)"
            path, note = ckpts[0], f"{name} is a run directory: evaluating its {which} checkpoint, {ckpts[0]}"
        if not path.is_dir():
            raise ValueError(f"{path} is not a folder (pass a model folder, a run directory or a hub name)")
        if problem := _model_folder_problem(path):  # a damaged file: named by main (damaged_file) before loading
            raise ValueError(f"{problem}: {damage_remedy(path)}")
        if is_adapters(path):
            if not adapters:
                raise ValueError(
                    f"{path} holds LoRA adapters, not a model: merge them into their base with troll export "
                    f"{path} --out DIR, and pass DIR"
                )
            _, base = lora_base(path)
            merged = f"its adapters merged into the run's base {base} in memory"
            note = f"{note}; {merged}" if note else f"{path} is a LoRA checkpoint: {merged}"
        return str(path), note
    if not gsm8k.is_hub_name(name):
        raise ValueError(f"model path {name} does not exist")
    from huggingface_hub import snapshot_download

    reason = "HF_HUB_OFFLINE is set" if hub_offline() else hub_lookup(name, "model")
    if reason is None:
        return name, None
    try:
        cached = snapshot_download(name, local_files_only=True)
    except Exception:  # not cached (huggingface_hub's LocalEntryNotFoundError, or an incomplete copy)
        raise ValueError(f"{name} is not a local path, {reason}, and it is not in the local cache") from None
    return cached, f"{reason}: using the cached copy of {name}, {cached}"


def check_hub_data(data: str) -> None:
    """A `--data` that names a hub dataset must answer at once (a local path is read, and checked, by load_gsm8k):
    ValueError with a one-line message otherwise."""
    if Path(data).expanduser().exists() or not gsm8k.is_hub_name(data) or hub_offline():
        return
    reason = hub_lookup(data, "dataset")
    if reason:
        raise ValueError(
            f"--data {data}: {reason}; pass a folder with test.jsonl, or set HF_HUB_OFFLINE=1 to read the datasets "
            "cache"
        )
