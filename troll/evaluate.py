"""Greedy pass@1 evaluation, used by training and on its own:

    python -m troll.evaluate --model NAME_OR_PATH [--data openai/gsm8k] [--chat true] [--limit N] [--out DIR]

Scores greedy completions of every GSM8K test problem (1,319) with exactly the reward training uses
(`troll.gsm8k.reward`), with vLLM when it is installed and a GPU or `--backend vllm` asks for it, else
transformers `generate`. Writes `predictions.jsonl` (question, gold, completion, extracted answer, reward)
and `summary.json` (accuracy, n, backend, seconds) into `--out`, and prints the accuracy.

Greedy decoding is the rollout backends' own `greedy` (rollout.HFGenerator, vllm_engine.VLLMGenerator), the
path training evaluates with too, so the numbers agree; it masks output ids past the tokenizer (Qwen's padded
rows), as the samplers do. `encode`, `decode` and `score` are shared with troll.train.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import torch

from troll.rollout import Generator, HFGenerator
from troll.task import decode, encode, score


def greedy_generator(backend: str, model_path: str, tokenizer: Any, max_model_len: int) -> Generator:
    """A rollout backend ("hf" or "vllm") holding the model at `model_path`, for its `greedy` method."""
    if backend == "vllm":
        from troll.vllm_engine import VLLMGenerator

        on_gpu = torch.cuda.is_available()
        dtype = "auto" if on_gpu else "float32"  # vLLM's "auto" runs a float32 checkpoint in 16 bits
        return VLLMGenerator(
            model_path, tokenizer, max_model_len, dtype=dtype, gpu_memory_utilization=0.9, sleep_level=None
        )

    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return HFGenerator(AutoModelForCausalLM.from_pretrained(model_path).to(device), tokenizer, max_model_len)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoTokenizer

    from troll import gsm8k

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=gsm8k.HUB_NAME, help="hub name or a folder with test.jsonl")
    p.add_argument(
        "--chat",
        default="auto",
        choices=["auto", "true", "false"],
        help="chat template prompts (auto: when the tokenizer has one)",
    )
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--backend", default="auto", choices=["auto", "hf", "vllm"])
    p.add_argument("--out", default=None, help="output folder (default: evals/<model name>)")
    args = p.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    chat = tokenizer.chat_template is not None if args.chat == "auto" else args.chat == "true"
    rows = gsm8k.load_gsm8k("test", source=args.data, limit=args.limit)
    prompts = encode(tokenizer, [gsm8k.make_prompt(r["question"], tokenizer, chat=chat) for r in rows])
    backend = args.backend
    if backend == "auto":
        backend = "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"
    start = time.time()
    max_model_len = max(len(x) for x in prompts) + args.max_new_tokens
    completions = decode(
        tokenizer, greedy_generator(backend, args.model, tokenizer, max_model_len).greedy(prompts, args.max_new_tokens)
    )
    acc, records = score(rows, completions, gsm8k.reward)
    out = Path(args.out or Path("evals") / Path(args.model).name)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w") as f:
        for rec in records:
            f.write(json.dumps(rec | {"extracted": gsm8k.extract_answer(rec["completion"])}) + "\n")
    summary = {
        "model": args.model,
        "accuracy": acc,
        "n": len(rows),
        "backend": backend,
        "chat": chat,
        "seconds": round(time.time() - start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"GSM8K greedy pass@1: {acc:.4f} ({len(rows)} problems, {backend}) -> {out}")
    return summary


if __name__ == "__main__":
    main()
