"""Where the trust region matters with off-policy data (stale rollouts, a bf16 sampler, update epochs), paired seeds.

Every loss starts from the same warm-started weights per seed and is compared with PPO-clip seed by seed.

    python -m study.offpolicy --dry-run                 # the grid and its size
    python -m study.offpolicy --jobs 2                  # run it (resumable: run it again to go on)
    python -m study.offpolicy --report                  # paired differences to PPO-clip with 95% intervals
    python -m study.offpolicy --figures study/figures   # the paired-difference figure
    python -m study.offpolicy --seeds 0 --lrs 1e-4 --sources none --losses troll --steps 2 --eval_size 20 \\
        --sft_steps 20 --out runs/offpolicy-smoke --results runs/offpolicy-smoke/results.jsonl   # a smoke test

Design, stated once:
- Task and warm-start: the main job's (tiny-cpu: sums written least-significant digit first; supervised steps until
  greedy decoding solves 30% of a training probe), run once per seed into <out>/warm-s<seed> and shared by every
  run of that seed (`--model <that folder> --sft_steps 0`): the variants of a seed start RL from the same weights,
  so a difference between two losses on one seed is not a difference between warm-starts.
- Sources of off-policy data (`SOURCES`): `none` (the main job: 2 minibatches, 1 epoch), `epochs` (4 minibatches x
  2 epochs against one old policy), `stale2` / `stale8` (--staleness 2 / 8: the batch trained at step s was sampled
  by the weights of step s - k), `bf16` (a bf16 sampler against the float32 trainer).
- Anchors (`ANCHORS`), where the sampler mu differs from the network before the update pi_old (stale, bf16):
  `recompute` (the trust region around pi_old, the policy term weighted by the truncated importance weight
  min(pi_old(y) / mu(y), 2): the decoupled objective) and `behaviour` (the trust region around mu itself, DPPO's
  choice). Without such a source both anchors are the same policy and `recompute` stands alone.
- Losses: TROLL (rest model), PPO-clip, DPPO (Binary-TV), CISPO (no trust region). Learning rates: the main job's
  1e-4 and 3e-4.
- Runs are shortened, not the seeds: 40 RL steps, evaluated before RL and at the end on 1,000 held-out problems.
  Order: learning rate, then cell (in the order `--sources` gives), then seed: a study cut short holds whole cells,
  every seed of each.
- Results (`--results`, JSONL): one row per finished run, merged by name after every run; a run whose saved
  settings differ from what the grid makes now is refused, not counted, and a row that is not this study's
  (`FIELDS`: another study's file) is refused. A value given twice in a list flag, or one that makes no run (a
  setting of a loss not in `--losses`, the behaviour anchor without a source where the sampler differs), is refused
  (study/runner.py). Workers and their threads as every study's
  (study/runner.py; `--jobs N`: N spawned processes, cores / N torch threads each).
- Report: per cell (lr, source, anchor) and loss, the mean final accuracy, the mean paired difference to PPO-clip
  over seeds with its 95% t-interval, and how many runs ended below their warm-start; a cell without the baseline's
  run leaves the paired columns "-" and the report names it.
- Settings (`--settings`, `SETTINGS`): each loss's trust-region size (TROLL's eps, PPO-clip's range, clip-higher);
  `default` keeps a run's old name. Where both losses ran several, the report adds each at its own best setting
  (the best mean final accuracy), paired, and the same with the settings chosen without each seed
  (`best_vs_best`; docs/algorithm.md, section 12).
- LoRA (`--settings lora8`): adapters (rank 8, alpha 16, all-linear) on the seed's frozen warm-start, for every
  loss. Where a loss ran both, the report adds LoRA at its own best learning rate against full fine-tuning
  (`default`) at its own, paired, and the same with the learning rates chosen without each seed (`lora_vs_full`).
- Task (`--task rare --vocab_size N`): the rare-behaviour variant (troll.tasks.addition); its warm-start records how
  often the behaviour appears, its rows the behaviour's rate per step, and the report how fast each loss adopts it.
- Modes: a run (or --dry-run), --report, --figures (the last two together too). A flag given that cannot act in
  the command's modes (`ACTS`) is refused in one line (study/runner.py): the run's flags (the grid, --out, --task,
  --jobs, --dry-run, ...) with --report or --figures, which read only the results file; --threshold (the rare
  task's adoption) without --report or --figures, --baseline (the table's pairing) without --report, --name (the
  figures' file names) without --figures.
- Its own files only (troll.base.outputs): a warm-start is made in a new folder of its own and renamed to
  <out>/warm-s<seed> when it is whole (onto nothing, or an empty folder); its log, <out>/warm-s<seed>.log, starts
  with the line `WARM_LOG` and is written whole (also when the warm-start fails), replacing only a log of its own.
  The figures carry the PNG text Software=study.offpolicy and replace only figures so marked. A file, folder or
  symbolic link of those names that the study did not write is refused in one line before anything is written.
- Files: the grid and each run's config in study/offpolicy_grid.py, the report and figures in
  study/offpolicy_report.py; here the warm-starts, the results rows and the command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from study.offpolicy_grid import (
    ANCHORS,
    BASELINE,
    FIELDS,
    FLAGS,
    LOSSES,
    LRS,
    SEEDS,
    SETTINGS,
    SOURCES,
    TASKS,
    THRESHOLD,
    Run,
    config,
    grid,
    setting_of,
    warm_dir,
)
from study.offpolicy_report import (
    MARK,
    _label,  # noqa: F401  (notebook 7 reads study.offpolicy._label)
    lora_vs_full,
    paired,  # noqa: F401  (notebooks 6 and 7 read study.offpolicy.paired)
    plot_adoption,
    plot_lora,
    plot_paired,
    plot_settings,
    report,
    report_best,
    report_lora,
)
from study.runner import (
    REPORT_MODES,
    check_figures,
    grid_problem,
    inert_flag,
    jobs_problem,
    plan,
    read_results,
    refuse_other_settings,
    report_modes,
    report_rows,
    run_all,
    save_warm,
    t_interval,  # noqa: F401  (docs/results.md names it study.offpolicy.t_interval)
    train_run,
    workers,
)
from troll.base import outputs
from troll.base.cli import Parser, UsageError, fail, run_command
from troll.base.config import Config, settings
from troll.run import runfiles
from troll.tools import plot

PROG = "python -m study.offpolicy"
WARM_LOG = "# python -m study.offpolicy: the warm-start of seed {seed}"  # a warm-start log's first line: its own

# ----------------------------------------------------------------------------- the runs


def warm_start(seed: int, args: argparse.Namespace) -> dict:
    """The main job's warm-start for `seed`, saved to warm_dir (model, tokenizer, warm.json written last)."""
    import torch

    from troll.models.build import build_model
    from troll.run.harness import device_of
    from troll.run.warmstart import warm_start_task
    from troll.tasks.task import load_task

    out = warm_dir(args, seed)
    cfg = Config(seed=seed, sft_steps=args.sft_steps, task=args.task, vocab_size=args.vocab_size, out=str(out))
    torch.manual_seed(seed)
    model, tokenizer = build_model(cfg, device_of(cfg))
    task, _ = load_task(cfg, tokenizer)
    log_file = warm_log(args, seed)
    with outputs.writing(log_file, keep_on_error=True) as log, contextlib.redirect_stdout(log):
        print(WARM_LOG.format(seed=seed), flush=True)  # its first line: the log is the study's own
        record = warm_start_task(cfg, model, tokenizer, task)
    if task.behaviour:  # how rare the rewarded behaviour is where RL starts
        record |= behaviour_rate(cfg, model, tokenizer, task)
    made = {"seed": seed, "sft_limit": args.sft_steps, "task": args.task, "vocab_size": args.vocab_size}
    save_warm(out, model, tokenizer, made | record, warm_problem)
    return record


