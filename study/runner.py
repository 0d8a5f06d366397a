"""What the studies (run.py, offpolicy.py, bandit.py, real.py) share: workers, the results file, paired statistics and
the command's common branches and rules. Each study imports this module and troll, never another study.

- Workers (`workers`, `each`, `run_all`): `--jobs N` runs N spawned worker processes (no fork of a process with
  OpenMP threads), each with cores / N torch threads; with one job the worker keeps torch's default threads, or,
  where a study asks for it (`in_process`: the bandit, whose runs take seconds), the work runs in this process.
  Jobs whose processes the memory free cannot hold (WORKER_BYTES each) are refused with the flags (`jobs_problem`).
- Results (`read_results`, `merge_results`): a JSONL file, one row per finished run, read by run name and merged
  by name after every run (rows of other grids in it are kept), rewritten atomically. A torn line, a run listed
  twice with different rows, or a foreign row (`foreign_row`: one lacking a field the study reads, or naming a cell
  or loss the study does not have: another study's file), or a damaged one (`check_rows`: a field the study reads
  not as its `FIELDS` table declares it, troll.base.schema's terms, e.g. an accuracy that is a string, null or 1.7) is
  refused with one line naming the file and the line or run (and the field); the file is left as it was.
- Paired statistics (`paired_diffs`, `t_interval`): differences between two variants on the same seed, and the 95%
  t-interval of their mean.
- The command (`save`, `report_rows`, `refuse_other_settings`, `plan`, `grid_problem`, `pm`): a figure written at
  the studies' dpi, the rows for --report / --figures, a run recorded with other settings refused rather than
  counted as done, the run count and --dry-run listing, the list flags' rules and a paired difference as text.
- Its own files only (troll.base.outputs): a study's figure carries the PNG text Software=<study> (study.figures,
  study.bandit, study.offpolicy) and replaces only a figure of that study's; every figure name is checked
  (`check_figures`) before the first is drawn, and a file of that name the study did not write, a folder or a
  symbolic link there is refused in one line, unchanged. A run's log.txt is appended to in its own (claimed) folder,
  never through a link.
- The list flags' rules (`grid_problem`), the same in every study: a value given twice (`--seeds 0 0`) is refused,
  not run twice into one folder by two workers; a value given on the command line that makes no run of the grid
  (a setting of a loss not in --losses, a variant no --cells runs) is refused, not dropped in silence.
- Flags of one mode (`given`, `inert_flag`): a study command runs in one or two modes (a run or --dry-run, --report,
  --figures, --calibrate); each study's table (`ACTS`: a flag -> the modes it acts in; a flag not in it acts in
  every mode) is the rule, and a flag typed on the command line that acts in none of the command's modes (the run's
  --sources with --report, the report's --baseline in a run) is refused before anything is read or written.
A problem the user fixes ends the command with one line on stderr and exit 2 (troll.base.cli).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import io
import json
import math
import os
import shutil
import statistics
import sys
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from troll.base import outputs
from troll.base.checkpoint import read_jsonl, rewrite_jsonl, rows_by_name
from troll.base.cli import UsageError, fail, free_memory, gib
from troll.base.config import Config
from troll.base.schema import SchemaError, Spec, fields_problem, jsonl_lines

# ----------------------------------------------------------------------------- workers


def init_worker(threads: int) -> None:
    """A worker's start: idle OpenMP threads sleep, and torch gets `threads` threads (0: its default)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads:
        import torch

        torch.set_num_threads(threads)


WORKER_BYTES = 1 << 29  # a study's worker process: torch and troll imported (0.33 GiB measured), a tiny run in it


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def jobs_problem(jobs: int) -> str | None:
    """Why --jobs `jobs` cannot run here, or None: its worker processes, WORKER_BYTES each, need more memory than is
    free (troll.base.cli.free_memory). A study checks it with its other flags, before it writes anything."""
    free = free_memory()
    if jobs < 2 or free is None or jobs * WORKER_BYTES <= free:
        return None
    return (
        f"--jobs {jobs}: each job is a worker process of about {gib(WORKER_BYTES)}, {gib(jobs * WORKER_BYTES)} in all, "
        f"more than the {gib(free)} free here: pass at most {max(1, free // WORKER_BYTES)}"
    )


