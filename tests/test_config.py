"""The command line and the config (troll/config.py): every bad value is an argparse error (exit 2, no traceback)
before any work, the choices are the library's, `--help` documents every flag, and field types come from the
annotations."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from troll.config import CHOICES, PRESETS, Config

ROOT = Path(__file__).resolve().parents[1]

BAD_FLAGS = [
    (["--loss", "clip"], "--loss: invalid choice: 'clip'"),
    (["--level", "foo"], "--level: invalid choice"),
    (["--task", "math"], "--task: invalid choice"),
    (["--advantage", "ppo"], "--advantage: invalid choice"),
    (["--agg", "mean"], "--agg: invalid choice"),
    (["--support", "dense"], "--support: invalid choice"),
    (["--dppo_divergence", "tv"], "--dppo_divergence: invalid choice"),
    (["--old_policy", "engine"], "--old_policy: invalid choice"),
    (["--backend", "sglang"], "--backend: invalid choice"),
    (["--lr_schedule", "linear"], "--lr_schedule: invalid choice"),
    (["--device", "tpu"], "--device: invalid choice"),
    (["--preset", "huge"], "--preset: invalid choice"),
    (["--eps", "0"], "eps must be > 0"),
    (["--eps", "-0.1"], "eps must be > 0"),
    (["--eps", "nan"], "eps must be > 0"),
    (["--alpha", "-1"], "alpha must be >= 0"),
    (["--alpha", "nan"], "alpha must be >= 0"),
    (["--alpha", "inf"], "alpha must be >= 0"),
    (["--k", "0"], "k must be >= 1"),
    (["--delta", "1"], r"delta must be in \[0, 1\)"),
    (["--delta=-1e-5"], r"delta must be in \[0, 1\)"),
    (["--delta", "nan"], r"delta must be in \[0, 1\)"),
    (["--clip_low", "1"], r"clip_low must be in \[0, 1\)"),
    (["--clip_high", "-0.1"], "clip_high must be >= 0"),
    (["--lr", "0"], "lr must be > 0"),
    (["--lr", "nan"], "lr must be > 0"),
    (["--sft_lr", "0"], "sft_lr must be > 0"),
    (["--steps", "0"], "steps must be >= 1"),
    (["--minibatches", "0"], "minibatches must be >= 1"),
    (["--minibatches", "257"], "minibatches=257 is more than the 256 samples"),
    (["--epochs", "0"], "epochs must be >= 1"),
    (["--kl_update_vocab", "-1"], "kl_update_vocab must be >= 0"),
    (["--log_to", "mlflow"], "--log_to: invalid choice"),
    (["--temperature", "0"], "temperature must be > 0"),
    (["--prompts_per_step", "0"], "prompts_per_step must be >= 1"),
    (["--samples_per_prompt", "0"], "samples_per_prompt must be >= 1"),
    (["--max_new_tokens", "0"], "max_new_tokens must be >= 1"),
    (["--max_prompt_len", "0"], "max_prompt_len must be >= 1"),
    (["--micro_batch_tokens", "-1"], "micro_batch_tokens must be >= 0"),
    (["--logits_chunk", "-1"], "logits_chunk must be >= 0"),
    (["--warmup_steps", "-1"], "warmup_steps must be >= 0"),
    (["--weight_decay", "-1"], "weight_decay must be >= 0"),
    (["--grad_clip", "0"], "grad_clip must be > 0"),
    (["--vllm_gpu_memory", "1.5"], r"vllm_gpu_memory must be in \(0, 1\]"),
    (["--sft_steps", "-1"], "sft_steps must be >= 0"),
    (["--sft_target", "1.5"], r"sft_target must be in \[0, 1\]"),
    (["--sft_target", "nan"], "sft_target must be in"),
    (["--sft_batch", "0"], "sft_batch must be >= 1"),
    (["--eval_every", "0"], "eval_every must be >= 1"),
    (["--eval_size", "-1"], "eval_size must be >= 0"),
    (["--save_every", "0"], "save_every must be >= 1"),
    (["--samples_to_log", "-1"], "samples_to_log must be >= 0"),
    (["--seed", "-1"], "seed must be >= 0"),
    (["--model", ""], "model must not be empty"),
    (["--loss", "dppo", "--level", "sequence"], "level=sequence .* not dppo"),
    (["--loss", "cispo", "--level", "sequence"], "level=sequence .* not cispo"),
    (["--bf16", "maybe"], "expected true/false"),
    (["--steps", "1.5"], "invalid int value"),
    (["--eps", "abc"], "invalid float value"),
    (["--no_such_flag", "1"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_an_argparse_error(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args([*argv, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m troll.train" in err
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_resume_without_a_run_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--resume", "true", "--out", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2 and "nothing to resume" in capsys.readouterr().err


def test_the_command_fails_before_any_work(tmp_path):
    """The issue's report: `--loss clip` used to warm up, evaluate and write a checkpoint, then die with a
    KeyError traceback, leaving a directory that blocked the corrected command."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "troll.train", "--loss", "clip", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "invalid choice: 'clip'" in proc.stderr
    assert not out.exists()


