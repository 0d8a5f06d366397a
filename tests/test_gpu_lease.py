"""scripts/gpu_lease.sh rehearsed on CPU (`--cpu`), so that a GPU lease never dies on setup: every part runs and
writes its file; misuse is refused in one line before anything is written; Ctrl-C stops the running part and the
rest and keeps what finished. Then its helpers: scripts/gpu_env.py reports a missing or damaged pins file as a line,
scripts/gpu_wheels.sh replaces the wheels only with a complete download, and $TROLL_TEST_DEVICE other than cuda or
cpu is one usage error for a whole pytest run.

Most tests run the lease with a stand-in Python (`fake_python`): the lease itself runs on this one, and each part is
a quick stand-in that records its command, so they test the lease's own logic in seconds; the slow rehearsal runs
the real parts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")  # the dev extra (pyproject.toml)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_lease.sh"
PARTS = ("env", "check-tiny", "projection", "tests", "rare-troll-seed0", "rare-ppo_clip-seed0")  # --cpu, in order
FILES = ("env", "checks", "projection", "tests", "rare")
KNOWN = set(PARTS) | set(FILES)
FAKE_PYTHON = """#!/usr/bin/env bash
case "$*" in *scripts/gpu_lease.py*) exec PYTHON "$@" ;; esac
echo "$*" >> DIR/calls
case "$*" in
    *"${FAKE_SLOW:-no part matches this}"*) touch DIR/started; exec sleep "${FAKE_SLOW_S:-60}" ;;
    *"${FAKE_FAIL:-no part matches this}"*) exit 3 ;;
esac
echo "stand-in: $*"
"""


def lease(*args: str, budget: str | None = "480", parts: str = "", python: str = sys.executable, **env: str):
    """bash scripts/gpu_lease.sh ARGS, run to its end."""
    environ = dict(os.environ, PYTHON=python, LEASE_PARTS=parts, **env)
    environ.pop("LEASE_BUDGET_S", None)
    if budget is not None:
        environ["LEASE_BUDGET_S"] = budget
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=environ, timeout=900)


@pytest.fixture
def fake_python(tmp_path) -> Path:
    """A stand-in for the parts' $PYTHON: scripts/gpu_lease.py runs on this interpreter; every other command is
    appended to `calls` and prints a line, except the part whose command contains $FAKE_SLOW (it touches `started`
    and sleeps $FAKE_SLOW_S seconds, a minute by default) and the one with $FAKE_FAIL (exit 3)."""
    fake = tmp_path / "fake" / "python"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON.replace("PYTHON", sys.executable).replace("DIR", str(fake.parent)))
    fake.chmod(0o755)
    return fake


def calls(fake: Path) -> list[str]:
    """The parts' commands the stand-in saw, in order."""
    path = fake.parent / "calls"
    return path.read_text().splitlines() if path.exists() else []


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.slow
def test_the_cpu_rehearsal_runs_every_part(tmp_path):
    """Each part exits 0 within the budget and leaves its figures: the pins table, the gpu tests' report (they
    run on CPU here, the CUDA-only ones skipped), the projection bench's SUMMARY, the check's table with every
    check passed or not applicable, and the rare-token runs' evaluations."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out))
    log = (out / "lease.log").read_text()
    assert res.returncode == 0 and res.stderr == "", res.stderr + log
    for name in PARTS:
        assert re.search(rf"^part {re.escape(name)}: exit 0 in \d+ s$", log, re.M), log
    assert re.search(r"^gpu_lease.sh: done in \d+ s of 480$", log, re.M), log
    assert re.search(r"^pins: ", (out / "env.txt").read_text(), re.M)
    tests = (out / "tests.txt").read_text()
    assert re.search(r"\d+ passed", tests) and " failed" not in tests, tests[-2000:]
    assert "SUMMARY projection: troll vs clip" in (out / "projection.txt").read_text()
    checks = (out / "checks.txt").read_text()
    assert "# troll check: passed" in checks and "FAILED" not in checks, checks[-2000:]
    assert len(re.findall(r"^eval: .* -> ", (out / "rare.txt").read_text(), re.M)) == 2
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["lease.log", "env.txt", "tests.txt", "projection.txt", "checks.txt", "rare.txt"]
    )  # at most 8 files come back from a lease


def test_every_part_runs_in_order_with_its_command(tmp_path, fake_python):
    """The stand-in sees each --cpu part's command once, in order, with TROLL_TEST_DEVICE=cpu's tests; each file
    holds its commands; exit 0, nothing on stderr."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out), python=str(fake_python))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    seen = calls(fake_python)
    assert [c.split()[0] for c in seen] == ["scripts/gpu_env.py", "-m", "bench/projection.py", "-m", "-m", "-m"]
    assert "troll check --shape tiny" in seen[1] and "--head 72 --profile" in seen[2]
    assert "pytest -m gpu tests/test_gpu.py" in seen[3]
    assert [re.search(r"--loss (\S+)", c)[1] for c in seen[4:]] == ["troll", "ppo_clip"]
    assert sorted(p.name for p in out.iterdir()) == sorted(["lease.log", *(f"{f}.txt" for f in FILES)])
    assert "stand-in: -m pytest" in (out / "tests.txt").read_text()


