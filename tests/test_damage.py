"""The damage sweep (issue 40): every file that a finished run, a LoRA run (with its `<out>/base`), an export, a
study's results file and the real-model study's GSM8K evaluations hold, each damage (deleted, truncated to half,
garbled bytes in the middle, emptied, made read-only, replaced by a folder), against each command that reads it
(resume, troll.tools.evaluate, troll.tools.export, troll.tools.plot, troll.tools.inspect, the studies' reports).

The invariant: exit 0 with a correct result, or a non-zero exit whose last stderr line is one line naming the file
(its path or name) and the way forward; never a traceback, and no progress bar (the output is not a terminal); and
after any command, every finished checkpoint that was whole before is still whole (its bytes unchanged), or was
rotated out by two newer whole ones (a run keeps its last two).

The cases come from the file listing of real artifacts (`files`), so a file a new troll writes is swept without a
change here. Each case runs on a copy of the pristine artifact, its command in this process (`invoke`: runpy with
sys.argv patched, its output captured; SystemExit is the exit status, any other exception a traceback). The whole
sweep is slow-marked; the quick suite runs a few cases of it (`test_a_sample_of_the_sweep`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import runpy
import shutil
import stat
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from troll.base.checkpoint import check_checkpoint, damaged_file

TINY = ["--sft_steps", "0", "--steps", "2", "--eval_size", "4", "--eval_every", "1", "--save_every", "1"]
TINY += ["--prompts_per_step", "2", "--samples_per_prompt", "2"]
DONE = 2  # the tiny runs' steps: resume asks for one more
BAR = re.compile(r"\r|\d+/\d+ \[\d+:\d+")  # a redraw, or tqdm's "3/12 [00:01" (its bar's text, drawn once)


# ------------------------------------------------------------------------------------------------ running commands


@dataclass(frozen=True)
class Result:
    status: int | None  # None: an exception other than SystemExit escaped (a traceback)
    out: str
    err: str


def invoke(module: str, *argv: str) -> Result:
    """`python -m module argv` in this process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    saved = sys.argv
    sys.argv = [module, *argv]
    status: int | None = None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*found in sys.modules", category=RuntimeWarning)  # runpy's
            try:
                runpy.run_module(module, run_name="__main__")
                status = 0
            except SystemExit as e:
                status = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            except Exception:
                err.write(traceback.format_exc())
    finally:
        sys.argv = saved
    return Result(status, out.getvalue(), err.getvalue())


def made(result: Result) -> None:
    assert result.status == 0, result.err[-3000:]


# ------------------------------------------------------------------------------------------------ the artifacts


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    """A finished tiny run, full fine-tuning."""
    out = tmp_path_factory.mktemp("pristine") / "full"
    made(invoke("troll.train", "--out", str(out), *TINY))
    return out


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    """A finished tiny LoRA run: adapters in its checkpoints, its own base in <out>/base."""
    out = tmp_path_factory.mktemp("pristine") / "lora"
    made(invoke("troll.train", "--out", str(out), "--lora_rank", "4", *TINY))
    return out


@pytest.fixture(scope="module")
def lora_export(lora_run, tmp_path_factory) -> Path:
    """The LoRA run merged by troll.tools.export: a plain model folder."""
    out = tmp_path_factory.mktemp("pristine") / "export"
    made(invoke("troll.tools.export", str(lora_run), "--out", str(out)))
    return out


@pytest.fixture(scope="module")
def study_results(tmp_path_factory) -> Path:
    """A bandit study's results file (two variants, two seeds: the report's paired differences), in a folder."""
    out = tmp_path_factory.mktemp("pristine") / "study"
    flags = ["--cells", "issue", "--variants", "troll-0.05", "clip-0.2", "--seeds", "0", "1", "--steps", "2"]
    made(invoke("study.bandit", *flags, "--samples", "4", "--results", str(out / "results.jsonl")))
    return out


@pytest.fixture(scope="module")
def real_gsm8k(tmp_path_factory) -> Path:
    """The real-model study on the tiny model (one seed, one lr a loss, one step) in <root>/runs, its results in
    <root>/r.jsonl, and GSM8K before and after its runs (study.real_gsm8k) in <root>/runs/gsm8k."""
    root = tmp_path_factory.mktemp("pristine") / "real"
    where = ["--out", str(root / "runs"), "--results", str(root / "r.jsonl")]
    from study import real, real_gsm8k  # imported, not run as __main__: the study's worker pickles its functions

    real.main(["--model", "tiny", "--seeds", "0", "--lrs", "1e-5", "--steps", "1", "--eval_size", "2", "--sft_steps",
               "1", "--stability_seeds", "0", *where])  # fmt: skip
    data = str(Path(__file__).resolve().parent / "data" / "gsm8k")  # the repository's sample of GSM8K
    real_gsm8k.main([*where, "--data", data, "--limit", "2", "--samples", "2", "--max_new_tokens", "4"])
    return root


