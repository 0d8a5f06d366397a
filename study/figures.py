"""The study's figures from its results file (PNG), and the results file's reader:

    python -m study.figures study/results.jsonl --out study/figures/

`read_results` reads the file study/run.py writes (JSONL, one finished run per line; its fields: `study.run.collect`);
`plot_study` draws accuracy after RL against off-policyness per loss, and the distribution of the network's
per-update KL per loss. A missing, empty or damaged results file exits 2 with one line naming it.

Its own files only (troll.base.outputs): each figure carries the PNG text Software=study.figures, and replaces a file of
its name in --out only when that file carries it (a figure it wrote before). Someone else's file of that name, a
figure without the mark (the committed ones made before it), a folder or a symbolic link there is refused in one
line before anything is drawn, unchanged: move it away, or choose another --out.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from study.runner import ACCURACY, LR, NAME, PER_STEP, SEED, check_figures, check_rows, save
from troll.base.checkpoint import read_jsonl
from troll.base.cli import Parser, UsageError, run_command
from troll.base.schema import Spec

# the fields of a results row that the figures read, as declared (study.runner.check_rows)
FIELDS = {
    "name": NAME, "variant": Spec("string"), "lr": LR, "minibatches": Spec("integer", low=1),
    "epochs": Spec("integer", low=1), "off_policy": Spec("integer", low=1), "seed": SEED, "eval_before": ACCURACY,
    "eval_after": ACCURACY, "kl_update_mean": PER_STEP, "kl_update_max": PER_STEP,
}  # fmt: skip
FIGURES = ("accuracy_vs_off_policy.png", "kl_update.png")  # what plot_study writes into --out
MARK = "study.figures"  # its figures carry the PNG text Software=study.figures: its own (troll.base.outputs)


def read_results(path: str | Path) -> list[dict]:
    """The rows of a study results file (JSONL, one finished run per line); a ValueError naming the file and the
    line when a line is not a JSON object, a row lacks one of `FIELDS` (another study's row) or holds one not as
    declared there (study.runner.check_rows)."""
    rows = read_jsonl(path)
    check_rows(Path(path), rows, FIELDS, "python -m study.run")
    return rows


def _by(rows: Sequence[dict], *keys: str) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return dict(sorted(groups.items()))


def plot_study(rows: Sequence[dict], out: str | Path) -> list[Path]:
    """The study's figures from its results rows; returns the written paths:

    accuracy_vs_off_policy.png   held-out accuracy after RL against off-policyness (minibatches x epochs, log
                                 axis), one panel per lr, one colour per loss; a point is the mean over seeds,
                                 its bar the min-max; circles and solid lines: 1 epoch, squares and dashed lines:
                                 more epochs (drawn a little to the right, so 4x1 and 1x4 do not overlap); the
                                 dotted line is the mean accuracy before RL (the warm-start); the black star is the
                                 on-policy run (1x1, one variant standing for every loss).
    kl_update.png                the network's own exact KL(p_new || p_old) per update, its per-step mean (top)
                                 and max (bottom): one box per loss and setting over all its seeds' steps (black:
                                 the on-policy 1x1 run), one panel per lr, log scale, whiskers 1.5 IQR.
    """
    from matplotlib.figure import Figure

    out = Path(out)
    check_figures(out, FIGURES, MARK)  # before the first is drawn: a file there not the study's is refused
    lrs = sorted({r["lr"] for r in rows})
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    on_policy = [r for r in rows if r["off_policy"] == 1]
    off_policy = [r for r in rows if r["off_policy"] > 1]

    fig = Figure(figsize=(4.2 * len(lrs), 3.6))
    axes = fig.subplots(1, len(lrs), squeeze=False, sharey=True)[0]
    for ax, lr in zip(axes, lrs, strict=True):
        at_lr = [r for r in rows if r["lr"] == lr]
        ax.axhline(sum(r["eval_before"] for r in at_lr) / len(at_lr), color="grey", ls=":", lw=1, label="before RL")
        for (_, epochs, variant), runs in _by(
            [r for r in off_policy if r["lr"] == lr], "lr", "epochs", "variant"
        ).items():
            # side by side, not on top: losses spread a little, settings with more epochs a little further right
            shift = 2 ** (0.04 * (variants.index(variant) - len(variants) / 2) + (0.25 if epochs > 1 else 0.0))
            pts = []
            for (x,), group in _by(runs, "off_policy").items():
                accs = [r["eval_after"] for r in group]
                pts.append((x * shift, sum(accs) / len(accs), min(accs), max(accs)))
            xs, mean, low, high = zip(*pts, strict=True)
            yerr = [[m - lo for m, lo in zip(mean, low, strict=True)], [h - m for m, h in zip(mean, high, strict=True)]]
            label = variant if epochs == min(r["epochs"] for r in off_policy if r["variant"] == variant) else None
            ax.errorbar(
                xs,
                mean,
                yerr=yerr,
                color=colours[variant],
                ls="-" if epochs == 1 else "--",
                marker="o" if epochs == 1 else "s",
                ms=4,
                capsize=2,
                label=label,
            )
        accs = [r["eval_after"] for r in on_policy if r["lr"] == lr]
        if accs:
            m = sum(accs) / len(accs)
            ax.errorbar(
                [1],
                [m],
                yerr=[[m - min(accs)], [max(accs) - m]],
                color="k",
                marker="*",
                ms=9,
                capsize=2,
                label="on-policy (1x1)",
            )
        ax.set_xscale("log", base=2)
        ax.set(xlabel="off-policyness: minibatches x epochs", title=f"lr {lr:g}")
    axes[0].set_ylabel("held-out accuracy after RL")
    axes[0].plot([], [], "o-", color="grey", label="1 epoch")
    axes[0].plot([], [], "s--", color="grey", label="more epochs")
    axes[0].legend(fontsize=7)
    written = [save(fig, out / "accuracy_vs_off_policy.png", MARK)]

    settings = sorted({(r["minibatches"], r["epochs"]) for r in rows}, key=lambda s: (s[0] * s[1], s[1]))
    fig = Figure(figsize=(4.2 * len(lrs), 6.4))
    axes = fig.subplots(2, len(lrs), squeeze=False, sharey="row")
    width = 0.8 / max(len(variants), 1)
    for row_axes, key in zip(axes, ("kl_update_mean", "kl_update_max"), strict=True):
        for ax, lr in zip(row_axes, lrs, strict=True):
            for j, setting in enumerate(settings):
                for i, variant in enumerate(variants):
                    runs = [r for r in rows if r["lr"] == lr and r["variant"] == variant]
                    vals = [v for r in runs if (r["minibatches"], r["epochs"]) == setting for v in r[key] if v > 0]
                    if not vals:
                        continue
                    box = ax.boxplot(
                        [vals],
                        positions=[j + (i - (len(variants) - 1) / 2) * width],
                        widths=width * 0.9,
                        patch_artist=True,
                        showfliers=False,
                    )
                    box["boxes"][0].set(facecolor=colours[variant] if setting != (1, 1) else "k", alpha=0.6)
            ax.set_yscale("log")
            ax.set_xticks(range(len(settings)), [f"{m}x{e}" for m, e in settings])
            ax.set(title=f"lr {lr:g}", xlabel="minibatches x epochs")
        row_axes[0].set_ylabel(f"{key} per RL step")
    handles = [axes[0][0].plot([], [], "s", color=colours[v], alpha=0.6, label=v)[0] for v in variants]
    axes[0][0].legend(handles=handles, fontsize=7)
    fig.suptitle("the network's exact KL(p_new || p_old) per update, over the vocabulary", fontsize=10)
    written.append(save(fig, out / "kl_update.png", MARK))
    return written


def main(argv: Sequence[str] | None = None) -> None:
    p = Parser(prog="python -m study.figures", description="Figures of study/run.py's results")
    p.add_argument("results", help="the results file (JSONL) that study/run.py wrote")
    p.add_argument("--out", default="study/figures", help="folder for the PNGs; default: %(default)s")
    args = p.parse_args(argv)

    def fail(message: str) -> NoReturn:
        """A usage error: one line on stderr, exit 2 (no usage text: the flags parsed)."""
        p.exit(2, f"{p.prog}: error: {message}\n")

    if importlib.util.find_spec("matplotlib") is None:
        fail("matplotlib is not installed (troll depends on it): pip install -r requirements.txt -e .")
    if not Path(args.results).is_file():
        fail(f"results file {args.results} does not exist")
    try:
        rows = read_results(args.results)
        if not rows:
            fail(f"{args.results} holds no finished runs")
        written = plot_study(rows, args.out)
    except (OSError, ValueError, UsageError) as e:  # a damaged results file, an --out that is a file, a foreign PNG
        fail(str(e))
    for path in written:
        print(path)


if __name__ == "__main__":
    run_command("python -m study.figures", main)