def test_a_part_past_the_budget_is_skipped_and_said(tmp_path, fake_python):
    """A budget spent before a part starts skips it with a line in lease.log (what a lease cut short returns), and
    the last line names the command that runs them; exit 0. With 20 s, the least accepted, the first part runs and
    leaves under 20 s for the next."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out), budget="20", python=str(fake_python), FAKE_SLOW="gpu_env", FAKE_SLOW_S="1.2")
    log = (out / "lease.log").read_text()
    assert res.returncode == 0 and res.stderr == "", res.stderr + log
    assert re.search(r"^part env: exit 0 in \d+ s$", log, re.M), log
    for name in PARTS[1:]:
        assert re.search(rf"^part {re.escape(name)}: skipped \(1\d s of the budget left\)$", log, re.M), log
    rest = " ".join(PARTS[1:])
    assert f'skipped for the budget: {rest} (run them: LEASE_PARTS="{rest}" bash scripts/gpu_lease.sh --cpu' in log
    assert len(calls(fake_python)) == 1


def test_lease_parts_picks_parts_by_file_or_by_name(tmp_path, fake_python):
    """LEASE_PARTS="env check-tiny" runs the environment part (by its file) and the check (by its name) alone; the
    rest are skipped with a line each (what a second lease does with what the first missed)."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out), parts="env check-tiny", python=str(fake_python))
    log = (out / "lease.log").read_text()
    assert res.returncode == 0, res.stderr + log
    ran = re.findall(r"^part (\S+): exit 0 in \d+ s$", log, re.M)
    skipped = re.findall(r"^part (\S+): skipped \(not in LEASE_PARTS\)$", log, re.M)
    assert ran == ["env", "check-tiny"] and skipped == [p for p in PARTS if p not in ran], log
    assert sorted(p.name for p in out.iterdir()) == ["checks.txt", "env.txt", "lease.log"]
    assert len(calls(fake_python)) == 2


