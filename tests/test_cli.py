"""Every command's flags (troll.cli.Parser, issue 40): a flag is never abbreviated (`--step 5` is refused, not run as
`--steps 5`), a refused flag is one line on stderr naming it and where the flags are listed (exit 2, no usage
block), and `--help` prints the full help (exit 0)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
from test_commands import BENCHES, ROOT

from troll.cli import Parser

COMMANDS = [
    *(f"troll.{name}" for name in ("train", "check", "evaluate", "export", "plot", "inspect")),
    *(f"study.{name}" for name in ("run", "offpolicy", "bandit", "figures")),
    *(f"bench.{name}" for name in BENCHES),
]


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
    ("argv", "words"),
    [
        (["--step", "5"], ["unrecognized arguments: --step 5"]),  # with abbreviations, this ran as --steps 5
        (["--no-such-flag"], ["unrecognized arguments: --no-such-flag"]),
        (["--steps", "x"], ["argument --steps: invalid int value: 'x'"]),
    ],
)
def test_a_refused_flag_is_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(argv)
    assert exit_info.value.code == 2
    line = one_line(capsys.readouterr().err)
    assert line.startswith("python -m x: error: ") and line.endswith("(python -m x --help lists the flags)"), line
    assert all(w in line for w in words), line


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


def run(module: str, *argv: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.Popen([sys.executable, "-m", module, *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip


def abbreviation(help_text: str) -> str:
    """One of the command's long flags less its last letter, a prefix of that flag only (so argparse with
    abbreviations would have taken it as the flag): from the longest flag down."""
    flags = set(re.findall(r"^\s+(?:-\w+, )?(--[\w-]+)", help_text, re.M)) - {"--help"}
    for flag in sorted(flags, key=lambda f: (-len(f), f)):
        short = flag[:-1]
        if [f for f in flags if f.startswith(short)] == [flag]:
            return short
    raise AssertionError(f"no flag to abbreviate in {sorted(flags)}")


@pytest.mark.slow
@pytest.mark.parametrize("module", COMMANDS)
def test_every_command_refuses_an_abbreviation_and_an_unknown_flag_in_one_line(module):
    """`--help` prints the usage (exit 0); an abbreviation of its longest flag and `--no-such-flag` are each one
    line naming the flag (exit 2). The two refusals run at once, one per core."""
    helped = run(module, "--help")
    out, err = helped.communicate(timeout=300)
    assert helped.returncode == 0 and out.startswith("usage:"), (module, err[-2000:])
    short = abbreviation(out)
    procs = {flag: run(module, flag, "1") for flag in (short, "--no-such-flag")}
    for flag, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        line = one_line(err)
        named = ": error: " in line and flag in line and "--help lists the flags" in line
        assert proc.returncode == 2 and named, (module, flag, line)
