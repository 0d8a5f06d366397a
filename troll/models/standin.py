"""Stand-ins for the hub models: the published Qwen and Llama architectures with random weights, and a local
tokenizer padded to the real tokenizer's size, so that every tensor has its real shape without downloading anything.

    model = build("qwen2.5-0.5b")                                  # random float32 weights, Qwen2.5-0.5B's shape
    path = save_standin("qwen2.5-0.5b", texts, "runs/standin")     # model + tokenizer, loadable by HF and vLLM
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)

Architectures (`ARCHS`, from the published config.json files; parameters with a tied embedding counted once, as
`sum(p.numel() for p in model.parameters())` counts them; output layer `vocab` rows, tokenizer `tok` ids, the rows
past it masked as in training):
    qwen2.5-0.5b  24 layers, hidden 896,  14 heads / 2 KV heads (head_dim 64),  MLP 4,864,  qkv bias,  tied  0.49B
    qwen3-0.6b    28 layers, hidden 1024, 16 heads / 8 KV heads (head_dim 128), MLP 3,072,  q/k norm,  tied  0.60B
    qwen2.5-1.5b  28 layers, hidden 1536, 12 heads / 2 KV heads (head_dim 128), MLP 8,960,  qkv bias,  tied  1.54B
    qwen3-1.7b    28 layers, hidden 2048, 16 heads / 8 KV heads (head_dim 128), MLP 6,144,  q/k norm,  tied  1.72B
    qwen3-4b      36 layers, hidden 2560, 32 heads / 8 KV heads (head_dim 128), MLP 9,728,  q/k norm,  tied  4.02B
    qwen3-8b      36 layers, hidden 4096, 32 heads / 8 KV heads (head_dim 128), MLP 12,288, q/k norm, untied 8.19B
    llama3.1-8b   32 layers, hidden 4096, 32 heads / 8 KV heads (head_dim 128), MLP 14,336, untied, vocabulary
                  128,256 (tokenizer and output layer), rope_theta 500,000 with the "llama3" rope scaling (factor 8,
                  low / high frequency factors 1 / 4, original context 8,192), rms_norm_eps 1e-5           8.03B
    tiny          the Qwen2 architecture at 2 layers, hidden 128 (head_dim 64), output layer = tokenizer + 64 rows:
                  the same code path at a size the test suite runs in seconds
Qwen2.5 / Qwen3: vocabulary 151,936 rows (tokenizer 151,665 / 151,669 ids), rope_theta 1e6, rms_norm_eps 1e-6.
Qwen3-1.7B's 1.72B is Qwen's own count ("1.7B, 1.4B non-embedding"); the hub's 2.03B counts its tied embedding
twice. `model_config(name, layers=n)` cuts a model to n layers at the full width (bench/real_shapes.py).

The tokenizer (`standin_tokenizer`), for every architecture, is `Qwen2Tokenizer` (Qwen's pre-tokenizer
regex, byte-level BPE, NFC), with merges trained on the texts given and the vocabulary padded with unreachable
filler entries to `tok` ids, special tokens last (<|endoftext|> = pad, <|im_start|>, <|im_end|> = EOS), as
Qwen's are. Why its own class: `AutoTokenizer` picks the tokenizer class from a folder's `model_type`, so a
Qwen2-architecture folder holding any other tokenizer is reloaded as a Qwen2Tokenizer that tokenises differently
(docs/vllm_cpu.md); with the class it names itself, the tokenizer a run starts with, the one a checkpoint reloads
and the one vLLM would load are the same. A Llama folder reloads it as the class its tokenizer_config.json names
(`tokenizer_class`: Qwen2Tokenizer), with the same ids (tests/test_check.py), so the Llama stand-in keeps it: its
vocabulary is padded to Llama 3's 128,256 ids and its chat template is ChatML, not Llama's. The chat template is
ChatML (Qwen's format without its default system message): `<|im_start|>{role}\\n{content}<|im_end|>\\n`, then
`<|im_start|>assistant\\n`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

VOCAB = 151_936  # the output layer of every Qwen2.5 / Qwen3 model
LLAMA3_VOCAB = 128_256  # Llama 3.x: output layer and tokenizer alike (128,000 BPE tokens + 256 special)
ARCHS: MappingProxyType[str, dict] = MappingProxyType(
    {  # arch, layers, hidden, heads, KV heads, head_dim, MLP, tokenizer ids, output rows (0: tokenizer + 64), tied
        "qwen2.5-0.5b": dict(arch="qwen2", layers=24, hidden=896, heads=14, kv=2, head_dim=64, mlp=4864,
                             tok=151_665, vocab=VOCAB, tied=True),
        "qwen3-0.6b": dict(arch="qwen3", layers=28, hidden=1024, heads=16, kv=8, head_dim=128, mlp=3072,
                           tok=151_669, vocab=VOCAB, tied=True),
        "qwen2.5-1.5b": dict(arch="qwen2", layers=28, hidden=1536, heads=12, kv=2, head_dim=128, mlp=8960,
                             tok=151_665, vocab=VOCAB, tied=True),
        "qwen3-1.7b": dict(arch="qwen3", layers=28, hidden=2048, heads=16, kv=8, head_dim=128, mlp=6144,
                           tok=151_669, vocab=VOCAB, tied=True),
        "qwen3-4b": dict(arch="qwen3", layers=36, hidden=2560, heads=32, kv=8, head_dim=128, mlp=9728,
                         tok=151_669, vocab=VOCAB, tied=True),
        "qwen3-8b": dict(arch="qwen3", layers=36, hidden=4096, heads=32, kv=8, head_dim=128, mlp=12288,
                         tok=151_669, vocab=VOCAB, tied=False),
        "llama3.1-8b": dict(arch="llama", layers=32, hidden=4096, heads=32, kv=8, head_dim=128, mlp=14336,
                            tok=LLAMA3_VOCAB, vocab=LLAMA3_VOCAB, tied=False),
        "tiny": dict(arch="qwen2", layers=2, hidden=128, heads=2, kv=1, head_dim=64, mlp=256, tok=0, vocab=0,
                     tied=True),
    }
)  # fmt: skip
LLAMA3_ROPE = dict(  # Llama 3.1's published rope_scaling ("llama3": long wavelengths stretched 8x) and theta
    rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)  # fmt: skip
TINY_PAD_ROWS = 64  # "tiny": output-layer rows past the tokenizer
PAD, IM_START, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIALS = (PAD, IM_START, EOS)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def model_config(
    name: str, vocab: int | None = None, special_ids: dict[str, int] | None = None, layers: int | None = None
) -> Any:
    """The transformers config of architecture `name` (ARCHS) with a `vocab`-row output layer (None: the
    architecture's own) and `layers` decoder layers (None: the architecture's own; fewer: a depth-truncated model
    at the full width, as bench/real_shapes.py measures the 4B and 8B shapes)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    m = ARCHS[name]
    common = dict(
        vocab_size=vocab or m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["mlp"],
        num_hidden_layers=layers or m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv"],
        rms_norm_eps=1e-6,
        tie_word_embeddings=m["tied"],
        hidden_act="silu",
        **(special_ids or {}),
    )
    if m["arch"] == "llama":
        common |= dict(rms_norm_eps=1e-5, max_position_embeddings=131_072, head_dim=m["head_dim"])
        return LlamaConfig(rope_parameters=dict(LLAMA3_ROPE), **common)
    common |= dict(max_position_embeddings=32768, rope_theta=1e6)
    if m["arch"] == "qwen3":
        return Qwen3Config(head_dim=m["head_dim"], **common)
    if m["hidden"] // m["heads"] != m["head_dim"]:
        raise ValueError(f"{name}: Qwen2 derives head_dim = hidden / heads, not {m['head_dim']}")
    return Qwen2Config(**common)


