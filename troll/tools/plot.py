"""Curves from metrics.jsonl in one figure, a panel per metric, several runs overlaid (e.g. TROLL vs clip):

    troll plot runs/tiny-troll runs/tiny-clip --out plots/      # writes plots/metrics.png
    troll plot runs/s*-troll runs/s*-clip --by loss              # seeds: a colour per loss, its mean thick

Each run is one colour in every panel, labelled by its folder name in one legend above the panels; x is the RL step.
With `--by loss` (several seeds of each loss), each run is a thin line in the colour of the loss its config.json
names, and each loss's mean over its runs a thick one, the legend naming the losses and their runs.
A panel, titled in words, is drawn for each metric in PANELS that at least one run logged, in this order: what the
task pays (training reward, held-out accuracy `eval_acc`, and `behaviour_rate` where the task names a behaviour, as
tiny-rare does), the trust region (the network's exact per-update KL `kl_update_mean` where the run logs it, as
tiny-rare does with --kl_update_vocab, with each run's mean over its steps, the per-update KL the README quotes; the
largest per-token KL of the network and of the projected policy; the share of tokens the loss bounds), then entropy,
response length and gradient norm. The held-out accuracy starts at step 0, the evaluation before RL, so its curve
shows the starting point and the gain. `figure` returns the same figure for a notebook.

Usage errors exit 2 with one line naming the problem: a missing run directory, a missing or empty metrics.jsonl, a
line in it that is not a JSON object, or a row that is not as its declared schema says (troll.run.runfiles.METRICS: an
integer "step", numbers in their ranges), each named by file, line and field; a metrics.png in --out that
troll.tools.plot did not write. A torn last line (a run killed while appending one) is skipped with a warning
naming the file (`read_jsonl`).

Its own files only: every figure troll.tools.plot writes carries the PNG text entry Software=troll.plot
(FIGURE_MARK), and it replaces an <out>/metrics.png only when that file carries it (a figure it wrote before). Anything
else there of that name (someone's file, a figure from before the mark, a folder, a symbolic link, which is never
written through) is refused, unchanged: choose another --out.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from troll.base.cli import Parser, run_command
from troll.base.outputs import png_marked
from troll.run import runfiles

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PANELS = {  # metrics.jsonl key (troll.train.rl_step writes them) -> (the panel's title, what its y axis shows)
    "reward": ("Training reward", "mean reward of the step's samples"),
    "eval_acc": ("Held-out accuracy", "greedy, fraction solved"),
    "behaviour_rate": ("Samples showing the behaviour", "fraction of the step's samples"),
    "kl_update_mean": ("Per-update KL, network", "KL(new || old), mean per token"),
    "kl_before_max": ("Largest per-token KL, network", "max KL(p || q) in the update"),
    "kl_after_max": ("Largest per-token KL, projected", "max KL(pi* || q) in the update"),
    "frac_active": ("Tokens projected (fraction)", "projected (TROLL) or clipped"),
    "entropy": ("Entropy", "mean per token, nats"),
    "response_len_mean": ("Response length", "tokens per response"),
    "grad_norm": ("Gradient norm", "before clipping"),
}
MEAN_SHOWN = ("kl_update_mean",)  # panels that also show each run's mean over its steps (the figure docs quote)
DEFAULT_KEYS = tuple(PANELS)
FIGURE_NAME = "metrics.png"
FIGURE_MARK = ("Software", "troll.plot")  # a PNG text entry (key, value) in every figure written: the plot's own
COLUMNS = 3


def read_metrics(run: str | Path) -> list[dict]:
    """The rows of <run>/metrics.jsonl, each checked against its declared schema (troll.run.runfiles.METRICS: an integer
    "step" >= 0, every other value a number, the known ones in their ranges); a torn last line skipped (`read_jsonl`).
    """
    return runfiles.read_metrics(run)


def series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that logged `key`, in file order (eval_acc: from step 0)."""
    return [(m["step"], m[key]) for m in rows if key in m]


