"""The run directory's files, written so that a crash at any moment leaves the previous complete state.

    out/checkpoints/step-NNNNNN/   HF `save_pretrained` (model + tokenizer: loadable by troll.tools.evaluate and vLLM;
                                   a LoRA run's: the adapters, `troll export` merges them)
                                   + trainer.pt {optimizer, scheduler, step, ...the run's state}
    out/base/                      a LoRA run's own frozen base (the tiny model, a warm-started one), written once
    out/checkpoints/latest         the name of the newest complete checkpoint
    out/metrics.jsonl, samples.jsonl   one JSON object per line, each with a "step"
    out/config.json, summary.json  JSON objects

- A checkpoint is written to a temporary folder and renamed into place, then `latest` is replaced (write, then
  rename): a crash during a save never damages the last good checkpoint. The last two are kept.
- `complete_checkpoints` lists the checkpoints newest first (`latest` first); `check_checkpoint` names the first
  damaged or missing file of one (a truncated trainer.pt or safetensors file, missing tokenizer files), and
  `load_trainer_state` refuses NaN in trainer.pt's tensors (what garbled bytes there load as), so resume can fall
  back to the older one and say why. `damaged_file` names the first file of a model or checkpoint folder
  that cannot be read (a JSON file that is not UTF-8 JSON, a safetensors file whose header does not parse or that is
  truncated, a folder where a file belongs), so a loader's failure names the file, not only the folder.
- JSON files are written through a temporary file and a rename (`write_json`, `rewrite_jsonl`). JSONL logs are
  appended a line at a time and flushed to disk; `read_jsonl(torn_tail=True)` skips a torn last line (a crash or
  a full disk during an append) with a warning, and resume's `truncate_jsonl` rewrites the file without it. Any
  other bad line is a ValueError naming the file and line.
- torch is imported only to write and read trainer.pt, so the log readers (troll.tools.plot) load without it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "adapter_model.safetensors")
TOKENIZER = ("tokenizer.json", "tokenizer.model", "vocab.json")  # the vocabulary, beside tokenizer_config.json


START = "step-000000"  # the checkpoint of a run's starting point, never rotated out


def save_checkpoint(out: Path, model: Any, tokenizer: Any, opt: Any, sched: Any, state: dict) -> Path:
    """Write checkpoints/step-NNNNNN (state["step"]) atomically, point `latest` at it, keep the last two and the
    run's starting point (step-000000: the model before the first RL step, warm-started, for troll.tools.evaluate to
    score before and after)."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state['step']:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    import torch

    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), **state}, tmp / "trainer.pt")
    shutil.rmtree(root / name, ignore_errors=True)
    os.replace(tmp, root / name)
    _write_atomic(root / "latest", name)
    for old in sorted(p for p in root.glob("step-*") if p.name not in (name, START))[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def complete_checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders of `out`, newest first: the one `latest` names, then the other step-* folders."""
    root = out / "checkpoints"
    steps = sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []
    pointer = root / "latest"  # a damaged pointer names no checkpoint: the step-* folders are listed without it
    first = root / pointer.read_bytes().decode("utf-8", "replace").strip() if pointer.is_file() else None
    return ([first] if first in steps else []) + [p for p in steps if p != first]


def check_checkpoint(ckpt: Path) -> str | None:
    """Why checkpoint folder `ckpt` cannot be resumed from (naming the file), or None if its files are whole;
    trainer.pt is checked by loading it (`load_trainer_state`)."""
    lora = (ckpt / "adapter_model.safetensors").is_file()  # a LoRA run's checkpoint holds its adapters
    config = "adapter_config.json" if lora else "config.json"
    if not (ckpt / "trainer.pt").is_file() or not (ckpt / config).is_file():
        return f"{ckpt}: trainer.pt or {config} is missing"
    if not any((ckpt / f).is_file() for f in WEIGHTS):
        return f"{ckpt}: no model weights ({' or '.join(WEIGHTS)})"
    if not any((ckpt / f).is_file() for f in TOKENIZER):
        return f"{ckpt}: no tokenizer vocabulary ({' or '.join(TOKENIZER)})"
    if not (ckpt / "tokenizer_config.json").is_file():  # its special tokens: without it the tokenizer has no EOS
        return f"{ckpt}: tokenizer_config.json is missing"
    return damaged_file(ckpt)


def damaged_file(folder: Path) -> str | None:
    """Why the first unreadable file of model or checkpoint folder `folder` cannot be read, naming it: each *.json
    file must be a UTF-8 JSON object and each *.safetensors file whole (`_safetensors_problem`); None when all are."""
    for path in sorted([*folder.glob("*.json"), *folder.glob("*.safetensors")]):
        if path.is_dir():
            return f"{path} is a folder, not a file"
        problem = _safetensors_problem(path) if path.suffix == ".safetensors" else _json_problem(path)
        if problem:
            return problem
    return None


def damage_remedy(folder: Path) -> str:
    """What to do about a model folder that cannot be read: a LoRA run's base, a run's checkpoint, or another."""
    if folder.name == "base" and (folder.parent / "config.json").is_file():
        return "the LoRA run's frozen base, which its checkpoints adapt: restore it from a copy, or start a new run"
    if folder.parent.name == "checkpoints":
        return "a damaged checkpoint: use the run's other one (a run keeps its last two), or resume the run"
    return "restore the folder, or pass another model"


def _json_problem(path: Path) -> str | None:
    """Why a JSON file does not hold a JSON object (empty, not UTF-8, not JSON), or None."""
    raw = path.read_bytes()
    if not raw.strip():
        return f"{path} is empty"
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return f"{path} is damaged (not UTF-8 at byte {e.start})"
    except json.JSONDecodeError as e:
        return f"{path} is damaged (not valid JSON: {e.msg} at line {e.lineno} column {e.colno})"
    return None if isinstance(obj, dict) else f"{path} is damaged (a JSON {type(obj).__name__}, not an object)"


def save_base(out: Path, model: Any, tokenizer: Any) -> Path:
    """Write a LoRA run's own frozen base (troll.lora.owns_base) to out/base, atomically; checkpoints then hold
    only the adapters."""
    tmp, base = out / ".tmp-base", out / "base"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(base, ignore_errors=True)
    os.replace(tmp, base)
    return base


def load_trainer_state(ckpt: Path) -> dict:
    """trainer.pt of a checkpoint: {optimizer, scheduler, step, ...the run's state}. torch raises several types on a
    damaged file (its callers say which file); one that holds no dict is a ValueError."""
    import torch

    state = torch.load(ckpt / "trainer.pt", weights_only=False)
    if not isinstance(state, dict):
        raise ValueError(f"it holds a {type(state).__name__}, not the trainer's state")
    if where := _nonfinite(state):  # garbled tensor bytes load without complaint; NaN would end the run later
        raise ValueError(f"its {where} holds NaN or infinite values (damaged bytes)")
    return state


def _nonfinite(obj: Any, where: str = "state") -> str | None:
    """Where in a nest of dicts, lists and tensors (an optimiser's state) a float tensor holds NaN or inf."""
    import torch

    if isinstance(obj, torch.Tensor):
        return where if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else None
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return next((w for k, v in items if (w := _nonfinite(v, f"{where}[{k!r}]"))), None)


def checkpoint_settings(out: Path) -> tuple[Path, dict] | None:
    """The settings the newest readable checkpoint of run `out` was written with (trainer.pt's "config") and that
    checkpoint; None when no checkpoint holds them."""
    for ckpt in complete_checkpoints(out):
        try:
            state = load_trainer_state(ckpt)
        except Exception:  # torch.load raises several types on a damaged file: the older checkpoint may do
            continue
        if isinstance(state.get("config"), dict):
            return ckpt, state["config"]
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header and the tensor bytes it lists: check that the
    header parses and the file holds every byte it lists (a truncated copy does not)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n)) if 8 + n <= size else None
    except (struct.error, ValueError, UnicodeDecodeError):
        header = None
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):  # no header, or not safetensors' layout
        return f"{path} is damaged (its header cannot be read)"
    if 8 + n + end > size:
        return f"{path} is truncated ({size} bytes, its header lists {8 + n + end})"
    return None