@contextlib.contextmanager
def workers(jobs: int, in_process: bool = False) -> Iterator[ProcessPoolExecutor | None]:
    """`jobs` spawned worker processes, each with cores / jobs torch threads (one job: torch's default); None, the
    work in this process, when `in_process` and `jobs` is 1. A study checks --jobs first (`jobs_problem`)."""
    if in_process and jobs == 1:
        yield None
        return
    threads = max(1, cores() // jobs) if jobs > 1 else 0
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=init_worker,
                             initargs=(threads,)) as pool:  # fmt: skip
        yield pool


def each(pool: ProcessPoolExecutor | None, fn: Callable, calls: Sequence[tuple]) -> Iterator:
    """fn(*call) for every call, each result as soon as it is ready: on the pool's workers, or one after the other
    in this process when `pool` is None."""
    if pool is None:
        yield from (fn(*call) for call in calls)
        return
    for future in as_completed([pool.submit(fn, *call) for call in calls]):
        yield future.result()


def run_all(
    pool: ProcessPoolExecutor | None, fn: Callable, calls: Sequence[tuple], results: Path, line: Callable[[dict], str]
) -> list[dict]:
    """Every call's results row (`each`), merged into the results file as it comes and announced as
    "[i/n] <line(row)>"; returns the rows."""
    rows = []
    for i, row in enumerate(each(pool, fn, calls), 1):
        merge_results(results, [row])
        rows.append(row)
        print(f"[{i}/{len(calls)}] {line(row)}", flush=True)
    return rows


