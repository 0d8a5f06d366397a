"""One typed config for a run, its presets, and command-line overrides.

    cfg = Config.from_args(["--preset", "tiny-cpu", "--loss", "ppo_clip", "--seed", "1"])

Every field is a flag (`--lr 1e-6`, `--bf16 true`). A preset sets a group of fields; flags given after it win.
The resolved config is written to `<out>/config.json` and `--resume` reads it back from there.

Presets:
    tiny-cpu            2-digit addition, a 0.6M-parameter Llama built locally, 250 supervised warm-start steps
                        (held-out greedy accuracy ~0.27), then 100 RL steps on two CPU cores in about a minute
                        (README's main command).
    gsm8k-qwen2.5-0.5b  GSM8K on one 24-80 GB GPU: the paper's defaults (ALGORITHM.md section 7) scaled down:
    gsm8k-qwen3-0.6b    lr 1e-6 constant, grad-clip 1, 8 samples per prompt, 64 prompts per step split into
                        4 optimiser steps, eps 0.05, alpha 1, K 64, delta 1e-5, vLLM rollouts, bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass
class Config:
    # what to train
    task: str = "addition"  # "addition" (tiny CPU task) or "gsm8k"
    model: str = "tiny"  # "tiny" builds a local tiny Llama; otherwise a hub name or a local HF directory
    data: str = "openai/gsm8k"  # GSM8K source: hub name or a folder with {train,test}.jsonl
    chat: bool = False  # GSM8K prompts through the tokenizer's chat template (instruct models)
    # the objective
    loss: str = "troll"  # troll | ppo_clip | dppo | cispo
    advantage: str = "grpo"  # grpo | dr_grpo | reinforce_pp
    agg: str = "token-mean"  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
    level: str = "token"  # token, or sequence (GSPO; troll and ppo_clip only)
    eps: float = 0.05  # TROLL: KL bound per token
    alpha: float = 1.0  # TROLL: weight of the regression term
    k: int = 64  # sparse support: at most K tokens per policy (plus the sampled one)
    delta: float = 1e-5  # sparse support: kept mass >= 1 - delta
    support: str = "rest"  # sparse model: rest (old policy's support + one exact rest atom) | paper (1e-12 tail)
    clip_low: float = 0.2  # PPO-clip: eps_low
    clip_high: float = 0.2  # PPO-clip: eps_high (0.28 = Clip-Higher); CISPO's cap is 1 + clip_high
    dppo_divergence: str = "binary_tv"  # binary_tv | binary_kl | topk_tv | topk_kl
    old_policy: str = "recompute"  # recompute (paper: model's log-probs before the update) | behaviour (engine)
    # rollouts
    backend: str = "hf"  # hf (transformers generate) | vllm
    prompts_per_step: int = 16  # prompts sampled per RL step
    samples_per_prompt: int = 8  # group size
    max_prompt_len: int = 512  # longer prompts are dropped from the data set (counted in the log)
    max_new_tokens: int = 8  # response length limit
    temperature: float = 1.0  # sampling temperature (the trainer scores with the same one)
    vllm_gpu_memory: float = 0.3  # vLLM's GPU memory fraction (GPU only)
    # optimisation
    steps: int = 60  # RL steps
    minibatches: int = 2  # optimiser steps per RL step (the batch is split into this many parts)
    micro_batch_tokens: int = 4096  # gradient accumulation: at most this many padded tokens per forward
    lr: float = 1e-3  # AdamW learning rate
    lr_schedule: str = "constant"  # constant | cosine (with warmup)
    warmup_steps: int = 0  # linear warmup, in optimiser steps
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max gradient norm
    bf16: bool = False  # bf16 autocast (GPU)
    grad_checkpointing: bool = False
    # supervised warm-start (tiny task)
    sft_steps: int = 0  # supervised steps on reference solutions before RL
    sft_lr: float = 3e-3
    sft_batch: int = 64
    # evaluation, logging, checkpoints
    eval_every: int = 20  # RL steps between held-out evaluations (greedy pass@1)
    eval_size: int = 200  # held-out problems per evaluation (0 = the whole test split)
    save_every: int = 20  # RL steps between checkpoints
    samples_to_log: int = 4  # completions written to samples.jsonl per evaluation
    seed: int = 0
    out: str = "runs/tiny"  # run directory
    device: str = "auto"  # auto | cpu | cuda
    resume: bool = False  # continue from <out>/checkpoints/latest

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> Config:
        parser = argparse.ArgumentParser(description="TROLL: RL with trust regions for LLMs")
        parser.add_argument("--preset", default="tiny-cpu", choices=sorted(PRESETS))
        for f in fields(cls):
            kind = {"int": int, "float": float, "str": str, "bool": _bool}[f.type]
            parser.add_argument(f"--{f.name}", type=kind, default=None)
        args = parser.parse_args(argv)
        cfg = cls(**PRESETS[args.preset])
        overrides = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name) is not None}
        if overrides.get("resume") and (Path(overrides.get("out", cfg.out)) / "config.json").exists():
            cfg = cls.load(Path(overrides.get("out", cfg.out)) / "config.json")
        return dataclasses.replace(cfg, **overrides)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Config:
        return cls(**json.loads(Path(path).read_text()))


def _bool(s: str) -> bool:
    if s.lower() not in ("1", "0", "true", "false", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")
    return s.lower() in ("1", "true", "yes")


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
    "tiny-cpu": dict(
        task="addition",
        model="tiny",
        sft_steps=250,
        sft_lr=1e-3,
        steps=100,
        lr=1e-4,
        prompts_per_step=32,
        samples_per_prompt=8,
        minibatches=2,
        max_new_tokens=5,
        eval_every=25,
        eval_size=1000,
        save_every=25,
        device="cpu",
        out="runs/tiny",
    ),
    "gsm8k-qwen2.5-0.5b": dict(_GSM8K_GPU, model="Qwen/Qwen2.5-0.5B-Instruct", out="runs/gsm8k-qwen2.5-0.5b"),
    "gsm8k-qwen3-0.6b": dict(_GSM8K_GPU, model="Qwen/Qwen3-0.6B", out="runs/gsm8k-qwen3-0.6b"),
}
