"""The run directory survives faults and misuse (troll/run/harness.py, troll/base/checkpoint.py): every interruption is
resumable, a directory belongs to one run, resume says what changes, damaged files are named."""

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_damage import invoke
from test_misuse import tree
from test_train import rows, tiny

from troll.base.checkpoint import complete_checkpoints, read_jsonl, truncate_jsonl
from troll.base.config import Config
from troll.run.harness import MARKER, Run, RunError
from troll.train import train

pytestmark = pytest.mark.usefixtures("varied_reward")


@pytest.fixture
def varied_reward(monkeypatch):
    monkeypatch.setattr("troll.tasks.addition.reward", lambda completion, gold: float(len(completion) % 2))


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run([sys.executable, "-m", "troll", "train", *args], capture_output=True, text=True, env=env)


def test_torn_metrics_line_is_repaired_on_resume(tmp_path):
    """A crash or a full disk during an append leaves a torn last line; resume drops it, says so, and goes on."""
    cfg = tiny(tmp_path, steps=2, save_every=1)
    train(dataclasses.replace(cfg, steps=1))
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 2, "rew')
    with pytest.warns(UserWarning, match="torn last line"):
        train(dataclasses.replace(cfg, resume=True))
    assert [m["step"] for m in rows(tmp_path / "run")] == [1, 2]
    assert all(line.endswith("}") for line in metrics.read_text().splitlines())


def test_a_bad_line_before_the_last_is_named(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"m.jsonl line 2"):
        read_jsonl(path)


def test_truncation_is_atomic(tmp_path, monkeypatch):
    """Resume cuts the logs back through a temporary file and a rename: a crash during it loses no row."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(5)))
    before = path.read_bytes()

    def crash(*args):
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        truncate_jsonl(path, 2)
    assert path.read_bytes() == before


@pytest.mark.parametrize("step", ['"3"', "null", "true", "-1", "2.5", "[1]"])
def test_truncation_drops_a_row_without_an_integer_step_with_a_warning(tmp_path, step):
    """A log row whose step is not an integer >= 0 is damaged: resume drops it, naming the file, and keeps the
    rows of steps up to the checkpoint (the comparison it replaced raised a TypeError on a string)."""
    path = tmp_path / "samples.jsonl"
    path.write_text(f'{{"step": 1, "x": 1}}\n{{"step": {step}}}\n{{"other": 2}}\n{{"step": 2}}\n{{"step": 3}}\n')
    with pytest.warns(UserWarning, match=f"{path}: skipped a damaged row without a step") as caught:
        truncate_jsonl(path, 2)
    assert len(caught) == 2 and read_jsonl(path) == [{"step": 1, "x": 1}, {"step": 2}]


@pytest.mark.slow
def test_killed_during_the_first_checkpoint_restarts_or_resumes(tmp_path, monkeypatch, capsys):
    """Killed while the step-0 checkpoint is written (a temporary folder, no `latest`): the same command starts
    the run again, and `--resume true` does too."""
    import troll.base.checkpoint as checkpoint

    cfg = tiny(tmp_path, steps=1)

    def killed(out, *args):
        (out / "checkpoints" / ".tmp-step-000000").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr("troll.run.harness.save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr("troll.run.harness.save_checkpoint", checkpoint.save_checkpoint)
    capsys.readouterr()
    train(cfg)
    assert "stopped before its first checkpoint" in capsys.readouterr().out
    assert [m["step"] for m in rows(tmp_path / "run")] == [1]

    other = tiny(tmp_path / "b", steps=1)
    monkeypatch.setattr("troll.run.harness.save_checkpoint", killed)
    with pytest.raises(KeyboardInterrupt):
        train(other)
    monkeypatch.setattr("troll.run.harness.save_checkpoint", checkpoint.save_checkpoint)
    train(dataclasses.replace(other, resume=True))
    assert "no checkpoint to resume from yet" in capsys.readouterr().out
    assert [m["step"] for m in rows(tmp_path / "b" / "run")] == [1]


@pytest.mark.slow
def test_a_second_process_on_the_same_out_is_refused(tmp_path):
    cfg = tiny(tmp_path)
    run = Run.open(cfg)
    try:
        with pytest.raises(RunError, match="in use by a running troll.train"):
            Run.open(cfg)
        done = cli("--out", str(tmp_path / "run"), "--sft_steps", "0", "--steps", "1")
        assert done.returncode == 2 and "in use" in done.stderr and "Traceback" not in done.stderr
    finally:
        run.lock.close()


@pytest.mark.slow
def test_foreign_files_are_not_overwritten(tmp_path):
    """A directory holding a finished run's files without checkpoints (or another config's) is refused, naming
    the files; nothing in it changes. Without troll's marker it is not a run's folder at all; with it, the files
    are a finished run's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.json").write_text('{"eval_after": 0.9}\n')
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    for marked, words in ((False, "holds no troll run (metrics.jsonl, summary.json"), (True, "would overwrite")):
        if marked:
            (out / MARKER).write_text('{"kind": "troll run", "folder": "made"}\n')
        before = tree(out)
        with pytest.raises(RunError, match=re.escape(words)):
            train(tiny(tmp_path))
        assert {k: v for k, v in tree(out).items() if k != ".lock" or not marked} == before  # a run's folder: locked
        done = cli("--out", str(out), "--sft_steps", "0", "--steps", "1")
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