def warm_log(args: argparse.Namespace, seed: int) -> outputs.Target:
    """<out>/warm-s<seed>.log, the warm-start's output: the study's own when it starts with its line (WARM_LOG)."""
    return outputs.log_file(Path(args.out) / f"warm-s{seed}.log", WARM_LOG.format(seed=seed), "--out")


def warm_problem(folder: Path) -> str | None:
    """Why a warm-start may not be put at `folder` (no warm.json there), in one line, or None: it may be new or an
    empty folder, which the finished warm-start replaces whole; a link, a file or a folder with files is refused."""
    if folder.is_symlink():
        return f"{folder} is a symbolic link, never written through nor replaced: remove it, or choose another --out"
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, where the warm-start's folder goes: move it away, or choose another --out"
    if folder.is_dir() and any(folder.iterdir()):
        return (
            f"{folder} holds files but no warm.json, so it is no finished warm-start of this study, and it is left as "
            "it is: move it away, or choose another --out"
        )
    return None


def check_warm_starts(args: argparse.Namespace, seeds: Sequence[int]) -> None:
    """Before anything is written: each warm-start to make (`seeds`) has its folder free (`warm_problem`) and its
    log new or the study's own (`warm_log`); a UsageError names the first that is not."""
    for seed in seeds:
        outputs.check([warm_log(args, seed)])
        if problem := warm_problem(warm_dir(args, seed)):
            raise UsageError(problem)


