"""Every command's flags (troll.base.cli.Parser, issue 40): a flag is never abbreviated (`--step 5` is refused, not run
as `--steps 5`), a refused flag is one line on stderr naming it and where the flags are listed (exit 2, no usage
block), and `--help` prints the full help (exit 0)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import pickle
import re
import shlex
import signal
import subprocess
import sys

import pytest
from test_commands import BENCHES, ROOT
from test_misuse import as_from_a_shell

from troll.base.cli import BROKEN_PIPE, Parser, UsageError, run_command

COMMANDS = [  # troll's as its verbs (`python -m troll VERB`, as `troll VERB`), the studies' and benches' as modules
    *(f"troll {verb}" for verb in ("train", "check", "evaluate", "export", "plot", "inspect", "model", "memory")),
    *(f"study.{name}" for name in ("run", "offpolicy", "bandit", "figures", "real", "real_gsm8k", "inspect_figure")),
    *(f"bench.{name}" for name in BENCHES),
]


NAMED = {"troll model": ["smollm2-135m-instruct"]}  # commands whose positional takes only its choices


def parser() -> Parser:
    p = Parser(prog="python -m x")
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    return p


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "usage:" not in err and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "words", "end"),
    [
        # with abbreviations, this ran as --steps 5
        (["--step", "5"], ["unrecognized arguments: --step 5"], "; did you mean --steps?"),
        (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"], ""),
        (["--steps", "x"], ["argument --steps: invalid int value: 'x'"], ""),
    ],
)
def test_a_refused_flag_is_one_line(argv, words, end, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(argv)
    assert exit_info.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("python -m x: error: ") and line.endswith(f"(python -m x --help lists the flags){end}"), line
    assert all(w in line for w in words), line


def refused(parse, argv: list[str], capsys) -> str:
    """The one line `parse(argv)` refuses `argv` with (exit 2)."""
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    line = one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2, line
    return line


TRAIN_MISSPELLED = [
    (["--lr_rate", "1e-4"], "--lr"),  # a flag extended by a word: its stem (difflib would say --lora_rank)
    (["--lr-rate=1e-4"], "--lr"),
    (["--step", "5"], "--steps"),  # an abbreviation, refused: the whole flag
    (["--seeds", "1"], "--seed"),
    (["--max-new-tokens", "8"], "--max_new_tokens"),  # dashes for underscores
    (["--eval_evry", "5"], "--eval_every"),
    (["--record_every", "5"], "--records_every"),
    (["--output", "runs/x"], "--out"),
    (["--out_dir", "runs/x"], "--out"),
]


@pytest.mark.parametrize(("argv", "meant"), TRAIN_MISSPELLED, ids=[" ".join(a) for a, _ in TRAIN_MISSPELLED])
def test_a_misspelled_flag_of_troll_train_suggests_the_closest(argv, meant, capsys):
    """troll.train's parser (troll.base.config.Config.parser): the line ends with the flag meant, nothing else
    changed."""
    from troll.base.config import Config

    line = refused(Config.from_args, argv, capsys)
    head = f"troll train: error: unrecognized arguments: {' '.join(argv)}"
    assert line == f"{head} (troll train --help lists the flags); did you mean {meant}?", line


@pytest.mark.parametrize("argv", [["--no-such-flag", "1"], ["--batch_size", "4"], ["--epsilon", "0.1"], ["-x"]])
def test_no_suggestion_when_no_flag_is_close(argv, capsys):
    from troll.base.config import Config

    line = refused(Config.from_args, argv, capsys)
    assert line.endswith("(troll train --help lists the flags)") and "did you mean" not in line, line


def test_every_misspelled_flag_gets_its_own_suggestion(capsys):
    from troll.base.config import Config

    line = refused(Config.from_args, ["--lr_rate=1e-4", "--step", "5", "--no-such-flag"], capsys)
    assert line.endswith("lists the flags); did you mean --lr for --lr_rate, --steps for --step?"), line


def test_another_commands_misspelled_flag_is_suggested(capsys):
    """troll.tools.plot's and troll.tools.evaluate's own parsers; an unknown flag named before a missing required one
    gets its suggestion too."""
    from troll.tools import evaluate, plot

    line = refused(plot.main, ["runs/x", "--outt", "plots"], capsys)
    assert line.startswith("troll plot: error: ") and line.endswith("; did you mean --out?"), line
    line = refused(evaluate.main, ["--modle", "x"], capsys)
    assert "unrecognized arguments: --modle; the following arguments are required: --model" in line, line
    assert line.endswith("; did you mean --model?"), line


def test_a_subcommands_flag_is_suggested_from_its_own_parser(capsys):
    p = Parser(prog="tool")
    p.add_subparsers(dest="what").add_parser("go").add_argument("--steps", type=int)
    assert refused(p.parse_args, ["go", "--stpes", "2"], capsys).endswith("; did you mean --steps?")


def test_the_commands_own_refusal_is_the_plain_line_and_help_is_whole(capsys):
    p = parser()
    assert p.parse_args(["--steps", "5"]).steps == 5
    with pytest.raises(SystemExit) as exit_info:
        p.error("--steps must be >= 1, got 0")  # a command's check after parsing: no hint about the flags
    line = one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and line == "python -m x: error: --steps must be >= 1, got 0"
    with pytest.raises(SystemExit) as exit_info:
        p.parse_args(["--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: python -m x")


def test_an_unknown_flag_is_named_before_a_missing_required_one(capsys):
    """argparse alone says only "--model is required" for `--mode x`, hiding the typo."""
    p = Parser(prog="python -m x")
    p.add_argument("--model", required=True)
    with pytest.raises(SystemExit) as exit_info:
        p.parse_args(["--mode=x"])
    line = one_line(capsys.readouterr().err)
    assert exit_info.value.code == 2 and "unrecognized arguments: --mode=x; the following arguments are" in line


def test_subparsers_are_parsers_too(capsys):
    p = Parser(prog="tool")
    p.add_subparsers(dest="what").add_parser("go").add_argument("--steps", type=int)
    assert p.parse_args(["go", "--steps", "2"]).steps == 2
    with pytest.raises(SystemExit) as exit_info:
        p.parse_args(["go", "--step", "2"])
    assert exit_info.value.code == 2 and "--step 2" in one_line(capsys.readouterr().err)


def test_every_parser_is_a_troll_parser():
    """No command builds a plain argparse.ArgumentParser (its usage block and abbreviations would come back)."""
    plain = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in ("troll", "bench", "study", "scripts", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "argparse.ArgumentParser(" in line
    ]
    assert not plain and issubclass(Parser, argparse.ArgumentParser)


def test_every_command_of_the_studies_and_benches_is_listed():
    """The modules of study/ and bench/ that run as a command (they end in run_command or hand their main to it)
    are the ones COMMANDS lists, so each new one gets this file's, the fuzzer's and the refusal tests' checks."""
    runs = {
        f"{folder}.{path.stem}"
        for folder in ("study", "bench")
        for path in (ROOT / folder).glob("*.py")
        if re.search(r"^\s+run_command\(", path.read_text(), re.M)
    }
    assert runs == {c for c in COMMANDS if c.split(".")[0] in ("study", "bench")}


