"""The policy network: how it is built, and its distribution at the completion positions of a batch.

    model, tokenizer = build_model(cfg, device)                   # tiny local Llama, or a HF model / directory
    logits = completion_logits(model, prompt_ids, completion_ids, temperature, len(tokenizer))   # [B, T, V]
    logits = rollout_logits(model, ro, rows, len(tokenizer))      # the same for samples `rows` of rollouts `ro`
    logits = packed_logits(model, ids, attn, T, temperature, vocab_size)                         # already packed
    head = packed_logits(model, ids, attn, T, temperature, vocab_size, chunk_rows=1024)          # head.LMHead

Everything that turns the network's weights into the policy pi(. | context) lives here, so the trainer, the TRL
integration, the tests and the benchmarks score completions with one function, and the samplers (rollout.py,
vllm_engine.py) are checked against it. Why a module of its own: sampling (rollout.py) produces token ids; this
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
- `build_model` names what it cannot load (a UsageError: the file, and what to do): a damaged file of a local
  model, checkpoint or `<out>/base` folder (troll.checkpoint.damaged_file, then the loader's own error), a LoRA
  run's missing base, adapters PEFT refuses.
- `build_model` returns train mode (`from_pretrained` returns eval mode, in which gradient checkpointing does
  nothing) in float32; bf16 is autocast by the trainer. On CPU a model whose query heads share key/value heads
  runs troll.attention's `gqa_sdpa`: sdpa's values without copying the shared heads.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from troll import lora, packaged
from troll.attention import use_gqa_attention
from troll.checkpoint import TOKENIZER, WEIGHTS, damage_remedy, damaged_file
from troll.cli import UsageError
from troll.head import LMHead, Logits
from troll.padding import left_pad, mask_padded_vocab, position_ids

if TYPE_CHECKING:
    from troll.config import Config
    from troll.rollout import Rollouts


class BaseMissing(UsageError, ValueError):
    """A LoRA run's own base folder is gone: one line at the command's boundary, and still the ValueError that
    troll.lora.base_source raises for it."""


TINY = dict(hidden=128, layers=2, heads=4)  # the tiny-cpu preset's model: 0.59M parameters


def build_model(cfg: Config, device: torch.device, path: str | Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer): the tiny local Llama (`cfg.model == "tiny"`), or `path` / cfg.model via transformers.
    The tiny tokenizer keeps troll.tiny's ChatML template only where the run's prompts go through it (GSM8K with
    `cfg.chat`): the addition tasks prompt with raw text, so the checkpoints and exports of those runs carry no chat
    template and `apply_chat_template` fails rather than giving a format the model never saw.
    With `cfg.lora_rank` the base comes in `base_dtype(cfg)` and without adapters (`adapt` adds them after the
    warm-start), unless `path` is a LoRA checkpoint: then its adapters on the run's base (troll.lora)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapters = path if path is not None and lora.is_adapter_checkpoint(path) else None
    if adapters:  # a checkpoint's adapters on the run's base, which sits two folders up (troll.checkpoint)
        try:
            path = lora.base_source(cfg, Path(adapters).parent.parent)
        except ValueError as e:  # the run's own base lacks its config.json: `load` names it, or the folder is gone
            own = Path(adapters).parent.parent / "base"
            if not own.is_dir():
                raise BaseMissing(str(e)) from None
            path = own
    if path is None and cfg.model == "tiny":
        from troll import addition
        from troll.tiny import pad_vocab, tiny_llama, train_tokenizer

        tokenizer = train_tokenizer(addition.corpus(), vocab_size=64)  # 260 tokens: the 256 bytes + specials
        if cfg.vocab_size:  # a long-tailed softmax, as an LLM's: unused tokens up to vocab_size (troll.tiny)
            tokenizer = pad_vocab(tokenizer, cfg.vocab_size)
        if not (cfg.task in ("gsm8k", "words") and cfg.chat):  # raw prompts ("04+85="): no chat template it never saw
            tokenizer.chat_template = None
        model = tiny_llama(tokenizer, **TINY, seed=cfg.seed)
    else:
        src = path or cfg.model
        tokenizer = load(AutoTokenizer.from_pretrained, adapters or src, "tokenizer")
        model = load(lambda s: AutoModelForCausalLM.from_pretrained(s, dtype=base_dtype(cfg)), src, "model")
        use_gqa_attention(model, device)  # on CPU: shared key/value heads read in place, the same values
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable()
    if adapters:
        model = load(lambda a: lora.load_adapters(model, a), adapters, "adapters")
    model.train()
    return model.to(device), tokenizer


NEEDS = {  # what `load` needs in a local folder: each entry a file, or a tuple of which one is enough
    "tokenizer": ("tokenizer_config.json", TOKENIZER),
    "model": ("config.json", ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")),
    "adapters": lora.ADAPTER_FILES,
}


def load(loader: Callable[[str], Any], source: str | Path, kind: str) -> Any:
    """`loader(source)`, loading a `kind` of NEEDS; for a local folder, its missing (NEEDS) and damaged files
    (troll.checkpoint.damaged_file) and the loader's failure are a UsageError naming the file or folder and what
    to do (troll.checkpoint.damage_remedy). A hub name's failures pass."""
    source = packaged.resolve(str(source))  # a packaged model's name: its folder, made on first use
    folder = Path(source)
    if not folder.is_dir():
        return loader(source)
    names = [(n,) if isinstance(n, str) else n for n in NEEDS[kind]]
    missing = [" or ".join(n) for n in names if not any((folder / f).is_file() for f in n)]
    problem = f"{folder} lacks {', '.join(missing)}" if missing else damaged_file(folder)
    if problem:
        raise UsageError(f"{problem}: {damage_remedy(folder)}")
    try:
        loaded = loader(source)
    except ImportError:
        raise
    except Exception as e:  # transformers, tokenizers, safetensors and PEFT raise many types on a file they refuse
        first = (str(e).splitlines() or [""])[0][:200]
        raise UsageError(f"{folder} cannot be loaded ({type(e).__name__}: {first}): {damage_remedy(folder)}") from None
    if problem := loaded_problem(loaded, folder):
        raise UsageError(f"{problem}: {damage_remedy(folder)}")
    return loaded


