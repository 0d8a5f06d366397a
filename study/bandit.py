"""The rare-token bandit: how fast each loss lets a good token the policy rates rare grow, at an LLM's vocabulary.

    python -m study.bandit --dry-run                    # the grid and its size
    python -m study.bandit --jobs 2                     # run it (resumable: run it again to go on)
    python -m study.bandit --report                     # paired differences to PPO-clip, best against best
    python -m study.bandit --figures study/figures      # figures/bandit_steps.png, bandit_curves.png
    python -m study.bandit --cells issue --variants troll-0.05 clip-0.2 --seeds 0 --steps 3 --vocab 2000 \\
        --results runs/bandit-smoke.jsonl               # a smoke test

A contextual bandit is one generated token with nothing before or after it: the question of docs/algorithm.md,
section 11 (how much may a token at probability q grow in one update, under a ratio clip and under a KL ball),
asked of the project's own losses on the project's own sparse old policy. Design, stated once:
- The simulator (the policy, its initial rows, the good tokens, an RL step, the rewards and what is measured):
  study/bandit_sim.py.
- Variants (`VARIANTS`): TROLL with eps 0.01, 0.02, 0.05, 0.1, 0.2; PPO-clip with range 0.1, 0.2, 0.3 and
  Clip-Higher (0.2 / 0.28); DPPO (Binary-TV) with its ratio cap at 10 (`dppo`: the project's default, Stable-RL's
  fallback), 2 (`dppo-cap2`: this project's before the cap was a setting), 20 (verl's fallback) and 10000
  (`dppo-cap10000`: verl's DPPO example, no cap in effect; docs/algorithm.md, section 6); CISPO with eps_high 0.2
  (cap 1.2, verl's), 1 and 5. The project's defaults: troll-0.05 and clip-0.2.
- Cells (`CELLS`; which variants run in each: `CELL_VARIANTS`, sized to the 2 shared cores): `issue` (clean
  reward, 4 passes per batch, lr 0.1, V = 32,000: the issue's own trial) with every variant; `noisy` (its noisy
  reward) with TROLL eps 0.01, 0.05, 0.2, every PPO-clip, DPPO and CISPO setting; `qwen` (the issue cell at Qwen's
  V = 151,936, five times the work per run) with TROLL and PPO-clip at their defaults; `passes1` (1 pass),
  `lr-high` (lr 0.3) and `noisy-lr-high` (the noisy reward at lr 0.3) with TROLL, PPO-clip, CISPO and DPPO at
  their defaults and DPPO uncapped. 20 RL steps per run, seeds 0-4: 235 runs.
- Results (`--results`, JSONL): one row per run, merged by name after every run; a run recorded with other
  settings is refused, not counted, and a row that is not this study's (`FIELDS`: another study's file) is refused.
  A value given twice in `--cells`, `--variants` or `--seeds`, or one that makes no run (a variant none of the
  `--cells` runs), is refused (study/runner.py). `--jobs N` (N > 1) runs N spawned worker processes with
  cores / N threads each (study/runner.py); one job runs in this process.
- Modes: a run (or --dry-run), --report, --figures (the last two together too). With --report or --figures, which
  read only the results file, a run's flag given (the grid, --steps, --samples, --vocab, --jobs, --dry-run:
  `ACTS`) cannot act and is refused in one line (study/runner.py).
- Figures (`--figures DIR`): bandit_steps.png and bandit_curves.png, each marked with the PNG text
  Software=study.bandit and replacing only a figure so marked; a foreign file, a folder or a symbolic link of those
  names is refused before anything is drawn (study.runner.check_figures, troll.base.outputs).
- Report: per cell and variant, means over seeds and paired differences to PPO-clip 0.2 (`BASELINE`) on the same
  seed with 95% t-intervals (study.runner.t_interval) of the focus context's steps to the threshold (the good
  token at 0.005, the issue's rank 20) and of `auc`; then best against best: each loss at its own best setting in
  the cell (the highest mean `auc`), paired with the best PPO-clip setting (Clip-Higher included).
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from study.bandit_sim import TARGETS, THRESHOLD, Cell, simulate
from study.runner import (
    NAME,
    OBJECT,
    PER_STEP,
    REPORT_MODES,
    SEED,
    check_figures,
    grid_problem,
    inert_flag,
    jobs_problem,
    one_of,
    paired_diffs,
    plan,
    pm,
    read_results,
    refuse_other_settings,
    report_modes,
    report_rows,
    run_all,
    save,
    t_interval,
    workers,
)
from troll.base.cli import Parser, run_command
from troll.base.schema import Spec

FOCUS = 2  # the context reported in the table: the good token at 0.005 (rank 21 of 32,000; the issue's rank 20)
VARIANTS: dict[str, tuple[str, dict]] = {
    "troll-0.01": ("troll", {"eps": 0.01}),
    "troll-0.02": ("troll", {"eps": 0.02}),
    "troll-0.05": ("troll", {"eps": 0.05}),
    "troll-0.1": ("troll", {"eps": 0.1}),
    "troll-0.2": ("troll", {"eps": 0.2}),
    "clip-0.1": ("ppo_clip", {"eps_low": 0.1, "eps_high": 0.1}),
    "clip-0.2": ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.2}),
    "clip-0.3": ("ppo_clip", {"eps_low": 0.3, "eps_high": 0.3}),
    "clip-higher": ("ppo_clip", {"eps_low": 0.2, "eps_high": 0.28}),
    "dppo": ("dppo", {"divergence": "binary_tv", "ratio_cap": 10.0}),  # the default cap c: Stable-RL's fallback
    "dppo-cap2": ("dppo", {"divergence": "binary_tv", "ratio_cap": 2.0}),
    "dppo-cap20": ("dppo", {"divergence": "binary_tv", "ratio_cap": 20.0}),  # verl's fallback
    "dppo-cap10000": ("dppo", {"divergence": "binary_tv", "ratio_cap": 10000.0}),  # verl's DPPO example: uncapped
    "cispo": ("cispo", {"eps_high": 0.2}),  # verl's
    "cispo-1": ("cispo", {"eps_high": 1.0}),
    "cispo-5": ("cispo", {"eps_high": 5.0}),  # SkyRL's example
}
DEFAULTS = ("troll-0.05", "clip-0.2", "clip-higher", "dppo", "cispo")  # each loss at the project's setting
BASELINE = "clip-0.2"
SEEDS = (0, 1, 2, 3, 4)
PROG = "python -m study.bandit"
MARK = "study.bandit"  # its figures carry the PNG text Software=study.bandit: its own (troll.base.outputs)

CELLS = {
    "issue": Cell("clean", 4, 0.1, 32_000),
    "noisy": Cell("noisy", 4, 0.1, 32_000),
    "qwen": Cell("clean", 4, 0.1, 151_936),
    "passes1": Cell("clean", 1, 0.1, 32_000),
    "lr-high": Cell("clean", 4, 0.3, 32_000),
    "noisy-lr-high": Cell("noisy", 4, 0.3, 32_000),
}
NOISY_SWEEP = ("troll-0.01", "troll-0.05", "troll-0.2", "clip-0.1", "clip-0.2", "clip-0.3", "clip-higher")
BASELINE_SWEEP = ("dppo", "dppo-cap2", "dppo-cap20", "dppo-cap10000", "cispo", "cispo-1", "cispo-5")
NOISY_SWEEP += BASELINE_SWEEP
SMALL = ("troll-0.05", "clip-0.2", "cispo", "dppo", "dppo-cap10000")  # the defaults, and DPPO uncapped
CELL_VARIANTS = {"noisy": NOISY_SWEEP, "qwen": SMALL[:2], "passes1": SMALL, "lr-high": SMALL, "noisy-lr-high": SMALL}


# What a results row holds that the report and figures read, as declared (study.runner.check_rows)
FIELDS = {
    "name": NAME, "cell": one_of(CELLS), "variant": one_of(VARIANTS), "seed": SEED, "settings": OBJECT,
    "q0": Spec("number", low=0, high=1, per_token=True, per="context"),
    "p_good": Spec("list", per_token=True, per="context", words="a list of p(good) per step"),
    "steps_to": Spec("integer", low=0, per_token=True, per="context"), "auc": Spec("float", low=0, high=1),
    "final": Spec("float", low=0, high=1), "kl_update_mean": PER_STEP, "kl_update_max": PER_STEP,
    "collapsed": Spec("boolean", per_token=True, per="context"),
}  # fmt: skip
# The list flags and each run's value of them (study.runner.grid_problem: no value twice, none that makes no run)
FLAGS = {"cells": lambda run: run.cell, "variants": lambda run: run.variant, "seeds": lambda run: run.seed}


@dataclass(frozen=True)
class Run:
    cell: str
    variant: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.cell}_{self.variant}_s{self.seed}"


# ----------------------------------------------------------------------------- the grid


def grid(args: argparse.Namespace) -> list[Run]:
    """Every run: cell by cell, seed by seed, every variant of a seed together (a study cut short holds whole
    seeds of whole cells)."""
    return [
        Run(cell, variant, seed)
        for cell in args.cells
        for seed in args.seeds
        for variant in args.variants
        if variant in CELL_VARIANTS.get(cell, VARIANTS)
    ]


def cell_of(run: Run, args: argparse.Namespace) -> Cell:
    """The run's cell, with --vocab in place of its vocabulary when given."""
    cell = CELLS[run.cell]
    return Cell(**(asdict(cell) | ({"vocab": args.vocab} if args.vocab else {})))