@pytest.fixture(scope="module")
def evaluated_run(full_run, tmp_path_factory) -> Path:
    """The full run with an evaluation of it in <run>/evals (greedy and samples), which the same command continues."""
    out = tmp_path_factory.mktemp("pristine") / "evaluated"
    shutil.copytree(full_run, out)
    made(invoke("troll.tools.evaluate", "--model", str(out), *EVAL, *SAMPLED, "--out", str(out / "evals")))
    return out


ARTIFACTS = {"full": "full_run", "lora": "lora_run", "export": "lora_export", "study": "study_results",
             "evaluation": "evaluated_run", "real": "real_gsm8k"}  # fmt: skip


def files(root: Path) -> list[Path]:
    """Every file of an artifact, relative to it (a run's .lock, which names its last holder, left out)."""
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() and p.name != ".lock")


# ------------------------------------------------------------------------------------------------ the damages


def garble(path: Path) -> None:
    """16 bytes of 0xff in the middle (not UTF-8, not JSON; NaN in float32 tensor data), the length kept."""
    data = path.read_bytes()
    middle = len(data) // 2
    n = min(16, len(data) - middle)
    path.write_bytes(data[:middle] + b"\xff" * n + data[middle + n :])


def read_only(path: Path) -> None:
    """chmod 0o444; as root, whom no mode stops, also the immutable attribute (chattr +i), which stops every process
    from writing, renaming or removing the file (`writable_again` undoes it)."""
    path.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True, capture_output=True)


def to_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


DAMAGES: dict[str, Callable[[Path], None]] = {
    "deleted": Path.unlink,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "garbled": garble,
    "emptied": lambda p: p.write_bytes(b""),
    "read-only": read_only,
    "folder": to_folder,
}


def writable_again(root: Path) -> None:
    """Undo `read_only`'s immutable attribute under `root`, so the folder can be removed."""
    if os.geteuid() == 0 and root.exists():
        subprocess.run(["chattr", "-R", "-i", str(root)], capture_output=True)


def read_only_stops_writes(tmp_path: Path) -> bool:
    """Whether `read_only` stops this process from writing here (chattr can fail on some file systems)."""
    probe = tmp_path / "probe"
    probe.write_text("")
    try:
        DAMAGES["read-only"](probe)
        with open(probe, "a"):
            return False
    except (OSError, subprocess.CalledProcessError):
        return True
    finally:
        writable_again(probe)


# ------------------------------------------------------------------------------------------------ the commands


def checkpoint_of(root: Path, rel: Path) -> Path:
    """The checkpoint folder holding file `rel` of run `root`, else the run itself: what a command that takes either
    is given to read that file."""
    parts = rel.parts
    return root / parts[0] / parts[1] if len(parts) > 2 and parts[0] == "checkpoints" else root


def latest_or_outside(root: Path, rel: Path) -> bool:
    """Whether file `rel` of run `root` is one resume reads: outside the checkpoints, or in the one `latest` names
    (the older one is read only when that one is damaged, a case of its own)."""
    ckpt = checkpoint_of(root, rel)
    return ckpt == root or ckpt.name == (root / "checkpoints" / "latest").read_text().strip()


def resumed(root: Path, work: Path, result: Result) -> str | None:
    summary = json.loads((root / "summary.json").read_text())
    latest = root / "checkpoints" / (root / "checkpoints" / "latest").read_text().strip()
    if summary.get("steps") != DONE + 1 or latest.name != f"step-{DONE + 1:06d}" or check_checkpoint(latest):
        return f"resume exited 0 without a whole checkpoint at step {DONE + 1}: {latest}, {summary}"
    return None


def evaluated(root: Path, work: Path, result: Result) -> str | None:
    summary = json.loads((work / "eval" / "summary.json").read_text())
    return None if summary["n"] == 2 and 0 <= summary["accuracy"] <= 1 else f"evaluate wrote {summary}"


def continued(root: Path, work: Path, result: Result) -> str | None:
    """The evaluation's files whole again: 2 problems of 2 samples each, summarised."""
    summary = json.loads((root / "evals" / "summary.json").read_text())
    lines = [json.loads(x) for x in (root / "evals" / "predictions.jsonl").read_text().splitlines()]
    whole = summary["n"] == len(lines) == 2 and all(len(x["samples"]) == 2 for x in lines)
    return None if whole and summary["pass@k"]["2"] >= summary["pass@k"]["1"] else f"evaluate wrote {summary}"


