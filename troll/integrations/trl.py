"""TROLL as the loss of TRL's `GRPOTrainer`: the same projection, TRL's launchers (docs/algorithm.md, the objective).

    from troll.integrations.trl import TROLLConfig, TROLLGRPOTrainer
    args = TROLLConfig(output_dir="out", troll_eps=0.05, num_generations=8, ...)   # every GRPOConfig field works
    TROLLGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...).train()

Everything but the steps below is TRL's own: generation (transformers, or vLLM server / colocate), rewards,
advantages, batching over `steps_per_generation` and `num_iterations`, accelerate / DeepSpeed / FSDP, PEFT
(`peft_config=LoraConfig(...)`: TRL wraps the model, only the adapters train, on the TROLL loss), optimiser,
logging and checkpoints. What TROLL adds or replaces:

  old policy   right after TRL generates and scores a batch, one no-grad forward of the training model over
               [prompt | completion] gives q at every completion position, sparsified once (troll.sparse.sparsify:
               top-mass support of at most K, kept mass >= 1 - delta, plus the sampled token) and stored with the
               batch as tensors "troll_old_<field>" [B, T, K+1] and [B, T]. It is the policy before any update on
               this batch: the paper's choice, = troll.train's old_policy="recompute".
  sampler      when the completions come with the sampler's log-probs (vLLM, server or colocate, or a rollout_func:
               TRL's batch field "sampling_per_token_logps", log mu(y) [B, T]), the decoupled objective of the plain
               loop (docs/algorithm.md, 10b): each token's policy term weighed by w = sg(min(q(y) / mu(y), C)), the
               trust region staying around q. On by default, as in TRL's GRPO
               (vllm_importance_sampling_correction=True): the sampler always differs from the trainer there (its own
               kernels and precision), and an uncorrected estimator is biased by the mismatch (10a).
               vllm_importance_sampling_mode "truncate" (default, = troll.train's --is_correction tis; per response
               under GSPO) or TRL's token_truncate / token_mask / sequence_truncate / sequence_mask, each as TRL
               defines it (10f); C = vllm_importance_sampling_clip_max (default 2.0, the plain loop's --is_cap; TRL's
               GRPO: 3.0), floor = vllm_importance_sampling_clip_min; vllm_importance_sampling_correction=False: none.
               w comes from troll.integrations.is_weights.trl_is_weight and enters troll_loss as is_weight.
               TRL's own correction code is switched off (TROLL's loss applies it). Logged every generation batch,
               with or without the correction: troll/mismatch_logratio_mean, troll/mismatch_logratio_absmax,
               troll/mismatch_kl (troll.run.diagnostics.mismatch_at, log q(y) - log mu(y) over the real tokens).
               No behaviour anchor (the plain loop's --old_policy behaviour, q = the sampler's top-K): TRL 1.16
               builds its vLLM engine with logprobs=0 and keeps one log-prob per position (`lp[0]` of what vLLM
               returns, dropping the token ids), so the sampler's top-K never reaches the batch; raising vLLM's
               logprobs would make that `lp[0]` the top-1 token's log-prob instead of the sampled one's.
  loss         `compute_loss`: logits [b, T, V] / temperature of the current model (`policy.packed_logits`, the
               function troll.train uses; positions counted from each row's first real token; with
               `troll_logits_chunk` > 0 the chunked output layer, which never builds [b, T, V]), then
               `troll.losses.troll_loss(logits, completion_ids, mask, advantages, q, eps, alpha, k, delta, agg, level)`
               (with the sampler correction, its weight is_weight too) with mask = completion_mask
               (x tool_mask) and TRL's settings mapped to troll's:

                   loss_type  troll agg                    scale (train; in eval GA = steps_per_generation = 1)
                   dapo       token-mean                   sum(m) / (num_items_in_batch / processes * GA / spg)
                   bnpo       token-mean                   1 / GA
                   grpo       seq-mean-token-mean          1 / GA
                   dr_grpo    seq-mean-token-sum-norm      1 / GA   (T_norm = max_completion_length)
                   importance_sampling_level "sequence" -> level="sequence" (GSPO with projected ratios), the
                   agg still the loss_type's, as in TRL (its GSPO recipe: loss_type "grpo", a mean over responses)

               so each TRL normalisation is reproduced exactly (dapo: the sum over the generation batch divided by
               its token count, as in TRL). With one process and GA = spg = 1 the loss is troll_loss itself.
  vLLM on CPU  TRL 1.16's weight sync into a colocated engine (`VLLMGeneration.sync_weights`) hands each tensor to
               the vLLM model's `load_weights`, which fails on the layers vLLM's CPU backend repacked for its kernels
               (float32 layers wherever oneDNN runs; bf16 ones on CPUs with AVX512-BF16 or AMX): "'Parameter' object
               has no attribute 'weight_loader'". On vLLM's CPU platform the trainer replaces that one method with
               vLLM's in-place `reload_weights`, as troll.models.vllm_engine pushes (`_reload_vllm_weights`; a LoRA
               model's adapted layers merged out of place, `vllm_weights`). On GPU TRL's own sync stays.
  metrics      every troll_loss metric and the correction's is_* ones as "troll/<key>" through TRL's logger, merged
               over processes by troll.base.metrics.merge ("_max" keys the max, "_min" keys the min, the rest the mean;
               the mismatch metrics weighted by each process's real tokens, so the mean is over the whole generation
               batch).

LoRA with dropout (`LoraConfig(lora_dropout > 0)` as `peft_config`, or a PeftModel's adapter) is refused by
TROLLGRPOTrainer with a ValueError naming `lora_dropout` (`check_no_lora_dropout`), unless `disable_dropout=True`
(TRL then sets every dropout to 0): with dropout every forward pass is a different random policy, so the loss's
policy differs from the sampler's and from the stored q before any update (the plain loop's adapters have none).

Not combined with TROLL (a clear ValueError from TROLLConfig): beta != 0 (the trust region replaces the reference
KL), the clip-family options (epsilon or epsilon_high away from TRL's defaults: troll_eps plays the clip's role;
the entropy mask / bonus, off-policy mask, delta cap), loss types other than the four above, Liger kernels.
Multimodal batches and MoE aux losses raise at the first step.

Memory: the loss needs the full [b, T, V] logits of a micro-batch (TRL's own loss streams the LM head); size
`per_device_train_batch_size` and `max_completion_length` for it, as with troll.train's micro_batch_tokens.
The stored q costs about (8 + 4 + 1) * (K + 1) bytes per completion token on the device.

Supported TRL versions: TRL_VERSIONS (this module overrides `GRPOTrainer._generate_and_score_completions` and
`compute_loss`, whose contracts change between minor releases, and, on vLLM's CPU platform only,
`VLLMGeneration.sync_weights`); others fail at import with the install command. With the vLLM CPU build (0.32),
TRL's colocate mode trains through TROLLGRPOTrainer, full model or LoRA: tests/test_trl.py runs two steps of each
and checks that the engine follows the trainer after every sync (docs/results.md, TRL with vLLM on CPU).
"""

