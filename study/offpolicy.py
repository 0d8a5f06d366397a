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
  settings differ from what the grid makes now is refused, not counted. Workers and their threads as in
  study/run.py (`--jobs N`: N spawned processes, cores / N torch threads each).
- Report: per cell (lr, source, anchor) and loss, the mean final accuracy, the mean paired difference to PPO-clip
  over seeds with its 95% t-interval, and how many runs ended below their warm-start.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from study.run import _init_worker, train_run, usage_error
from troll import plot
from troll.checkpoint import read_jsonl, rewrite_jsonl
from troll.config import Config, settings

SOURCES: dict[str, dict] = {
    "none": {},
    "epochs": dict(minibatches=4, epochs=2),
    "stale2": dict(staleness=2),
    "stale8": dict(staleness=8),
    "bf16": dict(rollout_dtype="bfloat16"),
}
ANCHORS: dict[str, dict] = {"recompute": dict(is_correction="tis"), "behaviour": dict(old_policy="behaviour")}
OFF_POLICY_SAMPLER = ("stale2", "stale8", "bf16")  # the sources where mu != pi_old: both anchors run
LOSSES = ("troll", "ppo_clip", "dppo", "cispo")
LRS = (1e-4, 3e-4)
SEEDS = (0, 1, 2, 3, 4)
BASELINE = "ppo_clip"
PROG = "python -m study.offpolicy"


@dataclass(frozen=True)
class Run:
    lr: float
    seed: int
    source: str
    anchor: str
    loss: str

    @property
    def name(self) -> str:
        return f"{self.loss}_{self.source}_{self.anchor}_lr{self.lr:g}_s{self.seed}"


def grid(args: argparse.Namespace) -> list[Run]:
    """Every run: learning rate by learning rate, then cell by cell in the order of --sources, every seed of a cell
    before the next cell (module docstring)."""
    cells = [
        (source, anchor)
        for source in args.sources
        for anchor in (args.anchors if source in OFF_POLICY_SAMPLER else ["recompute"])
    ]
    return [
        Run(lr, seed, source, anchor, loss)
        for lr, (source, anchor), seed in itertools.product(args.lrs, cells, args.seeds)
        for loss in args.losses
    ]


def warm_dir(args: argparse.Namespace, seed: int) -> Path:
    return Path(args.out) / f"warm-s{seed}"


def config(run: Run, args: argparse.Namespace) -> Config:
    """The run's troll.train config: the main job's, from the seed's warm-start, with its source and anchor."""
    anchor = ANCHORS[run.anchor] if run.source in OFF_POLICY_SAMPLER else {}
    return Config(
        **SOURCES[run.source],
        **anchor,
        model=str(warm_dir(args, run.seed)),
        sft_steps=0,
        loss=run.loss,
        lr=run.lr,
        seed=run.seed,
        steps=args.steps,
        eval_every=args.steps,
        save_every=args.steps,
        eval_size=args.eval_size,
        kl_update_vocab=4096,
        out=str(Path(args.out) / run.name),
    )


def warm_start(seed: int, args: argparse.Namespace) -> dict:
    """The main job's warm-start for `seed`, saved to warm_dir (model, tokenizer, warm.json written last)."""
    import torch

    from troll.harness import device_of
    from troll.policy import build_model
    from troll.task import load_task
    from troll.warmstart import warm_start_task

    out = warm_dir(args, seed)
    cfg = Config(seed=seed, sft_steps=args.sft_steps, out=str(out))
    torch.manual_seed(seed)
    model, tokenizer = build_model(cfg, device_of(cfg))
    task, _ = load_task(cfg, tokenizer)
    with open(Path(args.out) / f"warm-s{seed}.log", "w") as log, contextlib.redirect_stdout(log):
        record = warm_start_task(cfg, model, tokenizer, task)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "warm.json").write_text(json.dumps({"seed": seed, "sft_limit": args.sft_steps, **record}, indent=2) + "\n")
    return record


def _read_config(path: Path) -> dict | None:
    """A saved config.json (or warm.json) as a dict of settings, or None when there is none."""
    return settings(json.loads(path.read_text())) if path.is_file() else None


def read_results(path: Path) -> dict[str, dict]:
    """The results file's rows by run name (empty when there is no file)."""
    return {r["name"]: r for r in read_jsonl(path)} if path.is_file() else {}


