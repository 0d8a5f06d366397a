"""Only its own files (troll.base.outputs, docs/misuse.md): every command with an output path, against everything a user
may have left where it writes, generated over the commands and over the kinds of foreign content:

- a user's file of an output's name, a symbolic link to a user's file, a link to nothing, a folder of that name: exit
  2, one line naming it, every byte and link under the test's folder as it was; except a user's file where the user
  named the output file itself (troll inspect --out page.html, a benchmark's --json), which is replaced, as a
  tool's `-o` replaces it;
- a user's unrelated file in the output folder: exit 0, that file as it was;
- the command's own earlier output (damaged, even): replaced whole on a rerun, nothing else left beside it.

Each command runs in this process through its boundary (troll.base.cli.run_command), on the smallest input that makes it
write: a tiny model, a fake run's records, the committed results files.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest
from test_misuse import tree

from troll.base import outputs
from troll.base.cli import UsageError, run_command

ROOT = Path(__file__).resolve().parents[1]
INSPECT = "troll inspect"
KINDS = ("a file", "a link", "a dangling link", "a folder", "an unrelated file")
USER_BYTES = b"the user's own bytes\n"


# ----------------------------------------------------------------------------- the commands


def evaluate(argv: list[str]) -> None:
    from troll.tools.evaluate import main

    main(argv)


def inspect(argv: list[str]) -> None:
    from troll.tools.inspect import main

    main(argv)


def study_figures(argv: list[str]) -> None:
    from study.figures import main

    main(argv)


def inspect_figure(argv: list[str]) -> None:
    """study.inspect_figure with its two training runs replaced by fake runs (tests/test_inspect.py's)."""
    from test_inspect import fake_run as make

    from study import inspect_figure as figure

    def train(work: Path, name: str) -> Path:
        from troll.base.config import Config

        (work / "runs").mkdir(exist_ok=True)
        run = make(work / "runs", f"tiny-rare-{name}", "troll" if name == "troll" else "ppo_clip",
                   evals={0: 0.0, 5: 0.25, 10: 0.5, 15: 0.75})
        Config(loss=json.loads((run / "config.json").read_text())["loss"], out=str(run)).save(run / "config.json")
        return run

    with mock.patch.object(figure, "train", train):
        figure.main(argv)


def bandit(argv: list[str]) -> None:
    from study.bandit import main

    main(argv)


def offpolicy(argv: list[str]) -> None:
    from study.offpolicy import main

    main(argv)


@contextlib.contextmanager
def in_threads(jobs: int, in_process: bool = False) -> Iterator[ThreadPoolExecutor]:
    """study.runner.workers in this process: the warm-start runs in a thread, not a spawned worker."""
    with ThreadPoolExecutor(1) as pool:
        yield pool


def offpolicy_warm_starts(argv: list[str]) -> None:
    """study.offpolicy's run up to its warm-starts: each made in this process, the grid's runs left out."""
    from study import offpolicy as study

    with mock.patch.object(study, "workers", in_threads), mock.patch.object(study, "run_all", lambda *a: []):
        study.main(argv)


def calibrate(argv: list[str]) -> None:
    from study.run import main

    main(argv)


def real_shapes(argv: list[str]) -> None:
    """bench/real_shapes.py with every variant's measurement faked (the variants run nothing)."""
    from bench import real_shapes as bench

    with (
        mock.patch.object(sys, "argv", ["bench/real_shapes.py", *argv]),
        mock.patch.object(bench, "run_child", lambda spec: dict(spec, update=1.0)),
        mock.patch.object(bench, "report", lambda results: None),
    ):
        bench.main()


@dataclass(frozen=True)
class Case:
    """A command with an output path: `flags(work)` writes into `work / "out"`, whose `names` are what it writes
    there, in folders of its own under it where a name has them (`named`: the one file the user names, which a
    user's file there does not stop)."""

    prog: str
    main: Callable[[list[str]], None]
    flags: Callable[[Path], list[str]]
    names: tuple[str, ...]
    named: bool = False


INPUTS: list[Path] = []  # the folder of the commands' inputs, made once for the module (`inputs`)


@pytest.fixture(scope="module", autouse=True)
def inputs(tmp_path_factory) -> Iterator[None]:
    INPUTS.append(tmp_path_factory.mktemp("inputs"))
    yield
    INPUTS.pop()


def tiny_model() -> Path:
    """A tiny addition model folder (tests/test_evaluate.py's `addition_dir`), made once."""
    from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer
    from troll.tasks import addition

    folder = INPUTS[-1] / "model"
    if not folder.is_dir():
        tok = train_tokenizer(addition.corpus(), vocab_size=64)
        tok.chat_template = None
        save_tiny(tiny_llama(tok, hidden=32, layers=1, heads=2), tok, folder)
    return folder


def fake_run() -> Path:
    """A run folder holding records troll.tools.inspect shows (tests/test_inspect.py's `fake_run`), made once."""
    from test_inspect import fake_run as make

    return INPUTS[-1] / "run" if (INPUTS[-1] / "run").is_dir() else make(INPUTS[-1], "run", "troll")


EVALUATE = ["--task", "addition", "--limit", "2", "--max_new_tokens", "2", "--backend", "hf"]
CALIBRATE = ["--calibrate", "--variants", "ppo_clip", "--lrs", "1e-4", "--off_policy", "1x1", "--steps", "1",
             "--eval_every", "1", "--eval_size", "2", "--sft_steps", "1"]  # fmt: skip
WARM = ["--seeds", "0", "--lrs", "1e-4", "--sources", "none", "--losses", "troll", "--steps", "1", "--eval_size", "2"]
CASES = {
    "troll.tools.evaluate": Case(
        "troll evaluate",
        evaluate,
        lambda w: ["--model", str(tiny_model()), *EVALUATE, "--out", str(w / "out")],
        (".troll-evaluate", "evaluation.json", "predictions.jsonl", "summary.json"),
    ),
    "troll.tools.inspect": Case(
        INSPECT,
        inspect,
        lambda w: [str(fake_run()), "--out", str(w / "out" / "page.html")],
        ("page.html",),
        named=True,
    ),
    "study.figures": Case(
        "python -m study.figures",
        study_figures,
        lambda w: [str(ROOT / "study" / "results.jsonl"), "--out", str(w / "out")],
        ("accuracy_vs_off_policy.png", "kl_update.png"),
    ),
    "study.inspect_figure": Case(
        "python -m study.inspect_figure",
        inspect_figure,
        lambda w: ["--records_only", "--out", str(w / "out")],
        tuple(f"inspect_tiny_rare/{run}/{name}" for run in ("troll", "ppo")
              for name in (".study-inspect_figure", "config.json", "tokens.jsonl", "metrics.jsonl")),  # fmt: skip
    ),
    "study.bandit --figures": Case(
        "python -m study.bandit",
        bandit,
        lambda w: ["--results", str(ROOT / "study" / "bandit.jsonl"), "--figures", str(w / "out")],
        ("bandit_curves.png", "bandit_steps.png"),
    ),
    "study.offpolicy --figures": Case(
        "python -m study.offpolicy",
        offpolicy,
        lambda w: ["--results", str(ROOT / "study" / "rare.jsonl"), "--figures", str(w / "out"), "--name", "rare"],
        ("rare_adoption.png", "rare_paired.png", "rare_settings.png"),
    ),
    "study.offpolicy --out": Case(
        "python -m study.offpolicy",
        offpolicy_warm_starts,
        lambda w: [*WARM, "--sft_steps", "1", "--out", str(w / "out"), "--results", str(w / "results.jsonl")],
        ("warm-s0", "warm-s0.log"),
    ),
    "study.run --calibrate": Case(
        "python -m study.run",
        calibrate,
        lambda w: [*CALIBRATE, "--out", str(w / "out")],
        ("calibration-ppo_clip_lr0.0001_mb1_ep1_s0", "calibration.json"),
    ),
    "bench/real_shapes.py --json": Case(
        "python bench/real_shapes.py",
        real_shapes,
        lambda w: ["--plan", "quick", "--json", str(w / "out" / "results.json")],
        ("results.json",),
        named=True,
    ),
}
SLOW = {"study.run --calibrate"}  # a whole run in a spawned worker: its writes are tested in the slow suite


def case_params(kinds: tuple[str, ...] = ()) -> list:
    """Every command (x every kind): a command whose run takes long is marked slow where it writes."""
    params = []
    for name in CASES:
        for kind in kinds or (None,):
            writes = kind in (None, "an unrelated file") or (kind == "a file" and CASES[name].named)
            marks = [pytest.mark.slow] if name in SLOW and writes else []
            values = (name, kind) if kinds else (name,)
            params.append(pytest.param(*values, marks=marks, id=" / ".join(v for v in values if v)))
    return params


def run(case: Case, work: Path) -> tuple[int, str]:
    """The command in this process, through its boundary: its exit status and stderr."""
    err = io.StringIO()
    argv = case.flags(work)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            run_command(case.prog, lambda: case.main(argv))
        except SystemExit as e:
            return e.code, err.getvalue()
    raise AssertionError("run_command always exits")


def plant(path: Path, kind: str, mine: Path) -> None:
    """Foreign content of `kind` at `path` (a user's file `mine` beside the work folder, for the links)."""
    mine.write_bytes(USER_BYTES)
    if kind == "a file":
        path.write_bytes(USER_BYTES)
    elif kind == "a link":
        path.symlink_to(mine)
    elif kind == "a dangling link":
        path.symlink_to(mine.with_name("nothing"))
    elif kind == "a folder":
        path.mkdir()
        (path / "notes.txt").write_bytes(USER_BYTES)


# ----------------------------------------------------------------------------- the generated cases


@pytest.mark.parametrize(("name", "kind"), case_params(KINDS))
def test_foreign_content_where_a_command_writes_is_never_changed(name, kind, tmp_path):
    """Foreign content of each kind at each of the command's output names (or an unrelated file beside them):
    refused in one line naming it with every byte and link as it was, or, where the rule allows (an unrelated file,
    a user's file where the user named the output), exit 0 with the unrelated file as it was."""
    case, work = CASES[name], tmp_path / "work"
    for target in ("notes.txt",) if kind == "an unrelated file" else case.names:
        shutil.rmtree(work, ignore_errors=True)
        (work / "out").mkdir(parents=True)
        path = work / "out" / target
        path.parent.mkdir(parents=True, exist_ok=True)  # a name in a folder of the command's: the folder made first
        plant(path, "a file" if kind == "an unrelated file" else kind, tmp_path / "mine")
        before = tree(tmp_path)
        status, err = run(case, work)
        if kind == "an unrelated file" or (kind == "a file" and case.named):
            assert status == 0, err[-3000:]
            replaced = case.named and kind == "a file"  # the file the user named: replaced, as -o does
            assert (path.read_bytes() != USER_BYTES) if replaced else (path.read_bytes() == USER_BYTES)
            assert (tmp_path / "mine").read_bytes() == USER_BYTES and not path.is_symlink()
            assert all((work / "out" / n).exists() for n in case.names), sorted(os.listdir(work / "out"))
            continue
        lines = err.strip().splitlines()
        assert status == 2 and len(lines) == 1, (target, err[-3000:])
        assert lines[0].startswith(f"{case.prog}: error: ") and str(path) in lines[0], lines[0]
        assert "Traceback" not in err and ("--out" in lines[0] or "--figures" in lines[0] or "--json" in lines[0])
        assert tree(tmp_path) == before, target


def damage(path: Path) -> bytes:
    """The command's own file, stale or damaged as a user's edit leaves it, still recognisably its own: a JSON
    object marked "written_by" holding nothing else, any other file cut to its first half (a PNG keeps its text
    chunks, which come first; a log its first line)."""
    data = path.read_bytes()
    with contextlib.suppress(ValueError):
        if isinstance(obj := json.loads(data), dict) and "written_by" in obj:
            path.write_text(json.dumps({"written_by": obj["written_by"]}))
            return path.read_bytes()
    path.write_bytes(data[: max(len(data) // 2, 80)])
    return path.read_bytes()


def written(out: Path) -> list[str]:
    """What a command left in `out`: its entries, and in each folder the names of a case's (`Case.names`), the
    files under it."""
    found = []
    for entry in sorted(out.iterdir()):
        nested = entry.is_dir() and any(n.startswith(entry.name + "/") for c in CASES.values() for n in c.names)
        found += [str(p.relative_to(out)) for p in entry.rglob("*") if p.is_file()] if nested else [entry.name]
    return sorted(found)


@pytest.mark.parametrize("name", case_params())
def test_a_commands_own_output_is_replaced_whole_on_a_rerun(name, tmp_path):
    """A clean run writes exactly its names (and makes its output folder); a rerun replaces each of its own files,
    damaged in between, whole, and leaves nothing else (no temporary file) beside them."""
    case, work = CASES[name], tmp_path / "work"
    (work / "out" if case.named else work).mkdir(parents=True)  # the folder of a named file is the user's to make
    status, err = run(case, work)
    assert status == 0, err[-3000:]
    assert written(work / "out") == sorted(case.names)
    files = [work / "out" / n for n in case.names if (work / "out" / n).is_file() and not Path(n).name.startswith(".")]
    damaged = {p: damage(p) for p in files}
    if name == "study.offpolicy --out":  # a warm-start is made again only once its folder has gone
        shutil.rmtree(work / "out" / "warm-s0")
    status, err = run(case, work)
    assert status == 0, err[-3000:]
    assert written(work / "out") == sorted(case.names)
    for path, old in damaged.items():
        assert path.read_bytes() != old and len(path.read_bytes()) > len(old), path


# ----------------------------------------------------------------------------- the rule itself


def test_a_file_that_appears_during_the_work_is_never_replaced(tmp_path):
    """The check is made again where each file is put in place: a file (or a link) that appeared at an output's name
    after the check is refused, not replaced, and no temporary file is left."""
    for kind in ("a file", "a link"):
        out = tmp_path / kind.replace(" ", "-")
        out.mkdir()
        target = outputs.figure(out / "f.png", "study.figures", "--out")
        outputs.check([target])
        with pytest.raises(UsageError, match="f.png"), outputs.writing(target, binary=True) as f:
            f.write(b"\x89PNG...")
            plant(out / "f.png", kind, tmp_path / "mine")
        assert sorted(os.listdir(out)) == ["f.png"]
        assert (out / "f.png").is_symlink() if kind == "a link" else (out / "f.png").read_bytes() == USER_BYTES


def test_marks_tell_a_commands_own_files(tmp_path):
    """Each mark is the command's alone: another command's figure, JSON or marker is not its own."""
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1])
    fig.savefig(tmp_path / "f.png", format="png", metadata=outputs.png_metadata("study.bandit"))
    assert outputs.png_marked(tmp_path / "f.png", "Software", "study.bandit")
    assert not outputs.png_marked(tmp_path / "f.png", "Software", "study.figures")
    (tmp_path / "c.json").write_text(json.dumps({"written_by": "study.run", "wall_s": 1}))
    assert outputs.json_marked(tmp_path / "c.json", "study.run") and not outputs.json_marked(tmp_path / "c.json", "x")
    mine = outputs.Marked(tmp_path, "troll.tools.evaluate", ["summary.json"], "--out")
    other = outputs.Marked(tmp_path, "troll.other", ["summary.json"], "--out")
    mine.claim()
    outputs.write(mine.target("summary.json"), "{}")
    assert outputs.problem(mine.target("summary.json")) is None
    assert "was not written by this command" in outputs.problem(other.target("summary.json"))


def test_a_log_is_kept_when_its_work_fails(tmp_path):
    """`writing(..., keep_on_error=True)` (a warm-start's log): what was written is put in place when the work
    fails, so it says what went wrong; without it nothing is left."""
    log = outputs.log_file(tmp_path / "w.log", "# header", "--out")
    with pytest.raises(RuntimeError), outputs.writing(log, keep_on_error=True) as f:
        f.write("# header\nstep 1\n")
        raise RuntimeError("the work failed")
    assert (tmp_path / "w.log").read_text() == "# header\nstep 1\n"
    other = outputs.named(tmp_path / "page.html", "--out")
    with pytest.raises(RuntimeError), outputs.writing(other) as f:
        f.write("half a page")
        raise RuntimeError("the work failed")
    assert sorted(os.listdir(tmp_path)) == ["w.log"]


def test_the_folder_of_a_named_file_is_named_when_it_is_a_file(tmp_path):
    """`troll inspect --out a-file/page.html`: one line saying that a-file is a file, not a folder (not that the
    folder does not exist)."""
    (tmp_path / "a-file").write_bytes(USER_BYTES)
    page = tmp_path / "a-file" / "page.html"
    status, err = run(Case(INSPECT, inspect, lambda w: [str(fake_run()), "--out", str(page)], ()), tmp_path)
    assert status == 2 and f"{tmp_path / 'a-file'} is a file, not a folder" in err and "does not exist" not in err
    assert (tmp_path / "a-file").read_bytes() == USER_BYTES


def test_a_calibration_run_removes_only_a_run_of_its_own(tmp_path):
    """study.run --calibrate starts its run afresh: a folder troll marked as a run's, holding only a run's files, is
    removed; one with a file a run does not write, or without troll's marker, is refused, nothing removed."""
    from study.run import remove_run
    from troll.run.harness import MARKER, MARKER_KIND

    def made(name: str, extra: str | None = None, marked: bool = True) -> Path:
        out = tmp_path / name
        (out / "checkpoints").mkdir(parents=True)
        (out / "metrics.jsonl").write_text("{}\n")
        (out / "log.txt").write_text("log\n")
        if marked:
            (out / MARKER).write_text(json.dumps({"kind": MARKER_KIND, "folder": "made"}))
        if extra:
            (out / extra).write_bytes(USER_BYTES)
        return out

    remove_run(made("own"))
    assert not (tmp_path / "own").exists()
    for out in (made("foreign", extra="notes.txt"), made("unmarked", marked=False)):
        before = tree(out)
        with pytest.raises(UsageError, match=str(out)):
            remove_run(out)
        assert tree(out) == before
    (tmp_path / "link").symlink_to(tmp_path / "foreign")
    with pytest.raises(UsageError, match="symbolic link"):
        remove_run(tmp_path / "link")
    remove_run(tmp_path / "nothing")  # nothing there: nothing to do
