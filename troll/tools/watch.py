"""What `troll check` watches a run with, apart from the checks it draws from them (troll/tools/check.py).

    train(cfg, LossWatch(LOSSES[cfg.loss]), lambda g: Recorder(g, cfg))   # troll.train's two seams for this
    figures = measure(out)                 # the run for <out>/check.json, watched; also written to <out>/measure.json

- `Recorder` wraps the run's Generator: times its calls, keeps every push's weight-sync figure, each update window's
  memory (end of a rollout to the next push: peak and baseline, the micro-batch it predicts from), and on a GPU the
  free memory around the engine's sleep and wake.
- `LossWatch` wraps the run's loss: whether each call got the chunked output layer, its dtype, a finite value.
- After the run, on its live objects: `perturbed_push` (a push of visibly changed weights, which the engine must
  take) and `compare_updates` (TROLL's update, this repository's PPO-clip's and the textbook clip's (`textbook_clip`,
  whole logits and one log-softmax, as TRL computes it) timed on the last batch, with their peak memory on CUDA).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from troll.aggregate import aggregate
from troll.base.config import Config
from troll.head import LMHead, compute_dtype
from troll.losses import LOSSES
from troll.models import memory
from troll.rollout import Batch, Generator, Rollouts
from troll.run.diagnostics import proc_status_bytes, reset_peak_rss
from troll.sparse import SparseDist

# ----------------------------------------------------------------------------- the run's generator and loss


def _memory_now(cuda: bool) -> int:
    return torch.cuda.memory_allocated() if cuda else proc_status_bytes("VmRSS")


class Recorder:
    """A Generator around the run's own: times its calls, keeps the weight-sync figure of every push, the memory
    of each update window (end of a rollout to the next push) and, on a GPU, the free memory around sleep and
    wake. Keeps the model of the last push and the last rollouts, for the update comparison."""

    def __init__(self, inner: Generator, cfg: Config) -> None:
        self.inner, self.cfg = inner, cfg
        self.cuda = cfg.device == "cuda"
        self.vllm = type(inner).__name__ == "VLLMGenerator"
        self.vocab_size: int = inner.vocab_size  # type: ignore[attr-defined]
        self.eos_token_ids = inner.eos_token_ids
        self.times: dict[str, float] = {"generate": 0.0, "greedy": 0.0, "push": 0.0}
        self.sync: list[float] = []
        self.windows: list[dict] = []  # per RL step: baseline and peak bytes, micro-batch tokens
        self.free_awake: list[int] = []  # GPU free bytes after each push (engine awake) and after each rollout
        self.free_asleep: list[int] = []
        self.model: Any = None
        self.last: Rollouts | None = None
        self._window: dict | None = None
        self.process_peak = 0  # CPU: the largest VmHWM seen (each window resets it)

    def _free(self) -> int:
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float = 1.0,
                 top_k_logprobs: int = 0, seed: int | None = None) -> Rollouts:  # fmt: skip
        t0 = time.perf_counter()
        ro = self.inner.generate(prompts, n, max_new_tokens, temperature, top_k_logprobs, seed)
        self.times["generate"] += time.perf_counter() - t0
        if self.cuda and self.vllm:
            self.free_asleep.append(self._free())
        self.last = ro
        gc.collect()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        else:
            self.process_peak = max(self.process_peak, proc_status_bytes("VmHWM"))
            reset_peak_rss()
        self._window = {"baseline": _memory_now(self.cuda), "tokens": update_tokens(self.cfg, ro),
                        "anchor_rows": anchor_rows(self.cfg, ro)}  # fmt: skip
        return ro

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        t0 = time.perf_counter()
        out = self.inner.greedy(prompts, max_new_tokens)
        self.times["greedy"] += time.perf_counter() - t0
        return out

    def sample(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, seed: int | None = None
    ) -> list[list[int]]:
        return self.inner.sample(prompts, n, max_new_tokens, temperature, seed)

    def push_weights(self, model: Any) -> None:
        if self._window is not None:  # the end of an update window
            peak = torch.cuda.max_memory_allocated() if self.cuda else proc_status_bytes("VmHWM")
            self.windows.append(self._window | {"peak": peak})
            self._window = None
        t0 = time.perf_counter()
        self.inner.push_weights(model)
        self.times["push"] += time.perf_counter() - t0
        self.model = model
        if self.vllm:
            self.sync.append(self.inner.last_sync_error)  # type: ignore[attr-defined]
            if self.cuda:
                self.free_awake.append(self._free())

    def close(self) -> None:
        """Shut a vLLM engine down (its memory is freed) and drop it."""
        if self.vllm:
            self.inner.close()  # type: ignore[attr-defined]
        self.inner = None  # type: ignore[assignment]
        gc.collect()


def update_tokens(cfg: Config, ro: Rollouts) -> tuple[int, float]:
    """(padded tokens of the update's largest micro-batch, their completion share) for rollouts `ro`, as
    troll.train.update splits them: minibatches of ceil(B / minibatches) samples, micro-batches by padded tokens."""
    width = max(len(p) for p in ro.prompt_ids) + ro.completion_ids.shape[1]
    rows = min(max(1, cfg.micro_batch_tokens // width), math.ceil(len(ro) / cfg.minibatches))
    return rows * width, ro.completion_ids.shape[1] / width


def anchor_rows(cfg: Config, ro: Rollouts) -> int:
    """Completion rows of the old policy's largest micro-batch for rollouts `ro` (troll.train.old_policy splits the
    whole batch with `Rollouts.micro_batches`)."""
    return max(len(rows) for rows in ro.micro_batches(cfg.micro_batch_tokens)) * ro.completion_ids.shape[1]


class LossWatch:
    """The run's loss, called as is; records whether it got the chunked output layer, the hidden states' dtype,
    and whether its value is finite."""

    def __init__(self, loss: Callable) -> None:
        self.loss = loss
        self.calls = self.chunked = self.finite = 0
        self.dtypes: set[str] = set()

    def __call__(self, logits: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if isinstance(logits, LMHead):
            self.chunked += 1
            self.dtypes.add(str(logits.hidden.dtype).removeprefix("torch."))
        else:
            self.dtypes.add(str(logits.dtype).removeprefix("torch."))
        value, metrics = self.loss(logits, *args, **kwargs)
        self.finite += bool(torch.isfinite(value.detach()).item())
        return value, metrics


# ----------------------------------------------------------------------------- after the run, on its live objects


def textbook_clip(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    adv: torch.Tensor,
    old: SparseDist,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    agg: str = "token-mean",
    norm_len: int | None = None,
    **unused: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip as TRL's default path computes it, the reference a GPU user already has: the whole logits [B, T, V]
    (no chunked output layer), one log-softmax over the vocabulary (bf16 / fp16 in float32) kept for backward, the
    sampled token's log-prob gathered, r = p(y) / q(y) with q(y) the old policy's at the token, loss
    agg(-min(r A, clip(r) A)). Per token, with no off-policy weight: troll.losses.ppo_clip's value and gradient."""
    if (
        isinstance(logits, LMHead)
        or unused.get("level", "token") != "token"
        or unused.get("behaviour_logp") is not None
    ):
        raise ValueError("textbook_clip takes whole logits [B, T, V], per token, with no off-policy weight")
    lp_y = torch.log_softmax(logits.to(compute_dtype(logits.dtype)), dim=-1).gather(-1, tokens[..., None])[..., 0]
    ratio = (lp_y - old.logp_at(tokens.reshape(-1)).view(mask.shape)).exp()
    a = adv[:, None].to(ratio.dtype)
    unclipped, clipped = ratio * a, ratio.clamp(1 - eps_low, 1 + eps_high) * a
    policy = aggregate(-torch.minimum(unclipped, clipped), mask, agg, norm_len)
    return policy, {
        "policy": float(policy.detach()),
        "frac_active": float(aggregate((clipped < unclipped).float(), mask)),
    }


