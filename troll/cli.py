"""What every command does with a problem the user fixes, and with Ctrl-C: one line on stderr, never a traceback.

    if __name__ == "__main__":
        run_command("python -m troll.plot", main)           # exit 2 on a UsageError, 130 on Ctrl-C
        run_command("python -m troll.train", lambda: train(cfg), resume="python -m troll.train --out x --resume true")

- `UsageError` (and troll.harness.RunError, one of them) is a problem with the arguments, files or environment that
  the user resolves: its message names it and the fix; the command prints `<prog>: error: <message>` and exits 2.
- Ctrl-C (KeyboardInterrupt) prints `<prog>: interrupted` with the command that continues, if there is one, and
  exits 130 (128 + SIGINT, what a shell reports for a command stopped by Ctrl-C).
- Every command's flags are parsed by `Parser` (argparse.ArgumentParser, subparsers included): a flag is never
  abbreviated (`--step 5` is refused, not taken as `--steps 5`), and a refused flag is the same one line, with
  `(<prog> --help lists the flags)` added, not argparse's usage block; `--help` prints the full help.
Any other exception is a bug and keeps its traceback. This module imports nothing heavy: commands use it before
torch is loaded.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

INTERRUPTED = 130  # the shell's exit status for a process stopped by SIGINT


class UsageError(Exception):
    """A problem the user resolves (arguments, files, environment); the message names it and the fix."""


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr, exit 2 (argparse's status for a usage error)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_command(prog: str, main: Callable[[], Any], resume: str | None = None) -> NoReturn:
    """Run a command's `main`; a UsageError and Ctrl-C end it with one line (module docstring). An int that `main`
    returns is the exit status (troll.check's 1 for a failed check); anything else exits 0."""
    try:
        status = main()
    except UsageError as e:
        fail(prog, str(e))
    except KeyboardInterrupt:
        then = f"; continue with: {resume}" if resume else ""
        print(f"\n{prog}: interrupted{then}", file=sys.stderr)
        raise SystemExit(INTERRUPTED) from None
    raise SystemExit(status if isinstance(status, int) else 0)


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser for every command: no abbreviated flags, and an error is one line (`fail`), not the
    usage block. argparse's own refusals while parsing (an unknown flag, a bad value) add where the flags are listed;
    a command's own `parser.error(...)` after parsing is the plain line. Subparsers are of this class too."""

    def __init__(self, *args: Any, allow_abbrev: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, allow_abbrev=allow_abbrev, **kwargs)
        self._parsing = 0  # > 0 inside parse_args / parse_known_args: an error there is argparse's about a flag
        self._argv: list[str] = []  # what parse_args was given, to name an unknown flag (`error`)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self._parsing += 1
        try:
            return super().parse_known_args(args, namespace)
        finally:
            self._parsing -= 1

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self._parsing += 1  # parse_args refuses leftover arguments after parse_known_args returns
        self._argv = list(sys.argv[1:] if args is None else args)
        try:
            return super().parse_args(args, namespace)
        finally:
            self._parsing -= 1

    def error(self, message: str) -> NoReturn:
        if self._parsing and message.startswith("the following arguments are required"):
            # argparse names a missing required flag before an unknown one: `--mode x` for `--model x` would be
            # refused as "--model is required", hiding the typo; the unknown flag is what the user fixes
            head = self._argv[: self._argv.index("--")] if "--" in self._argv else self._argv
            unknown = [a for a in head if a.startswith("--") and a.split("=")[0] not in self._option_string_actions]
            if unknown:
                message = f"unrecognized arguments: {' '.join(unknown)}; {message}"
        fail(self.prog, f"{message} ({self.prog} --help lists the flags)" if self._parsing else message)
