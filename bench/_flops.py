"""What one RL step must compute, in floating-point operations, and what this machine computes in a second.

    need = step_flops(model.config, ro, epochs=1)   # {"generate": ..., "old_policy": ..., "update": ...} FLOPs
    rate = matmul_rate(model.config)                # float32 FLOP/s of the MLP's product, the best of 5 at each of
                                                    # 256 and 2,048 rows (a minibatch's and a generation's sizes)

The count is the least the step's arithmetic needs, each prompt computed once per pass (prefix sharing), each
completion token once: a forward over n positions of a decoder with N weights in its layers costs 2 N n for the
weight products, plus the attention's 4 L d n c (scores and weighted sum, L layers, width d = heads x head_dim,
c the mean number of positions attended), plus the output layer's 2 H V at every position whose distribution is
used. Generation needs a forward of each prompt (its last position's distribution) and one position per sampled
token; the old-policy pass a forward over the prompts and completions; the update a forward and a backward (2x
the forward) of the same, per epoch. Embedding look-ups, norms and activations are left out (under 1% at these
shapes). A path that forwards every sample's prompt (`--share_prompt false`) does more than this count: the
fraction of the matmul rate a step reaches is the count over its time, over the rate.
"""

from __future__ import annotations

import time
from typing import Any

import torch


def layer_weights(config: Any) -> int:
    """Weights in the decoder layers' products (attention and MLP projections) of a Llama-shaped `config`."""
    h, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return layers * (h * q + 2 * h * kv + q * h + 3 * h * inter)


def forward_flops(config: Any, positions: float, context: float, scored: float) -> float:
    """FLOPs of a forward over `positions` positions that attend to `context` positions on average and whose
    distribution over the vocabulary is computed at `scored` of them (module docstring)."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * d * positions * context
    return 2 * layer_weights(config) * positions + attention + 2 * config.hidden_size * config.vocab_size * scored


def step_flops(config: Any, ro: Any, epochs: int = 1) -> dict[str, float]:
    """The least FLOPs of one RL step on rollouts `ro` (troll.rollout.Rollouts): each distinct prompt once per
    pass, each completion token once (module docstring)."""
    prompts = {tuple(p) for p in ro.prompt_ids}
    prompt_positions = sum(len(p) for p in prompts)
    tokens = float(ro.completion_mask.sum())
    mean_prompt = sum(len(p) for p in ro.prompt_ids) / len(ro)
    mean_len = tokens / len(ro)
    # prompt positions attend to half their prompt on average; completion positions to the prompt and half the rest
    prompt_part = forward_flops(config, prompt_positions, mean_prompt / 2, 0)
    completion_part = forward_flops(config, tokens, mean_prompt + mean_len / 2, tokens)
    generate = prompt_part + completion_part + forward_flops(config, 0, 0, len(prompts))
    one_pass = prompt_part + completion_part
    return {"generate": generate, "old_policy": one_pass, "update": 3 * one_pass * epochs}


def matmul_rate(config: Any, rows: tuple[int, ...] = (256, 2048), repeats: int = 5) -> float:
    """This machine's float32 FLOP/s on the MLP's product at the model's shape, [r, H] x [H, I]: the best of
    `repeats` timed products after one untimed, at each r of `rows` (2 cores: about 320 GFLOP/s at 256 rows, which
    stay in cache, and 130-190 at 2,048), the highest."""
    rates = []
    for r in rows:
        a = torch.randn(r, config.hidden_size)
        b = torch.randn(config.hidden_size, config.intermediate_size)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
        rates.append(2 * r * config.hidden_size * config.intermediate_size / best)
    return max(rates)
