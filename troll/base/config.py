"""The run's config: typed fields with their help, presets, command-line flags, checks, and config.json.

    cfg = Config.from_args(["--preset", "tiny-cpu", "--loss", "ppo_clip", "--seed", "1"])
    troll train --help          # every flag: its help, default and allowed values

Every field is a flag (`--lr 1e-6`, `--bf16 true`, `--micro_batch_tokens auto`), parsed by the field's type; a
preset sets a group of fields and flags win over it. Every Config is checked when it is made (`check`: types,
choices, ranges, and combinations that cannot run), so a bad value is a ValueError naming the field, and on the
command line an argparse error (exit 2) before any work. A value that makes every update zero is such a
combination (`--samples_per_prompt 1`: every estimator subtracts the group's own mean, so a group of one gets A = 0;
`--lora_alpha 0` with a rank scales the adapters' update by 0).

Every setting acts or is refused: a flag given on the command line for a setting that acts only under a switch
that is off, or only for another loss, is refused in one line naming the flag and what makes it act (`inert`,
from the table `ACTS_ONLY`: `--eps 0.1 --loss ppo_clip`, `--lora_alpha 16` without `--lora_rank`). Only the flags
given are checked: a preset's values and the defaults never are (the field's default is what it would be anyway).
A comma-separated list must name only what exists: `--lora_targets` names that match no layer of the model are
refused when the model is built, before the run folder is touched (troll.lora.check_targets).

The resolved config is saved to `<out>/config.json` (troll.run.harness writes it once the run has claimed its folder);
`--resume true` reads it back with the same checks, and it must name every field, so a run never resumes under
defaults it did not use; reading it writes nothing (`Config.resumed`). This module imports no torch, so `--help`
answers at once.

Presets:
    tiny-cpu            Config's defaults: 2-digit addition on a tiny local Llama, a supervised warm-start, then
                        250 TROLL steps on CPU
    tiny-stale          the same task off-policy: rollouts 2 steps stale, lr 3e-4, anchored at the sampler, 40 steps
    tiny-rare           tiny-stale on the rare-behaviour task (a rewarded answer format the warm-start writes 1% of
                        the time) with a 1,024-token vocabulary: how fast each loss adopts a rare good token
    tiny-lora           tiny-cpu with LoRA adapters (rank 8, alpha 16) on the frozen warm-started model, lr 3e-4
    smollm2-words       a real LM on CPU: SmolLM2-135M-Instruct (troll.models.packaged) on word problems scored as GSM8K
    gsm8k-qwen2.5-0.5b  GSM8K on one GPU: vLLM rollouts, bf16, chunked output layer, gradient checkpointing
    gsm8k-qwen3-0.6b    the same recipe for Qwen3-0.6B, with half the micro-batch
    gsm8k-qwen3-1.7b-lora   the recipe with LoRA (rank 32, lr 1e-5) for Qwen3-1.7B on a 24 GB GPU
    gsm8k-qwen3-4b-lora     the same for Qwen3-4B (the model the paper measures its overhead on) on a 24 GB GPU
    gsm8k-qwen3-8b-lora     the same for Qwen3-8B on an 80 GB GPU
    gsm8k-llama3.1-8b-lora  the same for Llama-3.1-8B-Instruct on an 80 GB GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from troll.base.cli import Parser
from troll.base.metrics import logger_missing

# the baselines' defaults that depend on more than one field; troll.losses holds the same values (a test locks them),
# and this module imports no torch
DPPO_CAP = 10.0  # DPPO's ratio cap c: Stable-RL's fallback for clip_ratio_c (docs/algorithm.md, section 6)
CLIP_RANGE = {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4)}  # PPO-clip's (eps_low, eps_high); GSPO per sequence
DEFAULT_AGG = {"token": "token-mean", "sequence": "seq-mean-token-mean"}  # an unset agg's; GSPO: a mean over sequences


def _bool(s: str) -> bool:
    if s.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")
    return s.lower() in ("1", "true", "yes")


def _int_or_auto(s: str) -> int:
    """micro_batch_tokens: a count, or "auto" (stored as 0; the trainer sizes it from troll.models.memory)."""
    if s.lower() == "auto":
        return 0
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or auto, got {s!r}") from None


def int_at_least(low: int) -> typing.Callable[[str], int]:
    """An argparse type: an integer >= `low` (the commands' and benchmarks' counts)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    return parse


PARSERS: dict[type, typing.Callable[[str], Any]] = {bool: _bool, int: int, float: float, str: str}


def opt(default: Any, help: str, choices: tuple[str, ...] | None = None, parse: typing.Callable | None = None) -> Any:
    """A field with its `--help` text, its allowed values, and a flag parser other than its type's."""
    return field(default=default, metadata={"help": help, "choices": choices, "parse": parse})