def run(module: str, *argv: str) -> subprocess.Popen:
    """`python -m module argv`; a command `troll VERB` runs as `python -m troll VERB`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen([sys.executable, "-m", *module.split(), *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def abbreviation(help_text: str) -> str | None:
    """One of the command's long flags less its last letter, a prefix of that flag only (so argparse with
    abbreviations would have taken it as the flag): from the longest flag down; None for a command whose only flag
    is --help (troll model takes a name; troll memory takes nothing), which has nothing to abbreviate."""
    flags = set(re.findall(r"^\s+(?:-\w+, )?(--[\w-]+)", help_text, re.M)) - {"--help"}
    if not flags:
        return None
    for flag in sorted(flags, key=lambda f: (-len(f), f)):
        short = flag[:-1]
        if [f for f in flags if f.startswith(short)] == [flag]:
            return short
    raise AssertionError(f"no flag to abbreviate in {sorted(flags)}")


@pytest.mark.slow
@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_refuses_an_abbreviation_and_an_unknown_flag_in_one_line(module):
    """`--help` prints the usage (exit 0); an abbreviation of its longest flag and `--no-such-flag` are each one
    line naming the flag (exit 2) after the command's own name, as its other refusals give it. The two refusals run
    at once, one per core."""
    helped = run(module, "--help")
    out, err = helped.communicate(timeout=300)
    assert helped.returncode == 0 and out.startswith("usage:"), (module, err[-2000:])
    short = abbreviation(out)
    given = NAMED.get(module, [])  # a positional with choices: a valid one, so the flag is what is refused
    procs = {flag: run(module, *given, flag, "1") for flag in (short, "--no-such-flag") if flag}
    for flag, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        line = one_line(err)
        named = ": error: " in line and flag in line and "--help lists the flags" in line
        assert proc.returncode == 2 and named, (module, flag, line)
        script = f"python {module.replace('.', '/')}.py"  # a benchmark is run as a script, a study as a module
        module_prog = module if module.startswith("troll ") else f"python -m {module}"
        assert line.split(": error: ")[0] == (script if module.startswith("bench.") else module_prog)


# ------------------------------------------------------------------------------------------------ the boundary


def ended(main, capsys, resume: str | None = None) -> tuple[int, str]:
    """run_command("python -m x", main): its exit status and its stderr."""
    with pytest.raises(SystemExit) as exit_info:
        run_command("python -m x", main, resume=resume)
    return exit_info.value.code, capsys.readouterr().err


def raising(e: BaseException):
    def main():
        raise e

    return main


def os_error(code: int, path: object, cls: type[OSError] = OSError) -> OSError:
    return cls(code, os.strerror(code), str(path))


class SafetensorError(Exception):
    """Stands in for safetensors' exception, recognised by its module and name (troll.base.cli imports nothing
    heavy)."""


SafetensorError.__module__ = "safetensors._safetensors_rust"


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (os_error(errno.EACCES, "/r/config.json", PermissionError), ["/r/config.json", "permission denied", "chmod"]),
        (os_error(errno.EISDIR, "/r/summary.json", IsADirectoryError), ["/r/summary.json is a folder", "move it"]),
        (os_error(errno.ENOENT, "/no/such/folder/x.json", FileNotFoundError), ["its folder /no/such/folder", "create"]),
        (os_error(errno.ENOENT, "/tmp/no-such-file.json", FileNotFoundError), ["/tmp/no-such-file.json does not"]),
        (os_error(errno.EROFS, "/ro/metrics.jsonl"), ["/ro/metrics.jsonl is on a read-only file system", "writable"]),
        (os_error(errno.EEXIST, "/r/out", FileExistsError), ["/r/out already exists", "another path"]),
        (os_error(errno.EIO, "/r/trainer.pt"), ["/r/trainer.pt", "Input/output error", "EIO"]),
        (OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b"), ["/a -> /b", "EXDEV"]),
        (FileNotFoundError("GSM8K source x does not exist (and is not a hub name)"), ["GSM8K source x does not exist"]),
        (ImportError("no module named peft: pip install peft", name="peft"), ["pip install peft", "missing package"]),
        (json.JSONDecodeError("Expecting value", "{", 0), ["damaged", "JSONDecodeError", "restore it"]),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), ["damaged", "UnicodeDecodeError"]),
        (pickle.UnpicklingError("invalid load key"), ["damaged", "UnpicklingError"]),
        (EOFError("Ran out of input"), ["damaged", "EOFError"]),
        (
            RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory"),
            ["damaged", "PytorchStreamReader"],
        ),
        (SafetensorError("Error while deserializing header: header too large"), ["damaged", "SafetensorError"]),
    ],
)
def test_an_expected_failure_is_one_line_exit_2(error, words, capsys):
    status, err = ended(raising(error), capsys)
    line = one_line(err)
    assert status == 2 and line.startswith("python -m x: error: "), (status, err)
    assert all(w in line for w in words), line


def test_a_file_where_a_folder_belongs_is_named(tmp_path, capsys):
    (tmp_path / "runs").write_text("a file")
    error = os_error(errno.ENOTDIR, tmp_path / "runs" / "x" / "config.json", NotADirectoryError)
    status, err = ended(raising(error), capsys)
    assert status == 2 and f"{tmp_path / 'runs'} is a file where a folder belongs" in one_line(err)


@pytest.mark.parametrize(
    "error",
    [
        os_error(errno.ENOSPC, "/r/checkpoints/.tmp-step-000003/trainer.pt"),
        RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed writing file data/0"),
        SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })"),
    ],
)
def test_a_full_disk_says_the_checkpoints_are_kept_and_how_to_continue(error, capsys):
    status, err = ended(raising(error), capsys, resume="troll train --out r --resume true")
    line = one_line(err)
    assert status == 2 and "free some disk space" in line and "finished checkpoints are kept" in line, line
    assert "continue with: troll train --out r --resume true" in line


def test_a_bug_keeps_its_traceback_and_says_it_is_one(capsys):
    status, err = ended(raising(KeyError("step")), capsys)
    assert status == 1 and err.startswith("Traceback") and "KeyError: 'step'" in err, err
    last = err.strip().splitlines()[-1]
    assert last == "python -m x: error: this is a bug in troll (KeyError): please report it with the traceback above"
    status, err = ended(raising(ImportError("cannot import name 'x' from 'troll.y'", name="troll.y")), capsys)
    assert status == 1 and "Traceback" in err and "bug in troll" in err  # troll's own import: a bug


def test_usage_error_ctrl_c_and_exit_status_are_as_before(capsys, monkeypatch):
    status, err = ended(raising(UsageError("--steps must be >= 1")), capsys)
    assert status == 2 and one_line(err) == "python -m x: error: --steps must be >= 1"
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # run_command sets it; restored after the test
    with pytest.raises(KeyboardInterrupt):  # it goes on to end the process by SIGINT (the tests below)
        run_command("python -m x", raising(KeyboardInterrupt()), resume="python -m x --resume true")
    assert one_line(capsys.readouterr().err) == "python -m x: interrupted; continue with: python -m x --resume true"
    sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)  # the interpreter's last word on it: nothing
    sys.excepthook(ValueError, ValueError("other"), None)  # anything else as Python prints it
    assert capsys.readouterr().err == "ValueError: other\n"
    assert ended(lambda: 3, capsys)[0] == 3 and ended(lambda: None, capsys)[0] == 0


INTERRUPTIBLE = """
import ctypes, time
from troll.base.cli import run_command

