"""The off-policy study's grid (design: study/offpolicy.py): its sources of off-policy data, anchors, settings and
losses, what one run is (`Run`), the order of the runs (`grid`) and each run's troll.train config (`config`)."""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from pathlib import Path

from study.runner import ACCURACY, FLOAT, LR, NAME, SEED, one_of
from troll.base.config import Config
from troll.base.schema import Spec

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
    # DPPO's ratio cap c (default 10, Stable-RL's fallback; 2 is what this project ran before it was a setting, 20
    # verl's fallback, 10000 verl's DPPO example: no cap in effect; docs/algorithm.md, section 6) and CISPO's
    # eps_high (default 0.2, verl's; the cap is 1 + eps_high, and the MiniMax-M1 paper tunes only this bound)
    **{f"cap{c:g}": ("dppo", dict(dppo_cap=float(c))) for c in (2, 20, 10000)},
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
TASKS = ("addition", "rare")  # --task: the main job's, or its variant whose rewarded format starts rare
THRESHOLD = 0.5  # the rare task's adoption: the first RL step whose samples show the behaviour this often
# What a results row holds that the report reads, as declared (study.runner.check_rows). A row's "setting" is
# optional: rows written before settings existed ran the default (`setting_of`); so are the run's time and, but for
# the rare task's runs, the share of samples that show its behaviour after each step.
FIELDS = {
    "name": NAME, "lr": LR, "seed": SEED, "source": one_of(SOURCES), "anchor": one_of(ANCHORS),
    "loss": one_of(LOSSES), "setting": one_of(SETTINGS, required=False), "eval_before": ACCURACY,
    "eval_after": ACCURACY, "kl_update_mean": FLOAT, "mismatch_kl": FLOAT,
    "wall_clock_s": Spec("number", low=0, required=False),
    "behaviour_rate": Spec("number", low=0, high=1, per_token=True, per="step", required=False),
}  # fmt: skip
# The list flags and each run's value of them (study.runner.grid_problem: no value twice, none that makes no run)
FLAGS = {
    "lrs": lambda run: run.lr, "seeds": lambda run: run.seed, "sources": lambda run: run.source,
    "anchors": lambda run: run.anchor, "losses": lambda run: run.loss, "settings": lambda run: run.setting,
}  # fmt: skip


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
