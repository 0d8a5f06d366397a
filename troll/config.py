"""One typed config for a run, its presets, command-line flags, and the checks that make a bad run fail at once.

    cfg = Config.from_args(["--preset", "tiny-cpu", "--loss", "ppo_clip", "--seed", "1"])
    python -m troll.train --help                      # every flag: its description, default and allowed values

Every field is a flag (`--lr 1e-6`, `--bf16 true`, `--level sequence`). A preset sets a group of fields; flags
win over it. The resolved config is written to `<out>/config.json`, and `--resume true` reads it back from there
(flags given with it still win; a saved config must name every field, so a run never resumes under defaults it did
not use).

Choices:
- `Config()`'s own defaults ARE the `tiny-cpu` preset (README's main command), so a test building `Config(...)`
  and the command line agree; the GPU presets change only the fields they list.
- The help of each flag is the comment after its field below (one source for the code and `--help`), followed
  by its default; choice fields list their allowed values (CHOICES).
- Checked when a Config is made (`__post_init__`, so also by `dataclasses.replace` and `Config.load`): every
  choice field against CHOICES, every range, and the combinations that cannot run (`level=sequence` only with
  troll / ppo_clip; at most one minibatch per sample). A violation is a ValueError naming the field;
  `from_args` turns it into an argparse error (exit 2, no traceback), before any model is built or any
  directory written. `from_args` also checks that `--log_to`'s package is installed (troll.metrics: looked up,
  not imported); a Config built in code is checked when train() starts. CHOICES equal the names the library
  accepts (tests compare them with troll.losses and troll.advantages), kept here so that parsing imports no
  torch and `--help` answers at once.
- A flag's type is the field's annotation (`typing.get_type_hints`): int, float, str, bool (true/false/1/0/
  yes/no), and `X | None` (the word `none` gives None).

Presets:
    tiny-cpu            (the defaults) 2-digit addition, the sum written least-significant digit first
                        (troll.addition), a 0.59M-parameter Llama built locally, a supervised warm-start (batches
                        of 128, lr 1e-3) that stops once greedy decoding solves 30% of 1,024 training problems
                        (troll.warmstart: ~270-450 steps), then 250 TROLL steps at lr 1e-4, 2 minibatches; under
                        two minutes on two idle CPU cores (README, Results).
    gsm8k-qwen2.5-0.5b  GSM8K on one 24-80 GB GPU: the paper's defaults (docs/algorithm.md, section 8)
    gsm8k-qwen3-0.6b    scaled down: lr 1e-6 constant, grad-clip 1, 8 samples per prompt, 64 prompts per step
                        split into 4 optimiser steps, eps 0.05, alpha 1, K 64, delta 1e-5, vLLM rollouts, bf16;
                        the chunked output layer (1,024 rows) and gradient checkpointing, micro-batches of 16,384
                        (0.5B) / 8,192 (0.6B) tokens: what troll.memory's model fits on a 24 GB GPU beside vLLM's
                        30% (README, "What fits where"); `--micro_batch_tokens auto` sizes it for the GPU at hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import re
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path

from troll.metrics import logger_missing

CHOICES: dict[str, tuple[str, ...]] = {
    "task": ("addition", "gsm8k"),
    "loss": ("troll", "ppo_clip", "dppo", "cispo"),  # = troll.losses.LOSSES
    "advantage": ("grpo", "dr_grpo", "reinforce_pp"),  # = troll.advantages.ESTIMATORS
    "agg": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),  # = troll.losses.AGGREGATIONS
    "level": ("token", "sequence"),
    "support": ("rest", "paper"),
    "dppo_divergence": ("binary_tv", "binary_kl", "topk_tv", "topk_kl"),  # = troll.losses.DPPO_THRESHOLDS
    "old_policy": ("recompute", "behaviour"),
    "backend": ("hf", "vllm"),
    "lr_schedule": ("constant", "cosine"),
    "device": ("auto", "cpu", "cuda"),
    "log_to": ("none", "tensorboard", "wandb"),
}
SEQUENCE_LEVEL_LOSSES = ("troll", "ppo_clip")  # the losses with a GSPO (level="sequence") mode


@dataclass
class Config:
    # what to train
    task: str = "addition"  # the task: addition (tiny CPU task) or gsm8k
    reverse_sum: bool = True  # addition: the sum's digits least-significant first ("04+85=" -> "980"; troll.addition)
    model: str = "tiny"  # "tiny" builds the local tiny Llama; otherwise a hub name or a local HF directory
    data: str = "openai/gsm8k"  # GSM8K source: hub name or a folder with {train,test}.jsonl
    chat: bool = False  # GSM8K prompts through the tokenizer's chat template (instruct models)
    # the objective
    loss: str = "troll"  # the policy loss: TROLL or one of the baselines
    advantage: str = "grpo"  # advantage estimator
    agg: str = "token-mean"  # how per-token terms are reduced to the loss
    level: str = "token"  # ratio per token, or per sequence (GSPO; troll and ppo_clip only)
    eps: float = 0.05  # TROLL: KL bound per token (> 0)
    alpha: float = 1.0  # TROLL: weight of the regression term (>= 0)
    k: int = 64  # sparse support: at most K tokens per policy, plus the sampled one (>= 1)
    delta: float = 1e-5  # sparse support: kept mass >= 1 - delta (0 <= delta < 1)
    support: str = "rest"  # sparse model: rest (old policy's support + one exact rest atom) | paper (top-K, 1e-12 tail)
    clip_low: float = 0.2  # PPO-clip: eps_low (0 <= clip_low < 1)
    clip_high: float = 0.2  # PPO-clip: eps_high (0.28 = Clip-Higher); CISPO's cap is 1 + clip_high
    dppo_divergence: str = "binary_tv"  # DPPO: the divergence its mask thresholds
    old_policy: str = "recompute"  # trust-region anchor: the model before the update (paper) or the engine's top-K
    # rollouts
    backend: str = "hf"  # rollout engine: transformers generate, or an in-process vLLM
    prompts_per_step: int = 32  # prompts sampled per RL step
    samples_per_prompt: int = 8  # group size
    max_prompt_len: int = 512  # longer prompts are dropped from the data set (counted in the summary)
    max_new_tokens: int = 5  # response length limit
    temperature: float = 1.0  # sampling temperature (> 0; the trainer scores with the same one)
    vllm_gpu_memory: float = 0.3  # vLLM's GPU memory fraction, in (0, 1] (GPU only)
    # optimisation
    steps: int = 250  # RL steps
    minibatches: int = 2  # optimiser steps per pass over the step's samples (split into this many parts)
    epochs: int = 1  # passes over each RL step's samples (PPO's update epochs, TRL's num_iterations), reshuffled
    micro_batch_tokens: int = 4096  # padded tokens per forward (gradient accumulation); auto: the most the GPU fits
    logits_chunk: int = 0  # output layer in chunks of this many rows, no [tokens, V] logits (0: full logits)
    lr: float = 1e-4  # AdamW learning rate
    lr_schedule: str = "constant"  # learning-rate schedule (cosine decays to 0 over all optimiser steps)
    warmup_steps: int = 0  # linear warmup, in optimiser steps
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max gradient norm
    bf16: bool = False  # bf16 autocast (GPU)
    grad_checkpointing: bool = False  # recompute activations in backward (saves memory)
    # supervised warm-start (tiny task)
    sft_steps: int = 600  # at most this many supervised steps on reference solutions before RL
    sft_target: float = 0.3  # stop once greedy solves this share of 1,024 training problems (0: all sft_steps)
    sft_lr: float = 1e-3  # supervised learning rate
    sft_batch: int = 128  # supervised batch size
    # evaluation, logging, checkpoints
    eval_every: int = 25  # RL steps between held-out evaluations (greedy pass@1)
    eval_size: int = 1000  # held-out problems per evaluation (0 = the whole test split)
    save_every: int = 25  # RL steps between checkpoints
    samples_to_log: int = 4  # completions written to samples.jsonl per evaluation
    kl_update_vocab: int = 4096  # exact KL(new || old) over the vocabulary after each step if V <= this (0: never)
    log_to: str = "none"  # also send metrics to tensorboard (<out>/tensorboard) or wandb; metrics.jsonl stays
    seed: int = 0  # seeds the model, the prompts and the sampler
    out: str = "runs/tiny"  # run directory
    device: str = "cpu"  # auto = cuda when available, else cpu
    resume: bool = False  # continue the run in --out from its latest checkpoint

    def __post_init__(self) -> None:
        problems = check(self)
        if problems:
            raise ValueError("invalid config: " + "; ".join(problems))

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> Config:
        """Parse flags (module docstring); any invalid value is an argparse error: exit 2, before any work."""
        parser = cls.parser()
        args = parser.parse_args(argv)
        overrides = {name: value for name, value in vars(args).items() if name != "preset"}  # the flags given
        try:
            cfg = cls(**PRESETS[args.preset])
            if overrides.get("resume"):
                saved = Path(overrides.get("out", cfg.out)) / "config.json"
                if not saved.is_file():
                    parser.error(f"--resume true: {saved} does not exist (nothing to resume)")
                cfg = cls.load(saved)
            cfg = dataclasses.replace(cfg, **overrides)
        except ValueError as e:
            parser.error(str(e))
        missing = logger_missing(cfg.log_to)  # an optional package: looked up, not imported
        if missing:
            parser.error(missing)
        return cfg

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        """The command line: --preset, then one flag per field with its comment, default and choices as help."""
        parser = argparse.ArgumentParser(
            prog="python -m troll.train",
            description="TROLL: RL with trust regions for LLMs. A preset sets a group of flags; flags win.",
        )
        parser.add_argument(
            "--preset",
            default="tiny-cpu",
            choices=list(PRESETS),
            help="tiny-cpu (the defaults below: addition, tiny local model, CPU) or a GSM8K GPU recipe "
            "(gsm8k-qwen2.5-0.5b, gsm8k-qwen3-0.6b); default: tiny-cpu",
        )
        comments, types_ = _field_comments(cls), typing.get_type_hints(cls)
        for f in fields(cls):
            text = comments.get(f.name, "").replace("%", "%%")
            default = str(f.default).lower() if isinstance(f.default, bool) else f.default
            parser.add_argument(
                f"--{f.name}",
                type=_tokens if f.name == "micro_batch_tokens" else _parser_for(types_[f.name]),
                choices=CHOICES.get(f.name),
                metavar="{true,false}" if types_[f.name] is bool else None,
                default=argparse.SUPPRESS,  # a flag not given is absent, so the preset's value stays
                help=f"{text}; default: {default}" if text else f"default: {default}",
            )
        return parser

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Config:
        data = json.loads(Path(path).read_text())
        names = {f.name for f in fields(cls)}
        unknown, missing = sorted(set(data) - names), sorted(names - set(data))
        if unknown:
            raise ValueError(f"{path}: unknown config fields {unknown}")
        if missing:  # today's defaults could differ from what the run used (reverse_sum once did)
            raise ValueError(
                f"{path}: missing config fields {missing} (written by an older troll? add them with the values the "
                "run used)"
            )
        return cls(**data)


def check(cfg: Config) -> list[str]:
    """Every problem with `cfg`: a value outside its choices or range, or a combination that cannot run."""
    problems = [
        f"{name}={getattr(cfg, name)!r} is not one of {', '.join(allowed)}"
        for name, allowed in CHOICES.items()
        if getattr(cfg, name) not in allowed
    ]

    def need(ok: bool, text: str) -> None:
        if not ok:
            problems.append(text)

    def finite(name: str) -> bool:
        return isinstance(getattr(cfg, name), (int, float)) and math.isfinite(getattr(cfg, name))

    need(finite("eps") and cfg.eps > 0, f"eps must be > 0 and finite, got {cfg.eps}")
    need(finite("alpha") and cfg.alpha >= 0, f"alpha must be >= 0 and finite, got {cfg.alpha}")
    need(finite("delta") and 0 <= cfg.delta < 1, f"delta must be in [0, 1), got {cfg.delta}")
    need(finite("clip_low") and 0 <= cfg.clip_low < 1, f"clip_low must be in [0, 1), got {cfg.clip_low}")
    need(finite("clip_high") and cfg.clip_high >= 0, f"clip_high must be >= 0 and finite, got {cfg.clip_high}")
    need(finite("temperature") and cfg.temperature > 0, f"temperature must be > 0, got {cfg.temperature}")
    need(finite("lr") and cfg.lr > 0, f"lr must be > 0 and finite, got {cfg.lr}")
    need(finite("sft_lr") and cfg.sft_lr > 0, f"sft_lr must be > 0 and finite, got {cfg.sft_lr}")
    need(finite("sft_target") and 0 <= cfg.sft_target <= 1, f"sft_target must be in [0, 1], got {cfg.sft_target}")
    need(finite("weight_decay") and cfg.weight_decay >= 0, f"weight_decay must be >= 0, got {cfg.weight_decay}")
    need(finite("grad_clip") and cfg.grad_clip > 0, f"grad_clip must be > 0 and finite, got {cfg.grad_clip}")
    need(
        finite("vllm_gpu_memory") and 0 < cfg.vllm_gpu_memory <= 1,
        f"vllm_gpu_memory must be in (0, 1], got {cfg.vllm_gpu_memory}",
    )
    at_least = {
        "k": 1,
        "prompts_per_step": 1,
        "samples_per_prompt": 1,
        "max_prompt_len": 1,
        "max_new_tokens": 1,
        "steps": 1,
        "minibatches": 1,
        "epochs": 1,
        "micro_batch_tokens": 0,
        "logits_chunk": 0,
        "warmup_steps": 0,
        "sft_steps": 0,
        "sft_batch": 1,
        "eval_every": 1,
        "eval_size": 0,
        "save_every": 1,
        "samples_to_log": 0,
        "kl_update_vocab": 0,
        "seed": 0,
    }
    for name, low in at_least.items():
        need(getattr(cfg, name) >= low, f"{name} must be >= {low}, got {getattr(cfg, name)}")
    samples = cfg.prompts_per_step * cfg.samples_per_prompt
    need(
        cfg.minibatches <= samples,
        f"minibatches={cfg.minibatches} is more than the {samples} samples of a step "
        f"(prompts_per_step x samples_per_prompt)",
    )
    need(
        cfg.level == "token" or cfg.loss in SEQUENCE_LEVEL_LOSSES,
        f"level=sequence (GSPO) works with loss {' or '.join(SEQUENCE_LEVEL_LOSSES)}, not {cfg.loss}",
    )
    need(bool(cfg.model), "model must not be empty")
    need(bool(cfg.out), "out must not be empty")
    return problems


def _bool(s: str) -> bool:
    if s.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")
    return s.lower() in ("1", "true", "yes")


def _tokens(s: str) -> int:
    """micro_batch_tokens: a count, or "auto" (stored as 0, resolved by the trainer from troll.memory)."""
    return 0 if s.lower() == "auto" else int(s)


def _parser_for(tp: typing.Any) -> typing.Callable[[str], typing.Any]:
    """The argparse `type` for a field annotation: bool, int, float, str, or `X | None` ("none" -> None)."""
    if tp is bool:
        return _bool
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"unsupported config field type {tp}")
        parse = _parser_for(inner[0])

        def optional(s: str) -> typing.Any:
            return None if s.lower() == "none" else parse(s)

        optional.__name__ = f"{getattr(inner[0], '__name__', inner[0])} or none"
        return optional
    if tp in (int, float, str):
        return tp
    raise TypeError(f"unsupported config field type {tp}")


def _field_comments(cls: type) -> dict[str, str]:
    """The comment after each `name: type = default` line of the dataclass sources (the flags' help)."""
    comments: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        for name, text in re.findall(r"^\s+(\w+): [^=\n]+=[^#\n]+#\s*(.+)$", inspect.getsource(klass), re.M):
            comments[name] = text.strip()
    return comments


_GSM8K_GPU = dict(
    task="gsm8k",
    chat=True,
    backend="vllm",
    lr=1e-6,
    grad_clip=1.0,
    samples_per_prompt=8,
    prompts_per_step=64,
    minibatches=4,
    max_prompt_len=512,
    max_new_tokens=1024,
    micro_batch_tokens=16384,
    logits_chunk=1024,
    bf16=True,
    grad_checkpointing=True,
    steps=200,
    eval_every=25,
    eval_size=0,
    save_every=25,
    sft_steps=0,
    device="cuda",
)
PRESETS: dict[str, dict] = {
    "tiny-cpu": {},  # Config's defaults
    "gsm8k-qwen2.5-0.5b": dict(_GSM8K_GPU, model="Qwen/Qwen2.5-0.5B-Instruct", out="runs/gsm8k-qwen2.5-0.5b"),
    # 8,192 tokens: troll.memory puts 16,384 at 0.5 GiB under a 24 GB GPU's budget (README, "What fits where")
    "gsm8k-qwen3-0.6b": dict(_GSM8K_GPU, model="Qwen/Qwen3-0.6B", micro_batch_tokens=8192, out="runs/gsm8k-qwen3-0.6b"),
}
