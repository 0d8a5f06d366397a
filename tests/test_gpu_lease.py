"""scripts/gpu_lease.sh rehearsed on CPU (`--cpu`), so that a GPU lease never dies on setup: every part runs and
writes its file, and misuse is refused before anything runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_lease.sh"
PARTS = ("env", "tests", "projection", "check-tiny", "rare-troll-seed0", "rare-ppo_clip-seed0")


def lease(*args: str, budget: int = 480, parts: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, LEASE_BUDGET_S=str(budget), PYTHON=sys.executable, LEASE_PARTS=parts)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=900)


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_every_part(tmp_path):
    """Each part exits 0 within the budget and leaves its figures: the pins table, the gpu tests' report (they
    run on CPU here, the CUDA-only ones skipped), the projection bench's SUMMARY, the check's table with every
    check passed or not applicable, and the rare-token runs' evaluations."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out))
    log = (out / "lease.log").read_text()
    assert res.returncode == 0, res.stderr + log
    for name in PARTS:
        assert re.search(rf"^part {re.escape(name)}: exit 0 in \d+ s$", log, re.M), log
    assert "gpu_lease.sh: done" in log
    assert re.search(r"^pins: ", (out / "env.txt").read_text(), re.M)
    tests = (out / "tests.txt").read_text()
    assert re.search(r"\d+ passed", tests) and " failed" not in tests, tests[-2000:]
    assert "SUMMARY projection: troll vs clip" in (out / "projection.txt").read_text()
    checks = (out / "checks.txt").read_text()
    assert "# troll.check: passed" in checks and "FAILED" not in checks, checks[-2000:]
    assert len(re.findall(r"^eval: .* -> ", (out / "rare.txt").read_text(), re.M)) == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["lease.log", "env.txt", "tests.txt", "projection.txt", "checks.txt", "rare.txt"]
    )  # at most 8 files come back from a lease


def test_a_part_past_the_budget_is_skipped_and_said(tmp_path):
    """A budget spent before a part starts skips it with a line in lease.log (what a lease cut short returns)."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out), budget=5)
    log = (out / "lease.log").read_text()
    assert res.returncode == 0, res.stderr + log
    assert re.search(r"^part env: skipped \(\d+ s of the budget left\)$", log, re.M), log
    assert "part rare-troll-seed0: skipped" in log


@pytest.mark.slow
def test_lease_parts_picks_parts_by_file_or_by_name(tmp_path):
    """LEASE_PARTS="env check-tiny" runs the environment part (by its file) and the check (by its name) alone; the
    rest are skipped with a line each (what a second lease does with what the first missed)."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out), parts="env check-tiny")
    log = (out / "lease.log").read_text()
    assert res.returncode == 0, res.stderr + log
    ran = re.findall(r"^part (\S+): exit 0 in \d+ s$", log, re.M)
    skipped = re.findall(r"^part (\S+): skipped \(not in LEASE_PARTS\)$", log, re.M)
    assert ran == ["env", "check-tiny"] and skipped == [p for p in PARTS if p not in ran], log
    assert sorted(p.name for p in out.iterdir()) == ["checks.txt", "env.txt", "lease.log"]


@pytest.mark.parametrize("case", ["no folder", "two folders", "not empty", "a file"])
def test_misuse_is_refused_in_one_line_before_anything_runs(tmp_path, case):
    """Exit 2 with one line naming the problem; nothing written."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    (tmp_path / "file").write_text("")
    args = {
        "no folder": ["--cpu"],
        "two folders": [str(tmp_path / "a"), str(tmp_path / "b")],
        "not empty": ["--cpu", str(full)],
        "a file": ["--cpu", str(tmp_path / "file" / "out")],
    }[case]
    res = lease(*args)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "gpu_lease.sh" in res.stderr and not (tmp_path / "a").exists()
    assert sorted(p.name for p in full.iterdir()) == ["x"]
