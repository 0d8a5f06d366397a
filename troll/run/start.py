"""A run up to its first RL step (troll.train's `start`): everything the loop needs, checked before anything is written.

    model, tokenizer, task, generator, opt, sched = start(run)     # run: troll.run.harness.Run, opened on cfg.out

In order: what a count implies for the model (`check_size`: the tiny model --vocab_size makes fits in memory); the
model (or the checkpoint a resumed run continues from) and the task's data; every check that needs them
(`check_start`: the tokenizer fits the output layer, --kl_update_vocab can act, a new LoRA run's targets match
layers and its rank is one they have); only then the run folder claimed (troll.run.harness), and for a new run the
supervised warm-start (troll.run.warmstart), the frozen base kept once (LoRA) and the adapters added (troll.lora); the
optimiser (`make_optimizer`: AdamW, fused, over the trained weights, linear warmup, then constant or cosine to 0 over
all optimiser steps); the rollout engine (`make_generator`: the training model itself, or a vLLM engine that loads the
base from disk once and then follows every update in place); last, the step-0 evaluation and checkpoint of a new
run, or the restored optimiser and schedule of a resumed one.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from troll.base.checkpoint import save_base
from troll.base.cli import free_memory, gib
from troll.base.config import Config
from troll.lora import base_source, base_weights, check_targets, is_adapter_checkpoint, owns_base, unwrap
from troll.models.build import adapt, build_model
from troll.padding import check_vocab
from troll.rollout import Generator, HFGenerator
from troll.run.harness import Run, RunError, starting
from troll.run.warmstart import adamw, warm_start_task
from troll.tasks.task import evaluate, load_task

TINY_TOKEN_BYTES = 6 << 10  # a --vocab_size token of the tiny model's run: its rows of the input and output layers
# (float32, trained: gradients and AdamW's moments), its tokenizer entry, its share of a step (5.4 KiB measured: the
# peak memory of a run of --vocab_size 200,000 over one of 100,000, CPU)
SCORE_BYTES = 12  # a sampled token's score per output row on the hf sampler: float32, its stack and log_softmax
KEPT_TOKEN_BYTES = 13  # a sampled token kept in a step's batch (troll.rollout.Rollouts): its id, log-prob and mask
TOP_BYTES = 12  # and each of its top-k log-probs (the id and the value), where the sampler keeps them (--k)
INDEX_TENSOR_BYTES = 600  # a step's shuffle or minibatch index tensor (troll.train.minibatches_of), its own cost:
# 1,806 bytes measured for an epoch of one 4-sample shuffle and its 2 minibatches


def make_generator(cfg: Config, model: Any, tokenizer: Any, out: Path) -> Generator:
    """The rollout engine: the training model itself (hf), or a vLLM engine that follows its weights."""
    if cfg.backend == "hf":  # rollout_dtype bfloat16: a bf16 copy samples, refreshed by every push
        dtype = torch.bfloat16 if cfg.rollout_dtype == "bfloat16" else None
        return HFGenerator(model, tokenizer, dtype=dtype, share_prompt=cfg.share_prompt)
    from troll.models.vllm_engine import VLLMGenerator

    auto_dtype = "bfloat16" if model.device.type == "cuda" else "float32"  # vLLM's usual dtype; CPU: the trainer's
    init = out / "engine-init"  # the engine loads the base once from disk; every update is pushed in place
    shutil.rmtree(init, ignore_errors=True)  # written again whole: no file of another model left in it
    unwrap(model).save_pretrained(init, state_dict=base_weights(model))  # LoRA: the base, under its own names
    tokenizer.save_pretrained(init)
    engine = VLLMGenerator(
        init,
        tokenizer,
        max_model_len=cfg.max_prompt_len + cfg.max_new_tokens,
        max_top_k=cfg.k,
        dtype=cfg.rollout_dtype if cfg.rollout_dtype != "auto" else auto_dtype,
        seed=cfg.seed,
        gpu_memory_utilization=cfg.vllm_gpu_memory,
    )
    engine.push_weights(model)
    return engine


def make_optimizer(cfg: Config, model: Any) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW and its schedule over all optimiser steps: linear warmup, then constant or cosine to 0."""
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters; else every weight
    opt = adamw(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    total = cfg.steps * cfg.epochs * cfg.minibatches

    def factor(i: int) -> float:
        warm = min(1.0, (i + 1) / max(cfg.warmup_steps, 1))
        return warm * (0.5 * (1 + math.cos(math.pi * min(i / total, 1.0))) if cfg.lr_schedule == "cosine" else 1.0)

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def check_size(cfg: Config) -> None:
    """What --vocab_size implies, checked before the model is built: its tokens, TINY_TOKEN_BYTES each, fit in the
    memory free (troll.base.cli.free_memory). A RunError names it."""
    size = cfg.vocab_size * TINY_TOKEN_BYTES
    free = free_memory()
    if free is not None and size > free:
        raise RunError(
            f"--vocab_size {cfg.vocab_size} makes a tiny model whose run takes about {gib(size)}, more than the "
            f"{gib(free)} free here: pass a smaller --vocab_size"
        )


def check_step(cfg: Config, model: Any) -> None:
    """What a step's counts imply for the model, checked before anything is written or sampled: --max_new_tokens
    leaves room for a prompt within the model's positions, and the scores a step's sampling keeps fit in the memory
    free (troll.base.cli.free_memory): --prompts_per_step x --samples_per_prompt completions of --max_new_tokens tokens,
    each token SCORE_BYTES per output row on the hf sampler (which keeps every step's scores) or per kept log-prob
    (--k + 1) on vLLM; and so do the 1 + --staleness batches sampled before the first update, KEPT_TOKEN_BYTES and
    TOP_BYTES x (--k + 1) a token, and a step's --epochs shuffles of its samples, each cut into --minibatches
    (troll.train.minibatches_of holds them all). A RunError names the counts."""
    positions = getattr(unwrap(model).config, "max_position_embeddings", None)
    check_counts(cfg, positions, unwrap(model).get_output_embeddings().weight.shape[0])


def check_counts(cfg: Config, positions: int | None, rows: int, flags: dict[str, str] | None = None) -> None:
    """`check_step` for a model known by its number of positions (None: unbounded) and output rows alone, as a
    command that has read the model's config but not its weights can ask it; `flags` names the counts by that
    command's own flags ({"--prompts_per_step": "--prompts"}, say)."""
    try:
        _check_counts(cfg, positions, rows)
    except RunError as e:
        text = str(e)
        for theirs, mine in (flags or {}).items():
            text = text.replace(theirs, mine)
        raise RunError(text) from None


def _check_counts(cfg: Config, positions: int | None, rows: int) -> None:
    if positions is not None and cfg.max_new_tokens >= positions:
        raise RunError(
            f"--max_new_tokens {cfg.max_new_tokens} leaves no room for a prompt within the {positions} positions of "
            f"{cfg.model}: pass fewer"
        )
    rows = rows if cfg.backend == "hf" else cfg.k + 1
    size = cfg.prompts_per_step * cfg.samples_per_prompt * cfg.max_new_tokens * rows * SCORE_BYTES
    free = free_memory()
    if free is not None and size > free:
        per = f"the {rows} output rows of {cfg.model} (hf sampler)" if cfg.backend == "hf" else f"--k {cfg.k} + 1"
        raise RunError(
            f"--prompts_per_step {cfg.prompts_per_step} x --samples_per_prompt {cfg.samples_per_prompt} x "
            f"--max_new_tokens {cfg.max_new_tokens} tokens, each scored over {per}, keep {gib(size)} in a step, "
            f"more than the {gib(free)} free here: pass smaller counts"
        )
    kept = (1 + cfg.staleness) * cfg.prompts_per_step * cfg.samples_per_prompt * cfg.max_new_tokens
    kept *= KEPT_TOKEN_BYTES + TOP_BYTES * (cfg.k + 1)
    if free is not None and kept > free:
        raise RunError(
            f"--staleness {cfg.staleness} keeps {1 + cfg.staleness} batches of --prompts_per_step "
            f"{cfg.prompts_per_step} x --samples_per_prompt {cfg.samples_per_prompt} x --max_new_tokens "
            f"{cfg.max_new_tokens} tokens with their top --k {cfg.k} log-probs before the first update, {gib(kept)}, "
            f"more than the {gib(free)} free here: pass a smaller --staleness"
        )
    samples = cfg.prompts_per_step * cfg.samples_per_prompt
    shuffles = cfg.epochs * ((1 + cfg.minibatches) * INDEX_TENSOR_BYTES + 8 * samples)
    if free is not None and shuffles > free:
        raise RunError(
            f"--epochs {cfg.epochs} shuffles of a step's {samples} samples, each cut into --minibatches "
            f"{cfg.minibatches}, take {gib(shuffles)}, more than the {gib(free)} free here: pass fewer --epochs"
        )


def check_start(cfg: Config, model: Any, tokenizer: Any, fresh: bool) -> None:
    """What the model and the tokenizer decide about `cfg`, checked before the run writes anything: the tokenizer
    fits the output layer, --kl_update_vocab can act, and a new LoRA run's every --lora_targets name matches a layer
    (troll.lora.check_targets) and its --lora_rank is at most the rank of the widest linear layer (a larger rank
    adds nothing but memory), and what a step's counts imply (`check_step`). A RunError names the setting."""
    try:
        check_vocab(len(tokenizer), unwrap(model).get_output_embeddings().weight.shape[0])
        if fresh and cfg.lora_rank:
            check_targets(model, cfg.lora_targets)
    except ValueError as e:
        raise RunError(f"--model {cfg.model}: {e}") from None
    check_step(cfg, model)
    linear = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widest = max((min(m.in_features, m.out_features) for m in linear), default=0)
    if fresh and cfg.lora_rank > widest:
        raise RunError(
            f"--lora_rank {cfg.lora_rank} is above the rank of every linear layer of {cfg.model} (at most {widest}), "
            f"which it adds nothing to but memory: pass at most {widest}"
        )
    if 0 < cfg.kl_update_vocab < len(tokenizer):
        raise RunError(
            f"--kl_update_vocab {cfg.kl_update_vocab} is below the model's {len(tokenizer)}-token vocabulary, so the "
            f"update-KL probe never runs: pass 0 (off) or at least {len(tokenizer)}"
        )


def start(run: Run, wrap_generator: Callable[[Generator], Generator] | None = None) -> tuple[Any, ...]:
    """The run up to its first step: the model and the data, every check that needs them (nothing is written until
    they pass), then the run folder claimed (troll.run.harness), the warm-start and LoRA adapters (a new run), the
    optimiser, the rollout engine, and the step-0 evaluation and checkpoint (new) or the restored state (resumed).
    Returns (model, tokenizer, task, generator, opt, sched)."""
    cfg = run.cfg
    source = f"--model {cfg.model}" if run.checkpoint is None else f"the checkpoint {run.checkpoint}"
    if run.checkpoint is not None and is_adapter_checkpoint(run.checkpoint):
        try:  # a resumed LoRA run's base: <out>/base, or the model it names
            source += f" on its base {base_source(cfg, run.out)}"
        except ValueError as e:
            raise RunError(str(e)) from None
    torch.manual_seed(cfg.seed)
    if cfg.model == "tiny":
        check_size(cfg)
    with starting(f"loading {source}"):  # resumed LoRA: its adapters on the base
        model, tokenizer = build_model(cfg, run.device, path=run.checkpoint)
    try:
        task, dropped = load_task(cfg, tokenizer)
    except (OSError, ValueError) as e:  # all prompts too long, or the data unreadable
        raise RunError(str(e)) from None
    check_start(cfg, model, tokenizer, fresh=run.checkpoint is None)
    run.claim()  # the run's first write
    if run.checkpoint is None:
        warm = warm_start_task(cfg, model, tokenizer, task) if cfg.sft_steps else {}
        if cfg.lora_rank and owns_base(cfg):  # LoRA checkpoints hold adapters: the base they adapt is kept once
            save_base(run.out, model, tokenizer)
        model = adapt(cfg, model)  # full fine-tuning: the model itself; LoRA: new adapters on the frozen base
    opt, sched = make_optimizer(cfg, model)
    generator = make_generator(cfg, model, tokenizer, run.out)
    generator = wrap_generator(generator) if wrap_generator else generator
    if run.checkpoint is None:
        extra = warm | {"dropped_prompts": dropped["train"], "dropped_test_prompts": dropped["test"]}
        run.begin(*evaluate(generator, tokenizer, task, cfg.max_new_tokens), extra, model, tokenizer, opt, sched)
    else:
        run.restore(opt, sched)
    return model, tokenizer, task, generator, opt, sched