from __future__ import annotations

import importlib.metadata
import inspect
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import Tensor

from troll.base.metrics import merge
from troll.integrations.is_weights import IS_MODES, trl_is_weight
from troll.lora import base_weights, engine_weights, is_lora
from troll.losses import check_troll_settings, troll_loss
from troll.policy import packed_logits
from troll.run.diagnostics import mismatch_at
from troll.sparse import TENSOR_FIELDS, SparseDist, cat_rows, sparsify

TRL_VERSIONS = ">=1.16,<1.17"
EPSILON = 0.2  # GRPOConfig's default epsilon (its epsilon_high defaults to None)
AGG = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
OLD = "troll_old_"
BEHAVIOUR = "troll_behaviour_logp"  # log mu(y) [B, T], stored with the batch when the correction is on


def check_trl_version(version: str | None) -> None:
    """Raise ImportError unless `version` (None = not installed) is in TRL_VERSIONS."""
    install = f"pip install 'trl{TRL_VERSIONS}'"
    if version is None:
        raise ImportError(f"troll.integrations.trl needs TRL: {install}")
    if Version(version) not in SpecifierSet(TRL_VERSIONS):
        raise ImportError(f"troll.integrations.trl supports trl{TRL_VERSIONS}, found trl {version}: {install}")


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