def loaded_problem(loaded: Any, folder: Path) -> str | None:
    """What a whole-looking folder loaded as and must not be: a tokenizer without an EOS token (its
    tokenizer_config.json lost), weights with NaN or inf (garbled bytes load without complaint), named by file."""
    if hasattr(loaded, "eos_token_id") and not hasattr(loaded, "parameters") and loaded.eos_token_id is None:
        return f"{folder / 'tokenizer_config.json'} is missing or damaged: the tokenizer has no EOS token"
    if not isinstance(loaded, torch.nn.Module):
        return None
    lora_only = lora.is_adapter_checkpoint(folder)  # the adapters were loaded onto a base checked before
    with torch.no_grad():
        bad = next(
            (n for n, p in loaded.named_parameters() if (not lora_only or "lora_" in n) and not p.isfinite().all()),
            None,
        )
    if bad is None:
        return None
    files = [f for f in ("adapter_model.safetensors", *WEIGHTS) if (folder / f).is_file()]
    return f"{folder / files[0] if files else folder} holds NaN or infinite weights ({bad}): damaged bytes"


def run_config(run: Path) -> Config:
    """Run `run`'s config.json, for a command that loads its checkpoints (troll.evaluate, troll.export). Missing or
    not JSON: a UsageError saying that resume writes it again from the run's newest checkpoint (Config.resumed)."""
    from troll.config import Config

    path = run / "config.json"
    again = (
        f"python -m troll.train --out {run} --resume true writes it again from the run's newest checkpoint (a "
        "finished run is not trained further)"
    )
    if not path.is_file():
        raise UsageError(f"{path} is missing: {again}")
    try:
        json.loads(path.read_bytes().decode("utf-8"))
    except ValueError:  # not UTF-8, not JSON
        raise UsageError(f"{path} is damaged (not JSON): {again}") from None
    try:
        return Config.load(path)
    except ValueError as e:
        raise UsageError(str(e)) from None


def base_dtype(cfg: Config) -> torch.dtype:
    """The weights' dtype: float32 (trained weights, and every weight of a full fine-tune), or bfloat16 for a LoRA
    run's frozen base under bf16 autocast (troll.lora)."""
    return torch.bfloat16 if cfg.lora_rank and cfg.bf16 else torch.float32


def adapt(cfg: Config, model: Any) -> Any:
    """`model` as the policy to train: itself (full fine-tuning), or with `cfg.lora_rank` new LoRA adapters on it,
    held frozen in `base_dtype(cfg)` (troll.lora)."""
    if not cfg.lora_rank:
        return model
    return lora.add_adapters(model.to(base_dtype(cfg)), cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)


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
