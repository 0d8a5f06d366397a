"""Where the trust region matters: a grid over learning rate and off-policyness on `tiny-cpu`, every loss, 3 seeds.

    python -m study.run --dry-run                      # the grid, and its time estimate
    python -m study.run --calibrate                    # measure one run (the heaviest pass), for the estimate
    python -m study.run                                # run it (resumable: run it again to go on)
    python -m study.run --limit 2 --steps 2 --sft_steps 10 --eval_size 20 --out runs/smoke --results runs/smoke.jsonl
    python -m study.figures study/results.jsonl --out study/figures/

Choices, stated once:
- Variants (`VARIANTS`): TROLL with each sparse model (`troll-rest`, `troll-paper`), PPO-clip, DPPO (Binary-TV,
  the trainer's default divergence) and CISPO, every other setting the `tiny-cpu` preset's (troll.base.config).
- Off-policyness = minibatches x epochs, the optimiser steps taken on one RL batch from one old policy. The grid
  sets the two apart: 4x1 and 1x4 (the same count, by splitting or by passes), and 8x4. Plus 1x1, on-policy, for
  the first variant only: every ratio is 1 and p = q, so every loss here is the same policy gradient (no token
  clipped, masked or projected; TROLL's regression term has zero gradient at p = pi*) and one run stands for all.
- Runs are shortened, not the seeds: `--steps` RL steps (the preset: 250), evaluation every `--eval_every` steps on
  `--eval_size` held-out problems (the preset: 1,000). `--dry-run` estimates the grid's time; what the committed
  grid took: docs/results.md#the-trust-region-study.
- The task and warm-start are pinned in `config`, not taken from the preset: sums written most-significant digit
  first, 250 supervised steps of 64 problems, no target. These are the settings that produced the committed
  results, so they reproduce (the same model for every run of a seed: it is seeded).
- Order: seed by seed, so a study cut short holds the whole grid on fewer seeds.
- One run = one `troll.train` run in `<out>/<name>`, its output in `log.txt` there. A run with summary.json, or
  with a row in the results file (so a committed results file resumes on a fresh machine), is finished and skipped;
  an interrupted one resumes from its checkpoint; a finished run's checkpoints are deleted
  (9 MB each; the study keeps metrics, samples and summary).
- A run is only ever counted as done, or resumed, with the settings it was made with (`differences`): when a run
  directory's config.json, or a results row, differs from the config the grid makes now (other --steps, --eval_size,
  --sft_steps, ...), the command stops (exit 2) naming the run and the fields; choose another --out and --results,
  or delete the run. A row records the run's config (`collect`); rows without one (the committed file) are
  compared on what they record: steps and held-out problems.
- The list flags (`--variants`, `--lrs`, `--off_policy`, `--seeds`) follow every study's rules (study/runner.py):
  a value given twice, or one that makes no run (a variant other than the first with only `--off_policy 1x1`), is
  refused in one line.
- Modes: a run (or `--dry-run`, which lists it, the estimate and the jobs it would use) and `--calibrate`. A flag
  given that cannot act in the command's mode is refused in one line (`ACTS`; study/runner.py): with --calibrate,
  which times one run of seed 0 in one worker, --results, --seeds, --jobs, --limit and --dry-run; and a `--limit`
  not below the grid's size, which would select every run.
- `--jobs N` (default 1) runs N at a time, each in its own worker process with cores / N torch threads; with one
  job the worker keeps torch's default threads. Workers are spawned (study/runner.py) and import torch once; the
  parent never imports it.
- Results (`--results`, JSONL): one row per finished run (`collect`), merged by run name into the file after
  every run (rows of other grids in it are kept), written atomically (study/runner.py). The KL of each update is
  the network's own, exact over the 260-token vocabulary (troll.train's kl_update_mean / kl_update_max, one value
  per RL step).
- Time estimate (`estimate`): a run at 1 epoch costs what the calibration run cost, wall clock in a fresh worker
  (its minibatch count is the grid's largest, so smaller ones are overestimated a little; a longer or shorter run
  adds or drops its mean step time per step, a different eval_size is not accounted for); each further epoch adds
  `steps` x its update time per pass. Without `<out>/calibration.json` the built-in `MEASURED` figures are used.
- Its own files only (troll.base.outputs): `--calibrate` writes `<out>/calibration.json` holding "written_by":
  "study.run", whole, and replaces only a file so marked; it runs in `<out>/calibration-<run>`, whose earlier run it
  removes only when troll marked that folder as a run's and it holds nothing but a run's files
  (`remove_run`). Anything else there, a folder or a symbolic link of those names, is refused in one line
  before the run, unchanged.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from study import figures
from study.runner import (
    grid_problem,
    inert_flag,
    jobs_problem,
    merge_results,
    read_rows,
    run_all,
    train_run,
    workers,
)
from troll.base import outputs
from troll.base.cli import Parser, UsageError, fail, run_command
from troll.base.config import Config, settings
from troll.run import runfiles
from troll.tools import plot

VARIANTS: dict[str, dict] = {
    "troll-rest": dict(loss="troll", support="rest"),
    "troll-paper": dict(loss="troll", support="paper"),
    "ppo_clip": dict(loss="ppo_clip"),
    "dppo-cap2": dict(loss="dppo", dppo_divergence="binary_tv", dppo_cap=2.0),  # as recorded (the default c: 10)
    "cispo": dict(loss="cispo"),
}
LRS = (1e-4, 3e-4, 1e-3)
OFF_POLICY = ((1, 1), (4, 1), (1, 4), (8, 4))  # (minibatches, epochs); 1x1 for the first variant only
SEEDS = (0, 1, 2)
# `--calibrate`'s figures on the project's 2-core development machine (troll-paper, 8 minibatches, 1 epoch, the
# defaults below): wall time in a fresh worker, mean RL step, update per pass. `--dry-run` estimates from them when
# `<out>/calibration.json` is absent; the estimate moves with the machine's load (the calibration runs and their
# load: docs/results.md#the-trust-region-study).
MEASURED = {"wall_s": 28.5, "steps": 40, "step_s": 0.346, "update_pass_s": 0.184}
PROG = "python -m study.run"
MARK = "study.run"  # calibration.json holds "written_by": "study.run": the study's own (troll.base.outputs)
# The list flags and each run's value of them (study.runner.grid_problem: no value twice, none that makes no run)
FLAGS = {
    "variants": lambda run: run.variant,
    "lrs": lambda run: run.lr,
    "off_policy": lambda run: (run.minibatches, run.epochs),
    "seeds": lambda run: run.seed,
}


@dataclass(frozen=True)
class Run:
    variant: str
    lr: float
    minibatches: int
    epochs: int
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}_lr{self.lr:g}_mb{self.minibatches}_ep{self.epochs}_s{self.seed}"


def grid(args: argparse.Namespace) -> list[Run]:
    """Every run of the study, seed by seed (module docstring)."""
    settings = [
        (v, lr, mb, ep)
        for v, lr, (mb, ep) in itertools.product(args.variants, args.lrs, args.off_policy)
        if (mb, ep) != (1, 1) or v == args.variants[0]  # on-policy: one run stands for every loss
    ]
    runs = [Run(v, lr, mb, ep, seed) for seed in args.seeds for v, lr, mb, ep in settings]
    return runs[: args.limit] if args.limit else runs


def config(run: Run, args: argparse.Namespace) -> Config:
    """The run's troll.train config: tiny-cpu, the variant, the grid point and the shortened schedule."""
    return Config(
        **VARIANTS[run.variant],
        lr=run.lr,
        minibatches=run.minibatches,
        epochs=run.epochs,
        seed=run.seed,
        steps=args.steps,
        eval_every=args.eval_every,
        eval_size=args.eval_size,
        save_every=args.eval_every,
        sft_steps=args.sft_steps,
        sft_batch=64,  # pinned with sft_target and reverse_sum: the settings of the committed results (docstring)
        sft_target=0.0,
        reverse_sum=False,  # sums written most-significant digit first, as in the committed results
        kl_update_vocab=4096,  # the network's exact per-update KL (troll.run.diagnostics), a result of the study
        out=str(Path(args.out) / run.name),
    )


