"""Measurements of a run, outside the algorithm: the step's metrics row and phase times, the sampler's mismatch,
memory, and (opt-in) the exact update KL.

    timer = StepTimer()                   # troll.train.rl_step: with timer("update"): ... -> timer.seconds["update"]
    row = step_row(step, batch, fresh, trainer, metrics, skipped, lr, timer, device, task, tokenizer)
    mismatch(ro, old)                     # every step: sampler mu vs the network before the update, at y
    mismatch_at(old_logp, mu_logp, mask)  # the same from the two log-probs [B, T] (troll.integrations.trl)
    peak_memory_mb(device)
    reset_peak_rss(); ...; proc_status_bytes("VmHWM")   # Linux: the resident peak since the reset, in bytes

    probe = UpdateKL(cfg, vocab_size)     # troll.train builds it when vocab_size <= cfg.kl_update_vocab
    probe.before(model, ro)               # right before the step's optimiser steps: p_old [B*T, V]
    metrics = probe.after(model, ro)      # after them: {"kl_update_mean", "kl_update_max"}

    KL(p_new || p_old) = sum_v p_new(v) (log p_new(v) - log p_old(v))     at every real completion token

The losses' kl_before_* / kl_after_* see the sparse model and only during the update; this is the dense truth of
how far the network moved in one RL step (all minibatches and epochs), over all V tokens, at the temperature the
samples were drawn at. Ids the policy gives probability 0 (the masked padded vocabulary) add nothing.

Cost: two no-grad forwards over the step's samples and B*T*V floats on CPU, so it is for small vocabularies only
(the tiny task's 260 tokens: 1.3 MB for a step's 256 x 5 positions; Qwen's 151,936 would need 10 GB at 16k
tokens). The studies (study/) turn it on; the main job leaves it off.
"""

from __future__ import annotations

import math
import re
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from troll.advantages import has_signal
from troll.head import LMHead
from troll.policy import rollout_logits
from troll.rollout import Batch, Rollouts
from troll.sparse import SparseDist
from troll.tasks.task import Task, decode_rollouts


class StepTimer:
    """Wall-clock seconds of an RL step's phases: `with timer("update"): ...` adds the block's time to
    `timer.seconds["update"]`; `timer.elapsed` runs from the timer's making to the end of the last phase."""

    def __init__(self) -> None:
        self.start = self.end = time.time()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t = time.time()
        yield
        self.end = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + self.end - t

    @property
    def elapsed(self) -> float:
        return self.end - self.start


def step_row(
    step: int,
    batch: Batch,
    fresh: Sequence[Batch],
    trainer: SparseDist,
    update: dict[str, float],
    skipped: int,
    lr: float,
    timer: StepTimer,
    device: torch.device,
    task: Task,
    tokenizer: Any,
) -> dict:
    """The metrics row of RL step `step` (0-based; the row counts from 1), which trained on `batch` after sampling
    the batches `fresh`: the batch's rewards and lengths, the learning rate after the step and its skipped optimiser
    steps, the share of fresh samples that show the task's watched behaviour (tasks that name one), the sampler's
    mismatch to `trainer` (the network's own old-policy pass), the update's metrics, and what the step cost."""
    ro = batch.ro
    rewards, group = batch.drawn or (batch.rewards, ro.group)  # every sample drawn, where --filter_groups kept a part
    lengths = ro.completion_mask.sum(-1).float()
    return {
        "step": step + 1,
        "reward": float(rewards.mean()),
        "accuracy": float((rewards > 0.5).float().mean()),
        "signal_frac": float(has_signal(rewards, group).float().mean()),
        "trained_frac": len(ro) / len(rewards),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()),
        "truncated_frac": float((~ro.finished).float().mean()),
        "lr": lr,
        "skipped": skipped,
        **({"behaviour_rate": behaviour_rate(task, tokenizer, fresh)} if task.behaviour and fresh else {}),
        **mismatch(ro, trainer),
        **update,
        "time_generate": sum(b.time_generate for b in fresh),
        "time_score": sum(b.time_score for b in fresh),
        "time_old_policy": timer.seconds["old_policy"],
        "time_update": timer.seconds["update"],
        "time_kl_update": timer.seconds["kl_update"],
        "time_sync": timer.seconds["sync"],
        "tokens_per_s": float(lengths.sum()) / timer.elapsed,
        "peak_memory_mb": peak_memory_mb(device),
    }


