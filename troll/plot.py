"""Curves from metrics.jsonl, one PNG per metric, several runs overlaid (e.g. TROLL vs clip):

    python -m troll.plot runs/tiny-troll runs/tiny-clip --out plots/

Each run is labelled by its folder name; x is the RL step. Metrics that a run lacks are skipped for it. The held-out
accuracy (`eval_acc`) starts at step 0, the evaluation before RL, so the curve shows the starting point and the gain.

Usage errors exit 2 with one line naming the problem: a missing run directory, a missing or empty metrics.jsonl, a
line in it that is not a JSON object (named by file and line), a row without an integer "step". A torn last line
(a run killed while appending one) is skipped with a warning naming the file (`read_jsonl`).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from troll.checkpoint import read_jsonl
from troll.cli import run_command

DEFAULT_KEYS = (
    "reward",
    "eval_acc",
    "kl_before_max",
    "kl_after_max",
    "frac_active",
    "entropy",
    "response_len_mean",
    "grad_norm",
)


def read_metrics(run: str | Path) -> list[dict]:
    """The rows of <run>/metrics.jsonl (a torn last line skipped, `read_jsonl`); each has an integer "step"."""
    if not Path(run).is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {run} a run directory?)")
    rows = read_jsonl(path, torn_tail=True)
    for row in rows:
        if not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
            raise ValueError(f"{path}: a row without an integer 'step': {json.dumps(row)[:80]}")
    return rows


def series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `key`, in file order (eval_acc: from step 0)."""
    return [(m["step"], m[key]) for m in rows if key in m]


def plot_runs(runs: Sequence[str | Path], out: str | Path, keys: Sequence[str] = DEFAULT_KEYS) -> list[Path]:
    """Write <out>/<key>.png for every key that at least one run logged; returns the written paths."""
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's inline backend alone

    out = Path(out)
    data = {}
    for run in runs:
        name = Path(run).resolve().name
        if name in data:
            raise ValueError(f"two runs are named {name!r} (runs are labelled by their folder name)")
        data[name] = read_metrics(run)
        if not data[name]:
            raise ValueError(f"{Path(run) / 'metrics.jsonl'} is empty: the run has logged no step yet")
    plots = {}  # key -> {run name: points}; every value checked before anything is drawn
    for key in keys:
        curves = {name: series(rows, key) for name, rows in data.items()}
        plots[key] = {name: pts for name, pts in curves.items() if pts}
        for name, pts in plots[key].items():
            bad = [(step, v) for step, v in pts if isinstance(v, bool) or not isinstance(v, (int, float))]
            if bad:
                raise ValueError(f"run {name}: {key} at step {bad[0][0]} is not a number: {bad[0][1]!r}")
    if any(plots.values()):
        out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, curves in plots.items():
        if not curves:
            continue
        fig = Figure(figsize=(5, 3.2))
        ax = fig.subplots()
        for name, pts in curves.items():
            ax.plot(*zip(*pts, strict=True), marker="o" if len(pts) < 20 else None, ms=3, label=name)
        ax.set_xlabel("RL step (0 = before RL)")
        ax.set_title(key)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{key}.png", dpi=110)
        written.append(out / f"{key}.png")
    return written


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m troll.plot", description="Plot metrics.jsonl of one or more runs")
    p.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--out", default="plots", help="folder for the PNGs; default: %(default)s")
    args = p.parse_args(argv)

    def fail(message: str) -> NoReturn:
        """A usage error: one line on stderr, exit 2 (no usage text: the flags parsed)."""
        p.exit(2, f"{p.prog}: error: {message}\n")

    if importlib.util.find_spec("matplotlib") is None:
        fail("matplotlib is not installed: pip install matplotlib (or troll[plot])")
    try:
        with warnings.catch_warnings(record=True) as caught:  # a skipped torn line: one line on stderr
            warnings.simplefilter("always")
            written = plot_runs(args.runs, args.out)
    except (OSError, ValueError) as e:  # a missing or damaged run directory, an --out that is a file
        fail(str(e))
    for w in caught:
        print(f"{p.prog}: warning: {w.message}", file=sys.stderr)
    if not written:
        fail(f"none of the runs logged any of {', '.join(DEFAULT_KEYS)}")
    for path in written:
        print(path)


if __name__ == "__main__":
    run_command("python -m troll.plot", main)