def train_run(cfg: Config, final: bool = False) -> Path:
    """Train one run in this (worker) process, or resume it where it stopped (troll.run.harness: with no checkpoint
    yet it starts from the beginning), its output to <out>/log.txt; its checkpoints are deleted once it is done.
    With `final`, its last checkpoint's model and tokenizer are kept first, as the model folder <out>/final (its
    optimiser state, trainer.pt, deleted with the rest)."""
    from troll.run.harness import claim_folder
    from troll.train import train

    out = Path(cfg.out)
    if (out / "summary.json").is_file():  # finished, its results row not yet written (the caller checked its settings)
        return out
    # the run's folder before log.txt is written in it (troll.run.harness: a run writes only in its own)
    claim_folder(out)
    path = out / "log.txt"
    if path.is_symlink():
        raise UsageError(f"{path} is a symbolic link, never written through: remove it, or choose another --out")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    with open(fd, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train(replace(cfg, resume=True))
    if final:
        last = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
        last.rename(out / "final")  # onto nothing: the run's folder is its own, and the run had no final model
        (out / "final" / "trainer.pt").unlink()
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- the results file


# The fields of a study's rows that it reads (a study's FIELDS, troll.base.schema's terms): each field's kind, range and
# allowed values (`choices`). A row that lacks a required field or holds a value not among a field's choices is
# another study's (`foreign_row`); any other value not as declared is a damaged row (a SchemaError). Fields a table
# does not declare may hold anything (rows carry more than their study reads).
Fields = Mapping[str, Spec]
NAME = Spec("string")
SEED = Spec("integer")
LR = Spec("number", low=0)
ACCURACY = Spec("number", low=0, high=1)  # a share of the evaluation's problems solved
FLOAT = Spec("float")  # a measurement: NaN and infinities too, as json.dumps writes a float that is one
OBJECT = Spec("object")
PER_STEP = Spec("float", per_token=True, per="step")  # one measurement per RL step


def one_of(values: Collection[str], required: bool = True) -> Spec:
    """A field that holds one of `values` (a study's losses, cells, ...): another value is another study's row."""
    return Spec("string", choices=tuple(values), required=required)


class ForeignRow(ValueError):
    """A results row that is not one of the study's: another study's file, or a row a person edited."""


def foreign_row(row: dict, fields: Fields) -> str:
    """What makes `row` not a row of the study whose rows hold `fields` (the required fields it lacks, a value not
    among a field's choices); empty when it is one."""
    missing = [f for f, spec in fields.items() if spec.required and f not in row]
    problems = [f"lacks {', '.join(missing)}"] if missing else []
    problems += [
        f"its {f} {row[f]!r} is none of {', '.join(spec.choices)}"
        for f, spec in fields.items()
        if spec.choices and f in row and row[f] not in spec.choices
    ]
    return "; ".join(problems)


def check_rows(path: Path, rows: Sequence[dict], fields: Fields, study: str) -> None:
    """A ForeignRow naming the file, the line and what the file should hold when a row is not one of `study`'s
    (`foreign_row`); a SchemaError (troll.base.schema) naming the file, the line, the run and the field when a field it
    declares is not as declared (a string, null or 1.7 for an accuracy). `rows` are read_jsonl's: one per non-blank
    line of the file, in order."""
    for n, row in zip(jsonl_lines(Path(path)), rows, strict=True):
        run = f"the row of run {row.get('name', '?')!r}"
        required = ", ".join(f for f, spec in fields.items() if spec.required)
        if problem := foreign_row(row, fields):
            raise ForeignRow(
                f"{path} line {n}: {run} {problem}: not a row of {study}; "
                f"--results must name a file of {study}'s rows (each with {required})"
            )
        refuse_damaged(path, n, row, fields)


def refuse_damaged(path: Path, n: int, row: dict, fields: Fields) -> None:
    """A SchemaError naming the file, line `n`, the run and the field when a field of `row` that `fields` declares
    is missing (where required) or not as declared; fields it does not declare may hold anything."""
    if found := fields_problem({k: row[k] for k in fields if k in row}, fields, 1):
        where, what = found
        run = f"the row of run {row['name']!r}" if type(row.get("name")) is str else "a row"
        raise SchemaError(f"{path} line {n}: {run}: {where} {what}: fix or remove that row (its run is run again)")


def read_rows(
    path: Path, reader: Callable[[Path], list[dict]] = read_jsonl, fields: Fields | None = None, study: str = ""
) -> dict[str, dict]:
    """The results file's rows (read by `reader`) by run name, empty when there is no file; a torn, conflicting or
    (with `fields`) foreign row is a ValueError naming the file and the line or run."""
    if not path.is_file():
        return {}
    rows = reader(path)
    if fields is not None:  # a row without a run name named by its line, before the rows are read by name
        for n, row in zip(jsonl_lines(path), rows, strict=True):
            refuse_damaged(path, n, row, {"name": NAME})
    by_name = rows_by_name(path, rows)  # first: a run listed twice is named as such, whatever its rows hold
    if fields is not None:
        check_rows(path, rows, fields, study)
    return by_name


def read_results(path: Path, fields: Fields | None = None, study: str = "") -> dict[str, dict]:
    """`read_rows`, its ValueError a UsageError that says what to do."""
    try:
        return read_rows(path, fields=fields, study=study)
    except SchemaError:
        raise
    except ForeignRow as e:
        raise UsageError(str(e)) from None
    except ValueError as e:
        raise UsageError(f"{e} (fix or remove that row: its run is trained again)") from None


def merge_results(path: Path, rows: Sequence[dict]) -> None:
    """Add or replace `rows` by name, keep the others, write atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rewrite_jsonl(path, list((read_results(path) | {r["name"]: r for r in rows}).values()))


# ----------------------------------------------------------------------------- paired statistics


def paired_diffs(a: Mapping[int, float], b: Mapping[int, float]) -> list[float]:
    """a[seed] - b[seed] over the seeds both have, in a's order."""
    return [x - b[seed] for seed, x in a.items() if seed in b]


def t_interval(diffs: Sequence[float]) -> tuple[float, float]:
    """Mean and half-width of the 95% t-interval of paired differences (nan half-width for fewer than 2)."""
    try:
        from scipy.stats import t
    except ImportError:
        raise UsageError("the report's t-intervals need scipy: pip install scipy (or the dev extra)") from None

    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return mean, math.nan
    return mean, float(t.ppf(0.975, len(diffs) - 1)) * statistics.stdev(diffs) / math.sqrt(len(diffs))


# ----------------------------------------------------------------------------- the command


def figure_file(path: Path, by: str) -> outputs.Target:
    """A study's figure in --figures (--out for study.figures), its own told by the PNG text Software=<by>."""
    return outputs.figure(path, by, "--out" if by == "study.figures" else "--figures")


def check_figures(folder: Path, names: Sequence[str], by: str) -> None:
    """Before any figure is drawn: every figure name in `folder` new, or a figure of the study's own
    (troll.base.outputs); a foreign file, a folder or a link there is a UsageError naming it."""
    outputs.check([figure_file(folder / name, by) for name in names])


def save(fig, path: Path, by: str) -> Path:
    """Lay out a matplotlib figure and write it to `path` (its folder made if missing) at the studies' 110 dpi,
    marked as study `by`'s (PNG text Software=<by>), whole, and only over a figure of its own (troll.base.outputs)."""
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110, metadata=outputs.png_metadata(by))
    target = figure_file(path, by)
    outputs.check([target])
    path.parent.mkdir(parents=True, exist_ok=True)
    return outputs.write(target, png.getvalue())


