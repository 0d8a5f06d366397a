"""Two-digit addition: the task a tiny model learns on two CPU cores in minutes.

    prompt "04+85="   completion "980" + eos   (the sum 089, least-significant digit first; reverse=False: "089")
    reward 1.0 iff the text before eos is exactly the gold answer

Operands are zero-padded to two digits and the sum to three, so every digit sits at a fixed position (a tiny
transformer learns this in a few hundred supervised steps; without padding it needs far more). The sum is
written least-significant digit first by default, the order in which a carry is computed: each digit then depends
on the two operand digits it adds and on the carry from the digit just written. Written the usual way, the first
digit depends on every operand digit, and the tiny model learns some seeds' carries and not others' (the
figures, both ways: docs/results.md#the-task-format-why-the-sum-is-written-backwards). Reversed output is the
standard fix (Lee et al., "Teaching Arithmetic to Small Transformers", 2023).

All 10,000 pairs (a, b), 0 <= a, b <= 99, are shuffled once with a fixed seed: the last 1,000 are held out for
evaluation, the other 9,000 are for training. Characters are tokens (the tiny tokenizer is byte-level with no
merges).
"""

from __future__ import annotations

import random

SPLIT_SEED = 1234
N_TEST = 1000


def problems(split: str, reverse: bool = True) -> list[dict[str, str]]:
    """All problems of a split ("train" or "test"), each {question, answer, gold}; `reverse`: the sum's digits
    least-significant first."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    pairs = pairs[-N_TEST:] if split == "test" else pairs[:-N_TEST]
    rows = []
    for a, b in pairs:
        total = f"{a + b:03d}"
        total = total[::-1] if reverse else total
        rows.append({"question": f"{a:02d}+{b:02d}=", "answer": total, "gold": total})
    return rows


def reward(completion: str, gold: str) -> float:
    """1.0 when the completion (eos already stripped) is exactly the gold answer, else 0.0."""
    return float(completion.strip() == gold)


def corpus() -> list[str]:
    """Every character the task uses, to train the tiny tokenizer on."""
    return ["0123456789+= "]
