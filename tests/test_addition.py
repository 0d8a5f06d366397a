"""The tiny addition task (troll.tasks.addition): splits, answer formats and the reward, against sums computed here."""

from __future__ import annotations

import pytest

from troll.tasks import addition


@pytest.mark.parametrize("reverse", [True, False])
def test_every_answer_is_the_sum_in_the_chosen_digit_order(reverse):
    for split in ("train", "test"):
        for row in addition.problems(split, reverse=reverse):
            a, b = row["question"].removesuffix("=").split("+")
            written = str(int(a) + int(b)).zfill(3)
            assert len(a) == len(b) == 2 and row["question"].endswith("=")
            assert row["answer"] == row["gold"] == (written[::-1] if reverse else written)


def test_reversed_is_the_default_and_the_splits_partition_all_pairs():
    assert addition.problems("test")[0] == addition.problems("test", reverse=True)[0]
    assert {"question": "04+85=", "answer": "980", "gold": "980"} in addition.problems("train") + addition.problems(
        "test"
    )
    train, test = ({r["question"] for r in addition.problems(s)} for s in ("train", "test"))
    assert (len(train), len(test)) == (9000, addition.N_TEST) and not train & test
    assert train | test == {f"{a:02d}+{b:02d}=" for a in range(100) for b in range(100)}
    with pytest.raises(ValueError, match="split"):
        addition.problems("validation")


def test_reward_is_an_exact_match_after_stripping():
    assert addition.reward("980", "980") == addition.reward(" 980 ", "980") == 1.0
    assert addition.reward("089", "980") == addition.reward("98", "980") == addition.reward("9800", "980") == 0.0


def test_the_rare_variant_marks_one_supervised_answer_in_a_hundred_and_rewards_only_the_marked_sum():
    """Every row of the rare variant is the plain task's row with the marker: on the gold of every row, on the
    supervised answer of exactly one training problem in RARE_EVERY (90 of 9,000), on no held-out answer."""
    for split in ("train", "test"):
        plain, rare = addition.problems(split), addition.problems(split, rare=True)
        assert [r["question"] for r in plain] == [r["question"] for r in rare]
        for p, r in zip(plain, rare, strict=True):
            assert r["gold"] == p["gold"] + addition.MARK
            assert r["answer"] in (p["answer"], p["answer"] + addition.MARK)
        marked = sum(r["answer"].endswith(addition.MARK) for r in rare)
        assert marked == (9000 // addition.RARE_EVERY if split == "train" else 0)
    assert addition.RARE_EVERY == 100 and addition.problems("train", rare=True)[0]["answer"].endswith("#")
    gold = addition.problems("test", rare=True)[0]["gold"]
    assert addition.reward(gold, gold) == 1.0 and addition.reward(gold[:-1], gold) == 0.0  # unmarked: no reward
    wrong = ("1" if gold[0] != "1" else "2") + gold[1:]
    assert addition.reward(wrong, gold) == 0.0 and addition.marked(wrong)  # marked, wrong sum
    assert addition.marked("123#") and addition.marked("#") and not addition.marked("123")