def collect(run: Run, out: Path) -> dict:
    """One results row from a finished run directory."""
    summary = runfiles.read_summary(out, oldest=2)  # eval_best: version 2 on
    metrics = plot.read_metrics(out)
    steps = [m for m in metrics if "eval_acc" not in m]

    def per_step(key: str) -> list[float]:
        return [m[key] for m in steps if key in m]

    frac = per_step("frac_active")
    variant = VARIANTS[run.variant]
    return {
        "name": run.name,
        **asdict(run),
        "loss": variant["loss"],
        "support": variant.get("support", "rest"),
        "off_policy": run.minibatches * run.epochs,
        "steps": len(steps),
        "eval_problems": summary["eval_problems"],
        "eval_before": summary["eval_before"],
        "eval_after": summary["eval_after"],
        "eval_best": summary["eval_best"],
        "eval_best_step": summary["eval_best_step"],
        "eval_curve": [[m["step"], m["eval_acc"]] for m in metrics if "eval_acc" in m],
        "reward": per_step("reward"),
        "kl_update_mean": per_step("kl_update_mean"),
        "kl_update_max": per_step("kl_update_max"),
        "kl_before_max": per_step("kl_before_max"),
        "frac_active": frac,  # tokens projected (troll) / clipped (ppo_clip, cispo) / masked (dppo), per step
        "frac_active_mean": sum(frac) / max(len(frac), 1),
        "skipped_steps": summary["skipped_steps"],
        "wall_clock_s": summary["wall_clock_s"],
        "config": settings(json.loads((out / "config.json").read_text())),
    }