@dataclass
class Config:
    # what to train
    task: str = opt(
        "addition",
        "the task: addition (tiny CPU task), rare (addition, rewarded only in a format the warm-start writes 1% of "
        "the time: troll.tasks.addition), gsm8k, or words (arithmetic word problems asked and scored as GSM8K: "
        "troll.tasks.words)",
        ("addition", "rare", "gsm8k", "words"),
    )
    reverse_sum: bool = opt(True, 'addition: the sum written least-significant digit first ("04+85=" -> "980")')
    model: str = opt("tiny", '"tiny" builds the local tiny Llama; otherwise a hub name or a local HF directory')
    vocab_size: int = opt(0, "tiny model: grow its 260-token tokenizer to this many tokens, unused ones (0: keep 260)")
    data: str = opt("openai/gsm8k", "GSM8K source: hub name or a folder with {train,test}.jsonl")
    chat: bool = opt(False, "GSM8K and words prompts through the tokenizer's chat template (instruct models)")
    system: str | None = opt(
        None,
        "chat prompts: the system message; unset: the template's own default (SmolLM2's adds one of 15 tokens), '' "
        "an empty one",
    )
    mask_overlong: bool = opt(False, "leave samples cut at max_new_tokens out of the loss (DAPO's overlong filter)")
    # the objective
    loss: str = opt("troll", "the policy loss: TROLL or one of the baselines", ("troll", "ppo_clip", "dppo", "cispo"))
    advantage: str = opt("grpo", "advantage estimator", ("grpo", "dr_grpo", "reinforce_pp"))
    filter_groups: bool = opt(
        False,
        "train only on groups whose rewards differ, where the advantage is not 0 (DAPO's dynamic sampling, "
        "without its resampling); a batch with no such group trains whole",
    )
    agg: str | None = opt(
        None,
        "reduction of per-token terms; unset: token-mean, or seq-mean-token-mean (GSPO's mean over sequences) with "
        "--level sequence",
        ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
    )
    level: str = opt("token", "ratio per token, or per sequence (GSPO; troll and ppo_clip only)", ("token", "sequence"))
    eps: float = opt(0.05, "TROLL: KL bound per token (> 0)")
    alpha: float = opt(1.0, "TROLL: weight of the regression term (>= 0)")
    k: int = opt(64, "sparse support: at most K tokens per policy, plus the sampled one (>= 1)")
    delta: float = opt(1e-5, "sparse support: kept mass >= 1 - delta (0 <= delta < 1)")
    support: str = opt(
        "rest", "sparse model: rest (old support + one exact rest atom) | paper (top-K)", ("rest", "paper")
    )
    clip_low: float | None = opt(
        None, "PPO-clip: eps_low (0 <= clip_low < 1); unset: 0.2, or GSPO's 3e-4 with --level sequence"
    )
    clip_high: float | None = opt(
        None,
        "PPO-clip: eps_high (0.28 = Clip-Higher); unset: 0.2, or GSPO's 4e-4 with --level sequence. CISPO's cap "
        "is 1 + clip_high (unset: 0.2)",
    )
    dppo_divergence: str = opt("binary_tv", "DPPO: mask divergence", ("binary_tv", "binary_kl", "topk_tv", "topk_kl"))
    dppo_cap: float = opt(
        DPPO_CAP,
        "DPPO: its stop-gradient ratio truncated at this value (>= 1; 10: the fallback in the authors' code; verl's "
        "DPPO example: 10000, uncapped)",
    )
    old_policy: str = opt(
        "recompute", "anchor: the model before the update (paper) or the engine's top-K", ("recompute", "behaviour")
    )
    is_correction: str = opt(
        "none", "recompute anchor, off-policy data: weigh the policy term by pi_old(y) / mu(y)", ("none", "is", "tis")
    )
    is_cap: float = opt(2.0, "is_correction tis: the weight truncated at this value (>= 1)")
    # rollouts
    backend: str = opt("hf", "rollout engine: transformers generate, or an in-process vLLM", ("hf", "vllm"))
    prompts_per_step: int = opt(32, "prompts sampled per RL step")
    samples_per_prompt: int = opt(8, "group size")
    max_prompt_len: int = opt(512, "longer prompts are dropped from the data set (counted in the summary)")
    max_new_tokens: int = opt(5, "response length limit")
    temperature: float = opt(1.0, "sampling temperature (> 0; the trainer scores with the same one)")
    vllm_gpu_memory: float = opt(0.3, "vLLM's GPU memory fraction, in (0, 1] (GPU only)")
    staleness: int = opt(0, "train step s on the batch sampled k steps earlier (an asynchronous pipeline of depth k)")
    rollout_dtype: str = opt(
        "auto", "sampler precision; auto: hf float32, vllm float32 on CPU, bf16 on GPU", ("auto", "float32", "bfloat16")
    )
    # optimisation
    steps: int = opt(250, "RL steps")
    minibatches: int = opt(2, "optimiser steps per pass over the step's samples (split into this many parts)")
    epochs: int = opt(1, "passes over each RL step's samples (PPO's update epochs, TRL's num_iterations), reshuffled")
    micro_batch_tokens: int = opt(4096, "padded tokens per forward; auto: the most the GPU fits", parse=_int_or_auto)
    logits_chunk: int = opt(0, "output layer in chunks of this many rows, no [tokens, V] logits (0: full logits)")
    compile_head: bool = opt(False, "the chunked output layer's pass over the vocabulary through torch.compile")
    share_prompt: bool = opt(
        False, "forward each distinct prompt of a micro-batch once, its KV cache shared by its completions (exact)"
    )
    minibatch_by: str = opt(
        "sample", "minibatches of shuffled samples, or of whole groups (one prompt forward each)", ("sample", "group")
    )
    lr: float = opt(1e-4, "AdamW learning rate")
    lr_schedule: str = opt("constant", "learning-rate schedule; cosine decays to 0 at the end", ("constant", "cosine"))
    warmup_steps: int = opt(0, "linear warmup, in optimiser steps")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm")
    bf16: bool = opt(False, "bf16 autocast (GPU)")
    grad_checkpointing: bool = opt(False, "recompute activations in backward (saves memory)")
    lora_rank: int = opt(0, "train LoRA adapters of this rank on a frozen base (troll.lora); 0: full fine-tuning")
    lora_alpha: float = opt(32.0, "LoRA scale alpha: the update is (alpha / rank) B A")
    lora_targets: str = opt("all-linear", "LoRA's layers: all-linear (every decoder linear) or comma-separated names")
    # supervised warm-start (tiny task)
    sft_steps: int = opt(600, "at most this many supervised steps on reference solutions before RL")
    sft_target: float = opt(0.3, "stop once greedy solves this share of the probe's problems (0: all sft_steps)")
    sft_probe: int = opt(1024, "the warm-start's probe: this many training problems, where the target is checked")
    sft_lr: float = opt(1e-3, "supervised learning rate")
    sft_batch: int = opt(128, "supervised batch size")
    # evaluation, logging, checkpoints
    eval_every: int = opt(25, "RL steps between held-out evaluations (greedy pass@1)")
    eval_size: int = opt(1000, "held-out problems per evaluation (0 = the whole test split)")
    save_every: int = opt(25, "RL steps between checkpoints")
    samples_to_log: int = opt(4, "completions written to samples.jsonl per evaluation")
    records_samples: int = opt(4, "per-token records (tokens.jsonl, troll.run.records) of this many samples (0: none)")
    records_every: int = opt(0, "RL steps between per-token records (0: at the evaluated steps)")
    kl_update_vocab: int = opt(0, "diagnostics: exact KL(new || old) over V after each step if V <= this (0: off)")
    log_to: str = opt("none", "also log to tensorboard (<out>/tensorboard) or wandb", ("none", "tensorboard", "wandb"))
    seed: int = opt(0, "seeds the model, the prompts and the sampler")
    out: str = opt("runs/tiny", "run directory")
    device: str = opt("cpu", "auto = cuda when available, else cpu", ("auto", "cpu", "cuda"))
    resume: bool = opt(
        False,
        "continue the run in --out from its newest whole checkpoint; only steps, lr, the eval / "
        "save / logging schedule, micro-batching and where it runs may change",
    )

    def __post_init__(self) -> None:
        # a level that is not one (a typo, a list in a config.json: compared, never hashed) is refused by `check`,
        # naming level, not the clip range it leaves unset
        level = self.level if self.level in tuple(CLIP_RANGE) else "token"
        low, high = CLIP_RANGE[level]
        self.clip_low = low if self.clip_low is None else self.clip_low  # unset: the level's range, once
        self.clip_high = high if self.clip_high is None else self.clip_high
        self.agg = DEFAULT_AGG[level] if self.agg is None else self.agg  # the same, once
        problems = check(self)
        if problems:
            raise ValueError("invalid config: " + "; ".join(problems))

    @classmethod
    def from_args(cls, argv: list[str] | None = None, prog: str = "troll train") -> Config:
        """Parse flags (module docstring); any invalid value is an argparse error: one line (troll.base.cli.Parser),
        exit 2, before any work. `prog` names the command in that line (bench/step.py passes its own flags through)."""
        parser = cls.parser(prog)
        overrides = vars(parser.parse_args(argv))  # the flags given (a flag not given is absent), and --preset
        preset = overrides.pop("preset")
        try:
            if not overrides.get("resume"):  # made once from preset and flags: unset clip range, agg follow the level
                cfg = cls(**(PRESETS[preset or "tiny-cpu"] | overrides))
            else:
                if preset:
                    parser.error("--preset with --resume: a resumed run keeps the settings in its config.json")
                cfg = cls.resumed(Path(overrides.get("out", cls().out)))
                fixed = [f"--{k} (the run has {getattr(cfg, k)!r})" for k, v in overrides.items()  # the flags given
                         if k not in NOT_SETTINGS + RESUME_CHANGEABLE and v != getattr(cfg, k)]  # fmt: skip
                if fixed:
                    parser.error(f"cannot change on resume: {', '.join(fixed)}; start a new run to change them")
                cfg = dataclasses.replace(cfg, **overrides)
        except ValueError as e:
            parser.error(str(e))
        if problems := inert(cfg, set(overrides)):
            parser.error("; ".join(problems))
        if missing := logger_missing(cfg.log_to):  # an optional package: looked up, not imported
            parser.error(missing)
        return cfg

    @classmethod
    def parser(cls, prog: str = "troll train") -> argparse.ArgumentParser:
        """The command line: --preset, then one flag per field with its help, default and choices."""
        parser = Parser(
            prog=prog,
            description="TROLL: RL with trust regions for LLMs. A preset sets a group of flags; flags win.",
        )
        parser.add_argument(
            "--preset",
            default=None,
            choices=list(PRESETS),
            help="tiny-cpu (the defaults below: addition, tiny local model, CPU), tiny-stale (stale rollouts), "
            "tiny-rare (a rare rewarded format), tiny-lora (LoRA on the tiny model), smollm2-words (a real LM on CPU: "
            "SmolLM2-135M-Instruct on word problems) or a "
            "GSM8K GPU recipe (gsm8k-qwen2.5-0.5b, gsm8k-qwen3-0.6b; with LoRA: gsm8k-qwen3-1.7b-lora and "
            "gsm8k-qwen3-4b-lora on 24 GB, gsm8k-qwen3-8b-lora and gsm8k-llama3.1-8b-lora on 80 GB); default: tiny-cpu",
        )
        types = field_types(cls)
        for f in fields(cls):
            tp = types[f.name]
            if tp not in PARSERS:
                raise TypeError(f"config field {f.name}: unsupported type {tp} (bool, int, float, str)")
            default = "unset" if f.default is None else str(f.default).lower() if tp is bool else f.default
            parser.add_argument(
                f"--{f.name}",
                type=f.metadata["parse"] or PARSERS[tp],
                choices=f.metadata["choices"],
                metavar="{true,false}" if tp is bool else None,
                default=argparse.SUPPRESS,  # a flag not given is absent, so the preset's value stays
                help=f"{f.metadata['help']}; default: {default}".replace("%", "%%"),  # argparse formats help with %
            )
        return parser

    def loss_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of troll.losses.LOSSES[self.loss] set by this config (the caller adds agg and
        norm_len, the batch's width)."""
        own = {
            "troll": {"eps": self.eps, "alpha": self.alpha, "level": self.level},
            "ppo_clip": {"eps_low": self.clip_low, "eps_high": self.clip_high, "level": self.level},
            "dppo": {"divergence": self.dppo_divergence, "ratio_cap": self.dppo_cap},
            "cispo": {"eps_high": self.clip_high},
        }
        truncation = {"is_cap": self.is_cap} if self.is_correction == "tis" else {}
        return {"k": self.k, "delta": self.delta, "support": self.support} | own[self.loss] | truncation

    def save(self, path: Path) -> None:
        """Write the config as JSON, atomically: a temporary file beside `path`, then renamed over it."""
        tmp = Path(path).with_name(Path(path).name + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> Config:
        """Read a saved config.json with the same checks as the command line; ValueError names the file."""
        try:
            data = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e}): a damaged config") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of config fields, got {type(data).__name__}")
        defaults = {f.name: f.default for f in fields(cls)}
        data = with_added(data)  # a config saved before a field in ADDED existed ran with its value
        unknown, missing = sorted(set(data) - set(defaults)), sorted(set(defaults) - set(data))
        if unknown:
            raise ValueError(f"{path}: unknown config fields {unknown}")
        if missing:  # today's defaults need not be what the run used
            example = ", ".join(f"{json.dumps(name)}: {json.dumps(defaults[name])}" for name in missing)
            raise ValueError(
                f"{path}: missing config fields {missing} (written by an older troll?): add each with the value the "
                f"run used (today's defaults: {example})"
            )
        try:
            return cls(**data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    @classmethod
    def resumed(cls, out: Path) -> Config:
        """The config of the run in `out`, to resume it, read only: its config.json; when that is missing or not
        JSON, the settings its newest readable checkpoint was written with, read only once `out` is known to be a
        run's folder (troll.base.outputs.run_marker: a folder that troll did not mark is refused, no checkpoint read).
        config.json is written again, a damaged one kept beside it, when the run claims its folder after every check
        (troll.run.harness.Run.claim). ValueError when there is nothing to resume."""
        path = out / "config.json"
        if not path.exists() and not path.is_symlink():
            problem = f"{path} does not exist"
        elif not path.is_file():
            problem = f"{path} is not a file"
        else:
            try:
                json.loads(path.read_text())
            except (OSError, ValueError):  # not UTF-8 or not JSON
                problem = f"{path} is not valid JSON"
            else:
                return cls.load(path)
        from troll.base.checkpoint import checkpoint_settings  # imports torch: only for a run that needs it
        from troll.base.outputs import RUN_MARKER, run_marker

        # a run made before the marker is recognised by its config.json, which is damaged here: unmarked, unread
        found = checkpoint_settings(out) if run_marker(out) else None
        if found is None:
            why = "no checkpoint holds the run's settings (nothing to resume)"
            if out.is_dir() and any(out.iterdir()) and not run_marker(out):
                why = f"{out} holds no {RUN_MARKER} (troll's mark on a run folder), so nothing of it is read"
            raise ValueError(
                f"--resume true: {problem}, and {why}: start the run without --resume, or choose another --out"
            )
        return cls(**with_added(found[1]), out=str(out), resume=True)


def field_types(cls: type) -> dict[str, type]:
    """Each field's type; an optional field (`float | None`: unset until the config is made) its value's type."""
    types = {}
    for name, tp in typing.get_type_hints(cls).items():
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        types[name] = args[0] if len(args) == 1 and type(None) in typing.get_args(tp) else tp
    return types


NOT_SETTINGS = ("out", "resume")  # where and how a run is started, not what it is
# Fields added after runs were recorded, with the value that reproduces what every run before them did: a saved
# config or results row without one ran with that value (`settings`, `Config.load`).
# dppo_cap acts only in DPPO, which ran at 2 before the setting existed; a run of another loss reproduces under any
# cap, so it takes today's default and compares equal to the same run made now (`with_added`).
ADDED = {
    "vocab_size": 0, "lora_rank": 0, "lora_alpha": 32.0, "lora_targets": "all-linear", "dppo_cap": 2.0,
    "sft_probe": 1024, "compile_head": False, "system": None, "mask_overlong": False, "share_prompt": False,
    "minibatch_by": "sample", "filter_groups": False,
}  # fmt: skip


# Fields that change nothing the run computes (troll.run.records only watches it): a config without them takes today's
# defaults, and compares equal to the same run made now
OBSERVING = {f.name: f.default for f in fields(Config) if f.name in ("records_samples", "records_every")}


def with_added(saved: dict[str, Any]) -> dict[str, Any]:
    """`saved` (a saved config or results row's fields) with each field of ADDED it lacks at the value it ran with."""
    added = ADDED if saved.get("loss") == "dppo" else ADDED | {"dppo_cap": DPPO_CAP}
    return added | OBSERVING | saved


def settings(saved: dict[str, Any]) -> dict[str, Any]:
    """A config's fields (a dict, e.g. a saved config.json) less where and how the run was started: what it is;
    a field in ADDED that it lacks has the value it ran with."""
    return {k: v for k, v in with_added(saved).items() if k not in NOT_SETTINGS}


# What may differ when a run is resumed (troll.run.harness applies and records it); every other field is the run's.
RESUME_CHANGEABLE = (
    "steps", "lr", "eval_every", "save_every", "samples_to_log", "log_to", "micro_batch_tokens",
    "grad_checkpointing", "kl_update_vocab", "device", "backend", "vllm_gpu_memory", "records_samples", "records_every",
)  # fmt: skip


MAY_BE_UNSET = ("system",)  # optional fields whose None is a setting (the template's own system message)


def _fits(value: Any, tp: type) -> bool:
    """`value` has the field type `tp`: bools are not ints, and ints are floats."""
    if tp in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if tp is float else tp)