def behaviour_rate(task: Task, tokenizer: Any, batches: Sequence[Batch]) -> float:
    """The share of samples that show `task.behaviour` (the rare task's marker), per batch, averaged over batches."""
    shares = []
    for b in batches:
        texts = decode_rollouts(tokenizer, b.ro)
        shares.append(sum(map(task.behaviour, texts)) / len(texts))
    return sum(shares) / len(shares)


def dense_kl(lp: Tensor, lq: Tensor) -> Tensor:
    """KL(p || q) per row from full log-probs [N, V] -> [N]; ids that p gives 0 add nothing."""
    return torch.where(lp > -math.inf, lp.exp() * (lp - lq), 0.0).sum(-1)


class UpdateKL:
    """The exact KL of one RL step's update (module docstring). `cfg` is the run's troll.base.config.Config."""

    def __init__(self, cfg: Any, vocab_size: int) -> None:
        self.cfg, self.vocab_size = cfg, vocab_size
        self.old: Tensor | None = None

    def full_logp(self, model: Any, ro: Rollouts) -> Tensor:
        """The model's log-probs over all V at every completion position of `ro`: [B*T, V] float32 on CPU."""
        out = []
        with torch.no_grad():
            for rows in ro.micro_batches(self.cfg.micro_batch_tokens):
                x = rollout_logits(model, ro, rows, self.vocab_size, self.cfg.logits_chunk, self.cfg.bf16)
                x = x.reshape(-1, x.shape[-1])
                x = x.logits() if isinstance(x, LMHead) else x
                out.append(torch.log_softmax(x.float(), -1).cpu())
        return torch.cat(out)

    def before(self, model: Any, ro: Rollouts) -> None:
        self.old = self.full_logp(model, ro)

    def after(self, model: Any, ro: Rollouts) -> dict[str, float]:
        if self.old is None:
            raise RuntimeError("UpdateKL.after() needs before() on the same rollouts first")
        kl = dense_kl(self.full_logp(model, ro), self.old).view(ro.completion_mask.shape)[ro.completion_mask]
        self.old = None
        return {"kl_update_mean": float(kl.mean()), "kl_update_max": float(kl.max())}


def mismatch(ro: Rollouts, old: SparseDist) -> dict[str, float]:
    """How far the sampler (mu: stale weights, lower precision) is from the network before the update (pi_old) at
    the sampled tokens of `ro` (mismatch_at)."""
    return mismatch_at(
        old.logp_at(ro.completion_ids.reshape(-1)).view(ro.logprobs.shape), ro.logprobs, ro.completion_mask
    )


def mismatch_at(old_logp: Tensor, behaviour_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """log r = log pi_old(y) - log mu(y) from the two log-probs of the sampled tokens [B, T] on the real ones (mask
    [B, T] bool; padding is never read): its mean and largest |log r|, and the estimate E_mu[r - 1 - log r] >= 0 of
    KL(mu || pi_old). No real token gives zeros."""
    log_r = (old_logp.double() - behaviour_logp.double())[mask]
    if log_r.numel() == 0:
        return {"mismatch_logratio_mean": 0.0, "mismatch_logratio_absmax": 0.0, "mismatch_kl": 0.0}
    return {
        "mismatch_logratio_mean": float(log_r.mean()),
        "mismatch_logratio_absmax": float(log_r.abs().max()),
        "mismatch_kl": float((log_r.exp() - 1 - log_r).mean()),
    }


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # ru_maxrss is in KiB on Linux


def proc_status_bytes(key: str) -> int:
    """A memory figure of this process from /proc/self/status (Linux), in bytes: VmRSS (resident now) or VmHWM
    (the resident peak since the process started or `reset_peak_rss`)."""
    return int(re.search(rf"{key}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak_rss() -> None:
    """Reset VmHWM to the current resident size (Linux: /proc/self/clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")
