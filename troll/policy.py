"""The policy network's distribution at the completion positions of a batch (troll.models.build makes the network).

    logits = completion_logits(model, prompt_ids, completion_ids, temperature, len(tokenizer))   # [B, T, V]
    logits = rollout_logits(model, ro, rows, len(tokenizer))      # the same for samples `rows` of rollouts `ro`
    logits = packed_logits(model, ids, attn, T, temperature, vocab_size)                         # already packed
    head = packed_logits(model, ids, attn, T, temperature, vocab_size, chunk_rows=1024)          # head.LMHead

Everything that turns the network's weights into the policy pi(. | context) lives here, so the trainer, the TRL
integration, the tests and the benchmarks score completions with one function, and the samplers (rollout.py,
models/vllm_engine.py) are checked against it. Why a module of its own: sampling (rollout.py) produces token ids; this
module is the one forward pass every loss differentiates, and the vocabulary mask the samplers must mirror.

Layout, B rows, P = longest prompt, T = completion columns:

    ids   [B, P+T]  long  [left-padded prompt | right-padded completion]   (`pack`)
    attn  [B, P+T]  bool  True on real prompt tokens and on every completion column
    out   [B, T, V] float32  mask(logits) / temperature at completion positions; log_softmax gives log pi
                             (float64 for a float64 model)

Choices:
- Completion position t sits at column P + t, so its logits are those of column P + t - 1: the forward keeps the
  last T + 1 columns (`logits_to_keep`) and drops the final one (it predicts past the completion).
- Position ids count from each row's first real token, as `generate` and vLLM (which never sees padding) do.
- Padding inside completions is not masked: it comes after every real token, so causal attention never sees it
  from a real position; callers use the rollouts' completion_mask on the outputs.
- `mask_padded_vocab` sets ids >= len(tokenizer) to -inf: Qwen's output layer has rows past the tokenizer
  (151,936 rows, 151,665 tokens) that must never carry probability. A tokenizer larger than the output layer is
  a ValueError (`check_vocab`). Both live in troll.padding, with `left_pad`, as the samplers use them too.
- `shared_prompt_logits` gives `completion_logits`' result (value and gradient) with each distinct prompt of the
  batch forwarded once: its keys and values (the KV cache, with grad) are gathered for every completion of that
  prompt, and the completions run on it. A group of n samples then costs one prompt's positions, not n (Prefix
  Grouper, arXiv 2506.05433); the gradient through the shared prompt is the sum over its completions, as in the
  per-sample pass. Gradient checkpointing drops the cache inside a layer, so the two are refused together.
- `chunk_rows` > 0 returns the same distribution as a `head.LMHead`: the last hidden states [B, T, H] and the
  output layer, applied in chunks of that many rows by the losses (each chunk's logits recomputed in backward),
  so no [B, T, V] tensor exists for the micro-batch. The LM head must be a plain linear layer on the decoder's
  last hidden state (Llama, Qwen2, Qwen3: checked; logit soft-capping or scaling raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from troll.head import LMHead, Logits
from troll.padding import left_pad, mask_padded_vocab, position_ids

if TYPE_CHECKING:
    from troll.rollout import Rollouts


def pack(prompt_ids: Sequence[Sequence[int]], completion_ids: Tensor, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Left-pad prompts, append right-padded completions: ([B, P+T] ids, [B, P+T] bool attention mask), on the
    completions' device."""
    ids, attn = (x.to(completion_ids.device) for x in left_pad(prompt_ids, pad_id))
    return torch.cat([ids, completion_ids], -1), torch.cat(
        [attn, torch.ones_like(completion_ids, dtype=torch.bool)], -1
    )


def completion_logits(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Tensor,
    temperature: float,
    vocab_size: int,
    chunk_rows: int = 0,
) -> Logits:
    """Teacher-forced `mask(logits) / temperature` at each completion position: [B, T, V] float32.

    `log_softmax` of this is the log-prob the samplers return (`Rollouts.logprobs` for the sampled id, `top_logp`
    for the top-K). Differentiable; call under `torch.no_grad()` when only scoring.
    """
    ids, attn = pack(prompt_ids, completion_ids)
    return packed_logits(model, ids, attn, completion_ids.shape[1], temperature, vocab_size, chunk_rows)