def test_a_finished_run_is_not_restarted_over(tmp_path):
    cfg = tiny(tmp_path, steps=1)
    train(cfg)
    with pytest.raises(RunError, match="already holds a run"):
        train(cfg)


def test_resume_applies_a_new_lr_and_records_it(tmp_path):
    """`--resume true --lr X`: the learning rate given is the one used from the resumed step on, and summary.json
    records the change with its step; config.json holds the setting in force."""
    cfg = tiny(tmp_path, steps=2, save_every=1)
    train(dataclasses.replace(cfg, steps=1))
    summary = train(Config.from_args(["--out", str(tmp_path / "run"), "--resume", "true", "--steps", "2",
                                      "--lr", "0.001"]))  # fmt: skip
    lrs = [m["lr"] for m in rows(tmp_path / "run")]
    assert lrs == [pytest.approx(1e-2), pytest.approx(1e-3)]
    assert summary["changes"] == [{"step": 1, "steps": 2, "lr": 0.001}]
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lr"] == 0.001


def test_resume_refuses_settings_that_cannot_change(tmp_path):
    cfg = tiny(tmp_path, steps=1)
    train(cfg)
    out = str(tmp_path / "run")
    done = cli("--out", out, "--resume", "true", "--loss", "ppo_clip", "--steps", "2")
    assert done.returncode == 2 and "cannot change on resume: --loss" in done.stderr
    done = cli("--out", out, "--resume", "true", "--preset", "tiny-cpu")
    assert done.returncode == 2 and "--preset with --resume" in done.stderr
    with pytest.raises(RunError, match="cannot change on resume: loss="):
        train(dataclasses.replace(cfg, resume=True, steps=2, loss="cispo"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["trainer.pt", "model.safetensors", "tokenizer"])
def test_a_damaged_checkpoint_is_named_and_the_older_one_used(tmp_path, damage, capsys):
    cfg = tiny(tmp_path, steps=2, save_every=1)
    train(dataclasses.replace(cfg, steps=1))
    newest = complete_checkpoints(tmp_path / "run")[0]
    assert newest.name == "step-000001"
    if damage == "tokenizer":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (newest / name).unlink()
    else:
        path = newest / damage
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    capsys.readouterr()
    train(dataclasses.replace(cfg, resume=True))
    out = capsys.readouterr().out
    assert f"checkpoint damaged: {newest}" in out and "resuming from the older checkpoint" in out
    assert [m["step"] for m in rows(tmp_path / "run")] == [1, 2]


def test_state_from_an_older_troll_is_refused(tmp_path):
    """One policy for runs written by older versions: refused with a message naming what is missing."""
    cfg = tiny(tmp_path, steps=2, save_every=1)
    train(dataclasses.replace(cfg, steps=1))
    for ckpt in complete_checkpoints(tmp_path / "run"):
        state = torch.load(ckpt / "trainer.pt", weights_only=False)
        del state["eval_best"]
        torch.save(state, ckpt / "trainer.pt")
    with pytest.raises(RunError, match=r"lacks \['eval_best'\]"):
        train(dataclasses.replace(cfg, resume=True))


@pytest.mark.slow
def test_out_that_is_a_file_is_named(tmp_path):
    (tmp_path / "run").write_text("not a folder")
    with pytest.raises(RunError, match="cannot be a run directory"):
        train(tiny(tmp_path))
    done = cli("--out", str(tmp_path / "run"), "--sft_steps", "0", "--steps", "1")
    assert done.returncode == 2 and "cannot be a run directory" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_missing_model_or_data_is_one_line_before_any_work(tmp_path):
    for argv, words in (
        (["--model", str(tmp_path / "nope")], "does not exist"),
        (["--task", "gsm8k", "--data", str(tmp_path / "no-data")], "does not exist"),
    ):
        done = cli(*argv, "--out", str(tmp_path / "run"))
        assert done.returncode == 2 and words in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert not (tmp_path / "run").exists()
    train(tiny(tmp_path / "a", steps=1))
    done = cli("--model", str(tmp_path / "a" / "run"), "--out", str(tmp_path / "run"))
    assert done.returncode == 2 and "is a run directory: pass one of its checkpoints" in done.stderr


def test_resume_accepts_the_same_out_written_differently(tmp_path):
    cfg = tiny(tmp_path, steps=2, save_every=1)
    train(dataclasses.replace(cfg, steps=1))
    train(dataclasses.replace(cfg, out=str(tmp_path / "run") + "/", resume=True))
    assert [m["step"] for m in rows(tmp_path / "run")] == [1, 2]


@pytest.mark.slow
def test_a_resume_change_is_recorded_even_if_killed_before_the_next_checkpoint(tmp_path, monkeypatch):
    """`--resume true --lr X --steps 3` rewrites config.json at once; killed before its next checkpoint, the next
    plain resume still applies and records the change: resume compares against the checkpoint's settings."""
    import troll.train as train_mod

    cfg = tiny(tmp_path, steps=3, save_every=1)
    train(dataclasses.replace(cfg, steps=1))

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_mod, "rl_step", killed)
    with pytest.raises(KeyboardInterrupt):
        train(Config.from_args(["--out", str(tmp_path / "run"), "--resume", "true", "--lr", "0.001", "--steps", "3"]))
    monkeypatch.undo()
    summary = train(Config.from_args(["--out", str(tmp_path / "run"), "--resume", "true"]))
    assert summary["changes"] == [{"step": 1, "lr": 0.001, "steps": 3}]
    assert [m["lr"] for m in rows(tmp_path / "run")][1:] == [pytest.approx(1e-3)] * 2