def check(cfg: Config) -> list[str]:
    """Every problem with `cfg`: a value of the wrong type, outside its choices or range, or a combination that
    cannot run."""
    types = field_types(type(cfg))
    wrong = [
        f"{name} must be {tp.__name__}, got {type(v).__name__} {v!r}"
        for name, tp in types.items()
        if not _fits(v := getattr(cfg, name), tp) and not (v is None and name in MAY_BE_UNSET)
    ]
    if wrong:  # the checks below assume the types
        return wrong
    problems = [
        f"{f.name}={getattr(cfg, f.name)!r} is not one of {', '.join(f.metadata['choices'])}"
        for f in fields(cfg)
        if f.metadata["choices"] and getattr(cfg, f.name) not in f.metadata["choices"]
    ]

    def need(holds: bool, text: str) -> None:
        if not holds:
            problems.append(text)

    for name in ("eps", "temperature", "lr", "sft_lr", "grad_clip"):  # nan fails every comparison
        need(0 < getattr(cfg, name) < math.inf, f"{name} must be > 0 and finite, got {getattr(cfg, name)}")
    for name in ("alpha", "clip_high", "weight_decay", "lora_alpha"):
        need(0 <= getattr(cfg, name) < math.inf, f"{name} must be >= 0 and finite, got {getattr(cfg, name)}")
    need(0 <= cfg.delta < 1, f"delta must be in [0, 1), got {cfg.delta}")
    need(0 <= cfg.clip_low < 1, f"clip_low must be in [0, 1), got {cfg.clip_low}")
    need(0 <= cfg.sft_target <= 1, f"sft_target must be in [0, 1], got {cfg.sft_target}")
    need(1 <= cfg.is_cap < math.inf, f"is_cap must be >= 1 and finite, got {cfg.is_cap}")
    need(1 <= cfg.dppo_cap < math.inf, f"dppo_cap must be >= 1 and finite, got {cfg.dppo_cap}")
    need(0 < cfg.vllm_gpu_memory <= 1, f"vllm_gpu_memory must be in (0, 1], got {cfg.vllm_gpu_memory}")
    zero_ok = "micro_batch_tokens logits_chunk warmup_steps sft_steps eval_size samples_to_log kl_update_vocab seed"
    zero_ok += " staleness vocab_size lora_rank records_samples records_every"
    for name in (name for name, tp in types.items() if tp is int):  # counts: >= 1, or >= 0 where 0 is allowed
        low = 0 if name in zero_ok.split() else 1
        need(getattr(cfg, name) >= low, f"{name} must be >= {low}, got {getattr(cfg, name)}")
        need(getattr(cfg, name) < 2**63, f"{name} must be below 2**63 (a 64-bit integer), got {getattr(cfg, name)}")
    samples = cfg.prompts_per_step * cfg.samples_per_prompt
    need(cfg.minibatches <= samples, f"minibatches={cfg.minibatches} is more than the {samples} samples of a step")
    need(
        cfg.minibatch_by == "sample" or cfg.minibatches <= cfg.prompts_per_step,
        f"minibatch_by=group: minibatches={cfg.minibatches} is more than the {cfg.prompts_per_step} groups of a step",
    )
    need(
        not (cfg.share_prompt and cfg.grad_checkpointing),
        "share_prompt needs the KV cache, which gradient checkpointing drops in every layer: drop one of them",
    )
    need(
        cfg.level == "token" or cfg.loss in ("troll", "ppo_clip"),  # the losses with a GSPO mode
        f"level=sequence (GSPO) works with loss troll or ppo_clip, not {cfg.loss}",
    )
    need(
        cfg.is_correction == "none" or cfg.old_policy == "recompute",
        "is_correction corrects the recomputed anchor; old_policy=behaviour anchors at the sampler itself",
    )
    need(cfg.vocab_size == 0 or cfg.model == "tiny", "vocab_size grows the tiny model's tokenizer (--model tiny)")
    need(cfg.vocab_size == 0 or cfg.vocab_size >= 260, f"vocab_size must be 0 or >= 260 (the tiny tokenizer's size), "
         f"got {cfg.vocab_size}")  # fmt: skip
    need(bool(cfg.lora_targets.strip(" ,")), "lora_targets must name at least one layer (or all-linear)")
    names = [t.strip() for t in cfg.lora_targets.split(",")]
    need(
        names == ["all-linear"] or "all-linear" not in names,
        f"lora_targets={cfg.lora_targets!r}: all-linear is every decoder linear; give it alone, or layer names",
    )
    # values that make every update zero
    need(
        cfg.samples_per_prompt >= 2,
        f"samples_per_prompt={cfg.samples_per_prompt} makes every advantage 0 (each "
        "estimator subtracts the group's own mean, and a group of one is its mean): use at least 2",
    )
    need(
        cfg.lora_rank == 0 or cfg.lora_alpha > 0,
        "lora_alpha=0 scales the adapters' update (alpha / rank) B A by 0: every update is zero; use alpha > 0",
    )
    for name in ("model", "data", "out"):
        need(bool(getattr(cfg, name).strip()), f"{name} must not be empty")
    return problems