def settings(run: Run, args: argparse.Namespace) -> dict:
    """Everything that makes a run's numbers: its cell, variant, seed and the run length."""
    loss, kwargs = VARIANTS[run.variant]
    return {
        **asdict(cell_of(run, args)),
        "loss": loss,
        **kwargs,
        "seed": run.seed,
        "steps": args.steps,
        "samples": args.samples,
    }


def bandit(cell: Cell, variant: str, seed: int, steps: int = 20, samples: int = 64, trace: bool = False) -> dict:
    """One run of a variant (study.bandit_sim.simulate); returns its measurements (the results row without its name
    and settings)."""
    return simulate(cell, *VARIANTS[variant], seed, steps, samples, trace)


def execute(run: Run, args: argparse.Namespace) -> dict:
    """One results row."""
    row = {"name": run.name, **asdict(run), "settings": settings(run, args)}
    return row | bandit(cell_of(run, args), run.variant, run.seed, args.steps, args.samples)


# ----------------------------------------------------------------------------- the report


def family(variant: str) -> str:
    """The loss a variant belongs to (PPO-clip's ranges and Clip-Higher are one family)."""
    return VARIANTS[variant][0]


def _paired(rows: Sequence[dict], a: str, b: str, key) -> tuple[float, float, int]:
    """Mean and 95% half-width of key(run of a) - key(run of b) over the seeds both ran; and that seed count."""
    diffs = paired_diffs(*({r["seed"]: key(r) for r in rows if r["variant"] == v} for v in (a, b)))
    return (*t_interval(diffs), len(diffs)) if diffs else (math.nan, math.nan, 0)


