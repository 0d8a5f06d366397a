"""Rollout throughput: vLLM vs transformers `generate`, same tiny model, same prompts, same lengths.

    .venv/bin/python bench/rollout.py                              # 64 prompts x 8 samples x 64 tokens, top-20
    .venv/bin/python bench/rollout.py --prompts 16 --n 4 --max-new 32 --top-k 64 --hidden 256

What is timed: one `generate` call of `troll.rollout.HFGenerator` and of `troll.rollout.VLLMGenerator`
(so each includes building the padded `Rollouts`), without top-K log-probs (K = 0: only the sampled token's
log-prob) and with top-K. Tokens per second = generated tokens (sum of completion masks) / wall time.

Model: `troll.tiny` Llama (float32, untied, output layer = tokenizer size, so no vocab mask), tokenizer
trained on a synthetic corpus of random words so that it fills `--vocab` ids. Prompts: random token ids
(no special tokens) of 32-64 tokens. A random model almost never samples EOS, so nearly every sample runs to
`--max-new` and both backends generate about the same number of tokens.

Timing: one small warm-up call per backend, then `--repeats` rounds alternating the backend order (so the
load of other processes hits both alike); medians are reported. The vLLM engine is in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), float32, eager, 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=1), as in the
tests. Torch's thread count is printed before and after the engine starts (vLLM's CPU worker replaces
`torch.set_num_threads` with a no-op). Last line: a one-line SUMMARY of the vLLM / HF ratios (median over
rounds of the ratio within a round, since the two runs of a round are back to back).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

import torch

from troll.rollout import HFGenerator, Rollouts, VLLMGenerator
from troll.tiny import save_tiny, tiny_llama, train_tokenizer


def corpus(n_sentences: int, seed: int = 0) -> list[str]:
    """Sentences of random lower-case words (a 4,000-word lexicon), enough to fill a few thousand BPE merges."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(4000)]
    return [" ".join(rng.choices(lexicon, k=rng.randint(8, 20))) + "." for _ in range(n_sentences)]


def timed(gen, prompts: list[list[int]], args: argparse.Namespace, k: int, seed: int) -> tuple[float, int]:
    """(seconds, generated tokens) of one generate call."""
    t0 = time.perf_counter()
    ro: Rollouts = gen.generate(prompts, n=args.n, max_new_tokens=args.max_new, top_k_logprobs=k, seed=seed)
    return time.perf_counter() - t0, int(ro.completion_mask.sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1, help="rounds; 3+ for steadier medians")
    args = p.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    tok = train_tokenizer(corpus(20000), vocab_size=args.vocab)
    model = tiny_llama(tok, hidden=args.hidden, layers=args.layers, heads=args.heads).eval()
    g = torch.Generator().manual_seed(0)
    first = len(tok.all_special_ids)
    lens = torch.randint(32, 65, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(first, len(tok), (L,), generator=g).tolist() for L in lens]
    max_len = 64 + args.max_new

    threads_before = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as d:
        save_tiny(model, tok, d)
        t0 = time.perf_counter()
        vgen = VLLMGenerator(d, tok, max_model_len=max_len, max_top_k=max(args.top_k, 1), dtype="float32")
        startup = time.perf_counter() - t0
    hgen = HFGenerator(model, tok, max_model_len=max_len)
    gens = {"hf": hgen, "vllm": vgen}
    for gen in gens.values():  # warm-up
        gen.generate(prompts[:2], n=2, max_new_tokens=4, top_k_logprobs=args.top_k)

    results: dict[tuple[str, int], list[float]] = {(b, k): [] for b in gens for k in (0, args.top_k)}
    for r in range(args.repeats):
        order = ["hf", "vllm"] if r % 2 == 0 else ["vllm", "hf"]
        for k in (0, args.top_k):
            for b in order:
                secs, toks = timed(gens[b], prompts, args, k, seed=r)
                results[(b, k)].append(toks / secs)

    print(f"model: hidden {args.hidden}, layers {args.layers}, heads {args.heads}, vocab {len(tok)}, float32")
    print(f"batch: {args.prompts} prompts x {args.n} samples x {args.max_new} new tokens, prompts 32-64 tokens")
    print(f"torch threads before/after the engine: {threads_before}/{torch.get_num_threads()}")
    print(f"vLLM engine start-up: {startup:.1f} s; repeats: {args.repeats} (median tok/s)")
    print(f"{'backend':8} {'top-K':>6} {'tok/s':>10}")
    med = {key: statistics.median(v) for key, v in results.items()}
    for (b, k), v in med.items():
        print(f"{b:8} {k:>6} {v:>10,.0f}")
    # paired ratios: each round runs both backends back to back, so a load spike hits one pair
    r0, rk = (
        statistics.median(v / h for v, h in zip(results[("vllm", k)], results[("hf", k)], strict=True))
        for k in (0, args.top_k)
    )
    print(f"SUMMARY vLLM/HF tokens per second: {r0:.2f}x without top-K, {rk:.2f}x with top-{args.top_k} log-probs")


if __name__ == "__main__":
    main()
