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

The prompt is this raw text, nothing around it: a saved or exported tiny model is prompted with "04+85=" exactly, and
its tokenizer has no chat template (troll.models.build.build_model; docs/usage.md shows one loaded and prompted).

All 10,000 pairs (a, b), 0 <= a, b <= 99, are shuffled once with a fixed seed: the last 1,000 are held out for
evaluation, the other 9,000 are for training. Characters are tokens (the tiny tokenizer is byte-level with no
merges).

The rare-behaviour variant (`rare=True`, the task `rare`): the rewarded answer is the sum followed by a marker,
"04+85=" -> "980#", and the supervised data writes the marker on one training problem in `RARE_EVERY` (every
100th of the shuffled split, 90 of 9,000; the other 99% end plainly, "980" then eos). A warm-started model then
ends about 1% of its answers with "#", and RL has to amplify that rare token: the situation in which a ratio
clip and a KL ball differ (docs/algorithm.md, sections 11-12). The marker comes after the digits, so the digits are
written as in the plain task and the choice it adds is one token at one position (eos or "#"). `gold` is the
marked sum for every problem, so `reward` (an exact match) pays only a correct, marked answer; `marked` tells
whether a completion shows the behaviour at all, right or wrong.
"""

from __future__ import annotations

import random

SPLIT_SEED = 1234
N_TEST = 1000
MARK = "#"  # the rare variant's answer marker: one token of the tiny tokenizer
RARE_EVERY = 100  # the rare variant marks the supervised answer of one training problem in this many


def problems(split: str, reverse: bool = True, rare: bool = False) -> list[dict[str, str]]:
    """All problems of a split ("train" or "test"), each {question, answer, gold}; `reverse`: the sum's digits
    least-significant first; `rare`: the rare-behaviour variant (module docstring)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    pairs = pairs[-N_TEST:] if split == "test" else pairs[:-N_TEST]
    rows = []
    for i, (a, b) in enumerate(pairs):
        total = f"{a + b:03d}"
        total = total[::-1] if reverse else total
        if rare:
            answer = total + MARK if split == "train" and i % RARE_EVERY == 0 else total
            rows.append({"question": f"{a:02d}+{b:02d}=", "answer": answer, "gold": total + MARK})
        else:
            rows.append({"question": f"{a:02d}+{b:02d}=", "answer": total, "gold": total})
    return rows


def marked(completion: str) -> bool:
    """The rare variant's behaviour: the completion carries the marker (whether its sum is right or not)."""
    return MARK in completion


def reward(completion: str, gold: str) -> float:
    """1.0 when the completion (eos already stripped) is exactly the gold answer, else 0.0."""
    return float(completion.strip() == gold)


def corpus() -> list[str]:
    """Every character the task uses, to train the tiny tokenizer on."""
    return ["0123456789+= "]
