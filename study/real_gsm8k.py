"""GSM8K before and after the real-model study's best runs (study/real.py): does what SmolLM2 learns on word problems
carry over to GSM8K?

    python -m study.real_gsm8k --data openai/gsm8k --dry-run     # the evaluations, and what they need
    python -m study.real_gsm8k --data openai/gsm8k               # run them (resumable: run it again to go on)
    python -m study.real_gsm8k --report                                  # the table of the evaluations made
    python -m study.real_gsm8k --data tests/data/gsm8k --out runs/real-smoke --results runs/real-smoke/results.jsonl \\
        --limit 4 --samples 2 --max_new_tokens 8                          # a rehearsal after study.real's

Design, stated once:
- What is evaluated: for each of `--seeds` (default 0), the seed's warm-start (<out>/warm-s<seed>, the model
  before RL) and, for each loss in the study's results (`--results`), its run at its own best lr on that seed
  (study.real_report.best_lr, as the study's report chooses it) after RL (<out>/<name>/final, the model the study
  keeps of each run). A seed without a run at a loss's best lr, a run without its results row or its final model,
  or a warm-start without warm.json is refused in one line naming it and the command that makes it; so is a
  results file without a best lr for any loss.
- How: troll.tools.evaluate in this process, task gsm8k from `--data` (the hub's openai/gsm8k, a folder with
  GSM8K's test.jsonl, or one .jsonl file; the repository's sample, tests/data/gsm8k, holds 100 test problems), the
  first `--limit` problems (default 200), greedy pass@1 and `--samples` completions a problem (default 8) at
  temperature 1.0, seed 0, for pass@k, at most `--max_new_tokens` tokens (default 256), before and after alike: a
  model folder, prompted through its chat template as GSM8K asks (troll.tasks.gsm8k). Each evaluation goes to
  <evals>/<label> (`--evals`, default <out>/gsm8k; label: warm-s<seed> or the run's name), where a stopped one
  continues and a finished one is read back (troll.tools.evaluate); every folder is checked to be free or
  evaluate's own before the first is written.
- Report (`--report`, from the summary.json files in --evals, read through `SUMMARY`): per seed, the warm-start and
  each loss's run: greedy pass@1 and pass@k at k = 1 and the samples, and the run minus its warm-start; then per
  loss over the seeds, the mean difference in greedy pass@1 and pass@k with 95% t-intervals. An interval that
  contains 0 is said in words: no transfer shown.
- Time: one evaluation of SmolLM2 on 50 GSM8K problems with 4 samples of 256 tokens took 454 s on 2 idle cores
  (docs/results.md): about 1.8 s a completion, so 200 problems x 9 completions about 55 minutes each at most (a
  completion that ends early costs less).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path

from study.real import FIELDS
from study.real import PROG as STUDY
from study.real_report import LOSSES, best_lr
from study.real_warm import warm_dir
from study.runner import ACCURACY, inert_flag, pm, read_results, repeats, t_interval
from troll.base import outputs
from troll.base.cli import Parser, UsageError, run_command
from troll.base.schema import Spec, fields_problem, read_json_checked

PROG = "python -m study.real_gsm8k"
SECONDS_PER_COMPLETION = 1.8  # SmolLM2 on GSM8K at 256 tokens, 2 idle cores (module docstring)
# What the report reads of troll.tools.evaluate's summary.json
SUMMARY = {"accuracy": ACCURACY, "n": Spec("integer", low=1), "task": Spec("string", choices=("gsm8k",)),
           "samples": Spec("integer", low=0), "pass@k": Spec("object", required=False)}  # fmt: skip


def evaluations(args: argparse.Namespace, rows: Sequence[dict], check: bool = True) -> list[tuple[str, Path]]:
    """(label, model) for each evaluation: per seed its warm-start, then each loss's run at its best lr; a
    UsageError names the first that is missing (with `check`, its model folder too)."""
    best = {loss: b[0] for loss in LOSSES if (b := best_lr(rows, loss))}
    if not best:
        raise UsageError(f"{args.results} holds no loss with a best lr: run {STUDY} (its sweep) first")
    out = Path(args.out)
    made = []
    for seed in args.seeds:
        warm = warm_dir(args, seed)
        if check and not (warm / "warm.json").is_file():
            raise UsageError(f"{warm} holds no warm-start (no warm.json): run {STUDY} --out {out} first")
        made.append((f"warm-s{seed}", warm))
        for loss, lr in best.items():
            name = next((r["name"] for r in rows if (r["loss"], r["lr"], r["seed"]) == (loss, lr, seed)), None)
            if name is None:
                raise UsageError(f"{args.results} has no {loss} run at its best lr {lr:g} on seed {seed}: run {STUDY}, "
                                 "or give --seeds it ran")  # fmt: skip
            if check and not (out / name / "final" / "model.safetensors").is_file():
                raise UsageError(f"{out / name / 'final'} holds no model (model.safetensors), which {STUDY} keeps of "
                                 "the runs it finishes: remove that run's row and folder and run it again")  # fmt: skip
            made.append((name, out / name / "final"))
    return made


def evaluate_argv(args: argparse.Namespace, model: Path, label: str) -> list[str]:
    """The troll.tools.evaluate command line of one evaluation."""
    argv = ["--model", str(model), "--task", "gsm8k", "--data", args.data, "--limit", str(args.limit)]
    argv += ["--max_new_tokens", str(args.max_new_tokens), "--out", str(Path(args.evals) / label), "--backend", "hf"]
    return argv + (["--samples", str(args.samples), "--seed", "0"] if args.samples else [])


def summary_problem(obj: dict) -> tuple[str, str] | None:
    """The first of `SUMMARY`'s fields of an evaluation's summary.json that is not as declared (pass@k: a share of
    the problems for each k); the other fields are evaluate's and not read here."""
    if found := fields_problem({k: obj[k] for k in SUMMARY if k in obj}, SUMMARY, 1):
        return found
    for k, v in obj.get("pass@k", {}).items():
        if not (k.isdigit() and ACCURACY.accepts(v)):
            return f"pass@k[{k!r}]", f"is {v!r}, expected a number in [0, 1] for a whole k"
    return None