def behaviour_rate(cfg: Config, model, tokenizer, task, prompts: int = 1024, samples: int = 8) -> dict:
    """The share of sampled completions (temperature cfg.temperature, `samples` per training prompt, the first
    `prompts` training problems) that show the task's behaviour, and the share that earn the reward."""
    import torch

    from troll.rollout import HFGenerator
    from troll.tasks.task import decode_rollouts, encode

    generator, texts, golds = HFGenerator(model, tokenizer), [], []
    for i in range(0, prompts, 128):  # 128 prompts at a time: the sampler's memory stays small at a large V
        rows = task.train[i : min(i + 128, prompts)]
        with torch.no_grad():
            ro = generator.generate(encode(tokenizer, [task.prompt(r["question"]) for r in rows]), samples,
                                    cfg.max_new_tokens, cfg.temperature, seed=cfg.seed + i)  # fmt: skip
        texts += decode_rollouts(tokenizer, ro)
        golds += [rows[int(g)]["gold"] for g in ro.group]
    return {
        "behaviour_rate": sum(map(task.behaviour, texts)) / len(texts),
        "reward_rate": sum(task.reward(t, g) for t, g in zip(texts, golds, strict=True)) / len(texts),
        "behaviour_samples": len(texts),
    }


def _read_config(path: Path) -> dict | None:
    """A saved config.json (or warm.json) as a dict of settings, or None when there is none."""
    return settings(json.loads(path.read_text())) if path.is_file() else None


def collect(run: Run, out: Path) -> dict:
    """One results row from a finished run directory."""
    summary = runfiles.read_summary(out)
    steps = [m for m in plot.read_metrics(out) if "eval_acc" not in m]

    def mean(key: str) -> float:
        values = [m[key] for m in steps if key in m]
        return sum(values) / len(values) if values else math.nan

    return {
        "name": run.name,
        **asdict(run),
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "eval_problems": summary["eval_problems"],
        "reward_mean": mean("reward"),
        "kl_update_mean": mean("kl_update_mean"),
        "kl_update_max": max(m.get("kl_update_max", 0.0) for m in steps),
        "mismatch_kl": mean("mismatch_kl"),
        "mismatch_logratio_absmax": max(m["mismatch_logratio_absmax"] for m in steps),
        "frac_active_mean": mean("frac_active"),
        "is_weight_mean": mean("is_weight_mean"),
        "skipped_steps": summary["skipped_steps"],
        "wall_clock_s": summary["wall_clock_s"],
        **({"behaviour_rate": [m["behaviour_rate"] for m in steps]} if "behaviour_rate" in steps[0] else {}),
        "config": settings(json.loads((out / "config.json").read_text())),
    }


