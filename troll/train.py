"""The single-GPU RL loop, end to end.

    python -m troll.train --preset tiny-cpu --loss troll --seed 0 --out runs/tiny-troll
    python -m troll.train --preset gsm8k-qwen2.5-0.5b --loss ppo_clip --out runs/qwen-clip      # one GPU
    python -m troll.train --out runs/tiny-troll --resume true                                   # continue

One RL step:  rollout (n samples per prompt) -> reward -> advantages -> old policy -> `minibatches` optimiser
steps over the batch (gradient accumulation in micro-batches of <= micro_batch_tokens padded tokens) ->
weight push to the rollout engine -> log.

Choices, stated once:
- Old policy (`--old_policy`): `recompute` (default, the paper) scores the rollouts with the training model
  right before the update, no grad, and sparsifies it; `behaviour` uses the engine's top-K log-probs.
  With `recompute` and a deterministic model (no dropout can fire), the first minibatch's own forward pass,
  taken before any optimiser step, *is* that recomputation (same weights, same inputs): its detached logits
  give those samples' old policy, and the no-grad pass only scores the other minibatches (none when
  minibatches = 1). `old_policy_from_forward` decides; tests check the metrics equal full recomputation's.
- Everything random in step s is seeded from (seed, s): the prompts drawn, the sampler. So a resumed run
  repeats exactly what the uninterrupted run would have done (tests check the next step's metrics).
- A step whose gradient norm is not finite is skipped (no optimiser step) and counted (`skipped_steps`).
- Run directory (`--out`): config.json, metrics.jsonl (one line per step, plus `eval` lines), samples.jsonl
  (a few completions per evaluation), checkpoints/step-NNNNNN (HF `save_pretrained` + trainer.pt with
  optimiser, scheduler, step) and checkpoints/latest, summary.json (eval_before, eval_after, wall-clock).
  A checkpoint is written to a temporary folder and renamed into place, and `latest` is replaced
  atomically, so a crash during a save never damages the last good checkpoint. The last two are kept.
- `tiny-cpu` builds a 0.6M-parameter Llama and a byte-level tokenizer locally, warm-starts it with a few
  hundred supervised steps on addition, then runs RL; evaluation is greedy pass@1 on held-out problems.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from troll import addition, gsm8k
from troll.advantages import advantages
from troll.config import Config
from troll.evaluate import decode, encode, greedy_hf, score
from troll.losses import LOSSES
from troll.rollout import HFGenerator, Rollouts, completion_logits
from troll.sparse import SparseDist, cat_rows, sparsify, sparsify_topk


@dataclass
class Task:
    train: list[dict]  # rows with question, answer (reference solution), gold
    test: list[dict]
    prompt: Callable[[str], str]  # question -> prompt text (special tokens included)
    reward: Callable[[str, str], float]  # (completion text, gold) -> 0/1


def load_task(cfg: Config, tokenizer: Any) -> tuple[Task, int]:
    """The task's data, prompt template and reward; also how many prompts were dropped as too long."""
    if cfg.task == "addition":
        task = Task(addition.problems("train"), addition.problems("test"), lambda q: q, addition.reward)
    elif cfg.task == "gsm8k":
        task = Task(
            gsm8k.load_gsm8k("train", cfg.data),
            gsm8k.load_gsm8k("test", cfg.data),
            lambda q: gsm8k.make_prompt(q, tokenizer, chat=cfg.chat),
            gsm8k.reward,
        )
    else:
        raise ValueError(f"unknown task {cfg.task!r}: addition or gsm8k")
    keep = [r for r in task.train if len(encode(tokenizer, [task.prompt(r["question"])])[0]) <= cfg.max_prompt_len]
    dropped, task.train = len(task.train) - len(keep), keep
    if not keep:
        raise ValueError(f"every training prompt is longer than max_prompt_len={cfg.max_prompt_len}")
    if cfg.eval_size:
        task.test = task.test[: cfg.eval_size]
    return task, dropped


def build_model(cfg: Config, device: torch.device, path: str | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): the tiny local Llama, or `path` / cfg.model through transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path is None and cfg.model == "tiny":
        from troll.tiny import tiny_llama, train_tokenizer

        tokenizer = train_tokenizer(addition.corpus(), vocab_size=64)  # bytes only: one token per character
        model = tiny_llama(tokenizer, hidden=128, layers=2, heads=4, seed=cfg.seed)
    else:
        src = path or cfg.model
        tokenizer = AutoTokenizer.from_pretrained(src)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()  # from_pretrained returns eval mode, in which gradient checkpointing does nothing
    return model.to(device), tokenizer