check_trl_version(_installed("trl"))

from trl import GRPOConfig, GRPOTrainer  # noqa: E402  (after the version check)


@dataclass
class TROLLConfig(GRPOConfig):
    """GRPOConfig plus TROLL's settings (paper defaults, docs/algorithm.md); incompatible options raise."""

    troll_eps: float = field(default=0.05, metadata={"help": "TROLL: KL bound per token."})
    troll_alpha: float = field(default=1.0, metadata={"help": "TROLL: weight of the regression term."})
    troll_k: int = field(default=64, metadata={"help": "TROLL: at most K tokens per sparse support."})
    troll_delta: float = field(default=1e-5, metadata={"help": "TROLL: kept mass >= 1 - delta."})
    troll_logits_chunk: int = field(
        default=0,
        metadata={"help": "TROLL: output layer in chunks of this many rows, no [b, T, V] logits (0: full logits)."},
    )
    troll_support: str = field(
        default="rest",
        metadata={"help": "TROLL's sparse model: rest (old support + one exact rest atom) or paper (1e-12 tail)."},
    )
    troll_detach_dual: bool = field(default=False, metadata={"help": "TROLL: no gradient through the dual."})
    vllm_importance_sampling_mode: str = field(
        default="truncate",
        metadata={
            "help": "TROLL: how the sampler correction weighs each token, rho = q(y) / mu(y): truncate (min(rho, "
            "clip_max) per token, per response under GSPO: the plain loop's --is_correction tis), or TRL's "
            "token_truncate, token_mask, sequence_truncate, sequence_mask (docs/algorithm.md, 10f)."
        },
    )
    vllm_importance_sampling_clip_max: float | None = field(
        default=2.0,
        metadata={"help": "TROLL: the correction's cap C_max >= 1 (the plain loop's --is_cap); None: no cap."},
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        clip = "no ratio clip with TROLL: its trust region is the KL bound troll_eps"
        cap, floor = self.vllm_importance_sampling_clip_max, self.vllm_importance_sampling_clip_min
        bad = {
            "beta": (self.beta != 0.0, "TROLL's trust region replaces the KL penalty to a reference model"),
            "loss_type": (self.loss_type not in AGG, f"TROLL maps only the loss types {sorted(AGG)}"),
            "top_entropy_quantile": (self.top_entropy_quantile < 1.0, "no entropy mask with TROLL"),
            "entropy_coef": (self.entropy_coef != 0.0 or self.use_adaptive_entropy, "no entropy bonus with TROLL"),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold is not None, "no off-policy mask"),
            "delta": (self.delta is not None, "no ratio cap: TROLL's ratio is bounded by its projection"),
            "epsilon": (self.epsilon != EPSILON, clip),
            "epsilon_high": (self.epsilon_high is not None, clip),
            "vllm_importance_sampling_mode": (
                self.vllm_importance_sampling_mode not in IS_MODES,
                f"the sampler correction's modes are {IS_MODES}",
            ),
            "vllm_importance_sampling_clip_max": (
                cap is not None and not cap >= 1,
                "the cap must be >= 1 (None: no cap), so that a token the sampler got right keeps weight 1",
            ),
            "vllm_importance_sampling_clip_min": (
                floor is not None and not 0 <= floor <= 1,
                "the floor must be in [0, 1] (None: no floor), so that a token the sampler got right keeps weight 1",
            ),
            "use_liger_kernel": (self.use_liger_kernel, "Liger's fused losses replace the logits TROLL needs"),
        }
        wrong = [f"{name} ({why}; got {getattr(self, name)!r})" for name, (hit, why) in bad.items() if hit]
        if wrong:
            raise ValueError("TROLLConfig does not support: " + "; ".join(wrong))
        if self.troll_logits_chunk < 0:
            raise ValueError(f"troll_logits_chunk must be >= 0, got {self.troll_logits_chunk}")
        try:  # troll_loss's own rules, so a value it would refuse at the first step is refused here
            check_troll_settings(self.troll_eps, self.troll_alpha, self.troll_k, self.troll_delta, self.troll_support)
        except ValueError as e:
            raise ValueError(f"TROLLConfig: troll_{e}") from None