UPDATES = ("troll", "troll_compiled", "ppo_clip", "textbook_clip")  # what compare_updates times, in its order


def compare_updates(cfg: Config, rec: Recorder, repeats: int) -> dict[str, Any]:
    """TROLL's `update` (and with the chunked output layer, `logits_chunk` > 0, TROLL's with its pass compiled:
    `compile_head`), this repository's PPO-clip's (the same chunked output layer and gather), and the textbook
    clip's (`textbook_clip`: whole logits, `logits_chunk` 0) on the run's last rollouts and trained model,
    interleaved forward then reversed per repeat after one untimed warm-up update of each, with plain SGD at
    learning rate 0 (the weights stay as they are; all pay the same step). Mean seconds per update and, on CUDA, the
    highest peak of memory allocated during a timed update above what was allocated before it (None on CPU).
    Advantages alternate +1 / -1 (a random model's rewards are mostly 0, which would make every advantage 0). The
    textbook clip is timed only per token with on-policy data (its `level`, `is_correction`); else None."""
    from troll.train import old_policy, update

    model, ro = rec.model, rec.last
    adv = torch.tensor([1.0 if b % 2 == 0 else -1.0 for b in range(len(ro))])
    gen = torch.Generator().manual_seed(cfg.seed)
    batch = Batch(ro, torch.zeros(len(ro)), adv, gen.get_state(), 0.0, 0.0)
    old = old_policy(cfg, model, ro, rec.vocab_size)
    minibatches = list(torch.randperm(len(ro), generator=gen).chunk(cfg.minibatches))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    runs = {"troll": (dataclasses.replace(cfg, loss="troll", compile_head=False), LOSSES["troll"])}
    if cfg.logits_chunk > 0:  # the chunked output layer's pass through torch.compile (troll.head)
        runs["troll_compiled"] = (dataclasses.replace(cfg, loss="troll", compile_head=True), LOSSES["troll"])
    runs["ppo_clip"] = (dataclasses.replace(cfg, loss="ppo_clip", compile_head=False), LOSSES["ppo_clip"])
    if cfg.level == "token" and cfg.is_correction == "none":
        runs["textbook_clip"] = (dataclasses.replace(cfg, loss="ppo_clip", logits_chunk=0), textbook_clip)
    cuda = cfg.device == "cuda"
    times: dict[str, list[float]] = {name: [] for name in runs}
    peaks: dict[str, int] = {name: 0 for name in runs}
    for r in range(repeats + 1):  # the first round: a warm-up of each, not timed
        for name in list(runs)[:: -1 if r % 2 else 1]:
            c, loss_fn = runs[name]
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            update(c, model, opt, sched, batch, old, minibatches, loss_fn)
            if cuda:
                torch.cuda.synchronize()
            if r:  # the timed rounds (the warm-up's compilation and first allocations not counted)
                times[name].append(time.perf_counter() - t0)
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated() - before) if cuda else 0
    mean = {name: sum(v) / len(v) for name, v in times.items()}
    out = {f"{name}_s": mean.get(name) for name in UPDATES}
    out |= {f"{name}_peak_bytes": peaks.get(name) if cuda else None for name in UPDATES}
    textbook, fused = mean.get("textbook_clip"), mean.get("troll_compiled")
    return out | {"ratio": mean["troll"] / mean["ppo_clip"], "ratio_textbook": textbook and mean["troll"] / textbook,
                  "ratio_compiled_textbook": textbook and fused and fused / textbook,
                  "updates_each": repeats, "samples": len(ro), "each_s": times}  # fmt: skip