def report_rows(path: Path, prog: str, fields: Fields | None = None) -> list[dict]:
    """--report / --figures: the results file's rows; an empty or missing file, or a foreign row (with `fields`),
    is a usage error."""
    rows = list(read_results(path, fields, prog).values())
    if not rows:
        fail(prog, f"{path} holds no results")
    return rows


def refuse_other_settings(prog: str, name: str, where: object, saved: dict | None, want: dict) -> None:
    """A run recorded (in `where`) with settings other than `want` is not counted as done: a usage error naming the
    run and the fields that differ. `saved` None: nothing recorded."""
    if saved is not None and saved != want:
        changed = sorted(k for k in want if saved.get(k) != want[k])
        fail(prog, f"{name} ({where}) was run with other settings ({', '.join(changed)})")


def plan(runs: Sequence, done: Mapping[str, dict], jobs: int, dry_run: bool) -> list:
    """The runs without a results row, announced with the grid's size; with `dry_run` also listed."""
    todo = [r for r in runs if r.name not in done]
    print(f"{len(runs)} runs, {len(runs) - len(todo)} done, {len(todo)} to run with {jobs} job(s)")
    for run in todo if dry_run else ():
        print(" ", run.name)
    return todo


def show(value: object) -> str:
    """A list flag's value as it is typed: 4x1 for (4, 1), 0.0001 for 1e-4."""
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def repeats(items: Sequence) -> list:
    """The items listed a second (or later) time, in order (a list: a repeated 0 is found too)."""
    seen: set = set()
    again = []
    for x in items:
        if x in seen:
            again.append(x)
        seen.add(x)
    return again


def grid_problem(
    parser: argparse.ArgumentParser, args: argparse.Namespace, runs: Sequence, flags: Mapping[str, Callable], why: str
) -> str:
    """The list flags' rules (module docstring), as the message that refuses them; empty when they hold. `flags`:
    each list flag's name and the run's value of it (e.g. {"seeds": lambda run: run.seed}); `runs`: the whole grid
    (before any --limit); `why`: what decides which values make runs, for the refusal. A flag counts as given when
    its value is not the parser's default object (argparse leaves that very list in place when the flag is absent).
    """
    for flag in flags:
        if twice := repeats(getattr(args, flag)):
            return (
                f"--{flag} lists {show(twice[0])} twice: the grid lists a run twice, which two workers would run into "
                "one folder; give each value once"
            )
    if twice := repeats([run.name for run in runs]):  # 1e-4 and 1.0000001e-4: one name
        return f"the grid lists a run twice ({twice[0]}): two values of a flag give one run name; give each value once"
    for flag, of in flags.items():
        if getattr(args, flag) is parser.get_default(flag):
            continue  # not given: the study's default list, of which the other flags may pick a part
        made = {of(run) for run in runs}
        if unused := [v for v in getattr(args, flag) if v not in made]:
            return (
                f"--{flag} {' '.join(map(show, unused))} makes no run with the other flags given ({why}); "
                f"drop it or change those flags"
            )
    return ""


