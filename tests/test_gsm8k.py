"""GSM8K task: loading, prompts, answer extraction and the 0/1 reward (troll/tasks/gsm8k.py)."""

from __future__ import annotations

import hashlib
import json
import random
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import datasets
import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from troll.tasks.gsm8k import extract_answer, is_hub_name, load_gsm8k, make_prompt, reward

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _raw_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _tiny_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")), unk_token="<unk>"
    )
    tok.chat_template = chat_template
    return tok


# -------------------------------------------------------------------------------------- reward on data


def test_reward_scores_every_gold_solution_and_rejects_changed_answers(
    gsm8k_dir: Path, gsm8k_rows: dict[str, int]
) -> None:
    rows = _raw_rows(gsm8k_dir / "test.jsonl")
    assert len(rows) == gsm8k_rows["test"]
    wrong_accepted, right_rejected = [], []
    for i, row in enumerate(rows):
        body, final = row["answer"].rsplit("####", 1)
        gold = final.strip().replace(",", "")
        if reward(row["answer"], gold) != 1.0 or reward(row["answer"], final.strip()) != 1.0:
            right_rejected.append(i)
        changed = f"{body}#### {int(gold) + 1}"
        if reward(changed, gold) != 0.0:
            wrong_accepted.append(i)
    assert right_rejected == [] and wrong_accepted == []


# ---------------------------------------------------------------------------------- extraction table

# (completion, gold, extracted answer, reward)
CASES = [
    ("#### 42", "42", "42", 1.0),
    ("so she has 6 + 36 = 42 apples.\n#### 42", "42", "42", 1.0),
    ("\\boxed{42}", "42", "42", 1.0),
    ("The answer is $1,000.", "1000", "1000", 1.0),
    ("The answer is $1,000.", "1,000", "1000", 1.0),
    ("The answer is 42.0", "42", "42.0", 1.0),
    ("#### 42.50", "42.5", "42.50", 1.0),
    ("It costs $42.", "42", "42", 1.0),
    ("The change is -3", "-3", "-3", 1.0),
    ("The change is -3", "3", "-3", 0.0),
    ("#### \u22123", "-3", "-3", 1.0),
    ("10-3", "3", "3", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\frac{84}{2}}", "42", "\\frac{84}{2}", 1.0),
    ("\\boxed{42 \\text{ dollars}}", "42", "42 \\text{ dollars}", 1.0),
    ("\\boxed{\\$42}", "42", "42", 1.0),
    ("\\boxed{1{,}000}", "1000", "1{,}000", 1.0),
    ("\\boxed{x = 42}", "42", "x = 42", 1.0),
    ("#### 25%", "25", "25", 1.0),
    ("#### 18 dollars per day.", "18", "18", 1.0),
    ("142", "42", "142", 0.0),
    ("#### 142", "42", "142", 0.0),
    ("\\boxed{1420}", "42", "1420", 0.0),
    ("First 12, then 30, finally 42", "42", "42", 1.0),
    ("First 42, then 30, finally 12", "42", "12", 0.0),
    ("#### 42\nQuestion: another one\n#### 7", "42", "7", 0.0),  # the last "####" wins
    ("\\boxed{7} ... so the final answer is \\boxed{42}", "42", "42", 1.0),
    ("#### 42 and later \\boxed{7} and 9", "42", "42", 1.0),  # "####" before \boxed before numbers
    ("\\boxed{42} then 7", "42", "42", 1.0),
    ("####\n\n42", "42", "42", 1.0),
    ("#### $", "42", None, 0.0),
    ("\\boxed{42", "42", "42", 1.0),  # unclosed box: falls through to the last number
    ("no number here", "42", None, 0.0),
    ("", "42", None, 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", "42", "9^{9^{9^{9}}}", 0.0),  # never reaches sympy
    # from SmolLM2-135M-Instruct's GSM8K answers, read by hand (docs/results.md): a completion cut off after a step
    # or list label states no answer, and the label is not one
    ("Step 11: Determine the hours per month.\n\nStep 12: Determine the number", "12", None, 0.0),
    ("the chickens are fed 25 meals per day.\n\nStep 5: Determine the number", "5", "25", 0.0),
    ("1. Mia buys 12 apples.\n2. She buys", "2", "12", 0.0),
    ("1) 4 * 2 = 8\n2) So the answer is 8.", "8", "8", 1.0),
    ("The answer is\n12.", "12", "12", 1.0),  # a number alone on its last line is an answer, not a label
    ("he traveled 20 + 15 = 35 miles.\n\n#### 35\n#### 35\n#### 35\n#### 3", "35", "3", 0.0),  # cut off: the last line
    ("So, 150 pieces of wire were used.\n\nThe answer is 150.\n\nThe answer is 150.", "150", "150", 1.0),  # restated
]


@pytest.mark.parametrize(("completion", "gold", "extracted", "expected"), CASES)
def test_extraction_table(completion: str, gold: str, extracted: str | None, expected: float) -> None:
    assert extract_answer(completion) == extracted
    assert reward(completion, gold) == expected


# -------------------------------------------------------------------------------------- robustness


def test_reward_never_raises_on_random_text() -> None:
    rng = random.Random(0)
    alphabet = list("0123456789 -,.$%{}^!=/\\\nxab") + ["####", "\\boxed{", "\\frac{", "\\text{", "}"]
    for _ in range(500):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 60)))
        assert reward(text, "42") in (0.0, 1.0)