def differences(run: Run, args: argparse.Namespace, recorded: dict[str, dict]) -> list[str]:
    """How the run's saved config (<out>/<name>/config.json) or results row differs from `config(run, args)`:
    one "field: was X, now Y" per differing field, empty when the run is this grid's (module docstring)."""
    want = settings(asdict(config(run, args)))
    saved = []
    path = Path(args.out) / run.name / "config.json"
    if path.is_file():
        try:
            saved.append((str(path), settings(json.loads(path.read_text()))))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})") from None
    row = recorded.get(run.name)
    if row is not None and "config" in row:
        saved.append((f"{args.results} row", settings(row["config"])))
    elif row is not None:  # a row written before rows held their config: what it records
        recorded_settings = {"steps": row.get("steps"), "eval_size": row.get("eval_problems")}
        if args.eval_size == 0:  # the whole test split: its size is not known here
            del recorded_settings["eval_size"]
        saved.append((f"{args.results} row", {**want, **recorded_settings}))
    missing = object()
    return [
        f"{field} was {have.get(field, 'not set')!r}, now {value!r} ({where})"
        for where, have in saved
        for field, value in want.items()
        if have.get(field, missing) != value
    ]


def execute(run: Run, cfg: Config) -> dict:
    """Train one run (study.runner.train_run); returns its results row."""
    return collect(run, train_run(cfg))


def estimate(runs: Sequence[Run], args: argparse.Namespace) -> tuple[float, str]:
    """Seconds for `runs` one at a time, and where the figures came from (module docstring)."""
    path = Path(args.out) / "calibration.json"
    cal, source = MEASURED, "built-in figures (study/run.py MEASURED); --calibrate measures this machine"
    if path.is_file():
        cal, source = json.loads(path.read_text()), f"{path}"
    one_epoch = cal["wall_s"] + (args.steps - cal["steps"]) * cal["step_s"]
    total = sum(one_epoch + args.steps * (r.epochs - 1) * cal["update_pass_s"] for r in runs)
    return total, source


def calibration_file(args: argparse.Namespace) -> outputs.Target:
    """<out>/calibration.json, the study's own when it holds "written_by": "study.run" (troll.base.outputs)."""
    return outputs.json_file(Path(args.out) / "calibration.json", MARK, "--out")