# Settings that act only under a switch: field -> (the switch, the switch's values where the field acts, those in
# words). From how the code reads each field: Config.loss_kwargs (troll.losses' parameters), troll.train,
# troll.tasks.task, troll.run.warmstart, troll.policy, troll.run.harness, troll.run.records. Every field not listed
# acts in every run.
_WARM = (lambda v: v > 0, "--sft_steps > 0 (a supervised warm-start)")
ACTS_ONLY: dict[str, tuple[str, typing.Callable[[Any], bool], str]] = {
    "eps": ("loss", lambda v: v == "troll", "--loss troll"),
    "alpha": ("loss", lambda v: v == "troll", "--loss troll"),
    "level": ("loss", lambda v: v in ("troll", "ppo_clip"), "--loss troll or ppo_clip"),  # dppo, cispo: per token
    "clip_low": ("loss", lambda v: v == "ppo_clip", "--loss ppo_clip"),
    "clip_high": ("loss", lambda v: v in ("ppo_clip", "cispo"), "--loss ppo_clip or cispo"),
    "dppo_divergence": ("loss", lambda v: v == "dppo", "--loss dppo"),
    "dppo_cap": ("loss", lambda v: v == "dppo", "--loss dppo"),
    "is_cap": ("is_correction", lambda v: v == "tis", "--is_correction tis"),
    "lora_alpha": ("lora_rank", lambda v: v > 0, "--lora_rank > 0"),
    "lora_targets": ("lora_rank", lambda v: v > 0, "--lora_rank > 0"),
    "vllm_gpu_memory": ("backend", lambda v: v == "vllm", "--backend vllm"),
    "compile_head": ("logits_chunk", lambda v: v > 0, "--logits_chunk > 0 (the chunked output layer)"),
    "sft_target": ("sft_steps", *_WARM),
    "sft_lr": ("sft_steps", *_WARM),
    "sft_batch": ("sft_steps", *_WARM),
    "sft_probe": ("sft_steps", *_WARM),
    "data": ("task", lambda v: v == "gsm8k", "--task gsm8k"),
    "chat": ("task", lambda v: v in ("gsm8k", "words"), "--task gsm8k or words"),
    "system": ("chat", lambda v: v is True, "--chat true"),
    "reverse_sum": ("task", lambda v: v in ("addition", "rare"), "--task addition or rare"),
    "records_every": ("records_samples", lambda v: v > 0, "--records_samples > 0 (per-token records)"),
}