def test_help_documents_every_flag_without_importing_torch():
    """`--help` lists each field's description (its comment in config.py), default and choices, and is answered
    before the trainer imports torch or transformers (so it prints at once)."""
    code = (
        "import runpy, sys\n"
        "sys.argv = ['troll.train', '--help']\n"
        "try:\n"
        "    runpy.run_module('troll.train', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    out = " ".join(proc.stdout.split())  # argparse wraps lines
    assert "HEAVY []" in out
    for f in dataclasses.fields(Config):
        assert f"--{f.name}" in out
    assert "--loss {troll,ppo_clip,dppo,cispo}" in out
    assert "TROLL: KL bound per token (> 0); default: 0.05" in out
    assert "--bf16 {true,false}" in out and "bf16 autocast (GPU); default: false" in out
    assert "--support {rest,paper}" in out and "one exact rest atom" in out
    assert "passes over each RL step's samples (PPO's update epochs, TRL's num_iterations)" in out
    assert "--log_to {none,tensorboard,wandb}" in out


def test_choices_are_what_the_library_accepts():
    from troll.advantages import ESTIMATORS
    from troll.losses import AGGREGATIONS, DPPO_THRESHOLDS, LOSSES

    assert set(CHOICES["loss"]) == set(LOSSES)
    assert set(CHOICES["advantage"]) == set(ESTIMATORS)
    assert set(CHOICES["agg"]) == set(AGGREGATIONS)
    assert set(CHOICES["dppo_divergence"]) == set(DPPO_THRESHOLDS)


def test_defaults_are_the_tiny_cpu_preset_and_presets_are_valid():
    assert PRESETS["tiny-cpu"] == {}
    assert Config.from_args([]) == Config()
    for name in PRESETS:
        assert Config.from_args(["--preset", name]) == Config(**PRESETS[name])  # each preset passes the checks
    cfg = Config.from_args(["--preset", "gsm8k-qwen2.5-0.5b", "--lr", "2e-6", "--bf16", "false"])
    assert cfg.task == "gsm8k" and cfg.lr == 2e-6 and not cfg.bf16  # flags win over the preset


def test_config_itself_rejects_bad_values():
    """Config(...), dataclasses.replace and Config.load check too, with a ValueError naming the field."""
    with pytest.raises(ValueError, match="eps must be > 0"):
        Config(eps=0.0)
    with pytest.raises(ValueError, match="loss='clip' is not one of"):
        dataclasses.replace(Config(), loss="clip")
    with pytest.raises(ValueError, match="level=sequence"):
        Config(loss="cispo", level="sequence")


def test_load_names_unknown_and_missing_fields(tmp_path, capsys):
    path = tmp_path / "config.json"
    Config().save(path)
    assert Config.load(path) == Config()
    saved = json.loads(path.read_text())
    path.write_text(path.read_text().replace('"seed"', '"sede"'))
    with pytest.raises(ValueError, match="unknown config fields \\['sede'\\]"):
        Config.load(path)
    del saved["reverse_sum"]  # a config from before the field existed: its default may not be what the run used
    path.write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="missing config fields \\['reverse_sum'\\]"):
        Config.load(path)
    with pytest.raises(SystemExit):  # resuming such a run is an argparse error, before any work
        Config.from_args(["--out", str(tmp_path), "--resume", "true"])
    assert "missing config fields" in capsys.readouterr().err


def test_field_types_come_from_the_annotations(capsys):
    """A field typed `int | None` parses ints and `none` (from_args used to look types up by name)."""

    @dataclass
    class Extended(Config):
        limit: int | None = None  # an optional limit
        scale: float | None = 1.0

    assert Extended.from_args(["--limit", "3"]).limit == 3
    assert Extended.from_args(["--limit", "none", "--scale", "None"]).scale is None
    assert Extended.from_args([]).limit is None
    with pytest.raises(SystemExit):
        Extended.from_args(["--limit", "x"])
    assert "invalid int or none value: 'x'" in capsys.readouterr().err
    help_text = " ".join(Extended.parser().format_help().split())
    assert "--limit LIMIT an optional limit; default: None" in help_text


def test_log_to_a_package_that_is_not_installed_fails_before_any_work(tmp_path, monkeypatch, capsys):
    """`--log_to wandb` without wandb: an argparse error naming the install command; a Config built in code
    fails when train() starts, before any directory is written."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--log_to", "wandb", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and "pip install wandb" in capsys.readouterr().err

    from troll.train import train

    with pytest.raises(ImportError, match="needs the wandb package, which is not installed: pip install wandb"):
        train(Config(log_to="wandb", out=str(tmp_path / "run")))
    assert not (tmp_path / "run").exists()