def make_generator(cfg: Config, model: Any, tokenizer: Any, out: Path) -> Any:
    if cfg.backend == "hf":
        return HFGenerator(model, tokenizer)
    if cfg.backend == "vllm":
        from troll.rollout import VLLMGenerator

        init = out / "engine-init"  # the engine loads once from disk; every later update is pushed in place
        model.save_pretrained(init)
        tokenizer.save_pretrained(init)
        gen = VLLMGenerator(
            init,
            tokenizer,
            max_model_len=cfg.max_prompt_len + cfg.max_new_tokens,
            max_top_k=max(cfg.k, 1),
            dtype="float32" if model.device.type == "cpu" else "bfloat16",
            seed=cfg.seed,
            gpu_memory_utilization=cfg.vllm_gpu_memory,
        )
        gen.push_weights(model)
        return gen
    raise ValueError(f"unknown backend {cfg.backend!r}: hf or vllm")


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(out: Path, step: int, model: Any, tokenizer: Any, opt: Any, sched: Any, state: dict) -> Path:
    """Write checkpoints/step-NNNNNN atomically, point `latest` at it, keep the last two."""
    root = out / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step-{step:06d}"
    tmp = root / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": step, **state}, tmp / "trainer.pt"
    )
    shutil.rmtree(root / name, ignore_errors=True)
    os.replace(tmp, root / name)
    (root / "latest.tmp").write_text(name)
    os.replace(root / "latest.tmp", root / "latest")
    for old in sorted(p for p in root.glob("step-*") if p.name != name)[:-1]:
        shutil.rmtree(old, ignore_errors=True)
    return root / name


def latest_checkpoint(out: Path) -> Path:
    """The folder `checkpoints/latest` names; a clear error when it is missing or incomplete."""
    pointer = out / "checkpoints" / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from: {pointer} does not exist")
    ckpt = out / "checkpoints" / pointer.read_text().strip()
    missing = [f for f in ("trainer.pt", "config.json") if not (ckpt / f).is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {ckpt} is incomplete or corrupt (missing {', '.join(missing)})")
    return ckpt


# ----------------------------------------------------------------------------- one RL step


def old_policy(cfg: Config, model: Any, ro: Rollouts, vocab: int) -> SparseDist:
    """The anchor of the trust region over all B*T completion positions of `ro` (see module docstring)."""
    tokens = ro.completion_ids.reshape(-1)
    if cfg.old_policy == "behaviour":
        if ro.top_idx is None:
            raise ValueError("old_policy=behaviour needs rollouts with top-K log-probs (k > 0)")
        top_idx, top_logp, tok_logp = ro.top_idx.clone(), ro.top_logp.clone(), ro.logprobs.clone()
        pad = ~ro.completion_mask  # padding: a valid one-hot distribution on the padding id, masked later
        top_logp[pad] = -math.inf
        top_logp[..., 0][pad], top_idx[..., 0][pad], tok_logp[pad] = 0.0, ro.completion_ids[pad], 0.0
        k = top_idx.shape[-1]
        return sparsify_topk(
            top_logp.view(-1, k), top_idx.view(-1, k), tok_logp.view(-1), tokens, vocab, delta=cfg.delta
        )
    if cfg.old_policy != "recompute":
        raise ValueError(f"unknown old_policy {cfg.old_policy!r}: recompute or behaviour")
    dists = []
    with torch.no_grad():
        for rows in micro_batches(ro, cfg.micro_batch_tokens, torch.arange(len(ro))):
            dists.append(anchor_from_logits(cfg, forward(cfg, model, ro, rows, vocab), ro, rows).to("cpu"))
    return cat_rows(dists)


def anchor_from_logits(cfg: Config, logits: torch.Tensor, ro: Rollouts, rows: torch.Tensor) -> SparseDist:
    """The sparse old policy of samples `rows` from their logits [b, T, V] (detached: a constant)."""
    logits = logits.detach()
    tokens = ro.completion_ids[rows].reshape(-1).to(logits.device)
    return sparsify(logits.reshape(-1, logits.shape[-1]), tokens, k=cfg.k, delta=cfg.delta)


def old_policy_from_forward(cfg: Config, model: Any) -> bool:
    """Whether the first minibatch's forward pass can stand in for the old-policy pass on its samples.

    Only with `recompute`, and only when the model is deterministic: in eval mode, or in train mode with every
    dropout probability 0 (`nn.Dropout` modules, and the `*dropout*` / `*pdrop*` rates of the config that
    transformers applies functionally, e.g. Llama's attention_dropout). Then a no-grad pass over those samples
    with the same weights returns the same logits (up to float rounding), so it is skipped.
    """
    if cfg.old_policy != "recompute":
        return False
    if not any(m.training for m in model.modules()):
        return True
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0 for m in model.modules()):
        return False
    config = getattr(model, "config", None)
    return not any(r > 0 for r in _dropout_rates(config.to_dict() if config is not None else {}))