def remove_run(out: Path) -> None:
    """Remove the troll run in folder `out` whole, for a run that starts afresh there (study.run's calibration):
    only a folder troll marked as a run's (troll.run.harness's marker) that holds nothing but the files a run writes
    (troll.run.harness.RUN_FILES and START_FILES, the marker, the lock) and the study's log.txt, none of them a link.
    Anything else is a UsageError naming it, nothing removed; a missing folder: nothing to do."""
    from troll.run.harness import LOCK, MARKER, MARKER_KIND, RUN_FILES, START_FILES

    if not out.exists() and not out.is_symlink():
        return
    refused = "so it is left as it is: move it away, or choose another --out"
    if out.is_symlink() or not out.is_dir():
        raise UsageError(f"{out} is {'a symbolic link' if out.is_symlink() else 'a file'}, where a run goes, {refused}")
    own = {MARKER, LOCK, "log.txt", *RUN_FILES, *START_FILES}
    other = sorted(p.name for p in out.iterdir() if p.name not in own or p.is_symlink())
    if other:
        shown = ", ".join(other[:4]) + (", ..." if len(other) > 4 else "")
        raise UsageError(f"{out} holds files a troll run does not write ({shown}), {refused}")
    try:
        marked = json.loads((out / MARKER).read_bytes()).get("kind") == MARKER_KIND
    except (OSError, ValueError, AttributeError):  # missing, unreadable, not JSON, not an object
        marked = False
    if not marked:
        raise UsageError(f"{out} is not a folder troll marked as a run's (no {MARKER} of troll's), {refused}")
    shutil.rmtree(out)


def fresh_run(run: Run, cfg: Config) -> dict:
    """Train one run from the beginning: an earlier run in its folder, troll's own, is removed first
    (`remove_run`: only a folder troll marked that holds nothing but a run's files)."""
    remove_run(Path(cfg.out))
    return execute(run, cfg)


def calibrate(args: argparse.Namespace) -> None:
    """Time one run of the heaviest pass (the most minibatches, 1 epoch, troll-paper) into calibration.json, the
    study's own (a calibration.json it did not write is refused before the run)."""
    mb = max(m for m, _ in args.off_policy)
    run = Run("troll-paper" if "troll-paper" in args.variants else args.variants[0], args.lrs[0], mb, 1, 0)
    cfg = replace(config(run, args), out=str(Path(args.out) / f"calibration-{run.name}"))
    outputs.check([calibration_file(args)])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with workers(1) as pool:
        t0 = time.time()
        row = pool.submit(fresh_run, run, cfg).result()
        wall = time.time() - t0
    steps = [m for m in plot.read_metrics(cfg.out) if "time_update" in m]
    step_s = sum(sum(v for k, v in m.items() if k.startswith("time_")) for m in steps) / len(steps)
    update_s = sum(m["time_update"] for m in steps) / len(steps)
    cal = {
        "wall_s": round(wall, 1),
        "steps": args.steps,
        "step_s": round(step_s, 3),
        "update_pass_s": round(update_s, 3),
    }
    cal |= {"run": run.name, "eval_size": args.eval_size, "measured": time.strftime("%Y-%m-%d %H:%M")}
    outputs.write(calibration_file(args), json.dumps(cal | {"written_by": MARK}, indent=2) + "\n")
    print(
        f"one run ({run.name}, {row['steps']} steps, a fresh worker process): {cal['wall_s']} s; update pass "
        f"{cal['update_pass_s']} s per RL step; written to {Path(args.out) / 'calibration.json'}"
    )


def progress(row: dict) -> str:
    """A finished run's line: its accuracy before, after and at best, and its time."""
    return (
        f"{row['name']}: {row['eval_before']:.3f} -> {row['eval_after']:.3f} (best {row['eval_best']:.3f}) "
        f"in {row['wall_clock_s']:.0f} s"
    )


