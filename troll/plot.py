"""Curves from metrics.jsonl, one PNG per metric, several runs overlaid (e.g. TROLL vs clip):

    python -m troll.plot runs/tiny-troll runs/tiny-clip --out plots/

Each run is labelled by its folder name; x is the RL step. Metrics that a run lacks are skipped for it. The held-out
accuracy (`eval_acc`) starts at step 0, the evaluation before RL, so the curve shows the starting point and the gain.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

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
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {run} a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `key`, in file order (eval_acc: from step 0)."""
    return [(m["step"], m[key]) for m in rows if key in m]


def plot_runs(runs: Sequence[str | Path], out: str | Path, keys: Sequence[str] = DEFAULT_KEYS) -> list[Path]:
    """Write <out>/<key>.png for every key that at least one run logged; returns the written paths."""
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's inline backend alone

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    data = {Path(r).name: read_metrics(r) for r in runs}
    written = []
    for key in keys:
        curves = {name: series(rows, key) for name, rows in data.items()}
        curves = {name: pts for name, pts in curves.items() if pts}
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
    p = argparse.ArgumentParser(description="Plot metrics.jsonl of one or more runs")
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", default="plots")
    args = p.parse_args(argv)
    for path in plot_runs(args.runs, args.out):
        print(path)


if __name__ == "__main__":
    main()
