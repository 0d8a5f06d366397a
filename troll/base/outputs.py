"""Where a command writes: only over files it can tell it wrote, never through a symbolic link (docs/misuse.md, "Only
its own files"). troll.tools.evaluate, troll.tools.inspect, the studies and the benchmarks write through this module;
troll.train and troll.tools.plot keep the same rule in troll.run.harness and troll.tools.plot.

Every file a command writes is a `Target`: its path, and how the command tells that a file already there is its
own. Before anything is written the command checks all of them (`check`), and one of them is refused in one line
(a UsageError naming the file and the way forward) when it is

- a symbolic link (to a file, a folder or nothing): never written through and never replaced, so the user's link
  and what it points to stay as they are;
- a folder, or anything else that is not a regular file;
- a file the command cannot tell it wrote;
- in a folder that is a file (`--out a-file/page.html`: `a-file` is a file, not a folder).

A file of another name in the same folder is left alone. Then each file is written whole (`write`, `writing`): into a
new temporary file beside it (created exclusively, never through a link), checked again, then put in place by
`os.replace` over the command's own earlier file (a reader sees the old file or the new one, never half of one), or
by `os.link` where there was none (a file or link that appeared at that name since the check is kept, and the write
refused: a link never replaces anything).

How a command tells its own file, the simplest way each file type allows:

- a PNG figure carries the PNG text entry Software=<command> (`figure`), as troll.tools.plot's figures do;
- a JSON object carries "written_by": <command> at its top level (`json_file`);
- a text log starts with a header line naming the command (`log_file`);
- other files (troll.tools.evaluate's predictions.jsonl, summary.json) lie in a folder holding the command's marker,
  `.<command>` (`.troll-evaluate`), which lists the names the command writes there and is written before any of
  them (`Marked`): a file of such a name is the command's own where the marker lists it;
- a single file the user names as the output (`troll inspect --out page.html`, a benchmark's `--json`) is the
  user's choice, and a regular file there is replaced, as every tool's `-o` replaces it (`named`).

A run folder (troll.train) is marked `.troll-run` (`RUN_MARKER`) when the run claims it; `run_marker` reads that
mark without importing torch, for Config.resumed, which reads a run's files only in a folder so marked.

Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from troll.base.cli import UsageError

RUN_MARKER, RUN_MARKER_KIND = ".troll-run", "troll run"  # a run writes it first when it claims its folder
RUN_FOLDERS = ("made", "empty", "adopted")  # how the run came to own it (troll.run.harness)


def run_marker(out: Path) -> str | None:
    """The "folder" of the run marker in `out` (how the run came to own it: RUN_FOLDERS), or None where there is no
    readable marker (no such file, a link, a folder, damaged bytes, another program's JSON)."""
    marker = out / RUN_MARKER
    if marker.is_symlink() or not marker.is_file():
        return None
    try:
        mark = json.loads(marker.read_bytes())
    except (OSError, ValueError):
        return None
    ok = isinstance(mark, dict) and mark.get("kind") == RUN_MARKER_KIND and mark.get("folder") in RUN_FOLDERS
    return mark["folder"] if ok else None

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MARKER_KIND = "troll output"  # the "kind" of a folder's marker (`Marked`)
_TEMPORARY = itertools.count()  # this process's temporary files, each of a name of its own (`_temporary`)


@dataclass(frozen=True)
class Target:
    """A file a command writes.

    path:  where it goes
    ours:  whether a regular file at `path` is the command's own, so that it may be replaced
    how:   how the command tells, for the refusal ("its own carry the PNG text Software=study.figures")
    flag:  the setting that chose the place, for the way forward ("--out")
    """

    path: Path
    ours: Callable[[Path], bool]
    how: str
    flag: str


# ----------------------------------------------------------------------------- how a command tells its own files


def png_marked(path: Path, key: str, value: str) -> bool:
    """Whether file `path` is a PNG image carrying the text entry key=value among its chunks."""
    mark = f"{key}\0{value}".encode("latin-1")  # a tEXt chunk's data: key, NUL, value
    with open(path, "rb") as f:
        if f.read(8) != PNG_SIGNATURE:
            return False
        while len(head := f.read(8)) == 8:  # each chunk: length, type, data, CRC
            length, kind = struct.unpack(">I4s", head)
            if kind == b"tEXt" and length == len(mark):
                if f.read(length) == mark:
                    return True
                f.seek(4, os.SEEK_CUR)
            elif kind == b"IEND":
                return False
            else:
                f.seek(length + 4, os.SEEK_CUR)
    return False


def figure(path: Path, by: str, flag: str) -> Target:
    """A PNG figure of command `by`: its own carry the PNG text entry Software=<by>, which `png_metadata` gives
    matplotlib's savefig."""
    return Target(
        Path(path), lambda p: png_marked(p, "Software", by), f"its own carry the PNG text Software={by}", flag
    )


def png_metadata(by: str) -> dict[str, str]:
    """savefig's `metadata` that marks a figure as command `by`'s (`figure`)."""
    return {"Software": by}


def json_marked(path: Path, by: str) -> bool:
    """Whether file `path` holds a JSON object whose "written_by" is `by`."""
    try:
        obj = json.loads(path.read_bytes())
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON
        return False
    return isinstance(obj, dict) and obj.get("written_by") == by


def json_file(path: Path, by: str, flag: str) -> Target:
    """A JSON object written by command `by`: its own hold "written_by": <by>."""
    return Target(Path(path), lambda p: json_marked(p, by), f'its own hold "written_by": "{by}"', flag)


def log_file(path: Path, header: str, flag: str) -> Target:
    """A text log whose first line is `header` (one line, which its writer writes first)."""
    line = (header + "\n").encode()

    def ours(p: Path) -> bool:
        with open(p, "rb") as f:
            return f.read(len(line)) == line

    return Target(Path(path), ours, f"its own start with the line {header!r}", flag)


def named(path: Path, flag: str) -> Target:
    """The file the user named as the output: a regular file there is replaced, as a tool's `-o` replaces it."""
    return Target(Path(path), lambda p: True, "", flag)


class Marked:
    """A folder into which command `by` writes files of the names `files`, its own told by the folder's marker
    `.<by>` (dots as dashes: `.troll-evaluate`), a JSON object {"kind": "troll output", "by": <by>, "files": [...]}.
    The marker is written first (`claim`), and a file of one of the names is the command's own where the marker
    lists it; a folder without the marker is the command's to write in while it holds none of the names."""

    def __init__(self, folder: Path, by: str, files: Sequence[str], flag: str) -> None:
        self.folder, self.by, self.files, self.flag = Path(folder), by, tuple(files), flag
        self.marker = self.folder / ("." + by.replace(".", "-"))

    def listed(self) -> list[str] | None:
        """The names the folder's marker lists as the command's own; None without a marker of the command's."""
        try:
            mark = json.loads(self.marker.read_bytes())
        except (OSError, ValueError):
            return None
        if not (isinstance(mark, dict) and mark.get("kind") == MARKER_KIND and mark.get("by") == self.by):
            return None
        files = mark.get("files")
        return [f for f in files if isinstance(f, str)] if isinstance(files, list) else []

    def targets(self) -> list[Target]:
        """The marker, then every file, each with the way the command tells it is its own."""
        marker = Target(self.marker, lambda p: self.listed() is not None, f"it is not {self.by}'s marker", self.flag)
        how = f"its own are listed in {self.marker.name}, which {self.by} writes first"
        files = [Target(self.folder / n, lambda p: p.name in (self.listed() or ()), how, self.flag) for n in self.files]
        return [marker, *files]

    def target(self, name: str) -> Target:
        """The target of the file `name`."""
        return next(t for t in self.targets()[1:] if t.path.name == name)

    def claim(self) -> None:
        """Check every target (`check`), make the folder and write the marker: before any of the files."""
        check(self.targets())
        self.folder.mkdir(parents=True, exist_ok=True)
        mark = {"kind": MARKER_KIND, "by": self.by, "files": sorted({*self.files, *(self.listed() or ())})}
        write(self.targets()[0], json.dumps(mark) + "\n")


# ----------------------------------------------------------------------------- the check


def problem(target: Target) -> str | None:
    """Why `target` may not be written (module docstring), in one line naming the file, or None."""
    path, flag = target.path, target.flag
    folder = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if folder is not None:
        return f"{flag} {path}: {folder} is a file, not a folder: choose another {flag}"
    if path.is_symlink():
        return (
            f"{path} is a symbolic link, which is never written through nor replaced: remove the link (what it points "
            f"to is left alone), or choose another {flag}"
        )
    if not path.exists():
        return None
    if path.is_dir():
        return f"{path} is a folder, where a file is written: move it away, or choose another {flag}"
    if not path.is_file():
        return f"{path} is not a regular file: move it away, or choose another {flag}"
    try:
        ours = target.ours(path)
    except OSError as e:  # unreadable: not known to be the command's
        ours, target = False, Target(path, target.ours, f"{target.how}; it cannot be read: {e.strerror}", flag)
    if not ours:
        return (
            f"{path} was not written by this command ({target.how}), so it is left as it is: move it away, or "
            f"choose another {flag}"
        )
    return None


def check(targets: Sequence[Target]) -> None:
    """Refuse, before anything is written, the first target that may not be written: a UsageError, one line."""
    for target in targets:
        if message := problem(target):
            raise UsageError(message)


# ----------------------------------------------------------------------------- writing


def _temporary(path: Path) -> tuple[Path, int]:
    """A new file beside `path`, created exclusively (never through a link), and its descriptor."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{next(_TEMPORARY)}.tmp")
        try:
            return tmp, os.open(tmp, flags, 0o666)
        except FileExistsError:  # another process's (or a file of that name): the next name
            continue


def _place(tmp: Path, target: Target) -> None:
    """Put the finished temporary file `tmp` at the target's path (module docstring)."""
    if message := problem(target):  # again: something may have appeared there since the check
        raise UsageError(message)
    if target.path.exists():
        os.replace(tmp, target.path)  # the command's own file: replaced whole
        return
    try:
        os.link(tmp, target.path)  # never over a file that appeared since the check
    except FileExistsError:
        raise UsageError(problem(target) or f"{target.path} appeared while it was written: run it again") from None
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        os.replace(tmp, target.path)  # a file system without hard links


@contextlib.contextmanager
def writing(target: Target, binary: bool = False, keep_on_error: bool = False) -> Iterator[IO]:
    """A file object for the target (text, UTF-8, or `binary`), written whole: into a new temporary file beside it,
    put in place (`_place`: checked again) when the block ends. `keep_on_error`: put in place also when the block
    raises (a log, which says what went wrong); otherwise nothing is left of it."""
    tmp, fd = _temporary(target.path)
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            try:
                yield f
            except BaseException:
                if keep_on_error:
                    f.flush()
                    f.close()
                    with contextlib.suppress(UsageError, OSError):  # the block's own exception is the one to tell
                        _place(tmp, target)
                raise
            f.flush()
            os.fsync(f.fileno())
        _place(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # refused, failed, or os.link's second name


def write(target: Target, data: bytes | str) -> Path:
    """Write `data` (str as UTF-8) to the target whole (`writing`); returns its path."""
    with writing(target, binary=True) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return target.path
