"""The studies' results rows read through troll.base.schema (study.runner.check_rows, each study's `FIELDS`): every
committed results file still reports, and a valid row of each with one field damaged (a string, null, 1.7, a
missing field, ...) ends the report command with exit 2 and one line naming the file, the line and the field,
never a traceback."""

import json
import math
from pathlib import Path

import pytest

from study import bandit, figures, offpolicy, offpolicy_grid, real
from troll.base.cli import run_command
from troll.base.schema import fields_problem

hypothesis = pytest.importorskip("hypothesis")  # the dev extra (pyproject.toml)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REAL_ROW = {"name": real.Run("troll", 1e-5, 0).name, "loss": "troll", "lr": 1e-5, "seed": 0, "eval_before": 0.4,
            "eval_after": 0.5, "step_s": 50.0, "model": "smollm2-135m-instruct", "config": {}}  # fmt: skip


FIGURES = "python -m study.figures"  # study.run's report: its figures


def report(prog: str, results: Path, tmp: Path) -> list[str]:
    """The argv of the report command `prog` on results file `results` (figures, if any, into `tmp`)."""
    if prog == FIGURES:
        return [str(results), "--out", str(tmp / "figures")]
    return ["--report", "--results", str(results)]


# (the command's name, its main, its table, a committed results file: None for study.real, which has none)
STUDIES = [
    (FIGURES, figures.main, figures.FIELDS, "results.jsonl"),
    (offpolicy.PROG, offpolicy.main, offpolicy_grid.FIELDS, "offpolicy.jsonl"),
    (offpolicy.PROG, offpolicy.main, offpolicy_grid.FIELDS, "rare.jsonl"),
    (offpolicy.PROG, offpolicy.main, offpolicy_grid.FIELDS, "lora.jsonl"),
    (bandit.PROG, bandit.main, bandit.FIELDS, "bandit.jsonl"),
    (real.PROG, real.main, real.FIELDS, None),
]
MISSING = object()  # the field removed from the row
DAMAGE = st.one_of(
    st.sampled_from([MISSING, "x", "", None, 1.7, -1, 0, 2, 0.5, True, [], {}, [None], ["x"], [1.7], [-1], [[0.5]],
                     math.nan, math.inf, 10**400]),  # fmt: skip
    st.text(max_size=5),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.one_of(st.none(), st.booleans(), st.floats(), st.text(max_size=2)), max_size=3),
)


def rows_of(file: str | None) -> list[dict]:
    if file is None:
        return [REAL_ROW]
    return [json.loads(line) for line in (ROOT / "study" / file).read_text().splitlines() if line.strip()]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def outcome(prog: str, main, argv: list[str], capsys) -> tuple[int, str]:
    """The exit status (0: it returned) and stderr of the command run in process as its `python -m` runs it."""
    try:
        run_command(prog, lambda: main(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


COMMITTED = [s for s in STUDIES if s[3]] + [
    (offpolicy.PROG, offpolicy.main, offpolicy_grid.FIELDS, f) for f in ("sweep.jsonl", "rare_dppo_cap.jsonl",
                                                                         "rare_earlier.jsonl")]  # fmt: skip


@pytest.mark.parametrize("prog, main, fields, file", COMMITTED, ids=[s[3] for s in COMMITTED])
def test_the_committed_results_files_still_report(prog, main, fields, file, tmp_path, capsys):
    code, err = outcome(prog, main, report(prog, ROOT / "study" / file, tmp_path), capsys)
    assert code == 0 and err == "", err


@pytest.mark.parametrize("prog, main, fields, file", STUDIES, ids=[s[3] or "real" for s in STUDIES])
def test_a_damaged_field_is_one_line_naming_the_file_the_line_and_the_field(prog, main, fields, file, tmp_path_factory,
                                                                             capsys):  # fmt: skip
    rows = rows_of(file)

    @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(i=st.integers(0, len(rows) - 1), field=st.sampled_from(sorted(fields)), value=DAMAGE)
    def damaged(i, field, value):
        spec = fields[field]
        hypothesis.assume(not (value is MISSING and not spec.required))
        hypothesis.assume(value is MISSING or fields_problem({field: value}, {field: spec}, 1) is not None)
        row = dict(rows[i])
        if value is MISSING:
            row.pop(field, None)
        else:
            row[field] = value
        tmp = tmp_path_factory.mktemp("damaged")
        results = write(tmp / "results.jsonl", [*rows[:i], row, *rows[i + 1 :]])
        code, err = outcome(prog, main, report(prog, results, tmp), capsys)
        assert code == 2, err
        assert err.count("\n") == 1 and err.startswith(f"{prog}: error: {results} line {i + 1}: "), err
        assert field in err and "Traceback" not in err, err

    damaged()