@pytest.mark.slow
def test_batches_sampled_ahead_resume_from_any_entry_point(tmp_path):
    """A checkpoint written by `troll train --staleness 1` holds its pending batch as troll.rollout.Batch,
    so the API (or a notebook, or the study) resumes it too."""
    from troll.rollout import Batch

    out = tmp_path / "run"
    done = cli("--out", str(out), "--sft_steps", "0", "--steps", "1", "--save_every", "1", "--staleness", "1",
               "--eval_size", "16", "--prompts_per_step", "4", "--samples_per_prompt", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    state = torch.load(complete_checkpoints(out)[0] / "trainer.pt", weights_only=False)
    assert len(state["pending"]) == 1 and isinstance(state["pending"][0], Batch)
    train(dataclasses.replace(Config.load(out / "config.json"), steps=2, resume=True))
    assert [m["step"] for m in rows(out)] == [1, 2]


def test_a_pending_batch_saved_with_a_field_since_removed_loads(tmp_path):
    """Checkpoints written before Batch lost its `behaviour` field (the rare task's share of marked samples, now
    computed by troll.run.diagnostics) hold it in every pending batch: torch.load still gives a Batch, field set
    aside."""
    from troll.rollout import Batch

    batch = Batch(None, torch.ones(4), torch.zeros(4), torch.Generator().manual_seed(3).get_state(), 1.5, 0.5)
    batch.behaviour = 0.25  # what such a checkpoint pickled: the fields of then
    torch.save({"pending": [batch]}, tmp_path / "trainer.pt")
    (loaded,) = torch.load(tmp_path / "trainer.pt", weights_only=False)["pending"]
    assert isinstance(loaded, Batch) and torch.equal(loaded.rewards, batch.rewards)
    assert torch.equal(loaded.rng_state, batch.rng_state) and (loaded.time_generate, loaded.time_score) == (1.5, 0.5)


# ------------------------------------------------------------------ whose folder: a run writes only in its own

QUICK = ["--sft_steps", "0", "--eval_size", "4", "--eval_every", "1", "--save_every", "1", "--prompts_per_step", "4",
         "--samples_per_prompt", "2", "--steps", "1"]  # fmt: skip


def users_folder(out: Path, *kinds: str) -> None:
    """A folder of someone else's files, of names a run also writes: a model's config.json, a project's checkpoint,
    notes in base/, their own .lock, a config.json that links to a valid troll config elsewhere."""
    out.mkdir()
    for kind in kinds:
        if kind == "config.json":
            (out / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}\n')
        elif kind == "checkpoints":
            (out / "checkpoints" / "epoch3").mkdir(parents=True)
            (out / "checkpoints" / "epoch3" / "model.pt").write_bytes(b"\x80\x02weights")
        elif kind == "base":
            (out / "base").mkdir()
            (out / "base" / "notes.txt").write_text("my notes\n")
        elif kind == ".lock":
            (out / ".lock").write_text("my lock: do not touch\n")
        else:  # "linked config.json"
            (out.parent / "elsewhere").mkdir()
            Config(out=str(out)).save(out.parent / "elsewhere" / "config.json")
            (out / "config.json").symlink_to(out.parent / "elsewhere" / "config.json")


KINDS = ["config.json", "checkpoints", "base", ".lock", "linked config.json"]


@pytest.mark.parametrize("resume", [False, True], ids=["new", "resume"])
@pytest.mark.parametrize("kinds", [[k] for k in KINDS] + [KINDS[:-1], KINDS[1:]], ids=[*KINDS, "all", "all linked"])
def test_a_folder_that_is_not_a_runs_is_refused_and_left_byte_for_byte(tmp_path, kinds, resume):
    """`troll.train --out DIR` in a folder of someone else's files (issue: it once took them for a failed start,
    overwrote config.json and deleted checkpoints/ and base/): one line naming the folder, exit 2, and every byte,
    link and folder under tmp_path as it was (nothing added either, not even a lock)."""
    out = tmp_path / "mine"
    users_folder(out, *kinds)
    before = tree(tmp_path)
    result = invoke("troll.train", "--out", str(out), *(["--resume", "true"] if resume else QUICK))
    lines = result.err.strip().splitlines()
    assert result.status == 2 and len(lines) == 1 and str(out) in lines[0], result.err[-3000:]
    assert resume or "choose a new or empty --out" in lines[0]
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "config.json.tmp", ".lock", MARKER, "checkpoints"])
def test_a_link_where_the_run_writes_is_refused_never_written_through(tmp_path, name):
    """In a run's own folder (here: a start that failed before its first checkpoint), a symbolic link where the run
    writes: one line naming it, exit 2; the link and what it points to as they were."""
    out = tmp_path / "run"
    Run.open(tiny(tmp_path)).lock.close()  # claimed: the marker and config.json written, then the start failed
    target = tmp_path / "elsewhere"
    if name == "checkpoints":
        target.mkdir()
        (target / "latest").write_text("mine\n")
    else:
        target.write_text("someone's file\n")
    if (out / name).exists():
        (out / name).unlink()
    (out / name).symlink_to(target)
    before = tree(tmp_path)
    result = invoke("troll.train", "--out", str(out), *QUICK)
    lines = result.err.strip().splitlines()
    assert result.status == 2 and len(lines) == 1 and str(out / name) in lines[0], result.err[-3000:]
    assert "symbolic link" in lines[0]
    assert tree(tmp_path) == before