def _write_atomic(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, flush it to disk, and rename it over `path`."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    _write_atomic(path, json.dumps(obj, indent=2) + "\n")


def append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    """Append one line per row and flush it to disk."""
    with open(path, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
        f.flush()
        os.fsync(f.fileno())


def json_object(raw: bytes) -> tuple[dict, None] | tuple[None, str]:
    """One JSONL line's object, or what is wrong with it: not UTF-8, not JSON (or past int's 4,300 digits), or not an
    object, in words that name the byte or column."""
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno}): {raw[:80].decode('utf-8', 'replace')!r}"
    except ValueError as e:  # int's limit (4,300 digits)
        return None, f"not readable ({e})"
    if type(row) is not dict:
        return None, f"expected a JSON object, got {type(row).__name__}"
    return row, None


def read_jsonl(path: str | Path, torn_tail: bool = False, skip_damaged: bool = False) -> list[dict]:
    """The JSON objects of a JSONL file, one per non-blank line, in file order.

    A line that is not UTF-8, not JSON, or not a JSON object is a ValueError naming the file and the 1-based line.
    With `torn_tail`, a last line that does not end in a newline and does not parse (what a crash while appending
    leaves: every complete row ends in one) is skipped with a warning naming the file instead. With `skip_damaged`
    (a log that resume repairs), every such line is skipped with a warning naming the file and the line.
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")  # the last item is b"" when the file ends with a newline
    rows = []
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        where = f"{path} line {n}"
        row, problem = json_object(raw)
        if problem is None:
            rows.append(row)
            continue
        if torn_tail and n == len(lines):
            message = f"{where}: skipped a torn last line ({problem}), as a run killed mid-write leaves one"
            warnings.warn(message, stacklevel=2)
            continue
        if skip_damaged:
            warnings.warn(f"{where}: skipped a damaged line ({problem})", stacklevel=2)
            continue
        raise ValueError(f"{where}: {problem}")
    return rows


def rows_by_name(path: str | Path, rows: Sequence[dict]) -> dict[str, dict]:
    """A results file's rows by their "name": a row without one, or a name listed twice with different rows, is a
    ValueError naming the file and the run; a row repeated as it is counts once."""
    by_name: dict[str, dict] = {}
    for row in rows:
        name = row.get("name")
        if not isinstance(name, str):
            raise ValueError(f"{path}: a row has no run name: {json.dumps(row)[:80]}")
        if by_name.setdefault(name, row) != row:
            raise ValueError(f"{path}: run {name!r} is listed twice with different results; remove one of its rows")
    return by_name


def rewrite_jsonl(path: Path, rows: Sequence[dict]) -> None:
    """Replace the file by `rows`, atomically."""
    _write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep only the rows of steps <= step (resume: later rows are written again), dropping damaged lines with a
    warning (a log: the run goes on without them), a row whose "step" is not an integer >= 0 among them (every row
    the run writes has one); atomic. A missing file is started empty."""
    rows = read_jsonl(path, torn_tail=True, skip_damaged=True) if path.exists() else []
    kept = []
    for row in rows:
        at = row.get("step")
        if not isinstance(at, int) or isinstance(at, bool) or at < 0:
            warnings.warn(f"{path}: skipped a damaged row without a step: {json.dumps(row)[:80]}", stacklevel=2)
        elif at <= step:
            kept.append(row)
    rewrite_jsonl(path, kept)