def main():
    if "{where}" == "embedded":  # in code an extension evaluates, as pybind11's py::exec does
        run = ctypes.pythonapi.PyRun_String
        run.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
        run.restype = ctypes.py_object
        # "ready" from inside: a SIGINT that lands while CPython compiles the string can be lost there
        run(b"import time; print('ready', flush=True); time.sleep(60)", 257, {{}}, {{}})  # 257: Py_file_input
    if "{where}" == "finalizer":  # Python prints and drops a KeyboardInterrupt raised in a finalizer
        class Held:
            def __del__(self):
                print("ready", flush=True)
                time.sleep(60)

        Held()
        return
    print("ready", flush=True)
    time.sleep(60)

run_command("python -m interruptible", main)
"""


def interrupted(tmp_path, argv: list[str], where: str) -> subprocess.CompletedProcess:
    """`argv` (in `tmp_path`, beside interruptible.py) interrupted by Ctrl-C as a terminal sends it, to its whole
    process group, once the command is at work."""
    (tmp_path / "interruptible.py").write_text(INTERRUPTIBLE.format(where=where))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=as_from_a_shell, start_new_session=True)  # fmt: skip
    assert proc.stdout.readline() == "ready\n"
    os.killpg(proc.pid, signal.SIGINT)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # no orphan left sleeping, and what it said
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"still running 60 s after Ctrl-C: {proc.communicate()[1]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("where", ["python", "embedded", "finalizer"])
@pytest.mark.parametrize("how", ["module", "script"])
def test_ctrl_c_ends_the_process_by_sigint_after_its_one_line(tmp_path, how, where):
    """Always by SIGINT, as a shell's Ctrl-C stops a program (status 130 in the shell): before, a plain exit 130,
    except that CPython ends a `python -m` run by SIGINT anyway when the KeyboardInterrupt passed through code an
    extension evaluated (the flaky test_ctrl_c_in_the_check... of issue 40). A Ctrl-C that lands in a finalizer,
    where Python drops it (the check saving its stand-in, in one CI run), ends the command the same way."""
    argv = [sys.executable, *(["-m", "interruptible"] if how == "module" else ["interruptible.py"])]
    result = interrupted(tmp_path, argv, where)
    assert result.returncode == -signal.SIGINT, (result.returncode, result.stderr)
    assert result.stderr == "\npython -m interruptible: interrupted\n", result.stderr


def test_ctrl_c_stops_a_shell_loop_over_runs(tmp_path):
    """`for s in 1 2; do troll train ...; done`: Ctrl-C stops the loop, not just its current run (bash
    goes on after a command that exits 130 by itself, taking the Ctrl-C as handled)."""
    loop = f"for s in 1 2; do {shlex.quote(sys.executable)} -m interruptible; done; echo the loop went on"
    result = interrupted(tmp_path, ["bash", "-c", loop], "python")
    assert "the loop went on" not in result.stdout and "ready" not in result.stdout, result.stdout
    assert result.returncode == -signal.SIGINT and result.stderr.count("interrupted") == 1, result


def test_a_closed_pipe_ends_quietly(capsys):
    status, err = ended(raising(BrokenPipeError(errno.EPIPE, "Broken pipe")), capsys)
    assert status == BROKEN_PIPE == 141 and err == ""


@pytest.mark.slow
def test_a_command_whose_reader_has_gone_ends_quietly():
    """`study.run --dry-run | head -1`, with head gone before the grid is listed (the pipe's read end closed before
    the command starts): no traceback, and the shell's status for a command stopped by SIGPIPE."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run([sys.executable, "-m", "study.run", "--dry-run"], cwd=ROOT, stdout=write,
                                stderr=subprocess.PIPE, text=True, timeout=300)  # fmt: skip
    finally:
        os.close(write)
    assert (result.returncode, result.stderr) == (BROKEN_PIPE, ""), result.stderr[-2000:]


