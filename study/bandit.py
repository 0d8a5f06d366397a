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
- Policy: a table of logits [C, V] in float32 (the trainer's precision), one row (a next-token distribution) per
  context, trained by Adam (no weight decay, betas (0.9, 0.999), one optimiser for the whole run, as the trainer).
- Initial rows: Zipf, p(rank k) proportional to k^-1.35 over k = 1..V: a long-tailed, high-entropy position (at
  V = 32,000 the top token has 0.30, the top 64 hold 83% of the mass, entropy 4.0 nats), the kind of position
  where RL's choice of token matters. Each context and seed places the ranks on its own random permutation of the
  ids (which changes nothing for the losses, all of which treat ids alike); the shape is the same for every seed.
- One rewarded ("good") token per context, at the rank whose initial probability is closest to each of TARGETS:
  0.3, 0.05, 0.005, 1e-3, 1e-4 (ranks 1, 4, 21, 68, 372 at V = 32,000), so C = 5 contexts per run.
- An RL step: G = 64 samples per context (`--samples`) from the current table by inverse-CDF sampling with
  uniforms from a generator seeded by (seed, step) (`draws`), so every variant of a seed starts from the same table
  and sees the same random numbers: identical samples while the policies agree, and the same noisy rewards for
  the same samples. Rewards, then GRPO advantages per context (troll.advantages.grpo). A context whose rewards are
  all equal carries no signal (every advantage 0) and is left out of the batch, as DAPO's dynamic sampling does
  (without drawing replacements; a step with no signal anywhere makes no update): the V-sized work goes to the
  contexts that teach something. Then the old policy as the trainer builds it (troll.sparse.sparsify, K = 64,
  delta = 1e-5: the rest model), then `passes` Adam steps on the whole batch with the loss (troll.losses,
  token-mean over the batch, each loss's own defaults but its setting).
- Rewards: `clean` pays 1 for the good token, 0 for any other. `noisy` pays the good token 1 with probability 0.6
  and a decoy, the neighbouring rank (one rank more likely; the second for a top-ranked good token), 1 with
  probability 0.4. In the few samples a rare token gets, the decoy looks as good as the good token about half the
  time, and it starts more likely; a loss that moves fast on little evidence can put most of the mass on the
  decoy before the good token is seen, after which the good token is hardly sampled again. So moving fast can
  cost, and speed alone does not win.
- Measured per run: p(good) per context after every step; the steps until p(good) >= THRESHOLD = 0.5 (censored:
  steps + 1 when it never does); the policy's expected reward after every step (mean over contexts; the best is 1
  clean, 0.6 noisy) and its mean over the run (`auc`: speed and level in one number); the exact KL(p_new || p_old)
  of each step's update over all V (troll.diagnostics.dense_kl, float64) per context; and collapse: a context
  ends with a token other than the good one holding more than half of the mass and the good token below its
  initial probability (or a non-finite logit, which ends the run).
- Variants (`VARIANTS`): TROLL with eps 0.01, 0.02, 0.05, 0.1, 0.2; PPO-clip with range 0.1, 0.2, 0.3 and
  Clip-Higher (0.2 / 0.28); DPPO (Binary-TV) with its ratio cap at the authors' 10 (`dppo`), 2 (`dppo-cap2`:
  this project's before the cap was a setting) and 20 (verl's); CISPO with eps_high 0.2 (cap 1.2, verl's), 1 and 5.
  The project's defaults: troll-0.05 and clip-0.2.
- Cells (`CELLS`; which variants run in each: `CELL_VARIANTS`, sized to the 2 shared cores): `issue` (clean
  reward, 4 passes per batch, lr 0.1, V = 32,000: the issue's own trial) with every variant; `noisy` (its noisy
  reward) with TROLL eps 0.01, 0.05, 0.2, every PPO-clip, DPPO and CISPO setting; `qwen` (the issue cell at Qwen's
  V = 151,936, five times the work per run) with TROLL and PPO-clip at their defaults; `passes1` (1 pass),
  `lr-high` (lr 0.3) and `noisy-lr-high` (the noisy reward at lr 0.3) with TROLL, PPO-clip, CISPO and DPPO at
  their defaults. 20 RL steps per run, seeds 0-4: 210 runs.
- Results (`--results`, JSONL): one row per run, merged by name after every run; a run recorded with other
  settings is refused, not counted. `--jobs N` (N > 1) runs N spawned worker processes with cores / N threads
  each (study/runner.py); one job runs in this process.
- Report: per cell and variant, means over seeds and paired differences to PPO-clip 0.2 (`BASELINE`) on the same
  seed with 95% t-intervals (study.runner.t_interval) of the focus context's steps to the threshold (the good
  token at 0.005, the issue's rank 20) and of `auc`; then best against best: each loss at its own best setting in
  the cell (the highest mean `auc`), paired with the best PPO-clip setting (Clip-Higher included).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from study.runner import (
    paired_diffs,
    plan,
    read_results,
    refuse_other_settings,
    report_rows,
    run_all,
    save,
    t_interval,
    workers,
)
from troll.cli import run_command

TARGETS = (0.3, 0.05, 0.005, 1e-3, 1e-4)  # the good token's initial probability, one context each
FOCUS = 2  # the context reported in the table: the good token at 0.005 (rank 21 of 32,000; the issue's rank 20)
ZIPF = 1.35
THRESHOLD = 0.5
NOISY = (0.6, 0.4)  # noisy reward: P(pay 1) for the good token and for the decoy
K, DELTA = 64, 1e-5  # the trainer's sparse old policy
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
    "dppo": ("dppo", {"divergence": "binary_tv", "ratio_cap": 10.0}),  # the authors' cap c
    "dppo-cap2": ("dppo", {"divergence": "binary_tv", "ratio_cap": 2.0}),
    "dppo-cap20": ("dppo", {"divergence": "binary_tv", "ratio_cap": 20.0}),  # verl's
    "cispo": ("cispo", {"eps_high": 0.2}),  # verl's
    "cispo-1": ("cispo", {"eps_high": 1.0}),
    "cispo-5": ("cispo", {"eps_high": 5.0}),  # SkyRL's example
}
DEFAULTS = ("troll-0.05", "clip-0.2", "clip-higher", "dppo", "cispo")  # each loss at the project's setting
BASELINE = "clip-0.2"
SEEDS = (0, 1, 2, 3, 4)
PROG = "python -m study.bandit"


