"""The off-policy study's analysis (design: study/offpolicy.py): per cell and loss, the paired differences to a
baseline loss with their 95% t-intervals (`paired`, `report`), each loss at its own best setting (`best_vs_best`),
LoRA against full fine-tuning each at its own best learning rate (`lora_vs_full`), and their figures."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from study.offpolicy_grid import ANCHORS, BASELINE, LOSSES, SETTINGS, SOURCES, THRESHOLD, setting_of
from study.runner import paired_diffs, pm, save, t_interval

MARK = "study.offpolicy"  # its figures carry the PNG text Software=study.offpolicy: its own (troll.base.outputs)


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


def _vs(runs: Sequence[dict], base: dict[int, dict], value: Callable[[dict], float]) -> tuple[float, float]:
    """Mean and 95% half-width of value(run) - value(the baseline's run of its seed) over the seeds both ran; nan
    for both when they share none."""
    return t_interval(paired_diffs({r["seed"]: value(r) for r in runs}, {s: value(b) for s, b in base.items()})
                      or [math.nan])  # fmt: skip


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
        mean, half = _vs(runs, base, lambda r: r["eval_after"])
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
            steps = [adoption_step(r, threshold) for r in runs]
            c |= {
                "rate_first": statistics.fmean(r["behaviour_rate"][0] for r in runs),
                "rate_last": statistics.fmean(r["behaviour_rate"][-1] for r in runs),
                "adopt": statistics.fmean(steps),
                "adopted": sum(r["behaviour_rate"][-1] >= threshold for r in runs),
                "adopt_diff": _vs(runs, base, lambda r: adoption_step(r, threshold)),
                "rate_diff": _vs(runs, base, lambda r: r["behaviour_rate"][-1]),
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
        vs = "-" if (c["loss"], c["setting"]) == (baseline, "default") else pm(c["diff"], c["half"])
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
            vs, vs_rate = ("-", "-") if own else (pm(d, h, "+.1f", ".1f"), pm(dr, hr))
            lines.append(
                f"| {c['lr']:g} | {c['source']} | {c['anchor']} | {_label(c)} | {c['n']} | {c['rate_first']:.3f} | "
                f"{c['rate_last']:.3f} | {vs_rate} | {c['adopt']:.1f} | {vs} | {c['adopted']}/{c['n']} |"
            )
    if note := missing_baseline(rows, baseline):
        lines += ["", note]
    return "\n".join(lines)


def missing_baseline(rows: Sequence[dict], baseline: str = BASELINE) -> str:
    """Which cells (lr, source, anchor) have no run of the baseline loss at its default setting, whose paired
    columns the report leaves "-", as a sentence; empty when every cell has one."""
    cells = list(dict.fromkeys(k[:3] for k in sorted(by_run(rows), key=lambda k: _cell_order(k[:5]))))
    have = {k[:3] for k in by_run(rows) if k[3:5] == (baseline, "default")}
    if not (missing := [c for c in cells if c not in have]):
        return ""
    if not have:
        losses = ", ".join(x for x in LOSSES if any(r["loss"] == x for r in rows))
        return (f"No {baseline} run at its default setting in these results: the paired columns are '-' "
                f"(--baseline picks the loss to pair with; these rows ran {losses}).")  # fmt: skip
    where = "; ".join(f"lr {lr:g} {source} {anchor}" for lr, source, anchor in missing)
    return f"No {baseline} run at its default setting in {where}: the paired columns there are '-'."


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
            f"{c['best_baseline']} | {c['after_baseline']:.3f} | {pm(*c['diff'])} | {pm(*c['held_out'])} |"
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
            f"{p['after_baseline']:.3f} | {p['n']} | {pm(*p['diff'])} | {pm(*p['held_out'])} |"
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
    return save(fig, out / f"{stem}_paired.png", MARK)


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
    return save(fig, out / f"{stem}_settings.png", MARK)


STYLES = ("-", "--", ":", "-.", (0, (5, 1)), (0, (1, 3)))  # a loss's settings in order, its default first


def plot_adoption(rows: Sequence[dict], out: Path, stem: str, threshold: float = THRESHOLD) -> Path:
    """One panel per cell: the share of each step's samples that show the rare behaviour, per loss (a colour) and
    setting (a line style: the default solid), mean over seeds; the seeds' range shaded for each default."""
    from matplotlib.figure import Figure

    by = by_run(rows)
    keys = sorted({k[:3] for k in by}, key=lambda k: _cell_order((*k, "troll", "default")))
    fig = Figure(figsize=(6 * len(keys), 4))
    for ax, key in zip(fig.subplots(1, len(keys), squeeze=False)[0], keys, strict=True):
        variants = sorted({k[3:5] for k in by if k[:3] == key}, key=lambda v: _cell_order((*key, *v)))
        losses = list(dict.fromkeys(loss for loss, _ in variants))
        for loss, setting in variants:
            curves = [r["behaviour_rate"] for k, r in by.items() if k[:5] == (*key, loss, setting)]
            steps = range(1, min(map(len, curves)) + 1)
            per_step = list(zip(*(c[: len(steps)] for c in curves), strict=True))
            label = loss if setting == "default" else f"{loss} {setting}"
            colour, style = (
                f"C{losses.index(loss)}",
                STYLES[[v for v in variants if v[0] == loss].index((loss, setting))],
            )
            ax.plot(
                steps, [statistics.fmean(x) for x in per_step], color=colour, ls=style, label=f"{label} ({len(curves)})"
            )
            if setting == "default":
                ax.fill_between(steps, [min(x) for x in per_step], [max(x) for x in per_step], color=colour, alpha=0.12)
        ax.axhline(threshold, color="gray", lw=0.8, ls="--")
        ax.set_xlabel("RL step")
        ax.set_ylabel("share of samples with the rare behaviour")
        ax.set_title(f"lr {key[0]:g}, {key[1]}, {key[2]}: mean over seeds, the defaults' range shaded", fontsize=10)
        ax.legend(fontsize=8)
    return save(fig, out / f"{stem}_adoption.png", MARK)


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
    return save(fig, out / f"{stem}_vs_full.png", MARK)