def steps_focus(row: dict) -> float:
    return row["steps_to"][FOCUS]


def auc(row: dict) -> float:
    return row["auc"]


def summary(rows: Sequence[dict], baseline: str = BASELINE) -> list[dict]:
    """Per (cell, variant): seeds, means, the paired differences to the baseline (steps to the threshold in the
    focus context, auc), update KL and collapses."""
    out = []
    for cell in [c for c in CELLS if any(r["cell"] == c for r in rows)]:
        mine = [r for r in rows if r["cell"] == cell]
        for variant in [v for v in VARIANTS if any(r["variant"] == v for r in mine)]:
            runs = [r for r in mine if r["variant"] == variant]
            d_steps, h_steps, _ = _paired(mine, variant, baseline, steps_focus)
            d_auc, h_auc, _ = _paired(mine, variant, baseline, auc)
            out.append({
                "cell": cell, "variant": variant, "n": len(runs),
                "steps": statistics.fmean(steps_focus(r) for r in runs),
                "censored": sum(steps_focus(r) > r["settings"]["steps"] for r in runs),
                "d_steps": d_steps, "h_steps": h_steps,
                "auc": statistics.fmean(auc(r) for r in runs), "d_auc": d_auc, "h_auc": h_auc,
                "final": statistics.fmean(r["final"] for r in runs),
                "kl_mean": statistics.fmean(statistics.fmean(r["kl_update_mean"] or [math.nan]) for r in runs),
                "kl_max": max(max(r["kl_update_max"] or [math.nan]) for r in runs),
                "collapsed": sum(any(r["collapsed"]) for r in runs),
            })  # fmt: skip
    return out