def _setting(text: str) -> tuple[int, int]:
    """ "4x1" -> (4, 1): minibatches x epochs."""
    parts = text.split("x")
    if len(parts) != 2 or not all(x.isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not MINIBATCHESxEPOCHS, e.g. 4x1")
    return int(parts[0]), int(parts[1])


# The command's modes, each as the refusal names what chooses it (study.runner.inert_flag)
MODES = {"run": "without --calibrate", "calibrate": "with --calibrate"}
# Each flag that acts in some modes only -> those modes (the others act in both): --calibrate times one run of seed
# 0 (of troll-paper, or the first of --variants; the first of --lrs; the most minibatches of --off_policy) into
# <out>/calibration.json, in one worker, whatever the grid's seeds, size or results file.
ACTS = dict.fromkeys(("--results", "--seeds", "--jobs", "--limit", "--dry-run"), ("run",))


def modes(args: argparse.Namespace) -> list[str]:
    """The mode the command runs in: --calibrate, or else a run (or --dry-run)."""
    return ["calibrate" if args.calibrate else "run"]


def parser() -> Parser:
    """The command's flags."""
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/study", help="one folder per run in here; default: %(default)s")
    p.add_argument("--results", default="study/results.jsonl", help="results file (JSONL); default: %(default)s")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    p.add_argument(
        "--off_policy",
        nargs="+",
        type=_setting,
        default=list(OFF_POLICY),
        help="MINIBATCHESxEPOCHS, e.g. 4x1 1x4; default: " + " ".join(f"{m}x{e}" for m, e in OFF_POLICY),
    )
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--steps", type=int, default=40, help="RL steps per run; default: %(default)s")
    p.add_argument("--eval_every", type=int, default=20, help="default: %(default)s")
    p.add_argument("--eval_size", type=int, default=400, help="held-out problems; default: %(default)s")
    p.add_argument("--sft_steps", type=int, default=250, help="warm-start steps (the study's); default: %(default)s")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time; default: %(default)s")
    p.add_argument("--limit", type=int, default=0, help="only the first N runs of the grid (0: all)")
    p.add_argument("--dry-run", action="store_true", help="list the grid and its time estimate, run nothing")
    p.add_argument("--calibrate", action="store_true", help="time one run and store it for the estimate")
    return p


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if problem := inert_flag(p, argv, ACTS, modes(args), MODES):  # before the checks of a flag that cannot act
        p.error(problem)
    try:  # every run's config is checked before any work
        for run in grid(args):
            config(run, args)
    except ValueError as e:
        p.error(str(e))
    if args.jobs < 1 or args.limit < 0:
        p.error("--jobs must be >= 1 and --limit >= 0")
    if problem := jobs_problem(args.jobs):
        p.error(problem)
    whole = grid(argparse.Namespace(**{**vars(args), "limit": 0}))  # a value past --limit still makes runs
    if problem := grid_problem(p, args, whole, FLAGS, "the on-policy 1x1 runs for the first of --variants only"):
        p.error(problem)
    if args.limit and args.limit >= len(whole):  # every run: the flag cannot act
        p.error(f"--limit {args.limit} cannot act: the grid has {len(whole)} runs, all of which it selects; give fewer "
                "or drop it")  # fmt: skip
    if Path(args.out).exists() and not Path(args.out).is_dir():
        p.error(f"--out {args.out} is a file, not a folder")
    if Path(args.results).is_dir():
        p.error(f"--results {args.results} is a folder, not a file")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run (or list) the grid; returns the results rows of this grid's finished runs."""
    args = parse(argv)
    if args.calibrate:
        calibrate(args)
        return []
    runs = grid(args)
    try:
        recorded = read_rows(Path(args.results), figures.read_results)
        changed = {r.name: d for r in runs if (d := differences(r, args, recorded))}
    except (OSError, ValueError) as e:
        fail(PROG, str(e))
    if changed:
        name, diff = next(iter(changed.items()))
        others = f" (and {len(changed) - 1} more runs)" if len(changed) > 1 else ""
        fail(
            PROG,
            f"run {name}{others} was made with other settings: {'; '.join(diff)}. Choose another --out and --results "
            "for these settings, or delete the run to make it again",
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)  # after the checks: a refused study writes nothing
    todo = [r for r in runs if r.name not in recorded and not (Path(args.out) / r.name / "summary.json").is_file()]
    total, source = estimate(todo, args)
    print(
        f"{len(runs)} runs ({len(args.variants)} variants x {len(args.lrs)} lrs x {len(args.off_policy)} "
        f"off-policy settings x {len(args.seeds)} seeds, 1x1 once{f'; first {args.limit}' if args.limit else ''}), "
        f"{len(runs) - len(todo)} finished; the rest: about {total / 60:.0f} min one at a time ({source}), to run "
        f"with {args.jobs} job(s)"
    )
    if args.dry_run:
        for r in runs:
            print(f"  {'done ' if r not in todo else ''}{r.name}")
        return []
    done = [
        recorded[r.name] if r.name in recorded else collect(r, Path(args.out) / r.name) for r in runs if r not in todo
    ]
    if done:
        merge_results(Path(args.results), done)  # rows of runs finished before, e.g. when the file was lost
    with workers(args.jobs) as pool:
        done += run_all(pool, execute, [(r, config(r, args)) for r in todo], Path(args.results), progress)
    print(f"{len(done)} runs in {args.results}")
    return done


if __name__ == "__main__":
    run_command(PROG, main)
