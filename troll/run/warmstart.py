"""The supervised warm-start: fit the reference solutions until greedy decoding solves a target share of problems.

    minimise  -(1/|A|) sum_{t in A} log p(a_t | prompt, a_<t)      A = the answer tokens and eos, [b, T] masked
    stop at the first step s <= sft_steps with  solved(batch_s) >= sft_target  and  solved(probe) >= sft_target

RL improves a policy that already solves some problems, so the tiny task starts from a supervised warm-start
(an LLM starts from its pretraining). How far that warm-start gets decides what RL can show, and on two-digit
addition a fixed step count does not fix it: the tiny model learns the carry in a sudden jump whose timing
depends on the seed, so a fixed count leaves seeds far apart. The warm-start runs until a target is met instead,
which lands every seed in a narrow band after a seed-dependent number of steps (a target:
docs/results.md#the-main-job-tiny-cpu; a fixed count: docs/results.md#the-trust-region-study):

- `solved(rows)` [b] bool: greedy decoding reproduces the reference answer and its eos exactly. One teacher-forced
  forward [b, T, V] gives it: greedy decoding emits the reference iff, at every answer position, the reference
  token is the argmax given the reference prefix (the first mismatch is where greedy leaves it). For addition
  this is greedy pass@1 (the reward is an exact match); for GSM8K it is stricter (the reference's wording).
- The probe is the first `probe` training problems (the split is shuffled), never the held-out ones. A forward
  over 1,024 problems costs about three supervised steps of 128, so it is not run every step: each step's own
  teacher-forced logits already tell which of the batch's problems greedy solved (before that step's update, a
  free and noisy estimate), and only when that share reaches the target does the probe decide. The warm-start
  stops at the first step where both say so, a little past the target.
- `sft_target = 0` runs all `sft_steps`; a target not met within `sft_steps` is reported, not an error.
- AdamW at `sft_lr` (`adamw`: torch's fused kernel on CPU and CUDA, the same update to float rounding and 3-5x faster
  than its per-tensor loop over SmolLM2's 134.5M weights on CPU), batches of `sft_batch` training problems drawn
  with replacement from a generator seeded by `seed`, so a warm-start is reproducible from the config.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from troll.policy import completion_logits
from troll.tasks.task import Task, encode


def answer_batch(
    tokenizer: Any, rows: Sequence[dict], prompt: Callable[[str], str]
) -> tuple[list[list[int]], Tensor, Tensor]:
    """Prompt ids, reference answer ids + eos right-padded [b, T] (long), and their mask [b, T] (True: real)."""
    prompts = encode(tokenizer, [prompt(r["question"]) for r in rows])
    answers = [ids + [tokenizer.eos_token_id] for ids in encode(tokenizer, [r["answer"] for r in rows])]
    width = max(len(a) for a in answers)
    ids = torch.tensor([a + [tokenizer.pad_token_id] * (width - len(a)) for a in answers])
    mask = torch.tensor([[j < len(a) for j in range(width)] for a in answers])
    return prompts, ids, mask


def solved_rows(logits: Tensor, answers: Tensor, mask: Tensor) -> Tensor:
    """[b] bool from teacher-forced logits [b, T, V]: the answer ids [b, T] are the argmax wherever mask [b, T]."""
    return ((logits.argmax(-1) == answers) | ~mask).all(-1)


@torch.no_grad()
def greedy_solves(model: Any, prompts: list[list[int]], answers: Tensor, mask: Tensor, vocab_size: int) -> Tensor:
    """[b] bool: greedy decoding from each prompt yields exactly its answer (ids [b, T] ending in eos, mask [b, T])."""
    logits = completion_logits(model, prompts, answers, 1.0, vocab_size)
    return solved_rows(logits, answers.to(logits.device), mask.to(logits.device))


def solved(model: Any, batch: tuple[list[list[int]], Tensor, Tensor], vocab_size: int, rows: int = 64) -> float:
    """The share of `batch` (answer_batch's output) that greedy decoding solves, `rows` problems a forward (a real
    vocabulary's [rows, T, V] logits stay small)."""
    prompts, answers, mask = batch
    hits = [
        greedy_solves(model, prompts[i : i + rows], answers[i : i + rows], mask[i : i + rows], vocab_size)
        for i in range(0, len(prompts), rows)
    ]
    return float(torch.cat(hits).float().mean())


def adamw(params: list[torch.nn.Parameter], **kwargs: float) -> torch.optim.AdamW:
    """torch's AdamW over `params`, fused where torch has the kernel (every weight on CPU or CUDA): the same update as
    its default loop to float rounding (tests/test_warmstart.py), in one pass over all weights."""
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, fused=fused, **kwargs)


def warm_start(
    model: Any,
    tokenizer: Any,
    rows: Sequence[dict],
    prompt: Callable[[str], str],
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    target: float = 0.0,
    probe: int = 1024,
) -> dict:
    """Supervised steps on `rows` (dicts with question and answer) until the probe's solved share reaches `target`
    or `steps` are done. Returns {"sft_steps_run", "sft_loss" (the last step's), "sft_probe_acc", "sft_reached"}."""
    if not 0.0 <= target <= 1.0:
        raise ValueError(f"target must be in [0, 1], got {target}")
    device = next(model.parameters()).device
    vocab = len(tokenizer)
    opt = adamw(list(model.parameters()), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    probe_batch = answer_batch(tokenizer, rows[:probe], prompt)
    loss, done = math.nan, 0
    bar = tqdm(range(steps), desc="sft", leave=False, disable=None)  # a bar on a terminal only
    for _ in bar:
        done += 1  # counted, not the loop variable: it is read after the loop
        drawn = [rows[i] for i in torch.randint(len(rows), (batch,), generator=gen).tolist()]
        prompts, ids, mask = answer_batch(tokenizer, drawn, prompt)
        ids, mask = ids.to(device), mask.to(device)
        logits = completion_logits(model, prompts, ids, 1.0, vocab)
        nll = -torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
        step_loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        step_loss.backward()
        opt.step()
        loss = float(step_loss.detach())
        if target:
            trigger = float(solved_rows(logits.detach(), ids, mask).float().mean())
            bar.set_postfix(loss=f"{loss:.3f}", solved=f"{trigger:.2f}")
            if trigger >= target:  # the batch just fitted says the target may be met: the probe decides
                acc = solved(model, probe_batch, vocab)
                if acc >= target:
                    break
    else:  # no early stop: probe the final model
        acc = solved(model, probe_batch, vocab) if steps else math.nan
    return {"sft_steps_run": done, "sft_loss": loss, "sft_probe_acc": acc, "sft_reached": bool(acc >= target)}


def warm_start_task(cfg: Any, model: Any, tokenizer: Any, task: Task) -> dict:
    """`warm_start` on a task's training problems with a run's settings (a troll.base.config.Config); prints and returns
    its record."""
    warm = warm_start(
        model, tokenizer, task.train, task.prompt, steps=cfg.sft_steps, lr=cfg.sft_lr, batch=cfg.sft_batch,
        seed=cfg.seed, target=cfg.sft_target, probe=cfg.sft_probe,
    )  # fmt: skip
    line = f"supervised warm-start: {warm['sft_steps_run']} steps, final loss {warm['sft_loss']:.3f}, greedy solves "
    line += f"{warm['sft_probe_acc']:.3f} of the training probe"
    if cfg.sft_target:
        line += f" (target {cfg.sft_target}: {'reached' if warm['sft_reached'] else 'NOT reached'})"
    print(line)
    return warm