def merge_results(path: Path, row: dict) -> None:
    """Add or replace `row` by name, keep the others, write atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rewrite_jsonl(path, list((read_results(path) | {row["name"]: row}).values()))


def collect(run: Run, out: Path) -> dict:
    """One results row from a finished run directory."""
    summary = json.loads((out / "summary.json").read_text())
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
        "config": settings(json.loads((out / "config.json").read_text())),
    }


def execute(run: Run, cfg: Config) -> dict:
    """Train one run (study.run.train_run); returns its results row."""
    return collect(run, train_run(cfg))


# ----------------------------------------------------------------------------- the report


def t_interval(diffs: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval of paired differences (nan half-width for fewer than 2)."""
    try:
        from scipy.stats import t
    except ImportError:
        usage_error("the report's t-intervals need scipy: pip install scipy (or the dev extra)", PROG)

    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.nan
    return mean, float(t.ppf(0.975, len(diffs) - 1)) * statistics.stdev(diffs) / math.sqrt(len(diffs))


def paired(rows: Sequence[dict], baseline: str = BASELINE) -> list[dict]:
    """Per (lr, source, anchor, loss): n seeds, mean final accuracy and gain, the mean paired difference to the
    baseline's final accuracy on the same seed with its 95% interval, and the runs that ended below their start."""
    by = {(r["lr"], r["source"], r["anchor"], r["loss"], r["seed"]): r for r in rows}
    order = (list(SOURCES), list(ANCHORS), list(LOSSES))
    cells = sorted({k[:4] for k in by}, key=lambda k: (k[0], *(o.index(x) for o, x in zip(order, k[1:], strict=True))))
    out = []
    for lr, source, anchor, loss in cells:
        runs = [r for k, r in by.items() if k[:4] == (lr, source, anchor, loss)]
        diffs = [
            r["eval_after"] - by[(lr, source, anchor, baseline, r["seed"])]["eval_after"]
            for r in runs
            if (lr, source, anchor, baseline, r["seed"]) in by
        ]
        mean, half = t_interval(diffs) if diffs else (math.nan, math.nan)
        out.append({
            "lr": lr, "source": source, "anchor": anchor, "loss": loss, "n": len(runs),
            "after": statistics.fmean(r["eval_after"] for r in runs),
            "gain": statistics.fmean(r["eval_after"] - r["eval_before"] for r in runs),
            "diff": mean, "half": half, "below": sum(r["eval_after"] < r["eval_before"] for r in runs),
            "kl_update": statistics.fmean(r["kl_update_mean"] for r in runs),
            "mismatch_kl": statistics.fmean(r["mismatch_kl"] for r in runs),
        })  # fmt: skip
    return out