def _dropout_rates(config: dict) -> list[float]:
    """Every `*dropout*` / `*pdrop*` number in a (nested, e.g. text_config) model config dict."""
    rates = []
    for key, v in config.items():
        if isinstance(v, dict):
            rates += _dropout_rates(v)
        elif ("dropout" in str(key) or "pdrop" in str(key)) and isinstance(v, (int, float)):
            rates.append(float(v))
    return rates


def forward(cfg: Config, model: Any, ro: Rollouts, rows: torch.Tensor, vocab: int) -> torch.Tensor:
    """Current policy's temperature-scaled logits [b, T, V] at the completion positions of `rows`."""
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
        return completion_logits(
            model, [ro.prompt_ids[i] for i in rows.tolist()], ro.completion_ids[rows], ro.temperature, vocab
        )


def micro_batches(ro: Rollouts, max_tokens: int, rows: torch.Tensor) -> list[torch.Tensor]:
    """Split `rows` into chunks of at most max_tokens padded tokens (prompt + completion) each."""
    width = max(len(p) for p in ro.prompt_ids) + ro.completion_ids.shape[1]
    per = max(1, max_tokens // width)
    return [rows[i : i + per] for i in range(0, len(rows), per)]


def update(
    cfg: Config,
    model: Any,
    opt: Any,
    sched: Any,
    ro: Rollouts,
    adv: torch.Tensor,
    old: SparseDist | None,
    old_rows: torch.Tensor,
    chunks: tuple[torch.Tensor, ...],
    vocab: int,
) -> tuple[dict[str, float], int]:
    """One optimiser step per chunk of samples (the minibatches). Returns averaged loss metrics and skipped steps.

    `old` is the old policy of the samples `old_rows` ([n] long, in that order; None when n = 0). Samples not
    among them must all be in chunks[0]: their old policy is taken from that chunk's own forward pass, before
    the first optimiser step (module docstring).
    """
    device = next(model.parameters()).device
    t_len = ro.completion_ids.shape[1]
    loss_fn, kwargs = LOSSES[cfg.loss], loss_kwargs(cfg)
    where = torch.full((len(ro),), -1, dtype=torch.long)  # sample -> its row block in `old` (-1: from forward)
    where[old_rows] = torch.arange(len(old_rows))
    logs: list[tuple[float, dict[str, float]]] = []
    skipped = 0
    for i, chunk in enumerate(chunks):
        opt.zero_grad(set_to_none=True)
        chunk_tokens = int(ro.completion_mask[chunk].sum())
        for rows in micro_batches(ro, cfg.micro_batch_tokens, chunk):
            logits = forward(cfg, model, ro, rows, vocab)
            fresh = where[rows] < 0
            if bool(fresh.any()):
                if i > 0 or not bool(fresh.all()):
                    raise ValueError("only the first minibatch may take its old policy from its own forward pass")
                anchor = anchor_from_logits(cfg, logits, ro, rows)
            else:
                flat_rows = (where[rows][:, None] * t_len + torch.arange(t_len)).reshape(-1)
                anchor = old.select(flat_rows).to(device)
            mask = ro.completion_mask[rows]
            loss, m = loss_fn(
                logits,
                ro.completion_ids[rows].to(device),
                mask.to(device),
                adv[rows].to(device),
                anchor,
                agg=cfg.agg,
                norm_len=t_len,
                **kwargs,
            )
            # weight each micro-batch by its share of the chunk, so the sum is the chunk's aggregate
            share = (int(mask.sum()) / max(chunk_tokens, 1)) if cfg.agg == "token-mean" else len(rows) / len(chunk)
            (loss * share).backward()
            logs.append((share, m))
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        if not torch.isfinite(norm):
            skipped += 1
            opt.zero_grad(set_to_none=True)
            continue
        opt.step()
        sched.step()
        logs.append((0.0, {"grad_norm": float(norm)}))
    return merge_metrics(logs), skipped


def loss_kwargs(cfg: Config) -> dict:
    base = {"k": cfg.k, "delta": cfg.delta, "support": cfg.support}
    if cfg.loss == "troll":
        return base | {"eps": cfg.eps, "alpha": cfg.alpha, "level": cfg.level}
    if cfg.loss == "ppo_clip":
        return base | {"eps_low": cfg.clip_low, "eps_high": cfg.clip_high, "level": cfg.level}
    if cfg.loss == "dppo":
        return base | {"divergence": cfg.dppo_divergence}
    if cfg.loss == "cispo":
        return base | {"eps_high": cfg.clip_high}
    raise ValueError(f"unknown loss {cfg.loss!r}; choose from {sorted(LOSSES)}")


def merge_metrics(logs: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Weighted means of micro-batch metrics (max for *_max, min for *_min, mean for grad_norm)."""
    out: dict[str, float] = {}
    for key in {k for _, m in logs for k in m}:
        vals = [(w, m[key]) for w, m in logs if key in m]
        if key.endswith("_max"):
            out[key] = max(v for _, v in vals)
        elif key.endswith("_min"):
            out[key] = min(v for _, v in vals)
        elif key == "grad_norm":
            out[key] = sum(v for _, v in vals) / len(vals)
        else:
            total = sum(w for w, _ in vals)
            out[key] = sum(w * v for w, v in vals) / total if total else sum(v for _, v in vals) / len(vals)
    return out


def evaluate(cfg: Config, model: Any, tokenizer: Any, task: Task, generator: Any = None) -> tuple[float, list[dict]]:
    """Greedy pass@1 on the held-out problems: with the vLLM engine when there is one, else transformers."""
    prompts = encode(tokenizer, [task.prompt(r["question"]) for r in task.test])
    if hasattr(generator, "greedy"):
        completions = decode(tokenizer, generator.greedy(prompts, cfg.max_new_tokens))
    else:
        completions = greedy_hf(model, tokenizer, prompts, cfg.max_new_tokens)
    return score(task.test, completions, task.reward)


def sft_warmstart(cfg: Config, model: Any, tokenizer: Any, task: Task) -> float:
    """Supervised steps on reference solutions (loss on the answer tokens only); returns the last loss."""
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    loss = torch.tensor(math.nan)
    for _ in tqdm(range(cfg.sft_steps), desc="sft", leave=False):
        rows = [task.train[i] for i in torch.randint(len(task.train), (cfg.sft_batch,), generator=gen).tolist()]
        prompts = encode(tokenizer, [task.prompt(r["question"]) for r in rows])
        answers = [ids + [tokenizer.eos_token_id] for ids in encode(tokenizer, [r["answer"] for r in rows])]
        width = max(len(a) for a in answers)
        comp = torch.tensor([a + [tokenizer.pad_token_id] * (width - len(a)) for a in answers])
        mask = torch.tensor([[j < len(a) for j in range(width)] for a in answers], device=device)
        logits = completion_logits(model, prompts, comp, 1.0, len(tokenizer))
        nll = -torch.log_softmax(logits, -1).gather(-1, comp.to(device)[..., None])[..., 0]
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss.detach())


# ----------------------------------------------------------------------------- the loop


def train(cfg: Config) -> dict:
    t_start = time.time()
    out = Path(cfg.out)
    device = torch.device(
        "cuda"
        if cfg.device == "auto" and torch.cuda.is_available()
        else ("cpu" if cfg.device == "auto" else cfg.device)
    )
    start_step, state = 0, {}
    if cfg.resume:
        ckpt = latest_checkpoint(out)
        model, tokenizer = build_model(cfg, device, path=str(ckpt))
        state = torch.load(ckpt / "trainer.pt", weights_only=False)
        start_step = state["step"]
    else:
        if (out / "checkpoints").exists():
            raise FileExistsError(f"{out} already holds a run: pass --resume true or choose another --out")
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.seed)
        model, tokenizer = build_model(cfg, device)
    cfg.save(out / "config.json")
    vocab = len(tokenizer)
    task, dropped = load_task(cfg, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.steps * cfg.minibatches
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda i: (
            min(1.0, (i + 1) / max(cfg.warmup_steps, 1))
            * (0.5 * (1 + math.cos(math.pi * min(i / max(total, 1), 1.0))) if cfg.lr_schedule == "cosine" else 1.0)
        ),
    )
    metrics_path = out / "metrics.jsonl"
    if cfg.resume:
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        lines = metrics_path.read_text().splitlines() if metrics_path.exists() else []
        metrics_path.write_text("".join(ln + "\n" for ln in lines if json.loads(ln).get("step", 0) <= start_step))
        eval_before = state["eval_before"]
    else:
        metrics_path.write_text("")
        if cfg.sft_steps:
            sft_loss = sft_warmstart(cfg, model, tokenizer, task)
            print(f"supervised warm-start: {cfg.sft_steps} steps, final loss {sft_loss:.3f}")
        eval_before, samples = evaluate(cfg, model, tokenizer, task)
        log_samples(out, 0, samples, cfg.samples_to_log)
        state = {"eval_before": eval_before, "skipped_steps": 0, "dropped_prompts": dropped}
        save_checkpoint(out, 0, model, tokenizer, opt, sched, state)
    print(f"eval before RL: {eval_before:.3f} on {len(task.test)} held-out problems")
    generator = make_generator(cfg, model, tokenizer, out)
    eval_after = eval_before
    bar = tqdm(range(start_step, cfg.steps), desc=f"rl/{cfg.loss}", initial=start_step, total=cfg.steps)
    for step in bar:
        row = rl_step(cfg, step, model, tokenizer, generator, opt, sched, task, vocab, device)
        state["skipped_steps"] += row["skipped"]
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            eval_after, samples = evaluate(cfg, model, tokenizer, task, generator)
            row["eval_acc"] = eval_after
            log_samples(out, step + 1, samples, cfg.samples_to_log)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        bar.set_postfix(reward=f"{row['reward']:.2f}", acc=f"{eval_after:.2f}", kl=f"{row['kl_after_max']:.3f}")
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save_checkpoint(out, step + 1, model, tokenizer, opt, sched, state)
    summary = {
        "eval_before": eval_before,
        "eval_after": eval_after,
        "wall_clock_s": round(time.time() - t_start, 1),
        "steps": cfg.steps,
        "loss": cfg.loss,
        "seed": cfg.seed,
        "skipped_steps": state["skipped_steps"],
        "dropped_prompts": state.get("dropped_prompts", 0),
        "eval_problems": len(task.test),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"eval: {eval_before:.3f} -> {eval_after:.3f} in {summary['wall_clock_s']} s; {out / 'summary.json'}")
    return summary


def rl_step(
    cfg: Config,
    step: int,
    model: Any,
    tokenizer: Any,
    generator: Any,
    opt: Any,
    sched: Any,
    task: Task,
    vocab: int,
    device: torch.device,
) -> dict:
    """One RL step; returns its metrics row."""
    t0 = time.time()
    seed = cfg.seed * 1_000_003 + step
    gen = torch.Generator().manual_seed(seed)
    rows = [task.train[i] for i in torch.randint(len(task.train), (cfg.prompts_per_step,), generator=gen).tolist()]
    prompts = encode(tokenizer, [task.prompt(r["question"]) for r in rows])
    ro = generator.generate(
        prompts,
        cfg.samples_per_prompt,
        cfg.max_new_tokens,
        cfg.temperature,
        top_k_logprobs=cfg.k if cfg.old_policy == "behaviour" else 0,
        seed=seed,
    )
    t1 = time.time()
    lengths = ro.completion_mask.sum(-1)  # real tokens come first in every row
    ids = [row[:n] for row, n in zip(ro.completion_ids.tolist(), lengths.tolist(), strict=True)]
    texts = decode(tokenizer, ids)
    golds = [rows[int(g)]["gold"] for g in ro.group]
    rewards = torch.tensor([task.reward(t, g) for t, g in zip(texts, golds, strict=True)], dtype=torch.float32)
    adv = advantages(cfg.advantage, rewards, ro.group)
    t2 = time.time()
    order = torch.randperm(len(ro), generator=gen)
    chunks = order.chunk(cfg.minibatches)  # the minibatches
    old_rows = order[len(chunks[0]) :] if old_policy_from_forward(cfg, model) else order  # need the no-grad pass
    old = old_policy(cfg, model, ro.select(old_rows), vocab) if len(old_rows) else None
    t3 = time.time()
    metrics, skipped = update(cfg, model, opt, sched, ro, adv, old, old_rows, chunks, vocab)
    t4 = time.time()
    generator.push_weights(model)
    t5 = time.time()
    lengths = lengths.float()
    peak = (
        torch.cuda.max_memory_allocated()
        if device.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ) / 2**20
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
        "time_sync": t5 - t4,
        "tokens_per_s": float(lengths.sum()) / (t5 - t0),
        "peak_memory_mb": peak,
    }


def log_samples(out: Path, step: int, records: list[dict], n: int) -> None:
    with open(out / "samples.jsonl", "a") as f:
        for rec in records[:n]:
            f.write(json.dumps({"step": step, **rec}) + "\n")


def main(argv: list[str] | None = None) -> dict:
    return train(Config.from_args(argv))


if __name__ == "__main__":
    main()
