"""Misuse and damage, one class of row at a time (issue 32), each through the real command where the command is what
fails. The table of entry points, what a user gets wrong and what each does is docs/misuse.md; the classes:

- misuse (an argument, a file, a missing environment): exit 2, one line naming the problem and the fix, no
  traceback, nothing written or changed;
- a run's log (metrics.jsonl, samples.jsonl) damaged: resume repairs it, says so, and the run goes on; a file that
  decides (config.json, summary.json, checkpoints/latest) missing or damaged: written again from the checkpoint, or
  one line naming the file and the command that continues;
- Ctrl-C: one line with the command that continues, the process ended by SIGINT (a shell's status 130);
- a study's results file torn or listing a run twice with different results: one line naming the file;
- a setting troll_loss would refuse is refused by TROLLConfig when it is given; a support listing a token twice is
  refused by sparsify_topk.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_commands import GOOD, ROOT, command

from troll.base.config import Config
from troll.sparse import sparsify_topk

NO_VLLM = (
    "import sys, runpy; sys.modules['vllm'] = None; sys.argv = {argv!r}; runpy.run_module({mod!r}, run_name='__main__')"
)


def without_vllm(module: str, *argv: str) -> subprocess.CompletedProcess:
    """`python -m module argv` on a machine where vLLM cannot be imported."""
    return command("-c", NO_VLLM.format(argv=[module, *argv], mod=module))


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` with its bytes (but a run's .lock, which names its last holder): what a refused
    command must leave as it was."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".lock"
    }


def tree(root: Path) -> dict[str, tuple]:
    """Everything under `root`, links not followed: each file's bytes, each link's target, each folder: what a
    command must leave as it was, `.lock` included (a user's file of that name is no lock of troll's)."""
    found: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            kind = ("link", os.readlink(p)) if p.is_symlink() else ("dir",) if p.is_dir() else ("file", p.read_bytes())
            found[str(p.relative_to(root))] = kind
    return found


def one_line(result: subprocess.CompletedProcess, status: int, *words: str) -> str:
    """Assert the exit status, no traceback, and a last stderr line naming `words`; returns that line."""
    assert result.returncode == status, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    for word in words:
        assert word in line, (word, line)
    return line


# ------------------------------------------------------------------------------------------------ misuse: exit 2


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A folder with a GSM8K folder, a one-file GSM8K source, a plain file, and a fake run of troll.train whose
    training problems are the GSM8K folder's test problems."""
    data = tmp_path / "gsm8k"
    data.mkdir()
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "one.jsonl").write_text(json.dumps(GOOD) + "\n")
    (tmp_path / "file").write_text("x")
    ckpt = tmp_path / "run" / "checkpoints" / "step-000001"
    ckpt.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (ckpt / name).write_text("{}")
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step-000001")
    Config(task="gsm8k", data=str(data)).save(tmp_path / "run" / "config.json")
    return tmp_path


MISUSE = [  # (command, flags with {w} for the work folder, words of the error line)
    ("troll.train", ["--out", "{w}/file/run"], ["--out", "Not a directory"]),
    ("troll.train", ["--out", "{w}/new", "--task", "gsm8k", "--data", "{w}/one.jsonl"], ["1 of the 1 test problems"]),
    ("troll.tools.evaluate", ["--model", "{w}/run", "--data", "{w}/gsm8k"], ["also training problems", "held-out"]),
    ("troll.tools.evaluate", ["--model", "{w}/run", "--data", "{w}/gsm8k", "--out", "{w}/file/x"], ["is a file"]),
    ("troll.tools.export", ["{w}/gsm8k", "--out", "{w}/merged"], ["not a LoRA run"]),
    ("troll.tools.plot", ["{w}/gsm8k", "--out", "{w}/plots"], ["metrics.jsonl"]),
]
if not torch.cuda.is_available():
    MISUSE.append(("troll.train", ["--out", "{w}/new", "--device", "cuda"], ["--device cuda", "--device cpu"]))


@pytest.mark.slow
@pytest.mark.parametrize(("module", "flags", "words"), MISUSE, ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_misuse_is_one_line_and_writes_nothing(workdir, module, flags, words):
    before = files(workdir)
    result = command("-m", module, *(f.format(w=workdir) for f in flags))
    assert ": error: " in one_line(result, 2, *words)
    assert files(workdir) == before
    assert not (workdir / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "flags"),
    [("troll.train", ["--backend", "vllm"]), ("troll.tools.evaluate", ["--model", "{w}/run", "--backend", "vllm"])],
)
def test_a_missing_vllm_is_refused_before_anything_is_written(workdir, module, flags):
    before = files(workdir)
    out = ["--out", str(workdir / "new")]
    data = ["--data", str(workdir / "gsm8k")] if module == "troll.tools.evaluate" else []  # train: addition, no --data
    one_line(without_vllm(module, *out, *data, *(f.format(w=workdir) for f in flags)), 2, "vllm", "--backend hf")
    assert files(workdir) == before
    assert not (workdir / "new").exists()