@dataclass(frozen=True)
class Cell:
    reward: str  # "clean" or "noisy"
    passes: int  # Adam steps on each batch
    lr: float
    vocab: int


CELLS = {
    "issue": Cell("clean", 4, 0.1, 32_000),
    "noisy": Cell("noisy", 4, 0.1, 32_000),
    "qwen": Cell("clean", 4, 0.1, 151_936),
    "passes1": Cell("clean", 1, 0.1, 32_000),
    "lr-high": Cell("clean", 4, 0.3, 32_000),
    "noisy-lr-high": Cell("noisy", 4, 0.3, 32_000),
}
NOISY_SWEEP = ("troll-0.01", "troll-0.05", "troll-0.2", "clip-0.1", "clip-0.2", "clip-0.3", "clip-higher")
BASELINE_SWEEP = ("dppo", "dppo-cap2", "dppo-cap20", "cispo", "cispo-1", "cispo-5")
NOISY_SWEEP += BASELINE_SWEEP
SMALL = ("troll-0.05", "clip-0.2", "cispo", "dppo")
CELL_VARIANTS = {"noisy": NOISY_SWEEP, "qwen": SMALL[:2], "passes1": SMALL, "lr-high": SMALL, "noisy-lr-high": SMALL}


@dataclass(frozen=True)
class Run:
    cell: str
    variant: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.cell}_{self.variant}_s{self.seed}"


# ----------------------------------------------------------------------------- the bandit