def check_no_lora_dropout(peft_config: Any, model: Any, disable_dropout: bool) -> None:
    """A ValueError naming `lora_dropout` when the LoRA adapters would train with dropout: the `peft_config` given to
    the trainer, or an adapter of a PeftModel given as the model, with lora_dropout > 0, unless the TROLLConfig's
    disable_dropout (TRL then sets every dropout to 0). Dropout makes each forward pass a different random policy:
    the one that sampled, the stored q and the one the loss scores differ before any update, so the trust region
    measures noise (the plain loop adds its adapters with lora_dropout=0, troll.lora)."""
    configs = [peft_config] if peft_config is not None else []
    configs += list(getattr(model, "peft_config", {}).values()) if not isinstance(model, str) else []
    rates = [c.lora_dropout for c in configs if getattr(c, "lora_dropout", 0.0)]
    if rates and not disable_dropout:
        raise ValueError(
            f"TROLLGRPOTrainer does not train LoRA with dropout (lora_dropout={rates[0]}): the policy the loss scores "
            "would differ from the one that sampled and from the stored old policy q before any update, a nonzero "
            "KL that eats the trust region; set LoraConfig(lora_dropout=0.0) (or disable_dropout=True in the "
            "TROLLConfig, which sets every dropout to 0)"
        )


class TROLLGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is TROLL (module docstring). Takes GRPOTrainer's arguments, with args a TROLLConfig."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = inspect.signature(GRPOTrainer.__init__).bind_partial(self, *args, **kwargs).arguments
        config = given.get("args")
        if not isinstance(config, TROLLConfig):
            raise TypeError(f"TROLLGRPOTrainer needs args=TROLLConfig(...), got {type(config).__name__}")
        check_no_lora_dropout(given.get("peft_config"), given.get("model"), config.disable_dropout)
        super().__init__(*args, **kwargs)
        # TROLL applies the sampler correction in its own loss (module docstring); switched off in TRL's code, which
        # would otherwise recompute log-probs TROLL's q already holds and weigh a loss TROLL does not use
        self.troll_correction = config.vllm_importance_sampling_correction
        self.vllm_importance_sampling_correction = False
        if self.use_vllm and self.vllm_mode == "colocate" and _vllm_on_cpu():
            self.vllm_generation.sync_weights = self._reload_vllm_weights  # TRL's own fails on CPU (its docstring)

    # ------------------------------------------------------------------------------------------ weight sync

    @torch.no_grad()
    def _reload_vllm_weights(self) -> None:
        """Replaces TRL 1.16's `VLLMGeneration.sync_weights` (trl/generation/vllm_generation.py) in colocate mode on
        vLLM's CPU build, where it fails: TRL hands each tensor to the vLLM model's `load_weights`, whose loaders
        live on the parameters the CPU backend replaced when it repacked its linear layers for its kernels
        (`AttributeError: 'Parameter' object has no attribute 'weight_loader'`). vLLM's in-place `reload_weights`
        (reached by `collective_rpc`, the worker's own method, as troll.models.vllm_engine pushes) puts the loadable
        parameters back, loads, and repacks. What it gets: `vllm_weights`, every tensor of the engine's model, a
        LoRA model's adapted layers merged out of place. Then the prefix cache is reset, as TRL does.
        On GPU TRL's own sync stays: it works there and gathers sharded weights (ZeRO-3, FSDP), which this does not."""
        model = self.accelerator.unwrap_model(self.model)
        llm = self.vllm_generation.llm
        llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=vllm_weights(model)))
        llm.reset_prefix_cache()

    # ------------------------------------------------------------------------------------------ old policy

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        batch = super()._generate_and_score_completions(inputs)
        if "pixel_values" in batch:
            raise ValueError("TROLLGRPOTrainer does not support multimodal batches")
        ids, attn, T = _packed(batch)
        chunk = self.args.per_device_train_batch_size
        parts = []
        with torch.no_grad(), self.accelerator.autocast():
            for s in range(0, ids.shape[0], chunk):
                logits = packed_logits(
                    self.model,
                    ids[s : s + chunk],
                    attn[s : s + chunk],
                    T,
                    self.temperature,
                    None,
                    self.args.troll_logits_chunk,
                )
                tokens = batch["completion_ids"][s : s + chunk]
                flat = logits.reshape(-1, logits.shape[-1])
                q = sparsify(flat, tokens.flatten(), k=self.args.troll_k, delta=self.args.troll_delta)
                parts.append(q)
        q = cat_rows(parts)  # micro-batches may keep supports of different widths
        for name in TENSOR_FIELDS:
            value = getattr(q, name)
            batch[OLD + name] = value.view(ids.shape[0], T, *value.shape[1:])
        if "sampling_per_token_logps" in batch:  # the sampler's log-probs: vLLM's (or a rollout_func's)
            self._behaviour(batch, q.logp_at(batch["completion_ids"].flatten()).view(ids.shape[0], T))
        return batch

    def _behaviour(self, batch: dict[str, Any], old_logp: Tensor) -> None:
        """Log the sampler's mismatch to q at the sampled tokens (troll.run.diagnostics.mismatch_at) and, with the
        correction on, store log mu(y) [B, T] for the loss. A token the sampler could not score (NaN, which TRL
        passes on from vLLM) takes log q(y): weight 1, no correction, and it is left out of the metrics, as in TRL."""
        mu = batch["sampling_per_token_logps"].to(old_logp.dtype)
        mask = _loss_mask(batch)
        scored = ~torch.isnan(mu)
        metrics = mismatch_at(old_logp, mu, mask & scored)
        self._log_troll(metrics, "train" if self.model.training else "eval", weight=float((mask & scored).sum()))
        if self.troll_correction:
            batch[BEHAVIOUR] = torch.where(scored, mu, old_logp)

    # ------------------------------------------------------------------------------------------------ loss

    def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("TROLLGRPOTrainer does not return outputs")
        if self.aux_loss_enabled:
            raise ValueError("TROLLGRPOTrainer does not add MoE router aux losses; set output_router_logits=False")
        ids, attn, T = _packed(inputs)
        with self.accelerator.autocast():
            logits = packed_logits(model, ids, attn, T, self.temperature, None, self.args.troll_logits_chunk)
        tokens = inputs["completion_ids"]
        mask = _loss_mask(inputs)
        adv = inputs["advantages"]
        if adv.dim() != 1:
            raise ValueError(f"TROLL needs one advantage per completion [B], got shape {tuple(adv.shape)}")
        old = old_policy(inputs, logits.shape[-1])
        weight, weight_metrics = self._correction(inputs, old, mask)
        loss, metrics = troll_loss(
            logits,
            tokens,
            mask,
            adv,
            old,
            eps=self.args.troll_eps,
            alpha=self.args.troll_alpha,
            k=self.args.troll_k,
            delta=self.args.troll_delta,
            support=self.args.troll_support,
            agg=AGG[self.loss_type],
            norm_len=self.max_completion_length,
            level=self.importance_sampling_level,
            detach_dual=self.args.troll_detach_dual,
            is_weight=weight,
        )
        mode = "train" if self.model.training else "eval"
        self._log_troll(metrics | weight_metrics, mode)
        return loss * self._loss_scale(mask, inputs, mode)

    def _correction(
        self, inputs: dict[str, Any], old: SparseDist, mask: Tensor
    ) -> tuple[Tensor | None, dict[str, float]]:
        """The sampler correction's weight w [B, T] in TRL's mode (is_weights.trl_is_weight, from log q(y) - log mu(y)
        at the sampled tokens) and its metrics; (None, {}) without the sampler's log-probs."""
        if BEHAVIOUR not in inputs:
            return None, {}
        tokens = inputs["completion_ids"]
        lq_y = old.logp_at(tokens.flatten()).view(tokens.shape)  # the loss's q(y): exact, over V
        cap, floor = self.args.vllm_importance_sampling_clip_max, self.args.vllm_importance_sampling_clip_min
        cap, floor = math.inf if cap is None else cap, 0.0 if floor is None else floor
        mode, level = self.args.vllm_importance_sampling_mode, self.importance_sampling_level
        return trl_is_weight(lq_y - inputs[BEHAVIOUR].to(lq_y.dtype), mask, mode, cap, floor, level)

    def _loss_scale(self, mask: Tensor, inputs: dict[str, Any], mode: str) -> Tensor | float:
        """Turn troll_loss's per-micro-batch aggregate into TRL's normalisation for `loss_type` (module docstring)."""
        # Trainer's loop sets current_gradient_accumulation_steps; a direct call (tests) uses the configured value
        accumulation = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        accumulation = accumulation if mode == "train" else 1
        if self.loss_type != "dapo":
            return 1.0 / accumulation
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * accumulation / self.args.steps_per_generation
        return mask.sum() / normalizer

    def _log_troll(self, metrics: dict[str, float], mode: str, weight: float = 1.0) -> None:
        """Log `metrics` as "troll/<key>", merged over processes (troll.base.metrics.merge, each process `weight`)."""
        keys = sorted(metrics)
        local = [weight] + [metrics[k] for k in keys]
        local = torch.tensor(local, dtype=torch.float64, device=self.accelerator.device)
        every = self.accelerator.gather(local[None]).view(-1, len(keys) + 1)
        merged = merge([(row[0], dict(zip(keys, row[1:], strict=True))) for row in every.tolist()])
        for key, value in merged.items():
            self._metrics[mode][f"troll/{key}"].append(value)


