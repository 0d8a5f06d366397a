"""The single-GPU RL loop, end to end. Read top to bottom: setup, the pieces of one RL step, `rl_step`, the loop.

    python -m troll.train --preset tiny-cpu --loss troll --seed 0 --out runs/tiny-troll
    python -m troll.train --preset gsm8k-qwen2.5-0.5b --loss ppo_clip --out runs/qwen-clip      # one GPU
    python -m troll.train --out runs/tiny-troll --resume true                                   # continue

One RL step:  rollout (n samples per prompt) -> reward -> advantages -> old policy -> `epochs` passes over the
batch, each `minibatches` optimiser steps (gradient accumulation in micro-batches of <= micro_batch_tokens padded
tokens) -> [exact KL of the update, small vocabularies] -> weight push to the rollout engine -> log.

Choices, stated once:
- The command line is parsed before torch is imported: `--help` answers at once, and a bad flag is an argparse
  error (exit 2, no traceback) before any model is built or any directory written (troll.config checks it).
- Busy CPU: run as a command, this module sets OMP_WAIT_POLICY=PASSIVE (unless the environment sets it) before
  torch loads. By default OpenMP threads spin while they wait; when other processes hold the cores, a small
  model then runs up to 10x slower (the main job, then about a minute, took 4-16 minutes on a busy 2-core machine).
  Passive waiting costs nothing measurable on an idle one.
- Old policy (`--old_policy`): `recompute` (default, the paper) scores the step's rollouts with the training
  model right before the update, in its own no-grad pass, and sparsifies it; `behaviour` uses the engine's top-K
  log-probs. The pass costs one forward over the step's samples, about a third of the update's forward +
  backward (tiny-cpu, measured: 0.08 s of a 0.6 s step, the update 0.4 s). Taking the first minibatch's anchor
  from its own forward would save part of it, but only without dropout and at the price of a sample map threaded
  through the update: not worth it.
- Sparse model (`--support`): `rest` (default) puts p and q on q's kept tokens plus one exact rest atom; `paper`
  is the paper's top-K with a 1e-12 tail (troll.sparse). Every loss and every logged KL use the chosen one.
- Output layer (`--logits_chunk`): 0 gives the losses full logits [b, T, V] (small vocabularies; the reference);
  N > 0 gives them the last hidden states and the output layer (troll.head.LMHead), applied N rows at a time in
  the old-policy pass and the loss and recomputed in backward, so a micro-batch never holds [b, T, V] (151,936
  columns for Qwen: 10 GB of float32 logits at 16k tokens).
- Update epochs (`--epochs`, PPO's update epochs, TRL's num_iterations): each pass over the step's samples is a
  fresh shuffle into `minibatches` optimiser steps; the old policy is computed once, before the first pass, so
  every minibatch after the first is off-policy (the network has moved, the anchor has not). Off-policyness is
  minibatches x epochs optimiser steps per batch; the lr schedule runs over steps x epochs x minibatches.
- Everything random in step s is seeded from (seed, s): the prompts drawn, the sampler, and the shuffles of
  epochs 1, 2, ... drawn in turn from that generator (epoch 1's split is the one a run without --epochs makes).
  So a resumed run repeats exactly what the uninterrupted run would have done (tests check the next step).
- The network's own KL per update (`--kl_update_vocab`, default 4096): when the vocabulary has at most that many
  tokens, after the step's updates one more no-grad forward over the step's samples gives the exact
  KL(p_new || p_old) over all V at every real completion token (temperature-scaled, as sampled), logged as
  kl_update_mean / kl_update_max. The losses' kl_before_* see the sparse model and only during the update; this
  is the dense truth of where the step left the network. p_old's full log-probs [B*T, V] are kept from the
  old-policy pass (recompute; behaviour: one extra no-grad pass). Cost: one forward, as the old-policy pass
  (tiny-cpu: about 0.04 s of a 0.35 s step), and B*T*V floats on CPU (1.3 MB on tiny-cpu). GSM8K's 152k-token
  vocabulary is over the limit, so those runs never pay for it.
- A step whose gradient norm is not finite is skipped (no optimiser step) and counted (`skipped_steps`).
- Warm-start (`--sft_steps`, `--sft_target`): supervised steps on reference solutions before RL, stopped once
  greedy decoding solves `sft_target` of a probe of training problems (troll.warmstart), so every seed starts RL
  from about the same accuracy; the GSM8K presets start from the instruct model instead (`sft_steps` 0).
- Evaluation is greedy pass@1 on held-out problems through the generator's own `greedy` (transformers, or the
  vLLM engine), the path troll.evaluate uses. The first one runs before RL, after the warm-start.
- Run directory (`--out`): config.json; metrics.jsonl: one row per RL step, and one row per evaluation
  `{"step", "eval_acc"}`, the first at step 0; samples.jsonl (a few completions per evaluation);
  checkpoints/ (troll.checkpoint: atomic, the last two kept, trainer.pt holds optimiser, scheduler and the
  run's state); summary.json (eval_before, eval_after = the last evaluation, eval_best and its step,
  the warm-start's record sft_*, wall-clock over all sessions); tensorboard/ with `--log_to tensorboard`.
- `--log_to tensorboard|wandb` also sends every metrics row there (troll.metrics.Logger, imported only then; a
  missing package is an error before any work, naming the install command). metrics.jsonl stays the record.
- Resume continues from checkpoints/latest; metrics and samples rows past it are dropped (the resumed run
  writes them again). A finished run (latest checkpoint at --steps, summary.json written) is left untouched:
  resuming it says so and returns its summary; pass a larger --steps to go on.
"""