def read_summary(path: Path) -> dict:
    """An evaluation's summary.json, read through `SUMMARY` (`summary_problem`)."""
    forward = f"evaluate it again: {PROG} --data ... (its predictions are kept)"
    return read_json_checked(path, summary_problem, forward)


def report(args: argparse.Namespace, rows: Sequence[dict]) -> str:
    """The table of the evaluations made (module docstring), as markdown."""
    made = {label: read_summary(p) for label, _ in evaluations(args, rows, check=False)
            if (p := Path(args.evals) / label / "summary.json").is_file()}  # fmt: skip
    if not made:
        raise UsageError(f"{args.evals} holds no finished evaluation: run {PROG} --data ... first")
    present = {int(k) for s in made.values() for k in s.get("pass@k", {})}
    ks = sorted({1, max(present)} & present) if present else []  # k = 1 and the samples an evaluation drew
    head = ["greedy pass@1", *(f"pass@{k}" for k in ks)]

    def figures(s: dict) -> list[float]:
        return [s["accuracy"], *(s.get("pass@k", {}).get(str(k), math.nan) for k in ks)]

    lines = [f"| model | problems | {' | '.join(head)} | run - warm-start ({head[0]}) |", "|---" * (len(ks) + 4) + "|"]
    diffs: dict[str, list[list[float]]] = {}
    for label, s in made.items():
        row = next((r for r in rows if r["name"] == label), None)
        warm = made.get(f"warm-s{row['seed']}") if row else None
        gain = [a - b for a, b in zip(figures(s), figures(warm), strict=True)] if warm else []
        if gain:
            diffs.setdefault(row["loss"], []).append(gain)
        lines.append(f"| {label} | {s['n']} | {' | '.join(f'{x:.3f}' for x in figures(s))} | "
                     f"{f'{gain[0]:+.3f}' if gain else '-'} |")  # fmt: skip
    lines += ["", "Each loss's run minus its warm-start over the seeds (95% t-intervals):"]
    for loss, per_seed in diffs.items():
        parts = [f"{h} {pm(*t_interval([d[i] for d in per_seed]))}" for i, h in enumerate(head)]
        shown = any(lo > 0 or hi < 0 for lo, hi in (interval(d) for d in zip(*per_seed, strict=True)))
        said = "a change beyond the noise" if shown else "no transfer shown (every interval holds 0)"
        lines.append(f"- {loss}, {len(per_seed)} seed(s): {', '.join(parts)}: {said}")
    return "\n".join(lines)


