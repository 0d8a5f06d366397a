"""GSM8K: load the data, build prompts, and score completions with a 0/1 reward.

Data (`load_gsm8k`): a list of dicts {question, answer, gold}, one per row, in file order.
    source      an existing local path: a directory holding {train,test}.jsonl, or one .jsonl file (read line by
                line here; blank lines are skipped); else a hub name ("openai/gsm8k", config "main", read with
                `datasets`; `is_hub_name`)
    answer      the full reference solution, e.g. "... 9 * 2 = $<<9*2=18>>18 every day.\\n#### 18"
    gold        the text after the last "####", stripped, commas removed: "#### 1,000" -> "1000"
    limit       keeps the first `limit` rows (only those are read and validated)
    errors      a line that is not UTF-8 or not a JSON object, a row without a question/answer string, without
                "####", or with nothing after it raises a ValueError naming the file and line (1-based), e.g.
                "data/test.jsonl line 12: answer has no '####' final-answer marker: ..."; hub rows are named
                "gsm8k test row 11 (0-based)". A local file without rows is a ValueError; a folder without
                <split>.jsonl, or a path that is neither a file nor a folder, a FileNotFoundError naming it.

Prompts (`make_prompt`): the model is asked for its final answer after "####" (GSM8K's own solution
format, and verl's GSM8K recipe); `reward` also accepts \\boxed{} and a bare last number.
    plain (base models, chat=False):
        Question: Janet has 3 apples ...
        Output the final answer after "####".
        Answer: Let's think step by step.
    chat (instruct models, chat=True): one user message, rendered by the tokenizer's own chat template
        with add_generation_prompt=True; no system message unless `system` gives one (the template may add its
        default one: SmolLM2's names itself in 15 tokens before every question; system="" gives an empty one):
        "Janet has 3 apples ... Let's think step by step and output the final answer after \\"####\\"."
        (question + " " + verl's GSM8K instruction, word for word).
        The rendered text already holds the template's special tokens: tokenize it with
        add_special_tokens=False. chat=True with a tokenizer without a chat template is a ValueError.

Answer extraction (`extract_answer`), first rule that yields something wins:
    1. "####": the first non-blank line after the LAST "####"      "#### $1,000."          -> "1000"
    2. \\boxed{...}: the contents of the LAST \\boxed{ (braces balanced; unbalanced -> skipped)
    3. the last number in the text (sign, 1,000-style commas, decimals) "... 3 + 4 = 7 eggs." -> "7"; step and
       list labels are not numbers here ("Step 12: Determine the" states no answer; "1. Mia has 5" -> "5")
    The extracted text is cleaned: $ and % (also \\$, \\%) dropped, thousands commas dropped, latex
    spaces (\\, \\! \\;) dropped, Unicode minus -> "-", a trailing "." dropped, and "<number> <words>"
    (units) cut to the number: "18 dollars per day" -> "18". Anything else (\\frac{1}{2}, x = 5) is
    returned as is for math_verify. "%" is dropped, so "25%" equals 25 (GSM8K golds give percentages as
    plain numbers). A number glued to a preceding letter or "." ("x2") is not a number in rule 3.

Equality (`reward`, 1.0 or 0.0; never substring matching, so "142" never matches gold "42"):
    gold        cleaned like an answer, so "1,000" and "$1,000" work as gold too
    fast path   both answer and gold are plain decimals: exact rational comparison
                ("42.0" == "42." == "42", "42.50" == "42.5", "-3" != "3")
    slow path   otherwise `math_verify.parse` on "\\boxed{answer}" and "\\boxed{gold}", then
                `math_verify.verify(gold, pred)` (\\frac{84}{2}, \\text{42 dollars}, x = 42 all match 42).
                Only answers of <= 64 characters without ^, **, !, \\binom, \\sum, \\prod, \\int, \\lim
                reach sympy: those can build astronomically large numbers (9^{9^{9^9}}, 10^6!) that no
                timeout reliably interrupts; such answers score 0.
    timeouts    math_verify's timeouts use SIGALRM, which only works in the main thread (elsewhere
                it raises ValueError). In the main thread we pass a 1 s timeout (this cancels any
                alarm the caller had set); in other threads we pass None (no timeout) and rely on the
                guard above. math_verify logs one warning per process when a timeout is None.
    robustness  `reward` never raises on any completion string (empty, garbage, megabytes); it is
                linear in the completion length, and math_verify's own errors count as 0.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from math_verify import parse, verify
from math_verify.errors import TimeoutException

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HUB_NAME = "openai/gsm8k"
SPLITS = ("train", "test")
PLAIN_TEMPLATE = "\n".join(
    ["Question: {question}", 'Output the final answer after "####".', "Answer: Let's think step by step."]
)
CHAT_TEMPLATE = '{question} Let\'s think step by step and output the final answer after "####".'

MAX_SLOW_CHARS = 64  # longest answer sent to math_verify / sympy
MATH_VERIFY_TIMEOUT_S = 1  # per parse / comparison, main thread only (SIGALRM takes whole seconds)

_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")  # in running text
_LABEL = re.compile(r"\b[Ss]tep\s+\d+\s*[:.)]|^[ \t]*\d+[.)][ \t]+(?=\S)", re.MULTILINE)  # "Step 3:", "3. ..."
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")  # a whole cleaned answer
_NUMBER_THEN_WORDS = re.compile(r"(-?\d+(?:\.\d+)?)\s+[^\W\d]")  # "18 dollars" -> "18"
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_NOISE = re.compile(r"\\?[$%]|\\[,!; ]")  # $ % \$ \% and latex spaces
_BRACE = re.compile(r"[{}]")
_TRAILING_NUMBER = re.compile(r"-?\d[\d,.]*$")  # a number the text ends in, its separators included
_UNSAFE = re.compile(r"\^|\*\*|!|\\binom|\\choose|\\sum|\\prod|\\int|\\lim")


# ---------------------------------------------------------------------------------------------- data


def _gold_from_answer(answer: str) -> str:
    """Text after the last "####", stripped, commas removed ("" when there is none)."""
    return answer.rsplit("####", 1)[-1].strip().replace(",", "") if "####" in answer else ""


def _check_row(row: dict[str, Any], where: str) -> dict[str, str]:
    """Validate one raw row and add `gold`; `where` names the row in error messages."""
    for field in ("question", "answer"):
        if not isinstance(row.get(field), str) or not row[field].strip():
            raise ValueError(f"{where}: missing or empty field {field!r} (got {row.get(field)!r})")
    if "####" not in row["answer"]:
        raise ValueError(f"{where}: answer has no '####' final-answer marker: {row['answer'][-80:]!r}")
    gold = _gold_from_answer(row["answer"])
    if not gold:
        raise ValueError(f"{where}: nothing after '####' in answer: {row['answer'][-80:]!r}")
    return {"question": row["question"], "answer": row["answer"], "gold": gold}


def is_hub_name(name: str) -> bool:
    """Whether `name` has the form of a hub repository id ("openai/gsm8k", "gpt2"); a path that does not exist and
    is not one (starts with / . ~, has two slashes, ...) is a missing local path, never a hub lookup."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def load_gsm8k(split: str, source: str = HUB_NAME, limit: int | None = None) -> list[dict[str, str]]:
    """Rows {question, answer, gold} of `split` from the hub or a local path (module docstring)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    path = Path(source).expanduser()
    if path.exists():
        data_file = path / f"{split}.jsonl" if path.is_dir() else path
        if path.is_dir() and not data_file.is_file():
            raise FileNotFoundError(
                f"local GSM8K folder {path} has no {split}.jsonl (it needs train.jsonl, test.jsonl)"
            )
        if not data_file.is_file():
            raise FileNotFoundError(f"GSM8K source {path} is neither a .jsonl file nor a folder holding one")
        rows = _jsonl_rows(data_file)
    elif not is_hub_name(source):
        raise FileNotFoundError(f"GSM8K source {source} does not exist (and is not a hub name like {HUB_NAME})")
    else:
        import datasets

        hub = datasets.load_dataset(source, "main", split=split)
        rows = ((row, f"gsm8k {split} row {i} (0-based)") for i, row in enumerate(hub))
    checked = [_check_row(row, where) for row, where in itertools.islice(rows, limit)]
    if not checked and limit != 0:
        raise ValueError(f"GSM8K source {source} holds no rows for split {split!r}")
    return checked


def check_held_out(train: list[dict[str, str]], test: list[dict[str, str]], source: str) -> None:
    """A ValueError when test problems are also training problems: an evaluation on them measures memory, not
    reasoning (a single .jsonl file as --data gives the same rows to both splits)."""
    seen = {r["question"].strip() for r in train}
    shared = sum(r["question"].strip() in seen for r in test)
    if shared:
        raise ValueError(
            f"--data {source}: {shared} of the {len(test)} test problems are also training problems; pass a folder "
            "whose train.jsonl and test.jsonl hold different problems"
        )


def _jsonl_rows(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """(row, "<file> line <n>") for every non-blank line of a JSONL file, read lazily; ValueError on a line that
    is not UTF-8 or not a JSON object."""
    with open(path, "rb") as f:  # bytes, decoded line by line, so a bad byte is named by its line
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            where = f"{path} line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})") from None
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg} at column {e.colno}): {line.strip()[:80]!r}") from e
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield row, where


# ------------------------------------------------------------------------------------------- prompts


def make_prompt(
    question: str,
    tokenizer: PreTrainedTokenizerBase | None = None,
    chat: bool = False,
    system: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text for one question: plain template, or the tokenizer's chat template if `chat`, with `system`
    as its system message (None: none given, so the template adds its own default if it has one).

    `template_kwargs` go to `apply_chat_template` (e.g. enable_thinking=False for Qwen3).
    """
    if not chat:
        return PLAIN_TEMPLATE.format(question=question)
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "chat=True needs a tokenizer with a chat template (tokenizer.chat_template is None); "
            "use chat=False (plain template) for base models"
        )
    messages = [{"role": "user", "content": CHAT_TEMPLATE.format(question=question)}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    kwargs = {"add_generation_prompt": True, "tokenize": False, **template_kwargs}
    return tokenizer.apply_chat_template(messages, **kwargs)


# ------------------------------------------------------------------------------------------- answers


def cut_number(text: str) -> str:
    """What a completion stopped at the token limit completed: a number it ends in may be cut ("#### 8" of 85), so
    that number is dropped and the rest is scored ("... = 85\n#### 8" reads 85 by the last-number rule)."""
    return _TRAILING_NUMBER.sub("", text)


def _clean(text: str) -> str:
    """Drop $ % latex spaces and thousands commas, a trailing period, and units after a number."""
    text = _NOISE.sub("", text.replace("\u2212", "-"))
    text = _THOUSANDS_COMMA.sub("", text).strip().rstrip(".").strip()
    number_then_words = _NUMBER_THEN_WORDS.match(text)
    return number_then_words.group(1) if number_then_words else text


def _after_hashes(completion: str) -> str | None:
    """The first non-blank line after the last "####"."""
    start = completion.rfind("####")
    if start < 0:
        return None
    rest = completion[start + 4 :].strip()
    return rest.split("\n", 1)[0] if rest else None


def _last_boxed(completion: str) -> str | None:
    """Contents of the last \\boxed{...}, or None if there is none or its braces never close."""
    start = completion.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for brace in _BRACE.finditer(completion, begin - 1):
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return completion[begin : brace.start()]
    return None


def _last_number(completion: str) -> str | None:
    """The last number in the text, e.g. "-3", "1,000", "42.5", not counting step and list labels ("Step 12:",
    a line opening "3. " or "3) "): a completion cut off after "Step 12: Determine the" states no answer."""
    numbers = _NUMBER.findall(_LABEL.sub(" ", completion))
    return numbers[-1] if numbers else None


def extract_answer(completion: str) -> str | None:
    """The cleaned final answer: after "####", else in the last \\boxed{}, else the last number."""
    for rule in (_after_hashes, _last_boxed, _last_number):
        raw = rule(completion)
        answer = _clean(raw) if raw is not None else ""
        if answer:
            return answer
    return None


def _as_fraction(text: str) -> Fraction | None:
    """Exact value of a plain decimal ("42", "-3", "42.50"), else None."""
    if not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except ValueError:  # more digits than Python's int/str conversion limit
        return None


def _math_verify_equal(answer: str, gold: str) -> bool:
    """math_verify comparison of two short, sympy-safe answers (module docstring, slow path)."""
    if len(answer) > MAX_SLOW_CHARS or _UNSAFE.search(answer) or _UNSAFE.search(gold):
        return False
    in_main = threading.current_thread() is threading.main_thread()
    timeout = MATH_VERIFY_TIMEOUT_S if in_main else None
    try:
        gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=timeout)
        pred_parsed = parse(f"\\boxed{{{answer}}}", parsing_timeout=timeout)
        return bool(gold_parsed and pred_parsed) and verify(gold_parsed, pred_parsed, timeout_seconds=timeout)
    except (Exception, TimeoutException):  # a grader bug or timeout is a wrong answer, not a crash
        return False


def reward(completion: str, gold: str) -> float:
    """1.0 if the completion's final answer equals `gold`, else 0.0 (module docstring)."""
    answer = extract_answer(completion)
    if answer is None:
        return 0.0
    gold = _clean(gold)
    answer_value, gold_value = _as_fraction(answer), _as_fraction(gold)
    if answer_value is not None and gold_value is not None:
        return float(answer_value == gold_value)
    return float(_math_verify_equal(answer, gold))
