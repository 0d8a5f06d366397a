"""The real-model study's time estimate (design: study/real.py): the runs and warm-starts left, one at a time, from
this study's finished runs where it has them, else from built-in figures (`MEASURED`); the line says which."""

from __future__ import annotations

import argparse
import statistics

from study.real_warm import preset, warm_record

# The built-in time figures, used until this study has finished runs of the model. SmolLM2's: the preset's seed 0-2
# runs (docs/results.md, "A finer warm-start") on the project's 2 cores shared by two runs and tests: 29.3-33.5 s a
# step on average; 0.25 s an evaluated problem (the earlier preset's run tB: (its wall time - its steps - its
# warm-start) / the 2,000 problems of its 4 evaluations, loading and checkpoints included); a warm-start about 200 s
# (7-9 supervised steps and the 256-problem probes: seed 0's step-0 checkpoint came 335 s after its start, the
# 500-problem evaluation before RL among them). The tiny model's:
# this study's rehearsal on the same busy machine (1 step, 4 problems: 17-20 s a run, mostly loading the task).
MEASURED = {
    "smollm2-135m-instruct": {
        "step_s": 32.0, "eval_s": 0.25, "warm_s": 200.0,
        "source": "built-in figures measured with the 2 cores shared (study/real_time.py MEASURED)",
    },
    "tiny": {"step_s": 2.5, "eval_s": 2.0, "warm_s": 30.0, "source": "built-in figures (study/real_time.py MEASURED)"},
}  # fmt: skip


def evaluations(args: argparse.Namespace) -> int:
    """Held-out evaluations a run makes: before RL, every eval_every steps and at the last (troll.run.harness)."""
    every = preset(args.model)["eval_every"]
    return 1 + sum(1 for s in range(1, args.steps + 1) if s % every == 0 or s == args.steps)


def time_figures(args: argparse.Namespace, done: dict[str, dict]) -> dict:
    """Seconds per RL step, per evaluated problem, per run (where measured) and per warm-start, and where they come
    from (module docstring)."""
    figures = dict(MEASURED[args.model])
    runs = [r for r in done.values() if r["model"] == args.model and r.get("steps")]
    same = [r for r in runs if (r["steps"], r.get("eval_problems")) == (args.steps, args.eval_size)]
    if same:  # runs of these settings: their whole wall time (loading, evaluations, checkpoints included)
        figures |= {"step_s": statistics.fmean(r["step_s"] for r in same)}
        figures |= {"run_s": statistics.fmean(r["wall_clock_s"] for r in same)}
        figures["source"] = f"measured: the mean of {len(same)} finished run(s) of these settings in {args.results}"
    elif runs:  # runs of other lengths: their step time, the built-in time per evaluated problem
        figures["step_s"] = statistics.fmean(r["step_s"] for r in runs)
        figures["source"] = f"step: the mean of {len(runs)} finished run(s) in {args.results}; {figures['source']}"
    warm = [w["warm_s"] for s in args.seeds if (w := warm_record(args, s)) and "warm_s" in w]
    if warm:
        figures["warm_s"] = statistics.fmean(warm)
        figures["source"] += f"; warm-start: the mean of {len(warm)} in {args.out}"
    return figures


def estimate(args: argparse.Namespace, runs: int, warm_starts: int, figures: dict) -> str:
    """The time of `runs` runs and `warm_starts` warm-starts one at a time, as a line that names its figures."""
    evals = evaluations(args)
    run_s = figures.get("run_s", args.steps * figures["step_s"] + evals * args.eval_size * figures["eval_s"])
    how = (
        f"{figures['step_s']:.1f} s a step"
        if "run_s" in figures
        else f"{args.steps} steps x {figures['step_s']:.1f} s + {evals} evaluations of {args.eval_size} problems x "
        f"{figures['eval_s']:.2f} s"
    )
    total = runs * run_s + warm_starts * figures["warm_s"]
    return (
        f"time: about {total / 60:.0f} min one run at a time ({runs} runs x {run_s / 60:.1f} min ({how}) + "
        f"{warm_starts} warm-starts x {figures['warm_s'] / 60:.1f} min; {figures['source']})"
    )
