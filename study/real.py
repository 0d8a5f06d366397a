"""A real model that learns on a CPU: TROLL against PPO-clip on SmolLM2-135M-Instruct, each at its best learning rate.

    python -m study.real --dry-run                 # the runs, and the time they take from a measured step time
    python -m study.real --jobs 2                  # run it (resumable: run it again to go on)
    python -m study.real --report                  # per loss and lr, TROLL - PPO-clip at each one's best lr, stability
    python -m study.real --model tiny --seeds 0 1 --lrs 1e-5 2e-5 --steps 1 --eval_size 4 --sft_steps 1 \\
        --out runs/real-smoke --results runs/real-smoke/results.jsonl       # a rehearsal: a few minutes

Design, stated once:
- The runs are the `smollm2-words` preset's (troll.base.config.PRESETS; `PRESET`): SmolLM2-135M-Instruct
  (troll.models.packaged, by name) on arithmetic word problems asked and scored as GSM8K is (troll.tasks.words), chat
  prompts, 8 prompts x 8 samples a step of which the groups with signal are trained on, 4 minibatches, 60 RL steps
  at a cosine lr, held-out accuracy (greedy pass@1) on 500 problems every 20 steps. A run changes only what the study
  varies: the loss, the learning rate, the seed, where it starts (`--model <the seed's warm-start> --sft_steps 0`)
  and, where given, `--steps` and `--eval_size`; it keeps a checkpoint at every evaluation, so an interrupted run
  loses at most 20 steps. `config` checks that
  every setting that asks, samples and scores a problem (`ASKED`: the task, chat template, prompt and answer
  lengths, temperature, prompts and samples a step, minibatches and epochs, advantage and aggregation, the
  evaluation schedule) is the preset's.
- Paired seeds, one warm-start per seed: the preset's supervised warm-start (at most `--sft_steps`, the preset's
  40; it stops once greedy decoding solves 15% of a 256-problem training probe, 7-9 steps on SmolLM2) runs once
  per seed into <out>/warm-s<seed> (model, tokenizer and warm.json), and every run of that seed starts RL from
  those weights: a difference between two losses on one seed is not a difference between warm-starts. The
  warm-start checks that the tokenizer it saved asks the preset's prompts token for token (the chat template kept).
- The sweep, then the best: the first `--sweep_seeds` seeds of `--seeds` (default 1) run every `--lrs` value
  (default 5e-6, 1e-5 (the preset's), 2e-5) for every loss; each loss's best lr is the one with the highest mean
  held-out accuracy after RL over those seeds (ties: the smaller lr, the more cautious step); the other seeds then
  run each loss at its own best lr only. `--sweep_seeds` equal to the number of seeds is the full grid.
- Stability, the paper's other claim: once the best lrs are chosen, the first `--stability_seeds` seeds (default 3,
  or every seed if fewer) run each loss at every `--stability` multiple of its own best lr (default 2 and 4); a run
  the sweep made already (the same loss, lr and seed) is that run. A row records which part made it (`stage`:
  sweep, best, stability), and the best lr is chosen from the sweep's rows only.
- Losses (`--losses`): TROLL and PPO-clip by default, each at its own default trust region (TROLL eps 0.05,
  PPO-clip 0.2); DPPO and CISPO may be added, and are paired with PPO-clip too.
- Order: the sweep seed by seed (lr by lr, every loss at each), then the other seeds, each with all its losses,
  then the stability runs.
  The missing warm-starts of the seeds with runs left are made first. `--jobs N` runs N at a time in spawned
  workers with cores / N torch threads each (study/runner.py).
- Results (`--results`, JSONL, default study/real.jsonl): one row per finished run, merged by name after every run
  (study/runner.py): the run (loss, lr, seed, model), held-out accuracy before RL, after, at best and at every
  evaluation, the reward per step, seconds per RL step (the sum of the step's timed phases, troll.run.diagnostics),
  the run's wall time and its CPU time (every thread of its process, over all its sessions), the trust region's
  statistics per step and their means (`TR_KEYS`, those metrics.jsonl holds: the share of tokens projected / clipped /
  masked, KL(p || q) before and after the projection, TROLL's sparse support size, the ratio's range; the network's
  exact update KL where a run measured it), and the run's whole config. A run with a row, or with summary.json in its
  folder, is done; an interrupted one resumes from its checkpoint; a finished run keeps its model after RL in
  <out>/<name>/final (0.5 GB for SmolLM2 in float32), which study/real_gsm8k.py evaluates on GSM8K. A run or
  warm-start recorded with other settings than the command makes now is refused, not counted; a row of another study's
  file is refused (`FIELDS`).
- Report (`--report`): per loss and lr, the mean held-out accuracy before and after RL and the gain over seeds,
  the runs that ended below their start, seconds per step and the trust-region statistics; then each loss at its
  best lr (chosen as above) against PPO-clip at its own: the mean paired difference over the seeds both ran, with
  its 95% t-interval (study.runner.paired_diffs, t_interval), and the same with the lrs chosen without each seed
  (a seed that chose the lr does not also score it; with one sweep seed: the other seeds only); then each loss at
  its best lr and every larger lr it ran: held-out accuracy after RL with its 95% t-interval over seeds, the runs
  that end below their start, and the policy's entropy over the first and the last 10 steps; last, the study's
  cost: its runs' wall and CPU hours summed. An interval that contains 0 is said to be noise, in those words.
- Time (`--dry-run` and every run's first lines): the runs left, one at a time, plus the warm-starts left. A run
  takes the mean wall time of this study's finished runs of the same model, steps and held-out size in --results;
  without such runs, steps x seconds per step (of its finished runs of the model, else built-in) + evaluations x
  problems x the built-in seconds per evaluated problem. A warm-start takes the mean of the warm.json files in
  --out, else the built-in figure (`MEASURED`). The command says which figures it used. --jobs 2 shares the same 2
  cores between two runs, a gain this study has not measured, so the figure is one run at a time.
- `--model tiny`: the tiny local Llama in place of SmolLM2 (troll.policy keeps its ChatML template for this chat
  task), for rehearsals and tests: seconds a run. Its byte-level tokenizer spells the same prompts in about 160
  tokens, so its prompt limit is 256 (the preset's 128 fits SmolLM2's 66-70); nothing else differs.
- Modes: a run (or --dry-run) and --report. A flag typed that cannot act in the command's mode is refused in one
  line (study/runner.py): every run flag with --report, which reads only the results file, --sweep_seeds with a
  single lr (there is no sweep) and --stability with --stability_seeds 0. A list flag's value given twice is refused
  (study/runner.py).
- Its own files only (troll.base.outputs): a warm-start is made in a new folder of its own and renamed to
  <out>/warm-s<seed> when whole (onto nothing or an empty folder); its log <out>/warm-s<seed>.log starts with the
  line `WARM_LOG` and replaces only a log of its own; a run writes only in its own folder (troll.run.harness). A file,
  folder or link of those names that the study did not write is refused in one line before anything is written.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from study.real_report import LOSSES, best_lr, report
from study.real_time import estimate, time_figures
from study.real_warm import (
    MODELS,
    PRESET,
    check_warm_starts,
    preset,
    warm_dir,
    warm_record,
    warm_start,
)
from study.runner import (
    ACCURACY,
    LR,
    NAME,
    OBJECT,
    SEED,
    given,
    grid_problem,
    inert_flag,
    jobs_problem,
    one_of,
    read_results,
    report_rows,
    run_all,
    train_run,
    workers,
)
from troll.base.cli import Parser, UsageError, run_command
from troll.base.config import PRESETS, Config, settings
from troll.base.schema import Spec
from troll.tools import plot

PROG = "python -m study.real"
DEFAULT_LOSSES = ("troll", "ppo_clip")
LRS = (5e-6, 1e-5, 2e-5)
SEEDS = (0, 1, 2, 3, 4)
STABILITY = (2.0, 4.0)  # the multiples of each loss's best lr the stability runs take
STAGES = ("sweep", "best", "stability")
# The settings that ask and score a problem: every run keeps the preset's (`config` checks)
ASKED = ("task", "chat", "data", "reverse_sum", "max_prompt_len", "max_new_tokens", "temperature", "prompts_per_step",
         "samples_per_prompt", "minibatches", "epochs", "advantage", "agg", "level", "eval_every")  # fmt: skip
# The trust region's statistics a row keeps per step where metrics.jsonl has them (troll.losses, troll.run.diagnostics)
TR_KEYS = ("frac_active", "kl_before_mean", "kl_before_max", "kl_after_mean", "kl_after_max", "kl_update_mean",
           "kl_update_max", "dual_support_size_mean", "ratio_min", "ratio_max", "entropy", "grad_norm")  # fmt: skip
# What a results row holds that the study reads, as declared (study.runner.check_rows): another study's rows lack
# step_s. The run's steps, evaluation size and time (the calibration's figures) are read where a row has them.
FIELDS = {
    "name": NAME, "loss": one_of(LOSSES), "lr": LR, "seed": SEED, "model": one_of(MODELS), "eval_before": ACCURACY,
    "eval_after": ACCURACY, "step_s": Spec("number", low=0), "config": OBJECT,
    "steps": Spec("integer", low=0, required=False), "eval_problems": Spec("integer", low=0, required=False),
    "wall_clock_s": Spec("number", low=0, required=False), "stage": one_of(STAGES, required=False),
    "cpu_s": Spec("number", low=0, required=False),
}  # fmt: skip
# The list flags and each run's value of them (study.runner.grid_problem: no value twice)
FLAGS = {"losses": lambda run: run.loss, "lrs": lambda run: run.lr, "seeds": lambda run: run.seed}


@dataclass(frozen=True)
class Run:
    loss: str
    lr: float
    seed: int
    stage: str = field(default="sweep", compare=False)  # which part of the study makes it (STAGES)

    @property
    def name(self) -> str:
        return f"{self.loss}_lr{self.lr:g}_s{self.seed}"


# ----------------------------------------------------------------------------- the runs and their configs


def sweep_seeds(args: argparse.Namespace) -> list[int]:
    return list(args.seeds[: args.sweep_seeds])


def later_seeds(args: argparse.Namespace) -> list[int]:
    return list(args.seeds[args.sweep_seeds :])


def sweep(args: argparse.Namespace) -> list[Run]:
    """The sweep's runs: every lr of every loss on the sweep seeds, seed by seed, lr by lr."""
    return [Run(loss, lr, seed) for seed in sweep_seeds(args) for lr in args.lrs for loss in args.losses]


