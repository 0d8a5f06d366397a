"""One way the project checks a file it reads: each file's fields declared in a table of `Spec`s, each row checked
against it when read, a mismatch one line naming the file, the line (for JSONL) and the field, with the way forward.

A table maps a field's name to its `Spec`: its kind (KINDS: JSON's values, exactly), whether null is allowed, its
range or choices, whether it is a list of such values (one per token, in tokens.jsonl), whether a row must hold it,
and the versions of the file that have it. `fields_problem` finds the first field of one JSON object that is
missing, not as declared or unknown (a table may instead declare what any other field holds, `other`, for files
that gain fields over versions, as metrics.jsonl does). `first_problem` tries each version of a file, newest first,
and says what the newest one wants when none has the row. `SchemaError` is the one line: a UsageError (a command's
`run_command` prints it, exit 2) and a ValueError (what the readers raised for a damaged file before).

`read_jsonl_checked` and `read_json_checked` read a file and check it. The tables live beside their files' writers
or readers: tokens.jsonl in troll.run.records, metrics.jsonl and summary.json in troll.run.runfiles, the studies'
results rows in study.runner. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from troll.base.cli import UsageError

Table = Mapping[str, "Spec"]
Problem = tuple[str, str]  # (the field's path, e.g. "samples[0].kl[3]", what is wrong with it)

KINDS: dict[str, Callable[[Any], bool]] = {  # JSON's values: exactly int, float, str, bool, list, dict or None
    "integer": lambda v: type(v) is int,  # not a bool, not 1.0
    "number": lambda v: type(v) in (int, float) and abs(v) <= sys.float_info.max,  # not NaN, inf or 10**400
    "float": lambda v: type(v) in (int, float),  # NaN and infinities too, as json.dumps writes a float that is one
    "string": lambda v: type(v) is str,
    "flag": lambda v: type(v) is int and v in (0, 1),
    "boolean": lambda v: type(v) is bool,
    "list": lambda v: type(v) is list,
    "object": lambda v: type(v) is dict,
}
WORDS = {"integer": "an integer", "number": "a number", "float": "a number (NaN or infinity allowed)",
         "string": "a string", "flag": "0 or 1", "boolean": "true or false", "list": "a list",
         "object": "an object"}  # fmt: skip


class SchemaError(UsageError, ValueError):
    """A file that is not as its table declares: one line naming the file, the line, the field and the way forward.
    A UsageError for the commands' boundary, a ValueError for the readers that caught one for a damaged file."""


@dataclass(frozen=True)
class Spec:
    """What one field holds: its kind (KINDS), whether null is allowed, its range or choices, whether it is a list
    with one such value per token (tokens.jsonl; or per what `per` says: a study's rows), whether a row must hold
    it, the versions of the file that have it (since, until), and what it is in words where the kind's own words
    (WORDS) say too little ("a list of samples")."""

    kind: str
    null: bool = False
    low: float = -math.inf
    high: float = math.inf
    choices: tuple[str, ...] = ()
    per_token: bool = False  # a list with one value per token: its reader checks the lengths
    per: str = "token"  # what a per_token list has one value for, in words (a study's rows: "step", "context")
    since: int = 1
    until: int | None = None  # the last version of the file that has it (None: every version from `since` on)
    required: bool = True
    words: str = ""

    def accepts(self, v: Any) -> bool:
        """Whether `v` is one value of the field (one element of a per-token field)."""
        if v is None or not KINDS[self.kind](v):
            return v is None and self.null
        if self.kind in ("integer", "number", "float") and not (self.low <= v <= self.high or v != v):  # NaN: kind's
            return False
        return not self.choices or v in self.choices

    def wants(self) -> str:
        """What one value must be, in words: "a number in [0, 1] or null"."""
        words = "one of " + ", ".join(map(json.dumps, self.choices)) if self.choices else self.words or WORDS[self.kind]
        if math.isfinite(self.low) and math.isfinite(self.high):
            words += f" in [{bound(self.low)}, {bound(self.high)}]"
        elif math.isfinite(self.low):
            words += f" >= {bound(self.low)}"
        elif math.isfinite(self.high):
            words += f" <= {bound(self.high)}"
        return words + " or null" * self.null


