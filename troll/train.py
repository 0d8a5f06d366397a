"""TROLL on one GPU (or CPU): the RL loop, read top to bottom.

    troll train                                              # tiny-cpu: 2-digit addition, minutes on a CPU
    troll train --preset gsm8k-qwen2.5-0.5b --out runs/qwen  # GSM8K, one GPU
    troll train --out runs/tiny --resume true                # continue a run

One RL step (`rl_step`), with pi_theta the network, q the old policy it is anchored to:

    1. rollout     sample n completions per prompt from pi_theta (transformers or vLLM); off-policy data: the
                   sampler mu runs k steps behind (--staleness k) or in bf16 (--rollout_dtype bfloat16)
    2. reward      score each completion against the gold answer (0 or 1)
    3. advantages  A_i = (r_i - mean_group r) / std_group r          (GRPO; troll.advantages)
    4. old policy  q = sparsify(pi_theta) at every completion token, before any update: the top-mass tokens,
                   the sampled one, and one atom for the rest of the vocabulary (troll.sparse); or q = mu, the
                   sampler's top-K (--old_policy behaviour)
    5. update      per minibatch: pi* = argmin KL(pi || pi_theta) s.t. KL(pi || q) <= eps   (troll.project)
                   L = -mean_t A * pi*(y_t) / q(y_t) + alpha * mean_t KL(pi_theta || sg(pi*))  (troll.losses)
                   (x min(q(y)/mu(y), cap) with --is_correction tis: the decoupled objective for data from mu)
                   then one AdamW step; `epochs` passes over the batch, each split into `minibatches`
    6. push        copy the new weights into the rollout engine

The projection replaces PPO's ratio clipping: the ratio is that of the projected policy, which is inside the trust
region by construction and differentiable in theta. `--loss ppo_clip | dppo | cispo` swaps step 5's loss for a
baseline; `--lora_rank r` trains LoRA adapters on a frozen base instead of every weight (troll.lora), with steps
1-6 unchanged. Everything else lives beside this file: the run's start, the optimiser and the rollout engine
(troll.run.start), the run directory and resume (troll.run.harness), the task and its reward (troll.tasks.task), the
settings (troll.base.config), measurements (troll.run.diagnostics); docs/algorithm.md derives the math and states every
choice.
"""

from __future__ import annotations

import os

from troll.base.cli import bars_on_a_terminal_only
from troll.base.config import Config

if __name__ == "__main__":  # parse the command line before importing torch: --help and bad flags answer at once
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # OpenMP threads that spin slow a busy CPU down many times
    bars_on_a_terminal_only()  # a log file gets lines, not bar redraws
    CLI_CONFIG = Config.from_args()

import shlex
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from troll.advantages import advantages, has_signal
from troll.aggregate import aggregate_count
from troll.base.cli import run_command
from troll.base.metrics import merge
from troll.losses import LOSSES
from troll.policy import rollout_logits
from troll.rollout import Batch, Generator, Rollouts
from troll.run.diagnostics import StepTimer, UpdateKL, step_row
from troll.run.harness import Run, check_sources, starting
from troll.run.records import Recorder, due
from troll.run.start import start
from troll.sparse import SparseDist, cat_rows, sparsify, sparsify_topk
from troll.tasks.task import Task, decode_rollouts, encode, evaluate, rewards_of

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]  # the signature every loss in troll.losses has

# ----------------------------------------------------------------------------- the pieces of one RL step


def collect(cfg: Config, index: int, tokenizer: Any, generator: Generator, task: Task) -> Batch:
    """Steps 1-3 for batch `index`: rollout, reward, advantages. Everything random is seeded from (seed, index),
    so a resumed run repeats what the uninterrupted one did."""
    t0 = time.time()
    seed = (cfg.seed * 1_000_003 + index) % 2**63  # the seeds torch takes; any seed below 9e12 is itself
    rng = torch.Generator().manual_seed(seed)
    drawn = torch.randint(len(task.train), (cfg.prompts_per_step,), generator=rng).tolist()
    rows = [task.train[i] for i in drawn]
    prompts = encode(tokenizer, [task.prompt(r["question"]) for r in rows])
    ro = generator.generate(  # 1. rollout
        prompts,
        cfg.samples_per_prompt,
        cfg.max_new_tokens,
        cfg.temperature,
        top_k_logprobs=cfg.k if cfg.old_policy == "behaviour" else 0,
        seed=seed,
    )
    t1 = time.time()
    golds = [rows[int(g)]["gold"] for g in ro.group]
    rewards = torch.tensor(rewards_of(task, decode_rollouts(tokenizer, ro), golds, ro.finished))  # 2. reward
    adv = advantages(cfg.advantage, rewards, ro.group)  # 3. advantages
    if cfg.mask_overlong:  # DAPO's overlong filter: a sample cut at the token limit is left out of the loss
        ro.completion_mask &= ro.finished[:, None]
    train_rows = [drawn[int(g)] for g in ro.group]
    batch = Batch(ro, rewards, adv, rng.get_state(), t1 - t0, time.time() - t1, train_rows, golds)
    if cfg.filter_groups:  # DAPO's dynamic sampling, without its resampling: only groups with signal are trained on
        keep = has_signal(rewards, ro.group).nonzero().flatten()
        batch = batch.keep(keep) if len(keep) else batch  # no group with signal: the batch stays whole (A = 0)
    return batch