def inert(cfg: Config, given: set[str]) -> list[str]:
    """The flags in `given` (those on the command line) that cannot act in `cfg`, each named with the switch that
    makes it act (ACTS_ONLY); empty when every flag given acts. A preset's values and the defaults are never in
    `given`: only what the user asked for is refused."""
    problems = []
    for name in sorted(given & ACTS_ONLY.keys()):
        switch, acts, when = ACTS_ONLY[name]
        value = getattr(cfg, switch)
        if not acts(value):
            shown = str(value).lower() if isinstance(value, bool) else value
            problems.append(f"--{name} acts only with {when}, not --{switch} {shown}: drop --{name}")
    return problems


_GSM8K_GPU = dict(  # what the GSM8K GPU presets change from the defaults
    task="gsm8k",
    chat=True,
    backend="vllm",
    lr=1e-6,
    prompts_per_step=64,
    minibatches=4,
    max_new_tokens=1024,
    micro_batch_tokens=16384,
    logits_chunk=1024,
    bf16=True,
    grad_checkpointing=True,
    steps=200,
    eval_size=0,
    sft_steps=0,
    device="cuda",
)
# LoRA on the GSM8K recipe: rank 32 on every decoder linear, alpha 32 (Config's default: the update is (alpha / r)
# B A = B A at r = 32, and with alpha fixed the best learning rate hardly moves with the rank), learning rate 10x
# full fine-tuning's: "LoRA Without Regret" (Thinking Machines, 2025) finds RL matches full fine-tuning at low rank
# with about 10x the full-FT learning rate
_LORA = dict(lora_rank=32, lr=1e-5)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny-cpu": {},  # Config's defaults
    # where the off-policy study saw the trust region matter most (docs/results.md): an asynchronous pipeline of
    # depth 2 at 3x the learning rate, anchored at the sampler; --loss cispo is the same without a trust region
    "tiny-stale": dict(staleness=2, old_policy="behaviour", lr=3e-4, steps=40, eval_every=10, save_every=10),
    # the rewarded answer format starts rare (1% of the warm-start's samples) on a 1,024-token vocabulary, in the
    # off-policy cell where the trust region binds: TROLL adopts it, PPO-clip's ratio clip holds it back
    # (docs/results.md#a-rare-rewarded-behaviour-the-sequence-task); --loss ppo_clip for the comparison
    "tiny-rare": dict(
        task="rare",
        vocab_size=1024,
        staleness=2,
        old_policy="behaviour",
        lr=3e-4,
        steps=40,
        eval_every=20,
        save_every=20,
        kl_update_vocab=4096,
        out="runs/tiny-rare",
    ),  # fmt: skip
    # LoRA on the tiny task at its best learning rate in the paired study against full fine-tuning
    # (docs/results.md#lora-against-full-fine-tuning-tiny-task): about 3x full fine-tuning's there
    "tiny-lora": dict(lora_rank=8, lora_alpha=16.0, lr=3e-4, out="runs/tiny-lora"),
    # a real pretrained LM on a CPU: SmolLM2-135M-Instruct from its PyPI package (troll.models.packaged) on arithmetic
    # word problems asked and scored as GSM8K is (troll.tasks.words), after a short supervised warm-start; sized for 2
    # cores, its levers measured one seed at a time (docs/results.md#a-finer-warm-start-every-seed-past-015-issue-52)
    # (docs/results.md#a-real-model-smollm2-135m-instruct)
    "smollm2-words": dict(
        task="words",
        model="smollm2-135m-instruct",
        chat=True,
        max_prompt_len=128,
        max_new_tokens=24,
        prompts_per_step=8,  # x the default 8 samples: groups of 8 keep more samples with signal than 16 x 4
        filter_groups=True,  # only groups with signal are trained on: many groups are all right or all wrong
        minibatches=4,  # optimiser steps per batch: from the second on, p has moved from q and the trust region acts
        share_prompt=True,  # each prompt forwarded once in generation, the old-policy pass and the update (exact)
        minibatch_by="group",  # whole groups a minibatch, so the update too forwards each prompt once
        lr=1e-5,
        lr_schedule="cosine",  # at a constant lr the filtered run's held-out accuracy fell back after step 40
        steps=60,
        eval_every=20,
        eval_size=500,
        save_every=20,
        sft_steps=40,
        sft_target=0.15,
        sft_lr=5e-6,  # half the step and 4x the probe of the earlier warm-start: RL starts lower (0.29-0.39 held-out
        sft_batch=16,  # on seeds 0-2, against 0.39-0.46), with more left to gain
        sft_probe=256,
        out="runs/smollm2-words",
    ),  # fmt: skip
    "gsm8k-qwen2.5-0.5b": dict(_GSM8K_GPU, model="Qwen/Qwen2.5-0.5B-Instruct", out="runs/gsm8k-qwen2.5-0.5b"),
    # 8,192 tokens: troll.models.memory leaves 16,384 too close to a 24 GB GPU's budget beside vLLM for this model
    "gsm8k-qwen3-0.6b": dict(_GSM8K_GPU, model="Qwen/Qwen3-0.6B", micro_batch_tokens=8192, out="runs/gsm8k-qwen3-0.6b"),
    # the papers' models with LoRA, sized by troll.models.memory for one GPU each (docs/results.md#what-fits-where): the
    # largest micro-batch whose update fits with vLLM asleep; vLLM's fraction 0.05 below the most the trainer's
    # resident state leaves while vLLM generates (the most KV cache; its least: bf16 weights + a minimal KV cache)
    "gsm8k-qwen3-1.7b-lora": dict(_GSM8K_GPU, **_LORA, model="Qwen/Qwen3-1.7B", vllm_gpu_memory=0.75,
                                  micro_batch_tokens=24576, out="runs/gsm8k-qwen3-1.7b-lora"),  # 24 GB
    "gsm8k-qwen3-4b-lora": dict(_GSM8K_GPU, **_LORA, model="Qwen/Qwen3-4B", vllm_gpu_memory=0.55,
                                micro_batch_tokens=8192, out="runs/gsm8k-qwen3-4b-lora"),  # 24 GB
    "gsm8k-qwen3-8b-lora": dict(_GSM8K_GPU, **_LORA, model="Qwen/Qwen3-8B", vllm_gpu_memory=0.7,
                                micro_batch_tokens=49152, out="runs/gsm8k-qwen3-8b-lora"),  # 80 GB
    "gsm8k-llama3.1-8b-lora": dict(_GSM8K_GPU, **_LORA, model="meta-llama/Llama-3.1-8B-Instruct",
                                   vllm_gpu_memory=0.7, micro_batch_tokens=49152,
                                   out="runs/gsm8k-llama3.1-8b-lora"),  # 80 GB
}  # fmt: skip