def execute(run: Run, cfg: Config) -> dict:
    """Train one run (study.runner.train_run); returns its results row."""
    return collect(run, train_run(cfg))


# ----------------------------------------------------------------------------- the command


# The command's modes (run, report, figures) and which are on: study.runner's, shared with the other such study
MODES, modes = REPORT_MODES, report_modes
RUN_FLAGS = ("--task", "--vocab_size", "--out", "--sources", "--anchors", "--losses", "--settings", "--lrs", "--seeds",
             "--steps", "--eval_size", "--sft_steps", "--jobs", "--dry-run")  # fmt: skip
# Each flag that acts in some modes only -> those modes (the others, --results, --report and --figures, act in
# every mode): the report reads the results file, not the grid's flags; --threshold is the rare task's adoption
# (its table and figure), --baseline the table's pairing (the figures pair with PPO-clip), --name the figures' files.
ACTS = {
    **dict.fromkeys(RUN_FLAGS, ("run",)),
    "--threshold": ("report", "figures"),
    "--baseline": ("report",),
    "--name": ("figures",),
}


def parser() -> Parser:
    """The command's flags."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument(
        "--task",
        default="addition",
        choices=list(TASKS),
        help="the main job's task, or its rare-behaviour variant (troll.tasks.addition); default: %(default)s",
    )
    p.add_argument("--vocab_size", type=int, default=0,
                   help="the warm-start's tokenizer grown to this many tokens (troll.models.tiny.pad_vocab; 0: its "
                   "260); default: %(default)s")  # fmt: skip
    p.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        help="the rare task's report: adopted once this share of a step's samples shows the behaviour",
    )
    p.add_argument("--out", default="runs/offpolicy", help="one folder per run in here; default: %(default)s")
    p.add_argument("--results", default="study/offpolicy.jsonl", help="results file; default: %(default)s")
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    p.add_argument("--anchors", nargs="+", default=list(ANCHORS), choices=list(ANCHORS))
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    p.add_argument("--settings", nargs="+", default=["default"], choices=list(SETTINGS),
                   help="each loss's trust-region sizes (SETTINGS; a setting runs only with its loss); default: "
                   "%(default)s")  # fmt: skip
    p.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--steps", type=int, default=40, help="RL steps per run; default: %(default)s")
    p.add_argument("--eval_size", type=int, default=1000, help="held-out problems; default: %(default)s")
    p.add_argument("--sft_steps", type=int, default=600, help="warm-start step limit; default: %(default)s")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time; default: %(default)s")
    p.add_argument("--dry-run", action="store_true", help="list the grid, run nothing")
    p.add_argument("--report", action="store_true", help="print the paired table of the results file")
    p.add_argument("--baseline", default=BASELINE, choices=list(LOSSES), help="the report's paired baseline")
    p.add_argument("--name", default="offpolicy", help="the figures' file names start with this; default: %(default)s")
    p.add_argument("--figures", default=None, help="draw the paired figure of the results file into this folder")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.figures == "":
        p.error("--figures names the folder to draw into, got ''")
    if problem := inert_flag(p, argv, ACTS, modes(args), MODES):  # before the checks of a flag that cannot act
        p.error(problem)
    for name in ("steps", "eval_size", "sft_steps", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if problem := jobs_problem(args.jobs):
        p.error(problem)
    if args.vocab_size and args.vocab_size < 260:
        p.error(f"--vocab_size must be 0 or >= 260 (the tiny tokenizer's size), got {args.vocab_size}")
    if not 0 < args.threshold <= 1:
        p.error(f"--threshold must be in (0, 1], got {args.threshold}")
    if any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        p.error(f"--lrs must be positive and finite, got {args.lrs}")
    if Path(args.out).is_file() or Path(args.results).is_dir():
        p.error("--out must be a folder and --results a file")
    why = "a setting runs with its own loss only, the behaviour anchor with stale2, stale8 or bf16 only"
    if problem := grid_problem(p, args, grid(args), FLAGS, why):
        p.error(problem)
    try:  # every run's config is checked before any work
        for run in grid(args):
            config(run, args)
    except ValueError as e:
        p.error(str(e))
    return args


def progress(row: dict) -> str:
    """A finished run's line: its held-out accuracy before and after RL."""
    return f"{row['name']}: {row['eval_before']:.3f} -> {row['eval_after']:.3f}"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse(argv)
    if modes(args) != ["run"]:
        rows = report_rows(Path(args.results), PROG, FIELDS)
        if args.report:
            print(report(rows, args.baseline, args.threshold))
            if best := report_best(rows, "troll", args.baseline):
                print(f"\nEach loss at its own best setting (by mean final accuracy):\n{best}")
            if lora := report_lora(rows):
                print(f"\nLoRA against full fine-tuning, each at its own best learning rate:\n{lora}")
        if args.figures is not None:  # <name>_paired.png, and _settings / _adoption / _vs_full where the rows have them
            stem, against = args.name, any(r["loss"] == BASELINE for r in rows)  # the first two: paired to PPO-clip
            drawn = {
                "paired": against,
                "settings": against and any(setting_of(r) != "default" for r in rows),
                "adoption": all("behaviour_rate" in r for r in rows),
                "vs_full": bool(lora_vs_full(rows)),
            }
            check_figures(Path(args.figures), [f"{stem}_{k}.png" for k, on in drawn.items() if on], MARK)
            if drawn["paired"]:
                print(plot_paired(rows, Path(args.figures), stem))
            if drawn["settings"]:
                print(plot_settings(rows, Path(args.figures), stem))
            if drawn["adoption"]:
                print(plot_adoption(rows, Path(args.figures), stem, args.threshold))
            if drawn["vs_full"]:
                print(plot_lora(rows, Path(args.figures), stem))
        return rows
    runs, done = grid(args), read_results(Path(args.results), FIELDS, PROG)
    for run in runs:  # a run recorded, or in its folder, with other settings is not counted as done
        want = settings(asdict(config(run, args)))
        path = Path(args.out) / run.name / "config.json"
        recorded = done[run.name]["config"] if run.name in done else None
        for where, saved in ((args.results, recorded and settings(recorded)), (path, _read_config(path))):
            refuse_other_settings(PROG, run.name, where, saved, want)
    for seed in sorted({r.seed for r in runs}):  # a warm-start made for another task or step limit is not this study's
        record = _read_config(warm_dir(args, seed) / "warm.json")
        made = {"sft_steps": "sft_limit", "task": "task", "vocab_size": "vocab_size"}
        old = {"task": "addition", "vocab_size": 0}  # warm-starts made before these were recorded
        for flag, key in made.items() if record is not None else ():
            if (was := record.get(key, old.get(key))) != getattr(args, flag):
                fail(PROG, f"{warm_dir(args, seed)} was warm-started with --{flag} {was}")
    todo = plan(runs, done, args.jobs, args.dry_run)
    if args.dry_run:
        return []
    seeds = sorted({r.seed for r in todo if not (warm_dir(args, r.seed) / "warm.json").is_file()})
    check_warm_starts(args, seeds)  # before anything is written
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with workers(args.jobs) as pool:
        for seed, future in [(s, pool.submit(warm_start, s, args)) for s in seeds]:
            print(f"warm-start seed {seed}: {future.result()}", flush=True)
        calls = [(run, config(run, args)) for run in todo]
        return run_all(pool, execute, calls, Path(args.results), progress)


if __name__ == "__main__":
    run_command(PROG, main)
