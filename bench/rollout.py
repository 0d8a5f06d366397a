"""Rollout throughput: vLLM vs transformers `generate`, same tiny model, same prompts, same lengths.

    .venv/bin/python bench/rollout.py                              # 64 prompts x 8 samples x 256 tokens, top-20
    .venv/bin/python bench/rollout.py --hidden 128 --layers 2 --max-new 64   # the 0.6M-parameter toy
    .venv/bin/python bench/rollout.py --model-vocab 32768 --top-k 0          # a Qwen-like wide output layer

Default workload: a 5.25M-parameter Llama (hidden 256, 4 layers) and 256 new tokens per sample, the shape of
a GSM8K rollout scaled to two CPU cores (the GSM8K presets allow 1,024 new tokens on 0.5B-parameter models).
On the 0.6M-parameter toy with 64 new tokens both backends spend most of their time outside the model, and
vLLM's fixed cost per token (scheduler, sampler, output handling, about 50 us) caps its lead near 1.5x: that
measures Python bookkeeping, not generation; the `split` lines below show it.

What is timed: one `generate` call of `troll.rollout.HFGenerator` and of `troll.models.vllm_engine.VLLMGenerator`
(so each includes building the padded `Rollouts`), without top-K log-probs (K = 0: only the sampled token's
log-prob) and with top-K (`--top-k 0` runs K = 0 only). Tokens per second = generated tokens (sum of
completion masks) / wall time.

Model: `troll.models.tiny` Llama (float32, untied; `--hidden`, `--layers`, `--heads`, head_dim = hidden / heads must
be one vLLM's CPU attention supports, e.g. 32 or 64), tokenizer trained on a synthetic corpus of random words
so that it fills `--vocab` ids. The output layer has `--model-vocab` rows (default: the tokenizer's size, so no
vocab mask); a larger value pads it like Qwen's (151,936 rows for 151,665 tokens) and both backends mask the
padding. Prompts: random token ids (no special tokens) of 32-64 tokens. A random model almost never samples
EOS, so nearly every sample runs to `--max-new` and both backends generate about the same number of tokens.

Timing: one small warm-up call per backend, then `--repeats` rounds alternating the backend order (so the
load of other processes hits both alike); medians are reported. The vLLM engine is in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), float32, eager, 2 GiB KV cache (VLLM_CPU_KVCACHE_SPACE=2: the default
batch's 512 sequences of up to 320 tokens need 1.3 GB at hidden 256, 4 layers). Like transformers, which runs
the whole batch in every forward call, vLLM may keep the whole batch in flight: `--max-num-seqs` defaults to
prompts x n (0 = vLLM's own CPU default of 256 sequences per engine step, which runs a 512-sample batch as two
waves); `--max-num-batched-tokens` overrides the tokens per engine step (0 = vLLM's 4,096). Torch's thread
count is printed before and after the engine starts (vLLM's CPU worker replaces `torch.set_num_threads` with a
no-op). OMP_WAIT_POLICY=PASSIVE is set unless the environment sets it (as in bench/step.py).

Where the time goes (`split` lines, medians over the measured calls): for vLLM, wall time inside the engine's
model executor (`execute_model`: input preparation and the forward pass), its sampler (`sample_tokens`:
temperature, Gumbel sampling, log-probs), the scheduler (`schedule` + `update_from_output`: per-request KV
block bookkeeping and stop checks, Python), and the rest (vLLM's output processing and request handling, and
our conversion to `Rollouts`); also the number of engine steps. For transformers: the model's forward calls
vs the rest of `generate` (sampling, the stored per-step scores, log-softmax/top-K of them, padding).
Last line: a one-line SUMMARY of the vLLM / HF ratios (median over rounds of the ratio within a round, since
the two runs of a round are back to back).
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported (module docstring)
if not __package__:  # run as a file (python bench/x.py): the repository root on the path, for `bench` and its troll
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._util import int_at_least  # noqa: E402
from troll.base.cli import Parser, free_memory, gib, run_command
from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer  # noqa: E402
from troll.models.vllm_engine import VLLMGenerator  # noqa: E402
from troll.rollout import HFGenerator, Rollouts  # noqa: E402

PROG = "python bench/rollout.py"  # the name in each of its lines, argparse's own and run_command's
SCORE_BYTES = 12  # a generated token's score per output row kept by transformers `generate` (troll.run.start's figure)
MODEL_BYTES = 8  # a parameter: float32, in the model and in vLLM's copy of it


def corpus(n_sentences: int, seed: int = 0) -> list[str]:
    """Sentences of random lower-case words (a 4,000-word lexicon), enough to fill a few thousand BPE merges."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon = ["".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(4000)]
    return [" ".join(rng.choices(lexicon, k=rng.randint(8, 20))) + "." for _ in range(n_sentences)]