from __future__ import annotations

import os

from troll.config import Config

if __name__ == "__main__":  # parse first, then import torch (module docstring)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    CLI_CONFIG = Config.from_args()

import json
import math
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm.auto import tqdm

from troll import addition, gsm8k, memory
from troll.advantages import advantages
from troll.checkpoint import append_jsonl, latest_checkpoint, save_checkpoint, truncate_jsonl
from troll.evaluate import decode, encode, score
from troll.head import LMHead, Logits
from troll.losses import LOSSES
from troll.metrics import Logger, logger_missing, merge
from troll.policy import build_model, completion_logits
from troll.rollout import Generator, HFGenerator, Rollouts
from troll.sparse import SparseDist, cat_rows, sparsify, sparsify_topk
from troll.warmstart import warm_start

LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]  # the signature of troll.losses.LOSSES

# ----------------------------------------------------------------------------- setup


@dataclass
class Task:
    train: list[dict]  # rows with question, answer (reference solution), gold
    test: list[dict]
    prompt: Callable[[str], str]  # question -> prompt text (special tokens included)
    reward: Callable[[str, str], float]  # (completion text, gold) -> 0/1


def load_task(cfg: Config, tokenizer: Any) -> tuple[Task, dict[str, int]]:
    """The task's data, prompt template and reward; prompts longer than max_prompt_len are dropped (counted)."""
    if cfg.task == "addition":
        train, test = (addition.problems(split, reverse=cfg.reverse_sum) for split in ("train", "test"))
        task = Task(train, test, lambda q: q, addition.reward)
    else:
        task = Task(
            gsm8k.load_gsm8k("train", cfg.data),
            gsm8k.load_gsm8k("test", cfg.data),
            lambda q: gsm8k.make_prompt(q, tokenizer, chat=cfg.chat),
            gsm8k.reward,
        )
    if cfg.eval_size:
        task.test = task.test[: cfg.eval_size]
    dropped = {}
    for split in ("train", "test"):
        rows = getattr(task, split)
        keep = [r for r in rows if len(encode(tokenizer, [task.prompt(r["question"])])[0]) <= cfg.max_prompt_len]
        if not keep:
            raise ValueError(f"every {split} prompt is longer than max_prompt_len={cfg.max_prompt_len}")
        dropped[split] = len(rows) - len(keep)
        setattr(task, split, keep)
    return task, dropped


def make_generator(cfg: Config, model: Any, tokenizer: Any, out: Path) -> Generator:
    """The rollout backend: the training model itself (hf), or a vLLM engine that follows its weights."""
    if cfg.backend == "hf":
        return HFGenerator(model, tokenizer)
    from troll.vllm_engine import VLLMGenerator

    init = out / "engine-init"  # the engine loads once from disk; every later update is pushed in place
    model.save_pretrained(init)
    tokenizer.save_pretrained(init)
    gen = VLLMGenerator(
        init,
        tokenizer,
        max_model_len=cfg.max_prompt_len + cfg.max_new_tokens,
        max_top_k=cfg.k,
        dtype="float32" if model.device.type == "cpu" else "bfloat16",
        seed=cfg.seed,
        gpu_memory_utilization=cfg.vllm_gpu_memory,
    )
    gen.push_weights(model)
    return gen