def old_policy(cfg: Config, model: Any, ro: Rollouts, vocab: int) -> SparseDist:
    """Step 4: the network before the update, sparsified over all B*T completion positions of `ro` in its own
    no-grad pass, on CPU."""
    parts = []
    with torch.no_grad():
        for rows in ro.micro_batches(cfg.micro_batch_tokens):
            logits = rollout_logits(model, ro, rows, vocab, cfg.logits_chunk, cfg.bf16, cfg.compile_head,
                                    cfg.share_prompt)  # fmt: skip
            logits = logits.reshape(-1, logits.shape[-1])
            ids = ro.completion_ids[rows].reshape(-1).to(logits.device)
            parts.append(sparsify(logits, ids, k=cfg.k, delta=cfg.delta).to("cpu"))
    return cat_rows(parts)


def behaviour_policy(cfg: Config, ro: Rollouts, vocab: int) -> SparseDist:
    """The policy that sampled `ro` (mu), from the engine's top-K log-probs: the anchor with --old_policy behaviour."""
    k = ro.top_idx.shape[-1]
    tokens = ro.completion_ids.reshape(-1)
    return sparsify_topk(
        ro.top_logp.view(-1, k), ro.top_idx.view(-1, k), ro.logprobs.view(-1), tokens, vocab, delta=cfg.delta
    )


def minibatches_of(cfg: Config, batch: Batch) -> list[torch.Tensor]:
    """Step 5's minibatches (sample indices): the batch shuffled once per pass (`cfg.epochs`) by the random state it
    was sampled with, each pass split into `cfg.minibatches`; with `minibatch_by group` the groups are shuffled and
    split, so a group's samples share a minibatch (and, with --share_prompt, one forward of their prompt)."""
    rng = torch.Generator()
    rng.set_state(batch.rng_state)
    group = batch.ro.group
    units = int(group.max()) + 1 if cfg.minibatch_by == "group" else len(batch.ro)
    shuffles = [torch.randperm(units, generator=rng) for _ in range(cfg.epochs)]
    parts = [mb for perm in shuffles for mb in perm.chunk(cfg.minibatches)]
    if cfg.minibatch_by == "group":  # groups -> their samples, in the shuffled groups' order
        parts = [torch.cat([(group == g).nonzero().flatten() for g in part.tolist()]) for part in parts]
    return parts


def update(
    cfg: Config,
    model: Any,
    opt: Any,
    sched: Any,
    batch: Batch,
    old: SparseDist,
    minibatches: Sequence[torch.Tensor],
    loss_fn: LossFn,
) -> tuple[dict[str, float], int]:
    """Step 5: one optimiser step per minibatch (sample indices), its gradient accumulated over micro-batches of at
    most `micro_batch_tokens` padded tokens. Returns the merged metrics and the number of skipped steps (a step
    whose gradient norm is not finite is skipped)."""
    device = next(model.parameters()).device
    ro = batch.ro
    T, vocab = ro.completion_ids.shape[1], old.vocab_size
    parts: list[tuple[float, dict[str, float]]] = []
    unmeasured: list[tuple[float, dict[str, float]]] = []
    skipped = 0
    for minibatch in minibatches:
        opt.zero_grad(set_to_none=True)
        whole = ro.completion_mask[minibatch]
        count, tokens = int(aggregate_count(whole, cfg.agg)), int(whole.sum())
        for rows in ro.micro_batches(cfg.micro_batch_tokens, minibatch):
            logits = rollout_logits(model, ro, rows, vocab, cfg.logits_chunk, cfg.bf16, cfg.compile_head,
                                    cfg.share_prompt)  # with grad  # fmt: skip
            mask = ro.completion_mask[rows]
            mu = ro.logprobs[rows].to(device) if cfg.is_correction != "none" else None  # off-policy correction
            loss, m = loss_fn(  # TROLL: the projection onto KL(. || q) <= eps runs inside (troll.losses)
                logits,
                ro.completion_ids[rows].to(device),
                mask.to(device),
                batch.adv[rows].to(device),
                old.samples(rows, T).to(device),
                agg=cfg.agg,
                norm_len=T,
                behaviour_logp=mu,
                **cfg.loss_kwargs(),
            )
            # a micro-batch weighs count(micro-batch) / count(minibatch), with count what cfg.agg divides by (real
            # tokens, or rows with one: troll.aggregate.aggregate_count), so the sum is the minibatch's aggregate
            share = int(aggregate_count(mask, cfg.agg)) / max(count, 1)
            (loss * share).backward()
            if mask.any():  # metrics: the loss's own terms weigh as the loss; the rest, over real tokens, by tokens
                own = {key: m[key] for key in ("policy", "regression") if key in m}
                parts += [(share, own), (int(mask.sum()) / tokens, {k: v for k, v in m.items() if k not in own})]
            else:  # no real token, nothing measured: its placeholders fill only keys no other micro-batch gives
                unmeasured.append((1.0, m))
        norm = torch.nn.utils.clip_grad_norm_(opt.param_groups[0]["params"], cfg.grad_clip)
        if not torch.isfinite(norm):
            skipped += 1
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
        sched.step()
        parts.append((1.0, {"grad_norm": float(norm)}))
    return merge(unmeasured) | merge(parts), skipped


