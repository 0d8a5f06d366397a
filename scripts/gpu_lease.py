"""One GPU lease, prepared: every GPU check this repository has, in order of value, inside one time budget.

    bash scripts/gpu_wheels.sh                 # here, once: the wheels the GPU machine lacks, into .whl/
    bash scripts/gpu_lease.sh OUT              # there (device tool: carry .whl): about 8 minutes on an H100
    bash scripts/gpu_lease.sh --cpu OUT        # here: the rehearsal, the same parts at CPU sizes (a few minutes)

(scripts/gpu_lease.sh runs this file with $PYTHON, default python3: the standard library and troll.base.cli, nothing
else, so it runs on a machine with no network and no package index.)

Parts, each written into OUT as it runs, so a lease stopped at its limit still returns what finished:
  env.txt         GPU, driver (nvidia-smi), torch, CUDA, every package troll imports against its pin
  checks.txt      troll check at the gsm8k-qwen2.5-0.5b, gsm8k-qwen3-1.7b-lora and gsm8k-qwen3-4b-lora
                  shapes: random-weight stand-ins, transformers backend, bf16, a small batch (--cpu: --shape tiny);
                  its update comparison is the whole-update table: TROLL, this repository's PPO-clip and the
                  textbook clip (whole logits, one log-softmax), time and peak memory
  projection.txt  bench/projection.py: TROLL against PPO-clip (same gather) and the textbook clip at V = 151,936,
                  bf16, N = 16,384 tokens, supports at the cap (--head 72); time and peak memory as ratios, then
                  torch.profiler of one call of each (--profile)
  tests.txt       python -m pytest -m gpu tests/test_gpu.py (--cpu: TROLL_TEST_DEVICE=cpu runs them on CPU)
  rare.txt        with the time left: the rare-token sequence task (tiny-rare) at a 32,768-token vocabulary,
                  TROLL and PPO-clip on paired seeds, each run's held-out accuracy
  lease.log       each part's exit status and seconds, and the budget left (also printed as it goes)
The lease's limit leaves out runs/ (checkpoints): the parts' run folders live under a temporary folder.

Settings, each checked before anything is written (a bad one is one line, exit 2; OUT is then left as it was):
  LEASE_BUDGET_S  whole seconds, at least 20 (default 480): bounds the parts, from when the first starts (after
                  the wheels are installed); each part gets at most its own cap and what is left, and a part with
                  under 20 s left is skipped with a line in lease.log.
  LEASE_PARTS     (default: all) parts by file (env checks projection tests rare) or by the name lease.log gives
                  them (check-gsm8k-qwen3-4b-lora, say), so a second lease runs what the first missed; a name that
                  is no part of this lease (GPU or --cpu) is refused.
  OUT             a new or empty folder you can write to.
Exit 0 when every part that ran exited 0 (parts skipped for the budget are named in the last line of lease.log);
1 when one failed or was stopped at its cap, with one line naming them and their files. Ctrl-C (or SIGTERM) stops
the running part (SIGINT to its process group, SIGKILL 15 s later), keeps what finished, records it in lease.log,
says in one line what finished and how to run the rest, and ends by that signal (a shell reports 130 for Ctrl-C).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # troll.base.cli from this checkout (nothing is installed on the lease machine)

from troll.base.cli import Parser, UsageError, run_command  # noqa: E402

PROG = "bash scripts/gpu_lease.sh"
BUDGET_S = 480  # LEASE_BUDGET_S's default
MIN_LEFT_S = 20  # a part with less of the budget left is skipped
KILL_AFTER_S = 15  # a part stopped with SIGINT (its cap, Ctrl-C) is killed if it has not ended by then
FILES = ("env", "checks", "projection", "tests", "rare")  # the parts' files (.txt), in the order they run


@dataclass
class Part:
    name: str  # what lease.log calls it, and LEASE_PARTS picks it by (or by its file's stem)
    file: str  # its output, in OUT
    cap: int  # seconds at most
    argv: list[str]


def plan(cpu: bool, py: str, work: Path) -> list[Part]:
    """Every part of a lease (GPU) or of its rehearsal (--cpu), in the order they run."""

    def part(name: str, file: str, cap: int, args: str) -> Part:
        return Part(name, file, cap, [py, *shlex.split(args)])

    def out(name: str) -> str:
        return shlex.quote(str(work / name))

    pytest = "-m pytest -m gpu tests/test_gpu.py -q -rA -p no:cacheprovider"
    parts = [part("env", "env.txt", 60, "scripts/gpu_env.py")]
    # first, the whole update at the GSM8K presets' shapes (stand-ins: no hub here), transformers backend: the
    # acceptance check, whose update comparison times TROLL, this repository's clip and the textbook clip
    if cpu:
        check = f"-m troll check --shape tiny --backend hf --device cpu --steps 1 --out {out('check-tiny')}"
        parts.append(part("check-tiny", "checks.txt", 120, check))
    else:
        for preset in ("gsm8k-qwen2.5-0.5b", "gsm8k-qwen3-1.7b-lora", "gsm8k-qwen3-4b-lora"):
            check = (
                f"-m troll check --preset {preset} --model standin --backend hf --prompts 4 --samples 4 "
                f"--max_new_tokens 64 --eval_size 4 --steps 2 --repeats 2 --out {out(f'check-{preset}')}"
            )
            parts.append(part(f"check-{preset}", "checks.txt", 180, check))
    # the loss at Qwen's vocabulary with supports at the cap (--head 72), TROLL against both clips, time and peak
    # memory, then the profile of one call of each
    if cpu:
        bench = "bench/projection.py --n 256 --v 8192 --repeats 1 --head 72 --profile"
        parts.append(part("projection", "projection.txt", 120, bench))
    else:
        bench = "bench/projection.py --device cuda --dtype bfloat16 --n 16384 --repeats 5 --head 72 --profile"
        parts.append(part("projection-n16384-cap", "projection.txt", 120, bench))
    parts.append(part("tests", "tests.txt", 180, pytest))
    # with the time left: the rare-token sequence task at a 32,768-token vocabulary, paired seeds
    device, vocab, steps = ("cpu", 1024, 2) if cpu else ("cuda", 32768, 40)
    for seed in (0,) if cpu else (0, 1, 2):
        for loss in ("troll", "ppo_clip"):
            train = (
                f"-m troll train --preset tiny-rare --loss {loss} --seed {seed} --vocab_size {vocab} --device {device} "
                f"--steps {steps} --eval_every {steps} --save_every {steps} --out {out(f'rare-{loss}-{seed}')}"
            )
            parts.append(part(f"rare-{loss}-seed{seed}", "rare.txt", 120, train))
    return parts


def budget_from(raw: str | None) -> int:
    """LEASE_BUDGET_S: whole seconds, at least MIN_LEFT_S (unset or empty: BUDGET_S)."""
    if not raw:
        return BUDGET_S
    if not re.fullmatch(r"[0-9]+", raw.strip()):
        raise UsageError(
            f"LEASE_BUDGET_S={raw!r} is not a whole number of seconds: give one, e.g. {BUDGET_S} (the default)"
        )
    if int(raw) < MIN_LEFT_S:
        raise UsageError(
            f"LEASE_BUDGET_S={raw!r} runs no part (a part needs {MIN_LEFT_S} s of the budget to "
            f"start): give at least {MIN_LEFT_S}, e.g. {BUDGET_S} (the default)"
        )
    return int(raw)


def selected(raw: str | None, parts: list[Part], cpu: bool) -> set[str]:
    """The names of the parts LEASE_PARTS picks (unset or empty: all); a word that picks none is refused."""
    words = (raw or "").split()
    if not words:
        return {p.name for p in parts}
    known = {p.name for p in parts} | {p.file.removesuffix(".txt") for p in parts}
    unknown = [w for w in words if w not in known]
    if unknown:
        lease = "the --cpu rehearsal" if cpu else "a GPU lease (--cpu: the rehearsal's)"
        names = " ".join(p.name for p in parts)
        raise UsageError(
            f"LEASE_PARTS: {' '.join(map(repr, unknown))} is no part of {lease}: give files "
            f"({' '.join(FILES)}) or part names ({names})"
        )
    return {p.name for p in parts if p.name in words or p.file.removesuffix(".txt") in words}


def checked_out(raw: str) -> Path:
    """OUT, absolute: a new folder whose nearest existing parent is a folder you can write in, or an existing
    empty folder you can write in. Nothing is created here."""
    out = Path(raw).expanduser().absolute()
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UsageError(f"OUT {raw} is not a folder: choose a new or empty folder")
        if any(out.iterdir()):
            raise UsageError(f"OUT {raw} is not empty: choose a new or empty folder (each lease writes its own)")
        if not os.access(out, os.W_OK | os.X_OK):
            raise UsageError(
                f"OUT {raw} is not writable by you: make it writable (chmod, chown, chattr -i), or "
                "choose another folder"
            )
        return out
    parent = next(p for p in out.parents if p.exists())
    if not parent.is_dir():
        raise UsageError(f"OUT {raw}: {parent} is a file where a folder belongs: choose another folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(
            f"OUT {raw}: {parent} is not writable by you, so OUT cannot be made there: make it "
            "writable (chmod, chown, chattr -i), or choose another folder"
        )
    return out


class Stopped(Exception):
    """SIGTERM or SIGHUP (a lease's own limit, a closed terminal): handled as Ctrl-C is, then ends by it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stopped(signum: int, frame: object) -> None:
    raise Stopped(signum)


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """`signum` to the part's process group (its own session: pytest's and troll.tools.check's children included)."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:  # every process of the group has ended
        pass


def stop(proc: subprocess.Popen) -> tuple[int, BaseException | None]:
    """SIGINT to the part (troll's commands stop cleanly on it), SIGKILL if it has not ended in KILL_AFTER_S
    seconds or at a Ctrl-C (or SIGTERM) while it waits; its exit status, and that Ctrl-C if one came."""
    signal_group(proc, signal.SIGINT)
    try:
        return proc.wait(KILL_AFTER_S), None
    except subprocess.TimeoutExpired:
        came = None
    except (KeyboardInterrupt, Stopped) as e:
        came = e
    signal_group(proc, signal.SIGKILL)
    return proc.wait(), came


def shell_status(returncode: int) -> int:
    """A shell's exit status: 128 + N for a process ended by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


@dataclass
class Lease:
    cpu: bool
    out: Path
    budget: int
    py: str
    parts: list[Part]
    picked: set[str]
    start: float = 0.0  # when the first part was due (time.monotonic)
    finished: list[str] = field(default_factory=list)  # parts that ran to their end (any exit status)
    failed: list[Part] = field(default_factory=list)  # ... not exit 0, or stopped at their cap
    skipped: list[str] = field(default_factory=list)  # picked, but with under MIN_LEFT_S of the budget left
    running: str | None = None

    def elapsed(self) -> int:
        """Whole seconds since the parts began (the first part is due at 0, so it gets the whole budget)."""
        return int(time.monotonic() - self.start)

    def log(self, line: str) -> None:
        """A line on stdout and in OUT/lease.log."""
        print(line, flush=True)
        with open(self.out / "lease.log", "a") as f:
            f.write(line + "\n")

    def command(self, names: list[str]) -> str:
        """The command that runs `names` in a new OUT."""
        return f'LEASE_PARTS="{" ".join(names)}" {PROG}{" --cpu" if self.cpu else ""} NEW_OUT'

    def run(self, env: dict[str, str]) -> int:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        self.start = time.monotonic()
        self.out.mkdir(parents=True, exist_ok=True)
        self.log(
            f"gpu_lease.sh {'--cpu ' if self.cpu else ''}{self.out}: budget {self.budget} s, "
            f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%SZ}, commit {commit.stdout.strip() or 'unknown'}"
        )
        for part in self.parts:
            self.run_part(part, env)
        done = f"gpu_lease.sh: done in {self.elapsed()} s of {self.budget}"
        if self.skipped:
            done += f"; skipped for the budget: {' '.join(self.skipped)} (run them: {self.command(self.skipped)})"
        self.log(done)
        if not self.failed:
            return 0
        files = ", ".join(f"{p.name} ({p.file})" for p in self.failed)
        print(
            f"{PROG}: error: parts failed: {files}: their files in {self.out} say why; run them again: "
            f"{self.command([p.name for p in self.failed])}",
            file=sys.stderr,
        )
        return 1

    def run_part(self, part: Part, env: dict[str, str]) -> None:
        """The part under the smaller of its cap and the budget left, its output appended to OUT/<file> as it comes;
        one line in lease.log."""
        if part.name not in self.picked:
            self.log(f"part {part.name}: skipped (not in LEASE_PARTS)")
            return
        left = self.budget - self.elapsed()
        if left < MIN_LEFT_S:
            self.log(f"part {part.name}: skipped ({left} s of the budget left)")
            self.skipped.append(part.name)
            return
        cap = min(part.cap, left)
        t0, proc, interrupt = time.monotonic(), None, None
        self.running = part.name
        try:
            with open(self.out / part.file, "a") as f:
                f.write(f"$ {shlex.join(part.argv)}\n")
                f.flush()
                proc = subprocess.Popen(
                    part.argv,
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            status, capped = proc.wait(cap), False
        except subprocess.TimeoutExpired:
            (status, interrupt), capped = stop(proc), True
        except (KeyboardInterrupt, Stopped) as e:
            status, interrupt = None if proc is None else stop(proc)[0], e  # a second one: SIGKILL at once
        took = int(time.monotonic() - t0)
        if interrupt is not None:
            said = "not started" if status is None else f"exit {shell_status(status)}"
            self.log(f"part {part.name}: stopped ({said}) in {took} s")
            raise interrupt
        status = shell_status(status)
        self.running = None
        self.finished.append(part.name)
        self.log(f"part {part.name}: exit {status} in {took} s" + (f" (stopped at its {cap} s cap)" if capped else ""))
        if status != 0 or capped:
            self.failed.append(part)

    def interrupted(self, how: str) -> str:
        """What finished and what did not, in lease.log, and the one line that says it."""
        order = [p.name for p in self.parts if p.name in self.picked]
        rest = [n for n in order if n not in self.finished]
        finished = " ".join(self.finished) or "no part"
        during = f" during part {self.running}" if self.running else ""
        if not (self.out / "lease.log").exists():  # stopped before the lease wrote anything: nothing to keep
            return f"{how} before any part started ({self.out} not written)"
        self.log(
            f"gpu_lease.sh: {how}{during} after {self.elapsed()} s; finished: {finished}; not finished: "
            f"{' '.join(rest)}"
        )
        return (
            f"{how}{during}: finished {finished} (kept in {self.out}); the rest: {self.command(rest)}"
            if rest
            else f"{how}: every part had finished (in {self.out})"
        )


def parts_env(cpu: bool, site: Path) -> dict[str, str]:
    """The parts' environment: the wheels' folder and the repository on the path, offline, quiet, this device."""
    path = os.pathsep.join([str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_WAIT_POLICY="PASSIVE",
        PYTHONPATH=path,
        TROLL_TEST_DEVICE="cpu" if cpu else "cuda",
    )


def install_wheels(py: str, site: Path) -> None:
    """The wheels of scripts/gpu_wheels.sh (.whl/*.whl), if any, into `site` (a folder of their own)."""
    wheels = sorted(str(w) for w in (ROOT / ".whl").glob("*.whl"))
    if not wheels:
        return
    quiet_offline = "-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target".split()
    pip = subprocess.run([py, *quiet_offline, str(site), *wheels], capture_output=True, text=True)
    if pip.returncode != 0:
        said = (pip.stderr.strip() or pip.stdout.strip() or f"exit {pip.returncode}").splitlines()[-1]
        raise UsageError(f"the wheels in .whl/ did not install ({said[:200]}): run bash scripts/gpu_wheels.sh again")


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=PROG, description="Every GPU check of this repository in one time budget (module doc).")
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: the same parts at CPU sizes")
    parser.add_argument("out", metavar="OUT", help="a new or empty folder: each part's results, and lease.log")
    args = parser.parse_args(argv)
    py = os.environ.get("PYTHON") or "python3"  # the parts' Python (scripts/gpu_lease.sh checked it exists)
    with tempfile.TemporaryDirectory(prefix="gpu_lease-") as work:  # the parts' run folders: not OUT's
        parts = plan(args.cpu, py, Path(work))
        picked = selected(os.environ.get("LEASE_PARTS"), parts, args.cpu)
        budget = budget_from(os.environ.get("LEASE_BUDGET_S"))
        lease = Lease(args.cpu, checked_out(args.out), budget, py, parts, picked)
        site = Path(work) / "site"
        install_wheels(py, site)
        env = parts_env(args.cpu, site)
        if not args.cpu:
            probe = "import torch, sys; sys.exit(not torch.cuda.is_available())"
            cuda = subprocess.run([py, "-c", probe], env=env, capture_output=True)
            if cuda.returncode != 0:
                subprocess.run([py, "scripts/gpu_env.py"], cwd=ROOT, env=env)  # on stdout: why, nothing written
                raise UsageError(
                    "torch sees no CUDA GPU (the report above says what this machine has): run this on "
                    "the GPU machine, or the rehearsal with --cpu"
                )
        # from here on OUT is written; SIGTERM and SIGHUP stop the lease as Ctrl-C does
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, raise_stopped)
        try:
            return lease.run(env)
        except (KeyboardInterrupt, Stopped) as e:
            for ignored in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the bookkeeping below is short
                signal.signal(ignored, signal.SIG_IGN)
            signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
            how = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
            line = lease.interrupted(how)
    end_by(signum, f"{PROG}: {line}")  # the temporary folder is gone: now the line, and the signal


def end_by(signum: int, line: str) -> NoReturn:
    """Print `line` and end by `signum`, as a process stopped by it ends (a shell reports 128 + signum and a loop
    over leases stops)."""
    print(line, file=sys.stderr, flush=True)
    sys.stdout.flush()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    raise SystemExit(128 + signum)  # not reached


if __name__ == "__main__":
    run_command(PROG, main)