def test_a_failed_part_is_named_in_one_line_and_the_rest_run(tmp_path, fake_python):
    """A part that exits non-zero: the lease goes on, then exits 1 with one line naming the part, its file and the
    command that runs it again."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out), python=str(fake_python), FAKE_FAIL="bench/projection.py")
    log = (out / "lease.log").read_text()
    assert res.returncode == 1, res.stderr + log
    line = one_line(res.stderr)
    assert "parts failed: projection (projection.txt)" in line and 'LEASE_PARTS="projection"' in line, line
    assert re.search(r"^part projection: exit 3 in \d+ s$", log, re.M) and len(calls(fake_python)) == len(PARTS)


@pytest.mark.slow
def test_a_part_past_its_cap_is_stopped(tmp_path, fake_python):
    """A part still running when the budget is spent is stopped (SIGINT to its process group), said in lease.log,
    and fails the lease; the parts after it are skipped. About 20 s."""
    out = tmp_path / "out"
    res = lease("--cpu", str(out), budget="20", parts="env tests", python=str(fake_python), FAKE_SLOW="gpu_env")
    log = (out / "lease.log").read_text()
    assert res.returncode == 1, res.stderr + log
    assert re.search(r"^part env: exit 130 in \d+ s \(stopped at its (19|20) s cap\)$", log, re.M), log
    assert re.search(r"^part tests: skipped \(-?\d+ s of the budget left\)$", log, re.M), log
    assert "parts failed: env (env.txt)" in one_line(res.stderr)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_stops_the_running_part_and_the_rest(tmp_path, fake_python, signum):
    """Ctrl-C (SIGINT to the lease's process group, as a terminal sends it) or SIGTERM while the tests part runs:
    the part is stopped at once, no later part starts, lease.log keeps the finished parts and says what did not
    finish, one line says so with the command that runs the rest, and the lease ends by that signal."""
    out = tmp_path / "out"
    environ = dict(os.environ, PYTHON=str(fake_python), LEASE_PARTS="", LEASE_BUDGET_S="480", FAKE_SLOW="pytest")
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), "--cpu", str(out)],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    started = fake_python.parent / "started"
    deadline = time.monotonic() + 60
    while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists(), proc.communicate(timeout=60)
    t0 = time.monotonic()
    os.killpg(proc.pid, signum)
    _, stderr = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 10, "the part was not stopped at once"
    assert proc.returncode == -signum, stderr
    how = "interrupted" if signum == signal.SIGINT else "stopped by SIGTERM"
    done, rest = " ".join(PARTS[:3]), " ".join(PARTS[3:])
    line = one_line(stderr)
    assert f"{how} during part tests: finished {done} (kept in {out})" in line, line
    assert f'the rest: LEASE_PARTS="{rest}" bash scripts/gpu_lease.sh --cpu NEW_OUT' in line, line
    log = (out / "lease.log").read_text()
    assert re.search(r"^part env: exit 0 in \d+ s$", log, re.M), log
    assert re.search(r"^part tests: stopped \(exit \d+\) in \d+ s$", log, re.M), log
    assert re.search(
        rf"^gpu_lease.sh: {how} during part tests after \d+ s; finished: {done}; not finished: {rest}$", log, re.M
    )
    assert len(calls(fake_python)) == 4  # env, the check, the projection and tests: nothing after
    assert sorted(p.name for p in out.iterdir()) == sorted([*(f"{f}.txt" for f in FILES[:4]), "lease.log"])


# Misuse: exit 2, one line naming the setting, nothing written (OUT left as it was: absent, or empty).


def assert_refused(res: subprocess.CompletedProcess, out: Path, names: str) -> None:
    assert res.returncode == 2, res.stdout + res.stderr
    line = one_line(res.stderr)
    assert line.startswith("bash scripts/gpu_lease.sh: error: ") and names in line, line
    assert res.stdout == "" and (not out.exists() or not any(out.iterdir())), res.stdout


@pytest.mark.parametrize("case", ["no folder", "two folders", "not empty", "a file", "under a file", "no python"])
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
        "a file": ["--cpu", str(tmp_path / "file")],
        "under a file": ["--cpu", str(tmp_path / "file" / "out")],
        "no python": ["--cpu", str(tmp_path / "a")],
    }[case]
    res = lease(*args, python=str(tmp_path / "no-python") if case == "no python" else sys.executable)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "gpu_lease.sh" in res.stderr and not (tmp_path / "a").exists()
    assert sorted(p.name for p in full.iterdir()) == ["x"] and (tmp_path / "file").read_text() == ""


@pytest.mark.parametrize(
    "budget", ["ten", "0", "-60", "19", "4.5", "1e3", "480s", " ", "+480", "0x1e0", "٤٨٠"]
)  # fmt: skip
def test_a_budget_that_is_not_whole_seconds_of_at_least_20_is_refused(tmp_path, budget):
    out = tmp_path / "out"
    assert_refused(lease("--cpu", str(out), budget=budget), out, "LEASE_BUDGET_S")


@pytest.mark.parametrize(
    "parts", ["nope", "env nope", "projection-n8192", "check-gsm8k-qwen3-4b-lora", "env,tests", "ENV", "check"]
)
def test_a_part_that_is_no_part_of_the_lease_is_refused(tmp_path, parts):
    """A word of LEASE_PARTS that picks no part (a typo, a GPU part in the --cpu rehearsal) refuses the lease,
    naming it, instead of skipping every part."""
    out = tmp_path / "out"
    assert_refused(lease("--cpu", str(out), parts=parts), out, "LEASE_PARTS")


def test_gpu_parts_are_no_parts_of_the_rehearsal_and_cpu_parts_none_of_a_lease(tmp_path):
    out = tmp_path / "out"
    assert_refused(lease(str(out), parts="check-tiny"), out, "'check-tiny' is no part of a GPU lease")


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    budget=st.one_of(
        st.integers(max_value=19).map(str),
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1).filter(
            lambda s: not s.strip().isascii() or not s.strip().isdigit()
        ),
    )
)
def test_a_drawn_bad_budget_is_refused(tmp_path, budget):
    out = tmp_path / "drawn"
    assert_refused(lease("--cpu", str(out), budget=budget), out, "LEASE_BUDGET_S")


@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@given(
    known=st.lists(st.sampled_from(sorted(KNOWN)), max_size=3),
    unknown=st.text(st.characters(blacklist_categories=("Cs", "Z", "Cc")), min_size=1).filter(lambda w: w not in KNOWN),
    at=st.integers(min_value=0, max_value=3),
)
def test_a_drawn_unknown_part_is_refused(tmp_path, known, unknown, at):
    out = tmp_path / "drawn"
    words = known[:at] + [unknown] + known[at:]
    assert_refused(lease("--cpu", str(out), parts=" ".join(words)), out, repr(unknown))


def read_only(folder: Path) -> None:
    """chmod 0o555; as root, whom no mode stops, also the immutable attribute (chattr +i) (tests/test_damage.py)."""
    folder.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], check=True, capture_output=True)


def writable_again(folder: Path) -> None:
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


@pytest.mark.parametrize("where", ["OUT itself", "its parent"])
def test_an_unwritable_out_is_refused_before_anything_runs(tmp_path, where):
    """An empty OUT, or the folder a new OUT would be made in, that this process cannot write: one line, not a
    lease whose every part fails to write its file."""
    folder = tmp_path / "ro"
    folder.mkdir()
    read_only(folder)
    try:
        try:
            (folder / "probe").write_text("")
        except OSError:
            pass
        else:
            pytest.skip("neither chmod 0o555 nor chattr +i stops this process's writes here")
        out = folder if where == "OUT itself" else folder / "out"
        assert_refused(lease("--cpu", str(out)), out, "not writable")
        assert list(folder.iterdir()) == []
    finally:
        writable_again(folder)


# scripts/gpu_env.py: a report, exit 0, whatever state the pins files are in.


@pytest.mark.parametrize(
    "damage, said",
    [
        ("requirements.txt missing", "pins: requirements.txt: No such file or directory"),
        ("requirements.txt not UTF-8", "pins: requirements.txt is damaged (not UTF-8"),
        ("requirements.txt line", "pins: requirements.txt line 2: 'torch=>2' is no requirement"),
        ("pyproject.toml not TOML", "pins: pyproject.toml is damaged (TOMLDecodeError"),
        ("pyproject.toml no [project]", "pins: pyproject.toml has no 'project'"),
    ],
)
def test_gpu_env_reports_a_missing_or_damaged_pins_file_as_a_line(tmp_path, damage, said):
    """The script (it reads the pins next to itself) in a copy of the tree, one file damaged: exit 0, no traceback,
    a line naming the file (and line), the other file's pins still checked, and the last line saying what was not."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "gpu_env.py", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "requirements.txt").write_text("numpy\ntorch=>2\n" if damage.endswith("line") else "numpy\n")
    if damage == "requirements.txt missing":
        (tmp_path / "requirements.txt").unlink()
    elif damage == "requirements.txt not UTF-8":
        (tmp_path / "requirements.txt").write_bytes(b"numpy\n\xff\xfe\n")
    elif damage == "pyproject.toml not TOML":
        (tmp_path / "pyproject.toml").write_text("[project\n")
    elif damage == "pyproject.toml no [project]":
        (tmp_path / "pyproject.toml").write_text("[tool.x]\n")
    res = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "gpu_env.py")], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and res.stderr == "", res.stderr
    lines = res.stdout.splitlines()
    assert any(line.startswith(said) for line in lines), res.stdout
    assert lines[-1].startswith("pins: ") and "; not all checked: " in lines[-1], lines[-1]
    checked = "numpy" if damage.startswith("pyproject") else "transformers"  # the other file's pins
    assert re.search(rf"^{checked} ", res.stdout, re.M), res.stdout


