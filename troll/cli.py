"""What every command does with a problem the user fixes, and with Ctrl-C: one line on stderr, never a traceback.

    if __name__ == "__main__":
        run_command("python -m troll.plot", main)           # exit 2 on a UsageError, 130 on Ctrl-C
        run_command("python -m troll.train", lambda: train(cfg), resume="python -m troll.train --out x --resume true")

- `UsageError` (and troll.harness.RunError, one of them) is a problem with the arguments, files or environment that
  the user resolves: its message names it and the fix; the command prints `<prog>: error: <message>` and exits 2.
- Ctrl-C (KeyboardInterrupt) prints `<prog>: interrupted` with the command that continues, if there is one, and
  exits 130 (128 + SIGINT, what a shell reports for a command stopped by Ctrl-C).
Any other exception is a bug and keeps its traceback. This module imports nothing heavy: commands use it before
torch is loaded.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
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