def at_best(args: argparse.Namespace, best: dict[str, float]) -> list[Run]:
    """The later seeds' runs: each loss at its best lr (`best`: loss -> lr), seed by seed."""
    return [Run(loss, best[loss], seed, "best") for seed in later_seeds(args) for loss in args.losses]


def stability(args: argparse.Namespace, best: dict[str, float]) -> list[Run]:
    """The stability runs: each loss at every --stability multiple of its best lr on the first --stability_seeds
    seeds, seed by seed, but those the sweep makes (the same name)."""
    made = {r.name for r in sweep(args)}
    runs = [Run(loss, float(f"{best[loss] * m:g}"), seed, "stability") for seed in args.seeds[: args.stability_seeds]
            for m in args.stability for loss in args.losses]  # fmt: skip
    return [r for r in runs if r.name not in made]


def every_run(args: argparse.Namespace) -> list[Run]:
    """Every run the flags can make, whatever the sweep chooses: what a recorded run is checked against."""
    return [Run(loss, lr, seed) for seed in args.seeds for lr in args.lrs for loss in args.losses]


def config(run: Run, args: argparse.Namespace) -> Config:
    """The run's troll.train config: the preset's, from the seed's warm-start, with the run's loss, lr and seed
    (module docstring); a setting of `ASKED` that is not the preset's is a ValueError."""
    base = preset(args.model)
    cfg = Config(**(base | dict(
        model=str(warm_dir(args, run.seed)), sft_steps=0, loss=run.loss, lr=run.lr, seed=run.seed, steps=args.steps,
        eval_size=args.eval_size, save_every=base["eval_every"], out=str(Path(args.out) / run.name),
    )))  # fmt: skip
    asked = Config(**base)
    if changed := [f for f in ASKED if getattr(cfg, f) != getattr(asked, f)]:
        raise ValueError(f"run {run.name} would not ask the preset's problems: {', '.join(changed)} changed")
    return cfg


