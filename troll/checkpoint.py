"""The run directory's files: atomic checkpoints, the `latest` pointer, and the JSONL logs.

    out/checkpoints/step-NNNNNN/   HF `save_pretrained` (model + tokenizer: loadable by troll.evaluate and vLLM)
                                   + trainer.pt {optimizer, scheduler, step, ...the run's state}
    out/checkpoints/latest         the name of the newest complete checkpoint
    out/metrics.jsonl, samples.jsonl   one JSON object per line, each with a "step"

A checkpoint is written to a temporary folder and renamed into place, and `latest` is replaced atomically
(write, then rename), so a crash during a save never damages the last good checkpoint. The last two are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(out: Path, model: Any, tokenizer: Any, opt: Any, sched: Any, state: dict) -> Path:
    """Write checkpoints/step-NNNNNN (state["step"]) atomically, point `latest` at it, keep the last two."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{state['step']:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), **state}, tmp / "trainer.pt")
    shutil.rmtree(root / name, ignore_errors=True)
    os.replace(tmp, root / name)
    (root / "latest.tmp").write_text(name)
    os.replace(root / "latest.tmp", root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.name != name)[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def latest_checkpoint(out: Path) -> Path:
    """The folder `checkpoints/latest` names; a clear error when it is missing or incomplete."""
    pointer = out / "checkpoints" / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from: {pointer} does not exist")
    ckpt = out / "checkpoints" / pointer.read_text().strip()
    missing = [f for f in ("trainer.pt", "config.json") if not (ckpt / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {ckpt} is incomplete or corrupt (missing {', '.join(missing)})")
    return ckpt


def append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    with open(path, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep only the rows of steps <= step (resume: later rows are written again)."""
    lines = path.read_text().splitlines() if path.exists() else []
    path.write_text("".join(ln + "\n" for ln in lines if json.loads(ln)["step"] <= step))
