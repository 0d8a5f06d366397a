"""Two-digit addition: the task a tiny model learns on two CPU cores in minutes.

    prompt "04+85="   completion "089" + eos   reward 1.0 iff the text before eos is exactly the sum

Operands are zero-padded to two digits and the sum to three, so every digit sits at a fixed position (a tiny
transformer learns this in a few hundred supervised steps; without padding it needs far more). All 10,000
pairs (a, b), 0 <= a, b <= 99, are shuffled once with a fixed seed: the last 1,000 are held out for evaluation,
the other 9,000 are for training. Characters are tokens (the tiny tokenizer is byte-level with no merges).
"""

from __future__ import annotations

import random

SPLIT_SEED = 1234
N_TEST = 1000


def problems(split: str) -> list[dict[str, str]]:
    """All problems of a split ("train" or "test"), each {question, answer, gold}."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    pairs = pairs[-N_TEST:] if split == "test" else pairs[:-N_TEST]
    return [{"question": f"{a:02d}+{b:02d}=", "answer": f"{a + b:03d}", "gold": f"{a + b:03d}"} for a, b in pairs]


def reward(completion: str, gold: str) -> float:
    """1.0 when the completion (eos already stripped) is exactly the gold sum, else 0.0."""
    return float(completion.strip() == gold)


def corpus() -> list[str]:
    """Every character the task uses, to train the tiny tokenizer on."""
    return ["0123456789+= "]