# ------------------------------------------------------------------- files that are not the command's: troll.tools.plot


@pytest.fixture
def plotted_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "eval_acc": 0.2}\n{"step": 1, "reward": 0.5}\n')
    return run


def plot(capsys, *argv: str) -> tuple[int, str]:
    """`troll plot argv` in this process: its exit status and stderr."""
    from troll.tools.plot import main

    try:
        main(list(argv))
        status = 0
    except SystemExit as e:
        status = e.code
    return status, capsys.readouterr().err


def png_of_matplotlib(path: Path) -> None:
    """A figure matplotlib writes without troll.tools.plot's mark: someone's, or one troll.tools.plot wrote before it
    had one."""
    from matplotlib.figure import Figure

    fig = Figure()
    fig.subplots().plot([0, 1])
    fig.savefig(path)


@pytest.mark.parametrize("kind", ["a file", "a figure", "a link", "a dangling link", "a folder"])
def test_plot_never_replaces_or_writes_through_what_it_did_not_write(plotted_run, tmp_path, capsys, kind):
    """A metrics.png in --out that troll.tools.plot did not write (a user's file, a figure without its mark, a folder)
    or a symbolic link of that name (to a user's file, or to none): one line naming it, exit 2, every byte as it was."""
    out = tmp_path / "plots"
    out.mkdir()
    figure, mine = out / "metrics.png", tmp_path / "mine.png"
    if kind == "a file":
        figure.write_bytes(b"my own metrics.png")
    elif kind == "a figure":
        png_of_matplotlib(figure)
    elif kind == "a link":
        png_of_matplotlib(mine)
        figure.symlink_to(mine)
    elif kind == "a dangling link":
        figure.symlink_to(mine)
    else:
        (figure / "notes.txt").parent.mkdir()
        (figure / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    status, err = plot(capsys, str(plotted_run), "--out", str(out))
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert str(figure) in err and "choose another --out" in err and "Traceback" not in err
    assert tree(tmp_path) == before


def test_plot_replaces_its_own_figure(plotted_run, tmp_path, capsys):
    """A figure troll.tools.plot wrote carries its mark: the same command replaces it, and nothing else is left."""
    from troll.tools.plot import marked

    out = tmp_path / "plots"
    assert plot(capsys, str(plotted_run), "--out", str(out)) == (0, "")
    assert marked(out / "metrics.png")
    (out / "metrics.png").write_bytes((out / "metrics.png").read_bytes()[:-12])  # its own, torn: still its own
    assert plot(capsys, str(plotted_run), "--out", str(out)) == (0, "")
    assert [p.name for p in out.iterdir()] == ["metrics.png"] and marked(out / "metrics.png")
    assert (out / "metrics.png").read_bytes().endswith(b"IEND\xaeB`\x82")  # whole again: PNG's last chunk


# ---------------------------------------------------------------------------------- damaged run files: resume


TINY = ["--sft_steps", "0", "--eval_size", "4", "--eval_every", "1", "--save_every", "1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A tiny run of 2 steps with a checkpoint at each."""
    out = tmp_path_factory.mktemp("base") / "run"
    result = command("-m", "troll", "train", "--out", str(out), "--steps", "2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def torn_middle(run: Path, name: str) -> None:
    lines = (run / name).read_text().splitlines(keepends=True)
    lines[0] = lines[0][:10] + "\n"
    (run / name).write_text("".join(lines))


DAMAGE = {  # what is done to the run, and what the resumed run says about it (stdout + stderr)
    "metrics.jsonl torn in the middle": (lambda r: torn_middle(r, "metrics.jsonl"), "metrics.jsonl line 1: skipped"),
    "samples.jsonl torn in the middle": (lambda r: torn_middle(r, "samples.jsonl"), "samples.jsonl line 1: skipped"),
    "metrics.jsonl missing": (lambda r: (r / "metrics.jsonl").unlink(), "resuming"),
    "config.json missing": (lambda r: (r / "config.json").unlink(), "config.json was missing: written again"),
    "config.json torn": (lambda r: (r / "config.json").write_text('{"lr": '), "config.json was damaged: written again"),
    "summary.json torn": (lambda r: (r / "summary.json").write_text("{"), "summary.json removed"),
    "summary.json missing": (lambda r: (r / "summary.json").unlink(), "eval:"),
    "checkpoints/latest missing": (lambda r: (r / "checkpoints" / "latest").unlink(), "resuming"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_run_file_is_repaired_and_the_run_goes_on(finished_run, tmp_path, damage):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    harm, said = DAMAGE[damage]
    harm(run)
    result = command("-m", "troll", "train", "--out", str(run), "--resume", "true", "--steps", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert said in result.stdout + result.stderr
    summary = json.loads((run / "summary.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3 and max(m["step"] for m in metrics) == 3  # summary, metrics, checkpoint agree
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-000003"


@pytest.mark.slow
def test_no_whole_checkpoint_names_the_command_that_continues(finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for ckpt in (run / "checkpoints").glob("step-*"):
        (ckpt / "trainer.pt").write_bytes((ckpt / "trainer.pt").read_bytes()[:100])
    before = files(run)
    result = command("-m", "troll", "train", "--out", str(run), "--resume", "true", "--steps", "3")
    one_line(result, 2, "no checkpoint", "is whole", "another --out")
    assert files(run) == before


# ------------------------------------------------------------------------------------------------------ Ctrl-C


def as_from_a_shell() -> None:
    """A child's SIGINT as a shell leaves it: at its default and not blocked, whatever a library loaded in this test
    process (vLLM's engines run in it) has done to its own; a command inherits an ignored or blocked SIGINT, and
    Python then installs no KeyboardInterrupt handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


@pytest.mark.slow
def test_ctrl_c_says_how_to_continue(tmp_path):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "troll", "train", "--out", str(out), "--steps", "500", *TINY]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_shell
    )
    deadline = time.time() + 300  # a loaded machine takes longer to reach the first checkpoint
    while not (out / "checkpoints" / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    result = subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)
    one_line(result, -signal.SIGINT, "interrupted", f"troll train --out {out} --resume true")


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, prog",
    [
        (["-m", "troll", "check", "--shape", "tiny", "--backend", "hf", "--out", "{tmp}/check"], "troll check"),
        (["bench/step.py"], "python bench/step.py"),
    ],
    ids=["check", "bench"],
)
def test_ctrl_c_in_the_check_and_a_benchmark_is_one_line(tmp_path, argv, prog):
    """Ctrl-C in the middle of the acceptance check or a benchmark (its first line printed, or its run folder made:
    past the imports, into the work, however loaded the machine): one line, ended by SIGINT, no traceback."""
    argv = [sys.executable, *(a.format(tmp=tmp_path) for a in argv)]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=as_from_a_shell
    )
    if "bench" in prog:
        first = proc.stdout.readline()
    else:
        deadline = time.time() + 300
        while not (tmp_path / "check").exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        first = time.sleep(2)  # a little into the check's work
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert first != ""  # the benchmark was at work, not finished
    one_line(subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), -signal.SIGINT, prog, "interrupted")


@pytest.mark.slow
def test_ctrl_c_in_the_checks_child_process_is_one_line(tmp_path):
    """Ctrl-C as a terminal (or `timeout --signal=INT`) sends it, to the whole process group, while the check's
    watched run works in its child process: one line, ended by SIGINT, no traceback from either process."""
    argv = [sys.executable, "-m", "troll", "check", "--shape", "tiny", "--backend", "hf", "--out", str(tmp_path / "c")]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_shell, start_new_session=True)  # fmt: skip
    deadline = time.time() + 300
    while not (tmp_path / "c" / "run" / "config.json").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)  # the child has started the run
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    one_line(
        subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr),
        -signal.SIGINT,
        "troll check",
        "interrupted",
    )


# ------------------------------------------------------------------------------------------ study results files


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"name": "a"}\n{"name": \n{"name": "b"}\n', ["line 2", "not valid JSON"]),
        ('{"name": "a", "x": 1}\n{"name": "a", "x": 2}\n', ["'a' is listed twice"]),
    ],
    ids=["torn", "duplicated"],
)
@pytest.mark.parametrize("module", ["study.offpolicy", "study.bandit"])
def test_a_damaged_results_file_is_one_line(tmp_path, module, text, words):
    path = tmp_path / "results.jsonl"
    path.write_text(text)
    one_line(command("-m", module, "--results", str(path), "--report"), 2, str(path), *words)
    assert path.read_text() == text


# ------------------------------------------------------------------------------------------- the library


@pytest.mark.parametrize(
    ("setting", "value"),
    [("troll_eps", math.inf), ("troll_eps", math.nan), ("troll_eps", -1.0), ("troll_alpha", math.inf),
     ("troll_alpha", -0.5), ("troll_k", 0), ("troll_delta", 1.0), ("troll_support", "dense")],
)  # fmt: skip
def test_trollconfig_refuses_what_troll_loss_would(tmp_path, setting, value):
    pytest.importorskip("trl")
    from troll.integrations.trl import TROLLConfig

    with pytest.raises(ValueError, match=setting):
        TROLLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{setting: value})


def test_a_support_listing_a_token_twice_is_refused():
    top_logp = torch.log(torch.tensor([[0.5, 0.3], [0.6, 0.2]]))
    top_idx = torch.tensor([[1, 2], [4, 4]])
    with pytest.raises(ValueError, match="row 1 lists token id 4 twice"):
        sparsify_topk(top_logp, top_idx, top_logp[:, 0], top_idx[:, 0], 10)
