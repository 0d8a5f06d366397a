"""How the metrics of parts (micro-batches, processes) combine into one row, the rule stated once:

    key ending in "_max"   the max over the parts (and "_absmax", a largest magnitude)
    key ending in "_min"   the min over the parts
    any other key          the mean weighted by each part's weight (equal weights: the plain mean)

A part without a key does not count for it. troll.train weights a micro-batch's loss terms (policy, regression)
by the shares that weight its loss, and its other metrics, means over real tokens, by its share of the minibatch's
real tokens; troll.integrations.trl gives every process weight 1.

And where rows go besides metrics.jsonl (`--log_to`): `Logger`, TensorBoard or Weights & Biases, each imported
only when asked for; `logger_missing` says at parse time when the package is not installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def merge(parts: Sequence[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """One value per key from (weight, metrics) parts (module docstring); a zero total weight gives the mean."""
    out: dict[str, float] = {}
    for key in sorted({k for _, m in parts for k in m}):
        vals = [(w, m[key]) for w, m in parts if key in m]
        if key.endswith(("_max", "_absmax")):
            out[key] = max(v for _, v in vals)
        elif key.endswith("_min"):
            out[key] = min(v for _, v in vals)
        else:
            total = sum(w for w, _ in vals)
            out[key] = sum(w * v for w, v in vals) / total if total else sum(v for _, v in vals) / len(vals)
    return out


# ----------------------------------------------------------------------------- optional logging backends

INSTALL = {  # --log_to: (the module it needs, the command that installs it)
    "tensorboard": ("tensorboard", 'pip install tensorboard   (or: pip install -e ".[log]")'),
    "wandb": ("wandb", 'pip install wandb   (or: pip install -e ".[log]")'),
}


def logger_missing(log_to: str) -> str | None:
    """Why `log_to` cannot run here (its package is not installed, with the install command), or None. Looks the
    package up without importing it, so the command line can say so before any work."""
    if log_to not in INSTALL:
        return None
    module, command = INSTALL[log_to]
    if importlib.util.find_spec(module) is None:
        return f"--log_to {log_to} needs the {module} package, which is not installed: {command}"
    return None


class Logger:
    """Sends each metrics row to TensorBoard (<out>/tensorboard, torch.utils.tensorboard) or W&B (project "troll",
    run name = the run directory's name), or nowhere (`none`). Every numeric key of a row is one scalar at the
    row's `step`. The package is imported here, only when asked for. metrics.jsonl stays the record: a resumed
    run writes its steps past the checkpoint again, so these backends may show them twice."""

    def __init__(self, log_to: str, out: Path, config: dict) -> None:
        problem = logger_missing(log_to)
        if problem:
            raise ImportError(problem)
        self.writer = self.run = None
        if log_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(out) / "tensorboard"))
        elif log_to == "wandb":
            import wandb

            self.run = wandb.init(project="troll", name=Path(out).name, dir=str(out), config=config)

    def log(self, row: Mapping[str, Any]) -> None:
        scalars = {
            k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float)) and type(v) is not bool
        }
        if self.writer is not None:
            for key, value in scalars.items():
                self.writer.add_scalar(key, value, global_step=int(row["step"]))
        if self.run is not None:
            self.run.log(scalars, step=int(row["step"]))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.run is not None:
            self.run.finish()
