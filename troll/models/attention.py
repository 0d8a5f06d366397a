"""Grouped-query attention that reads each key/value head in place, on CPU.

    use_gqa_attention(model)      # after loading: the same values, fewer copies

A model with grouped-query attention (SmolLM2-135M: 9 query heads on 3 key/value heads; Qwen3 and Llama-3.1 too)
shares each key/value head among several query heads. transformers' "sdpa" attention passes that to torch only
where no mask is given; with a padding mask (every left-padded batch: generation, evaluation, the scoring pass) it
first copies each key/value head to its query heads (`repeat_kv`), at every layer of every forward, and at every
decoding step over the whole KV cache. torch's `scaled_dot_product_attention(..., enable_gqa=True)` computes the
same attention reading the shared heads in place. `gqa_sdpa` is that call behind transformers' attention interface
(query [B, H, L, D], key and value [B, KV, S, D], the mask sdpa's own: [B, 1, L, S] bool, True where a position is
attended, or None); `use_gqa_attention` registers it, with sdpa's mask, under ATTENTION and switches a model on CPU
to it. The values are sdpa's (tests/test_attention.py: logits and gradients in float64, and generated tokens);
SmolLM2-135M decodes 64 rows about 2.7x faster (docs/results.md).

Only on CPU and only for a model whose attention is "sdpa" with fewer key/value heads than query heads: on CUDA a
masked grouped call falls back to sdpa's math kernel, and any other model is left as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "troll_gqa_sdpa"


def gqa_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface, as its sdpa_attention_forward, with the key/value heads shared in place:
    ([B, L, H, D], None). Causal without a mask for a prompt (L > 1), as sdpa; a mask is cut to the keys given."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = query.shape[2] > 1 and attention_mask is None and causal
    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def use_gqa_attention(model: Any, device: torch.device | None = None) -> bool:
    """Switch `model`, which runs on `device` (default: where its weights are), to `gqa_sdpa` where it acts (module
    docstring); whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = model.config
    heads = config.num_attention_heads
    shared = (getattr(config, "num_key_value_heads", None) or heads) < heads
    device = device or next(model.parameters()).device
    if not shared or config._attn_implementation != "sdpa" or torch.device(device).type != "cpu":
        return False
    AttentionInterface.register(ATTENTION, gqa_sdpa)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return True