def test_a_new_or_empty_folder_is_marked_and_a_lock_not_troll_s_is_never_rewritten(tmp_path):
    """A new folder (its parents too) and an empty one are claimed: the marker first, saying which. A .lock in a
    run's folder that does not hold troll's "pid N" is locked as it is, its bytes unchanged."""
    new, empty = tmp_path / "a" / "new", tmp_path / "empty"
    empty.mkdir()
    for out, folder in ((new, "made"), (empty, "empty")):
        with Run.open(dataclasses.replace(tiny(tmp_path), out=str(out))):
            assert json.loads((out / MARKER).read_text()) == {"kind": "troll run", "folder": folder}
            assert (out / ".lock").read_text() == f"pid {os.getpid()}\n"
        assert sorted(p.name for p in out.iterdir()) == [".lock", MARKER, "config.json"]
    (empty / ".lock").write_text("my notes\n")
    with Run.open(dataclasses.replace(tiny(tmp_path), out=str(empty))):
        assert (empty / ".lock").read_text() == "my notes\n"
    assert (empty / ".lock").read_text() == "my notes\n"


def test_a_failed_start_leaves_a_folder_the_same_command_starts_again(tmp_path, monkeypatch, capsys):
    """A start that failed after claiming an empty folder (here: the rollout engine) leaves the marker and the run's
    files; the same command starts again there, removing only the run's files: one of the user's put there since
    stays."""
    out = tmp_path / "run"
    out.mkdir()
    cfg = tiny(tmp_path, steps=1)

    def broken(*args, **kwargs):
        raise RuntimeError("the engine did not start")

    monkeypatch.setattr("troll.run.start.make_generator", broken)
    with pytest.raises(RuntimeError, match="did not start"):
        train(cfg)
    monkeypatch.undo()
    assert (out / MARKER).is_file() and (out / "config.json").is_file() and not (out / "checkpoints").exists()
    (out / "notes.txt").write_text("mine\n")
    capsys.readouterr()
    train(cfg)
    assert "stopped before its first checkpoint here (config.json)" in capsys.readouterr().out
    assert (out / "notes.txt").read_text() == "mine\n" and [m["step"] for m in rows(out)] == [1]