def test_gpu_env_on_the_repository_checks_every_pin():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_env.py")], capture_output=True, text=True)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    last = res.stdout.splitlines()[-1]
    assert re.fullmatch(r"pins: (all met|\d+ not met \(.*\))", last), last


# scripts/gpu_wheels.sh: the wheels in .whl/ are replaced only by a complete download.

OLD_WHEELS = {"math_verify-0.8.0-py3-none-any.whl": os.urandom(256), "other-1.0-py3-none-any.whl": b"\x00\xff" * 99}


def wheels_tree(tmp_path: Path, pip: str) -> tuple[Path, dict[str, str]]:
    """A git checkout holding the script and earlier wheels in .whl/, and an environment whose `python3` runs the
    shell text `pip` instead of `python3 -m pip download ...` ($DIR: its -d folder, $SPECS: the wheels asked for)."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "gpu_wheels.sh", tree / "scripts")
    shutil.copy(ROOT / ".gitignore", tree)
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    (tree / ".whl").mkdir()
    for name, data in OLD_WHEELS.items():
        (tree / ".whl" / name).write_bytes(data)
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'SPECS=(); while [[ $# -gt 0 ]]; do case "$1" in -d) DIR=$2; shift 2 ;; *==*) SPECS+=("$1"); shift ;;'
        " *) shift ;; esac; done\n" + pip + "\n"
    )
    fake.chmod(0o755)
    return tree, dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}")


def wheels_in(tree: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((tree / ".whl").iterdir())}


@pytest.mark.parametrize(
    "pip",
    [
        'echo "ERROR: Could not find a version that satisfies math-verify==0.9.0" >&2; exit 1',
        'touch "$DIR/${SPECS[0]%%==*}-0-py3-none-any.whl"; echo "ERROR: connection reset" >&2; exit 1',
        'touch "$DIR/${SPECS[0]%%==*}-0-py3-none-any.whl"',  # pip says it succeeded, with one wheel of three
    ],
    ids=["nothing downloaded", "one wheel, then a failure", "one wheel of three"],
)
def test_gpu_wheels_keeps_the_earlier_wheels_when_the_download_fails(tmp_path, pip):
    tree, env = wheels_tree(tmp_path, pip)
    res = subprocess.run(["bash", str(tree / "scripts" / "gpu_wheels.sh")], capture_output=True, text=True, env=env)
    assert res.returncode == 1, res.stderr
    assert "left as it was" in one_line(res.stderr)
    assert wheels_in(tree) == OLD_WHEELS  # byte for byte, and nothing else (no .whl/.new)


def test_gpu_wheels_replaces_the_earlier_wheels_with_a_complete_download(tmp_path):
    pip = 'for s in "${SPECS[@]}"; do echo "$s" > "$DIR/${s%%==*}-${s##*==}-py3-none-any.whl"; done'
    tree, env = wheels_tree(tmp_path, pip)
    res = subprocess.run(["bash", str(tree / "scripts" / "gpu_wheels.sh")], capture_output=True, text=True, env=env)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert sorted(wheels_in(tree)) == [
        "antlr4-python3-runtime-4.13.2-py3-none-any.whl",
        "latex2sympy2_extended-1.11.0-py3-none-any.whl",
        "math-verify-0.9.0-py3-none-any.whl",
    ]
    assert "3 wheels" in res.stdout


@pytest.mark.parametrize("what", ["a file of another", "a folder", ".whl a file"])
def test_gpu_wheels_refuses_a_whl_holding_anything_else(tmp_path, what):
    """.whl/ is the script's folder: a file it did not download there, or .whl not a folder, is refused in one line
    (exit 2), everything left as it was; pip is not run."""
    tree, env = wheels_tree(tmp_path, 'touch "$DIR/../../ran"')
    if what == "a file of another":
        (tree / ".whl" / "notes.txt").write_text("mine")
    elif what == "a folder":
        (tree / ".whl" / "src").mkdir()
    else:
        shutil.rmtree(tree / ".whl")
        (tree / ".whl").write_text("mine")
    before = {p.relative_to(tree): p.read_bytes() for p in tree.rglob("*") if p.is_file() and ".git/" not in str(p)}
    res = subprocess.run(["bash", str(tree / "scripts" / "gpu_wheels.sh")], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and ".whl" in one_line(res.stderr), res.stderr
    after = {p.relative_to(tree): p.read_bytes() for p in tree.rglob("*") if p.is_file() and ".git/" not in str(p)}
    assert after == before and not (tree / "ran").exists()


def test_gpu_wheels_ctrl_c_during_the_download_keeps_the_earlier_wheels(tmp_path):
    pip = 'touch "$DIR/${SPECS[0]%%==*}-0-py3-none-any.whl" "$DIR/../../started"; sleep 60'
    tree, env = wheels_tree(tmp_path, pip)
    proc = subprocess.Popen(
        ["bash", str(tree / "scripts" / "gpu_wheels.sh")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not (tree / "started").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGINT, stderr
    assert "interrupted: no wheel replaced" in one_line(stderr)
    assert wheels_in(tree) == OLD_WHEELS


# $TROLL_TEST_DEVICE: one usage error for the whole run.


@pytest.mark.parametrize("value", ["gpu0", "cuda:0", ""])
def test_a_test_device_other_than_cuda_or_cpu_is_one_usage_error(value):
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "test_gpu.py")],
        capture_output=True,
        text=True,
        env=dict(os.environ, TROLL_TEST_DEVICE=value),
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 4, res.stdout[-2000:] + res.stderr
    said = (res.stdout + res.stderr).strip().splitlines()
    assert said == [f"ERROR: TROLL_TEST_DEVICE={value!r}: give cuda (the default; tests/test_gpu.py skips without a "
                    "GPU) or cpu (the same tests on CPU)"], said  # fmt: skip
    assert "Traceback" not in res.stdout + res.stderr