# ----------------------------------------------------------------------------- results rows


def collect(run: Run, out: Path, model: str) -> dict:
    """One results row from a finished run's folder (module docstring)."""
    summary = json.loads((out / "summary.json").read_text())
    metrics = plot.read_metrics(out)
    steps = [m for m in metrics if "eval_acc" not in m]
    per_step = {k: [m[k] for m in steps] for k in TR_KEYS if steps and all(k in m for m in steps)}
    seconds = [sum(v for k, v in m.items() if k.startswith("time_")) for m in steps]
    return {
        "name": run.name,
        **asdict(run),
        "model": model,
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "eval_best": summary["eval_best"],
        "eval_curve": [[m["step"], m["eval_acc"]] for m in metrics if "eval_acc" in m],
        "eval_problems": summary["eval_problems"],
        "steps": len(steps),
        "reward": [m["reward"] for m in steps],
        "step_s": statistics.fmean(seconds) if seconds else math.nan,
        "wall_clock_s": summary["wall_clock_s"],
        **({"cpu_s": summary["cpu_s"]} if "cpu_s" in summary else {}),  # summary.json from version 4 on
        **{k: statistics.fmean(v) for k, v in per_step.items()},
        "per_step": per_step,
        "skipped_steps": summary["skipped_steps"],
        "config": settings(json.loads((out / "config.json").read_text())),
    }