@pytest.mark.parametrize(
    "completion",
    ["9" * 1_000_000, "\\boxed{" * 100_000, "1 a " * 250_000, "#### " + "x" * 1_000_000, "{" * 500_000 + "}"],
)
def test_reward_is_fast_on_huge_completions(completion: str) -> None:
    start = time.perf_counter()
    assert reward(completion, "42") == 0.0
    assert time.perf_counter() - start < 2.0


def test_reward_works_outside_the_main_thread() -> None:
    """math_verify's SIGALRM timeout cannot run off the main thread; reward must still work there."""
    completions = ["\\boxed{\\frac{84}{2}}", "\\boxed{x = 42}", "\\boxed{9^{9^{9^{9}}}}", "#### 42", "7"]
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(reward, completions, ["42"] * 5)) == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert threading.current_thread() is threading.main_thread()
    assert reward("\\boxed{\\frac{84}{2}}", "42") == 1.0  # and in the main thread, with a timeout


# -------------------------------------------------------------------------------------------- loading


def test_load_local_splits(gsm8k_dir: Path, gsm8k_rows: dict[str, int]) -> None:
    for split, count in gsm8k_rows.items():
        rows = load_gsm8k(split, source=str(gsm8k_dir))
        assert len(rows) == count
        assert all(set(row) == {"question", "answer", "gold"} for row in rows)
        assert all(re.fullmatch(r"-?\d+", row["gold"]) for row in rows)
    first = load_gsm8k("test", source=str(gsm8k_dir), limit=1)[0]
    assert first["question"].startswith("Janet\u2019s ducks lay 16 eggs") and first["gold"] == "18"


