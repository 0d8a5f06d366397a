"""A run's start through the real command (issue 40): nothing is written before everything checkable is checked, a
start that failed later leaves a folder the corrected command runs in (and a folder that is not troll's is refused,
unchanged), a third-party exception while the run starts is one line, every flag given acts or is refused, and a
resume never goes back in steps.

Each test runs `troll train` in a subprocess, as a user does; the invariant: exit 0, or exit 2 with one
line naming the setting or file and the way forward, no traceback, and no finished checkpoint lost."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_commands import command
from test_misuse import files, one_line

pytestmark = pytest.mark.slow

# one quick RL step on the tiny task, no warm-start
QUICK = ["--sft_steps", "0", "--eval_size", "4", "--eval_every", "1", "--save_every", "1", "--prompts_per_step", "4",
         "--samples_per_prompt", "2", "--steps", "1"]  # fmt: skip


def train(out: Path, *flags: str):
    return command("-m", "troll", "train", "--out", str(out), *flags)


def ran(result, out: Path, steps: int = 1) -> None:
    """The command exited 0 with a run of `steps` steps in `out`."""
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "summary.json").is_file() and (out / "checkpoints" / f"step-{steps:06d}").is_dir()


@pytest.mark.parametrize(
    ("wrong", "right", "words"),
    [
        (["--max_prompt_len", "3"], ["--max_prompt_len", "6"], ["--max_prompt_len 3", "the shortest has 6 tokens"]),
        (
            ["--lora_rank", "4", "--lora_targets", "q_proj,v_prj"],
            ["--lora_rank", "4", "--lora_targets", "q_proj,v_proj"],
            ["v_prj matches no layer", "q_proj", "v_proj", "up_proj"],
        ),
        (["--vocab_size", str(10**12)], ["--vocab_size", "300"], ["--vocab_size 1000000000000", "GiB free here"]),
        (["--prompts_per_step", str(10**12)], [], ["--prompts_per_step 1000000000000 x", "GiB free here"]),
        (["--samples_per_prompt", str(10**9)], [], ["--samples_per_prompt 1000000000 x", "GiB free here"]),
        (["--max_new_tokens", str(10**12)], ["--max_new_tokens", "4"], ["--max_new_tokens 1000000000000", "2048"]),
        (["--lora_rank", "100000"], ["--lora_rank", "4"], ["--lora_rank 100000", "pass at most 128"]),
        (["--staleness", str(10**8)], ["--staleness", "1"], ["--staleness 100000000 keeps 100000001 batches", "free"]),
        (["--epochs", str(10**9)], ["--epochs", "2"], ["--epochs 1000000000 shuffles of a step's 8 samples", "free"]),
    ],
    ids=["max_prompt_len", "lora_targets", "vocab_size", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
         "lora_rank", "staleness", "epochs"],  # fmt: skip
)
def test_a_failed_start_writes_nothing(tmp_path, wrong, right, words):
    """A check that needs the model or the data (every prompt too long; a LoRA target name that matches no layer,
    which PEFT drops in silence when another matches; a count whose memory is more than is free or that the model
    cannot take) refuses the run before <out> is made; the corrected command then runs in the same --out. An empty
    --out stays empty (a new run locks it when it claims it)."""
    out = tmp_path / "run"
    one_line(train(out, *QUICK, *wrong), 2, *words)
    assert not out.exists()
    out.mkdir()
    one_line(train(out, *QUICK, *wrong), 2, *words)
    assert list(out.iterdir()) == []
    ran(train(out, *QUICK, *right), out)


def test_a_broken_model_folder_is_one_line_and_the_same_command_runs_after_the_fix(tmp_path):
    """A damaged model folder while the run starts: one line naming the damaged file and the fix, nothing written;
    once the folder is repaired, the same command runs."""
    from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer
    from troll.tasks import addition

    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    good = save_tiny(tiny_llama(tok, hidden=32, layers=1, heads=2), tok, tmp_path / "good")
    model = tmp_path / "model"
    shutil.copytree(good, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    out = tmp_path / "run"
    flags = ["--model", str(model), *QUICK]
    one_line(train(out, *flags), 2, str(weights), "restore the folder")  # named where it is read (troll.policy)
    assert not out.exists()
    shutil.copy(good / "model.safetensors", weights)
    ran(train(out, *flags), out)


def test_a_start_that_failed_after_writing_restarts_with_other_flags(tmp_path, monkeypatch):
    """A start that failed after the run folder was written (here: the rollout engine, after the LoRA base was
    saved) leaves config.json and <out>/base but no checkpoint: the corrected command, with other settings, runs
    in the same --out and says it starts from the beginning."""
    import dataclasses

    from test_train import tiny

    from troll.train import train as train_in_process

    def broken(*args, **kwargs):
        raise RuntimeError("the engine did not start")

    monkeypatch.setattr("troll.run.start.make_generator", broken)
    with pytest.raises(RuntimeError, match="did not start"):
        train_in_process(dataclasses.replace(tiny(tmp_path, lora_rank=4), lr=1e-3))
    out = tmp_path / "run"
    assert (out / "config.json").is_file() and (out / "base").is_dir() and not (out / "checkpoints").exists()
    result = train(out, *QUICK, "--lora_rank", "4", "--lr", "3e-4")
    ran(result, out)
    assert "stopped before its first checkpoint" in result.stdout


def test_a_failed_start_of_another_config_restarts_but_a_whole_checkpoint_is_never_removed(tmp_path):
    """The files a failed start left in the folder troll made (another config's config.json, metrics, a
    half-written checkpoint folder, a LoRA base): the new run starts there, removing those of the run's names only.
    The same files without troll's marker (an older troll's failed start, or someone's folder: no file there can be
    told to be troll's) are refused, unchanged. A folder with a whole checkpoint is refused, unchanged."""
    out = tmp_path / "run"
    ran(train(out, *QUICK), out)
    finished = files(out)
    (out / "summary.json").unlink()
    whole = files(out)
    one_line(train(out, *QUICK, "--lr", "1e-3"), 2, "already holds a run", "--resume true")
    assert files(out) == whole
    shutil.rmtree(out / "checkpoints")
    (out / "checkpoints" / ".tmp-step-000000").mkdir(parents=True)
    (out / "base").mkdir()
    (out / "base" / "config.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    marker = (out / ".troll-run").read_bytes()
    (out / ".troll-run").unlink()
    before = files(out)
    one_line(train(out, *QUICK, "--lr", "1e-3"), 2, str(out), "choose a new or empty --out")
    assert files(out) == before
    (out / ".troll-run").write_bytes(marker)
    result = train(out, *QUICK, "--lr", "1e-3")
    ran(result, out)
    assert "stopped before its first checkpoint" in result.stdout and not (out / "base").exists()
    assert set(files(out)) == set(finished) | {"notes.txt"} and (out / "notes.txt").read_text() == "mine"


def test_a_damaged_base_on_resume_is_one_line_and_changes_nothing(tmp_path):
    """A LoRA run's <out>/base damaged (garbled weights) or missing: resume refuses in one line naming it; nothing
    in the run changes; with the base restored the same command resumes."""
    out = tmp_path / "run"
    ran(train(out, *QUICK, "--lora_rank", "4"), out)
    weights = out / "base" / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(b"\x00" * 64 + good[64:])
    before = files(out)
    resume = ["--resume", "true", "--steps", "2"]
    one_line(train(out, *resume), 2, str(weights), "frozen base", "restore it from a copy")
    assert files(out) == before
    shutil.move(out / "base", tmp_path / "base")
    one_line(train(out, *resume), 2, f"{out / 'base'} is missing")
    assert files(out) == {k: v for k, v in before.items() if not k.startswith("base/")}
    shutil.move(tmp_path / "base", out / "base")
    weights.write_bytes(good)
    ran(train(out, *resume), out, steps=2)


def test_resume_with_fewer_steps_than_done_is_refused(tmp_path):
    """`--resume true --steps N` below the checkpoint's step: one line naming that step, nothing changed (it
    once exited 0 with a summary that disagreed with the metrics and the checkpoint); equal steps on a finished
    run is still "nothing to do"."""
    out = tmp_path / "run"
    ran(train(out, *QUICK, "--steps", "2"), out, steps=2)
    before = files(out)
    one_line(train(out, "--resume", "true", "--steps", "1"), 2, "--steps 1", "2 steps", "step-000002", "--steps 2")
    assert files(out) == before
    same = train(out, "--resume", "true", "--steps", "2")
    assert same.returncode == 0 and "nothing to do" in same.stdout and files(out) == before


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--loss", "ppo_clip", "--eps", "0.1"], ["--eps acts only with --loss troll", "not --loss ppo_clip"]),
        (["--lora_alpha", "16"], ["--lora_alpha acts only with --lora_rank > 0"]),
        (["--is_cap", "3"], ["--is_cap acts only with --is_correction tis"]),
        (["--samples_per_prompt", "1"], ["samples_per_prompt=1 makes every advantage 0"]),
        (["--lora_rank", "4", "--lora_alpha", "0"], ["lora_alpha=0"]),
    ],
    ids=["eps", "lora_alpha", "is_cap", "samples_per_prompt", "lora_alpha_0"],
)
def test_a_setting_that_cannot_act_is_refused_by_the_command(tmp_path, flags, words):
    """A flag for a switch that is off or another loss, or a value that zeroes every update: one line, exit 2,
    nothing written."""
    out = tmp_path / "run"
    one_line(train(out, *QUICK, *flags), 2, *words)
    assert not out.exists()
