"""The word-problem task (troll.tasks.words): every answer against arithmetic done here from the question's own words,
the splits, and GSM8K's reward on the reference answers."""

from __future__ import annotations

import re

import pytest

from troll.tasks import gsm8k, words

QUESTION = re.compile(r"(\w+) has (\d+) (\w+)\. (?:She|He) (.+)\. How many (\w+) does (\w+) have now\?")


def _solve(question: str) -> int:
    """The count asked for, read from the question's words: an adding phrase adds, a taking-away phrase subtracts."""
    name, a, things, action, asked, again = QUESTION.fullmatch(question).groups()
    assert (things, name) == (asked, again)
    b = int(re.search(r"\d+", action).group())
    adds = [p.format(b=b) for p in words.ADD]
    subs = [p.format(b=b) for p in words.SUB]
    assert action in adds + subs, action
    return int(a) + b if action in adds else int(a) - b


def test_every_answer_and_gold_is_the_arithmetic_the_question_asks_for():
    for split in ("train", "test"):
        for row in words.problems(split):
            c = _solve(row["question"])
            assert c >= 1 and row["gold"] == str(c)
            assert row["answer"].endswith(f"= {c}\n#### {c}")
            assert gsm8k.reward(row["answer"], row["gold"]) == 1.0
            assert gsm8k.reward(row["answer"].replace(f"#### {c}", f"#### {c + 1}"), row["gold"]) == 0.0


def test_the_splits_are_disjoint_cover_every_case_and_are_fixed():
    train, test = words.problems("train"), words.problems("test")
    assert len(test) == words.N_TEST
    cases = {QUESTION.fullmatch(r["question"]).group(2, 4) for r in train + test}  # (a, the action with b)
    n_add = len(words.ADD) * 90 * 90  # 10 <= a, b <= 99
    n_sub = len(words.SUB) * 90 * 89 // 2  # a > b
    assert len(train) + len(test) == len(cases) == n_add + n_sub
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert words.problems("test") == test  # a pure function of the split
    with pytest.raises(ValueError, match="split"):
        words.problems("validation")


def test_the_prompt_is_gsm8ks():
    row = words.problems("test")[0]
    assert gsm8k.make_prompt(row["question"]).startswith(f"Question: {row['question']}\n")
