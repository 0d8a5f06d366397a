"""troll.tools.inspect: the text summary and the self-contained page (quick, from written records), the command's
one-line refusals (subprocess), the page in headless Chromium (rendered DOM, colouring, both runs, a screenshot, no
network), and real tiny-rare runs of every loss writing records that survive a resume."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
from html import escape
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from study import inspect_figure
from troll.base.cli import UsageError, run_command
from troll.base.config import Config
from troll.run import records
from troll.tasks import addition
from troll.tools import inspect as tinspect

ROOT = Path(__file__).resolve().parents[1]


TEXTS = ["9", "8", "0", "#", "</script>"]
# token texts that can stop a page's script: a comment opener before a script tag (no token was drawn), an end tag,
# the line and paragraph separators (a newline to an older script parser)
HOSTILE = ["<!--<script>", "</script>", "\u2028", "#", "a\u2029&<!--"]


def row(step: int, loss: str, texts: list[str] = TEXTS) -> dict:
    """A records row with one rewarded completion ending in the rare `#`, projected under the KL ball and cut by
    the clip, and one tricky token text (a closing script tag)."""
    sample = {"index": 7, "adv": 2.47, "reward": 1.0, "prompt": "04+85=", "text": list(texts),
              "q": [0.5, 0.6, 0.9, 0.01, 0.2], "p_before": [0.5, 0.6, 0.9, 0.012, 0.2],
              "p": [0.52, 0.6, 0.9, 0.016, 0.2], "p_after": [0.55, 0.61, 0.9, 0.05, 0.2],
              "kl": [1e-4, 0.0, 0.0, 0.09, 0.0], "projected": [0, 0, 0, 1, 0],
              "log_ratio": [math.log(1.04), 0.0, 0.0, math.log(1.6), 0.0],
              "log_ratio_proj": [math.log(1.04), 0.0, 0.0, math.log(1.3), 0.0], "clipped": [0, 0, 0, 1, 0],
              "train_row": 485, "gold": "89#", "completion": "980#"}  # fmt: skip
    return {"step": step, "loss": loss, "eps": 0.05, "clip_low": 0.2, "clip_high": 0.2, "level": "token",
            "samples": [sample]}  # fmt: skip


def fake_run(root: Path, name: str, loss: str, steps=(5, 10), texts: list[str] = TEXTS,
             evals: dict[int, float] | None = None) -> Path:  # fmt: skip
    """A run folder holding what troll.tools.inspect reads: config.json, tokens.jsonl and (with `evals`) metrics.jsonl's
    evaluation rows."""
    out = root / name
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"task": "rare", "loss": loss, "eps": 0.05, "lr": 3e-4}))
    (out / records.FILE).write_text("".join(json.dumps(row(s, loss, texts)) + "\n" for s in steps))
    if evals is not None:
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "eval_acc": a}) + "\n"
                                                   for s, a in evals.items()))  # fmt: skip
    return out


def loaded(run: Path) -> tuple[str, dict, list[dict], dict[int, float]]:
    """A run as troll.tools.inspect's page takes it: its name, config, every records row (read whole) and
    evaluations."""
    cfg, recs, evals = tinspect.load(str(run))
    return str(run), cfg, recs.rows(), evals


def steps_of(runs: list[tuple[str, dict, list[dict], dict]]) -> dict[str, list[int]]:
    return {name: [r["step"] for r in rows] for name, _, rows, _ in runs}


def data_of(page: str) -> dict:
    return json.loads(embedded(page))


def embedded(page: str) -> str:
    """The text of the page's data element, as the HTML parser ends it: at the first `</script`."""
    return re.search(r'<script type="application/json" id="data">(.*?)</script', page, re.S | re.I).group(1)


def test_page_is_self_contained_and_holds_both_runs_every_step_and_their_accuracy(tmp_path):
    a = fake_run(tmp_path, "troll", "troll", evals={0: 0.1, 10: 0.3})
    b = fake_run(tmp_path, "ppo", "ppo_clip")
    shown = [loaded(r) for r in (a, b)]
    step = tinspect.pick_step(steps_of(shown), None)
    assert step == 10
    page = tinspect.page(shown, step)
    assert not re.search(r"https?://|src=|href=|@import|url\(", page)  # nothing to fetch
    assert page.count("<script") == 2 and "</script>\"" not in page  # the token text cannot end the script early
    data = data_of(page)
    assert [r["loss"] for r in data["runs"]] == ["troll", "ppo_clip"] and data["step"] == 10
    assert data["colour"] == "update" and [r["step"] for r in data["runs"][0]["rows"]] == [5, 10]
    assert data["runs"][0]["evals"] == {"0": 0.1, "10": 0.3} and data["runs"][1]["evals"] == {}
    assert data["runs"][0]["rows"][1]["samples"][0]["text"][-1] == "</script>"
    assert all(f"<div>{line}</div>" in page for line in tinspect.KEY) and len(tinspect.KEY) == 3
    text = tinspect.text_summary(str(a), shown[0][1], tinspect.at_step(shown[0][2], 10), shown[0][3])
    assert "1 projected (KL > eps), 1 PPO-clip would cut; held-out accuracy 0.300 at step 10" in text
    assert "'#'" in text and "1.6 " in text  # the ratio, from the stored log-ratio
    assert "reward 1, gold '89#', prompt '04+85='" in text  # what re-checks the reward
    text = tinspect.text_summary(str(b), shown[1][1], tinspect.at_step(shown[1][2], 5), shown[1][3])
    assert "1 would be projected (KL > eps), 1 cut by the clip" in text and "accuracy" not in text
    assert tinspect.accuracy_at({0: 0.1, 10: 0.3}, 9) == (0, 0.1) and tinspect.accuracy_at({10: 0.3}, 9) is None