def make_optimizer(cfg: Config, model: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule: linear warmup over warmup_steps, then constant or cosine to 0 (optimiser steps)."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.steps * cfg.epochs * cfg.minibatches

    def factor(i: int) -> float:
        warm = min(1.0, (i + 1) / max(cfg.warmup_steps, 1))
        return warm * (0.5 * (1 + math.cos(math.pi * min(i / total, 1.0))) if cfg.lr_schedule == "cosine" else 1.0)

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def sft_warmstart(cfg: Config, model: Any, tokenizer: Any, task: Task) -> dict:
    """The supervised warm-start (troll.warmstart) on the task's training problems; prints and returns its record."""
    warm = warm_start(
        model,
        tokenizer,
        task.train,
        task.prompt,
        steps=cfg.sft_steps,
        lr=cfg.sft_lr,
        batch=cfg.sft_batch,
        seed=cfg.seed,
        target=cfg.sft_target,
    )
    line = (
        f"supervised warm-start: {warm['sft_steps_run']} steps, final loss {warm['sft_loss']:.3f}, "
        f"greedy solves {warm['sft_probe_acc']:.3f} of the training probe"
    )
    if cfg.sft_target:
        line += f" (target {cfg.sft_target}: {'reached' if warm['sft_reached'] else 'NOT reached'})"
    print(line)
    return warm


# ----------------------------------------------------------------------------- the pieces of one RL step


def policy_logits(cfg: Config, model: Any, ro: Rollouts, rows: torch.Tensor, vocab: int) -> Logits:
    """Current policy's temperature-scaled logits [b, T, V] at the completion positions of samples `rows`, or with
    `logits_chunk` the same as a chunked output layer over the hidden states (head.LMHead)."""
    device = next(model.parameters()).device
    prompts = [ro.prompt_ids[i] for i in rows.tolist()]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        return completion_logits(model, prompts, ro.completion_ids[rows], ro.temperature, vocab, cfg.logits_chunk)


def micro_batches(ro: Rollouts, max_tokens: int, rows: torch.Tensor) -> list[torch.Tensor]:
    """Split `rows` into chunks of at most max_tokens padded tokens (prompt + completion) each."""
    width = max(len(p) for p in ro.prompt_ids) + ro.completion_ids.shape[1]
    per = max(1, max_tokens // width)
    return [rows[i : i + per] for i in range(0, len(rows), per)]


def full_logp(x: Logits) -> Tensor:
    """Log-probs over the whole vocabulary of 2-D logits or a 2-D head, [N, V] float32 on CPU (small V only)."""
    return torch.log_softmax((x.logits() if isinstance(x, LMHead) else x).float(), -1).cpu()


def model_logp(cfg: Config, model: Any, ro: Rollouts, vocab: int) -> Tensor:
    """The model's full log-probs at all B*T completion positions of `ro`, [B*T, V], no gradient, on CPU."""
    out = []
    with torch.no_grad():
        for rows in micro_batches(ro, cfg.micro_batch_tokens, torch.arange(len(ro))):
            logits = policy_logits(cfg, model, ro, rows, vocab)
            out.append(full_logp(logits.reshape(-1, logits.shape[-1])))
    return torch.cat(out)


def dense_kl(lp: Tensor, lq: Tensor) -> Tensor:
    """KL(p || q) per row from full log-probs [N, V] -> [N]; ids that p gives 0 (masked padding) add nothing."""
    return torch.where(lp > -math.inf, lp.exp() * (lp - lq), 0.0).sum(-1)


def update_kl(cfg: Config, model: Any, ro: Rollouts, vocab: int, before: Tensor) -> dict[str, float]:
    """Exact KL(p_new || p_old) over the vocabulary at every real completion token, p_old = `before` [B*T, V]
    (module docstring): its mean and max."""
    kl = dense_kl(model_logp(cfg, model, ro, vocab), before).view(ro.completion_mask.shape)[ro.completion_mask]
    return {"kl_update_mean": float(kl.mean()), "kl_update_max": float(kl.max())}


def old_policy(
    cfg: Config, model: Any, ro: Rollouts, vocab: int, dense: bool = False
) -> tuple[SparseDist, Tensor | None]:
    """The trust region's anchor over all B*T completion positions of `ro`, on CPU (module docstring), and with
    `dense` the model's own full log-probs there, [B*T, V] (recompute: from the same pass), else None."""
    tokens = ro.completion_ids.reshape(-1)
    if cfg.old_policy == "behaviour":
        top_idx, top_logp, tok_logp = ro.top_idx.clone(), ro.top_logp.clone(), ro.logprobs.clone()
        pad = ~ro.completion_mask  # padding: a valid one-hot distribution on the padding id, masked later
        top_logp[pad] = -math.inf
        top_logp[..., 0][pad], top_idx[..., 0][pad], tok_logp[pad] = 0.0, ro.completion_ids[pad], 0.0
        k = top_idx.shape[-1]
        anchor = sparsify_topk(
            top_logp.view(-1, k), top_idx.view(-1, k), tok_logp.view(-1), tokens, vocab, delta=cfg.delta
        )
        return anchor, model_logp(cfg, model, ro, vocab) if dense else None
    dists, full = [], []
    with torch.no_grad():
        for rows in micro_batches(ro, cfg.micro_batch_tokens, torch.arange(len(ro))):
            logits = policy_logits(cfg, model, ro, rows, vocab)
            logits = logits.reshape(-1, logits.shape[-1])
            ids = ro.completion_ids[rows].reshape(-1).to(logits.device)
            dists.append(sparsify(logits, ids, k=cfg.k, delta=cfg.delta).to("cpu"))
            if dense:
                full.append(full_logp(logits))
    return cat_rows(dists), torch.cat(full) if dense else None


def loss_kwargs(cfg: Config) -> dict:
    """The config's settings for the chosen loss (each loss takes only its own)."""
    own = {
        "troll": {"eps": cfg.eps, "alpha": cfg.alpha, "level": cfg.level},
        "ppo_clip": {"eps_low": cfg.clip_low, "eps_high": cfg.clip_high, "level": cfg.level},
        "dppo": {"divergence": cfg.dppo_divergence},
        "cispo": {"eps_high": cfg.clip_high},
    }
    return {"k": cfg.k, "delta": cfg.delta, "support": cfg.support} | own[cfg.loss]


def update(
    cfg: Config,
    model: Any,
    opt: Any,
    sched: Any,
    ro: Rollouts,
    adv: torch.Tensor,
    old: SparseDist,
    minibatches: Sequence[torch.Tensor],
    loss_fn: LossFn,
) -> tuple[dict[str, float], int]:
    """One optimiser step per minibatch (sample indices; all epochs' minibatches in turn); `old` holds every
    sample's B*T rows, in sample order.

    Returns the merged loss metrics (troll.metrics: micro-batches weighted by their share of the minibatch) and
    the number of skipped optimiser steps.
    """
    device = next(model.parameters()).device
    T = ro.completion_ids.shape[1]
    kwargs = loss_kwargs(cfg)
    parts: list[tuple[float, dict[str, float]]] = []
    skipped = 0
    for minibatch in minibatches:
        opt.zero_grad(set_to_none=True)
        minibatch_tokens = int(ro.completion_mask[minibatch].sum())
        for rows in micro_batches(ro, cfg.micro_batch_tokens, minibatch):
            logits = policy_logits(cfg, model, ro, rows, old.vocab_size)
            anchor = old.select((rows[:, None] * T + torch.arange(T)).reshape(-1)).to(device)
            mask = ro.completion_mask[rows]
            loss, m = loss_fn(
                logits,
                ro.completion_ids[rows].to(device),
                mask.to(device),
                adv[rows].to(device),
                anchor,
                agg=cfg.agg,
                norm_len=T,
                **kwargs,
            )
            # weight each micro-batch by its share of the minibatch, so the sum is the minibatch's aggregate
            tokens_share = int(mask.sum()) / max(minibatch_tokens, 1)
            share = tokens_share if cfg.agg == "token-mean" else len(rows) / len(minibatch)
            (loss * share).backward()
            parts.append((share, m))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if not torch.isfinite(norm):
            skipped += 1
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
        sched.step()
        parts.append((1.0, {"grad_norm": float(norm)}))
    return merge(parts), skipped


def evaluate(cfg: Config, generator: Generator, tokenizer: Any, task: Task) -> tuple[float, list[dict]]:
    """Greedy pass@1 on the held-out problems, and one record per problem."""
    prompts = encode(tokenizer, [task.prompt(r["question"]) for r in task.test])
    return score(task.test, decode(tokenizer, generator.greedy(prompts, cfg.max_new_tokens)), task.reward)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # ru_maxrss is in KiB on Linux


def rl_step(
    cfg: Config,
    step: int,
    model: Any,
    tokenizer: Any,
    generator: Generator,
    opt: Any,
    sched: Any,
    task: Task,
    loss_fn: LossFn | None = None,
) -> dict:
    """One RL step; returns its metrics row. `loss_fn` (default LOSSES[cfg.loss]) is the seam for another loss
    with the same signature, or a timed one (bench/step.py)."""
    t0 = time.time()
    seed = cfg.seed * 1_000_003 + step
    gen = torch.Generator().manual_seed(seed)
    rows = [task.train[i] for i in torch.randint(len(task.train), (cfg.prompts_per_step,), generator=gen).tolist()]
    prompts = encode(tokenizer, [task.prompt(r["question"]) for r in rows])
    behaviour_k = cfg.k if cfg.old_policy == "behaviour" else 0
    ro = generator.generate(
        prompts, cfg.samples_per_prompt, cfg.max_new_tokens, cfg.temperature, top_k_logprobs=behaviour_k, seed=seed
    )
    t1 = time.time()
    lengths = ro.completion_mask.sum(-1)  # real tokens come first in every row
    texts = decode(tokenizer, [ids[:n] for ids, n in zip(ro.completion_ids.tolist(), lengths.tolist(), strict=True)])
    golds = [rows[int(g)]["gold"] for g in ro.group]
    rewards = torch.tensor([task.reward(t, g) for t, g in zip(texts, golds, strict=True)], dtype=torch.float32)
    adv = advantages(cfg.advantage, rewards, ro.group)
    t2 = time.time()
    dense = len(tokenizer) <= cfg.kl_update_vocab
    old, before = old_policy(cfg, model, ro, len(tokenizer), dense=dense)
    t3 = time.time()
    minibatches = [
        mb for _ in range(cfg.epochs) for mb in torch.randperm(len(ro), generator=gen).chunk(cfg.minibatches)
    ]
    metrics, skipped = update(cfg, model, opt, sched, ro, adv, old, minibatches, loss_fn or LOSSES[cfg.loss])
    t4 = time.time()
    if before is not None:
        metrics |= update_kl(cfg, model, ro, len(tokenizer), before)
    t_kl = time.time()
    generator.push_weights(model)
    t5 = time.time()
    lengths = lengths.float()
    return {
        "step": step + 1,
        "reward": float(rewards.mean()),
        "accuracy": float((rewards > 0.5).float().mean()),
        "response_len_mean": float(lengths.mean()),
        "response_len_max": float(lengths.max()),
        "truncated_frac": float((~ro.finished).float().mean()),
        "lr": sched.get_last_lr()[0],
        "skipped": skipped,
        **metrics,
        "time_generate": t1 - t0,
        "time_score": t2 - t1,
        "time_old_policy": t3 - t2,
        "time_update": t4 - t3,
        "time_kl_update": t_kl - t4,
        "time_sync": t5 - t_kl,
        "tokens_per_s": float(lengths.sum()) / (t5 - t0),
        "peak_memory_mb": peak_memory_mb(next(model.parameters()).device),
    }


# ----------------------------------------------------------------------------- the loop


def auto_micro_batch(cfg: Config, device: torch.device) -> int:
    """`--micro_batch_tokens auto`: the largest micro-batch troll.memory's fitted model says this GPU holds (beside
    vLLM's share, with the chunked output layer if `logits_chunk`); on CPU the default, 4096."""
    if device.type != "cuda":
        return Config.micro_batch_tokens
    gib = torch.cuda.get_device_properties(device).total_memory / memory.GIB
    vllm = cfg.vllm_gpu_memory if cfg.backend == "vllm" else 0.0
    return memory.micro_batch_tokens(cfg.model, gib, vllm, cfg.grad_checkpointing, chunked=cfg.logits_chunk > 0)


def train(cfg: Config) -> dict:
    """Run (or resume) the RL loop of `cfg`; returns the summary written to <out>/summary.json."""
    t_start, out = time.time(), Path(cfg.out)
    if missing := logger_missing(cfg.log_to):  # before any work, as the command line does
        raise ImportError(missing)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if cfg.device == "auto" else cfg.device)
    if cfg.resume:
        ckpt = latest_checkpoint(out)
        state = torch.load(ckpt / "trainer.pt", weights_only=False)
        if state["step"] >= cfg.steps and (out / "summary.json").is_file():
            print(f"{out} finished at step {state['step']} (--steps {cfg.steps}): nothing to do, nothing changed")
            return json.loads((out / "summary.json").read_text())
        model, tokenizer = build_model(cfg, device, path=str(ckpt))
        first = state["eval_before"]  # checkpoints written before the best evaluation was tracked lack these keys
        state = {"eval_after": first, "eval_best": first, "eval_best_step": 0, "dropped_test_prompts": 0} | state
    else:
        if (out / "checkpoints").exists():
            raise FileExistsError(f"{out} already holds a run: pass --resume true or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        model, tokenizer = build_model(cfg, device)
        state = None
    if cfg.micro_batch_tokens == 0:
        cfg = replace(cfg, micro_batch_tokens=auto_micro_batch(cfg, device))
        print(f"micro_batch_tokens auto: {cfg.micro_batch_tokens}")
    cfg.save(out / "config.json")
    task, dropped = load_task(cfg, tokenizer)
    opt, sched = make_optimizer(cfg, model)
    generator = make_generator(cfg, model, tokenizer, out)
    metrics_path, samples_path = out / "metrics.jsonl", out / "samples.jsonl"
    logger = Logger(cfg.log_to, out, asdict(cfg))
    if state is None:
        metrics_path.write_text("")
        samples_path.write_text("")
        warm = {}
        if cfg.sft_steps:
            warm = sft_warmstart(cfg, model, tokenizer, task)
            generator.push_weights(model)
        acc, records = evaluate(cfg, generator, tokenizer, task)
        append_jsonl(metrics_path, [{"step": 0, "eval_acc": acc}])
        logger.log({"step": 0, "eval_acc": acc})
        append_jsonl(samples_path, [{"step": 0, **r} for r in records[: cfg.samples_to_log]])
        state = {"step": 0, "eval_before": acc, "eval_after": acc, "eval_best": acc, "eval_best_step": 0, **warm}
        state |= {"skipped_steps": 0, "dropped_prompts": dropped["train"], "dropped_test_prompts": dropped["test"]}
        save_checkpoint(out, model, tokenizer, opt, sched, state | {"wall_clock_s": time.time() - t_start})
    else:
        opt.load_state_dict(state.pop("optimizer"))
        sched.load_state_dict(state.pop("scheduler"))
        t_start -= state.pop("wall_clock_s", 0.0)  # the clock runs on from the checkpoint's
        truncate_jsonl(metrics_path, state["step"])
        truncate_jsonl(samples_path, state["step"])
    print(f"eval before RL: {state['eval_before']:.3f} on {len(task.test)} held-out problems")
    bar = tqdm(range(state["step"], cfg.steps), desc=f"rl/{cfg.loss}", initial=state["step"], total=cfg.steps)
    for step in bar:
        row = rl_step(cfg, step, model, tokenizer, generator, opt, sched, task)
        state["step"], state["skipped_steps"] = step + 1, state["skipped_steps"] + row["skipped"]
        rows = [row]
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            acc, records = evaluate(cfg, generator, tokenizer, task)
            rows.append({"step": step + 1, "eval_acc": acc})
            append_jsonl(samples_path, [{"step": step + 1, **r} for r in records[: cfg.samples_to_log]])
            state["eval_after"] = acc
            if acc > state["eval_best"]:
                state["eval_best"], state["eval_best_step"] = acc, step + 1
        append_jsonl(metrics_path, rows)
        for r in rows:
            logger.log(r)
        bar.set_postfix(
            reward=f"{row['reward']:.2f}", acc=f"{state['eval_after']:.2f}", kl=f"{row['kl_after_max']:.3f}"
        )
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(out, model, tokenizer, opt, sched, state | {"wall_clock_s": time.time() - t_start})
    logger.close()
    summary = {k: v for k, v in state.items() if k != "step"}
    summary |= {"wall_clock_s": round(time.time() - t_start, 1), "steps": cfg.steps, "loss": cfg.loss}
    summary |= {"seed": cfg.seed, "eval_problems": len(task.test)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"eval: {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} (best {summary['eval_best']:.3f} at "
        f"step {summary['eval_best_step']}) in {summary['wall_clock_s']} s; {out / 'summary.json'}"
    )
    return summary


def main(argv: list[str] | None = None) -> dict:
    return train(Config.from_args(argv))


if __name__ == "__main__":
    train(CLI_CONFIG)
