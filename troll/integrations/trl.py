"""TROLL as the loss of TRL's `GRPOTrainer`: the same projection, TRL's launchers (docs/algorithm.md, the objective).

    from troll.integrations.trl import TROLLConfig, TROLLGRPOTrainer
    args = TROLLConfig(output_dir="out", troll_eps=0.05, num_generations=8, ...)   # every GRPOConfig field works
    TROLLGRPOTrainer(model=..., reward_funcs=..., args=args, train_dataset=...).train()

Everything but two steps is TRL's own: generation (transformers, or vLLM server / colocate), rewards, advantages,
batching over `steps_per_generation` and `num_iterations`, accelerate / DeepSpeed / FSDP, optimiser, logging and
checkpoints. The two steps TROLL replaces:

  old policy   right after TRL generates and scores a batch, one no-grad forward of the training model over
               [prompt | completion] gives q at every completion position, sparsified once (troll.sparse.sparsify:
               top-mass support of at most K, kept mass >= 1 - delta, plus the sampled token) and stored with the
               batch as tensors "troll_old_<field>" [B, T, K+1] and [B, T]. It is the policy before any update on
               this batch: the paper's choice, = troll.train's old_policy="recompute". (TRL asks its vLLM engine for
               the sampled token's log-prob only, so the engine's top-K cannot serve as q here.)
  loss         `compute_loss`: logits [b, T, V] / temperature of the current model (`policy.packed_logits`, the
               function troll.train uses; positions counted from each row's first real token; with
               `troll_logits_chunk` > 0 the chunked output layer, which never builds [b, T, V]), then
               `troll.losses.troll_loss(logits, completion_ids, mask, advantages, q, eps, alpha, k, delta, agg, level)`
               with mask = completion_mask (x tool_mask) and TRL's settings mapped to troll's:

                   loss_type  troll agg                    scale (train; in eval GA = steps_per_generation = 1)
                   dapo       token-mean                   sum(m) / (num_items_in_batch / processes * GA / spg)
                   bnpo       token-mean                   1 / GA
                   grpo       seq-mean-token-mean          1 / GA
                   dr_grpo    seq-mean-token-sum-norm      1 / GA   (T_norm = max_completion_length)
                   importance_sampling_level "sequence" -> level="sequence" (GSPO with projected ratios)

               so each TRL normalisation is reproduced exactly (dapo: the sum over the generation batch divided by
               its token count, as in TRL). With one process and GA = spg = 1 the loss is troll_loss itself.
  metrics      every troll_loss metric as "troll/<key>" through TRL's logger, merged over processes by
               troll.metrics.merge ("_max" keys the max, "_min" keys the min, the rest the mean).

Not combined with TROLL (a clear ValueError from TROLLConfig): beta != 0 (the trust region replaces the reference
KL), the clip-family options (epsilon's clip does not apply; the entropy mask / bonus, off-policy mask, delta cap),
loss types other than the four above, TRL's vLLM importance-sampling correction (off by default here; q is the
trainer's own recomputation), Liger kernels. Multimodal batches and MoE aux losses raise at the first step.

Memory: the loss needs the full [b, T, V] logits of a micro-batch (TRL's own loss streams the LM head); size
`per_device_train_batch_size` and `max_completion_length` for it, as with troll.train's micro_batch_tokens.
The stored q costs about (8 + 4 + 1) * (K + 1) bytes per completion token on the device.

Supported TRL versions: TRL_VERSIONS (this module overrides `GRPOTrainer._generate_and_score_completions` and
`compute_loss`, whose contracts change between minor releases); others fail at import with the install command.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass, field
from typing import Any

import torch
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import Tensor

from troll.losses import troll_loss
from troll.metrics import merge
from troll.policy import packed_logits
from troll.sparse import SUPPORTS, TENSOR_FIELDS, SparseDist, cat_rows, sparsify

TRL_VERSIONS = ">=1.16,<1.17"
AGG = {"dapo": "token-mean", "bnpo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
OLD = "troll_old_"


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
    vllm_importance_sampling_correction: bool = field(
        default=False, metadata={"help": "Must stay False with TROLL: q is the trainer's own recomputation."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        bad = {
            "beta": (self.beta != 0.0, "TROLL's trust region replaces the KL penalty to a reference model"),
            "loss_type": (self.loss_type not in AGG, f"TROLL maps only the loss types {sorted(AGG)}"),
            "top_entropy_quantile": (self.top_entropy_quantile < 1.0, "no entropy mask with TROLL"),
            "entropy_coef": (self.entropy_coef != 0.0 or self.use_adaptive_entropy, "no entropy bonus with TROLL"),
            "off_policy_mask_threshold": (self.off_policy_mask_threshold is not None, "no off-policy mask"),
            "delta": (self.delta is not None, "no ratio cap: TROLL's ratio is bounded by its projection"),
            "vllm_importance_sampling_correction": (
                self.vllm_importance_sampling_correction,
                "q is the trainer's recomputed policy, so the sampler's log-probs are not used",
            ),
            "use_liger_kernel": (self.use_liger_kernel, "Liger's fused losses replace the logits TROLL needs"),
        }
        wrong = [f"{name} ({why}; got {getattr(self, name)!r})" for name, (hit, why) in bad.items() if hit]
        if wrong:
            raise ValueError("TROLLConfig does not support: " + "; ".join(wrong))
        if self.troll_logits_chunk < 0:
            raise ValueError(f"troll_logits_chunk must be >= 0, got {self.troll_logits_chunk}")
        if self.troll_support not in SUPPORTS:
            raise ValueError(f"troll_support must be one of {SUPPORTS}, got {self.troll_support!r}")
        if not (self.troll_eps > 0 and self.troll_alpha >= 0 and self.troll_k >= 1 and 0 <= self.troll_delta < 1):
            raise ValueError(
                f"need troll_eps > 0, troll_alpha >= 0, troll_k >= 1, 0 <= troll_delta < 1; got {self.troll_eps}, "
                f"{self.troll_alpha}, {self.troll_k}, {self.troll_delta}"
            )


class TROLLGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose loss is TROLL (module docstring). Takes GRPOTrainer's arguments, with args a TROLLConfig."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if not isinstance(config, TROLLConfig):
            raise TypeError(f"TROLLGRPOTrainer needs args=TROLLConfig(...), got {type(config).__name__}")
        super().__init__(*args, **kwargs)

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
        return batch

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
        mask = inputs["completion_mask"].bool()
        if "tool_mask" in inputs:
            mask = mask & inputs["tool_mask"].bool()
        adv = inputs["advantages"]
        if adv.dim() != 1:
            raise ValueError(f"TROLL needs one advantage per completion [B], got shape {tuple(adv.shape)}")
        loss, metrics = troll_loss(
            logits,
            tokens,
            mask,
            adv,
            old_policy(inputs, logits.shape[-1]),
            eps=self.args.troll_eps,
            alpha=self.args.troll_alpha,
            k=self.args.troll_k,
            delta=self.args.troll_delta,
            support=self.args.troll_support,
            agg=AGG[self.loss_type],
            norm_len=self.max_completion_length,
            level=self.importance_sampling_level,
            detach_dual=self.args.troll_detach_dual,
        )
        mode = "train" if self.model.training else "eval"
        self._log_troll(metrics, mode)
        return loss * self._loss_scale(mask, inputs, mode)

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

    def _log_troll(self, metrics: dict[str, float], mode: str) -> None:
        keys = sorted(metrics)
        local = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.accelerator.device)
        every = self.accelerator.gather(local[None]).view(-1, len(keys))
        merged = merge([(1.0, dict(zip(keys, row, strict=True))) for row in every.tolist()])
        for key, value in merged.items():
            self._metrics[mode][f"troll/{key}"].append(value)


def _packed(batch: dict[str, Any]) -> tuple[Tensor, Tensor, int]:
    """[left-padded prompt | completion] ids and attention mask [B, P+T], and T."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    return ids, attn, batch["completion_ids"].shape[1]


def old_policy(batch: dict[str, Any], vocab_size: int) -> SparseDist:
    """The stored q of a (micro-)batch as a SparseDist over its B*T rows, row-major as troll_loss expects."""
    return SparseDist(**{name: batch[OLD + name].flatten(0, 1) for name in TENSOR_FIELDS}, vocab_size=vocab_size)