BARS = """
import sys
if sys.argv[1] == "before":
    import transformers  # imported before the boundary, as troll.tools.check and the benchmarks import it
from troll.base.cli import run_command


def main():
    import tqdm
    from huggingface_hub.utils import tqdm as hub_tqdm
    from transformers.utils import logging

    bars = [logging.tqdm(range(3), desc="transformers"), hub_tqdm(range(3), desc="hub")]
    if sys.argv[1] == "after":  # a plain tqdm reads TQDM_DISABLE when first imported
        bars.append(tqdm.tqdm(range(3), desc="plain"))
    for bar in bars:
        list(bar)
    print("done")


run_command("bars", main)
"""


@pytest.mark.parametrize(
    ("imported", "env"), [("before", {}), ("after", {}), ("after", {"HF_HUB_DISABLE_PROGRESS_BARS": "0"})]
)
def test_library_bars_draw_on_a_terminal_only(imported, env):
    """Output piped (a log file, `| tee`): transformers', huggingface_hub's and a plain tqdm's bars are off, whether
    the libraries were imported before the boundary or after; a HF_HUB_DISABLE_PROGRESS_BARS the user sets is kept."""
    clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")}
    done = subprocess.run([sys.executable, "-c", BARS, imported], capture_output=True, text=True, cwd=ROOT,
                          env={**clean, "PYTHONPATH": str(ROOT), **env}, timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout == "done\n", done.stderr[-2000:]
    if env:
        assert "transformers: 100%" in done.stderr and "hub: 100%" in done.stderr
    else:
        assert done.stderr == "", done.stderr[-2000:]


# ------------------------------------------------------------------------------------------ troll VERB


def troll(*argv: str) -> subprocess.CompletedProcess:
    """`python -m troll ARGV` from the repository, as the console script `troll` runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "troll", *argv], capture_output=True, text=True, env=env, cwd=ROOT)


def test_troll_help_lists_every_command_and_each_verb_is_its_module():
    """Every troll module that is a command (it ends in run_command) is a verb, listed with its line by --help; a
    verb's --help is its module's own."""
    from troll.__main__ import VERBS

    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "troll").rglob("*.py")}
    commands = {name for name, p in modules.items() if "run_command(" in p.read_text()}
    assert commands - {"troll.base.cli"} == {module for module, _ in VERBS.values()}
    listed = troll("--help")
    assert listed.returncode == 0 and all(f"  {verb}" in listed.stdout for verb in VERBS)
    for verb in ("evaluate", "model"):
        own = troll(verb, "--help")
        assert own.returncode == 0 and f"usage: troll {verb}" in own.stdout, own.stderr


@pytest.mark.parametrize(
    "argv, words",
    [
        (["evalute"], ["'evalute' is not a verb", "did you mean evaluate?"]),
        (["trian", "--steps", "1"], ["did you mean train?"]),
        ([], ["usage: troll VERB"]),
        (
            ["evaluate", "--model", "/no/such/model"],
            ["troll evaluate: error:", "/no/such/model does not exist"],
        ),
        (["train", "--step", "5"], ["--step", "--steps"]),
    ],
)
def test_a_verbs_mistake_is_one_line_and_exit_2(argv, words):
    """An unknown verb names the nearest; a verb's own refusal keeps its command's boundary (one line, exit 2)."""
    result = troll(*argv)
    err = result.stderr.strip()
    assert result.returncode == 2 and "Traceback" not in err, err
    assert argv == [] or len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


def test_any_other_first_word_is_one_line_naming_it(capsys):
    """Generated first words (any text, flags, paths, empty): exit 2 with one line that names the word and the nearest
    verbs, or the usage for none; nothing is run."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from troll.__main__ import VERBS, main

    @settings(max_examples=60, derandomize=True, deadline=None)
    @given(st.lists(st.text(min_size=0, max_size=12), min_size=1, max_size=3))
    def check(argv: list[str]) -> None:
        if argv[0] in VERBS or argv[0] in ("-h", "--help"):
            return
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and repr(argv[0]) in err, err
        assert "did you mean" in err

    check()