def exported(root: Path, work: Path, result: Result) -> str | None:
    merged = work / "merged"
    whole = (merged / "config.json").is_file() and (merged / "model.safetensors").is_file()
    return None if whole and damaged_file(merged) is None else f"export wrote {sorted(os.listdir(merged))}"


def plotted(root: Path, work: Path, result: Result) -> str | None:
    return None if (work / "plots" / "metrics.png").is_file() else "plot wrote no figure"


def inspected(root: Path, work: Path, result: Result) -> str | None:
    shown = " at step " in result.out and (work / "page.html").is_file()
    return None if shown else f"inspect printed {result.out[-500:]!r} and wrote no page"


def reported(root: Path, work: Path, result: Result) -> str | None:
    return None if "| cell |" in result.out else f"the report printed {result.out[-500:]!r}"


def gsm8k_reported(root: Path, work: Path, result: Result) -> str | None:
    return None if "| model | problems |" in result.out else f"the report printed {result.out[-500:]!r}"


def drawn(root: Path, work: Path, result: Result) -> str | None:
    return None if (work / "figures" / "bandit_steps.png").is_file() else "the study drew no figure"


@dataclass(frozen=True)
class Command:
    """A command that reads an artifact's files: its module, its arguments for a damaged file, which files it is run
    for, and the check of its result when it exits 0."""

    module: str
    argv: Callable[[Path, Path, Path], list[str]]  # (artifact copy, damaged file relative to it, work folder)
    ok: Callable[[Path, Path, Result], str | None]
    reads: Callable[[Path, Path], bool] = lambda root, rel: True  # (pristine artifact, file relative to it)


EVAL = ["--task", "addition", "--limit", "2", "--max_new_tokens", "4", "--backend", "hf"]  # the task the runs learn
SAMPLED = ["--samples", "2"]
COMMANDS = {
    "resume": Command(
        "troll.train",
        lambda root, rel, work: ["--out", str(root), "--resume", "true", "--steps", str(DONE + 1)],
        resumed,
        latest_or_outside,
    ),
    "evaluate": Command(
        "troll.tools.evaluate",
        lambda root, rel, work: ["--model", str(checkpoint_of(root, rel)), *EVAL, "--out", str(work / "eval")],
        evaluated,
    ),
    "continue": Command(  # the evaluation's own files, read to continue it
        "troll.tools.evaluate",
        lambda root, rel, work: ["--model", str(root), *EVAL, *SAMPLED, "--out", str(root / "evals")],
        continued,
        lambda root, rel: rel.parts[0] == "evals",
    ),
    "export": Command(
        "troll.tools.export",
        lambda root, rel, work: [str(checkpoint_of(root, rel)), "--out", str(work / "merged")],
        exported,
    ),
    "plot": Command(  # it reads metrics.jsonl: run for each file beside it
        "troll.tools.plot",
        lambda root, rel, work: [str(root), "--out", str(work / "plots")],
        plotted,
        lambda root, rel: rel.parent == Path("."),
    ),
    "inspect": Command(  # it reads config.json, tokens.jsonl and metrics.jsonl (the accuracy at the step)
        "troll.tools.inspect",
        lambda root, rel, work: [str(root), "--out", str(work / "page.html")],
        inspected,
        lambda root, rel: str(rel) in ("config.json", "tokens.jsonl", "metrics.jsonl"),
    ),
    "bandit-report": Command(
        "study.bandit", lambda root, rel, work: ["--report", "--results", str(root / rel)], reported
    ),
    "gsm8k-report": Command(  # the study's results and each evaluation's summary.json
        "study.real_gsm8k",
        lambda root, rel, work: ["--report", "--out", str(root / "runs"), "--results", str(root / "r.jsonl")],
        gsm8k_reported,
        lambda root, rel: str(rel) == "r.jsonl" or (rel.parts[:2] == ("runs", "gsm8k") and rel.name == "summary.json"),
    ),
    "bandit-figures": Command(
        "study.bandit",
        lambda root, rel, work: ["--figures", str(work / "figures"), "--results", str(root / rel)],
        drawn,
    ),
}
READERS = {  # the commands that read each artifact's files
    "full": ("resume", "evaluate", "plot", "inspect"),
    "lora": ("resume", "evaluate", "export", "plot"),
    "export": ("evaluate",),
    "study": ("bandit-report", "bandit-figures"),
    "evaluation": ("continue",),
    "real": ("gsm8k-report",),
}
CASES = [
    (artifact, command, damage) for artifact, commands in READERS.items() for command in commands for damage in DAMAGES
]