def test_the_page_holds_at_most_max_steps_of_a_run_the_first_shown_and_last_kept(tmp_path):
    steps = list(range(1, 101))
    for shown in (1, 37, 100):
        kept = tinspect.kept_steps(steps, shown, 10)
        assert len(kept) <= 10 and {1, 100, shown} <= set(kept) and kept == sorted(set(kept))
    assert tinspect.kept_steps([3, 5], 5, 10) == [3, 5]
    run = fake_run(tmp_path, "long", "troll", steps=range(1, 2 * tinspect.MAX_STEPS + 1))
    rows = data_of(tinspect.page([loaded(run)], 7))["runs"][0]["rows"]
    assert len(rows) <= tinspect.MAX_STEPS and 7 in [r["step"] for r in rows]


def test_a_long_runs_page_reads_whole_only_the_rows_it_shows(tmp_path, monkeypatch):
    """3,000 recorded steps: the command checks (reads whole) at most MAX_STEPS rows, the ones its page holds, and
    the page and text are what reading every row would have made."""
    run = fake_run(tmp_path, "long", "troll", steps=range(1, 3001))
    want = tinspect.page([loaded(run)], 3000)
    checked = []
    check = records.row_problem
    monkeypatch.setattr(records, "row_problem", lambda row, v=records.VERSION: checked.append(row) or check(row, v))
    status, out, err = inspect_in_process(str(run), "--out", str(tmp_path / "page.html"))
    assert status == 0, err
    assert 0 < len({r["step"] for r in checked}) <= tinspect.MAX_STEPS
    assert (tmp_path / "page.html").read_text() == want and "at step 3000" in out


SCRIPT_BREAKERS = ("<", ">", "&", "\u2028", "\u2029")  # what the embedded JSON must not hold as itself


def test_the_embedded_data_round_trips_and_no_text_can_end_or_stop_the_script(tmp_path):
    _, cfg, rows, evals = loaded(fake_run(tmp_path, "run", "troll", texts=HOSTILE))
    name = "run </script><!--<script>"  # a run's name is the path given: text in the page too
    page = tinspect.page([(name, cfg, rows, evals)], 10)
    blob = embedded(page)
    assert not any(c in blob for c in SCRIPT_BREAKERS), blob  # so no "<!--", "<script" or "</" either
    data = json.loads(blob)
    assert data["runs"][0]["rows"] == rows and data["runs"][0]["name"] == name
    assert data["runs"][0]["rows"][1]["samples"][0]["text"] == HOSTILE
    assert page.count("<script") == 2 and "run &lt;/script&gt;" in page  # the title escaped as HTML


@settings(max_examples=200, deadline=None, derandomize=True)
@given(texts=st.lists(st.text(), min_size=1, max_size=4), prompt=st.text(), name=st.text())
def test_any_text_in_the_page_round_trips_and_cannot_end_or_stop_the_script(texts, prompt, name):
    r = row(1, "troll")
    sample = r["samples"][0] | {"text": texts, "prompt": prompt}
    sample |= {k: sample[k][:1] * len(texts) for k in records.FIELDS if k != "text"}
    r["samples"] = [sample]
    blob = embedded(tinspect.page([(name, {"loss": name}, [r], {})], 1))
    assert not any(c in blob for c in SCRIPT_BREAKERS)
    shown = json.loads(blob)["runs"][0]
    assert shown["name"] == name and shown["settings"] == {"loss": name} and shown["rows"] == [r]


def test_steps_and_files_are_refused_with_the_way_forward(tmp_path):
    a, b = fake_run(tmp_path, "a", "troll", (5, 10)), fake_run(tmp_path, "b", "ppo_clip", (5,))
    shown = [loaded(r) for r in (a, b)]
    assert tinspect.pick_step(steps_of(shown), None) == 5
    with pytest.raises(UsageError, match=r"--step 10 is not recorded in every run .*b: 5"):
        tinspect.pick_step(steps_of(shown), 10)
    with pytest.raises(UsageError, match="is not a run directory"):
        tinspect.load(str(tmp_path / "nowhere"))
    (tmp_path / "c").mkdir()
    with pytest.raises(UsageError, match="config.json does not exist"):
        tinspect.load(str(tmp_path / "c"))
    (b / "config.json").write_text("[1]")
    with pytest.raises(UsageError, match="does not hold a JSON object"):
        tinspect.load(str(b))


