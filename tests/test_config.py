"""The command line and the config (troll/base/config.py): every bad value is an argparse error (exit 2, no traceback)
before any work, the choices are the library's, `--help` documents every flag, a flag's parser comes from its
field's type, a saved config.json is read with the same checks, and loss_kwargs fits the loss functions."""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from troll.base.config import PRESETS, Config

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
    (["--dppo_cap", "0.5"], r"dppo_cap must be >= 1 and finite"),
    (["--dppo_cap", "inf"], r"dppo_cap must be >= 1 and finite"),
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
    (["--seed", str(2**63)], r"seed must be below 2\*\*63 \(a 64-bit integer\), got 9223372036854775808"),
    (["--sft_steps", "1" + "0" * 30], r"sft_steps must be below 2\*\*63"),  # a count past a C integer
    (["--model", ""], "model must not be empty"),
    (["--model", " "], "model must not be empty"),
    (["--task", "gsm8k", "--data", ""], "data must not be empty"),
    (["--share_prompt", "true", "--grad_checkpointing", "true"], "share_prompt needs the KV cache"),
    (["--minibatch_by", "group", "--prompts_per_step", "2", "--minibatches", "3"], "more than the 2 groups"),
    (["--minibatch_by", "batch"], "invalid choice"),
    (["--loss", "dppo", "--level", "sequence"], "level=sequence .* not dppo"),
    (["--loss", "cispo", "--level", "sequence"], "level=sequence .* not cispo"),
    (["--bf16", "maybe"], "expected true/false"),
    (["--reverse_sum", "2"], "expected true/false"),
    (["--micro_batch_tokens", "many"], "expected an int or auto, got 'many'"),
    (["--micro_batch_tokens", "1.5"], "expected an int or auto"),
    (["--steps", "1.5"], "invalid int value"),
    (["--eps", "abc"], "invalid float value"),
    (["--no_such_flag", "1"], "unrecognized arguments"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_an_argparse_error(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args([*argv, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # one line (troll.base.cli.Parser), not the usage block
    assert len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert err.startswith("troll train: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "run").exists()


def test_resume_without_a_run_is_an_argparse_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--resume", "true", "--out", str(tmp_path / "nothing")])
    assert exit_info.value.code == 2 and "nothing to resume" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["tiny-rare", "gsm8k-qwen3-1.7b-lora"])
def test_resume_of_a_run_whose_fields_are_in_added(tmp_path, preset, capsys):
    """A run whose vocab_size or LoRA fields differ from the values in ADDED resumes with `--out --resume true
    --steps N`: the flags given are compared with the run's, nothing filled in from ADDED (which once refused
    every tiny-rare and LoRA resume as a change of a setting). A real change is still refused."""
    out = tmp_path / "run"
    out.mkdir()
    Config(**PRESETS[preset]).save(out / "config.json")
    cfg = Config.from_args(["--out", str(out), "--resume", "true", "--steps", "300"])
    run = Config(**PRESETS[preset])
    assert cfg.steps == 300 and (cfg.vocab_size, cfg.lora_rank) == (run.vocab_size, run.lora_rank) != (0, 0)
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--out", str(out), "--resume", "true", "--lora_rank", "4"])
    assert exit_info.value.code == 2 and "cannot change on resume: --lora_rank" in capsys.readouterr().err


def test_the_command_fails_before_any_work(tmp_path):
    """A bad flag (`--loss clip`) stops the command at once: exit 2 with argparse's message and no traceback, before
    any warm-up, evaluation or checkpoint, and with no run directory left to block the corrected command."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "troll", "train", "--loss", "clip", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "invalid choice: 'clip'" in proc.stderr
    assert not out.exists()


def test_help_documents_every_flag_without_importing_torch():
    """`--help` lists each field's description (declared with the field), default and choices, and is answered
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
    squeezed = "".join(out.split())  # argparse may also break a line after a hyphen
    for f in dataclasses.fields(Config):
        assert f"--{f.name}" in out and f.metadata["help"] and "".join(f.metadata["help"].split()) in squeezed
    assert "--loss {troll,ppo_clip,dppo,cispo}" in out
    assert "TROLL: KL bound per token (> 0); default: 0.05" in out
    assert "--bf16 {true,false}" in out and "bf16 autocast (GPU); default: false" in out
    assert "--support {rest,paper}" in out and "one exact rest atom" in out
    assert "auto: the most the GPU fits; default: 4096" in out
    assert "passes over each RL step's samples (PPO's update epochs, TRL's num_iterations)" in out
    assert "--log_to {none,tensorboard,wandb}" in out


def test_choices_are_what_the_library_accepts():
    """The choices declared with the fields (config.py imports no torch) are the names the library accepts."""
    from troll.advantages import ESTIMATORS
    from troll.losses import AGGREGATIONS, DPPO_THRESHOLDS, LOSSES

    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(Config)}
    assert set(choices["loss"]) == set(LOSSES)
    assert set(choices["advantage"]) == set(ESTIMATORS)
    assert set(choices["agg"]) == set(AGGREGATIONS)
    assert set(choices["dppo_divergence"]) == set(DPPO_THRESHOLDS)


def test_loss_kwargs_are_the_loss_functions_keyword_arguments():
    """Each key is a keyword-only parameter of the chosen loss, and carries the config's setting."""
    from troll.losses import LOSSES

    cfg = dict(eps=0.1, alpha=0.5, k=8, delta=1e-3, support="paper", clip_low=0.1, clip_high=0.3)
    shared = {"k": 8, "delta": 1e-3, "support": "paper"}
    want = {
        "troll": shared | {"eps": 0.1, "alpha": 0.5, "level": "sequence"},
        "ppo_clip": shared | {"eps_low": 0.1, "eps_high": 0.3, "level": "sequence"},
        "dppo": shared | {"divergence": "topk_kl", "ratio_cap": 10.0},
        "cispo": shared | {"eps_high": 0.3},
    }
    assert set(want) == set(LOSSES)
    for name, loss in LOSSES.items():
        level = "sequence" if "level" in want[name] else "token"
        kwargs = Config(loss=name, level=level, dppo_divergence="topk_kl", **cfg).loss_kwargs()
        assert kwargs == want[name], name
        params = inspect.signature(loss).parameters
        assert all(key in params and params[key].kind is inspect.Parameter.KEYWORD_ONLY for key in kwargs), name


def test_defaults_are_the_tiny_cpu_preset_and_presets_are_valid():
    assert PRESETS["tiny-cpu"] == {}
    for name, changes in PRESETS.items():  # a preset lists only what it changes
        assert all(getattr(Config(), key) != value for key, value in changes.items()), name
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
    with pytest.raises(ValueError, match="steps must be int, got str '6'"):
        Config(steps="6")
    with pytest.raises(ValueError, match="bf16 must be bool, got int 1"):
        Config(bf16=1)
    assert Config(lr=1).lr == 1  # an int is a float


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
    with pytest.raises(ValueError, match="missing config fields \\['reverse_sum'\\]") as error:
        Config.load(path)
    assert str(path) in str(error.value) and '"reverse_sum": true' in str(error.value)  # says what to add
    with pytest.raises(SystemExit):  # resuming such a run is an argparse error, before any work
        Config.from_args(["--out", str(tmp_path), "--resume", "true"])
    assert "missing config fields" in capsys.readouterr().err


def test_flags_parse_by_the_fields_type():
    """bool takes true/false/1/0/yes/no, int and float their literals, micro_batch_tokens also "auto" (0)."""
    for word, value in [("true", True), ("1", True), ("Yes", True), ("false", False), ("0", False), ("no", False)]:
        assert Config.from_args(["--bf16", word]).bf16 is value
    cfg = Config.from_args(["--steps", "7", "--lr", "3e-4", "--model", "x", "--micro_batch_tokens", "AUTO"])
    assert (cfg.steps, cfg.lr, cfg.model, cfg.micro_batch_tokens) == (7, 3e-4, "x", 0)
    assert Config.from_args(["--micro_batch_tokens", "2048"]).micro_batch_tokens == 2048


def test_save_is_atomic(tmp_path, monkeypatch):
    """A write that fails half-way leaves the previous config.json whole."""
    path = tmp_path / "config.json"
    Config(seed=1).save(path)

    def half_then_fail(self, text, *args, **kwargs):
        Path.write_bytes(self, text[: len(text) // 2].encode())
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        Config(seed=2).save(path)
    monkeypatch.undo()
    assert Config.load(path) == Config(seed=1)
    Config(seed=3).save(path)
    assert Config.load(path) == Config(seed=3) and [p.name for p in tmp_path.iterdir()] == ["config.json"]


BAD_SAVED = [
    ({"reverse_sum": "false"}, "reverse_sum must be bool, got str 'false'"),  # a non-empty string is not true
    ({"steps": "6"}, "steps must be int, got str '6'"),
    ({"steps": 6.0}, "steps must be int, got float 6.0"),
    ({"seed": True}, "seed must be int, got bool True"),  # bools are not ints
    ({"lr": "1e-4"}, "lr must be float, got str '1e-4'"),
    ({"lr": None}, "lr must be float, got NoneType None"),
    ({"model": 3}, "model must be str, got int 3"),
    ({"eps": -1}, "eps must be > 0"),
    ({"loss": "clip"}, "loss='clip' is not one of"),
    ({"level": ["token"]}, "level must be str, got list ['token']"),  # not hashed on the way (once a TypeError)
    ({"level": "tokens"}, "level='tokens' is not one of token, sequence"),
]


@pytest.mark.parametrize(("change", "message"), BAD_SAVED, ids=[json.dumps(c) for c, _ in BAD_SAVED])
def test_load_refuses_a_wrong_value_naming_file_and_field(change, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(Config()) | change))
    with pytest.raises(ValueError, match=re.escape(f"{path}: invalid config: ") + ".*" + re.escape(message)):
        Config.load(path)
    with pytest.raises(SystemExit) as exit_info:  # resuming it: an argparse error, no traceback
        Config.from_args(["--out", str(tmp_path), "--resume", "true"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_load_accepts_an_int_for_a_float(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(Config()) | {"lr": 1, "sft_target": 0}))
    assert Config.load(path) == Config(lr=1.0, sft_target=0.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "is not valid JSON"),  # cut in half
        ("", "is not valid JSON"),
        (b"\xff\xfe{}", "is not valid JSON"),  # not UTF-8
        ("[1, 2]", "expected a JSON object of config fields, got list"),
        ('"tiny"', "expected a JSON object of config fields, got str"),
    ],
)
def test_load_names_a_damaged_file(text, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    Config().save(path)
    if text is None:
        text = path.read_text()[: len(path.read_text()) // 2]
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=re.escape(f"{path}") + ".*" + re.escape(message)):
        Config.load(path)
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--out", str(tmp_path), "--resume", "true"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


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


def test_tiny_rare_preset_and_vocab_size():
    """The rare-behaviour preset parses to the rare task on a grown tokenizer; vocab_size is checked."""
    cfg = Config.from_args(["--preset", "tiny-rare"])
    assert cfg.task == "rare" and cfg.vocab_size >= 260 and cfg.model == "tiny"
    with pytest.raises(ValueError, match="vocab_size must be 0 or >= 260"):
        Config(vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size grows the tiny model's tokenizer"):
        Config(vocab_size=1024, model="Qwen/Qwen2.5-0.5B-Instruct")


def test_a_config_saved_before_vocab_size_existed_ran_with_its_added_value(tmp_path):
    """Fields in ADDED were added after runs were saved: a config or results row without one ran with its value
    (every run before vocab_size kept the tokenizer's 260 tokens), so settings() and load() fill it in."""
    from troll.base.config import ADDED, settings

    path = tmp_path / "config.json"
    Config().save(path)
    saved = json.loads(path.read_text())
    del saved["vocab_size"]
    path.write_text(json.dumps(saved))
    assert Config.load(path) == Config()
    assert ADDED == {
        "vocab_size": 0, "lora_rank": 0, "lora_alpha": 32.0, "lora_targets": "all-linear", "dppo_cap": 2.0,
        "sft_probe": 1024,  # every warm-start before the setting probed 1,024 training problems
        "compile_head": False,  # every run before the setting took the eager output layer
        "system": None, "mask_overlong": False,  # the template's own system message; cut samples in the loss
        "share_prompt": False, "minibatch_by": "sample",  # every sample's prompt forwarded with it; shuffled samples
        "filter_groups": False,  # every group trained on, with signal or without
    }  # fmt: skip
    for name in ("lora_rank", "lora_alpha", "lora_targets", "sft_probe", "compile_head", "system", "mask_overlong",
                 "share_prompt", "minibatch_by", "filter_groups"):  # fmt: skip
        del saved[name]
    path.write_text(json.dumps(saved))
    assert Config.load(path) == Config()
    assert settings(saved) == settings(dataclasses.asdict(Config()))
    assert settings({**saved, "vocab_size": 1024})["vocab_size"] == 1024


def test_a_dppo_run_saved_before_its_cap_was_a_setting_ran_at_two(tmp_path):
    """DPPO's cap was fixed at 2 before dppo_cap existed (10 is the default since): a saved DPPO config
    without the field loads at 2 and resumes as it ran; any other loss, which the cap does not touch, takes today's
    default, so its old rows still compare equal to the same run made now."""
    from troll.base.config import settings

    path = tmp_path / "config.json"
    for loss, cap in (("dppo", 2.0), ("troll", 10.0), ("cispo", 10.0)):
        Config(loss=loss).save(path)
        saved = json.loads(path.read_text())
        del saved["dppo_cap"]
        path.write_text(json.dumps(saved))
        assert Config.load(path).dppo_cap == cap and settings(saved)["dppo_cap"] == cap, loss
    assert Config(loss="dppo").dppo_cap == 10.0 and Config(loss="dppo", dppo_cap=20.0).loss_kwargs()["ratio_cap"] == 20


def test_an_unset_clip_range_follows_the_level():
    """clip_low / clip_high unset: PPO's 0.2 per token, GSPO's 3e-4 / 4e-4 per sequence, resolved once when the
    config is made (from preset and flags together); a value given wins, and the saved config holds numbers."""
    assert (Config().clip_low, Config().clip_high) == (0.2, 0.2)
    gspo = Config.from_args(["--loss", "ppo_clip", "--level", "sequence"])
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    given = Config.from_args(["--loss", "ppo_clip", "--level", "sequence", "--clip_high", "1e-3"])
    assert (given.clip_low, given.clip_high) == (3e-4, 1e-3)
    assert Config.from_args(["--loss", "cispo", "--clip_high", "5"]).loss_kwargs()["eps_high"] == 5.0
    assert dataclasses.asdict(gspo)["clip_low"] == 3e-4


def test_an_unset_agg_follows_the_level():
    """agg unset: the token mean per token, GSPO's mean over sequences (seq-mean-token-mean) with --level sequence,
    for ppo_clip (GSPO) and troll alike, resolved once when the config is made (from preset and flags together); a
    given --agg wins, and the saved config holds the mode that ran."""
    assert Config().agg == Config.from_args([]).agg == Config.from_args(["--loss", "ppo_clip"]).agg == "token-mean"
    for loss in ("ppo_clip", "troll"):
        gspo = Config.from_args(["--loss", loss, "--level", "sequence"])
        assert gspo.agg == "seq-mean-token-mean" and dataclasses.asdict(gspo)["agg"] == "seq-mean-token-mean", loss
        given = Config.from_args(["--loss", loss, "--level", "sequence", "--agg", "token-mean"])
        assert given.agg == "token-mean", loss
    gpu = Config.from_args(["--preset", "gsm8k-qwen2.5-0.5b", "--loss", "ppo_clip", "--level", "sequence"])
    assert gpu.agg == "seq-mean-token-mean"
    assert Config.from_args(["--agg", "seq-mean-token-sum-norm"]).agg == "seq-mean-token-sum-norm"
    assert Config(level="sequence").agg == "seq-mean-token-mean" and Config(agg=None).agg == "token-mean"


def test_a_gspo_run_saved_under_the_token_mean_resumes_with_it(tmp_path, capsys):
    """agg has been a field since the first config and Config.save writes every field, so every config.json names
    the mode it ran: a GSPO run saved when --level sequence defaulted to the token mean resumes with the token mean,
    not today's default; asking for another agg on resume is refused. A config.json without agg is refused, naming
    it (agg is not in ADDED: no run was saved without it)."""
    from troll.base.config import ADDED

    out = tmp_path / "run"
    out.mkdir()
    old = dataclasses.asdict(Config(loss="ppo_clip", level="sequence", agg="token-mean", out=str(out)))
    (out / "config.json").write_text(json.dumps(old))  # what the old code wrote: the default named
    assert Config.load(out / "config.json").agg == "token-mean"
    cfg = Config.from_args(["--out", str(out), "--resume", "true", "--steps", "300"])
    assert (cfg.level, cfg.agg, cfg.steps) == ("sequence", "token-mean", 300)
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--out", str(out), "--resume", "true", "--agg", "seq-mean-token-mean"])
    assert exit_info.value.code == 2 and "cannot change on resume: --agg" in capsys.readouterr().err
    assert "agg" not in ADDED
    del old["agg"]
    (out / "config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"missing config fields \['agg'\]"):
        Config.load(out / "config.json")


LORA_PRESET_GPUS = {  # GiB
    "gsm8k-qwen3-1.7b-lora": 24,
    "gsm8k-qwen3-4b-lora": 24,
    "gsm8k-qwen3-8b-lora": 80,
    "gsm8k-llama3.1-8b-lora": 80,
}


@pytest.mark.parametrize("name", sorted(LORA_PRESET_GPUS))
def test_lora_presets_fit_their_gpu(name):
    """Each LoRA preset parses to the LoRA recipe, and troll.models.memory's model says its micro-batch is the largest
    whose two phases (vLLM generating, vLLM asleep during the update) fit its target GPU at its vLLM fraction."""
    from troll.models import memory

    assert set(LORA_PRESET_GPUS) == {n for n in PRESETS if n.startswith("gsm8k-") and n.endswith("-lora")}
    cfg = Config.from_args(["--preset", name])
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets, cfg.lr) == (32, 32.0, "all-linear", 1e-5)
    assert cfg.bf16 and cfg.grad_checkpointing and cfg.logits_chunk == 1024 and cfg.backend == "vllm"
    gb = LORA_PRESET_GPUS[name]
    run = memory.lora_run(cfg.lora_rank, cfg.vllm_gpu_memory, cfg.lora_targets, cfg.bf16, True, cfg.logits_chunk)
    assert not memory.phases(cfg.model, gb, cfg.micro_batch_tokens, run).problems
    assert cfg.micro_batch_tokens == memory.colocated_micro_batch_tokens(cfg.model, gb, run)
    lo, hi = memory.vllm_fractions(cfg.model, gb, run)
    assert lo <= cfg.vllm_gpu_memory <= hi


# ------------------------------------------------------------------ every setting acts or is refused (issue 40)

INERT_FLAGS = [
    (["--loss", "ppo_clip", "--eps", "0.1"], "--eps acts only with --loss troll, not --loss ppo_clip"),
    (["--compile_head", "true"], "--compile_head acts only with --logits_chunk > 0 (the chunked output layer), not "
     "--logits_chunk 0"),
    (["--loss", "dppo", "--alpha", "0.5"], "--alpha acts only with --loss troll, not --loss dppo"),
    (["--loss", "cispo", "--level", "token"], "--level acts only with --loss troll or ppo_clip"),
    (["--clip_low", "0.1"], "--clip_low acts only with --loss ppo_clip, not --loss troll"),
    (["--loss", "dppo", "--clip_high", "0.28"], "--clip_high acts only with --loss ppo_clip or cispo"),
    (["--dppo_cap", "3"], "--dppo_cap acts only with --loss dppo"),
    (["--loss", "ppo_clip", "--dppo_divergence", "topk_kl"], "--dppo_divergence acts only with --loss dppo"),
    (["--is_cap", "3"], "--is_cap acts only with --is_correction tis, not --is_correction none"),
    (["--is_correction", "is", "--is_cap", "3"], "--is_cap acts only with --is_correction tis, not --is_correction is"),
    (["--lora_alpha", "16"], "--lora_alpha acts only with --lora_rank > 0, not --lora_rank 0"),
    (["--lora_targets", "q_proj"], "--lora_targets acts only with --lora_rank > 0"),
    (["--vllm_gpu_memory", "0.5"], "--vllm_gpu_memory acts only with --backend vllm, not --backend hf"),
    (["--sft_steps", "0", "--sft_lr", "1e-3"], "--sft_lr acts only with --sft_steps > 0"),
    (["--sft_steps", "0", "--sft_target", "0.5"], "--sft_target acts only with --sft_steps > 0"),
    (["--preset", "gsm8k-qwen2.5-0.5b", "--sft_batch", "8"], "--sft_batch acts only with --sft_steps > 0"),
    (["--data", "some/folder"], "--data acts only with --task gsm8k, not --task addition"),
    (["--chat", "true"], "--chat acts only with --task gsm8k"),
    (["--task", "gsm8k", "--system", ""], "--system acts only with --chat true, not --chat false"),
    (["--task", "gsm8k", "--reverse_sum", "false"], "--reverse_sum acts only with --task addition or rare"),
    (["--records_every", "1", "--records_samples", "0"], "--records_every acts only with --records_samples > 0"),
    (["--samples_per_prompt", "1"], "samples_per_prompt=1 makes every advantage 0"),
    (["--advantage", "reinforce_pp", "--samples_per_prompt", "1"], "samples_per_prompt=1 makes every advantage 0"),
    (["--lora_rank", "4", "--lora_alpha", "0"], "lora_alpha=0 scales the adapters' update"),
    (["--lora_rank", "4", "--lora_targets", "all-linear,q_proj"], "give it alone"),
]


@pytest.mark.parametrize(("argv", "message"), INERT_FLAGS, ids=[" ".join(a) for a, _ in INERT_FLAGS])
def test_a_setting_that_cannot_act_is_refused(argv, message, capsys, tmp_path):
    """A flag given for a switch that is off or for another loss, or a value that makes every update zero: one
    line naming the flag and what makes it act, exit 2, nothing written."""
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args([*argv, "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert not (tmp_path / "run").exists()


def test_two_inert_flags_are_named_in_one_line(capsys):
    with pytest.raises(SystemExit):
        Config.from_args(["--loss", "cispo", "--eps", "0.1", "--lora_alpha", "8"])
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--eps" in err and "--lora_alpha" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["--eps", "0.1", "--alpha", "0.5", "--level", "sequence"],
        ["--loss", "ppo_clip", "--clip_low", "0.1", "--clip_high", "0.28", "--level", "token"],
        ["--loss", "cispo", "--clip_high", "5"],
        ["--loss", "dppo", "--dppo_cap", "3", "--dppo_divergence", "topk_kl"],
        ["--is_correction", "tis", "--is_cap", "3"],
        ["--lora_rank", "4", "--lora_alpha", "8", "--lora_targets", "q_proj,v_proj"],
        ["--backend", "vllm", "--vllm_gpu_memory", "0.5"],
        ["--sft_lr", "1e-3", "--sft_target", "0.5", "--sft_batch", "64"],
        ["--task", "gsm8k", "--data", "x", "--chat", "true"],
        ["--task", "words", "--chat", "true", "--system", ""],
        ["--share_prompt", "true", "--minibatch_by", "group", "--mask_overlong", "true"],
        ["--task", "rare", "--reverse_sum", "false"],
        ["--samples_per_prompt", "2", "--advantage", "dr_grpo"],
        ["--records_samples", "2", "--records_every", "3"],
        ["--records_samples", "0"],
    ],
    ids=lambda a: " ".join(a),
)
def test_a_setting_that_acts_is_accepted(argv):
    Config.from_args(argv)


def test_presets_and_defaults_never_trigger_the_rule():
    """A preset's values are not flags given: the GSM8K presets (no warm-start, sft_* at their defaults) and the
    LoRA presets on --backend hf (their vllm_gpu_memory then idle) are accepted; the rule reads only `given`."""
    from troll.base.config import inert

    for name in PRESETS:
        Config.from_args(["--preset", name])
    Config.from_args(["--preset", "gsm8k-qwen3-1.7b-lora", "--backend", "hf"])
    assert inert(Config(), set()) == []
    assert inert(Config(loss="ppo_clip"), {"lr", "steps", "clip_low"}) == []


def test_the_rule_table_names_fields():
    """Each row of ACTS_ONLY is a field, switched by a field, and the switch's default makes the row's field act or
    not as the table says (the table and the code agree on the defaults: eps acts with troll, clip_low does not)."""
    from troll.base.config import ACTS_ONLY

    names = {f.name for f in dataclasses.fields(Config)}
    assert set(ACTS_ONLY) <= names and {switch for switch, _, _ in ACTS_ONLY.values()} <= names
    default = Config()
    acting = {name for name, (switch, acts, _) in ACTS_ONLY.items() if acts(getattr(default, switch))}
    assert acting == {"eps", "alpha", "level", "sft_target", "sft_lr", "sft_batch", "sft_probe", "reverse_sum",
                      "records_every"}  # fmt: skip


def test_resume_refuses_a_flag_that_cannot_act(tmp_path, capsys):
    """On resume the rule reads the run's config: --vllm_gpu_memory (resume-changeable) for an hf run is refused."""
    out = tmp_path / "run"
    out.mkdir()
    Config().save(out / "config.json")
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--out", str(out), "--resume", "true", "--vllm_gpu_memory", "0.5"])
    assert exit_info.value.code == 2 and "--vllm_gpu_memory acts only with --backend vllm" in capsys.readouterr().err
    assert Config.from_args(["--out", str(out), "--resume", "true", "--backend", "vllm", "--vllm_gpu_memory", "0.5"])
    Config(records_samples=0).save(out / "config.json")  # a run without per-token records: --records_every idle
    with pytest.raises(SystemExit) as exit_info:
        Config.from_args(["--out", str(out), "--resume", "true", "--records_every", "5"])
    assert exit_info.value.code == 2 and "not --records_samples 0: drop --records_every" in capsys.readouterr().err
