"""Greedy pass@1 evaluation, used by training and on its own:

    python -m troll.evaluate --model NAME_OR_PATH [--data openai/gsm8k] [--chat true] [--limit N] [--out DIR]

Scores greedy completions of every GSM8K test problem (1,319) with exactly the reward training uses
(`troll.gsm8k.reward`), with vLLM when it is installed and a GPU or `--backend vllm` asks for it, else
transformers `generate`. Writes `predictions.jsonl` (question, gold, completion, extracted answer, reward)
and `summary.json` (accuracy, n, backend, seconds) into `--out`, and prints the accuracy.
Greedy decoding masks output ids past the tokenizer (Qwen's padded rows), as the samplers do.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import GenerationConfig, LogitsProcessorList

from troll.rollout import MaskPaddedVocab, check_vocab, import_vllm, left_pad


def encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of prompts that already hold any special tokens they need (chat templates do)."""
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def decode(tokenizer: Any, seqs: Sequence[Sequence[int]]) -> list[str]:
    """Completion texts of token id sequences, special tokens (EOS, padding) removed."""
    return tokenizer.batch_decode([list(ids) for ids in seqs], skip_special_tokens=True)


@torch.no_grad()
def greedy_hf(
    model: Any, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 64
) -> list[str]:
    """Greedy completions (text, special tokens removed) with transformers `generate`, left-padded batches."""
    check_vocab(len(tokenizer), model.get_output_embeddings().weight.shape[0])
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad
    )
    saved, model.generation_config = model.generation_config, GenerationConfig()
    was_training = model.training
    model.eval()
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = prompts[i : i + batch_size]
            ids, attn = left_pad(chunk, pad)
            width = ids.shape[1]
            seq = model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.long().to(device),
                generation_config=config,
                logits_processor=LogitsProcessorList([MaskPaddedVocab(len(tokenizer))]),
            )
            out += decode(tokenizer, seq[:, width:].tolist())
    finally:
        model.generation_config = saved
        model.train(was_training)
    return out


def greedy_vllm(
    model_path: str, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int, dtype: str = "auto"
) -> list[str]:
    """Greedy completions with a vLLM engine loaded from `model_path` (hub name or HF directory)."""
    from transformers import AutoConfig

    vllm = import_vllm()
    padded = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size > len(tokenizer)
    llm = vllm.LLM(
        model=model_path,
        skip_tokenizer_init=True,
        generation_config="vllm",
        seed=0,
        dtype=dtype,
        max_model_len=max(len(p) for p in prompts) + max_new_tokens,
        enforce_eager=not torch.cuda.is_available(),
    )
    params = vllm.SamplingParams(
        temperature=0.0,
        max_tokens=max_new_tokens,
        detokenize=False,
        stop_token_ids=[tokenizer.eos_token_id],
        allowed_token_ids=list(range(len(tokenizer))) if padded else None,  # padded output rows never win
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    return decode(tokenizer, [o.outputs[0].token_ids for o in outs])


def score(
    rows: Sequence[dict], completions: Sequence[str], reward_fn: Callable[[str, str], float]
) -> tuple[float, list[dict]]:
    """Accuracy in [0, 1] and one record per problem."""
    records = [
        {"question": r["question"], "gold": r["gold"], "completion": c, "reward": reward_fn(c, r["gold"])}
        for r, c in zip(rows, completions, strict=True)
    ]
    return (sum(x["reward"] for x in records) / max(len(records), 1)), records


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
        try:
            import_vllm()
            backend = "vllm" if torch.cuda.is_available() else "hf"
        except ImportError:
            backend = "hf"
    start = time.time()
    if backend == "vllm":
        completions = greedy_vllm(args.model, tokenizer, prompts, args.max_new_tokens)
    else:
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = AutoModelForCausalLM.from_pretrained(args.model).to(device)
        completions = []
        for i in tqdm(range(0, len(prompts), 64), desc="greedy"):
            completions += greedy_hf(model, tokenizer, prompts[i : i + 64], args.max_new_tokens)
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
