"""Rollouts: sample completions and their behaviour log-probs; greedy completions for evaluation.

One protocol (`Generator`), two backends, one result:

    gen = HFGenerator(model, tokenizer)            # or vllm_engine.VLLMGenerator(model_dir, tokenizer)
    ro = gen.generate(prompts, n=8, max_new_tokens=256, temperature=1.0, top_k_logprobs=64, seed=0)
    ids = gen.greedy(prompts, max_new_tokens=256)  # evaluation: token ids, a final EOS included
    ids = gen.sample(prompts, n=4, max_new_tokens=256, temperature=1.0, seed=0)  # evaluation: ids only, no log-probs
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

Padding positions hold id 0 and log-prob 0.0, and their top-K is a one-hot distribution on id 0 (top_idx
0, 1, ..., K - 1, top_logp 0, -inf, ...), so every position is a valid distribution for `sparse.sparsify_topk`;
losses and metrics still use `completion_mask`.

Log-probs describe exactly the distribution that was sampled, and the trainer recomputes the same
quantity with `policy.completion_logits` (then `log_softmax`):

    log pi(. | context) = log_softmax(mask(logits) / temperature)

- No top-p / top-k / min-p truncation, no penalties; temperature > 0 (sampling; `greedy` is its own call).
- `mask` sets ids >= len(tokenizer) to -inf (`padding.mask_padded_vocab`); every code path (HF sampling and
  greedy, vLLM sampling and greedy, the scoring forward) applies it.
- The model's own generation config (Qwen ships top_k=20, top_p=0.8, repetition_penalty...) is ignored:
  HF `generate` runs with `model.generation_config` swapped for a fresh `GenerationConfig()` for the call,
  in eval mode (no dropout; gradient checkpointing would turn the KV cache off), the mode restored after.
- HF sampling runs under `torch.random.fork_rng` seeded with `seed`: reproducible, and the caller's RNG state
  is left as it was. With `share_prompt` a prompt is forwarded once for its n samples (its KV cache repeated),
  not n times: the same distribution, sampled in the same order from the same seed. Its memory is O(B * T * V)
  (it keeps every step's scores): meant for tests and small models.

Bad input, all checked before any sampling (`check_request`): an empty batch, an empty prompt, a token id
outside the tokenizer, n < 1, max_new_tokens < 1, temperature <= 0, K < 0, and a prompt with
len(prompt) + max_new_tokens > max_model_len are ValueErrors naming the offending value (prompts are never
dropped silently: filter by length when building the data set).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor
from tqdm.auto import tqdm
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from troll.padding import check_vocab, left_pad, mask_padded_vocab, position_ids


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

    def tokens(self) -> list[list[int]]:
        """Each sample's completion ids, its real tokens only (an ending EOS included): B lists."""
        lengths = self.completion_mask.sum(-1).tolist()
        return [ids[:n] for ids, n in zip(self.completion_ids.tolist(), lengths, strict=True)]

    def micro_batches(self, max_tokens: int, rows: Tensor | None = None) -> list[Tensor]:
        """Split sample indices `rows` (default: all) into chunks of at most max_tokens padded tokens (prompt +
        completion columns) each, at least one sample per chunk."""
        rows = torch.arange(len(self)) if rows is None else rows
        width = max(len(p) for p in self.prompt_ids) + self.completion_ids.shape[1]
        per = max(1, max_tokens // width)
        return [rows[i : i + per] for i in range(0, len(rows), per)]

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


@dataclass
class Batch:
    """One RL step's data, made when it is sampled (troll.train.collect): the rollouts, their rewards [B] and
    advantages [B], the random state that goes on to shuffle its minibatches, what making it cost, and what the
    rewards were scored against: each sample's problem (its row in task.train) and gold answer, [B] (troll.run.records
    keeps them). Batches sampled ahead (--staleness) are saved in checkpoints, so the class lives here, in an
    importable module; one pickled with a field since removed (`behaviour`, now troll.run.diagnostics.behaviour_rate)
    loads with it unread, and one pickled before a field with a default existed reads the default (the class's)."""

    ro: Rollouts
    rewards: Tensor
    adv: Tensor
    rng_state: Tensor
    time_generate: float
    time_score: float
    train_rows: list[int] | None = None  # [B] each sample's problem, its index in task.train (None: not kept)
    golds: list[str] | None = None  # [B] each sample's gold answer (None: not kept)
    drawn: tuple[Tensor, Tensor] | None = None  # [B0] rewards and groups of all samples drawn, where B keeps a part

    def keep(self, idx: Tensor) -> Batch:
        """Samples `idx` ([b] long, whole groups) of this batch, their groups numbered anew from 0; `drawn` records
        what the whole batch drew (--filter_groups: troll.train.collect)."""
        _, group = torch.unique(self.ro.group[idx], return_inverse=True)
        ro = dataclasses.replace(self.ro.select(idx), group=group)
        pick = idx.tolist()
        return dataclasses.replace(
            self, ro=ro, rewards=self.rewards[idx], adv=self.adv[idx],
            drawn=self.drawn or (self.rewards, self.ro.group),
            train_rows=None if self.train_rows is None else [self.train_rows[i] for i in pick],
            golds=None if self.golds is None else [self.golds[i] for i in pick],
        )  # fmt: skip


class Generator(Protocol):
    """What the trainer and the evaluation need from a rollout backend (HFGenerator, vllm_engine.VLLMGenerator)."""

    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k_logprobs: int = 0,
        seed: int | None = None,
    ) -> Rollouts: ...

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]: ...

    def sample(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, seed: int | None = None
    ) -> list[list[int]]: ...

    def push_weights(self, model: Any) -> None: ...

    eos_token_ids: list[int]  # a completion ends at the first of these (or at max_new_tokens)


