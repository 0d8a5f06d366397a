"""Tiny local models for tests, notebooks and the CPU preset; nothing is downloaded.

Choices, all fixed here:

- Tokenizer: byte-level BPE trained with `tokenizers` on the texts you pass (every byte is in the
  initial alphabet, so any string encodes). Special tokens take the first ids, in this order:
  `<|pad|>` (pad), `<|bos|>` (bos), `<|im_end|>` (eos), `<|im_start|>`. No token is added
  automatically when encoding; the ChatML-style `chat_template` writes
  `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message and `<|im_start|>assistant\\n` as the
  generation prompt, so a completion ends with eos = `<|im_end|>`, as in Qwen's chat models. Stand-ins for chat
  models (GSM8K tests) keep it; troll.policy drops it from the addition tasks' model, which is prompted raw.
- Model: `LlamaForCausalLM` (not Qwen2: with `model_type=qwen2`, `AutoTokenizer` and vLLM load a
  Qwen2 tokenizer class instead of the saved one; see docs/vllm_cpu.md), float32, untied
  embeddings (so a weight push must send `lm_head.weight`), MLP width 4 * hidden, no GQA.
  Keep head_dim = hidden / heads in {32, 64, 80, 96, 112, 128, ...}: vLLM's CPU attention rejects
  others (head_dim 16 fails at the first forward with "Unsupported CPU attention configuration").
  `vocab_size` may exceed the tokenizer to mimic Qwen's padded output layer; the extra rows are
  ordinary random weights, so samplers must mask them.
- `pad_vocab` grows a tokenizer to a given size with tokens no text encodes to (BPE entries without a merge,
  named `<unusedN>`): the output layer then has that many real rows, and the softmax a long tail of tokens that
  are possible but never seen, as in an LLM's 151,936-token vocabulary (the `--vocab_size` setting).
- Initialisation is seeded inside `torch.random.fork_rng`, so building a model does not move the
  global RNG.
- `save_tiny` writes model and tokenizer with `save_pretrained` into one directory that both
  `from_pretrained` and `vllm.LLM(model=dir)` load.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

PAD, BOS, EOS, IM_START = "<|pad|>", "<|bos|>", "<|im_end|>", "<|im_start|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on `texts`; `len(tok) <= vocab_size` (small corpora stop early)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS, IM_START],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tok.add_special_tokens({"additional_special_tokens": [IM_START]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def pad_vocab(tokenizer: PreTrainedTokenizerFast, size: int) -> PreTrainedTokenizerFast:
    """A copy of `tokenizer` with `size` tokens: the new ids are BPE vocabulary entries that no merge produces, so
    every text encodes as before and the new tokens appear only when a model samples them."""
    if size < len(tokenizer):
        raise ValueError(f"vocab_size={size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<unused{i}>": i for i in range(len(tokenizer), size)})
    padded = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        additional_special_tokens=[IM_START],
    )
    padded.chat_template = tokenizer.chat_template
    return padded


def tiny_llama(
    tokenizer: PreTrainedTokenizerFast,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    seed: int = 0,
    vocab_size: int | None = None,
) -> LlamaForCausalLM:
    """A randomly initialised float32 Llama; `vocab_size` defaults to `len(tokenizer)` and may be larger."""
    vocab = len(tokenizer) if vocab_size is None else vocab_size
    if vocab < len(tokenizer):
        raise ValueError(f"vocab_size={vocab} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_tiny(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, path: str | Path) -> Path:
    """Save model (safetensors) and tokenizer into `path` so `from_pretrained` and vLLM can load it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
