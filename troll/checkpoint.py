"""The run directory's files, written so that a crash at any moment leaves the previous complete state.

    out/checkpoints/step-NNNNNN/   HF `save_pretrained` (model + tokenizer: loadable by troll.evaluate and vLLM;
                                   a LoRA run's: the adapters, `python -m troll.export` merges them)
                                   + trainer.pt {optimizer, scheduler, step, ...the run's state}
    out/base/                      a LoRA run's own frozen base (the tiny model, a warm-started one), written once
    out/checkpoints/latest         the name of the newest complete checkpoint
    out/metrics.jsonl, samples.jsonl   one JSON object per line, each with a "step"
    out/config.json, summary.json  JSON objects

- A checkpoint is written to a temporary folder and renamed into place, then `latest` is replaced (write, then
  rename): a crash during a save never damages the last good checkpoint. The last two are kept.
- `complete_checkpoints` lists the checkpoints newest first (`latest` first); `check_checkpoint` names the first
  damaged or missing file of one (a truncated trainer.pt or safetensors file, missing tokenizer files), so resume
  can fall back to the older one and say why.
- JSON files are written through a temporary file and a rename (`write_json`, `rewrite_jsonl`). JSONL logs are
  appended a line at a time and flushed to disk; `read_jsonl(torn_tail=True)` skips a torn last line (a crash or
  a full disk during an append) with a warning, and resume's `truncate_jsonl` rewrites the file without it. Any
  other bad line is a ValueError naming the file and line.
- torch is imported only to write and read trainer.pt, so the log readers (troll.plot) load without it.
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
TOKENIZER = ("tokenizer.json", "tokenizer_config.json")


def save_checkpoint(out: Path, model: Any, tokenizer: Any, opt: Any, sched: Any, state: dict) -> Path:
    """Write checkpoints/step-NNNNNN (state["step"]) atomically, point `latest` at it, keep the last two."""
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
    for old in sorted(p for p in root.glob("step-*") if p.name != name)[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def complete_checkpoints(out: Path) -> list[Path]:
    """Checkpoint folders of `out`, newest first: the one `latest` names, then the other step-* folders."""
    root = out / "checkpoints"
    steps = sorted(root.glob("step-*"), reverse=True) if root.is_dir() else []
    pointer = root / "latest"
    first = root / pointer.read_text().strip() if pointer.is_file() else None
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
        return f"{ckpt}: no tokenizer files ({' or '.join(TOKENIZER)})"
    for name in ("model.safetensors", "adapter_model.safetensors"):
        if (ckpt / name).is_file():
            return _safetensors_problem(ckpt / name)
    return None


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
    """trainer.pt of a checkpoint: {optimizer, scheduler, step, ...the run's state}."""
    import torch

    return torch.load(ckpt / "trainer.pt", weights_only=False)


def checkpoint_settings(out: Path) -> tuple[Path, dict] | None:
    """The settings the newest readable checkpoint of run `out` was written with (trainer.pt's "config") and that
    checkpoint; None when no checkpoint holds them."""
    for ckpt in complete_checkpoints(out):
        try:
            state = load_trainer_state(ckpt)
        except Exception:  # torch.load raises several types on a damaged file: the older checkpoint may do
            continue
        if isinstance(state, dict) and isinstance(state.get("config"), dict):
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
    if not isinstance(header, dict):
        return f"{path} is damaged (its header cannot be read)"
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
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
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            problem = f"not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
        except json.JSONDecodeError as e:
            problem = f"not valid JSON ({e.msg} at column {e.colno}): {raw[:80].decode('utf-8', 'replace')!r}"
        else:
            if isinstance(row, dict):
                rows.append(row)
                continue
            problem = f"expected a JSON object, got {type(row).__name__}"
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
    warning (a log: the run goes on without them); atomic. A missing file is started empty."""
    rows = read_jsonl(path, torn_tail=True, skip_damaged=True) if path.exists() else []
    rewrite_jsonl(path, [r for r in rows if r.get("step", 0) <= step])