def read_runs(runs: Sequence[str | Path]) -> dict[str, list[dict]]:
    """{run folder name: its metrics rows}, in the order given; two runs of one name, or an empty one, refused."""
    data: dict[str, list[dict]] = {}
    for run in runs:
        name = Path(run).resolve().name
        if name in data:
            raise ValueError(f"two runs are named {name!r} (runs are labelled by their folder name)")
        data[name] = read_metrics(run)
        if not data[name]:
            raise ValueError(f"{Path(run) / 'metrics.jsonl'} is empty: the run has logged no step yet")
    return data


def curves(data: dict[str, list[dict]], keys: Sequence[str]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{key: {run name: points}} for every key at least one run logged, each value checked to be a number."""
    panels = {}
    for key in keys:
        lines = {name: pts for name, rows in data.items() if (pts := series(rows, key))}
        for name, pts in lines.items():
            bad = [(step, v) for step, v in pts if isinstance(v, bool) or not isinstance(v, (int, float))]
            if bad:
                raise ValueError(f"run {name}: {key} at step {bad[0][0]} is not a number: {bad[0][1]!r}")
        if lines:
            panels[key] = lines
    return panels


def losses(runs: Sequence[str | Path]) -> dict[str, str]:
    """{run folder name: the loss its config.json names} (troll.base.config.Config.load: a missing or damaged config is
    a ValueError naming the file)."""
    from troll.base.config import Config  # imports no torch

    out = {}
    for run in runs:
        path = Path(run) / "config.json"
        if not path.is_file():
            raise ValueError(f"{path} is missing: --by loss reads each run's loss from it (or pass --by run)")
        out[Path(run).resolve().name] = Config.load(path).loss
    return out


def mean_curve(lines: Sequence[Sequence[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The mean over the curves at each step any of them has, of the curves that have it."""
    at: dict[int, list[float]] = {}
    for pts in lines:
        for step, v in pts:
            at.setdefault(step, []).append(v)
    return [(step, sum(vs) / len(vs)) for step, vs in sorted(at.items())]


def figure(runs: Sequence[str | Path], keys: Sequence[str] = DEFAULT_KEYS, by: str = "run") -> Figure | None:
    """One figure: a panel (an Axes titled in words, PANELS; a key PANELS lacks titles its own) per key that at
    least one run logged, COLUMNS to a row, one legend for the figure. `by` "run": each run one colour throughout.
    `by` "loss" (seeds of TROLL and PPO-clip, say): each run a thin line in its loss's colour (`losses`), and the
    loss's mean over its runs at each step (`mean_curve`) a thick one. None when no run logged any of `keys`."""
    from matplotlib.figure import Figure  # no pyplot: leaves a notebook's inline backend alone
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    data = read_runs(runs)
    label = losses(runs) if by == "loss" else {name: name for name in data}
    panels = curves(data, keys)  # every value checked before anything is drawn
    if not panels:
        return None
    labels = list(dict.fromkeys(label.values()))
    colour = {x: f"C{i % 10}" for i, x in enumerate(labels)}  # a run is drawn in its label's
    cols = min(COLUMNS, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig = Figure(figsize=(4.2 * cols, 2.9 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, (key, lines) in zip(axes, panels.items(), strict=False):
        for name, pts in lines.items():
            thin = {"lw": 0.7, "alpha": 0.45} if by == "loss" else {"marker": "o" if len(pts) < 20 else None, "ms": 3}
            ax.plot(*zip(*pts, strict=True), color=colour[label[name]], **thin)
            if key in MEAN_SHOWN and by == "run":
                mean = sum(v for _, v in pts) / len(pts)
                ax.axhline(mean, color=colour[label[name]], ls="--", lw=0.8, label=f"mean {mean:.3f}")
        for x in labels if by == "loss" else ():
            mean = mean_curve([pts for name, pts in lines.items() if label[name] == x])
            if mean:
                ax.plot(*zip(*mean, strict=True), color=colour[x], lw=2.2)
        title, ylabel = PANELS.get(key, (key, ""))
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=8)
        if key in MEAN_SHOWN and by == "run":
            ax.legend(fontsize=7, frameon=False, handlelength=1.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # RL steps
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in axes[len(panels) :]:  # the last row's empty cells
        fig.delaxes(ax)
    count = {x: sum(label[name] == x for name in data) for x in labels}
    shown = [f"{x} ({count[x]} runs: thin; their mean: thick)" for x in labels] if by == "loss" else labels
    handles = [Line2D([], [], color=colour[x], label=text) for x, text in zip(labels, shown, strict=True)]
    fig.legend(handles=handles, loc="outside upper center", ncol=min(len(labels), 5), fontsize=9, frameon=False)
    fig.supxlabel("RL step (held-out accuracy from step 0, the evaluation before RL)", fontsize=9)
    return fig


def marked(path: Path) -> bool:
    """Whether file `path` is a PNG image carrying FIGURE_MARK among its text chunks: a figure troll.tools.plot
    wrote."""
    return png_marked(path, *FIGURE_MARK)


def plot_runs(
    runs: Sequence[str | Path], out: str | Path, keys: Sequence[str] = DEFAULT_KEYS, by: str = "run"
) -> Path | None:
    """Write the runs' figure (`figure`) to <out>/metrics.png, marked as troll.tools.plot's (FIGURE_MARK), and return
    that path; None (nothing written, no folder made) when no run logged any of `keys`. A metrics.png there that is not
    troll.tools.plot's (`marked`), or a symbolic link of that name, is a FileExistsError naming it, nothing written."""
    fig = figure(runs, keys, by)
    if fig is None:
        return None
    path = Path(out) / FIGURE_NAME
    if path.is_symlink():
        raise FileExistsError(
            f"{path} is a symbolic link, and troll plot never writes through one: choose another --out, or remove "
            "the link (what it points to is left alone)"
        )
    ours = path.exists()
    if ours and not (path.is_file() and marked(path)):
        raise FileExistsError(
            f"{path} is not a figure troll plot wrote (its own carry the PNG text {'='.join(FIGURE_MARK)}), so it is "
            "left as it is: choose another --out, or move it away"
        )
    Path(out).mkdir(parents=True, exist_ok=True)
    # a figure of its own is replaced; otherwise the file is created, never over one that appeared since the check
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_TRUNC if ours else os.O_EXCL)
    with os.fdopen(os.open(path, flags, 0o666), "wb") as f:
        fig.savefig(f, format="png", dpi=110, metadata=dict([FIGURE_MARK]))
    return path


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="troll plot", description="Plot metrics.jsonl of one or more runs")
    p.add_argument("runs", nargs="+", help="run directories (each holding metrics.jsonl)")
    p.add_argument("--out", default="plots", help=f"folder for the figure, {FIGURE_NAME}; default: %(default)s")
    p.add_argument(
        "--by",
        default="run",
        choices=["run", "loss"],
        help="a colour per run, or per loss (each run thin, the loss's mean over its runs thick); default: run",
    )
    args = p.parse_args(argv)

    def fail(message: str) -> NoReturn:
        """A usage error: one line on stderr, exit 2 (no usage text: the flags parsed)."""
        p.exit(2, f"{p.prog}: error: {message}\n")

    if importlib.util.find_spec("matplotlib") is None:
        fail("matplotlib is not installed (troll depends on it): pip install -r requirements.txt -e .")
    try:
        with warnings.catch_warnings(record=True) as caught:  # a skipped torn line: one line on stderr
            warnings.simplefilter("always")
            written = plot_runs(args.runs, args.out, by=args.by)
    except (OSError, ValueError) as e:  # a missing or damaged run directory, an --out that is a file, a foreign figure
        fail(str(e))
    for w in caught:
        print(f"{p.prog}: warning: {w.message}", file=sys.stderr)
    if written is None:
        fail(f"none of the runs logged any of {', '.join(DEFAULT_KEYS)}")
    print(written)


if __name__ == "__main__":
    run_command("troll plot", main)