def rl_step(cfg: Config, step: int, model: Any, tokenizer: Any, generator: Generator, opt: Any, sched: Any, task: Task,
            pending: list[Batch] | None = None, loss_fn: LossFn | None = None, probe: UpdateKL | None = None,
            recorder: Recorder | None = None) -> dict:  # fmt: skip
    """One RL step (module docstring); returns its metrics row (troll.run.diagnostics.step_row). `pending` holds the
    batches sampled ahead of training (--staleness k: step s trains on batch s, sampled k steps earlier, by the
    weights of then). `loss_fn` (default LOSSES[cfg.loss]) is a seam for another loss or a timed one (bench/step.py);
    `probe` measures the step's exact update KL (troll.run.diagnostics); `recorder` writes down a few samples' tokens as
    the loss sees them (troll.run.records)."""
    timer = StepTimer()  # the phases' wall-clock seconds, for the row
    pending = [] if pending is None else pending
    fresh = []
    while len(pending) + len(fresh) <= cfg.staleness:  # 1-3. rollout, reward, advantages
        fresh.append(collect(cfg, step + len(pending) + len(fresh), tokenizer, generator, task))
    pending += fresh
    batch, vocab = pending.pop(0), len(tokenizer)
    with timer("old_policy"):  # 4. old policy
        # the network's own pass; --old_policy behaviour runs it too, for the row's mismatch_* the studies record
        trainer = old_policy(cfg, model, batch.ro, vocab)
        old = trainer if cfg.old_policy == "recompute" else behaviour_policy(cfg, batch.ro, vocab)
    with timer("update"):  # 5. update
        if probe:
            probe.before(model, batch.ro)
        minibatches = minibatches_of(cfg, batch)
        loss = loss_fn or LOSSES[cfg.loss]
        loss = recorder.watch(loss, batch, minibatches, model) if recorder else loss
        metrics, skipped = update(cfg, model, opt, sched, batch, old, minibatches, loss)
        if recorder:
            recorder.after(model, batch)
    with timer("kl_update"):
        metrics |= probe.after(model, batch.ro) if probe else {}
    with timer("sync"):
        generator.push_weights(model)  # 6. push
    lr, device = sched.get_last_lr()[0], next(model.parameters()).device
    return step_row(step, batch, fresh, trainer, metrics, skipped, lr, timer, device, task, tokenizer)


# ----------------------------------------------------------------------------- the loop


def train(
    cfg: Config, loss_fn: LossFn | None = None, wrap_generator: Callable[[Generator], Generator] | None = None
) -> dict:
    """Run (or resume) the RL loop of `cfg`; returns the summary written to <out>/summary.json. `loss_fn` and
    `wrap_generator` are seams for measurements (troll.tools.check): a loss that inspects its inputs, a generator that
    records its calls around the real one. A failure before the first step leaves nothing, or a folder the same
    command starts again in (troll.run.harness); a third-party package's exception there is a RunError (`starting`)."""
    # the run directory: new, restarted or resumed from its newest whole checkpoint; nothing written until claimed
    with Run.open(cfg, claim=False) as run:
        if run.finished:
            return run.summary()
        with starting():
            model, tokenizer, task, generator, opt, sched = start(run, wrap_generator)
        cfg = run.cfg
        probe = UpdateKL(cfg, len(tokenizer)) if len(tokenizer) <= cfg.kl_update_vocab else None
        for step in run.steps():
            pending = run.state["pending"]
            recorder = Recorder(cfg, tokenizer, step) if due(cfg, step) else None  # per-token records (troll.run)
            row = rl_step(cfg, step, model, tokenizer, generator, opt, sched, task, pending, loss_fn, probe, recorder)
            evaluation = evaluate(generator, tokenizer, task, cfg.max_new_tokens) if run.eval_due(step) else None
            run.record(step, row, evaluation, model, tokenizer, opt, sched, recorder.row() if recorder else None)
        return run.finish(len(task.test))


def main(cfg: Config) -> None:
    """The command: the model and data checked before any work, then the run."""
    check_sources(cfg)
    train(cfg)


if __name__ == "__main__":  # a RunError: one line, exit 2; Ctrl-C: the command that continues the run, then SIGINT
    resume = f"troll train --out {shlex.quote(CLI_CONFIG.out)} --resume true"
    run_command("troll train", lambda: main(CLI_CONFIG), resume=resume)