def check_request(
    prompts: list[list[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    top_k_logprobs: int,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raise ValueError on anything `generate` would otherwise sample wrongly or crash on (both backends)."""
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


def to_rollouts(
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
    t_idx = torch.arange(K).expand(B, T, K).clone() if top_idx is not None else None
    t_lp = torch.full((B, T, K), -torch.inf) if top_logp is not None else None
    if t_lp is not None and K > 0:
        t_lp[..., 0] = 0.0  # padding: a one-hot on id 0 (module docstring)
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


def eos_ids(tokenizer: Any, eos_token_ids: Sequence[int] | None) -> list[int]:
    ids = list(eos_token_ids) if eos_token_ids is not None else [tokenizer.eos_token_id]
    if not ids or any(i is None for i in ids):
        raise ValueError("no EOS id: pass eos_token_ids or use a tokenizer with an eos_token")
    return ids


class MaskPaddedVocab(LogitsProcessor):
    """`generate` hook applying `mask_padded_vocab` to every step's scores ([B, V])."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return mask_padded_vocab(scores, self.vocab_size)


class HFGenerator:
    """Sample with transformers `generate` from the training model itself (`push_weights` is then a no-op), or with
    `dtype` (e.g. torch.bfloat16) from a copy of it in that precision, which `push_weights` refreshes: a sampler in
    lower precision than the trainer, as a bf16 inference engine is."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_model_len: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        greedy_batch: int = 64,
        dtype: torch.dtype | None = None,
        share_prompt: bool = False,
    ):
        self.source = model
        self.model = model if dtype in (None, model.dtype) else copy.deepcopy(model).to(dtype)
        self.vocab_size = len(tokenizer)
        check_vocab(self.vocab_size, model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = eos_ids(tokenizer, eos_token_ids)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.greedy_batch = greedy_batch
        self.share_prompt = share_prompt

    def push_weights(self, model: Any) -> None:
        """Copy the training model's weights into the lower-precision sampler (no-op when the sampler is the model
        itself). Refuses a different model object."""
        if model is not self.source:
            raise ValueError("HFGenerator samples with the model it was built with; got a different model")
        if self.model is not model:
            with torch.no_grad():
                for dst, src in zip(self.model.parameters(), model.parameters(), strict=True):
                    dst.copy_(src)

    @torch.no_grad()
    def _generate(
        self, prompts: list[list[int]], config: GenerationConfig, seed: int | None, n: int = 1
    ) -> tuple[Any, int]:
        """`model.generate` on left-padded prompts, in eval mode, without the model's own generation config; n
        samples of each. With `share_prompt` each prompt but its last token is forwarded once and its cache repeated for
        its n samples (`_prefill`, where every prompt has a token before its last); else transformers repeats it
        (`num_return_sequences`)."""
        device = next(self.model.parameters()).device
        ids, attn = (x.to(device) for x in left_pad(prompts, self.pad_id))
        config.eos_token_id, config.pad_token_id = self.eos_token_ids, self.pad_id
        saved, was_training = self.model.generation_config, self.model.training
        self.model.generation_config = GenerationConfig()
        self.model.eval()
        try:
            cache = None
            if self.share_prompt and n > 1 and min(len(p) for p in prompts) > 1:
                ids, attn, cache = self._prefill(ids, attn, n)
            config.num_return_sequences = 1 if cache is not None else n  # a shared prompt's rows are repeated already
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if seed is not None:
                    torch.manual_seed(seed)
                out = self.model.generate(
                    input_ids=ids,
                    attention_mask=attn.long(),
                    generation_config=config,
                    logits_processor=LogitsProcessorList([MaskPaddedVocab(self.vocab_size)]),
                    **({"past_key_values": cache} if cache is not None else {}),
                )
        finally:
            self.model.generation_config = saved
            self.model.train(was_training)
        return out, ids.shape[1]

    def _prefill(self, ids: Tensor, attn: Tensor, n: int) -> tuple[Tensor, Tensor, Any]:
        """Prompts [U, P] forwarded once up to their last column, the KV cache repeated n times per prompt (sample
        b = i * n + j, as transformers orders num_return_sequences): (ids, attn [U * n, P], the cache). `generate`
        then computes only the last column of each row before sampling."""
        positions = position_ids(attn)  # as generate numbers them
        head = self.model(
            input_ids=ids[:, :-1], attention_mask=attn[:, :-1].long(), position_ids=positions[:, :-1], use_cache=True,
            logits_to_keep=1,
        )  # fmt: skip
        cache = head.past_key_values
        cache.batch_repeat_interleave(n)
        return ids.repeat_interleave(n, 0), attn.repeat_interleave(n, 0), cache

    def _lengths(self, comp: Tensor) -> tuple[Tensor, Tensor]:
        """(finished [B] bool, length [B] long): up to and including the first EOS, else the whole row."""
        is_eos = torch.isin(comp, torch.tensor(self.eos_token_ids))
        finished = is_eos.any(-1)
        return finished, torch.where(finished, is_eos.int().argmax(-1) + 1, comp.shape[1])

    def _completions(self, seqs: Tensor, P: int) -> list[list[int]]:
        """Each row's completion after the P prompt columns, up to and including its first EOS."""
        comp = seqs[:, P:].cpu()
        _, lengths = self._lengths(comp)
        return [row[:n] for row, n in zip(comp.tolist(), lengths.tolist(), strict=True)]

    def greedy(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy completions (token ids, a final EOS included) in batches of `greedy_batch` prompts."""
        check_request(prompts, 1, max_new_tokens, 1.0, 0, self.vocab_size, self.max_model_len)
        out: list[list[int]] = []
        batches = range(0, len(prompts), self.greedy_batch)
        for i in tqdm(batches, desc="greedy", leave=False, disable=True if len(batches) < 2 else None):  # a terminal
            config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens)
            out += self._completions(*self._generate(prompts[i : i + self.greedy_batch], config, seed=None))
        return out

    def sample(
        self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float, seed: int | None = None
    ) -> list[list[int]]:
        """n sampled completions of each prompt (token ids, a final EOS included; sample b = i * n + j): the tokens
        `generate` draws from the same seed, without their scores, so memory is O(B * V), not O(B * T * V). For
        evaluation, which needs no log-probs."""
        check_request(prompts, n, max_new_tokens, temperature, 0, self.vocab_size, self.max_model_len)
        config = GenerationConfig(
            do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens
        )
        return self._completions(*self._generate(prompts, config, seed, n))

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
        check_request(prompts, n, max_new_tokens, temperature, top_k_logprobs, self.vocab_size, self.max_model_len)
        config = GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new_tokens,
            output_scores=True,
            return_dict_in_generate=True,
        )
        out, P = self._generate(prompts, config, seed, n)
        comp = out.sequences[:, P:].cpu()  # [B, T]
        logp = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu()  # [B, T, V]
        finished, lengths = self._lengths(comp)
        tok_lp = logp.gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        top = logp.topk(top_k_logprobs, dim=-1) if top_k_logprobs > 0 else None
        L = lengths.tolist()
        return to_rollouts(
            prompts,
            n,
            [comp[b, : L[b]].tolist() for b in range(len(L))],
            finished.tolist(),
            [tok_lp[b, : L[b]] for b in range(len(L))],
            None if top is None else [top.indices[b, : L[b]] for b in range(len(L))],
            None if top is None else [top.values[b, : L[b]] for b in range(len(L))],
            temperature,
        )