def initial_table(vocab: int, seed: int, targets: Sequence[float] = TARGETS) -> dict:
    """The initial logits [C, V] (float32, Zipf rows, ids permuted per context and seed), the good and decoy token ids
    [C], their ranks (1-based) and the good token's initial probability [C] (module docstring)."""
    import torch

    logp = -ZIPF * torch.arange(1, vocab + 1, dtype=torch.float64).log()
    logp = logp - logp.logsumexp(0)
    ranks = [int((logp.exp() - t).abs().argmin()) + 1 for t in targets]
    decoys = [r - 1 if r > 1 else 2 for r in ranks]
    gen = torch.Generator().manual_seed(seed)
    perms = torch.stack([torch.randperm(vocab, generator=gen) for _ in targets])  # perms[c, k - 1]: id of rank k
    table = torch.empty(len(targets), vocab, dtype=torch.float64).scatter_(1, perms, logp.expand(len(targets), -1))
    rows = torch.arange(len(targets))
    return {
        "table": table.float(),
        "good": perms[rows, torch.tensor(ranks) - 1],
        "decoy": perms[rows, torch.tensor(decoys) - 1],
        "ranks": ranks,
        "decoy_ranks": decoys,
        "q0": [float(logp[r - 1].exp()) for r in ranks],
    }


def draws(seed: int, step: int, contexts: int, samples: int):
    """The step's uniforms [C, G] for sampling and for the noisy rewards: a function of (seed, step) only."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    u = torch.rand(2, contexts, samples, generator=gen, dtype=torch.float64)
    return u[0], u[1]


def sample(logp, u):
    """Inverse-CDF samples [C, G] from log-probs [C, V] with uniforms u [C, G] (float64)."""
    import torch

    cdf = logp.double().exp().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_max(logp.shape[-1] - 1)


def rewards(tokens, good, decoy, u, reward: str):
    """Rewards [C, G] of the samples (module docstring): clean 1[good]; noisy Bernoulli(0.6) / Bernoulli(0.4)."""
    hit = tokens == good[:, None]
    if reward == "clean":
        return hit.double()
    return ((hit & (u < NOISY[0])) | ((tokens == decoy[:, None]) & (u < NOISY[1]))).double()


def expected_reward(logp, good, decoy, reward: str) -> float:
    """The policy's expected reward, mean over contexts (logp [C, V])."""
    p = logp.exp()
    rows = range(p.shape[0])
    if reward == "clean":
        return float(p[rows, good].mean())
    return float((NOISY[0] * p[rows, good] + NOISY[1] * p[rows, decoy]).mean())


