"""What every command does with a problem the user fixes, and with Ctrl-C: one line on stderr, never a traceback.

    if __name__ == "__main__":
        run_command("troll plot", main)           # exit 2 on a user's problem, 1 on a bug, SIGINT on Ctrl-C
        run_command("troll train", lambda: train(cfg), resume="troll train --out x --resume true")

- `UsageError` (and troll.run.harness.RunError, one of them) is a problem with the arguments, files or environment that
  the user resolves: its message names it and the fix; the command prints `<prog>: error: <message>` and exits 2.
- The expected failures of a file system and of damaged files end the same way, one line and exit 2 (`expected`),
  naming the file from the exception where it carries one:
  - OSError: permission denied, a folder where a file belongs and a file where a folder belongs, a missing file or
    parent folder, a full disk (finished checkpoints are kept; the line says how to continue), a read-only file
    system, any other errno;
  - a damaged file: JSON that does not parse, bytes that are not UTF-8, a safetensors file (SafetensorError), a
    torch.load file (pickle.UnpicklingError, EOFError, the zip reader's "PytorchStreamReader failed ..."); torch's
    and safetensors' failed writes (a full disk) too. The commands name the file where they read it (a UsageError),
    so this is the fallback for a read site that does not;
  - an optional package that is missing (ImportError, but one of troll's own modules).
- A closed pipe on stdout (`troll inspect RUN | head`) ends quietly with 141, as a shell reports a command
  stopped by SIGPIPE.
- Ctrl-C (KeyboardInterrupt) prints `<prog>: interrupted` with the command that continues, if there is one, and
  the process then ends by SIGINT after Python's normal shutdown, as an uncaught KeyboardInterrupt ends it: a shell
  reports 130, and a shell loop over runs (`for s in 1 2 3; do troll train ...; done`) stops too, which
  it does not after a plain exit 130 (bash takes that as a Ctrl-C the command handled). Always so, not only when
  CPython decides it: a KeyboardInterrupt that passes through Python source an extension runs (PyRun_String, as
  pybind11's `py::exec` does) makes CPython end a `python -m` run by SIGINT even after a SystemExit(130).
  A Ctrl-C that lands in a finalizer (`__del__`), where Python prints and drops the KeyboardInterrupt, is
  remembered and ends the command the same way when its work returns (`remembered_interrupts`).
- Every command's flags are parsed by `Parser` (argparse.ArgumentParser, subparsers included): a flag is never
  abbreviated (`--step 5` is refused, not taken as `--steps 5`), and a refused flag is the same one line, with
  `(<prog> --help lists the flags)` added, not argparse's usage block, and `; did you mean --steps?` after it when an
  unknown flag is close to one of the command's (`close_flag`); `--help` prints the full help.
- Progress bars draw on a terminal only: before a command's work, `run_command` turns the libraries' bars off when
  stderr is a file or a pipe (`bars_on_a_terminal_only`), so a log gets lines.
- A count is checked against the memory it implies before the work that would hold it: `free_memory` is what this
  process can still take (the machine's available memory, within an address-space limit), `gib` writes a size.
Any other exception is a bug: it keeps its traceback, followed by one line saying that it is a bug in troll to
report with that traceback, and exit 1. This module imports nothing heavy: commands use it before torch is loaded
(torch's and safetensors' exceptions are recognised by their module and name).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import json
import os
import pickle
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

INTERRUPTED = 130  # the shell's exit status for a process stopped by SIGINT (troll.tools.check's child exits with it)
BROKEN_PIPE = 141  # the shell's for one stopped by SIGPIPE: its output's reader closed the pipe (`| head`)


class UsageError(Exception):
    """A problem the user resolves (arguments, files, environment); the message names it and the fix."""


def fail(prog: str, message: str) -> NoReturn:
    """One line on stderr, exit 2 (argparse's status for a usage error)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def run_command(prog: str, main: Callable[[], Any], resume: str | None = None) -> NoReturn:
    """Run a command's `main`; a UsageError, an expected failure (`expected`) and Ctrl-C end it with one line, a bug
    with its traceback and a line saying so (module docstring). An int that `main` returns is the exit status
    (troll.tools.check's 1 for a failed check); anything else exits 0."""
    bars_on_a_terminal_only()
    try:
        with remembered_interrupts() as interrupts:
            status = main()
        if interrupts:  # a Ctrl-C that a finalizer swallowed: the command still ends as interrupted
            raise KeyboardInterrupt
    except UsageError as e:
        fail(prog, str(e))
    except KeyboardInterrupt:
        then = f"; continue with: {resume}" if resume else ""
        print(f"\n{prog}: interrupted{then}", file=sys.stderr)
        sys.excepthook = quiet_interrupt  # the line above is all it says; CPython then ends the process by SIGINT
        raise
    except BrokenPipeError:  # stdout's reader has gone (`... | head`): nothing more to say, and no one to hear it
        with contextlib.suppress(OSError, ValueError):  # Python's flush at exit would fail again: stdout to devnull
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(BROKEN_PIPE) from None
    except Exception as e:
        message = expected(e, resume)
        if message is not None:
            fail(prog, message)
        traceback.print_exc()
        print(
            f"{prog}: error: this is a bug in troll ({type(e).__name__}): please report it with the traceback above",
            file=sys.stderr,
        )
        raise SystemExit(1) from None
    raise SystemExit(status if isinstance(status, int) else 0)


@contextlib.contextmanager
def remembered_interrupts() -> Iterator[list[int]]:
    """SIGINT raises KeyboardInterrupt, as Python's own handler does, and is also remembered in the list yielded. A
    KeyboardInterrupt raised inside a finalizer (`__del__`, a weakref callback, which a library's garbage may run at
    any moment) is only printed as "Exception ignored in ..." and the command goes on as if no Ctrl-C came; with the
    list, `run_command` still ends it as interrupted, and that print is left out (the one line says it). A SIGINT
    the command inherited as ignored (`nohup`, a shell's background job) stays ignored; both hooks are restored."""
    seen: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield seen
        return

    def remember(signum: int, frame: Any) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    def unraisable(info: Any) -> None:
        if not (seen and isinstance(info.exc_value, KeyboardInterrupt)):
            hook(info)

    hook, ours = sys.unraisablehook, signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, remember)
    sys.unraisablehook = unraisable
    try:
        yield seen
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = hook