def report(rows: Sequence[dict], baseline: str = BASELINE) -> str:
    """The paired table as markdown."""
    lines = [
        f"| lr | source | anchor | loss | seeds | final acc | gain | vs {baseline} (95% CI) | below start | "
        "update KL | mismatch KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in paired(rows, baseline):
        vs = "-" if c["loss"] == baseline else f"{c['diff']:+.3f} ± {c['half']:.3f}"
        lines.append(
            f"| {c['lr']:g} | {c['source']} | {c['anchor']} | {c['loss']} | {c['n']} | {c['after']:.3f} | "
            f"{c['gain']:+.3f} | {vs} | {c['below']}/{c['n']} | {c['kl_update']:.4f} | {c['mismatch_kl']:.4f} |"
        )
    return "\n".join(lines)


def plot_paired(rows: Sequence[dict], out: Path) -> Path:
    """One panel per learning rate: each loss's paired difference to PPO-clip, per cell, with its 95% interval."""
    from matplotlib.figure import Figure

    cells = [c for c in paired(rows) if c["loss"] != BASELINE]
    lrs = sorted({c["lr"] for c in cells})
    fig = Figure(figsize=(11, 3.4 * len(lrs)))
    axes = fig.subplots(len(lrs), 1, squeeze=False)[:, 0]
    for ax, lr in zip(axes, lrs, strict=True):
        mine = [c for c in cells if c["lr"] == lr]
        labels = list(dict.fromkeys(f"{c['source']}\n{c['anchor']}" for c in mine))
        for j, loss in enumerate(x for x in LOSSES if x != BASELINE):
            pts = [c for c in mine if c["loss"] == loss]
            xs = [labels.index(f"{c['source']}\n{c['anchor']}") + (j - 1) * 0.22 for c in pts]
            ax.errorbar(xs, [c["diff"] for c in pts], yerr=[c["half"] for c in pts], fmt="o", ms=4, capsize=3,
                        label=loss)  # fmt: skip
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylabel("final accuracy - PPO-clip's")
        ax.set_title(f"lr {lr:g}: paired difference to PPO-clip, mean over seeds, 95% interval", fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "offpolicy_paired.png"
    fig.savefig(path, dpi=110)
    return path


# ----------------------------------------------------------------------------- the command


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/offpolicy", help="one folder per run in here; default: %(default)s")
    p.add_argument("--results", default="study/offpolicy.jsonl", help="results file; default: %(default)s")
    p.add_argument("--sources", nargs="+", default=list(SOURCES), choices=list(SOURCES))
    p.add_argument("--anchors", nargs="+", default=list(ANCHORS), choices=list(ANCHORS))
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=list(LOSSES))
    p.add_argument("--lrs", nargs="+", type=float, default=list(LRS))
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--steps", type=int, default=40, help="RL steps per run; default: %(default)s")
    p.add_argument("--eval_size", type=int, default=1000, help="held-out problems; default: %(default)s")
    p.add_argument("--sft_steps", type=int, default=600, help="warm-start step limit; default: %(default)s")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time; default: %(default)s")
    p.add_argument("--dry-run", action="store_true", help="list the grid, run nothing")
    p.add_argument("--report", action="store_true", help="print the paired table of the results file")
    p.add_argument("--baseline", default=BASELINE, choices=list(LOSSES), help="the report's paired baseline")
    p.add_argument("--figures", default=None, help="draw the paired figure of the results file into this folder")
    args = p.parse_args(argv)
    for name in ("steps", "eval_size", "sft_steps", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if any(not (lr > 0 and math.isfinite(lr)) for lr in args.lrs):
        p.error(f"--lrs must be positive and finite, got {args.lrs}")
    if Path(args.out).is_file() or Path(args.results).is_dir():
        p.error("--out must be a folder and --results a file")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse(argv)
    if args.report or args.figures:
        rows = list(read_results(Path(args.results)).values())
        if not rows:
            usage_error(f"{args.results} holds no results", PROG)
        if args.report:
            print(report(rows, args.baseline))
        if args.figures:
            print(plot_paired(rows, Path(args.figures)))
        return rows
    runs, done = grid(args), read_results(Path(args.results))
    for run in runs:  # a run recorded, or in its folder, with other settings is not counted as done
        want = settings(asdict(config(run, args)))
        path = Path(args.out) / run.name / "config.json"
        for where, saved in ((args.results, done.get(run.name, {}).get("config")), (path, _read_config(path))):
            if saved is not None and saved != want:
                changed = sorted(k for k in want if saved.get(k) != want[k])
                usage_error(f"{run.name} ({where}) was run with other settings ({', '.join(changed)})", PROG)
    for seed in sorted({r.seed for r in runs}):  # a warm-start made with another step limit is not this study's
        record = _read_config(warm_dir(args, seed) / "warm.json")
        if record is not None and record.get("sft_limit") != args.sft_steps:
            usage_error(f"{warm_dir(args, seed)} was warm-started with --sft_steps {record.get('sft_limit')}", PROG)
    todo = [r for r in runs if r.name not in done]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} done, {len(todo)} to run with {args.jobs} job(s)")
    if args.dry_run:
        for run in todo:
            print(" ", run.name)
        return []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else 0
    context = get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context, initializer=_init_worker, initargs=(threads,)) as pool:
        seeds = sorted({r.seed for r in todo if not (warm_dir(args, r.seed) / "warm.json").is_file()})
        for seed, future in [(s, pool.submit(warm_start, s, args)) for s in seeds]:
            print(f"warm-start seed {seed}: {future.result()}", flush=True)
        futures = {pool.submit(execute, run, config(run, args)): run for run in todo}
        finished = []
        for i, future in enumerate(as_completed(futures), 1):
            row = future.result()
            merge_results(Path(args.results), row)
            finished.append(row)
            print(f"[{i}/{len(todo)}] {row['name']}: {row['eval_before']:.3f} -> {row['eval_after']:.3f}", flush=True)
    return finished


if __name__ == "__main__":
    main()