def test_a_run_made_before_the_marker_resumes_and_is_marked(tmp_path, capsys):
    """A run from before troll marked its folders (a config.json troll accepts beside a whole checkpoint) resumes,
    and is marked "adopted"; a new run there is refused as in any run's folder."""
    cfg = tiny(tmp_path, steps=2, save_every=1)
    out = tmp_path / "run"
    train(dataclasses.replace(cfg, steps=1))
    (out / MARKER).unlink()
    with pytest.raises(RunError, match="already holds a run"):
        train(cfg)
    assert not (out / MARKER).exists()
    train(dataclasses.replace(cfg, resume=True))
    assert [m["step"] for m in rows(out)] == [1, 2]
    assert json.loads((out / MARKER).read_text()) == {"kind": "troll run", "folder": "adopted"}


# ------------------------------------------------------------------ what a resume says, and config.json on resume


def resume(out: Path, *flags: str):
    """`troll train --out OUT --resume true FLAGS`, in this process (test_damage.invoke)."""
    return invoke("troll.train", "--out", str(out), "--resume", "true", *flags)


def test_a_resumed_run_says_its_checkpoint_its_step_and_the_steps_it_computes_again(tmp_path):
    """A run stopped after step 3 with its last checkpoint at step 2 (metrics.jsonl shows step 3): the resumed run's
    line names the checkpoint and its step, and the one step it computes again; a run resumed where it stopped has
    no step to compute again. One such line each, on stdout as the run's other lines."""
    out = tmp_path / "run"
    train(tiny(tmp_path, steps=3, save_every=2))  # checkpoints at steps 2 and 3
    shutil.rmtree(out / "checkpoints" / "step-000003")  # as if stopped before the checkpoint of step 3
    (out / "summary.json").unlink()
    ckpt = out / "checkpoints"
    said = resume(out)
    assert said.status == 0, said.err[-3000:]
    lines = [line for line in said.out.splitlines() if line.startswith("resuming from")]
    assert lines == [f"resuming from {ckpt / 'step-000002'} at step 2 of 3; recomputing 1 step done after it before "
                     "the stop (step 3)"], said.out  # fmt: skip
    assert [m["step"] for m in rows(out)] == [1, 2, 3]
    said = resume(out, "--steps", "4")
    lines = [line for line in said.out.splitlines() if line.startswith("resuming from")]
    assert said.status == 0 and lines == [
        f"resuming from {ckpt / 'step-000003'} at step 3 of 4; no step after it had been done"
    ], said.out


def test_resume_counts_every_step_after_the_checkpoint_up_to_the_last_one_done(tmp_path, capsys):
    """Steps run in order: the last step metrics.jsonl shows decides, damaged rows before it too (dropped, warned)."""
    out = tmp_path / "run"
    train(tiny(tmp_path, steps=3))  # checkpoints at steps 0 and 3
    shutil.rmtree(out / "checkpoints" / "step-000003")
    (out / "summary.json").unlink()
    metrics = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    metrics[2] = "not json\n"  # a row of step 1 or 2
    (out / "metrics.jsonl").write_text("".join(metrics))
    capsys.readouterr()
    with pytest.warns(UserWarning, match="line 3: skipped a damaged line"):
        train(dataclasses.replace(tiny(tmp_path, steps=3), resume=True))
    said = capsys.readouterr().out
    assert f"resuming from {out / 'checkpoints' / 'step-000000'} at step 0 of 3; recomputing 3 steps done after " \
           "it before the stop (steps 1-3)" in said  # fmt: skip