class Stopwatch:
    """Wall seconds spent inside wrapped methods, by label, since the last `reset` (and how many calls)."""

    def __init__(self) -> None:
        self.secs: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)  # keeps the signature: transformers inspects model.forward's parameters
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.secs[label] += time.perf_counter() - t0
                self.calls[label] += 1

        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.secs.clear()
        self.calls.clear()


def timed(gen, prompts: list[list[int]], args: argparse.Namespace, k: int, seed: int) -> tuple[float, int]:
    """(seconds, generated tokens) of one generate call."""
    t0 = time.perf_counter()
    ro: Rollouts = gen.generate(prompts, n=args.n, max_new_tokens=args.max_new, top_k_logprobs=k, seed=seed)
    return time.perf_counter() - t0, int(ro.completion_mask.sum())


def main() -> None:
    p = Parser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int_at_least(1), default=64)
    p.add_argument("--n", type=int_at_least(1), default=8, help="samples per prompt")
    p.add_argument("--max-new", type=int_at_least(1), default=256)
    p.add_argument("--top-k", type=int_at_least(0), default=20, help="also time with top-K log-probs (0: only K = 0)")
    p.add_argument("--vocab", type=int_at_least(1), default=2048, help="tokenizer size (BPE target)")
    p.add_argument(
        "--model-vocab", type=int_at_least(0), default=0, help="output layer rows (0 = tokenizer size; more = padded)"
    )
    p.add_argument("--hidden", type=int_at_least(1), default=256)
    p.add_argument("--layers", type=int_at_least(1), default=4)
    p.add_argument("--heads", type=int_at_least(1), default=4)
    p.add_argument(
        "--max-num-seqs",
        type=int_at_least(0),
        default=None,
        help="vLLM: sequences per engine step (default: the whole batch; 0 = vLLM's)",
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int_at_least(0), default=0, help="vLLM: tokens per engine step (0 = default)"
    )
    p.add_argument("--repeats", type=int_at_least(1), default=1, help="rounds; 3+ for steadier medians")
    args = p.parse_args()
    if args.hidden % args.heads:
        p.error(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    rows = max(args.model_vocab, args.vocab)  # the output layer: at least the tokenizer's size
    params = args.layers * 12 * args.hidden**2 + 2 * rows * args.hidden  # a Llama layer's 12 H^2, embeddings
    free = free_memory()
    if free is not None and params * MODEL_BYTES > free:
        p.error(
            f"--hidden {args.hidden} x --layers {args.layers} with {rows} output rows make a model of "
            f"{gib(params * MODEL_BYTES)} in its two copies, more than the {gib(free)} free here: pass smaller counts"
        )
    size = args.prompts * args.n * args.max_new * rows * SCORE_BYTES
    if free is not None and size > free:
        p.error(
            f"--prompts {args.prompts} x --n {args.n} x --max-new {args.max_new} tokens, each scored over {rows} "
            f"output rows, keep {gib(size)} in one transformers call, more than the {gib(free)} free here: pass "
            "smaller counts"
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    tok = train_tokenizer(corpus(20000), vocab_size=args.vocab)
    model = tiny_llama(
        tok, hidden=args.hidden, layers=args.layers, heads=args.heads, vocab_size=args.model_vocab or None
    ).eval()
    g = torch.Generator().manual_seed(0)
    first = len(tok.all_special_ids)
    lens = torch.randint(32, 65, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(first, len(tok), (L,), generator=g).tolist() for L in lens]
    max_len = 64 + args.max_new

    max_num_seqs = args.prompts * args.n if args.max_num_seqs is None else args.max_num_seqs
    engine = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens}
    engine = {key: v for key, v in engine.items() if v}
    threads_before = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as d:
        save_tiny(model, tok, d)
        t0 = time.perf_counter()
        vgen = VLLMGenerator(
            d, tok, max_model_len=max_len, max_top_k=max(args.top_k, 1), dtype="float32", engine_kwargs=engine
        )
        startup = time.perf_counter() - t0
    hgen = HFGenerator(model, tok, max_model_len=max_len)
    gens = {"hf": hgen, "vllm": vgen}
    for gen in gens.values():  # warm-up
        gen.generate(prompts[:2], n=2, max_new_tokens=4, top_k_logprobs=args.top_k)

    watch = {b: Stopwatch() for b in gens}
    core = vgen.llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
    sched_cfg = vgen.llm.llm_engine.vllm_config.scheduler_config
    watch["vllm"].wrap(core.model_executor, "execute_model", "forward")
    watch["vllm"].wrap(core.model_executor, "sample_tokens", "sampler")
    watch["vllm"].wrap(core.scheduler, "schedule", "scheduler")
    watch["vllm"].wrap(core.scheduler, "update_from_output", "scheduler")
    watch["hf"].wrap(model, "forward", "forward")  # nn.Module.__call__ looks up self.forward

    ks = sorted({0, args.top_k})
    results: dict[tuple[str, int], list[float]] = {(b, k): [] for b in gens for k in ks}
    splits: dict[tuple[str, int], list[dict[str, float]]] = {key: [] for key in results}
    for r in range(args.repeats):
        order = ["hf", "vllm"] if r % 2 == 0 else ["vllm", "hf"]
        for k in ks:
            for b in order:
                watch[b].reset()
                secs, toks = timed(gens[b], prompts, args, k, seed=r)
                results[(b, k)].append(toks / secs)
                parts = {label: s / secs for label, s in watch[b].secs.items()}
                parts["rest"] = 1.0 - sum(parts.values())
                splits[(b, k)].append(parts | {"steps": watch[b].calls["forward"], "us_per_token": 1e6 * secs / toks})

    model_vocab = model.get_output_embeddings().weight.shape[0]
    n_params = sum(x.numel() for x in model.parameters())
    print(
        f"model: hidden {args.hidden}, layers {args.layers}, heads {args.heads}, vocab {len(tok)} "
        f"(output layer {model_vocab}), {n_params / 1e6:.2f}M parameters, float32"
    )
    print(f"batch: {args.prompts} prompts x {args.n} samples x {args.max_new} new tokens, prompts 32-64 tokens")
    print(
        f"vLLM: max_num_seqs {sched_cfg.max_num_seqs}, max_num_batched_tokens {sched_cfg.max_num_batched_tokens}; "
        f"torch threads before/after the engine: {threads_before}/{torch.get_num_threads()}; "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}"
    )
    print(f"vLLM engine start-up: {startup:.1f} s; repeats: {args.repeats} (median tok/s)")
    print(f"{'backend':8} {'top-K':>6} {'tok/s':>10}   split of the wall time (median)")
    med = {key: statistics.median(v) for key, v in results.items()}
    for (b, k), v in med.items():
        sp = {label: statistics.median(s.get(label, 0.0) for s in splits[(b, k)]) for label in splits[(b, k)][0]}
        labels = ("forward", "sampler", "scheduler", "rest") if b == "vllm" else ("forward", "rest")
        text = ", ".join(f"{label} {sp.get(label, 0.0):.0%}" for label in labels)
        print(
            f"{b:8} {k:>6} {v:>10,.0f}   {text}; {sp['steps']:.0f} forward calls, {sp['us_per_token']:.0f} us per token"
        )
    # paired ratios: each round runs both backends back to back, so a load spike hits one pair
    ratios = {
        k: statistics.median(v / h for v, h in zip(results[("vllm", k)], results[("hf", k)], strict=True)) for k in ks
    }
    names = {k: "without top-K" if k == 0 else f"with top-{k} log-probs" for k in ks}
    text = ", ".join(f"{x:.2f}x {names[k]}" for k, x in ratios.items())
    verdict = "met" if min(ratios.values()) >= 3.0 else "NOT met"
    print(f"SUMMARY vLLM/HF tokens per second: {text} (target >= 3x): {verdict}")


if __name__ == "__main__":  # Ctrl-C: one line, exit 130
    run_command(PROG, main)
