"""bench/trl_compare.py's real-model path (`--model smollm2-135m-instruct`) on a tiny Llama with a chat template:
its troll side with both levers and an empty system message, and its TRL side on the same prompts, whose token ids
TRL's GRPOTrainer must tokenize exactly as troll does (and a difference stops the side). In-process, one step each:
slow (TRL's import and trainer). The refusals of the new flags are in tests/test_commands.py
(test_bench_bad_arguments); SmolLM2 itself is measured by the command (docs/results.md)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")  # the trl extra

from bench import trl_compare  # noqa: E402
from troll.base.config import PRESETS, Config  # noqa: E402

PRESET = trl_compare.MODELS["smollm2-135m-instruct"]


@pytest.fixture
def tiny_chat(tmp_path, monkeypatch) -> dict:
    """A tiny Llama folder whose tokenizer keeps troll.models.tiny's ChatML template, and the options of one small step;
    the preset's prompt limit raised for the byte-level tokenizer (a word problem is hundreds of its tokens)."""
    from troll.models.build import build_model
    from troll.models.tiny import save_tiny

    monkeypatch.setitem(PRESETS, PRESET, PRESETS[PRESET] | {"max_prompt_len": 4096})
    model, tokenizer = build_model(Config.from_args(["--preset", PRESET, "--model", "tiny"]), torch.device("cpu"))
    assert tokenizer.chat_template is not None
    save_tiny(model, tokenizer, tmp_path / "model")
    return {
        "model": "smollm2-135m-instruct", "model_dir": str(tmp_path / "model"), "steps": 1, "warmup": 0,
        "prompts": 2, "n": 2, "max_new": 3, "minibatches": 2, "lr": 1e-5, "trl_loss": "dapo", "seed": 0,
    }  # fmt: skip


@pytest.mark.slow
def test_real_model_sides_on_the_same_prompt_tokens(tiny_chat):
    troll = trl_compare.run_troll(tiny_chat | {"side": "troll_shared_system"})
    trl = trl_compare.run_trl(tiny_chat | {"side": "trl_system"})
    for res in (troll, trl):
        assert len(res["wall"]) == len(res["user"]) == 1 and res["wall"][0] > 0
        assert res["completions"] == 4 and 0 < res["len"] <= 3
    assert trl["checked"] >= 4  # every prompt TRL tokenized (each repeated for its samples) equalled troll's


@pytest.mark.slow
def test_a_prompt_tokenized_otherwise_stops_the_trl_side(tiny_chat, monkeypatch):
    """troll's tokenization with one more token in front (as a tokenizer adding a BOS would give): the side stops."""
    from troll.tasks import task

    real = task.encode
    monkeypatch.setattr(task, "encode", lambda tok, texts: [[0, *ids] for ids in real(tok, texts)])
    with pytest.raises(RuntimeError, match="would not see the same tokens"):
        trl_compare.run_trl(tiny_chat | {"side": "trl"})


def test_each_real_troll_side_is_the_preset_and_its_levers():
    o = {"model": "smollm2-135m-instruct", **trl_compare.DEFAULTS["smollm2-135m-instruct"]}  # the preset's
    o["seed"] = 0
    cfgs = {s: Config.from_args(trl_compare.troll_argv(o | {"side": s})) for s in trl_compare.REAL_SIDES}
    # the preset training on every group, as TRL's GRPO does (the preset filters them: issue 52)
    preset = Config.from_args(["--preset", PRESET, "--sft_steps", "0", "--filter_groups", "false"])
    assert cfgs["troll"] == Config.from_args(  # the per-sample path, as the preset ran before issue 52
        ["--preset", PRESET, "--sft_steps", "0", "--filter_groups", "false", "--share_prompt", "false",
         "--minibatch_by", "sample"]
    )  # fmt: skip
    assert cfgs["troll_shared"] == preset and preset.share_prompt and preset.minibatch_by == "group"
    assert cfgs["troll_shared_system"].system == "" and cfgs["troll_shared_system"].share_prompt
    assert cfgs["trl"] == preset and cfgs["trl_system"].system == ""  # TRL's prompts: the same templates
    tiny = {"model": "tiny", "minibatches": 1, "prompts": 32, "n": 8, "max_new": 5, "lr": 1e-4, "seed": 0}
    assert Config.from_args(trl_compare.troll_argv(tiny | {"side": "troll_clip"})).loss == "ppo_clip"
    assert Config.from_args(trl_compare.troll_argv(tiny | {"side": "troll"})) == Config.from_args(
        ["--preset", "tiny-cpu", "--sft_steps", "0", "--minibatches", "1"]  # this script's default, not the preset's
    )
