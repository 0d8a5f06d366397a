"""The declared schemas of a run's files (troll.base.schema, troll.run.runfiles, troll.base.config): a valid file reads;
a file damaged in one field (a wrong type, null, out of range, missing) is one line naming the file, the line and the
field through the command's boundary (exit 2), never a traceback. The damage is generated (Hypothesis)."""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from troll.base.cli import run_command
from troll.base.config import Config
from troll.base.schema import SchemaError, Spec, fields_problem
from troll.run import runfiles
from troll.tools import plot

EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def step_row(step: int) -> dict:
    """A metrics.jsonl row as troll.run.diagnostics.step_row and the loss write it (the loss's metrics among them)."""
    return {
        "step": step, "reward": 0.5, "accuracy": 0.25, "response_len_mean": 3.0, "response_len_max": 4.0,
        "truncated_frac": 0.0, "lr": 0.01, "skipped": 0, "mismatch_logratio_mean": 0.0, "mismatch_kl": 0.0,
        "policy": -0.1, "frac_active": 0.125, "kl_before_max": 0.2, "kl_after_max": 0.05, "grad_norm": 1.5,
        "time_generate": 0.1, "time_score": 0.0, "time_old_policy": 0.01, "time_update": 0.2, "time_kl_update": 0.0,
        "time_sync": 0.0, "tokens_per_s": 120.0, "peak_memory_mb": 300.0,
    }  # fmt: skip


def metrics_rows() -> list[dict]:
    """A valid metrics.jsonl of two steps: the evaluation at step 0, each step's row, the evaluation at the last."""
    return [{"step": 0, "eval_acc": 0.25}, step_row(1), step_row(2), {"step": 2, "eval_acc": 0.5}]


def summary() -> dict:
    """A valid summary.json as troll.run.harness.Run.finish writes it (the warm-start record among its other fields)."""
    return {"eval_before": 0.25, "eval_after": 0.5, "eval_best": 0.5, "eval_best_step": 2, "skipped_steps": 0,
            "changes": [], "dropped_prompts": 0, "wall_clock_s": 3.5, "steps": 2, "loss": "troll", "seed": 0,
            "eval_problems": 16, "cpu_s": 6.5}  # fmt: skip


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def one_line_exit_2(capsys, main) -> str:
    """What the command said through run_command, checked to be one line and exit 2 (no traceback)."""
    with pytest.raises(SystemExit) as e:
        run_command("prog", main)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


WRONG_TYPE = st.sampled_from(["x", "", True, False, [], [1], {}, {"a": 1}])


def bad_value(spec: Spec) -> st.SearchStrategy:
    """A value `spec` refuses: another type, null (where not allowed), or out of its range."""
    bad = [WRONG_TYPE]
    if not spec.null:
        bad.append(st.none())
    if spec.kind == "integer":
        bad.append(st.floats(allow_nan=False).filter(lambda v: v != int(v) if math.isfinite(v) else True))
    if math.isfinite(spec.low):
        bad.append(st.floats(max_value=spec.low, exclude_max=True, allow_nan=False, allow_infinity=False))
    if math.isfinite(spec.high):
        bad.append(st.floats(min_value=spec.high, exclude_min=True, allow_nan=False, allow_infinity=False))
    if spec.kind == "number":
        bad.append(st.sampled_from([math.nan, math.inf, -math.inf]).filter(lambda v: not spec.accepts(v)))
    return st.one_of(bad).filter(lambda v: not spec.accepts(v))


# ----------------------------------------------------------------------------- metrics.jsonl


def test_valid_metrics_read_and_grow():
    """The writer's rows read; a metric a later version adds reads; a loss metric that went NaN reads (as written)."""
    with tempfile.TemporaryDirectory() as d:
        rows = metrics_rows()
        rows[1] |= {"kl_update_mean": 1e-3, "a_new_metric": 7, "policy": math.nan}
        write_jsonl(Path(d) / "metrics.jsonl", rows)
        read = plot.read_metrics(d)
    assert len(read) == 4 and read[1]["a_new_metric"] == 7 and math.isnan(read[1]["policy"])


@EXAMPLES
@given(data=st.data())
def test_damaged_metrics_field_is_one_line_through_plot(capsys, data):
    """One field of one row of a valid metrics.jsonl damaged: `troll plot RUN` exits 2 with one line
    naming the file, the line and the field."""
    rows = metrics_rows()
    n = data.draw(st.integers(0, len(rows) - 1), label="row")
    known = [k for k in rows[n] if k in runfiles.METRICS]
    key = data.draw(st.sampled_from([*known, "a_new_metric"]), label="field")
    spec = runfiles.METRICS.get(key, runfiles.OTHER)
    missing = key == "step" and data.draw(st.booleans(), label="missing")
    if missing:
        del rows[n]["step"]
    else:
        rows[n][key] = data.draw(bad_value(spec), label="value")
    with tempfile.TemporaryDirectory() as d:
        run = Path(d) / "run"
        run.mkdir()
        write_jsonl(run / "metrics.jsonl", rows)
        err = one_line_exit_2(capsys, lambda: plot.main([str(run), "--out", str(Path(d) / "plots")]))
        assert f"{run / 'metrics.jsonl'} line {n + 1}: {key} " in err, err
        assert ("is missing" if missing else "expected") in err and "resume" in err, err
        assert not (Path(d) / "plots").exists()


