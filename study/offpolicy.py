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
- Settings (`--settings`, `SETTINGS`): each loss's trust-region size (TROLL's eps, PPO-clip's range, clip-higher);
  `default` keeps a run's old name. Where both losses ran several, the report adds each at its own best setting
  (the best mean final accuracy), paired, and the same with the settings chosen without each seed
  (`best_vs_best`; docs/algorithm.md, section 12).
- LoRA (`--settings lora8`): adapters (rank 8, alpha 16, all-linear) on the seed's frozen warm-start, for every
  loss. Where a loss ran both, the report adds LoRA at its own best learning rate against full fine-tuning
  (`default`) at its own, paired, and the same with the learning rates chosen without each seed (`lora_vs_full`).
- Task (`--task rare --vocab_size N`): the rare-behaviour variant (troll.addition); its warm-start records how often
  the behaviour appears, its rows the behaviour's rate per step, and the report how fast each loss adopts it.
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

from study import figures
from study.run import _init_worker, train_run, usage_error
from troll import plot
from troll.checkpoint import read_jsonl, rewrite_jsonl, rows_by_name
from troll.cli import UsageError, run_command
from troll.config import Config, settings

SOURCES: dict[str, dict] = {
    "none": {},
    "epochs": dict(minibatches=4, epochs=2),
    "stale2": dict(staleness=2),
    "stale8": dict(staleness=8),
    "bf16": dict(rollout_dtype="bfloat16"),
}
ANCHORS: dict[str, dict] = {"recompute": dict(is_correction="tis"), "behaviour": dict(old_policy="behaviour")}
# A loss's setting: the size of its trust region. `default` is the loss's own default (TROLL eps 0.05, PPO-clip
# 0.2 / 0.2) and runs for every loss; every other setting belongs to one loss (`SETTINGS[name][0]`) and runs only
# with it. clip0.2-0.28 is DAPO's clip-higher.
SETTINGS: dict[str, tuple[str | None, dict]] = {
    "default": (None, {}),
    **{f"eps{e:g}": ("troll", dict(eps=e)) for e in (0.01, 0.02, 0.1, 0.2)},
    **{f"clip{c:g}": ("ppo_clip", dict(clip_low=c, clip_high=c)) for c in (0.1, 0.3)},
    "clip0.2-0.28": ("ppo_clip", dict(clip_low=0.2, clip_high=0.28)),
    # DPPO's ratio cap c (default: the authors' 10; 2 is what this project ran before it was a setting) and CISPO's
    # eps_high (default 0.2, verl's; the cap is 1 + eps_high, and the MiniMax-M1 paper tunes only this bound)
    **{f"cap{c:g}": ("dppo", dict(dppo_cap=float(c))) for c in (2, 20)},
    **{f"eh{e:g}": ("cispo", dict(clip_high=float(e))) for e in (1, 5)},
    # Not a trust-region size: LoRA adapters (rank 8, alpha 16, PEFT's all-linear) on the seed's frozen warm-start,
    # for every loss; the report sets it at its own best learning rate against full fine-tuning at its own.
    "lora8": (None, dict(lora_rank=8, lora_alpha=16.0, lora_targets="all-linear")),
}
# The study's sweep (docs/results.md#best-against-best): these settings and the defaults in these cells.
SWEEP = ["eps0.01", "eps0.02", "eps0.1", "eps0.2", "clip0.1", "clip0.3", "clip0.2-0.28"]
OFF_POLICY_SAMPLER = ("stale2", "stale8", "bf16")  # the sources where mu != pi_old: both anchors run
LOSSES = ("troll", "ppo_clip", "dppo", "cispo")
LRS = (1e-4, 3e-4)
SEEDS = (0, 1, 2, 3, 4)
BASELINE = "ppo_clip"
PROG = "python -m study.offpolicy"
TASKS = ("addition", "rare")  # --task: the main job's, or its variant whose rewarded format starts rare
THRESHOLD = 0.5  # the rare task's adoption: the first RL step whose samples show the behaviour this often


@dataclass(frozen=True)
class Run:
    lr: float
    seed: int
    source: str
    anchor: str
    loss: str
    setting: str = "default"

    @property
    def name(self) -> str:
        variant = self.loss if self.setting == "default" else f"{self.loss}-{self.setting}"
        return f"{variant}_{self.source}_{self.anchor}_lr{self.lr:g}_s{self.seed}"