def interval(values: Sequence[float]) -> tuple[float, float]:
    """The 95% t-interval's ends (both the mean for one value, which shows nothing beyond the noise: NaN ends)."""
    mean, half = t_interval(values)
    return (math.nan, math.nan) if math.isnan(half) else (mean - half, mean + half)


MODES = {"run": "without --report", "report": "with --report"}
ACTS = {"--data": ("run",), "--limit": ("run",), "--samples": ("run",), "--max_new_tokens": ("run",),
        "--dry-run": ("run",)}  # fmt: skip


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--data", help="GSM8K's test split: openai/gsm8k, a folder with test.jsonl or a .jsonl file")
    p.add_argument("--out", default="runs/real", help="the study's --out; default: %(default)s")
    p.add_argument("--results", default="study/real.jsonl", help="the study's --results; default: %(default)s")
    p.add_argument("--evals", default=None, help="one folder per evaluation in here; default: <out>/gsm8k")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--limit", type=int, default=200, help="the first N test problems; default: %(default)s")
    p.add_argument("--samples", type=int, default=8, help="sampled completions a problem; default: %(default)s")
    p.add_argument("--max_new_tokens", type=int, default=256, help="the longest completion; default: %(default)s")
    p.add_argument("--dry-run", action="store_true", help="list the evaluations and their time, run nothing")
    p.add_argument("--report", action="store_true", help="print the table of the evaluations made")
    args = p.parse_args(argv)
    if problem := inert_flag(p, argv, ACTS, ["report" if args.report else "run"], MODES):
        p.error(problem)
    if not args.report and not args.data:
        p.error("--data is needed to evaluate: openai/gsm8k, or a folder with GSM8K's test.jsonl (tests/data/gsm8k)")
    for name, low in (("limit", 1), ("samples", 0), ("max_new_tokens", 1)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if twice := repeats(args.seeds):
        p.error(f"--seeds lists {twice[0]} twice: give each seed once")
    args.evals = args.evals or str(Path(args.out) / "gsm8k")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Print the report, or list and make the evaluations; returns their summaries."""
    from troll.tools import evaluate

    args = parse(argv)
    rows = list(read_results(Path(args.results), FIELDS, STUDY).values())
    if args.report:
        print(report(args, rows))
        return []
    todo = evaluations(args, rows)
    for label, _ in todo:  # every folder free or evaluate's own before anything is written
        outputs.check(outputs.Marked(Path(args.evals) / label, "troll.evaluate", evaluate.OUTPUTS, "--evals").targets())
    completions = args.limit * (1 + args.samples)
    print(f"{len(todo)} evaluations of at most {args.limit} problems x {1 + args.samples} completions; at most about "
          f"{len(todo) * completions * SECONDS_PER_COMPLETION / 60:.0f} min on 2 idle cores at "
          f"{SECONDS_PER_COMPLETION} s a completion of {args.max_new_tokens} tokens")  # fmt: skip
    for label, model in todo:
        print(f"  {label}: {model}")
    if args.dry_run:
        return []
    made = []
    for label, model in todo:
        made.append(summary := evaluate.main(evaluate_argv(args, model, label)))
        print(f"{label}: greedy pass@1 {summary['accuracy']:.3f}", flush=True)
    print(report(args, rows))
    return made


if __name__ == "__main__":
    run_command(PROG, main)
