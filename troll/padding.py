"""Padding, both kinds the policy and its samplers share: prompts left-padded into a batch, and the output layer's
rows past the tokenizer masked out.

    ids, attn = left_pad(prompt_ids, pad_id)        # [B, P] long, [B, P] bool; P = the longest prompt
    positions = position_ids(attn)                  # [B, P] long, counted from each row's first real token
    logits = mask_padded_vocab(logits, vocab_size)  # ids >= vocab_size -> -inf
    check_vocab(len(tokenizer), model_vocab)        # a tokenizer larger than the output layer: ValueError

A module of its own because both sides need it: troll.policy scores completions with it, and the samplers
(troll.rollout, troll.models.vllm_engine) mirror the same mask and padding, so neither imports the other for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Left-padded prompts: ([B, P] ids, [B, P] bool attention mask), P = the longest prompt."""
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompt_ids), P), dtype=torch.bool)
    for b, p in enumerate(prompt_ids):
        ids[b, P - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        attn[b, P - len(p) :] = True
    return ids, attn


def mask_padded_vocab(logits: Tensor, vocab_size: int) -> Tensor:
    """Set ids >= vocab_size (the output layer's padding past the tokenizer) to -inf. [..., V] -> same."""
    if logits.shape[-1] == vocab_size:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= vocab_size, -torch.inf)


def check_vocab(tokenizer_size: int, model_vocab: int) -> None:
    """A tokenizer may be smaller than the output layer (padding, masked) but never larger."""
    if tokenizer_size > model_vocab:
        raise ValueError(
            f"tokenizer has {tokenizer_size} tokens but the model's output layer only {model_vocab}: "
            "ids past the output layer could never be scored"
        )


def position_ids(attn: Tensor) -> Tensor:
    """Position ids of left-padded rows, [B, L] mask -> [B, L] long: counted from each row's first real token, as
    `generate` and vLLM (which never sees padding) number them; padding sits at 0."""
    return (attn.long().cumsum(-1) - 1).clamp(min=0)

