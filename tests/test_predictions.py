"""troll.tools.predictions: the order of an evaluation's calls, its completions from any point it resumes at, and the
files it continues from, read through their schema."""

from __future__ import annotations

import json
import random

import pytest

from troll.base.schema import SchemaError
from troll.tasks.task import stopped
from troll.tools.predictions import calls, completions, read_done


class NumberedBackend:
    """A stand-in backend: sample j of prompt p in a call seeded s is [p[0], s, j]; its greedy completion of p is
    [p[0], -1].
    It records every call: ("greedy", problems' first ids) or ("sample", first ids, n, seed)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def greedy(self, prompts, max_new_tokens):
        self.calls.append(("greedy", [p[0] for p in prompts]))
        return [[p[0], -1] for p in prompts]

    def sample(self, prompts, n, max_new_tokens, temperature, seed=None):
        self.calls.append(("sample", [p[0] for p in prompts], n, seed))
        return [[p[0], seed, j] for p in prompts for j in range(n)]


def test_calls_take_whole_problems_and_split_only_a_problem_too_big_for_one():
    assert list(calls(range(0, 5), 2, 4)) == [(range(0, 2), 2), (range(2, 4), 2), (range(4, 5), 2)]
    assert list(calls(range(3, 5), 0, 4)) == [(range(3, 5), 0)]  # greedy only: the block at once
    assert list(calls(range(0, 2), 5, 2)) == [(range(0, 1), 2), (range(0, 1), 2), (range(0, 1), 1),
                                             (range(1, 2), 2), (range(1, 2), 2), (range(1, 2), 1)]  # fmt: skip
    absurd = calls(range(0, 4), 10**12, 3)  # made one at a time: nothing is built for a count that cannot run
    assert next(absurd) == (range(0, 1), 3)


@pytest.mark.parametrize("n, block, per_call", [(2, 4, 4), (3, 2, 2), (0, 3, 8), (5, 4, 16)])
def test_completions_from_any_start_are_the_tail_of_the_whole(n, block, per_call):
    """Each problem's greedy completion and n samples, in order; call c seeded with the c-th draw of Random(seed);
    from any `start`, the same items as the whole evaluation's from there, with the calls before the start's block
    not made."""
    prompts = [[100 + i] for i in range(7)]
    backend = NumberedBackend()
    calls_made = list(completions(backend, prompts, n, 4, 1.0, 11, block, per_call))
    whole = [item for finished in calls_made for item in finished]
    assert all(calls_made)  # a call that finished no problem yields nothing
    assert [i for i, _, _ in whole] == list(range(7))
    assert all(g == [100 + i, -1] and len(s) == n and all(x[0] == 100 + i for x in s) for i, g, s in whole)
    draws = random.Random(11)
    seeds = [call[3] for call in backend.calls if call[0] == "sample"]
    assert seeds == [draws.randrange(2**63) for _ in seeds] and len(set(seeds)) == len(seeds)
    for start in range(8):
        again = NumberedBackend()
        tail = completions(again, prompts, n, 4, 1.0, 11, block, per_call, start=start)
        assert [item for finished in tail for item in finished] == whole[start:]
        made = {i for call in again.calls for i in call[1]}  # the problems any call touched
        assert all(100 + i in made for i in range(start, 7)) and all(i - 100 >= start // block * block for i in made)


def test_a_finished_completion_ends_in_eos_or_before_the_limit():
    assert stopped([[5, 2], [5, 6, 7], [5, 6, 2], [], [5]], 3, [2]) == [True, False, True, True, True]


# ----------------------------------------------------------------------------------------- continuing


SETTINGS = {"model": "m", "samples": 1}
ROWS = [{"question": f"q{i}", "gold": str(i)} for i in range(3)]


def line(i: int, **over) -> dict:
    sample = {"completion": f"#### {i}", "extracted": str(i), "reward": 1.0, "cut": False}
    return {"question": f"q{i}", "gold": str(i), "completion": "x", "reward": 0.0, "extracted": None, "cut": True,
            "samples": [sample]} | over  # fmt: skip


def folder(tmp_path, rows: list, settings: dict = SETTINGS):
    (tmp_path / "evaluation.json").write_text(json.dumps({"settings": settings}))
    (tmp_path / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_the_lines_of_the_same_settings_are_continued_and_other_settings_start_over(tmp_path):
    assert read_done(folder(tmp_path, [line(0), line(1)]), SETTINGS, ROWS) == [line(0), line(1)]
    assert read_done(tmp_path, SETTINGS | {"samples": 2}, ROWS) is None
    (tmp_path / "evaluation.json").unlink()
    assert read_done(tmp_path, SETTINGS, ROWS) is None


@pytest.mark.parametrize(
    "rows, words",
    [
        ([line(0, reward=2.0)], ["line 1", "reward is 2.0", "in [0, 1]"]),
        ([line(0), line(1, cut="no")], ["line 2", 'cut is "no"', "true or false"]),
        ([line(0, samples=[])], ["line 1", "samples holds 0 samples, expected 1"]),
        ([line(0, samples=[{"completion": "a", "extracted": None, "reward": 0.0}])], ["samples[0].cut is missing"]),
        ([line(0, samples=[3])], ["samples[0] is not an object"]),
        ([line(0, more=1)], ["more is not a field of predictions.jsonl"]),
        ([line(1)], ["line 1 is not problem 1"]),
        ([line(0), line(1), line(2), line(3)], ["holds 4 problems, more than the 3"]),
    ],
)
def test_a_damaged_line_is_one_line_naming_the_file_the_line_and_the_field(tmp_path, rows, words):
    with pytest.raises(ValueError) as e:
        read_done(folder(tmp_path, rows), SETTINGS, ROWS)
    message = str(e.value)
    assert "\n" not in message and "predictions.jsonl" in message and "starts again from its first problem" in message
    assert all(w in message for w in words), message


def test_a_damaged_settings_file_is_a_schema_error(tmp_path):
    folder(tmp_path, [line(0)])
    (tmp_path / "evaluation.json").write_text("[1]")
    with pytest.raises(SchemaError, match="evaluation.json holds \\[1\\], expected a JSON object"):
        read_done(tmp_path, SETTINGS, ROWS)