def damaged_config(out: Path) -> bytes:
    """Tear `out`'s config.json in half; its bytes now."""
    path = out / "config.json"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.read_bytes()


@pytest.mark.parametrize("folder", ["user's", "a run without its marker"])
def test_resume_in_a_folder_not_a_runs_with_a_damaged_config_changes_nothing(tmp_path, folder):
    """`--resume true` where config.json is damaged, in a folder troll cannot tell is a run's (no marker, and no
    config.json it accepts): one line naming the folder, exit 2, and every byte under tmp_path as it was. (It once
    wrote config.json from the checkpoint's settings at parse time, kept the damaged one as config.json.damaged,
    and then took the folder for a run from before the marker.)"""
    out = tmp_path / "mine"
    if folder == "user's":
        users_folder(out, "config.json", "checkpoints", "base")
    else:
        train(tiny(tmp_path, steps=1, out=str(out)))
        (out / MARKER).unlink()
    damaged_config(out)
    before = tree(tmp_path)
    result = resume(out)
    lines = result.err.strip().splitlines()
    assert result.status == 2 and len(lines) == 1 and str(out) in lines[0], result.err[-3000:]
    assert "config.json is not valid JSON" in lines[0] and f"no {MARKER}" in lines[0], lines[0]
    assert tree(tmp_path) == before


def test_a_damaged_config_is_written_again_only_after_every_check(tmp_path):
    """In a run's own folder, a damaged config.json is left as it is while anything else is refused (here: --steps
    below the steps done; a config.json that is a link, never renamed or written through); once every check
    passes it is written again from the checkpoint's settings, the damaged one kept as config.json.damaged, and
    said. A finished run resumed with nothing to do gets its config.json written again too."""
    out = tmp_path / "run"
    train(tiny(tmp_path, steps=2, save_every=1))
    torn = damaged_config(out)
    unlocked = lambda: {k: v for k, v in tree(tmp_path).items() if k != "run/.lock"}  # noqa: E731
    before = unlocked()
    result = resume(out, "--steps", "1")
    assert result.status == 2 and "--steps 1 is below the 2 steps done" in result.err, result.err[-3000:]
    assert unlocked() == before
    (out / "config.json").rename(tmp_path / "elsewhere.json")
    (out / "config.json").symlink_to(tmp_path / "elsewhere.json")
    before = unlocked()
    result = resume(out, "--steps", "3")
    assert result.status == 2 and f"{out / 'config.json'} is a symbolic link" in result.err, result.err[-3000:]
    assert unlocked() == before
    (out / "config.json").unlink()
    (tmp_path / "elsewhere.json").rename(out / "config.json")
    result = resume(out, "--steps", "3")
    assert result.status == 0, result.err[-3000:]
    assert f"{out / 'config.json'} was damaged: written again from {out / 'checkpoints' / 'step-000002'}" in result.out
    assert (out / "config.json.damaged").read_bytes() == torn and Config.load(out / "config.json").steps == 3
    (out / "config.json").unlink()
    result = resume(out, "--steps", "3")
    assert result.status == 0 and f"{out / 'config.json'} was missing: written again" in result.out, result.out
    assert "nothing to do" in result.out and Config.load(out / "config.json").steps == 3


def test_a_run_keeps_its_starting_point_and_its_last_two_checkpoints(tmp_path):
    """Checkpoints rotate (the last two are kept), but step 0's, the warm-started model before the first RL step,
    stays, so troll.tools.evaluate scores the run before and after: here its weights are the model's before training."""
    from troll.models.build import build_model

    cfg = tiny(tmp_path, steps=4, save_every=1)
    before = {k: v.clone() for k, v in build_model(cfg, torch.device("cpu"))[0].state_dict().items()}
    train(cfg)
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*"))
    assert names == ["step-000000", "step-000003", "step-000004"]
    from safetensors.torch import load_file

    start = load_file(tmp_path / "run" / "checkpoints" / "step-000000" / "model.safetensors")
    assert all(torch.equal(start[k], before[k]) for k in start)  # no warm-start here (sft_steps 0): the built model
    last = load_file(tmp_path / "run" / "checkpoints" / "step-000004" / "model.safetensors")
    assert any(not torch.equal(last[k], start[k]) for k in start)