def bandit(cell: Cell, variant: str, seed: int, steps: int = 20, samples: int = 64, trace: bool = False) -> dict:
    """One run (module docstring); returns its measurements (the results row without its name and settings).
    With `trace`, also "trace": per step the samples [C, G] and the log-probs [C, V] before and after the update."""
    import torch

    from troll.advantages import grpo
    from troll.diagnostics import dense_kl
    from troll.losses import LOSSES
    from troll.sparse import sparsify

    start = time.time()
    loss_name, kwargs = VARIANTS[variant]
    init = initial_table(cell.vocab, seed)
    good, decoy = init["good"], init["decoy"]
    table = init["table"].clone().requires_grad_(True)
    opt = torch.optim.Adam([table], lr=cell.lr)
    c = table.shape[0]
    ctx = torch.arange(c).repeat_interleave(samples)  # row i of the batch is a sample of context ctx[i]
    logp = table.detach().double().log_softmax(-1)
    p_good = [[float(x)] for x in logp.exp()[range(c), good]]
    reward_curve = [expected_reward(logp, good, decoy, cell.reward)]
    kl_mean, kl_max, kl_ctx, active, finite, steps_trace = [], [], [], [], True, []
    for step in range(steps):
        u_tok, u_rew = draws(seed, step, c, samples)
        tokens = sample(logp, u_tok)
        r = rewards(tokens, good, decoy, u_rew, cell.reward)
        signal = (r != r[:, :1]).any(-1)  # the contexts whose group has some reward variance
        rows = signal[ctx]
        if bool(rows.any()):  # a step without any signal makes no update (nothing to learn from)
            adv = grpo(r.reshape(-1)[rows], ctx[rows])
            y = tokens.reshape(-1)[rows]
            with torch.no_grad():
                old = sparsify(table.detach()[ctx[rows]], y, k=K, delta=DELTA)
            mask = torch.ones(len(y), 1, dtype=torch.bool)
            for _ in range(cell.passes):
                logits = table[ctx[rows]].unsqueeze(1)  # [B, 1, V]: each sample is a one-token response
                loss, metrics = LOSSES[loss_name](logits, y[:, None], mask, adv, old, **kwargs)
                opt.zero_grad()
                loss.backward()
                opt.step()
                active.append(metrics["frac_active"])
        new = table.detach().double().log_softmax(-1)
        if not bool(torch.isfinite(table).all()):
            finite = False
            break
        if trace:
            steps_trace.append({"tokens": tokens, "logp_old": logp, "logp_new": new})
        kl = dense_kl(new, logp)  # [C]: the exact KL of this step's update, over all V
        kl_mean.append(float(kl.mean()))
        kl_max.append(float(kl.max()))
        kl_ctx.append([float(x) for x in kl])
        logp = new
        for i, x in enumerate(logp.exp()[range(c), good]):
            p_good[i].append(float(x))
        reward_curve.append(expected_reward(logp, good, decoy, cell.reward))
    p_final = logp.exp()
    top = p_final.max(-1)
    other_top = (top.indices != good) & (top.values > 0.5)
    collapsed = [not finite or bool(o and p_final[i, good[i]] < init["q0"][i]) for i, o in enumerate(other_top)]
    steps_to = [next((s for s, p in enumerate(curve) if p >= THRESHOLD), steps + 1) for curve in p_good]

    def r6(x):  # six significant digits: the results file stays small
        return [r6(v) for v in x] if isinstance(x, list) else float(f"{x:.6g}")

    return {
        "ranks": init["ranks"],
        "decoy_ranks": init["decoy_ranks"],
        "q0": init["q0"],
        "p_good": r6(p_good),
        "steps_to": steps_to,
        "reward_curve": r6(reward_curve),
        "auc": statistics.fmean(reward_curve),
        "final": reward_curve[-1],
        "kl_update_mean": r6(kl_mean),
        "kl_update_max": r6(kl_max),
        "kl_update_ctx": r6(kl_ctx),
        "frac_active_mean": statistics.fmean(active) if active else math.nan,
        "collapsed": collapsed,
        "finite": finite,
        "wall_s": round(time.time() - start, 2),
    } | ({"trace": steps_trace} if trace else {})


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


def _pm(d: float, h: float, fmt: str = "+.3f") -> str:
    return f"{d:{fmt}} ± {h:.3f}" if not math.isnan(d) else "-"


def report(rows: Sequence[dict], baseline: str = BASELINE) -> str:
    """The paired table and the best-against-best table as markdown."""
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
            f"{'-' if base else _pm(c['d_steps'], c['h_steps'], '+.1f')} | {c['auc']:.3f} | "
            f"{'-' if base else _pm(c['d_auc'], c['h_auc'])} | {c['final']:.3f} | {c['kl_mean']:.4f} | "
            f"{c['kl_max']:.3f} | {c['collapsed']}/{c['n']} |"
        )
    lines += [
        "",
        "| cell | loss | its best setting | auc | vs the best PPO-clip (95% CI) | steps: vs the best PPO-clip |",
        "|---|---|---|---|---|---|",
    ]
    for b in best_vs_best(rows):
        vs = "-" if b["loss"] == "ppo_clip" else _pm(b["d_auc"], b["h_auc"])
        steps = "-" if b["loss"] == "ppo_clip" else _pm(b["d_steps"], b["h_steps"], "+.1f")
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
    return save(fig, out / "bandit_steps.png")


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
    return save(fig, out / "bandit_curves.png")


# ----------------------------------------------------------------------------- the command


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
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
    args = p.parse_args(argv)
    for name in ("steps", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
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
    return args


def progress(row: dict) -> str:
    """A finished run's line: the steps to the threshold per context, auc and time."""
    return f"{row['name']}: steps to {THRESHOLD} {row['steps_to']}, auc {row['auc']:.3f}, {row['wall_s']:.1f} s"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse(argv)
    if args.report or args.figures:
        rows = report_rows(Path(args.results), PROG)
        if args.report:
            print(report(rows))
        if args.figures:
            print(plot_steps(rows, Path(args.figures)))
            if any(r["cell"] == "issue" for r in rows):
                print(plot_curves(rows, Path(args.figures)))
        return rows
    runs, done = grid(args), read_results(Path(args.results))
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