# ----------------------------------------------------------------------------- the command


def command(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "troll", "inspect", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip


def refused(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert lines[0].startswith("troll inspect: error: ") and all(w in lines[0] for w in words), lines[0]


@pytest.mark.slow
def test_the_command_prints_writes_and_refuses_in_one_line(tmp_path):
    a, b = fake_run(tmp_path, "a", "troll"), fake_run(tmp_path, "b", "ppo_clip")
    done = command(str(a), str(b), "--step", "5", "--out", str(tmp_path / "page.html"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "at step 5" in done.stdout and (tmp_path / "page.html").is_file()
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    torn = fake_run(tmp_path, "torn", "troll")
    (torn / records.FILE).write_text("{no json\n" + json.dumps(row(1, "troll")) + "\n")
    bad_metrics, metrics_folder = fake_run(tmp_path, "m1", "troll"), fake_run(tmp_path, "m2", "troll")
    (bad_metrics / "metrics.jsonl").write_text('{"step": 0, "eval_acc": 0.5}\n{"step": "x", "eval_acc": 2}\n')
    (metrics_folder / "metrics.jsonl").mkdir()
    cases = [
        ((str(bad_metrics),), ("metrics.jsonl", "line 2", "step")),
        ((str(metrics_folder),), ("metrics.jsonl is not a file",)),
        ((str(tmp_path / "none"),), ("none", "is not a run directory")),
        ((str(tmp_path / "empty"),), ("tokens.jsonl does not exist", "--records_samples")),
        ((str(torn),), ("tokens.jsonl line 1", "resume the run")),
        ((str(a), "--step", "7"), ("--step 7 is not recorded",)),
        ((str(a), "--ste", "5"), ("--ste",)),
        ((str(a), str(a), str(a)), ("at most two runs",)),
        ((str(a), "--out", str(tmp_path / "no" / "page.html")), ("its folder does not exist",)),
    ]
    for argv, words in cases:
        refused(command(*argv), *words)


# ----------------------------------------------------------------------------- damaged records, field by field


def inspect_in_process(*argv: str) -> tuple[int, str, str]:
    """`troll inspect argv` in this process, through its boundary (troll.base.cli.run_command): the exit
    status, stdout and stderr (a bug's traceback included)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as e:
        run_command(tinspect.PROG, lambda: tinspect.main(list(argv)))
    return e.value.code, out.getvalue(), err.getvalue()


# each field of tokens.jsonl as this test knows it, apart from troll.run.records' table: its kind, whether null is
# allowed, values outside its range; the per-token fields hold a list of such values, one per token
KNOWN = {
    "step": ("integer", False, [0, -1, 2**53, 10**20]),  # from 2**53 on, JavaScript's numbers run together
    "loss": ("string", False, []),
    "eps": ("number", False, [-0.05]),
    "clip_low": ("number", False, [-0.2]),
    "clip_high": ("number", False, [-0.2]),
    "level": ("string", False, ["word", ""]),
    "samples": ("samples", False, []),
    "index": ("integer", False, [-1, 2**53 + 1]),
    "adv": ("number", True, []),
    "reward": ("number", True, []),
    "prompt": ("string", False, []),
    "train_row": ("integer", True, [-1]),
    "gold": ("string", True, []),
    "completion": ("string", True, []),
    "text": ("string", False, []),
    "q": ("number", True, [1.5, -0.1]),
    "p_before": ("number", True, [1.5, -0.25]),
    "p": ("number", True, [1.0001, -1e-9]),
    "p_after": ("number", True, [2.0, -0.5]),
    "kl": ("number", True, []),
    "projected": ("flag", False, [2, -1]),
    "log_ratio": ("number", True, []),
    "log_ratio_proj": ("number", True, []),
    "clipped": ("flag", False, [2, 3]),
}
PER_TOKEN = ("text", "q", "p_before", "p", "p_after", "kl", "projected", "log_ratio", "log_ratio_proj", "clipped")
NOT_NUMBERS = [math.nan, math.inf, -math.inf, 10**400]  # json.dumps writes NaN, Infinity; json.loads reads them
WRONG_TYPE = {  # values of another JSON type than each kind's
    "integer": ["7", 7.0, True, [7], {}],
    "number": ["0.5", True, [0.5], {"x": 1}],
    "string": [7, ["a"], {}, False],
    "flag": ["1", True, 0.5, [1]],
    "samples": ["x", {}, 7],
}


def damages() -> list[tuple[str, tuple, str, object]]:
    """Every damage of one row's fields, (kind, path, action, value): a path is ("step",) or ("samples", I, "q", T)
    with I and T filled in later; action "set" (to value), "delete", "append" or "pop" (a list's last value), "add"
    (an unknown field)."""
    found = []
    for k, (kind, null, outside) in KNOWN.items():
        at = ("samples", "I", k) if k in records.SAMPLE else (k,)
        found.append(("missing", at, "delete", None))
        one = (*at, "T") if k in PER_TOKEN else at
        found += [("wrong type", one, "set", v) for v in WRONG_TYPE[kind]]
        found += [("out of range", one, "set", v) for v in outside + (NOT_NUMBERS if kind == "number" else [])]
        found += [] if null else [("null", one, "set", None)]
        if k in PER_TOKEN:
            found += [("not a list", at, "set", v) for v in (None, "abc", 0.5)]
            found += [("length", at, "append", None), ("length", at, "pop", None)]
    found += [("not an object", ("samples", "I"), "set", v) for v in (None, [], "x")]
    found += [("unknown", ("extra",), "add", 1), ("unknown", ("samples", "I", "extra"), "add", [1])]
    return found


DAMAGES = damages()


def path_name(path: tuple) -> str:
    """("samples", 0, "q", 3) as troll.run.records names it: samples[0].q[3]."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def damage_row(good: dict, path: tuple, action: str, value: object) -> None:
    *parents, last = path
    obj = good
    for p in parents:
        obj = obj[p]
    if action in ("set", "add"):
        obj[last] = value
    elif action == "delete":
        del obj[last]
    elif action == "append":
        obj[last].append(obj[last][-1])
    else:
        obj[last].pop()


def damaged_file(run: Path, kind: str, path: tuple, action: str, value: object, before: int, blanks: list[int],
                 samples: int, sample: int, token: int) -> tuple[int, str]:  # fmt: skip
    """Write `before` good rows, then the damaged one, each after its number of blank lines (`blanks`): the damaged
    row's line and the damaged field's name."""
    bad = row(100, "troll")
    bad["samples"] = [bad["samples"][0] | {"index": i} for i in range(samples)]
    bad = json.loads(json.dumps(bad))  # no list shared between samples
    path = tuple(sample if p == "I" else token if p == "T" else p for p in path)
    damage_row(bad, path, action, value)
    lines = [json.dumps(row(step, "troll")) for step in range(1, before + 1)] + [json.dumps(bad)]
    text, line = "", 0
    for blank, one in zip(blanks, lines, strict=True):
        text += "\n" * blank + one + "\n"
        line += blank + 1
    (run / records.FILE).write_text(text)
    return line, path_name(path)


def refused_naming(status: int, err: str, run: Path, line: int, where: str) -> None:
    """Exit 2 with one line, no traceback, naming the file, the line and the field (`where`, or a field under it)."""
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and "Traceback" not in err, (status, err[-3000:])
    said = re.fullmatch(r"troll inspect: error: (.*) line (\d+): (\S+) .*", lines[0])
    assert said and said[1] == str(run / records.FILE) and said[2] == str(line), lines[0]
    assert said[3] == where or said[3].startswith((where + "[", where + ".")), (where, lines[0])


def config_run(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"task": "rare", "loss": "troll"}))
    return run


def test_every_damage_of_every_field_is_one_line_naming_the_file_line_and_field(tmp_path):
    """The sweep: each damage of each field (the test's own list, KNOWN), in the second of two samples, at its
    last token, on line 4 after a good row and blank lines. A new field in troll.run.records' table must join KNOWN."""
    assert set(KNOWN) == set(records.ROW) | set(records.SAMPLE_KEYS) and set(PER_TOKEN) == set(records.FIELDS)
    run = config_run(tmp_path)
    for kind, path, action, value in DAMAGES:
        line, where = damaged_file(run, kind, path, action, value, 1, [1, 1], samples=2, sample=1, token=4)
        if kind == "length" and where.endswith(".text"):  # text's length is what the other fields are held to
            where = where.removesuffix(".text")
        refused_naming(*inspect_in_process(str(run), "--out", str(tmp_path / "page.html"))[::2], run, line, where)
        assert not (tmp_path / "page.html").exists()  # nothing written before everything is checked


@settings(max_examples=150, deadline=None, derandomize=True)
@given(data=st.data(), damage=st.sampled_from(DAMAGES), before=st.integers(0, 3), samples=st.integers(1, 3))
def test_generated_damage_in_any_row_sample_and_token_is_named(data, damage, before, samples):
    """Hypothesis: a damage (DAMAGES) at any sample and token of a row after 0-3 good ones, blank lines between."""
    blanks = data.draw(st.lists(st.integers(0, 2), min_size=before + 1, max_size=before + 1))
    sample, token = data.draw(st.integers(0, samples - 1)), data.draw(st.integers(0, len(TEXTS) - 1))
    with tempfile.TemporaryDirectory() as tmp:
        run = config_run(Path(tmp))
        line, where = damaged_file(run, *damage, before, blanks, samples, sample, token)
        if damage[0] == "length" and where.endswith(".text"):
            where = where.removesuffix(".text")
        refused_naming(*inspect_in_process(str(run))[::2], run, line, where)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from(NOT_NUMBERS) | st.floats() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def paths_of(good: dict) -> list[tuple]:
    """Every field and per-token value of a one-sample row."""
    sample = good["samples"][0]
    return [(k,) for k in good] + [("samples", 0)] + [("samples", 0, k) for k in sample] + [
        ("samples", 0, k, t) for k in records.FIELDS for t in range(len(sample[k]))]  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(path=st.sampled_from(paths_of(row(1, "troll"))), value=JSON)
def test_any_value_in_any_field_is_shown_or_refused_in_one_line_never_a_traceback(path, value):
    """Hypothesis: any JSON value (NaN, infinities and 10**400 too) in any field: inspect writes its text and page
    (whose data round-trips), or refuses naming the file, the line and that field or one under it."""
    with tempfile.TemporaryDirectory() as tmp:
        run, page = config_run(Path(tmp)), Path(tmp) / "page.html"
        good, bad = row(1, "troll"), row(3, "troll")
        damage_row(bad, path, "set", value)
        (run / records.FILE).write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
        status, out, err = inspect_in_process(str(run), "--out", str(page))
        if status == 0:
            assert "Traceback" not in err and " at step " in out, err[-3000:]
            rows = [good, json.loads(json.dumps(bad))]
            want = next(r for r in rows if r["step"] == max(r["step"] for r in rows))  # the last step, its first row
            data = data_of(page.read_text())
            shown = next(r for r in data["runs"][0]["rows"] if r["step"] == data["step"])  # as the page finds it
            assert data["step"] == want["step"] and shown["samples"] == want["samples"]
        else:  # a sample's field may be named for another of its fields: text's length holds the others'
            refused_naming(status, err, run, 2, path_name(path[:2] if path[0] == "samples" else path))


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("adv", "1.5", 'samples[0].adv is "1.5", expected a number or null'),
        ("reward", [1.0], "samples[0].reward is [1.0], expected a number or null"),
        ("prompt", 12, "samples[0].prompt is 12, expected a string"),
        ("projected", [0, 0, 0, None, 0], "samples[0].projected[3] is null, expected 0 or 1"),
        ("clipped", [None] * 5, "samples[0].clipped[0] is null, expected 0 or 1"),
        ("projected", None, "samples[0].projected is null, expected a list with one value per token, each 0 or 1"),
    ],
)
def test_the_issues_rows_are_refused_in_one_line(tmp_path, field, value, says):
    """The rows of the issue: each passed troll.run.records' old checks and ended troll.tools.inspect in a traceback."""
    run = config_run(tmp_path)
    bad = row(1, "troll")
    bad["samples"][0][field] = value
    (run / records.FILE).write_text(json.dumps(bad) + "\n")
    status, _, err = inspect_in_process(str(run))
    refused_naming(status, err, run, 1, f"samples[0].{field}")
    assert says in err, err


# ----------------------------------------------------------------------------- in a real browser

FIGURE = ROOT / "docs" / "figures" / "inspect_tiny_rare"  # the README's runs' files, made by study.inspect_figure


def need_chromium() -> None:
    """Skip, saying why, where no Chromium is installed; fail where one must be (TROLL_BROWSER_TESTS=required,
    which .ci/run sets once it has installed Chromium)."""
    if inspect_figure.chromium() is None:
        message = "no chromium here: apt-get install -y chromium (.ci/run installs it)"
        if os.environ.get("TROLL_BROWSER_TESTS") == "required":
            pytest.fail(message + "; TROLL_BROWSER_TESTS=required says it must be here")
        pytest.skip(message)


def dom(page: Path, address: str = "") -> str:
    """The page's DOM after its script ran, opened at `address` (#colour=...&step=...&pin=...)."""
    return inspect_figure.browse(page.as_uri() + address, "--dump-dom").stdout


def rgb(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.fullmatch(r"rgb\((\d+), ?(\d+), ?(\d+)\)", text).groups())


def tokens_of(html: str) -> list[list[tuple[tuple[int, ...], str]]]:
    """Each panel's tokens as drawn: (background colour, text)."""
    panels = re.split(r'<section class="run"', html)[1:]
    pattern = r'<span class="tok[^"]*"[^>]*style="background-color: (rgb\([^)]*\))[^>]*>([^<]*)</span>'
    return [[(rgb(c), t) for c, t in re.findall(pattern, panel)] for panel in panels]


def legend_of(html: str) -> list[tuple[tuple[int, ...], str]]:
    """The legend's chips: (colour, label)."""
    legend = re.search(r'<span id="legend">(.*?)</span></span>(?!<span class="sw">)', html, re.S).group(1)
    return [(rgb(c), label) for c, label in re.findall(r'background-color: (rgb\([^)]*\));"></span>([^<]*)', legend)]


def red(c: tuple[int, ...]) -> bool:
    return c[0] > c[2] + 20


def blue(c: tuple[int, ...]) -> bool:
    return c[2] > c[0] + 20


@pytest.mark.slow
def test_the_page_renders_in_headless_chromium_without_network(tmp_path):
    """Both runs drawn, the second's token texts hostile (HOSTILE: a comment opener before a script tag, line
    separators), each shown as text."""
    need_chromium()
    a, b = fake_run(tmp_path, "troll-run", "troll"), fake_run(tmp_path, "ppo-run", "ppo_clip", texts=HOSTILE)
    out = tmp_path / "page.html"
    assert command(str(a), str(b), "--out", str(out)).returncode == 0
    html = out.read_text()
    assert not re.search(r"https?://", html)
    shown = dom(out)
    assert 'data-ready="1"' in shown and 'data-colour="update"' in shown and 'data-step="10"' in shown
    runs = re.findall(r'<section class="run" data-run="(\d)" data-loss="(\w+)"', shown)
    assert runs == [("0", "troll"), ("1", "ppo_clip")]
    panels = tokens_of(shown)
    assert [t for _, t in panels[0]] == [*TEXTS[:4], "&lt;/script&gt;"]
    assert [t for _, t in panels[1]] == [escape(t, quote=False) for t in HOSTILE]
    assert shown.count('<span class="gold"> · gold "89#"</span>') == 2  # each sample's gold, beside its prompt
    colours = dict((t, c) for c, t in panels[0])
    assert red(colours["#"]) and colours["8"][2] > 240  # `#` rose 0.012 -> 0.05: red; `8` barely moved: near white
    shot = tmp_path / "page.png"
    inspect_figure.browse(out.as_uri(), f"--screenshot={shot}", "--window-size=1200,700", "--hide-scrollbars")
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 5000


@pytest.mark.slow
def test_every_view_draws_its_legend_and_a_pinned_token_shows_what_happened_and_what_would_have(tmp_path):
    """Each colouring selected through the address (the page sets its selector and paints as on a change), its
    legend's two colours (four for the clip against the ball) checked, a token pinned in each panel, another step
    chosen."""
    need_chromium()
    a, b = fake_run(tmp_path, "a", "troll"), fake_run(tmp_path, "b", "ppo_clip")
    out = tmp_path / "page.html"
    assert command(str(a), str(b), "--out", str(out)).returncode == 0
    for view in tinspect.QUANTITIES:
        shown = dom(out, f"#colour={view}&pin=0.7.3,1.7.3")
        assert f'data-colour="{view}"' in shown and f'<option value="{view}" selected' not in shown  # drawn
        legend = legend_of(shown)
        hash_token = dict((t, c) for c, t in tokens_of(shown)[0])["#"]
        if view == "clip_ball":  # `#` is projected and cut: both act
            assert [label for _, label in legend] == ["the clip cuts, the ball lets through", "both act",
                                                      "only the ball", "neither"]  # fmt: skip
            assert hash_token == legend[1][0] and len({c for c, _ in legend}) == 4
        elif view == "kl":
            assert [label for _, label in legend] == ["0", "2·eps"] and legend[0][0] == (255, 255, 255)
            assert red(legend[1][0]) and '<span class="tok over' in shown  # framed: KL above eps
        else:  # a diverging view: blue below, red above
            assert len(legend) == 2 and blue(legend[0][0]) and red(legend[1][0]), legend
            assert red(hash_token)  # `#` rose in every diverging view of this row
        pinned = re.findall(r'<div class="detail">(.*?)</div>', shown, re.S)
        assert len(pinned) == 2 and all("what happened" in box and '"#"' in box for box in pinned)
        assert "hypothetical: what PPO-clip would have done" in pinned[0]
        assert "hypothetical: what TROLL would have done" in pinned[1]
        assert len(re.findall(r'class="tok[^"]* sel"', shown)) == 2
        assert "— hypothetical: what PPO-clip would have done —" in shown  # in a hovered token's figures too
    earlier = dom(out, "#step=5")
    assert 'data-step="5"' in earlier and "troll, step 5" in earlier and 'data-colour="update"' in earlier


# what the page's address can hold: names every JavaScript object inherits, numbers written other ways, markup
INHERITED = ["constructor", "__proto__", "toString", "hasOwnProperty", "valueOf", "prototype", "length",
             "__lookupGetter__"]
SPELLINGS = ["01", "010", "1e1", "1e0", "10.0", " 10", "10 ", "+10", "-10", "0x0a", "٣", "Infinity", "NaN", "",
             "9007199254740993", "00000000000000000000010", "10,5"]  # fmt: skip
MARKUP = ["<img src=x onerror=document.title='x'>", "</script><b>", '"><i>x</i>', "&amp;", "%3Cb%3E", "a=b&c", "#kl"]
VALUES = st.sampled_from(INHERITED + SPELLINGS + MARKUP)


@pytest.fixture(scope="module")
def two_runs_page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The page of two fake runs (steps 5 and 10, sample 7 in both), made by the command."""
    root = tmp_path_factory.mktemp("address")
    a, b = fake_run(root, "a", "troll"), fake_run(root, "b", "ppo_clip")
    assert command(str(a), str(b), "--out", str(root / "page.html")).returncode == 0
    return root / "page.html"


def expected_view_and_step(address: str) -> tuple[str, int]:
    """What the page must open on: the first `colour` if it is a view, else the default (update); the first `step`
    written in decimal digits if it is a recorded step (5 or 10), else the default (10, the last)."""
    asked = {}
    for key, value in urllib.parse.parse_qsl(address.removeprefix("#"), keep_blank_values=True):
        asked.setdefault(key, value)  # URLSearchParams.get: the first
    view = asked.get("colour") if asked.get("colour") in tinspect.QUANTITIES else "update"
    step = asked.get("step", "")
    return view, int(step) if re.fullmatch("[0-9]+", step) and int(step) in (5, 10) else 10


@pytest.mark.slow
@settings(max_examples=24, deadline=None, derandomize=True)
@given(colour=st.sampled_from(tinspect.QUANTITIES) | VALUES, step=st.sampled_from(["5", "10", "05"]) | VALUES,
       pin=st.sampled_from(["0.7.3", "1.7.3", "0.07.03", "1.7.3,0.7.0"]) | VALUES, quoted=st.booleans(),
       order=st.permutations(["colour", "step", "pin"]))  # fmt: skip
@example(colour="constructor", step="01", pin="0.7.3", quoted=False, order=["colour", "step", "pin"])
@example(colour="__proto__", step="1e0", pin="toString", quoted=False, order=["step", "colour", "pin"])
@example(colour="toString", step="<b>5</b>", pin="</script>", quoted=True, order=["pin", "colour", "step"])
def test_the_page_opens_on_a_recorded_step_in_a_known_view_whatever_its_address(two_runs_page, colour, step, pin,
                                                                                  quoted, order):  # fmt: skip
    """Hypothesis: an address drawn from inherited names, numeric spellings and markup (percent-encoded or as
    typed): the script runs to its end, the view is the one asked for if it is one (else the default), the step the
    one asked for if it is recorded (else the default), both panels drawn in it with its legend."""
    need_chromium()
    values = {"colour": colour, "step": step, "pin": pin}
    address = "#" + "&".join(f"{k}={urllib.parse.quote(values[k], safe='') if quoted else values[k]}" for k in order)
    shown = dom(two_runs_page, address)
    view, at = expected_view_and_step(address)
    assert 'data-ready="1"' in shown, (address, shown[-2000:])  # the script ran to its end
    assert f'data-colour="{view}"' in shown and f'data-step="{at}"' in shown, address
    assert f'<option value="{view}" selected' not in shown  # the selector's value set by the script, not markup
    assert shown.count(f"— troll, step {at}<") + shown.count(f"— ppo_clip, step {at}<") == 2, address
    panels = tokens_of(shown)
    assert len(panels) == 2 and all(len(p) == len(TEXTS) for p in panels), address  # every token coloured
    assert len(legend_of(shown)) in (2, 4) and "<img" not in shown and "<i>" not in shown, address  # text, not markup


@pytest.mark.slow
def test_the_committed_figure_shows_the_lesson_without_a_number(tmp_path):
    """The README's page (study.inspect_figure's runs, step 10, its default view): the `#` both runs drew alike
    rose under both, more under TROLL, by the factors README and docs/results.md quote (read from the committed
    records); in the clip-against-ball view TROLL's is what the clip would have cut and the ball let through."""
    need_chromium()
    out = tmp_path / "page.html"
    assert command(str(FIGURE / "troll"), str(FIGURE / "ppo"), "--step", "10", "--out", str(out)).returncode == 0
    pins = inspect_figure.pins(FIGURE)
    shown = dom(out, "#" + "pin=" + pins)
    assert "in both panels: same completion" in shown and "held-out accuracy" in shown
    troll, ppo = (re.search(r'class="tok[^"]* sel"[^>]*style="background-color: (rgb\([^)]*\))', panel).group(1)
                  for panel in re.split(r'<section class="run"', shown)[1:])  # fmt: skip
    troll, ppo = rgb(troll), rgb(ppo)
    assert red(troll) and red(ppo) and troll[2] < ppo[2]  # both rose; TROLL's redder
    index, position = (int(x) for x in pins.split(",")[0].split(".")[1:])  # "0.<sample>.<token>": the pinned `#`
    rises = []  # p after / p before of the pinned `#`, TROLL's then PPO-clip's
    for run in inspect_figure.RUNS:
        sample = next(s for s in tinspect.at_step(records.read(FIGURE / run), 10)["samples"] if s["index"] == index)
        assert sample["text"][position] == "#"
        rises.append(sample["p_after"][position] / sample["p_before"][position])
    assert rises[0] > rises[1] > 1
    for doc in ("README.md", "docs/results.md"):  # the prose quotes the files' factors, rounded as it writes them
        text = (ROOT / doc).read_text()
        assert all(f"x{rise:.3f}" in text for rise in rises), (doc, rises)
    ball = dom(out, "#colour=clip_ball&pin=" + inspect_figure.pins(FIGURE))
    troll, ppo = (rgb(re.search(r'class="tok[^"]* sel"[^>]*style="background-color: (rgb\([^)]*\))', panel).group(1))
                  for panel in re.split(r'<section class="run"', ball)[1:])  # fmt: skip
    legend = dict((label, c) for c, label in legend_of(ball))
    assert troll == legend["the clip cuts, the ball lets through"] and ppo == legend["neither"]