def bars_on_a_terminal_only() -> None:
    """Progress bars draw on a terminal only: with stderr sent to a file or a pipe, huggingface_hub's,
    transformers' and plain tqdm's bars (model loading, "Writing model shards") are off, as troll's own are (tqdm's
    disable=None). `run_command` calls it before a command's work. The libraries read HF_HUB_DISABLE_PROGRESS_BARS
    and TQDM_DISABLE when first imported: transformers and huggingface_hub imported already have their bars turned
    off through their own switch, and a plain tqdm imported already keeps its default, so a command that imports
    one at its own import calls this first (troll.train) and a bar drawn through it passes disable=None (troll's
    own, troll.models.packaged's GGUF conversion). HF_HUB_DISABLE_PROGRESS_BARS set other than 1 is the user's choice of
    bars: nothing is changed."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] != "1":  # the user's own choice: bars
        return
    os.environ.setdefault("TQDM_DISABLE", "1")
    if "transformers" in sys.modules:  # its switch read the environment at its import; it turns the hub's off too
        sys.modules["transformers"].utils.logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()


def free_memory() -> int | None:
    """Bytes of memory this process can still take: the machine's available memory (/proc/meminfo's MemAvailable,
    else its physical memory), and under an address-space limit (`ulimit -v`, RLIMIT_AS) no more than the limit
    leaves; None where neither can be read. A command checks what a count implies against it before its work."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        free = int(next(line.split()[1] for line in meminfo.splitlines() if line.startswith("MemAvailable:"))) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        try:
            free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        status = Path("/proc/self/status").read_text()
        used = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024
    except (ImportError, OSError, StopIteration, ValueError, IndexError):
        return free
    return free if limit == resource.RLIM_INFINITY else max(0, min(free, limit - used))


def gib(size: int) -> str:
    """`size` bytes in GiB for a message ("1.5 GiB"), a size past a float's range too (an absurd count's)."""
    return f"{size / 2**30:.3g} GiB" if size < 2**1000 else f"more than 10^{len(str(size)) - 11} GiB"


def quiet_interrupt(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    """sys.excepthook once `run_command` has said a Ctrl-C: nothing more for the KeyboardInterrupt (no traceback),
    any other exception as Python prints it."""
    if not issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)


def expected(e: BaseException, resume: str | None = None) -> str | None:
    """The one-line message for a failure the user or the file system caused (module docstring), or None for a
    bug. `resume`: the command that continues after a full disk."""
    if isinstance(e, OSError):
        return os_error(e, resume)
    if isinstance(e, ImportError) and not (e.name or "troll").startswith("troll"):
        return f"{e} (a missing package: pip install -r requirements.txt -e .)"
    kind, first = f"{type(e).__module__}.{type(e).__name__}", (str(e).splitlines() or [""])[0][:200]
    if kind.startswith("safetensors") and type(e).__name__ == "SafetensorError" and "while serializing" in first:
        return write_failed(f"safetensors: {first}", resume)
    if isinstance(e, RuntimeError) and "PytorchStreamWriter" in first:
        return write_failed(f"torch.save: {first}", resume)
    damaged = (json.JSONDecodeError, UnicodeDecodeError, pickle.UnpicklingError, EOFError)
    zip_reader = isinstance(e, RuntimeError) and "PytorchStreamReader" in str(e)
    if isinstance(e, damaged) or zip_reader or type(e).__name__ == "SafetensorError":
        return (
            f"a file this command reads is damaged ({type(e).__name__}: {first}): restore it, or pass another one "
            "(a run keeps its last two checkpoints)"
        )
    return None