def test_committed_sample_is_the_head_of_gsm8k(gsm8k_dir: Path) -> None:
    """tests/data/gsm8k holds the first lines of each split, unchanged: the hashes its README lists, and (with a
    full copy in $TROLL_GSM8K_DIR) the same bytes as that copy's first lines."""
    sample = Path(__file__).resolve().parent / "data" / "gsm8k"
    listed = dict(re.findall(r"([0-9a-f]{64})  (\w+\.jsonl)", (sample / "README.md").read_text()))
    assert sorted(listed.values()) == ["test.jsonl", "train.jsonl"]
    for digest, name in listed.items():
        data = (sample / name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == digest, f"{name} differs from the sample its README describes"
        if gsm8k_dir != sample:
            assert (gsm8k_dir / name).read_bytes()[: len(data)] == data, f"{name} is not the head of {gsm8k_dir}"


def test_load_limit_and_arguments(gsm8k_dir: Path, gsm8k_rows: dict[str, int]) -> None:
    assert [r["gold"] for r in load_gsm8k("test", str(gsm8k_dir), limit=3)] == ["18", "3", "70000"]
    assert load_gsm8k("test", str(gsm8k_dir), limit=0) == []
    assert len(load_gsm8k("test", str(gsm8k_dir), limit=10**6)) == gsm8k_rows["test"]
    with pytest.raises(ValueError, match="limit"):
        load_gsm8k("test", str(gsm8k_dir), limit=-1)
    with pytest.raises(ValueError, match="split"):
        load_gsm8k("validation", str(gsm8k_dir))


def test_load_single_file_and_gold_commas(tmp_path: Path) -> None:
    rows = [{"question": "How many?", "answer": "Lots.\n#### 1,000", "id": 7}]
    data_file = _write_jsonl(tmp_path / "mine.jsonl", rows)
    assert load_gsm8k("test", str(data_file)) == [
        {"question": "How many?", "answer": "Lots.\n#### 1,000", "gold": "1000"}
    ]
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        load_gsm8k("train", str(tmp_path))


def test_load_from_hub_name_calls_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    """A source that is not an existing path is a hub name (no download here: load_dataset is faked)."""
    calls = []

    def fake_load_dataset(*args: object, **kwargs: object) -> datasets.Dataset:
        calls.append((args, kwargs))
        return datasets.Dataset.from_list([GOOD, GOOD])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert [row["gold"] for row in load_gsm8k("train", limit=1)] == ["42"]
    assert calls == [(("openai/gsm8k", "main"), {"split": "train"})]


GOOD = {"question": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42"}


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"question": "What is 6 * 7?"}, r"line 3: missing or empty field 'answer'"),
        ({"answer": "#### 42"}, r"line 3: missing or empty field 'question'"),
        ({"question": "", "answer": "#### 42"}, r"line 3: missing or empty field 'question'"),
        ({"question": 7, "answer": "#### 42"}, r"line 3: missing or empty field 'question'"),
        ({"question": "What is 6 * 7?", "answer": "42"}, r"line 3: answer has no '####'"),
        ({"question": "What is 6 * 7?", "answer": "so 42\n####  "}, r"line 3: nothing after '####'"),
        ('{"question": "What is 6 * 7?", "answer": ', r"line 3: not valid JSON"),
        ("[1, 2]", r"line 3: expected a JSON object, got list"),
    ],
)
def test_load_malformed_rows_name_file_and_line(tmp_path: Path, bad: dict | str, message: str) -> None:
    """A malformed line 3 (after a blank line 2) is a ValueError naming the file and the 1-based line number."""
    bad_line = bad if isinstance(bad, str) else json.dumps(bad)
    (tmp_path / "train.jsonl").write_text(json.dumps(GOOD) + "\n\n" + bad_line + "\n" + json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match=re.escape(str(tmp_path / "train.jsonl")) + " " + message):
        load_gsm8k("train", str(tmp_path))
    assert len(load_gsm8k("train", str(tmp_path), limit=1)) == 1  # rows past the limit are not read


def test_load_non_utf8_bytes_name_file_and_line(tmp_path: Path) -> None:
    data_file = tmp_path / "test.jsonl"
    data_file.write_bytes((json.dumps(GOOD) + "\n").encode() * 2 + b'{"question": "caf\xe9?", "answer": "#### 1"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{data_file} line 3: not UTF-8 (byte 0xe9 at column 18)")):
        load_gsm8k("test", str(tmp_path))
    assert len(load_gsm8k("test", str(tmp_path), limit=2)) == 2


def test_load_empty_and_missing_local_sources(tmp_path: Path) -> None:
    (tmp_path / "test.jsonl").write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no rows for split 'test'"):
        load_gsm8k("test", str(tmp_path))
    assert load_gsm8k("test", str(tmp_path), limit=0) == []
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError, match=re.escape(f"folder {tmp_path / 'sub'} has no test.jsonl")):
        load_gsm8k("test", str(tmp_path / "sub"))
    with pytest.raises(FileNotFoundError, match="neither a .jsonl file nor a folder"):
        load_gsm8k("test", "/dev/null")
    for missing in (str(tmp_path / "nothing"), "./nothing", "data/gsm8k/test.jsonl"):  # never a hub lookup
        with pytest.raises(FileNotFoundError, match=re.escape(f"GSM8K source {missing} does not exist")):
            load_gsm8k("test", missing)