@pytest.mark.slow
def test_the_committed_figure_records_are_what_its_command_makes_today(tmp_path):
    """study.inspect_figure --records_only, run now, writes the committed files byte for byte (its runs hold
    PyTorch, MKL and oneDNN to AVX2 kernels and MKL to its strict reproducible mode: inspect_figure.PINNED)."""
    import torch

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU has no AVX2: the committed bytes are an AVX2 machine's")
    done = subprocess.run([sys.executable, "-m", "study.inspect_figure", "--records_only", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for run in inspect_figure.RUNS:
        for name in inspect_figure.FILES:
            fresh, committed = tmp_path / "inspect_tiny_rare" / run / name, FIGURE / run / name
            assert fresh.read_bytes() == committed.read_bytes(), f"{committed} is stale: python -m study.inspect_figure"


# ----------------------------------------------------------------------------- real runs


def train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "troll", "train", "--preset", "tiny-rare", "--out", str(out), "--steps", "2",
            "--sft_steps", "20", "--sft_target", "0", "--prompts_per_step", "4", "--eval_size", "20",
            "--eval_every", "1", "--save_every", "1", *flags]  # fmt: skip
    if "--resume" in flags:  # a resumed run keeps the settings in its config.json
        argv = [sys.executable, "-m", "troll", "train", "--out", str(out), *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def re_derived(row: dict, sample: dict) -> tuple[list[int], list[int]]:
    """A sample's projected and clipped flags from its stored figures alone: KL > eps, and PPO-clip's rule on
    exp(log_ratio), or under --level sequence on GSPO's exp(mean log_ratio) (written here, not troll.run.records')."""
    lr, a, n = sample["log_ratio"], sample["adv"], len(sample["text"])
    ratios = [math.exp(math.fsum(lr) / n)] * n if row["level"] == "sequence" and n else [math.exp(x) for x in lr]
    clipped = [int((a > 0 and r > 1 + row["clip_high"]) or (a < 0 and r < 1 - row["clip_low"])) for r in ratios]
    return [int(k > row["eps"]) for k in sample["kl"]], clipped


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["troll", "ppo_clip", "dppo", "cispo", "ppo_clip-sequence"])
def test_a_tiny_rare_run_of_each_loss_writes_records_that_resume_cuts_back(tmp_path, loss):
    """Every figure known (p before and after the update read), every flag re-derived from the file (GSPO's clip
    range under --level sequence too), and the rows a crash left redone on resume as first written."""
    out = tmp_path / loss
    loss, *level = loss.split("-")
    done = train(out, "--loss", loss, *(["--level", level[0]] if level else []))
    assert done.returncode == 0, done.stderr[-3000:]
    cfg = Config.load(out / "config.json")
    rows, bound = records.read(out), records.row_bytes_bound(cfg)
    train_rows = addition.problems("train", reverse=cfg.reverse_sum, rare=True)  # tiny-rare's task.train
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] == loss for r in rows)
    for r in rows:
        assert len(r["samples"]) == 4 and len((json.dumps(r) + "\n").encode()) <= bound
        assert r["level"] == (level[0] if level else "token")
        for s in r["samples"]:  # the reward re-checked from the file: the problem's prompt and gold, the completion
            problem = train_rows[s["train_row"]]
            assert (s["prompt"], s["gold"]) == (problem["question"], problem["gold"])
            assert addition.reward(s["completion"], s["gold"]) == s["reward"], s
            assert all(v is not None for k in records.FIELDS for v in s[k])  # p before and after read
            assert [s["projected"], s["clipped"]] == list(re_derived(r, s))
    # a crash after step 2's rows were written and before its checkpoint: resume drops them and writes them again
    (out / "summary.json").unlink()
    shutil.rmtree(out / "checkpoints" / "step-000002")
    (out / "checkpoints" / "latest").write_text("step-000001")
    again = train(out, "--resume", "true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert records.read(out) == rows  # step 2 again, as the uninterrupted run recorded it
