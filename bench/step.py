"""One full RL step with TROLL (each sparse model) vs with PPO-clip: rollout, scoring, old-policy pass, update, sync.

    .venv/bin/python bench/step.py                                  # tiny-cpu preset, HF backend, 10 rounds
    .venv/bin/python bench/step.py --backend vllm --repeats 6       # rollouts with the vLLM CPU build
    .venv/bin/python bench/step.py --sft_steps 0                    # stress case: an untrained, near-uniform model

What is timed: `troll.train.rl_step`, the function the training loop calls, unchanged: sample
prompts_per_step x samples_per_prompt completions (`make_generator`: transformers `generate`, or vLLM), decode
and reward them, GRPO advantages, the old-policy pass (`--old_policy recompute`: a no-grad forward + sparsify
of every sample), `minibatches` optimiser steps (forward, loss, backward, AdamW), and the weight push (a no-op
with HF). The phase times are the ones `rl_step` returns (time_generate, time_score, time_old_policy,
time_update, time_sync); total = their sum. The variants differ only in the config: `troll` (the default
"rest" sparse model), `troll-paper` (`support="paper"`, the paper's tail model), `clip` (`loss="ppo_clip"`: this
repository's, through the same one-pass gather) and `textbook` (PPO-clip as TRL computes it: whole logits, one
log-softmax over the vocabulary kept for backward, `troll.tools.watch.textbook_clip`, with `logits_chunk` 0).
Inside the update, the loss functions' forward (`troll_loss` / `ppo_clip`, not their backward) is also timed
(wall and CPU user), to show how much of the difference is the loss itself: `rl_step`'s `loss_fn` seam gets the
loss wrapped in a timer.

Setup: `Config.from_args(["--preset", "tiny-cpu", ...])` (every flag of the command line is passed through to it,
e.g. `--prompts_per_step 16 --k 32`): the 0.59M-parameter tiny Llama built locally (`build_model`) and warm-started
like the preset's training run (supervised steps on the addition task until greedy solves 30% of the training probe,
untimed), 32 prompts x 8 samples x at most 5 new tokens, 2 minibatches, lr 1e-4, K 64, eps 0.05, clip 0.2. The
task's reward is replaced by `_util.parity_reward` (1.0 when the sum of the completion's code points is odd;
`--reward odd_length` for odd-length completions; `--reward task` keeps the addition reward), about a coin flip per
sample, so every round's update has real gradients whatever the model has learnt.

Stress case, `--sft_steps 0`: the untrained model is near-uniform over its 260 tokens, so the K = 64 sparse
supports hold only ~1/4 of the mass. In the first minibatch old and new policy are identical and nothing is
projected; after the first optimiser step the top-64 sets of old and new policy differ by near-ties, and the
paper's tail model charges the boundary tokens 1e-12, so `troll-paper` projects nearly every token of the
later minibatches, with 7-8 solver iterations each, although the true KL is tiny. The rest model's KL is a lower
bound of the true KL, so `troll` projects only what really left the region; PPO-clip's ratio p(y) / q(y) is
exact, so it clips almost nothing here. The fraction of tokens projected is printed for both TROLL variants.

Pairing: every round starts all variants from the same weights, optimiser and scheduler state (restored
from a snapshot, untimed; with vLLM the restored weights are pushed to the engine, untimed) and the same step
index, so all sample the same prompts with the same sampler seed: with the same weights they get the same
rollouts, and only the update differs. The run then continues from the state of the round's last variant.
The order reverses between rounds so the load of other processes hits every variant alike;
`--warmup` rounds (untimed) come first. Reported: per variant the median of each phase and of the
total over rounds (and the minimum total, the steadiest figure on a busy machine), the CPU user time of the
step and of each phase (getrusage around the phase functions: on a shared machine the steadier measure of work
done), and each TROLL variant's ratio to clip: of the medians, and the median of the per-round (paired)
ratios. Target: a TROLL step (the default model) costs at most 1.05x a clip step. The SUMMARY uses the paired
median ratios.

`--compare levers` (issue 52): the preset's own loss, with `LEVERS` as the variants: today's per-sample path
(`--share_prompt false --minibatch_by sample`), the shared prompt with minibatches of whole groups, that with an empty
system message (`--system ''`, other prompts, the same problems), today's path with troll's fused AdamW in place
of torch's per-tensor loop (`today+fused`; every variant but today runs it), the shared step without the old-policy
pass (`--old_policy behaviour`: q is the sampler's own log-probs, which differ from the recomputed ones by the
cached decoding's rounding, the run's `mismatch_*` metrics; not exact), the shared step training LoRA adapters (rank
16 on every linear layer, `shared+lora`: a frozen copy of the warm-started model with new adapters, its own sampler,
AdamW and schedule, `Policy`; another model, so not exact), and the shared step on transformers' own sdpa attention
(which copies each shared key/value head to its query heads; the others run troll.models.attention's `gqa_sdpa`
where the model is built with it: on CPU, a model with grouped-query attention). Each variant's task is loaded with
its own settings. Reported: the phases, each variant's paired ratio to today's step, and the step's least FLOPs
(`bench._flops.step_flops`: each prompt once per pass, each completion token once; full fine-tuning's, LoRA's row
too) over its median time, as a fraction of this machine's float32 matmul rate at the model's shapes
(`bench._flops.matmul_rate`). Target: the best variant at most a third of today's step.

OMP_WAIT_POLICY=PASSIVE is set (unless the environment sets it) before torch is imported: with the default
spinning OpenMP threads a small CPU model runs up to 10x slower when another process competes for the cores.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (module docstring)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
if not __package__:  # run as a file (python bench/x.py): the repository root on the path, for `bench` and its troll
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import troll.train as train  # noqa: E402
from bench._flops import matmul_rate, step_flops  # noqa: E402
from bench._util import REWARDS, cpu_user, int_at_least, median, ratio  # noqa: E402
from troll.base.cli import Parser, UsageError, run_command
from troll.base.config import Config  # noqa: E402
from troll.losses import LOSSES  # noqa: E402
from troll.models.build import adapt, build_model  # noqa: E402
from troll.run.start import check_size, check_step, make_generator, make_optimizer  # noqa: E402
from troll.run.warmstart import warm_start_task  # noqa: E402
from troll.tasks.task import load_task  # noqa: E402
from troll.tools.watch import textbook_clip  # noqa: E402

PROG = "python bench/step.py"  # the name in each of its lines, argparse's own and run_command's

PHASES = ("generate", "score", "old_policy", "update", "sync")
VARIANTS = {
    "troll": {"loss": "troll"},
    "troll-paper": {"loss": "troll", "support": "paper"},
    "clip": {"loss": "ppo_clip"},
    "textbook": {"loss": "ppo_clip", "logits_chunk": 0},  # its loss: troll.tools.watch.textbook_clip (below)
}
TROLLS = ("troll", "troll-paper")
# --compare levers: the preset's own loss, today's per-sample path against the levers that remove repeated work
# (today's AdamW is torch's per-tensor loop; every other variant runs troll's fused AdamW, troll.run.warmstart.adamw)
LEVERS = {
    "today": {"share_prompt": False, "minibatch_by": "sample", "system": None, "adamw": "loop"},
    "today+fused": {"share_prompt": False, "minibatch_by": "sample", "system": None},  # the fused AdamW alone
    "shared": {"share_prompt": True, "minibatch_by": "group", "system": None},  # exact, and whole groups
    "shared+system": {"share_prompt": True, "minibatch_by": "group", "system": ""},  # an empty system message
    # no old-policy pass: the sampler's own log-probs as q (not exact: the cached decoding's rounding, ~1e-6 nats)
    "shared+behaviour": {"share_prompt": True, "minibatch_by": "group", "system": None, "old_policy": "behaviour"},
    # LoRA adapters (rank 16, every linear layer) on a frozen copy of the model: its own optimiser and sampler
    "shared+lora": {"share_prompt": True, "minibatch_by": "group", "system": None, "lora_rank": 16, "lora_alpha": 32.0},
    # the shared step with transformers' own sdpa attention, which copies shared key/value heads
    # (troll.models.attention)
    "shared, repeat_kv": {"share_prompt": True, "minibatch_by": "group", "system": None, "attention": "sdpa"},
}


class PhaseClock:
    """CPU user seconds spent inside the phase functions `rl_step` calls (score = step total minus the rest),
    and wall + CPU user seconds inside the loss functions' forward (phase "loss", part of "update"; the timed
    losses are `self.losses`, passed to `rl_step` as `loss_fn`)."""

    def __init__(self, generators: list, variants: dict[str, dict], cfg: Config) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}
        for phase in ("old_policy", "update"):
            setattr(train, phase, self.timed(getattr(train, phase), phase))
        for generator in generators:
            generator.generate = self.timed(generator.generate, "generate")
            generator.push_weights = self.timed(generator.push_weights, "sync")
        loss = {name: textbook_clip if name == "textbook" else LOSSES[v.get("loss", cfg.loss)]
                for name, v in variants.items()}  # fmt: skip
        self.losses = {name: self.timed(fn, "loss") for name, fn in loss.items()}

    def clear(self) -> None:
        self.cpu.clear()
        self.wall.clear()

    def timed(self, fn, phase: str):
        """`fn`, adding its wall and CPU user seconds to `phase`."""

        def run(*args, **kwargs):
            if phase == "update":  # the step's batch, for its FLOP count (update(cfg, model, opt, sched, batch, ...))
                self.batch = args[4]
            u, t = cpu_user(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu_user() - u
                self.wall[phase] = self.wall.get(phase, 0.0) + time.perf_counter() - t

        return run


def report_levers(runs: dict[str, list[dict]], flops: dict[str, list[float]], rate: float, repeats: int) -> None:
    """--compare levers: each variant's median phases, its paired ratio to today's path, and the fraction of this
    machine's matmul rate its step reaches on the step's least FLOPs (bench/_flops.py)."""
    med = {name: {k: median(m[k] for m in ms) for k in ms[0]} for name, ms in runs.items()}
    head = "".join(f"{p:>11s}" for p in PHASES)
    print(f"\nmedian wall s    {head} {'total':>7s} | paired to today | GFLOP  of the rate ({rate / 1e9:.1f} GFLOP/s)")
    for name, ms in runs.items():
        md = med[name]
        paired = median(ratio(m["total"], t["total"]) for m, t in zip(ms, runs["today"], strict=True))
        need = median(flops[name])
        print(
            f"{name:16s} " + "".join(f"{md[p]:11.3f}" for p in PHASES) + f" {md['total']:7.2f} |"
            f" {paired:14.2f}x | {need / 1e9:5.1f}  {need / md['total'] / rate:6.1%}"
        )
    best = min((n for n in runs if n != "today"), key=lambda n: med[n]["total"])
    paired = median(ratio(m["total"], t["total"]) for m, t in zip(runs[best], runs["today"], strict=True))
    verdict = "met" if paired <= 1 / 3 else "NOT met"
    print(
        f"SUMMARY levers: {best} / today {paired:.2f}x the step (target <= 0.33x): {verdict}; median of {repeats} "
        f"paired rounds; today {med['today']['total']:.1f} s, {best} {med[best]['total']:.1f} s a step"
    )


def snapshot(model, opt, sched) -> dict:
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "opt": copy.deepcopy(opt.state_dict()),
        "sched": copy.deepcopy(sched.state_dict()),
    }


def restore(snap: dict, model, opt, sched) -> None:
    model.load_state_dict(snap["model"])
    opt.load_state_dict(copy.deepcopy(snap["opt"]))
    sched.load_state_dict(copy.deepcopy(snap["sched"]))


@dataclasses.dataclass
class Policy:
    """What a variant steps: the model, its sampler, optimiser and schedule (a LoRA variant has its own), and the
    state every variant of a round starts from (`keep`, then `restart` before each variant)."""

    model: Any
    generator: Any
    opt: Any
    sched: Any
    snap: dict = dataclasses.field(default_factory=dict)
    fresh: bool = True  # the engine (vLLM) holds the kept weights

    def keep(self) -> None:
        """The current state as the next round's start."""
        self.snap, self.fresh = snapshot(self.model, self.opt, self.sched), True

    def restart(self) -> None:
        """Back to the kept state; an engine that has stepped since gets the kept weights (untimed)."""
        restore(self.snap, self.model, self.opt, self.sched)
        if not self.fresh:
            self.generator.push_weights(self.model)