def test_hub_names_and_paths() -> None:
    assert all(map(is_hub_name, ["openai/gsm8k", "gpt2", "Qwen/Qwen2.5-0.5B-Instruct"]))
    assert not any(map(is_hub_name, ["./data", "/abs/x", "~/x", "runs/x/checkpoints", "a b", "x..y", ""]))


def test_hub_rows_are_named_by_index(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list([GOOD, {"q": 1}]))
    with pytest.raises(ValueError, match=r"gsm8k test row 1 \(0-based\): missing or empty field 'question'"):
        load_gsm8k("test")


# -------------------------------------------------------------------------------------------- prompts


def test_plain_prompt() -> None:
    prompt = make_prompt("Janet has 3 apples. How many?")
    assert prompt == (
        "Question: Janet has 3 apples. How many?\n"
        'Output the final answer after "####".\n'
        "Answer: Let's think step by step."
    )


def test_chat_prompt_uses_the_tokenizer_template() -> None:
    tok = _tiny_tokenizer(CHATML)
    prompt = make_prompt("Janet has 3 apples. How many?", tok, chat=True)
    assert prompt == (
        "<|im_start|>user\nJanet has 3 apples. How many? "
        'Let\'s think step by step and output the final answer after "####".<|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    no_think = make_prompt("Q?", tok, chat=True, enable_thinking=False)
    assert no_think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert make_prompt("Q?", tok) == make_prompt("Q?")  # chat=False ignores the tokenizer


def test_chat_prompt_with_a_system_message() -> None:
    """--system: None leaves the template's own choice (CHATML here adds none), "" and a text are given as the
    system message, before the question."""
    tok = _tiny_tokenizer(CHATML)
    plain = make_prompt("Q?", tok, chat=True)
    assert make_prompt("Q?", tok, chat=True, system=None) == plain
    assert make_prompt("Q?", tok, chat=True, system="") == "<|im_start|>system\n<|im_end|>\n" + plain
    assert make_prompt("Q?", tok, chat=True, system="Be brief.") == "<|im_start|>system\nBe brief.<|im_end|>\n" + plain


@pytest.mark.parametrize(
    ("completion", "completed", "score"),
    [
        ("47 + 38 = 85\n#### 8", "47 + 38 = 85\n#### ", 1.0),  # the "####" answer cut: the last whole number reads
        ("#### 8", "#### ", 0.0),  # a prefix of the gold is no answer
        ("The total is 1,00", "The total is ", 0.0),
        ("Mia has -8", "Mia has ", 0.0),
        ("so 85.", "so ", 0.0),  # a final "." may be a decimal point cut short
        ("#### 85 marbles", "#### 85 marbles", 1.0),  # ends in a word: nothing it ends in was cut
        ("", "", 0.0),
    ],
)
def test_a_completion_cut_at_the_limit_is_scored_by_what_it_completed(completion, completed, score) -> None:
    from troll.tasks.gsm8k import cut_number
    from troll.tasks.task import Task, rewards_of

    assert cut_number(completion) == completed
    task = Task([], [], str, reward, cut=cut_number)
    cut, whole = rewards_of(task, [completion, completion], ["85", "85"], [False, True])
    assert cut == score and whole == reward(completion, "85")
    assert rewards_of(Task([], [], str, reward), [completion], ["85"], [False]) == [reward(completion, "85")]


def test_chat_prompt_without_template_raises() -> None:
    with pytest.raises(ValueError, match="chat template"):
        make_prompt("Q?", _tiny_tokenizer(None), chat=True)
    with pytest.raises(ValueError, match="chat template"):
        make_prompt("Q?", None, chat=True)