def best_vs_best(rows: Sequence[dict], baseline_family: str = "ppo_clip") -> list[dict]:
    """Per cell and loss: its best setting there (highest mean auc; ties go to the earlier variant in VARIANTS),
    paired with the baseline family's best."""
    out = []
    for cell in [c for c in CELLS if any(r["cell"] == c for r in rows)]:
        mine = [r for r in rows if r["cell"] == cell]
        ran = [v for v in VARIANTS if any(r["variant"] == v for r in mine)]  # in VARIANTS' order, not a set's
        means = {v: statistics.fmean(auc(r) for r in mine if r["variant"] == v) for v in ran}
        best = {}
        for v in sorted(means, key=lambda v: -means[v]):
            best.setdefault(family(v), v)
        if baseline_family not in best:
            continue
        ref = best[baseline_family]
        for loss in [x for x in ("troll", "ppo_clip", "dppo", "cispo") if x in best]:
            v = best[loss]
            d_auc, h_auc, n = _paired(mine, v, ref, auc)
            d_steps, h_steps, _ = _paired(mine, v, ref, steps_focus)
            out.append({
                "cell": cell, "loss": loss, "best": v, "vs": ref, "n": n, "auc": means[v],
                "d_auc": d_auc, "h_auc": h_auc, "d_steps": d_steps, "h_steps": h_steps,
            })  # fmt: skip
    return out