def bound(x: float) -> str:
    """A range's end in words: an integer whole (2**53 - 1 as 9007199254740991), a float shortest (0.05)."""
    return str(x) if type(x) is int else f"{x:g}"


def fields_problem(obj: dict, table: Table, version: int, prefix: str = "", file: str = "the file",
                   other: Spec | None = None) -> Problem | None:  # fmt: skip
    """The first field of one JSON object (a row, a sample) that is missing (where required), not as `table`
    declares for version `version` of the file, or unknown: refused naming `file`, or, with `other`, checked as it."""
    fields = {k: spec for k, spec in table.items() if spec.since <= version <= (spec.until or version)}
    for k, spec in fields.items():
        where, value = prefix + k, obj.get(k)
        if k not in obj:
            if spec.required:
                return where, "is missing"
            continue
        if spec.per_token and type(value) is not list:
            return where, f"is {shown(value)}, expected a list with one value per {spec.per}, each {spec.wants()}"
        values = enumerate(value) if spec.per_token else [(None, value)]
        for t, v in values:
            if not spec.accepts(v):
                return where + ("" if t is None else f"[{t}]"), f"is {shown(v)}, expected {spec.wants()}"
    for k in obj:
        if k in fields:
            continue
        if other is None:
            return prefix + k, f"is not a field of {file} (version {version})"
        if not other.accepts(obj[k]):
            return prefix + k, f"is {shown(obj[k])}, expected {other.wants()}"
    return None


def first_problem(problem: Callable[[int], Problem | None], newest: int, oldest: int = 1) -> Problem | None:
    """None when some version from `newest` down to `oldest` of a file has the row (`problem(version)` is None);
    otherwise what the newest version says is wrong with it. An older version is asked only when a newer one refuses
    the row."""
    first = problem(newest)
    if first is None or any(problem(v) is None for v in range(newest - 1, oldest - 1, -1)):
        return None
    return first


def shown(v: Any) -> str:
    """A value as JSON, cut to 40 characters."""
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def jsonl_lines(path: Path) -> list[int]:
    """The 1-based numbers of the non-blank lines of a JSONL file: the lines read_jsonl's rows are on, in order (a
    torn last line it skips is last, so zip stops before it)."""
    return [n for n, raw in enumerate(path.read_bytes().split(b"\n"), start=1) if raw.strip()]


def read_jsonl_checked(path: Path, problem: Callable[[dict], Problem | None], forward: str,
                       torn_tail: bool = True) -> list[dict]:  # fmt: skip
    """The rows of a JSONL file (troll.base.checkpoint.read_jsonl: a torn last line skipped with a warning), each
    checked by `problem` (a row -> its first Problem or None); the first row that is not as declared is a SchemaError
    naming the file, its line and the field, then `forward` (the way forward). A line that is not a JSON object stays
    read_jsonl's ValueError, which names the file and the line."""
    from troll.base.checkpoint import read_jsonl

    rows = read_jsonl(path, torn_tail=torn_tail)
    for n, row in zip(jsonl_lines(path), rows, strict=False):
        if found := problem(row):
            where, what = found
            raise SchemaError(f"{path} line {n}: {where} {what}: {forward}")
    return rows


def read_json_checked(path: Path, problem: Callable[[dict], Problem | None], forward: str) -> dict:
    """The JSON object in file `path`, checked by `problem`; a file that is not UTF-8 JSON, not an object, or not
    as declared is a SchemaError naming the file (and the field), then `forward`."""
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SchemaError(f"{path} is not UTF-8 (byte at {e.start + 1}): {forward}") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise SchemaError(f"{path} is not valid JSON ({e.msg} at {where}): {forward}") from None
    if type(obj) is not dict:
        raise SchemaError(f"{path} holds {shown(obj)}, expected a JSON object: {forward}")
    if found := problem(obj):
        where, what = found
        raise SchemaError(f"{path}: {where} {what}: {forward}")
    return obj