def setting_of(row: dict) -> str:
    """A results row's setting; rows written before settings existed ran the default."""
    return row.get("setting", "default")


def grid(args: argparse.Namespace) -> list[Run]:
    """Every run: learning rate by learning rate, then cell by cell in the order of --sources, every seed of a cell
    before the next cell (module docstring)."""
    cells = [
        (source, anchor)
        for source in args.sources
        for anchor in (args.anchors if source in OFF_POLICY_SAMPLER else ["recompute"])
    ]
    variants = [(loss, s) for loss in args.losses for s in args.settings if SETTINGS[s][0] in (None, loss)]
    return [
        Run(lr, seed, source, anchor, loss, setting)
        for lr, (source, anchor), seed in itertools.product(args.lrs, cells, args.seeds)
        for loss, setting in variants
    ]


def warm_dir(args: argparse.Namespace, seed: int) -> Path:
    return Path(args.out) / f"warm-s{seed}"


def config(run: Run, args: argparse.Namespace) -> Config:
    """The run's troll.train config: the main job's, from the seed's warm-start, with its source, anchor and
    setting."""
    anchor = ANCHORS[run.anchor] if run.source in OFF_POLICY_SAMPLER else {}
    return Config(
        **SOURCES[run.source],
        **anchor,
        **SETTINGS[run.setting][1],
        task=args.task,
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
    cfg = Config(seed=seed, sft_steps=args.sft_steps, task=args.task, vocab_size=args.vocab_size, out=str(out))
    torch.manual_seed(seed)
    model, tokenizer = build_model(cfg, device_of(cfg))
    task, _ = load_task(cfg, tokenizer)
    with open(Path(args.out) / f"warm-s{seed}.log", "w") as log, contextlib.redirect_stdout(log):
        record = warm_start_task(cfg, model, tokenizer, task)
    if task.behaviour:  # how rare the rewarded behaviour is where RL starts
        record |= behaviour_rate(cfg, model, tokenizer, task)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    made = {"seed": seed, "sft_limit": args.sft_steps, "task": args.task, "vocab_size": args.vocab_size}
    (out / "warm.json").write_text(json.dumps(made | record, indent=2) + "\n")
    return record


def behaviour_rate(cfg: Config, model, tokenizer, task, prompts: int = 1024, samples: int = 8) -> dict:
    """The share of sampled completions (temperature cfg.temperature, `samples` per training prompt, the first
    `prompts` training problems) that show the task's behaviour, and the share that earn the reward."""
    import torch

    from troll.rollout import HFGenerator
    from troll.task import decode, encode

    generator, texts, golds = HFGenerator(model, tokenizer), [], []
    for i in range(0, prompts, 128):  # 128 prompts at a time: the sampler's memory stays small at a large V
        rows = task.train[i : min(i + 128, prompts)]
        with torch.no_grad():
            ro = generator.generate(encode(tokenizer, [task.prompt(r["question"]) for r in rows]), samples,
                                    cfg.max_new_tokens, cfg.temperature, seed=cfg.seed + i)  # fmt: skip
        lengths = ro.completion_mask.sum(-1).tolist()
        texts += decode(tokenizer, [ids[:n] for ids, n in zip(ro.completion_ids.tolist(), lengths, strict=True)])
        golds += [rows[int(g)]["gold"] for g in ro.group]
    return {
        "behaviour_rate": sum(map(task.behaviour, texts)) / len(texts),
        "reward_rate": sum(task.reward(t, g) for t, g in zip(texts, golds, strict=True)) / len(texts),
        "behaviour_samples": len(texts),
    }


def _read_config(path: Path) -> dict | None:
    """A saved config.json (or warm.json) as a dict of settings, or None when there is none."""
    return settings(json.loads(path.read_text())) if path.is_file() else None


def read_results(path: Path) -> dict[str, dict]:
    """The results file's rows by run name (empty when there is no file); a torn or conflicting row is a
    UsageError naming the file and the line or run."""
    try:
        return rows_by_name(path, read_jsonl(path)) if path.is_file() else {}
    except ValueError as e:
        raise UsageError(f"{e} (fix or remove that row: its run is trained again)") from None


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
        **({"behaviour_rate": [m["behaviour_rate"] for m in steps]} if "behaviour_rate" in steps[0] else {}),
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


def _cell_order(key: tuple) -> tuple:
    """Sort key of (lr, source, anchor, loss, setting): the study's own orders."""
    lr, source, anchor, loss, setting = key
    return (
        lr,
        list(SOURCES).index(source),
        list(ANCHORS).index(anchor),
        LOSSES.index(loss),
        list(SETTINGS).index(setting),
    )


def by_run(rows: Sequence[dict]) -> dict[tuple, dict]:
    """Rows by (lr, source, anchor, loss, setting, seed)."""
    return {(r["lr"], r["source"], r["anchor"], r["loss"], setting_of(r), r["seed"]): r for r in rows}


def adoption_step(row: dict, threshold: float = THRESHOLD) -> int:
    """The first RL step whose samples show the rare task's behaviour at least `threshold` of the time; a run that
    never does counts as steps + 1 (censored: its true step is later)."""
    rates = row["behaviour_rate"]
    return next((i + 1 for i, x in enumerate(rates) if x >= threshold), len(rates) + 1)


def paired(rows: Sequence[dict], baseline: str = BASELINE, threshold: float = THRESHOLD) -> list[dict]:
    """Per (lr, source, anchor, loss, setting): n seeds, mean final accuracy and gain, the mean paired difference
    to the baseline loss at its default setting on the same seed with its 95% interval, and the runs that ended
    below their start. Rows of the rare task add the behaviour's rate at the first and last step (and the last
    step's paired difference to the baseline's) and the step it passes `threshold` (mean, and paired difference)."""
    by = by_run(rows)
    out = []
    for cell in sorted({k[:5] for k in by}, key=_cell_order):
        lr, source, anchor, loss, setting = cell
        runs = [r for k, r in by.items() if k[:5] == cell]
        base = {k[5]: r for k, r in by.items() if k[:5] == (lr, source, anchor, baseline, "default")}
        mean, half = t_interval([r["eval_after"] - base[r["seed"]]["eval_after"] for r in runs if r["seed"] in base]
                                or [math.nan])  # fmt: skip
        c = {
            "lr": lr, "source": source, "anchor": anchor, "loss": loss, "setting": setting, "n": len(runs),
            "after": statistics.fmean(r["eval_after"] for r in runs),
            "gain": statistics.fmean(r["eval_after"] - r["eval_before"] for r in runs),
            "diff": mean, "half": half, "below": sum(r["eval_after"] < r["eval_before"] for r in runs),
            "kl_update": statistics.fmean(r["kl_update_mean"] for r in runs),
            "mismatch_kl": statistics.fmean(r["mismatch_kl"] for r in runs),
            "wall_clock_s": statistics.fmean(r.get("wall_clock_s", math.nan) for r in runs),
        }  # fmt: skip
        if all("behaviour_rate" in r for r in runs):
            steps = {r["seed"]: adoption_step(r, threshold) for r in runs}
            d = [steps[s] - adoption_step(b, threshold) for s, b in base.items() if s in steps]
            last = {r["seed"]: r["behaviour_rate"][-1] for r in runs}
            c |= {
                "rate_first": statistics.fmean(r["behaviour_rate"][0] for r in runs),
                "rate_last": statistics.fmean(r["behaviour_rate"][-1] for r in runs),
                "adopt": statistics.fmean(steps.values()),
                "adopted": sum(r["behaviour_rate"][-1] >= threshold for r in runs),
                "adopt_diff": t_interval(d or [math.nan]),
                "rate_diff": t_interval(
                    [last[s] - b["behaviour_rate"][-1] for s, b in base.items() if s in last] or [math.nan]
                ),  # fmt: skip
            }
        out.append(c)
    return out


def _label(c: dict) -> str:
    return c["loss"] if c["setting"] == "default" else f"{c['loss']} {c['setting']}"


def report(rows: Sequence[dict], baseline: str = BASELINE, threshold: float = THRESHOLD) -> str:
    """The paired table as markdown; for the rare task a second table, how fast each loss adopts the behaviour."""
    cells = paired(rows, baseline, threshold)
    lines = [
        f"| lr | source | anchor | loss | seeds | final acc | gain | vs {baseline} (95% CI) | below start | "
        "update KL | mismatch KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        own = (c["loss"], c["setting"]) == (baseline, "default") or math.isnan(c["diff"])  # or no baseline ran
        vs = "-" if own else f"{c['diff']:+.3f} ± {c['half']:.3f}"
        lines.append(
            f"| {c['lr']:g} | {c['source']} | {c['anchor']} | {_label(c)} | {c['n']} | {c['after']:.3f} | "
            f"{c['gain']:+.3f} | {vs} | {c['below']}/{c['n']} | {c['kl_update']:.4f} | {c['mismatch_kl']:.4f} |"
        )
    if all("adopt" in c for c in cells):
        lines += [
            "",
            f"| lr | source | anchor | loss | seeds | rate, step 1 | rate, last step | vs {baseline} (95% CI) | "
            f"step rate >= {threshold:g} | vs {baseline} (95% CI) | adopted |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in cells:
            (d, h), (dr, hr) = c["adopt_diff"], c["rate_diff"]
            own = (c["loss"], c["setting"]) == (baseline, "default")
            vs, vs_rate = ("-", "-") if own else (f"{d:+.1f} ± {h:.1f}", f"{dr:+.3f} ± {hr:.3f}")
            lines.append(
                f"| {c['lr']:g} | {c['source']} | {c['anchor']} | {_label(c)} | {c['n']} | {c['rate_first']:.3f} | "
                f"{c['rate_last']:.3f} | {vs_rate} | {c['adopt']:.1f} | {vs} | {c['adopted']}/{c['n']} |"
            )
    return "\n".join(lines)


def _best(by: dict[tuple, dict], candidates: Sequence[tuple], seeds: Sequence[int] | None = None) -> tuple | None:
    """Of `candidates` (run keys less the seed), the one with the highest mean final accuracy over `seeds` (default:
    every seed any of them ran; a candidate that lacks one of them is not one); ties go to the earlier candidate;
    None when there is none."""
    want = sorted({k[5] for k in by if k[:5] in candidates}) if seeds is None else list(seeds)
    best = None
    for c in candidates if want else ():
        if all((*c, s) in by for s in want):
            score = statistics.fmean(by[(*c, s)]["eval_after"] for s in want)
            if best is None or score > best[1]:
                best = (c, score)
    return best and best[0]


def _best_pair(by: dict[tuple, dict], a: Sequence[tuple], b: Sequence[tuple]) -> dict:
    """Two sets of candidates (run keys less the seed), each at its best (`_best`, by mean final accuracy): the
    paired difference a - b over the seeds both best ones ran, with its 95% interval; and, since a best-of-several
    chosen on the same seeds is optimistic, the same difference with each choice made leaving each seed out
    (chosen on the other seeds, scored on that one)."""
    best = (_best(by, a), _best(by, b))
    seeds = sorted(set.intersection(*({k[5] for k in by if k[:5] == c} for c in best)))
    diffs = [by[(*best[0], s)]["eval_after"] - by[(*best[1], s)]["eval_after"] for s in seeds]
    held_out = []
    for s in seeds:  # the choices made on the other seeds, scored on seed s
        others = {k: r for k, r in by.items() if k[5] != s}
        chosen = (_best(others, a), _best(others, b))
        if all(c is not None and (*c, s) in by for c in chosen):
            held_out.append(by[(*chosen[0], s)]["eval_after"] - by[(*chosen[1], s)]["eval_after"])
    return {
        "best_a": best[0], "best_b": best[1], "n": len(seeds),
        "after": statistics.fmean(by[(*best[0], s)]["eval_after"] for s in seeds),
        "after_baseline": statistics.fmean(by[(*best[1], s)]["eval_after"] for s in seeds),
        "diff": t_interval(diffs), "held_out": t_interval(held_out) if held_out else (math.nan, math.nan),
    }  # fmt: skip


def best_settings(rows: Sequence[dict], seeds: Sequence[int] | None = None) -> dict[tuple, str]:
    """Per (lr, source, anchor, loss): the setting with the highest mean final accuracy over `seeds` (default:
    every seed; settings that lack one of them are not candidates); ties go to the earlier setting."""
    by = by_run(rows)
    cells = sorted({k[:5] for k in by}, key=_cell_order)
    best = {g: _best(by, [c for c in cells if c[:4] == g], seeds) for g in dict.fromkeys(c[:4] for c in cells)}
    return {g: c[4] for g, c in best.items() if c is not None}


def best_vs_best(rows: Sequence[dict], loss: str = "troll", baseline: str = BASELINE) -> list[dict]:
    """Per (lr, source, anchor) where both losses ran more than one setting: each loss at its own best setting
    (`best_settings`, by mean final accuracy), the paired difference `loss` - `baseline` over seeds with its 95%
    interval, and the same with the settings chosen leaving each seed out (`_best_pair`)."""
    by, out = by_run(rows), []
    cells = sorted({k[:5] for k in by}, key=_cell_order)
    for lr, source, anchor in sorted({k[:3] for k in by}, key=lambda k: _cell_order((*k, loss, "default"))):
        a, b = ([c for c in cells if c[:4] == (lr, source, anchor, x)] for x in (loss, baseline))
        if min(len(a), len(b)) < 2:
            continue
        pair = _best_pair(by, a, b)
        out.append({"lr": lr, "source": source, "anchor": anchor, "loss": loss, "baseline": baseline,
                    "best": pair.pop("best_a")[4], "best_baseline": pair.pop("best_b")[4], **pair})  # fmt: skip
    return out


def lora_vs_full(rows: Sequence[dict], lora: str = "lora8", full: str = "default") -> list[dict]:
    """Per (source, anchor, loss) that ran both: LoRA (setting `lora`) at its own best learning rate against full
    fine-tuning (setting `full`) at its own, each by mean final accuracy over seeds; the paired difference LoRA -
    full over seeds with its 95% interval, and the same with both learning rates chosen leaving each seed out
    (`_best_pair`)."""
    by, out = by_run(rows), []
    cells = sorted({k[:5] for k in by}, key=_cell_order)  # learning rate first: ties go to the smaller one
    for source, anchor, loss in sorted({c[1:4] for c in cells}, key=lambda k: _cell_order((0, *k, full))):
        a, b = ([c for c in cells if c[1:] == (source, anchor, loss, x)] for x in (lora, full))
        if not (a and b):
            continue
        pair = _best_pair(by, a, b)
        out.append({"source": source, "anchor": anchor, "loss": loss, "lora": lora, "full": full,
                    "lr": pair.pop("best_a")[0], "lr_full": pair.pop("best_b")[0], **pair})  # fmt: skip
    return out


def report_best(rows: Sequence[dict], loss: str = "troll", baseline: str = BASELINE) -> str:
    """`best_vs_best` as markdown (empty when no cell swept both losses)."""
    cells = best_vs_best(rows, loss, baseline)
    if not cells:
        return ""
    lines = [
        f"| lr | source | anchor | {loss}: best setting | final acc | {baseline}: best setting | final acc | "
        "best - best (95% CI) | settings chosen without the seed (95% CI) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c['lr']:g} | {c['source']} | {c['anchor']} | {c['best']} | {c['after']:.3f} | "
            f"{c['best_baseline']} | {c['after_baseline']:.3f} | {c['diff'][0]:+.3f} ± {c['diff'][1]:.3f} | "
            f"{c['held_out'][0]:+.3f} ± {c['held_out'][1]:.3f} |"
        )
    return "\n".join(lines)


def report_lora(rows: Sequence[dict], lora: str = "lora8", full: str = "default") -> str:
    """LoRA against full fine-tuning as markdown: every learning rate of each, then `lora_vs_full` (empty when no
    cell ran both)."""
    pairs = lora_vs_full(rows, lora, full)
    if not pairs:
        return ""
    lines = [
        "| loss | source | method | lr | seeds | final acc | gain | below start | update KL | s / run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = paired(rows)
    for p in pairs:
        for method, setting, best in (("full", full, p["lr_full"]), ("LoRA", lora, p["lr"])):
            want = (p["source"], p["anchor"], p["loss"], setting)
            for c in (c for c in cells if (c["source"], c["anchor"], c["loss"], c["setting"]) == want):
                lr = f"**{c['lr']:g}**" if c["lr"] == best else f"{c['lr']:g}"  # the best in bold
                lines.append(
                    f"| {p['loss']} | {p['source']} | {method} ({setting}) | {lr} | {c['n']} | {c['after']:.3f} | "
                    f"{c['gain']:+.3f} | {c['below']}/{c['n']} | {c['kl_update']:.4f} | {c['wall_clock_s']:.0f} |"
                )
    lines += [
        "",
        "| loss | source | anchor | LoRA: best lr | final acc | full: best lr | final acc | seeds | "
        "LoRA - full (95% CI) | lrs chosen without the seed (95% CI) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        lines.append(
            f"| {p['loss']} | {p['source']} | {p['anchor']} | {p['lr']:g} | {p['after']:.3f} | {p['lr_full']:g} | "
            f"{p['after_baseline']:.3f} | {p['n']} | {p['diff'][0]:+.3f} ± {p['diff'][1]:.3f} | "
            f"{p['held_out'][0]:+.3f} ± {p['held_out'][1]:.3f} |"
        )
    return "\n".join(lines)


def plot_paired(rows: Sequence[dict], out: Path, stem: str = "offpolicy") -> Path:
    """One panel per learning rate: each loss's paired difference to PPO-clip, per cell, with its 95% interval."""
    from matplotlib.figure import Figure

    cells = [c for c in paired(rows) if c["loss"] != BASELINE and c["setting"] == "default"]
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
    return figures.save(fig, out / f"{stem}_paired.png")


def plot_settings(rows: Sequence[dict], out: Path, stem: str) -> Path:
    """One panel per cell: every (loss, setting)'s paired difference to PPO-clip at its default, 95% interval;
    each loss's best setting filled."""
    from matplotlib.figure import Figure

    cells, best = paired(rows), best_settings(rows)
    keys = list(dict.fromkeys((c["lr"], c["source"], c["anchor"]) for c in cells))
    fig = Figure(figsize=(11, 3.6 * len(keys)))
    for ax, key in zip(fig.subplots(len(keys), 1, squeeze=False)[:, 0], keys, strict=True):
        mine = [c for c in cells if (c["lr"], c["source"], c["anchor"]) == key]
        for i, c in enumerate(mine):
            chosen = best.get((*key, c["loss"])) == c["setting"]
            ax.errorbar([i], [c["diff"]], yerr=[0.0 if math.isnan(c["half"]) else c["half"]], fmt="o", capsize=3,
                        color=f"C{LOSSES.index(c['loss'])}", mfc=None if chosen else "white")  # fmt: skip
        ax.axhline(0.0, color="black", lw=0.8)
        ax.set_xticks(range(len(mine)), [_label(c).replace(" ", "\n") for c in mine], fontsize=8)
        ax.set_ylabel("final accuracy - PPO-clip's")
        ax.set_title(f"lr {key[0]:g}, {key[1]}, {key[2]}: paired difference to PPO-clip (0.2), 95% interval; "
                     "filled: the loss's best setting", fontsize=10)  # fmt: skip
    return figures.save(fig, out / f"{stem}_settings.png")


def plot_adoption(rows: Sequence[dict], out: Path, stem: str, threshold: float = THRESHOLD) -> Path:
    """One panel per cell: the share of each step's samples that show the rare behaviour, per loss and setting,
    mean over seeds with the seeds' range shaded."""
    from matplotlib.figure import Figure

    by = by_run(rows)
    keys = sorted({k[:3] for k in by}, key=lambda k: _cell_order((*k, "troll", "default")))
    fig = Figure(figsize=(6 * len(keys), 4))
    for ax, key in zip(fig.subplots(1, len(keys), squeeze=False)[0], keys, strict=True):
        variants = sorted({k[3:5] for k in by if k[:3] == key}, key=lambda v: _cell_order((*key, *v)))
        for j, (loss, setting) in enumerate(variants):
            curves = [r["behaviour_rate"] for k, r in by.items() if k[:5] == (*key, loss, setting)]
            steps = range(1, min(map(len, curves)) + 1)
            per_step = list(zip(*(c[: len(steps)] for c in curves), strict=True))
            label = loss if setting == "default" else f"{loss} {setting}"
            ax.plot(steps, [statistics.fmean(x) for x in per_step], color=f"C{j}", label=f"{label} ({len(curves)})")
            ax.fill_between(steps, [min(x) for x in per_step], [max(x) for x in per_step], color=f"C{j}", alpha=0.15)
        ax.axhline(threshold, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("RL step")
        ax.set_ylabel("share of samples with the rare behaviour")
        ax.set_title(f"lr {key[0]:g}, {key[1]}, {key[2]}: mean over seeds, range shaded", fontsize=10)
        ax.legend(fontsize=8)
    return figures.save(fig, out / f"{stem}_adoption.png")


def plot_lora(rows: Sequence[dict], out: Path, stem: str, lora: str = "lora8", full: str = "default") -> Path:
    """One panel per (source, anchor, loss) that ran both: final accuracy against the learning rate, full
    fine-tuning and LoRA, each seed a dot and the mean over seeds a line; the warm-starts' mean dashed."""
    from matplotlib.figure import Figure

    by = by_run(rows)
    keys = [(p["source"], p["anchor"], p["loss"]) for p in lora_vs_full(rows, lora, full)]
    fig = Figure(figsize=(6 * len(keys), 4))
    for ax, key in zip(fig.subplots(1, len(keys), squeeze=False)[0], keys, strict=True):
        for j, (label, setting) in enumerate((("full fine-tuning", full), (f"LoRA ({lora})", lora))):
            mine = {k: r for k, r in by.items() if k[1:5] == (*key, setting)}
            lrs = sorted({k[0] for k in mine})
            ax.scatter([k[0] for k in mine], [r["eval_after"] for r in mine.values()], s=12, color=f"C{j}", alpha=0.5)
            ax.plot(lrs, [statistics.fmean(r["eval_after"] for k, r in mine.items() if k[0] == lr) for lr in lrs],
                    "o-", color=f"C{j}", label=label)  # fmt: skip
        befores = [r["eval_before"] for k, r in by.items() if k[1:4] == key]
        ax.axhline(statistics.fmean(befores), color="gray", lw=0.8, ls="--", label="warm-start")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel("held-out accuracy after RL")
        ax.set_title(f"{key[2]}, {key[0]}: final accuracy per seed (dots) and mean", fontsize=10)
        ax.legend(fontsize=8)
    return figures.save(fig, out / f"{stem}_vs_full.png")


# ----------------------------------------------------------------------------- the command


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument(
        "--task",
        default="addition",
        choices=list(TASKS),
        help="the main job's task, or its rare-behaviour variant (troll.addition); default: %(default)s",
    )
    p.add_argument("--vocab_size", type=int, default=0,
                   help="the warm-start's tokenizer grown to this many tokens (troll.tiny.pad_vocab; 0: its 260); "
                   "default: %(default)s")  # fmt: skip
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
    args = p.parse_args(argv)
    for name in ("steps", "eval_size", "sft_steps", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.vocab_size and args.vocab_size < 260:
        p.error(f"--vocab_size must be 0 or >= 260 (the tiny tokenizer's size), got {args.vocab_size}")
    if not 0 < args.threshold <= 1:
        p.error(f"--threshold must be in (0, 1], got {args.threshold}")
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
            print(report(rows, args.baseline, args.threshold))
            if best := report_best(rows, "troll", args.baseline):
                print(f"\nEach loss at its own best setting (by mean final accuracy):\n{best}")
            if lora := report_lora(rows):
                print(f"\nLoRA against full fine-tuning, each at its own best learning rate:\n{lora}")
        if args.figures:  # <name>_paired.png, and _settings / _adoption / _vs_full where the rows have them
            stem, against = args.name, any(r["loss"] == BASELINE for r in rows)  # the first two: paired to PPO-clip
            if against:
                print(plot_paired(rows, Path(args.figures), stem))
            if against and any(setting_of(r) != "default" for r in rows):
                print(plot_settings(rows, Path(args.figures), stem))
            if all("behaviour_rate" in r for r in rows):
                print(plot_adoption(rows, Path(args.figures), stem, args.threshold))
            if lora_vs_full(rows):
                print(plot_lora(rows, Path(args.figures), stem))
        return rows
    runs, done = grid(args), read_results(Path(args.results))
    for run in runs:  # a run recorded, or in its folder, with other settings is not counted as done
        want = settings(asdict(config(run, args)))
        path = Path(args.out) / run.name / "config.json"
        recorded = done[run.name]["config"] if run.name in done else None
        for where, saved in ((args.results, recorded and settings(recorded)), (path, _read_config(path))):
            if saved is not None and saved != want:
                changed = sorted(k for k in want if saved.get(k) != want[k])
                usage_error(f"{run.name} ({where}) was run with other settings ({', '.join(changed)})", PROG)
    for seed in sorted({r.seed for r in runs}):  # a warm-start made for another task or step limit is not this study's
        record = _read_config(warm_dir(args, seed) / "warm.json")
        made = {"sft_steps": "sft_limit", "task": "task", "vocab_size": "vocab_size"}
        old = {"task": "addition", "vocab_size": 0}  # warm-starts made before these were recorded
        for flag, key in made.items() if record is not None else ():
            if (was := record.get(key, old.get(key))) != getattr(args, flag):
                usage_error(f"{warm_dir(args, seed)} was warm-started with --{flag} {was}", PROG)
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
    run_command(PROG, main)