def _vllm_on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def vllm_weights(model: Any) -> Iterator[tuple[str, Tensor]]:
    """Every tensor vLLM's model is built from, under the base model's names, one at a time: a plain model's state
    dict (a tied lm_head included), or a LoRA model's base with each adapted layer merged out of place
    (troll.lora.engine_weights: W + (alpha / r) B A in float32; the trainer's W is never touched). All of them, as
    TRL's own sync sends: TRL's engine loads the base from `name_or_path` on disk, which need not hold the
    trainer's base (a model changed in memory before training)."""
    if not is_lora(model):
        yield from model.state_dict().items()
        return
    merged = engine_weights(model)  # the adapted layers in the model's order, which is its state dict's
    pending = next(merged, None)
    for name, tensor in base_weights(model).items():
        if pending is not None and pending[0] == name:
            tensor, pending = pending[1], next(merged, None)
        yield name, tensor
    if pending is not None:
        raise RuntimeError(f"{pending[0]}: an adapted layer out of the base's state-dict order")


def _loss_mask(batch: dict[str, Any]) -> Tensor:
    """[B, T] bool: the completion tokens the loss reads (tool outputs left out)."""
    mask = batch["completion_mask"].bool()
    return mask & batch["tool_mask"].bool() if "tool_mask" in batch else mask


def _packed(batch: dict[str, Any]) -> tuple[Tensor, Tensor, int]:
    """[left-padded prompt | completion] ids and attention mask [B, P+T], and T."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return ids, attn, batch["completion_ids"].shape[1]


def old_policy(batch: dict[str, Any], vocab_size: int) -> SparseDist:
    """The stored q of a (micro-)batch as a SparseDist over its B*T rows, row-major as troll_loss expects."""
    return SparseDist(**{name: batch[OLD + name].flatten(0, 1) for name in TENSOR_FIELDS}, vocab_size=vocab_size)