def report(rows: Sequence[dict], baseline: str = BASELINE) -> str:
    """The paired table and the best-against-best tables (against the best PPO-clip, and against TROLL's best) as
    markdown."""
    lines = [
        f"| cell | variant | seeds | steps to {THRESHOLD} at q0 {TARGETS[FOCUS]:g} | vs {baseline} (95% CI) | auc | "
        f"vs {baseline} (95% CI) | final reward | update KL mean | update KL max | collapsed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in summary(rows, baseline):
        base = c["variant"] == baseline
        censored = f" ({c['censored']} not reached)" if c["censored"] else ""
        lines.append(
            f"| {c['cell']} | {c['variant']} | {c['n']} | {c['steps']:.1f}{censored} | "
            f"{'-' if base else pm(c['d_steps'], c['h_steps'], '+.1f')} | {c['auc']:.3f} | "
            f"{'-' if base else pm(c['d_auc'], c['h_auc'])} | {c['final']:.3f} | {c['kl_mean']:.4f} | "
            f"{c['kl_max']:.3f} | {c['collapsed']}/{c['n']} |"
        )
    ran = {(r["cell"], r["variant"]) for r in rows}
    if missing := [c for c in CELLS if any(cell == c for cell, _ in ran) and (c, baseline) not in ran]:
        lines += ["", f"No {baseline} run in cell {', '.join(missing)}: its paired columns there are '-'."]
    for family_, name in (("ppo_clip", "the best PPO-clip"), ("troll", "TROLL's best")):
        lines += [
            "",
            f"| cell | loss | its best setting | auc | vs {name} (95% CI) | steps: vs {name} |",
            "|---|---|---|---|---|---|",
        ]
        for b in best_vs_best(rows, family_):
            vs = "-" if b["loss"] == family_ else pm(b["d_auc"], b["h_auc"])
            steps = "-" if b["loss"] == family_ else pm(b["d_steps"], b["h_steps"], "+.1f")
            lines.append(f"| {b['cell']} | {b['loss']} | {b['best']} | {b['auc']:.3f} | {vs} | {steps} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the figures


def plot_steps(rows: Sequence[dict], out: Path) -> Path:
    """One panel per cell: steps until p(good) >= THRESHOLD against the good token's initial probability, each loss
    at its default setting (mean over seeds; a run that never got there counts as steps + 1, the dotted line)."""
    from matplotlib.figure import Figure

    cells = [c for c in CELLS if any(r["cell"] == c for r in rows)]
    cols = min(3, len(cells))
    rows_ = math.ceil(len(cells) / cols)
    fig = Figure(figsize=(3.6 * cols, 3.2 * rows_))
    axes = fig.subplots(rows_, cols, squeeze=False).reshape(-1)
    for ax in axes[len(cells) :]:
        ax.set_visible(False)
    for ax, cell in zip(axes, cells, strict=False):
        mine = [r for r in rows if r["cell"] == cell]
        for variant in [v for v in DEFAULTS if any(r["variant"] == v for r in mine)]:
            runs = [r for r in mine if r["variant"] == variant]
            q0 = runs[0]["q0"]
            mean = [statistics.fmean(r["steps_to"][i] for r in runs) for i in range(len(q0))]
            ax.plot(q0, mean, "o-", ms=4, color=f"C{DEFAULTS.index(variant)}", label=variant)
        steps = mine[0]["settings"]["steps"]
        ax.axhline(steps + 1, color="grey", ls=":", lw=1)
        s = mine[0]["settings"]
        ax.set(xscale="log", xlabel="good token's initial probability", title=f"{cell}: {s['reward']}, "
               f"{s['passes']} pass(es), lr {s['lr']:g}, V {s['vocab']:,}")  # fmt: skip
        ax.title.set_fontsize(8)
    for ax in axes[::cols]:
        ax.set_ylabel(f"RL steps until p(good) >= {THRESHOLD}")
    axes[0].legend(fontsize=7)
    return save(fig, out / "bandit_steps.png", MARK)


def plot_curves(rows: Sequence[dict], out: Path, cell: str = "issue") -> Path:
    """The cell's focus context (the good token at 0.005): p(good) per RL step and the update's exact KL per step,
    each loss at its default setting, mean over seeds (the band: min to max)."""
    from matplotlib.figure import Figure

    mine = [r for r in rows if r["cell"] == cell]
    fig = Figure(figsize=(10, 3.4))
    ax1, ax2 = fig.subplots(1, 2)
    for variant in [v for v in DEFAULTS if any(r["variant"] == v for r in mine)]:
        runs, color = [r for r in mine if r["variant"] == variant], f"C{DEFAULTS.index(variant)}"
        curves = list(zip(*(r["p_good"][FOCUS] for r in runs), strict=False))
        xs = range(len(curves))
        ax1.plot(xs, [statistics.fmean(c) for c in curves], color=color, label=variant)
        ax1.fill_between(xs, [min(c) for c in curves], [max(c) for c in curves], color=color, alpha=0.15)
        kls = list(zip(*(r["kl_update_mean"] for r in runs), strict=False))
        ax2.plot(range(1, len(kls) + 1), [statistics.fmean(k) for k in kls], color=color, label=variant)
    ax1.axhline(THRESHOLD, color="grey", ls=":", lw=1)
    ax1.set(yscale="log", xlabel="RL step", ylabel="p(good)", title=f"{cell}: the good token at {TARGETS[FOCUS]:g}")
    ax2.set(yscale="log", xlabel="RL step", ylabel="KL(p_new || p_old), mean over contexts",
            title="exact KL of each update, over all V")  # fmt: skip
    ax1.legend(fontsize=7)
    return save(fig, out / "bandit_curves.png", MARK)


# ----------------------------------------------------------------------------- the command


# The command's modes (run, report, figures) and which are on: study.runner's, shared with the other such study
MODES, modes = REPORT_MODES, report_modes
# Each flag that acts in some modes only -> those modes (the others, --results, --report and --figures, act in
# every mode): the report and the figures read the results file, not the grid's flags.
ACTS = dict.fromkeys(
    ("--cells", "--variants", "--seeds", "--steps", "--samples", "--vocab", "--jobs", "--dry-run"), ("run",)
)


def parser() -> Parser:
    """The command's flags."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--results", default="study/bandit.jsonl", help="results file; default: %(default)s")
    p.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--steps", type=int, default=20, help="RL steps per run; default: %(default)s")
    p.add_argument("--samples", type=int, default=64, help="samples per context per step; default: %(default)s")
    p.add_argument("--vocab", type=int, default=0, help="every cell's vocabulary size (0: the cell's own)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time; default: %(default)s")
    p.add_argument("--dry-run", action="store_true", help="list the grid, run nothing")
    p.add_argument("--report", action="store_true", help="print the paired tables of the results file")
    p.add_argument("--figures", default=None, help="draw the figures of the results file into this folder")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.figures == "":
        p.error("--figures names the folder to draw into, got ''")
    if problem := inert_flag(p, argv, ACTS, modes(args), MODES):  # before the checks of a flag that cannot act
        p.error(problem)
    for name in ("steps", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if problem := jobs_problem(args.jobs):
        p.error(problem)
    if args.samples < 2:
        p.error(f"--samples must be >= 2 (GRPO needs a group), got {args.samples}")
    if args.vocab and args.vocab < 1000:
        p.error(f"--vocab must be 0 (the cells' own) or at least 1,000 (the rarest target's rank), got {args.vocab}")
    if any(s < 0 for s in args.seeds):
        p.error(f"--seeds must be >= 0, got {args.seeds}")
    if Path(args.results).is_dir():
        p.error(f"--results {args.results} is a folder, not a file")
    if not grid(args):
        p.error("the grid is empty: the --cells given run none of the --variants given (CELL_VARIANTS)")
    if problem := grid_problem(p, args, grid(args), FLAGS, "CELL_VARIANTS: the variants each cell runs"):
        p.error(problem)
    return args


def progress(row: dict) -> str:
    """A finished run's line: the steps to the threshold per context, auc and time."""
    return f"{row['name']}: steps to {THRESHOLD} {row['steps_to']}, auc {row['auc']:.3f}, {row['wall_s']:.1f} s"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse(argv)
    if modes(args) != ["run"]:
        rows = report_rows(Path(args.results), PROG, FIELDS)
        if args.report:
            print(report(rows))
        if args.figures is not None:  # every name checked before the first is drawn (study.runner.check_figures)
            curves = any(r["cell"] == "issue" for r in rows)
            check_figures(Path(args.figures), ["bandit_steps.png", *(["bandit_curves.png"] if curves else [])], MARK)
            print(plot_steps(rows, Path(args.figures)))
            if curves:
                print(plot_curves(rows, Path(args.figures)))
        return rows
    runs, done = grid(args), read_results(Path(args.results), FIELDS, PROG)
    for run in runs:  # a run recorded with other settings is not counted as done
        refuse_other_settings(PROG, run.name, args.results, done.get(run.name, {}).get("settings"), settings(run, args))
    todo = plan(runs, done, args.jobs, args.dry_run)
    if args.dry_run:
        return []
    # one job: in this process (a run takes seconds, a fresh worker's imports would take longer)
    with workers(args.jobs, in_process=True) as pool:
        return run_all(pool, execute, [(run, args) for run in todo], Path(args.results), progress)


if __name__ == "__main__":
    run_command(PROG, main)