def perturbed_push(rec: Recorder) -> tuple[float, float]:
    """Push weights visibly different from the last push (the output layer doubled), so that a push the engine did
    not take would show, then put them back (halved: exact) and push again. Returns (how far the change moved the
    trainer's probe log-probs, the engine's difference from the trainer after the push); push_weights raises if
    its own check fails."""
    gen, model = rec.inner, rec.model
    before = gen.probe_logprobs(model)[1]  # type: ignore[attr-defined]
    weight = model.get_output_embeddings().weight
    with torch.no_grad():
        weight.mul_(2.0)
    try:
        gen.push_weights(model)
        engine, ref = gen.probe_logprobs(model)  # type: ignore[attr-defined]
    finally:
        with torch.no_grad():
            weight.mul_(0.5)
    gen.push_weights(model)
    return float((ref - before).abs().max()), float((engine - ref).abs().max())


# ----------------------------------------------------------------------------- the watched run


def measure(out: Path) -> dict:
    """The run and what needs its live objects, for the settings in <out>/check.json: train with the Recorder and
    LossWatch, the pushed-weights test, the update comparison. Returns the figures (and writes <out>/measure.json);
    an exception inside the run is recorded as `error`."""
    spec = json.loads((out / "check.json").read_text())
    cfg = Config(**spec["config"])
    from troll.train import train

    watch = LossWatch(LOSSES[cfg.loss])
    recs: list[Recorder] = []
    res: dict[str, Any] = {"error": None, "times": {}}
    t0 = time.perf_counter()
    try:
        train(cfg, watch, lambda g: recs.append(Recorder(g, cfg)) or recs[-1])
    except Exception as e:  # a failure inside the run is this check's finding: report it
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    res["times"]["run (total)"] = time.perf_counter() - t0
    rec = recs[0] if recs else None
    res["watch"] = {"calls": watch.calls, "chunked": watch.chunked, "finite": watch.finite,
                    "dtypes": sorted(watch.dtypes)}  # fmt: skip
    if rec is None:
        return write_json(out / "measure.json", res)
    res |= {"vllm": rec.vllm, "sync": rec.sync, "windows": rec.windows, "times_greedy": rec.times["greedy"]}
    res |= {"free_awake": rec.free_awake, "free_asleep": rec.free_asleep}
    params = list(rec.model.parameters()) if rec.model is not None else []
    res["params"] = sum(p.numel() for p in params)
    res["trained_params"] = sum(p.numel() for p in params if p.requires_grad)  # LoRA: the adapters
    if rec.vllm and res["error"] is None:
        res["sync_tol"] = rec.inner.sync_tol  # type: ignore[attr-defined]
        try:
            res["perturbed"] = perturbed_push(rec)
        except RuntimeError as e:
            res["perturbed_error"] = str(e)
    if rec.model is not None and rec.last is not None and res["error"] is None:
        t0 = time.perf_counter()
        rec.close()
        res["update_time"] = compare_updates(cfg, rec, spec["repeats"])
        res["times"]["TROLL vs clip updates"] = time.perf_counter() - t0
    if not rec.cuda:
        res["peak_rss_gib"] = max(rec.process_peak, proc_status_bytes("VmHWM")) / memory.GIB
    return write_json(out / "measure.json", res)


def write_json(path: Path, obj: dict) -> dict:
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    return obj