def execute(run: Run, cfg: Config, model: str) -> dict:
    """Train one run (study.runner.train_run); returns its results row."""
    return collect(run, train_run(cfg, final=True), model)


def check_recorded(args: argparse.Namespace, done: dict[str, dict], best: dict[str, float] | None) -> None:
    """Every run of the flags that is recorded (a results row, or config.json in its folder) was made with the
    settings the command makes now (the stability runs too, once `best` is chosen); otherwise a UsageError naming
    the run, the fields and the way forward."""
    for run in every_run(args) + (stability(args, best) if best else []):
        want = settings(asdict(config(run, args)))
        path = Path(args.out) / run.name / "config.json"
        row = done.get(run.name)
        saved = settings(json.loads(path.read_text())) if path.is_file() else None
        for where, have in ((args.results, row and settings(row["config"])), (path, saved)):
            if have is not None and have != want:
                changed = ", ".join(sorted(k for k in want if have.get(k) != want[k]))
                raise UsageError(
                    f"{run.name} ({where}) was run with other settings ({changed}): give the flags it was run with, "
                    "or choose another --out and --results"
                )


# ----------------------------------------------------------------------------- the best learning rate


def chosen(rows: Sequence[dict], args: argparse.Namespace) -> dict[str, float] | None:
    """Each loss's best lr from the sweep's rows (`best_lr` over the sweep seeds and --lrs); None until every sweep
    run has its row."""
    names = {r.name for r in sweep(args)}
    mine = [r for r in rows if r["name"] in names]
    if len(mine) < len(names):
        return None
    return {loss: best_lr(mine, loss)[0] for loss in args.losses}


# ----------------------------------------------------------------------------- the command

MODES = {"run": "without --report", "report": "with --report"}
RUN_FLAGS = ("--model", "--losses", "--lrs", "--seeds", "--sweep_seeds", "--stability", "--stability_seeds", "--steps",
             "--eval_size", "--sft_steps", "--out", "--jobs", "--dry-run")  # fmt: skip
ACTS = dict.fromkeys(RUN_FLAGS, ("run",))  # --report reads only the results file; --results acts in both modes


