"""troll.models.attention: grouped-query attention reading the shared key/value heads in place gives sdpa's values and
gradients (float64, a left-padded batch and an unpadded one), the same generated tokens through the KV cache and the
shared prompt, and acts only where it should."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from troll.models.attention import ATTENTION, use_gqa_attention
from troll.models.tiny import tiny_llama, train_tokenizer
from troll.policy import completion_logits
from troll.rollout import HFGenerator

PROMPTS = [[5, 9, 11, 40], [7, 3], [12, 13, 14, 15, 16, 17], [20]]


def llama(kv_heads: int, dtype: torch.dtype = torch.float64) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=272, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=kv_heads, max_position_embeddings=128,
                         eos_token_id=2, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype)


def pair(kv_heads: int = 2, dtype: torch.dtype = torch.float64) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """(sdpa's model, the same weights on gqa_sdpa)."""
    plain = llama(kv_heads, dtype)
    shared = copy.deepcopy(plain)
    assert use_gqa_attention(shared) and shared.config._attn_implementation == ATTENTION
    assert plain.config._attn_implementation == "sdpa"
    return plain, shared


@pytest.mark.parametrize("prompts", [PROMPTS, [[5, 9, 11], [7, 3, 8]]], ids=["left-padded", "unpadded"])
def test_values_and_gradients_are_sdpas(prompts):
    plain, shared = pair()
    completions = torch.tensor([[4, 8, 2], [6, 2, 0], [9, 9, 9], [30, 31, 2]])[: len(prompts)]
    outs = []
    for model in (plain, shared):
        logits = completion_logits(model, prompts, completions, 0.7, 272)
        (logits.log_softmax(-1)[..., :5] * torch.linspace(-1, 1, 5, dtype=logits.dtype)).sum().backward()
        outs.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=0, atol=1e-12)
    for g1, g0 in zip(outs[1][1], outs[0][1], strict=True):
        torch.testing.assert_close(g1, g0, rtol=0, atol=1e-12)


def test_generation_draws_the_same_tokens_through_the_cache_and_the_shared_prompt():
    """float32, as the samplers run: greedy and sampled tokens (with the prompt shared by its samples) equal."""
    tok = train_tokenizer(["ab cd ef " * 20], vocab_size=64)
    plain, shared = pair(dtype=torch.float32)
    prompts = [[p % 60 + 3 for p in row] for row in PROMPTS]
    runs = []
    for model in (plain, shared):
        gen = HFGenerator(model.eval(), tok, 64, eos_token_ids=[2], share_prompt=True)
        runs.append((gen.greedy(prompts, 12), gen.sample(prompts, 3, 12, 1.0, seed=4)))
    assert runs[0] == runs[1] and len({tuple(x) for x in runs[0][1]}) > 1


def test_it_acts_only_on_a_cpu_model_with_shared_heads():
    assert not use_gqa_attention(llama(kv_heads=6))  # as many key/value heads as query heads: nothing to share
    tok = train_tokenizer(["ab cd"], vocab_size=64)
    assert not use_gqa_attention(tiny_llama(tok, hidden=32, layers=1, heads=2))  # the tiny models: no grouping
    eager = llama(kv_heads=2)
    eager.set_attn_implementation("eager")
    assert not use_gqa_attention(eager) and eager.config._attn_implementation == "eager"  # a choice left as it is