def os_error(e: OSError, resume: str | None = None) -> str:
    """An OSError's one line: the file it names (`filename`, and `filename2` for a rename) and what to do."""
    if e.errno is None:  # raised with a message of its own (troll's, a library's): it says what to do
        return str(e)
    names = [str(n) for n in (e.filename, e.filename2) if n is not None]
    name = " -> ".join(names) if names else "a file"
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return write_failed(f"{name}: {reason}", resume)
    if e.errno == errno.EROFS:
        return f"{name} is on a read-only file system: choose a path on a writable one"
    if isinstance(e, PermissionError):
        return f"{name}: permission denied: make it readable and writable by you (chmod, chown), or choose another path"
    if isinstance(e, IsADirectoryError):
        return f"{name} is a folder where a file belongs: move it away, or choose another path"
    if isinstance(e, NotADirectoryError):
        file = next((p for p in Path(names[0]).parents if p.exists() and not p.is_dir()), None) if names else None
        where = f"{file} is a file where a folder belongs (in {name})" if file else f"{name}: not a folder"
        return f"{where}: move it away, or choose another path"
    if isinstance(e, FileNotFoundError):
        parent = Path(names[0]).parent if names else None
        if parent is not None and not parent.exists():
            return f"{name}: its folder {parent} does not exist: create it, or choose another path"
        return f"{name} does not exist: check the path"
    if isinstance(e, FileExistsError):
        return f"{name} already exists: move it away, or choose another path"
    if not names:
        return f"{type(e).__name__}: {reason}"
    code = f" ({errno.errorcode[e.errno]})" if e.errno in errno.errorcode else ""
    return f"{name}: {reason}{code}"


def write_failed(what: str, resume: str | None) -> str:
    """A write that failed for lack of space (or another I/O error): the finished checkpoints are kept."""
    then = f", then continue with: {resume}" if resume else ", then run the command again"
    return f"writing failed ({what}): free some disk space{then} (finished checkpoints are kept)"


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser for every command: no abbreviated flags, and an error is one line (`fail`), not the
    usage block. argparse's own refusals while parsing (an unknown flag, a bad value) add where the flags are listed,
    and an unknown flag close to one of the command's ends the line with it (`did you mean --lr?`, `suggest`); a
    command's own `parser.error(...)` after parsing is the plain line. Subparsers are of this class too."""

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
        if not self._parsing:
            fail(self.prog, message)
        head = self._argv[: self._argv.index("--")] if "--" in self._argv else self._argv
        flags = self._flags(head)
        unknown = [a for a in head if _flag_like(a) and a.split("=")[0] not in flags]
        if unknown and message.startswith("the following arguments are required"):
            # argparse names a missing required flag before an unknown one: `--mode x` for `--model x` would be
            # refused as "--model is required", hiding the typo; the unknown flag is what the user fixes
            message = f"unrecognized arguments: {' '.join(unknown)}; {message}"
        hint = suggest([a.split("=")[0] for a in unknown], flags) if message.startswith("unrecognized") else None
        fail(self.prog, f"{message} ({self.prog} --help lists the flags)" + (f"; {hint}" if hint else ""))

    def _flags(self, argv: Sequence[str]) -> set[str]:
        """The option strings this parser takes, and those of each subcommand named in `argv` (its subparser's)."""
        flags = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    if name in argv:
                        flags |= sub._flags(argv) if isinstance(sub, Parser) else set(sub._option_string_actions)
        return flags


def suggest(unknown: Sequence[str], flags: Sequence[str] | set[str]) -> str | None:
    """`did you mean --lr?` for the unknown flags that have a close flag among `flags` (`close_flag`), or None."""
    pairs = [(typed, near) for typed in dict.fromkeys(unknown) if (near := close_flag(typed, flags))]
    if not pairs:
        return None
    if len(pairs) == 1:
        return f"did you mean {pairs[0][1]}?"
    return "did you mean " + ", ".join(f"{near} for {typed}" for typed, near in pairs) + "?"


def close_flag(typed: str, flags: Sequence[str] | set[str]) -> str | None:
    """The flag a misspelled `typed` most likely meant, or None when none is close: the most similar one by difflib
    (`--step` -> `--steps`, `--max-new-tokens` -> `--max_new_tokens`) at a similarity of 0.75 or more, else the
    longest flag that `typed` extends by a word (`--lr_rate` -> `--lr`, `--out_dir` -> `--out`)."""
    candidates = sorted(f for f in flags if f != typed)
    near = difflib.get_close_matches(typed, candidates, n=1, cutoff=0.75)
    if near:
        return near[0]
    stems = [f for f in candidates if f.startswith("--") and typed.startswith(f) and typed[len(f)] in "_-"]
    return max(stems, key=len, default=None)


def _flag_like(arg: str) -> bool:
    """Whether a command-line argument is written as a flag (`--x`, `-x`), not a value (`-1`, `-0.5`, `-`)."""
    return arg.startswith("--") or (arg.startswith("-") and arg[1:2].isalpha())
