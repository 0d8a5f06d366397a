"""Arithmetic word problems in natural language with GSM8K's answer format: the task a real LM learns on a CPU.

    question  "Mia has 47 marbles. She gets 38 more. How many marbles does Mia have now?"
    answer    "47 + 38 = 85\\n#### 85"           gold "85"
    reward    troll.tasks.gsm8k.reward: the number after the last "####" (else the last number) equals the gold

Why this task: GSM8K itself gives a 135M model no signal (SmolLM2-135M-Instruct solves none of the first 32 test
problems zero-shot, and a reward of 0 for every sample leaves every group without an advantage), while two-digit
arithmetic asked in words is within its reach after a short supervised warm-start, and a step stays short: the
answer is one line of about a dozen tokens. It is asked exactly as GSM8K is (troll.tasks.gsm8k.make_prompt: the question
and "Let's think step by step and output the final answer after '####'", through the chat template), and scored by
GSM8K's reward, so what RL teaches here (the arithmetic and the "####" line) is what GSM8K's scoring reads, and
GSM8K accuracy is measured before and after on the same prompts.

Problems: every (template, a, b) with two-digit operands, 10 <= a, b <= 99; subtraction only where a > b (no
negative counts). Templates differ in who, what and how (adding: gets, buys, finds; taking away: gives away, eats,
loses). All problems are shuffled once with a fixed seed (`SPLIT_SEED`); the last `N_TEST` are held out, the rest
are for training, so no held-out problem is a training problem. Names and objects are drawn per problem from
seeded lists, so a question's wording is a pure function of its index.
"""

from __future__ import annotations

import random

SPLIT_SEED = 4321
N_TEST = 1000
NAMES = ("Mia", "Liam", "Ava", "Noah", "Emma", "Omar", "Sofia", "Ben", "Lena", "Kai", "Zoe", "Ravi")
PRONOUNS = {"Mia": "She", "Ava": "She", "Emma": "She", "Sofia": "She", "Lena": "She", "Zoe": "She"}
THINGS = ("marbles", "apples", "stickers", "books", "coins", "shells", "cards", "pencils", "stamps", "cookies")
ADD = ("gets {b} more", "buys {b} more", "finds {b} more", "is given {b} more")
SUB = ("gives away {b}", "loses {b}", "sells {b}", "uses {b}")


def _question(i: int, a: int, b: int, add: bool, verb: int) -> str:
    """The problem's text: who and what are drawn from a generator seeded by the problem's index."""
    rng = random.Random(SPLIT_SEED * 7919 + i)
    name, things = rng.choice(NAMES), rng.choice(THINGS)
    pronoun = PRONOUNS.get(name, "He")
    action = (ADD if add else SUB)[verb].format(b=b)
    return f"{name} has {a} {things}. {pronoun} {action}. How many {things} does {name} have now?"


def problems(split: str) -> list[dict[str, str]]:
    """All problems of a split ("train" or "test"), each {question, answer, gold} (module docstring)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    cases = [(a, b, add, verb) for add in (True, False) for verb in range(4) for a in range(10, 100)
             for b in range(10, 100) if add or a > b]  # fmt: skip
    random.Random(SPLIT_SEED).shuffle(cases)
    cases = cases[-N_TEST:] if split == "test" else cases[:-N_TEST]
    rows = []
    for i, (a, b, add, verb) in enumerate(cases):
        c = a + b if add else a - b
        rows.append({
            "question": _question(i if split == "train" else -1 - i, a, b, add, verb),
            "answer": f"{a} {'+' if add else '-'} {b} = {c}\n#### {c}",
            "gold": str(c),
        })  # fmt: skip
    return rows