def lora_policy(cfg: Config, model: Any, tokenizer: Any, folder: Path) -> Policy:
    """A LoRA variant's policy: new adapters on a frozen copy of the (warm-started) model, as a LoRA run adds them
    after its warm-start (troll.run.start), with its own optimiser over the adapters and its own sampler."""
    policy = adapt(cfg, copy.deepcopy(model))
    return Policy(policy, make_generator(cfg, policy, tokenizer, folder), *make_optimizer(cfg, policy))


def main() -> None:
    ap = Parser(
        prog=PROG,
        description=__doc__.split("\n")[0],
        epilog="Other flags go to troll.base.config.Config (e.g. --backend vllm).",
    )
    ap.add_argument("--repeats", type=int_at_least(1), default=10, help="measured rounds (each runs both variants)")
    ap.add_argument("--warmup", type=int_at_least(0), default=2, help="untimed rounds first")
    ap.add_argument("--reward", default="parity", choices=[*REWARDS, "task"], help="task = the addition reward")
    ap.add_argument(
        "--compare", default="losses", choices=["losses", "levers"],
        help="losses: TROLL against PPO-clip; levers: the preset's loss on today's per-sample path against the shared "
        "prompt (and an empty system message), with the step's FLOPs against this machine's matmul rate",
    )  # fmt: skip
    a, rest = ap.parse_known_args()
    cfg = Config.from_args(["--preset", "tiny-cpu", *rest], prog=ap.prog)
    device = torch.device("cpu" if cfg.device == "auto" else cfg.device)

    t0 = time.perf_counter()
    torch.manual_seed(cfg.seed)
    check_size(cfg)  # what --vocab_size implies, before the model is built (troll.run.start)
    model, tokenizer = build_model(cfg, device)
    check_step(cfg, model)  # what the counts imply for this model, in one line before any step (troll.run.start)
    vocab = len(tokenizer)
    try:
        task, _ = load_task(cfg, tokenizer)
    except ValueError as e:  # every prompt longer than --max_prompt_len
        raise UsageError(str(e)) from None
    if cfg.sft_steps:
        warm_start_task(cfg, model, tokenizer, task)  # prints its record
    variants = VARIANTS if a.compare == "losses" else LEVERS
    settings = {name: {k: x for k, x in v.items() if k not in ("attention", "adamw")} for name, v in variants.items()}
    built = model.config._attn_implementation  # troll.models.attention's on CPU where the model shares key/value heads
    attention = {name: v.get("attention", built) for name, v in variants.items()}
    tasks = {name: load_task(dataclasses.replace(cfg, **v), tokenizer)[0] for name, v in settings.items()}
    for t in tasks.values():  # each variant's prompts (a system message changes them), the same problems
        t.reward = REWARDS[a.reward] if a.reward != "task" else t.reward
    threads_before = torch.get_num_threads()
    tmp = tempfile.TemporaryDirectory()
    generator = make_generator(cfg, model, tokenizer, Path(tmp.name))
    opt, sched = make_optimizer(cfg, model)  # the preset's constant schedule, no warmup
    full = Policy(model, generator, opt, sched)
    policies = {name: lora_policy(dataclasses.replace(cfg, **v), model, tokenizer, Path(tmp.name))
                if v.get("lora_rank") else full for name, v in settings.items()}  # fmt: skip
    distinct = list({id(p): p for p in policies.values()}.values())
    clock = PhaseClock([p.generator for p in distinct], variants, cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {cfg.model}, {n_params / 1e6:.2f}M parameters, vocab {vocab}; backend {cfg.backend}, "
        f"setup {time.perf_counter() - t0:.1f} s; torch threads {threads_before}/{torch.get_num_threads()} "
        f"(before/after the generator), OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    )
    print(
        f"step: {cfg.prompts_per_step} prompts x {cfg.samples_per_prompt} samples x <= {cfg.max_new_tokens} "
        f"tokens, {cfg.minibatches} minibatches, old_policy {cfg.old_policy}, K {cfg.k}, eps {cfg.eps}, "
        f"clip {cfg.clip_low}/{cfg.clip_high}, lr {cfg.lr}, reward {a.reward}; "
        f"{a.warmup} warm-up + {a.repeats} measured rounds"
    )

    for p in distinct:
        p.keep()
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    flops: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(a.warmup + a.repeats):
        order = list(variants)[:: -1 if r % 2 else 1]
        line = []
        for name in order:
            policy = policies[name]
            model, generator, opt, sched = policy.model, policy.generator, policy.opt, policy.sched
            policy.restart()  # untimed
            clock.clear()
            u = cpu_user()
            variant = dataclasses.replace(cfg, **settings[name])
            model.set_attn_implementation(attention[name])
            for group in opt.param_groups:  # the same state either way: torch's loop where a variant asks for it
                group["fused"] = opt.defaults["fused"] and variants[name].get("adamw") != "loop"
            loss_fn, pending = clock.losses[name], []
            row = train.rl_step(variant, r, model, tokenizer, generator, opt, sched, tasks[name], pending, loss_fn)
            user = cpu_user() - u
            policy.fresh = False
            cpu = {p: clock.cpu.get(p, 0.0) for p in PHASES}
            cpu["score"] = user - sum(v for p, v in cpu.items() if p != "score")
            m = {p: row[f"time_{p}"] for p in PHASES}
            m |= {"total": sum(m.values()), "user": user, **{f"user_{p}": cpu[p] for p in PHASES}}
            m |= {"loss": clock.wall.get("loss", 0.0), "user_loss": clock.cpu.get("loss", 0.0)}
            m |= {k: row.get(k, float("nan")) for k in ("reward", "frac_active", "dual_iters_mean", "grad_norm")}
            if r >= a.warmup:
                runs[name].append(m)
                flops[name].append(sum(step_flops(model.config, clock.batch.ro, variant.epochs).values()))
            line.append(f"{name} {m['total']:.2f} s (update {m['update']:.2f}, user {user:.2f})")
        for p in distinct:  # each policy continues from its last variant's state
            p.keep()
        tag = "warm-up" if r < a.warmup else f"round {r - a.warmup + 1}"
        print(f"  {tag:8s}: " + ", ".join(line) + f"; reward {row['reward']:.2f}")

    if a.compare == "levers":
        report_levers(runs, flops, matmul_rate(model.config), a.repeats)
        tmp.cleanup()
        return
    med = {name: {k: median(m[k] for m in ms) for k in ms[0]} for name, ms in runs.items()}
    for name, ms in runs.items():
        med[name]["min"] = min(m["total"] for m in ms)
    head = "".join(f"{p:>11s}" for p in PHASES)
    print(f"\nmedian wall s    {head} {'total':>7s} {'(min)':>6s} | cpu user: {'step':>6s} {'update':>7s} {'old':>6s}")
    for name in VARIANTS:
        md = med[name]
        print(
            f"{name:16s} " + "".join(f"{md[p]:11.3f}" for p in PHASES) + f" {md['total']:7.3f} {md['min']:6.3f} |"
            f"           {md['user']:6.3f} {md['user_update']:7.3f} {md['user_old_policy']:6.3f}"
        )
    paired, textbook = {}, {}
    for name in TROLLS:
        x = {k: ratio(med[name][k], med["clip"][k]) for k in med[name]}
        print(
            f"{name + '/clip':16s} " + "".join(f"{x[p]:10.2f}x" for p in PHASES) + f" {x['total']:6.2f}x "
            f"{x['min']:5.2f}x |           {x['user']:5.2f}x {x['user_update']:6.2f}x {x['user_old_policy']:5.2f}x"
        )
        paired[name] = {
            k: median(ratio(t[k], c[k]) for t, c in zip(runs[name], runs["clip"], strict=True))
            for k in ("total", "update", "user", "user_update")
        }
        textbook[name] = {
            k: median(ratio(t[k], c[k]) for t, c in zip(runs[name], runs["textbook"], strict=True))
            for k in ("total", "update")
        }
    print("paired (median over rounds of the within-round ratio to clip):")
    c = med["clip"]
    for name in TROLLS:
        t, pr = med[name], paired[name]
        print(
            f"  {name:12s} total {pr['total']:.2f}x, update {pr['update']:.2f}x; cpu user: step {pr['user']:.2f}x, "
            f"update {pr['user_update']:.2f}x; update extra per step {t['update'] - c['update']:+.3f} s, of which "
            f"the loss forward {t['loss'] - c['loss']:+.3f} s; tokens projected {t['frac_active']:.1%}, dual "
            f"iterations mean {t['dual_iters_mean']:.1f}, grad norm {t['grad_norm']:.3f}"
        )
    print(
        f"  {'clip':12s} tokens clipped {c['frac_active']:.1%}, grad norm {c['grad_norm']:.3f}; "
        f"reward {c['reward']:.2f}"
    )
    for name in TROLLS:
        tb = textbook[name]
        print(f"  {name:12s} against the textbook clip (whole logits): total {tb['total']:.2f}x, update "
              f"{tb['update']:.2f}x")  # fmt: skip
    pr = paired["troll"]
    verdict = "met" if pr["total"] <= 1.05 else "NOT met"
    print(
        f"SUMMARY step: troll/clip total {pr['total']:.2f}x, update {pr['update']:.2f}x (target <= 1.05x): "
        f"{verdict}; against the textbook clip {textbook['troll']['total']:.2f}x, update "
        f"{textbook['troll']['update']:.2f}x; troll-paper/clip {paired['troll-paper']['total']:.2f}x; tokens "
        "projected: rest model "
        f"{med['troll']['frac_active']:.1%}, paper model {med['troll-paper']['frac_active']:.1%}; cpu user "
        f"{pr['user']:.2f}x, {cfg.backend}, median of {a.repeats} paired rounds"
    )
    tmp.cleanup()
    sys.stdout.flush()


if __name__ == "__main__":  # Ctrl-C: one line, exit 130
    run_command(PROG, main)
