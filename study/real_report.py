"""The real-model study's analysis (design: study/real.py): each loss's best learning rate over the sweep seeds
(`best_lr`), each loss at its best against PPO-clip at its own, paired over seeds with a 95% t-interval, and the same
with the lrs chosen without the seed they are scored on (`compare`), said in words (`verdict`), each loss at its best
lr and the larger ones it ran (`stability`), and the report's markdown (`report`: per loss and lr, the paired
comparisons, the stability table). An interval that contains 0 is said to be noise.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from study.runner import paired_diffs, pm, t_interval

LOSSES = ("troll", "ppo_clip", "dppo", "cispo")
BASELINE = "ppo_clip"


def best_lr(rows: Sequence[dict], loss: str, without: int | None = None) -> tuple[float, list[int]] | None:
    """The loss's best lr in `rows` and the seeds that chose it: of the lrs it ran, the one with the highest mean
    held-out accuracy after RL over the seeds that ran every one of them (the sweep seeds; `without`: that seed
    left out); ties go to the smaller lr. None when no such seed is left. The stability runs (`stage`) do not
    choose: they run where the sweep chose."""
    after = {(r["lr"], r["seed"]): r["eval_after"] for r in rows if r["loss"] == loss and r.get("stage") != "stability"}
    lrs = sorted({lr for lr, _ in after})
    seeds = sorted({s for _, s in after if s != without and all((lr, s) in after for lr in lrs)})
    if not seeds:
        return None
    score = {lr: statistics.fmean(after[lr, s] for s in seeds) for lr in lrs}
    return max(lrs, key=lambda lr: (score[lr], -lr)), seeds


def compare(rows: Sequence[dict], loss: str, baseline: str = BASELINE) -> dict | None:
    """`loss` at its best lr against `baseline` at its own (`best_lr`): the mean paired difference in held-out
    accuracy after RL over the seeds both ran, with its 95% t-interval, and the same with both lrs chosen without
    each seed (scored on that seed only); their seconds per step. None when either has no best lr."""
    best = {x: best_lr(rows, x) for x in (loss, baseline)}
    if None in best.values():
        return None

    def at(x: str, lr: float) -> dict[int, dict]:
        return {r["seed"]: r for r in sorted(rows, key=lambda r: r["seed"]) if (r["loss"], r["lr"]) == (x, lr)}

    (a, a_seeds), (b, b_seeds) = best[loss], best[baseline]
    mine, base = at(loss, a), at(baseline, b)
    diffs = paired_diffs({s: r["eval_after"] for s, r in mine.items()}, {s: r["eval_after"] for s, r in base.items()})
    held_out = []
    for seed in sorted({r["seed"] for r in rows}):
        picks = [best_lr(rows, x, without=seed) for x in (loss, baseline)]
        if None not in picks:
            pair = [at(x, pick[0]).get(seed) for x, pick in zip((loss, baseline), picks, strict=True)]
            if None not in pair:
                held_out.append(pair[0]["eval_after"] - pair[1]["eval_after"])
    paired = sorted(set(mine) & set(base))
    return {
        "loss": loss, "baseline": baseline, "lr": a, "lr_baseline": b, "chosen_on": a_seeds,
        "chosen_on_baseline": b_seeds, "n": len(diffs), "diff": t_interval(diffs) if diffs else (math.nan, math.nan),
        "held_out_n": len(held_out), "held_out": t_interval(held_out) if held_out else (math.nan, math.nan),
        "after": statistics.fmean(mine[s]["eval_after"] for s in paired) if paired else math.nan,
        "after_baseline": statistics.fmean(base[s]["eval_after"] for s in paired) if paired else math.nan,
        "step_s": statistics.fmean(r["step_s"] for r in mine.values()),
        "step_s_baseline": statistics.fmean(r["step_s"] for r in base.values()),
    }  # fmt: skip


def verdict(diff: float, half: float, n: int, loss: str, baseline: str) -> str:
    """What a paired difference and its 95% half-width say, in words."""
    if n == 0:
        return "no seed to pair"
    if math.isnan(half):
        return "nothing to conclude"
    if diff - half <= 0 <= diff + half:
        return f"the interval contains 0: noise, no difference between {loss} and {baseline} shown"
    return f"the interval excludes 0: {loss if diff > 0 else baseline} ahead"


def entropy(run: dict, last: bool) -> float:
    """The policy's mean entropy (nats) over a run's first 10 steps, or its last 10; nan where not recorded."""
    values = run.get("per_step", {}).get("entropy", [])
    values = values[-10:] if last else values[:10]
    return statistics.fmean(values) if values else math.nan


def stability(rows: Sequence[dict], best: dict[str, float]) -> list[str]:
    """Each loss at its best lr and every larger lr it ran, as markdown rows: the multiple of the best lr, the seeds,
    held-out accuracy after RL with its 95% t-interval over seeds, the runs that end below their start, and the
    entropy over the first and the last 10 steps (means over seeds)."""
    lines = []
    for loss in sorted(best, key=LOSSES.index):
        for lr in sorted({r["lr"] for r in rows if r["loss"] == loss and r["lr"] >= best[loss]}):
            runs = sorted((r for r in rows if (r["loss"], r["lr"]) == (loss, lr)), key=lambda r: r["seed"])
            first, last = (statistics.fmean(entropy(r, end) for r in runs) for end in (False, True))
            lines.append(
                f"| {loss} | {lr:g} | {lr / best[loss]:g}x | {','.join(str(r['seed']) for r in runs)} | "
                f"{pm(*t_interval([r['eval_after'] for r in runs]), fmt='.3f')} | "
                f"{sum(r['eval_after'] < r['eval_before'] for r in runs)}/{len(runs)} | {first:.3f} -> {last:.3f} |"
            )
    return lines


def seeds_text(n: int) -> str:
    return f"{n} seed{'' if n == 1 else 's'}"


def report(rows: Sequence[dict], models: Sequence[str]) -> str:
    """`report_model` for each of `models` the rows hold (one section each where there are several)."""
    models = [m for m in models if any(r["model"] == m for r in rows)]
    if len(models) == 1:
        return report_model(rows)
    return "\n\n".join(f"## {m}\n\n{report_model([r for r in rows if r['model'] == m])}" for m in models)


def report_model(rows: Sequence[dict]) -> str:
    """The per-run table (loss, lr) and each loss at its best lr against PPO-clip at its own, as markdown."""
    cells: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (LOSSES.index(r["loss"]), r["lr"], r["seed"])):
        cells.setdefault((r["loss"], r["lr"]), []).append(r)
    best = {loss: b[0] for loss in {r["loss"] for r in rows} if (b := best_lr(rows, loss))}

    def mean(runs: list[dict], key: str) -> str:
        values = [r[key] for r in runs if key in r]
        return f"{statistics.fmean(values):.4f}" if len(values) == len(runs) else "-"

    lines = [
        "| loss | lr | seeds | before | after | gain | below start | s / step | frac active | KL(p‖q) before | "
        "KL(p‖q) after | update KL |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (loss, lr), runs in cells.items():
        mark = " (best)" if best.get(loss) == lr else ""
        lines.append(
            f"| {loss} | {lr:g}{mark} | {','.join(str(r['seed']) for r in runs)} | "
            f"{statistics.fmean(r['eval_before'] for r in runs):.3f} | "
            f"{statistics.fmean(r['eval_after'] for r in runs):.3f} | "
            f"{statistics.fmean(r['eval_after'] - r['eval_before'] for r in runs):+.3f} | "
            f"{sum(r['eval_after'] < r['eval_before'] for r in runs)}/{len(runs)} | "
            f"{statistics.fmean(r['step_s'] for r in runs):.1f} | {mean(runs, 'frac_active')} | "
            f"{mean(runs, 'kl_before_mean')} | {mean(runs, 'kl_after_mean')} | {mean(runs, 'kl_update_mean')} |"
        )
    lines += ["", "Each loss at its own best lr (the highest mean held-out accuracy after RL over the seeds that ran "
              "every lr; 95% t-intervals over seeds):"]  # fmt: skip
    others = [x for x in LOSSES if x != BASELINE and x in best]
    if BASELINE not in best:
        lines.append(f"- no {BASELINE} run with a best lr in these results: nothing to pair with")
    for loss in others if BASELINE in best else ():
        c = compare(rows, loss)
        (d, h), (dh, hh) = c["diff"], c["held_out"]
        seeds = ",".join(map(str, c["chosen_on"]))
        lines += [
            f"- {loss} at lr {c['lr']:g} - {BASELINE} at lr {c['lr_baseline']:g} (chosen on seeds {seeds}), "
            f"{seeds_text(c['n'])}: {c['after']:.3f} - {c['after_baseline']:.3f} = {pm(d, h)}: "
            f"{verdict(d, h, c['n'], loss, BASELINE)}",
            f"  - lrs chosen without the seed they are scored on, {seeds_text(c['held_out_n'])}: {pm(dh, hh)}: "
            f"{verdict(dh, hh, c['held_out_n'], loss, BASELINE)}",
            f"  - seconds per RL step at those lrs: {loss} {c['step_s']:.1f}, {BASELINE} {c['step_s_baseline']:.1f}",
        ]
    if best:
        lines += ["", "Stability: each loss at its best lr and the larger lrs it ran (held-out accuracy after RL, 95% "
                  "t-interval over seeds; runs that end below their start; entropy, nats, first 10 -> last 10 steps):",
                  "", "| loss | lr | x best | seeds | after | below start | entropy |", "|---|---|---|---|---|---|---|",
                  *stability(rows, best)]  # fmt: skip
    return "\n".join([*lines, "", cost(rows)])


def cost(rows: Sequence[dict]) -> str:
    """The study's cost: its runs' wall and CPU time summed, with how many runs recorded each."""

    def hours(key: str, what: str) -> str:
        seconds = [r[key] for r in rows if key in r]
        if not seconds:
            return f"{what} time not recorded"
        return f"{sum(seconds) / 3600:.2f} {what} hours" + (
            f" ({len(seconds)} of the runs recorded it)" if len(seconds) < len(rows) else ""
        )

    return (
        f"Cost: {len(rows)} runs, {hours('wall_clock_s', 'wall')} and {hours('cpu_s', 'CPU')}, summed over runs "
        "(warm-starts not counted)."
    )