# ------------------------------------------------------------------------------------------------ the invariant


def whole_checkpoints(root: Path, damaged: Path) -> dict[Path, dict[str, bytes]]:
    """Every checkpoint folder of run `root` that the damage left whole, with its files' bytes."""
    found = {}
    for ckpt in sorted((root / "checkpoints").glob("step-*")) if (root / "checkpoints").is_dir() else []:
        if ckpt not in damaged.parents and check_checkpoint(ckpt) is None:
            found[ckpt] = {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}
    return found


def kept(before: dict[Path, dict[str, bytes]]) -> str | None:
    """Whether each checkpoint whole before the command is unchanged, or rotated out by two newer whole ones."""
    for ckpt, contents in before.items():
        if ckpt.exists():
            now = {str(p.relative_to(ckpt)): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}
            if now != contents:
                return f"the whole checkpoint {ckpt} was changed"
            continue
        newer = [c for c in ckpt.parent.glob("step-*") if c.name > ckpt.name and check_checkpoint(c) is None]
        if len(newer) < 2:
            return f"the whole checkpoint {ckpt} was lost"
    return None


def run_case(pristine: Path, artifact: str, command: str, damage: str, rel: Path, work: Path) -> str | None:
    """One case on a copy of the artifact in folder `work` (whose name must not name the file, which the error line
    must): the breach of the invariant, or None."""
    root = work / pristine.name
    shutil.copytree(pristine, root)
    DAMAGES[damage](root / rel)
    before = whole_checkpoints(root, root / rel)
    cmd = COMMANDS[command]
    result = invoke(cmd.module, *cmd.argv(root, rel, work))
    where = f"{command} after {rel} {damage}"
    print(f"{artifact} {where}: exit {result.status}: {(result.err.strip().splitlines() or [''])[-1]}")  # pytest -s
    if result.status is None or "Traceback" in result.err:
        return f"{where}: a traceback\n{result.err[-2500:]}"
    if bar := BAR.search(result.out + result.err):  # its output here is not a terminal
        return f"{where}: a progress bar in output that is not a terminal: {bar.group()!r}"
    if result.status == 0:
        try:
            problem = cmd.ok(root, work, result)
        except (OSError, ValueError, KeyError) as e:
            problem = f"its result cannot be read ({type(e).__name__}: {e})"
        if problem:
            return f"{where}: exit 0, but {problem}"
    else:
        lines = result.err.strip().splitlines()
        line = lines[-1] if lines else ""
        if ": error: " not in line or not re.search(rf"(?<![\w.-]){re.escape(rel.name)}(?![\w.-])", line):
            return f"{where}: exit {result.status}, and its last line does not name {rel.name}: {line!r}"
    if problem := kept(before):
        return f"{where}: {problem}"
    return None


def sweep(request, tmp_path: Path, cases: list[tuple[str, str, str, Path]]) -> None:
    """Run `cases` (artifact, command, damage, file); one assertion listing every breach."""
    breaches = []
    for n, (artifact, command, damage, rel) in enumerate(cases):
        pristine = request.getfixturevalue(ARTIFACTS[artifact])
        try:
            breach = run_case(pristine, artifact, command, damage, rel, tmp_path / f"case{n}")
        finally:
            writable_again(tmp_path / f"case{n}")
        if breach:
            breaches.append(breach)
    assert not breaches, f"{len(breaches)} of {len(cases)} cases break the invariant:\n\n" + "\n\n".join(breaches)


def cases_of(request, artifact: str, command: str, damage: str) -> list[tuple[str, str, str, Path]]:
    pristine = request.getfixturevalue(ARTIFACTS[artifact])
    return [(artifact, command, damage, rel) for rel in files(pristine) if COMMANDS[command].reads(pristine, rel)]


@pytest.mark.slow
@pytest.mark.parametrize(("artifact", "command", "damage"), CASES)
def test_the_damage_sweep(artifact, command, damage, request, tmp_path):
    if damage == "read-only" and not read_only_stops_writes(tmp_path):
        pytest.skip("neither chmod 0o444 nor chattr +i stops this process's writes here: the damage is no damage")
    sweep(request, tmp_path, cases_of(request, artifact, command, damage))


def test_a_sample_of_the_sweep(request, tmp_path):
    """Six cases of the full run's sweep, the same ones every time: every file's damage, each command, in turn."""
    every = [case for a, c, d in CASES if a == "full" and d != "read-only" for case in cases_of(request, a, c, d)]
    sweep(request, tmp_path, every[:: len(every) // 6][:6])
