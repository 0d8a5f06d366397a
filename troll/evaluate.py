"""Greedy pass@1 evaluation of a model on GSM8K, the command:

    python -m troll.evaluate --model NAME_OR_PATH [--data openai/gsm8k] [--chat true] [--limit N] [--out DIR]

Scores greedy completions of every GSM8K test problem (1,319) with exactly the reward training uses
(`troll.gsm8k.reward`), with vLLM when it is installed and a GPU or `--backend vllm` asks for it, else
transformers `generate`. Writes `predictions.jsonl` (question, gold, completion, extracted answer, reward)
and `summary.json` (accuracy, n, backend, seconds) into `--out`, and prints the accuracy.

Greedy decoding is the rollout backends' own `greedy` (rollout.HFGenerator, vllm_engine.VLLMGenerator), the
path training evaluates with too, so the numbers agree; it masks output ids past the tokenizer (Qwen's padded
rows), as the samplers do. Prompts are encoded, completions decoded and scored by troll.task, as in training.

`--model` (`resolve_model`): a local folder holding a model and its tokenizer (config.json, weights, tokenizer
files); a run directory, whose `checkpoints/latest` checkpoint is evaluated (said on stderr); a LoRA run's
checkpoint (adapter_config.json, or a LoRA run directory), whose adapters are loaded on the run's base and merged in
memory in float32, as `python -m troll.export` merges them (with the hf backend: vLLM loads a model folder, which
troll.export writes); or a hub name. A
name is looked up once, with a short timeout: when the hub cannot be reached (or HF_HUB_OFFLINE is set) a copy in
the local cache is used, else the command stops at once instead of retrying for a minute. A path that does not exist,
a folder that lacks a model or tokenizer file (named) or holds a damaged one (troll.checkpoint.damaged_file), a LoRA
checkpoint whose run config or base is missing, an unknown hub name, bad --data or a bad number: a usage error, exit
2 with one line on stderr, before any model is loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from troll.checkpoint import complete_checkpoints, damage_remedy, damaged_file
from troll.cli import Parser, run_command
from troll.task import decode, encode, score

if TYPE_CHECKING:
    from troll.rollout import Generator


HUB_TIMEOUT_S = 3.0  # the one hub lookup of a model name (resolve_model)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json")


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
    """A LoRA checkpoint's run config (for troll.policy.build_model) and the base its adapters go on
    (troll.lora.base_source): the run directory is two folders up. ValueError naming what is missing."""
    from troll import lora  # imports torch: only for a LoRA checkpoint
    from troll.policy import run_config

    if ckpt.parent.name != "checkpoints":
        raise ValueError(
            f"{ckpt} holds LoRA adapters, and it is not in a run directory, whose config.json names their base: "
            "evaluate it in its run directory, or pass a model that python -m troll.export merged there"
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
    A LoRA checkpoint is accepted with `adapters` (troll.evaluate merges it), else refused naming troll.export.
    """
    path = Path(name).expanduser()
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
                    f"{path} holds LoRA adapters, not a model: merge them into their base with python -m troll.export "
                    f"{path} --out DIR, and pass DIR"
                )
            _, base = lora_base(path)
            merged = f"its adapters merged into the run's base {base} in memory"
            note = f"{note}; {merged}" if note else f"{path} is a LoRA checkpoint: {merged}"
        return str(path), note
    from troll.gsm8k import is_hub_name

    if not is_hub_name(name):
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
    from troll import gsm8k

    if Path(data).expanduser().exists() or not gsm8k.is_hub_name(data) or hub_offline():
        return
    reason = hub_lookup(data, "dataset")
    if reason:
        raise ValueError(
            f"--data {data}: {reason}; pass a folder with test.jsonl, or set HF_HUB_OFFLINE=1 to read the datasets "
            "cache"
        )


def check_not_trained_on(model_path: str, rows: list[dict[str, str]], data: str) -> None:
    """A ValueError when the model is a troll run's checkpoint whose GSM8K training problems (a local --data of the
    run) include evaluated ones: a score on its own training problems is not a held-out accuracy."""
    from troll import gsm8k

    config = Path(model_path).parent.parent / "config.json"  # <run>/checkpoints/step-N -> <run>/config.json
    try:
        run = json.loads(config.read_text())
    except (OSError, ValueError):
        return  # not a run's checkpoint (or its config is unreadable): nothing to compare with
    source = run.get("data", "") if run.get("task") == "gsm8k" else ""
    if not source or not Path(source).expanduser().exists():
        return  # the run trained on another task, or on the hub's train split, which shares no test problem
    try:
        gsm8k.check_held_out(gsm8k.load_gsm8k("train", source), rows, data)
    except ValueError as e:
        raise ValueError(f"{e} ({model_path} was trained on {source}: evaluate on held-out problems)") from None