def shared_prompt_logits(
    model: Any,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Tensor,
    temperature: float,
    vocab_size: int | None,
    chunk_rows: int = 0,
) -> Logits:
    """`completion_logits` with each distinct prompt forwarded once (module docstring): [B, T, V] float32, or an
    `LMHead` with chunk_rows > 0. Completion position 0 reads the prompt's last position; positions 1..T-1 are a
    forward of completion columns 0..T-2 on the prompt's cache, at position ids that continue the prompt's."""
    if getattr(model, "is_gradient_checkpointing", False):
        raise ValueError("a shared prompt needs the KV cache, which gradient checkpointing drops: share_prompt=False")
    device = next(model.parameters()).device
    distinct: dict[tuple[int, ...], int] = {}
    index = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids], device=device)
    ids, attn = (x.to(device) for x in left_pad([list(p) for p in distinct], 0))
    length = attn.long().sum(-1)  # [U] real prompt tokens
    # the decoder's hidden states for the chunked head, else the model's own logits (its head, soft-capping included)
    forward = model.get_decoder() if chunk_rows else model
    pick = (lambda o: o.last_hidden_state) if chunk_rows else (lambda o: o.logits)
    positions = position_ids(attn)
    first = forward(input_ids=ids, attention_mask=attn.long(), position_ids=positions, use_cache=True,
                    **({} if chunk_rows else {"logits_to_keep": 1}))  # fmt: skip
    x = pick(first)[index, -1:]  # [B, 1, .]: the prompt's last position predicts completion token 0
    T = completion_ids.shape[1]
    if T > 1:  # columns 0..T-2 predict tokens 1..T-1; the last column predicts nothing that is scored
        cache = first.past_key_values
        cache.batch_select_indices(index)  # [U, ...] -> [B, ...]: a gather, so the prompt's gradient is the sum
        rest = completion_ids[:, :-1].to(device)
        mask = torch.cat([attn[index], torch.ones_like(rest, dtype=torch.bool)], -1).long()
        positions = length[index, None] + torch.arange(T - 1, device=device)
        out = forward(
            input_ids=rest, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        )
        x = torch.cat([x, pick(out)], 1)  # [B, T, .]
    if chunk_rows:
        out_layer = _plain_output_layer(model)
        return LMHead(x, out_layer.weight, out_layer.bias, temperature, vocab_size, chunk_rows)
    logits = at_least_float32(x) / temperature
    return logits if vocab_size is None else mask_padded_vocab(logits, vocab_size)


def rollout_logits(
    model: Any,
    ro: Rollouts,
    rows: Tensor,
    vocab_size: int,
    chunk_rows: int = 0,
    bf16: bool = False,
    compiled: bool = False,
    shared: bool = False,
) -> Logits:
    """`completion_logits` of samples `rows` ([b] long) of rollouts `ro` at their sampling temperature: [b, T, V]
    (or an `LMHead` with chunk_rows > 0, its pass through torch.compile when `compiled`), the forward under bf16
    autocast when `bf16`, each distinct prompt forwarded once when `shared` (`shared_prompt_logits`)."""
    device = next(model.parameters()).device
    prompts = [ro.prompt_ids[i] for i in rows.tolist()]
    scorer = shared_prompt_logits if shared else completion_logits
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        x = scorer(model, prompts, ro.completion_ids[rows], ro.temperature, vocab_size, chunk_rows)
    return replace(x, compiled=True) if compiled and isinstance(x, LMHead) else x


def packed_logits(
    model: Any,
    ids: Tensor,
    attn: Tensor,
    T: int,
    temperature: float,
    vocab_size: int | None = None,
    chunk_rows: int = 0,
) -> Logits:
    """`completion_logits` for rows already packed as [left-padded prompt | completion of T columns]:
    ids, attn [B, P+T] -> [B, T, V] float32 (vocab_size None: no padded-vocabulary mask), or with chunk_rows > 0
    the same as an `LMHead` over the hidden states [B, T, H] (module docstring)."""
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device).long()
    inputs = dict(input_ids=ids, attention_mask=attn, position_ids=position_ids(attn))
    if chunk_rows:
        out_layer = _plain_output_layer(model)
        hidden = model.get_decoder()(**inputs).last_hidden_state[:, -(T + 1) : -1]
        return LMHead(hidden, out_layer.weight, out_layer.bias, temperature, vocab_size, chunk_rows)
    out = model(**inputs, logits_to_keep=T + 1)
    logits = at_least_float32(out.logits[:, :-1]) / temperature
    return logits if vocab_size is None else mask_padded_vocab(logits, vocab_size)


def at_least_float32(x: Tensor) -> Tensor:
    """float32 logits from a bf16 / fp16 forward; a float64 model's stay float64 (the exactness tests' reference)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _plain_output_layer(model: Any) -> torch.nn.Linear:
    """The LM head, if the logits are exactly `head(last hidden state)`; a ValueError naming what is not."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    extra = [k for k in ("final_logit_softcapping", "logit_scale", "logits_scaling") if getattr(config, k, None)]
    head = model.get_output_embeddings()
    if extra or not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"the chunked output layer needs logits = lm_head(last hidden state); {type(model).__name__} has "
            f"{extra or type(head).__name__}: use chunk_rows=0 (full logits)"
        )
    return head