def test_metrics_schema_declares_what_the_writer_writes():
    """Every key troll.run.diagnostics.step_row writes by name has a declared spec; an eval row is step and eval_acc."""
    import inspect

    from troll.run import diagnostics

    source = inspect.getsource(diagnostics.step_row)
    written = [k for k in runfiles.METRICS if f'"{k}"' in source]
    assert len(written) >= 15 and runfiles.metrics_problem({"step": 0, "eval_acc": 1}) is None
    assert runfiles.metrics_problem({"step": 0, "eval_acc": 1.5}) == ("eval_acc", "is 1.5, expected a number in [0, 1]")


@pytest.mark.slow
def test_a_tiny_runs_files_read_and_damaged_through_plot(tmp_path, capsys):
    """The files a tiny run writes read through their schemas; its metrics.jsonl with one value turned into a string
    is one line through troll.tools.plot naming the file, the line and the field."""
    from test_train import tiny

    from troll.train import train

    cfg = tiny(tmp_path, eval_every=1)
    train(cfg)
    rows = plot.read_metrics(cfg.out)
    assert [r["step"] for r in rows if "eval_acc" in r] == [0, 1, 2]
    assert runfiles.read_summary(cfg.out, oldest=runfiles.SUMMARY_VERSION)["steps"] == 2
    path = Path(cfg.out) / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines[1] = json.dumps(json.loads(lines[1]) | {"kl_after_max": "0.1"})
    path.write_text("\n".join(lines) + "\n")
    capsys.readouterr()  # the run's own output
    err = one_line_exit_2(capsys, lambda: plot.main([cfg.out, "--out", str(tmp_path / "plots")]))
    assert f'{path} line 2: kl_after_max is "0.1", expected a number' in err, err


# ----------------------------------------------------------------------------- summary.json


def test_valid_summary_reads_each_version():
    with tempfile.TemporaryDirectory() as d:
        s = summary()
        (Path(d) / "summary.json").write_text(json.dumps(s))
        assert runfiles.read_summary(d, oldest=2) == s
        for k in ("eval_best", "eval_best_step", "changes"):  # version 1: before eval_best and changes
            del s[k]
        (Path(d) / "summary.json").write_text(json.dumps(s))
        assert runfiles.read_summary(d) == s
        with pytest.raises(SchemaError, match="eval_best is missing"):
            runfiles.read_summary(d, oldest=2)


@EXAMPLES
@given(data=st.data())
def test_damaged_summary_field_is_one_line(capsys, data):
    """One declared field of a valid summary.json damaged or removed: one line naming the file and the field, exit 2
    at the boundary, and troll.run.harness takes the run as not finished (its summary is written again)."""
    s = summary()
    key = data.draw(st.sampled_from(list(runfiles.SUMMARY)), label="field")
    missing = data.draw(st.booleans(), label="missing")
    if missing:
        del s[key]
    else:
        s[key] = data.draw(bad_value(runfiles.SUMMARY[key]), label="value")
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "summary.json").write_text(json.dumps(s))
        if missing and runfiles.SUMMARY[key].since > 2:  # a version-2 summary has no `changes`
            assert runfiles.read_summary(d, oldest=2) == s
            return
        err = one_line_exit_2(capsys, lambda: runfiles.read_summary(d, oldest=2))
    assert f"summary.json: {key} " in err or (missing and "summary.json: eval_best" in err), err
    assert runfiles.summary_problem(s, oldest=2) is not None


@pytest.mark.parametrize("text", ["", "{", "[1]", "\xff", "null"])
def test_summary_not_an_object_is_one_line(capsys, text):
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "summary.json").write_bytes(text.encode("latin-1"))
        err = one_line_exit_2(capsys, lambda: runfiles.read_summary(d))
    assert "summary.json" in err


# ----------------------------------------------------------------------------- config.json


CONFIG_DAMAGE = st.one_of(WRONG_TYPE, st.none(), st.sampled_from([-1, -1.5, math.nan, math.inf, 10**400]))


@EXAMPLES
@given(data=st.data())
def test_damaged_config_field_is_one_line(capsys, data):
    """A field of a saved config.json given a wrong type, null or a value out of range: `troll train --out
    RUN --resume true` (Config.load, with the command line's checks, troll.base.config.check) exits 2 with one line
    naming the file and the field."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        Config(out=d).save(path)
        saved = json.loads(path.read_text())
        key = data.draw(st.sampled_from(["steps", "lr", "eps", "loss", "bf16", "max_new_tokens", "eval_size", "seed",
                                         "prompts_per_step", "clip_low"]), label="field")  # fmt: skip
        value = data.draw(CONFIG_DAMAGE, label="value")
        path.write_text(json.dumps(saved | {key: value}))
        try:
            Config.load(path)
        except ValueError:
            pass
        else:  # a value the field takes (an integer seed of -1): nothing to refuse
            return
        err = one_line_exit_2(capsys, lambda: Config.from_args(["--out", d, "--resume", "true"]))
    assert str(path) in err and key in err, err


# ----------------------------------------------------------------------------- the generic checks


def test_fields_problem_unknown_and_other():
    table = {"a": Spec("integer", low=0), "b": Spec("string", required=False)}
    assert fields_problem({"a": 1}, table, 1) is None
    assert fields_problem({"a": 1, "c": 2}, table, 1, file="f.jsonl") == ("c", "is not a field of f.jsonl (version 1)")
    assert fields_problem({"a": 1, "c": 2}, table, 1, other=Spec("number")) is None
    assert fields_problem({"a": 1, "c": "x"}, table, 1, other=Spec("number")) == ("c", 'is "x", expected a number')
    assert fields_problem({"b": "x"}, table, 1) == ("a", "is missing")
    assert fields_problem({"a": -1}, table, 1) == ("a", "is -1, expected an integer >= 0")
    assert issubclass(SchemaError, ValueError)