def build(
    name: str,
    vocab: int | None = None,
    seed: int = 0,
    special_ids: dict[str, int] | None = None,
    layers: int | None = None,
) -> Any:
    """A random-weight float32 model of architecture `name` (ARCHS; `model_config`); the global RNG is left as
    it was."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = model_config(name, vocab, special_ids, layers)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def standin_tokenizer(texts: Iterable[str], size: int = 0, merges: int = 2048) -> Any:
    """A Qwen2Tokenizer with up to `merges` BPE tokens learned from `texts` (the 256 bytes included), padded with
    unreachable filler entries to `size` ids (0: no padding), the three special tokens last (module docstring)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=merges, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train_from_iterator(texts, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = dict(model["vocab"])
    merge_list = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    n_regular = max(size - len(SPECIALS), len(vocab))
    if size and size - len(SPECIALS) < len(vocab):
        raise ValueError(f"size={size} is smaller than the {len(vocab) + len(SPECIALS)} ids learned")
    for i in range(len(vocab), n_regular):  # fillers: no merge produces them, so no text encodes to them
        vocab[f"<|filler_{i}|>"] = i
    for i, s in enumerate(SPECIALS):
        vocab[s] = n_regular + i
    tok = Qwen2Tokenizer(vocab=vocab, merges=merge_list, unk_token=None, eos_token=EOS, pad_token=PAD)
    tok.add_special_tokens({"additional_special_tokens": [IM_START]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_standin(name: str, texts: Iterable[str], path: str | Path, seed: int = 0) -> Path:
    """Build the stand-in for architecture `name` (its tokenizer learned from `texts`) and save model and tokenizer
    into `path`, a folder `from_pretrained`, `AutoTokenizer` and `vllm.LLM(model=path)` load."""
    m = ARCHS[name]
    tok = standin_tokenizer(texts, size=m["tok"])
    vocab = m["vocab"] or len(tok) + TINY_PAD_ROWS
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    model = build(name, vocab=vocab, seed=seed, special_ids=ids)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path