def parser() -> Parser:
    """The command's flags."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", choices=list(MODELS),
                   help="the preset's model, or tiny for a rehearsal; default: %(default)s")  # fmt: skip
    p.add_argument("--losses", nargs="+", default=list(DEFAULT_LOSSES), choices=list(LOSSES))
    p.add_argument("--lrs", nargs="+", type=float, default=list(LRS), help="the sweep's learning rates")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument(
        "--sweep_seeds",
        type=int,
        default=1,
        help="the first this many --seeds run every lr, the others each loss's best; default: %(default)s",
    )
    p.add_argument("--stability", nargs="+", type=float, default=list(STABILITY),
                   help="the multiples of each loss's best lr the stability runs take (each above 1)")  # fmt: skip
    p.add_argument("--stability_seeds", type=int, default=None,
                   help="the first this many --seeds make them, 0 none; default: 3, or all if fewer")  # fmt: skip
    p.add_argument("--steps", type=int, default=PRESETS[PRESET]["steps"],
                   help="RL steps per run; default: the preset's %(default)s")  # fmt: skip
    p.add_argument("--eval_size", type=int, default=PRESETS[PRESET]["eval_size"],
                   help="held-out problems per evaluation; default: the preset's %(default)s")  # fmt: skip
    p.add_argument("--sft_steps", type=int, default=PRESETS[PRESET]["sft_steps"],
                   help="the warm-start's step limit; default: the preset's %(default)s")  # fmt: skip
    p.add_argument("--out", default="runs/real", help="one folder per run and warm-start in here; default: %(default)s")
    p.add_argument("--results", default="study/real.jsonl", help="results file (JSONL); default: %(default)s")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time; default: %(default)s")
    p.add_argument("--dry-run", action="store_true", help="list the runs and their time, run nothing")
    p.add_argument("--report", action="store_true", help="print the tables of the results file")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if problem := inert_flag(p, argv, ACTS, ["report" if args.report else "run"], MODES):
        p.error(problem)
    for name in ("steps", "eval_size", "sft_steps", "jobs", "sweep_seeds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if problem := jobs_problem(args.jobs):
        p.error(problem)
    if any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        p.error(f"--lrs must be positive and finite, got {' '.join(map(str, args.lrs))}")
    if problem := grid_problem(p, args, every_run(args), FLAGS, "every value makes runs"):
        p.error(problem)
    if args.sweep_seeds > len(args.seeds):
        p.error(f"--sweep_seeds {args.sweep_seeds} is more than the {len(args.seeds)} --seeds: give at most that many")
    if args.stability_seeds is None:
        args.stability_seeds = min(3, len(args.seeds))
    if args.stability_seeds < 0 or args.stability_seeds > len(args.seeds):
        p.error(f"--stability_seeds {args.stability_seeds} must be in 0..{len(args.seeds)}, the number of --seeds")
    multiples = [f"{m:g}" for m in args.stability]
    if any(not (m > 1 and math.isfinite(m)) for m in args.stability) or len(set(multiples)) < len(multiples):
        p.error(f"--stability takes distinct multiples above 1 of the best lr, got {' '.join(multiples)}")
    if args.stability_seeds == 0 and "--stability" in given(p, argv):
        p.error("--stability cannot act with --stability_seeds 0: no seed runs it; drop one of them")
    if len(args.lrs) == 1 and "--sweep_seeds" in given(p, argv):
        p.error("--sweep_seeds cannot act with a single --lrs value: there is no sweep; drop it, or give more lrs")
    if Path(args.out).is_file() or Path(args.results).is_dir():
        p.error("--out must be a folder and --results a file")
    try:  # every run's config is checked before any work, the stability runs' at the largest lr they can take
        top = {loss: max(args.lrs) for loss in args.losses}
        for run in every_run(args) + (stability(args, top) if args.stability_seeds else []):
            config(run, args)
    except ValueError as e:
        p.error(str(e))
    return args


def progress(row: dict) -> str:
    """A finished run's line: held-out accuracy before and after RL, and seconds per step."""
    return f"{row['name']}: {row['eval_before']:.3f} -> {row['eval_after']:.3f}, {row['step_s']:.1f} s / step"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Print the report, or list and run the runs (the sweep, then the later seeds at each loss's best lr); returns
    the rows read or made."""
    args = parse(argv)
    if args.report:
        rows = report_rows(Path(args.results), PROG, FIELDS)
        print(report(rows, MODELS))
        return rows
    done = read_results(Path(args.results), FIELDS, PROG)
    first, best = sweep(args), chosen(list(done.values()), args)
    check_recorded(args, done, best)
    check_warm_starts(args)
    later, stable = (at_best(args, best), stability(args, best)) if best else ([], [])
    n_later = len(later_seeds(args)) * len(args.losses)
    n_stable = len(stable) if best else args.stability_seeds * len(args.stability) * len(args.losses)  # at most
    todo_later = len([r for r in later if r.name not in done]) if best else n_later
    todo_stable = len([r for r in stable if r.name not in done]) if best else n_stable
    unknown = () if best else later_seeds(args) + args.seeds[: args.stability_seeds]
    needed = {r.seed for r in first + later + stable if r.name not in done} | set(unknown)  # seeds with runs to make
    warm = [s for s in args.seeds if s in needed and warm_record(args, s) is None]
    seeds = " ".join(map(str, sweep_seeds(args)))
    print(f"sweep: seeds {seeds}, every lr of every loss: {len(first)} runs, "
          f"{sum(r.name in done for r in first)} done")  # fmt: skip
    for run in first if args.dry_run else ():
        print(f"  {'done ' if run.name in done else ''}{run.name}")
    if n_later:
        at = ", ".join(f"{loss} {lr:g}" for loss, lr in best.items()) if best else "chosen when the sweep is done"
        print(f"then seeds {' '.join(map(str, later_seeds(args)))} at each loss's best lr ({at}): {n_later} runs, "
              f"{n_later - todo_later} done")  # fmt: skip
        for run in later if args.dry_run else ():
            print(f"  {'done ' if run.name in done else ''}{run.name}")
    if n_stable:
        on = f"{' '.join(f'{m:g}' for m in args.stability)} x its best lr on seeds " + " ".join(
            map(str, args.seeds[: args.stability_seeds])
        )
        print(f"then stability, each loss at {on}: {n_stable} runs, {n_stable - todo_stable} done" if best else
              f"then stability, each loss at {on}: at most {n_stable} runs, chosen when the sweep is done")  # fmt: skip
        for run in stable if args.dry_run else ():
            print(f"  {'done ' if run.name in done else ''}{run.name}")
    print(f"warm-starts to make: {len(warm)} (seeds {' '.join(map(str, warm)) or '-'})")
    runs_left = len([r for r in first if r.name not in done]) + todo_later + todo_stable
    print(estimate(args, runs_left, len(warm), time_figures(args, done)) + f"; {args.jobs} job(s)")
    if args.dry_run:
        return []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with workers(args.jobs) as pool:
        for seed, future in [(s, pool.submit(warm_start, s, args)) for s in warm]:
            record = future.result()
            print(f"warm-start seed {seed}: {record['sft_steps_run']} steps, probe {record['sft_probe_acc']:.3f}, "
                  f"{record['warm_s']:.0f} s", flush=True)  # fmt: skip
        calls = [(run, config(run, args), args.model) for run in first if run.name not in done]
        rows += run_all(pool, execute, calls, Path(args.results), progress)
        if n_later or n_stable:
            best = chosen(list(read_results(Path(args.results), FIELDS, PROG).values()), args)
            print(f"best lr on seeds {seeds}: {', '.join(f'{loss} {lr:g}' for loss, lr in best.items())}", flush=True)
            runs = at_best(args, best) + stability(args, best)
            calls = [(run, config(run, args), args.model) for run in runs if run.name not in done]
            rows += run_all(pool, execute, calls, Path(args.results), progress)
    return rows


if __name__ == "__main__":
    run_command(PROG, main)