# The modes of a study that runs, reports or draws (bandit, offpolicy), each as the refusal names what chooses it
REPORT_MODES = {"run": "without --report or --figures", "report": "with --report", "figures": "with --figures"}


def report_modes(args: argparse.Namespace) -> list[str]:
    """The modes of such a study's command: --report and / or --figures, or else a run (or --dry-run)."""
    return [m for m, on in (("report", args.report), ("figures", args.figures is not None)) if on] or ["run"]


def given(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> list[str]:
    """The flags typed in `argv` (sys.argv[1:] when None), each once in the order typed, by its long name:
    `--flag value` and `--flag=value` alike, nothing after `--`. A flag left at its default is not given, even
    where its value equals the default (`--steps 40` is given)."""
    actions = parser._option_string_actions  # argparse's own map of option strings (no abbreviations: troll.base.cli)
    typed = []
    for arg in sys.argv[1:] if argv is None else argv:
        if arg == "--":
            break
        action = actions.get(arg.split("=", 1)[0]) if arg.startswith("-") else None
        if action is not None and (flag := max(action.option_strings, key=len)) not in typed:
            typed.append(flag)
    return typed


def inert_flag(
    parser: argparse.ArgumentParser,
    argv: Sequence[str] | None,
    acts: Mapping[str, Collection[str]],
    active: Collection[str],
    modes: Mapping[str, str],
) -> str:
    """The refusal of the first flag given (`given`) that acts in none of the `active` modes, empty when each one
    acts. `acts`: a flag -> the modes it acts in (a flag not in it acts in every mode); `modes`: each mode -> what
    chooses it, as the message says it ("with --report")."""
    for flag in given(parser, argv):
        where = acts.get(flag)
        if where is not None and not set(where) & set(active):
            return (
                f"{flag} cannot act {' and '.join(modes[m] for m in active)}: it acts only "
                f"{' or '.join(modes[m] for m in where)}; drop it"
            )
    return ""


def pm(diff: float, half: float, fmt: str = "+.3f", half_fmt: str = ".3f") -> str:
    """A paired difference and its 95% half-width as the reports print it: "-" with no paired seed (no baseline run
    to pair with), "(1 seed)" in place of a half-width that one seed cannot give."""
    if math.isnan(diff):
        return "-"
    return f"{diff:{fmt}} (1 seed)" if math.isnan(half) else f"{diff:{fmt}} ± {half:{half_fmt}}"


def save_warm(
    out: Path,
    model: Any,
    tokenizer: Any,
    warm: dict,
    problem: Callable[[Path], str | None],
    check: Callable[[Path], None] | None = None,
) -> None:
    """A seed's warm-start saved whole at `out`: model, tokenizer and `warm` as warm.json into a new folder of its own
    (made exclusively), `check(folder)` on it, then renamed onto `out`, onto nothing or an empty folder, never over a
    file or through a link. Something that appeared at `out` meanwhile is a UsageError (`problem(out)`, the study's
    own reading of it); the new folder is removed on any failure."""
    work = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    work.mkdir()
    try:
        model.save_pretrained(work)
        tokenizer.save_pretrained(work)
        if check:
            check(work)
        (work / "warm.json").write_text(json.dumps(warm, indent=2) + "\n")
        try:
            os.rename(work, out)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
            raise UsageError(problem(out) or f"{out} appeared during the warm-start: run it again") from None
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)  # its own folder, made above
        raise