def greedy_generator(backend: str, model_path: str, tokenizer: Any, max_model_len: int) -> Generator:
    """A rollout backend ("hf" or "vllm") holding the model at `model_path` (a LoRA checkpoint: merged, hf only),
    for its `greedy` method."""
    import torch

    if backend == "vllm":
        from troll.vllm_engine import VLLMGenerator

        on_gpu = torch.cuda.is_available()
        dtype = "auto" if on_gpu else "float32"  # vLLM's "auto" runs a float32 checkpoint in 16 bits
        return VLLMGenerator(
            model_path, tokenizer, max_model_len, dtype=dtype, gpu_memory_utilization=0.9, sleep_level=None
        )

    from transformers import AutoModelForCausalLM

    from troll.policy import load
    from troll.rollout import HFGenerator

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if is_adapters(Path(model_path)):
        model = merged_lora(Path(model_path), device)
    else:
        model = load(AutoModelForCausalLM.from_pretrained, model_path, "model").to(device)
    return HFGenerator(model.eval(), tokenizer, max_model_len)


def merged_lora(ckpt: Path, device: Any) -> Any:
    """A LoRA checkpoint's adapters on its run's base, merged in float32 (as troll.export writes it)."""
    import dataclasses

    from troll.lora import merge
    from troll.policy import build_model

    cfg, _ = lora_base(ckpt)
    cfg = dataclasses.replace(cfg, bf16=False, grad_checkpointing=False)  # merged in float32, no training
    model, _ = build_model(cfg, device, path=ckpt)
    return merge(model)


def main(argv: list[str] | None = None) -> dict:
    from troll import gsm8k

    p = Parser(prog="python -m troll.evaluate", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a model folder, a run directory or a hub name")
    p.add_argument("--data", default=gsm8k.HUB_NAME, help="hub name or a folder with test.jsonl")
    p.add_argument(
        "--chat",
        default="auto",
        choices=["auto", "true", "false"],
        help="chat template prompts (auto: when the tokenizer has one)",
    )
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--backend", default="auto", choices=["auto", "hf", "vllm"])
    p.add_argument("--out", default=None, help="output folder (default: evals/<model name>)")
    args = p.parse_args(argv)

    def fail(message: str) -> NoReturn:
        """A usage error: one line on stderr, exit 2 (no usage text: the flags parsed)."""
        p.exit(2, f"{p.prog}: error: {message}\n")

    for flag in ("model", "data"):
        if not getattr(args, flag).strip():
            fail(f"--{flag} must not be empty")
    if args.out is not None and not args.out.strip():
        fail("--out must not be empty (leave it out for evals/<model name>)")
    if args.limit is not None and args.limit < 1:
        fail(f"--limit must be >= 1, got {args.limit}")
    if args.limit is not None and args.limit > sys.maxsize:
        fail(f"--limit must be at most {sys.maxsize} (leave it out for every row), got {args.limit}")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    out = Path(args.out or Path("evals") / Path(args.model).name)
    if file := next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None):
        fail(f"--out {out}: {file} is a file, not a folder")
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        fail("--backend vllm needs the optional vllm package, which is not installed: pass --backend hf")
    try:
        model_path, note = resolve_model(args.model, adapters=True)
        check_hub_data(args.data)
        rows = gsm8k.load_gsm8k("test", source=args.data, limit=args.limit)
        check_not_trained_on(model_path, rows, args.data)
    except (OSError, ValueError) as e:
        fail(str(e))
    lora = is_adapters(Path(model_path))
    if lora and args.backend == "vllm":
        fail(
            f"--backend vllm loads a model folder, and {model_path} holds LoRA adapters: merge them with "
            f"python -m troll.export {model_path} --out DIR and evaluate DIR, or pass --backend hf"
        )
    if note:
        print(f"{p.prog}: {note}", file=sys.stderr)
    if Path(model_path).is_dir() and (problem := damaged_file(Path(model_path))):
        fail(f"{problem}: {damage_remedy(Path(model_path))}")
    import torch  # after the checks: a usage error answers without loading torch
    from transformers import AutoTokenizer

    from troll.policy import load

    tokenizer = load(AutoTokenizer.from_pretrained, model_path, "tokenizer")
    chat = tokenizer.chat_template is not None if args.chat == "auto" else args.chat == "true"
    if chat and tokenizer.chat_template is None:
        fail(f"--chat true, but the tokenizer of {args.model} has no chat template")
    prompts = encode(tokenizer, [gsm8k.make_prompt(r["question"], tokenizer, chat=chat) for r in rows])
    backend = args.backend
    if backend == "auto":  # a LoRA checkpoint is merged in memory, which the hf backend evaluates
        backend = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") and not lora else "hf"
    start = time.time()
    max_model_len = max(len(x) for x in prompts) + args.max_new_tokens
    completions = decode(
        tokenizer, greedy_generator(backend, model_path, tokenizer, max_model_len).greedy(prompts, args.max_new_tokens)
    )
    acc, records = score(rows, completions, gsm8k.reward)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec | {"extracted": gsm8k.extract_answer(rec["completion"])}) + "\n")
    summary = {
        "model": args.model,
        "accuracy": acc,
        "n": len(rows),
        "backend": backend,
        "chat": chat,
        "seconds": round(time.time() - start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"GSM8K greedy pass@1: {acc:.4f} ({len(rows)} problems, {backend}) -> {out}")
    return summary


if __name__ == "__main__":
    run_command("python -m troll.evaluate", main)
