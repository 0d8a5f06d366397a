"""What the three studies (run.py, offpolicy.py, bandit.py) share: workers, the results file, paired statistics and
the command's common branches. Each study imports this module and troll, never another study.

- Workers (`workers`, `each`, `run_all`): `--jobs N` runs N spawned worker processes (no fork of a process with
  OpenMP threads), each with cores / N torch threads; with one job the worker keeps torch's default threads, or,
  where a study asks for it (`in_process`: the bandit, whose runs take seconds), the work runs in this process.
- Results (`read_results`, `merge_results`): a JSONL file, one row per finished run, read by run name and merged
  by name after every run (rows of other grids in it are kept), rewritten atomically. A torn line or a run listed
  twice with different rows is refused with one line naming the file and the line or run.
- Paired statistics (`paired_diffs`, `t_interval`): differences between two variants on the same seed, and the 95%
  t-interval of their mean.
- The command (`save`, `report_rows`, `refuse_other_settings`, `plan`): a figure written at the studies' dpi, the
  rows for --report / --figures, a run recorded with other settings refused rather than counted as done, and the
  run count and --dry-run listing. A problem the user fixes ends the command with one line on stderr and exit 2
  (troll.cli).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import replace
from multiprocessing import get_context
from pathlib import Path

from troll.checkpoint import read_jsonl, rewrite_jsonl, rows_by_name
from troll.cli import UsageError, fail
from troll.config import Config

# ----------------------------------------------------------------------------- workers


def init_worker(threads: int) -> None:
    """A worker's start: idle OpenMP threads sleep, and torch gets `threads` threads (0: its default)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if threads:
        import torch

        torch.set_num_threads(threads)


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def workers(jobs: int, in_process: bool = False) -> Iterator[ProcessPoolExecutor | None]:
    """`jobs` spawned worker processes, each with cores / jobs torch threads (one job: torch's default); None, the
    work in this process, when `in_process` and `jobs` is 1."""
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


def train_run(cfg: Config) -> Path:
    """Train one run in this (worker) process, or resume it where it stopped (troll.harness: with no checkpoint
    yet it starts from the beginning), its output to <out>/log.txt; its checkpoints are deleted once it is done."""
    from troll.train import train

    out = Path(cfg.out)
    if (out / "summary.json").is_file():  # finished, its results row not yet written (the caller checked its settings)
        return out
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        train(replace(cfg, resume=True))
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    return out


# ----------------------------------------------------------------------------- the results file


def read_rows(path: Path, reader: Callable[[Path], list[dict]] = read_jsonl) -> dict[str, dict]:
    """The results file's rows (read by `reader`) by run name, empty when there is no file; a torn or conflicting
    row is a ValueError naming the file and the line or run."""
    return rows_by_name(path, reader(path)) if path.is_file() else {}


def read_results(path: Path) -> dict[str, dict]:
    """`read_rows`, its ValueError a UsageError that says what to do."""
    try:
        return read_rows(path)
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


def save(fig, path: Path) -> Path:
    """Lay out a matplotlib figure and write it to `path` (its folder made if missing) at the studies' 110 dpi."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def report_rows(path: Path, prog: str) -> list[dict]:
    """--report / --figures: the results file's rows; an empty or missing file is a usage error."""
    rows = list(read_results(path).values())
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
