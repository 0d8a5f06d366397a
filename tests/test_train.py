"""The RL loop (troll/train.py) on CPU with tiny local models: every loss runs, resume is exact, checkpoints fail
loudly, the GSM8K recipe runs end to end with a stand-in for Qwen, and the tiny task learns."""

import dataclasses
import json
import math

import pytest
import torch

from troll.config import Config
from troll.losses import LOSSES
from troll.train import build_model, latest_checkpoint, train

TIMING_KEYS = ("time_", "tokens_per_s", "peak_memory_mb")


def tiny(tmp_path, **kw) -> Config:
    base = dict(
        task="addition",
        model="tiny",
        sft_steps=0,
        steps=2,
        prompts_per_step=4,
        samples_per_prompt=4,
        minibatches=2,
        max_new_tokens=4,
        eval_every=100,
        eval_size=16,
        save_every=100,
        device="cpu",
        out=str(tmp_path / "run"),
        lr=1e-2,
    )
    return Config(**(base | kw))


@pytest.fixture
def varied_reward(monkeypatch):
    """An untrained model never adds correctly, so every advantage would be 0 and nothing would move. This
    reward (1 for an odd-length completion) gives a random policy a signal, so the updates are real."""
    monkeypatch.setattr("troll.addition.reward", lambda completion, gold: float(len(completion) % 2))


def rows(path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_two_rl_steps_for_every_loss(tmp_path, loss, varied_reward):
    cfg = tiny(tmp_path, loss=loss)
    summary = train(cfg)
    out = tmp_path / "run"
    metrics = rows(out)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(math.isfinite(m["policy"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    assert any(m["grad_norm"] > 0 for m in metrics)
    for key in (
        "reward",
        "kl_before_max",
        "kl_after_max",
        "frac_active",
        "entropy",
        "lr",
        "time_generate",
        "time_update",
        "tokens_per_s",
        "peak_memory_mb",
        "response_len_mean",
        "truncated_frac",
    ):
        assert key in metrics[0], key
    fresh, _ = build_model(cfg, torch.device("cpu"))
    trained, _ = build_model(cfg, torch.device("cpu"), path=str(latest_checkpoint(out)))
    changed = [not torch.equal(a, b) for a, b in zip(fresh.parameters(), trained.parameters(), strict=True)]
    assert any(changed)
    assert set(json.loads((out / "summary.json").read_text())) >= {"eval_before", "eval_after", "wall_clock_s"}
    assert 0.0 <= summary["eval_after"] <= 1.0
    assert json.loads((out / "config.json").read_text())["loss"] == loss


def test_behaviour_policy_as_anchor(tmp_path, varied_reward):
    train(tiny(tmp_path, old_policy="behaviour", k=8))
    m = rows(tmp_path / "run")
    assert len(m) == 2 and m[0]["kl_before_max"] >= 0 and math.isfinite(m[1]["policy"])


def test_vllm_backend_two_steps(tmp_path, monkeypatch, varied_reward):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    train(tiny(tmp_path, backend="vllm", old_policy="behaviour", k=8, eval_every=1))  # evaluation runs on the engine
    m = rows(tmp_path / "run")
    assert len(m) == 2 and m[1]["time_sync"] > 0 and math.isfinite(m[1]["policy"])
    assert all(0.0 <= r["eval_acc"] <= 1.0 for r in m)


def test_resume_equals_uninterrupted(tmp_path, varied_reward):
    straight = tiny(tmp_path / "a", steps=3, save_every=1)
    train(straight)
    first = tiny(tmp_path / "b", steps=2, save_every=1)
    train(first)
    train(dataclasses.replace(first, steps=3, resume=True))
    a, b = rows(tmp_path / "a" / "run"), rows(tmp_path / "b" / "run")
    assert [m["step"] for m in b] == [1, 2, 3]
    for key in a[2]:
        if not key.startswith(TIMING_KEYS):
            assert a[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key


def test_missing_or_corrupt_checkpoint_is_a_clear_error(tmp_path):
    cfg = tiny(tmp_path, steps=1)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        train(dataclasses.replace(cfg, resume=True))
    train(cfg)
    with pytest.raises(FileExistsError, match="already holds a run"):
        train(cfg)
    ckpt = latest_checkpoint(tmp_path / "run")
    (ckpt / "trainer.pt").unlink()
    with pytest.raises(FileNotFoundError, match="incomplete or corrupt"):
        train(dataclasses.replace(cfg, steps=2, resume=True))


def test_gsm8k_preset_one_step_with_a_local_stand_in(tmp_path, gsm8k_dir):
    """The GPU recipe's code path on CPU: chat template, GSM8K from disk, reward, update, evaluation."""
    from troll.gsm8k import load_gsm8k
    from troll.tiny import save_tiny, tiny_llama, train_tokenizer

    questions = [r["question"] for r in load_gsm8k("train", str(gsm8k_dir), limit=300)]
    tok = train_tokenizer(questions, vocab_size=512)
    model_dir = save_tiny(tiny_llama(tok, hidden=64, layers=1, heads=2), tok, tmp_path / "stand-in")
    cfg = Config.from_args(
        [
            "--preset",
            "gsm8k-qwen2.5-0.5b",
            "--model",
            str(model_dir),
            "--data",
            str(gsm8k_dir),
            "--device",
            "cpu",
            "--backend",
            "hf",
            "--bf16",
            "false",
            "--steps",
            "1",
            "--prompts_per_step",
            "2",
            "--samples_per_prompt",
            "2",
            "--max_new_tokens",
            "6",
            "--eval_size",
            "3",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert cfg.chat and cfg.task == "gsm8k" and cfg.lr == 1e-6 and cfg.grad_checkpointing
    model, _ = build_model(cfg, torch.device("cpu"))  # from_pretrained returns eval mode: build_model undoes it
    assert model.training and model.is_gradient_checkpointing
    summary = train(cfg)
    m = rows(tmp_path / "run")
    assert len(m) == 1 and math.isfinite(m[0]["policy"]) and m[0]["eval_acc"] == summary["eval_after"]
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and "completion" in samples[0]


def test_tiny_cpu_run_learns(tmp_path):
    """README's main command, shortened: 250 supervised steps, then 50 TROLL steps raise held-out greedy accuracy
    (measured on the full preset: 0.266 -> 0.355 after 100 steps; after 50 steps about 0.35)."""
    cfg = Config.from_args(
        ["--preset", "tiny-cpu", "--out", str(tmp_path / "run"), "--steps", "50", "--eval_size", "500"]
    )
    summary = train(cfg)
    print(f"\ntiny-cpu: eval {summary['eval_before']:.3f} -> {summary['eval_after']:.3f}")
    assert summary["eval_before"] > 0.1  # the warm-start made the policy partly competent
    assert summary["eval_after"] > summary["eval_before"] + 0.04


def test_plot_overlays_runs(tmp_path):
    from troll.plot import plot_runs

    for name, kl in (("troll", 0.05), ("clip", 0.3)):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": s, "reward": s / 10, "kl_after_max": kl}) for s in range(1, 6)]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    written = plot_runs([tmp_path / "troll", tmp_path / "clip"], tmp_path / "plots")
    assert sorted(p.name for p in written) == ["kl_after_max.png", "reward.png"]
    assert all(p.stat().st_size > 1000 for p in written)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot_runs([tmp_path / "nope"], tmp_path / "plots")


def test_non_finite_gradient_skips_the_step(tmp_path, monkeypatch, varied_reward):
    import troll.train as train_mod

    real_build = train_mod.build_model

    def poisoned(*args, **kw):
        model, tok = real_build(*args, **kw)
        model.lm_head.weight.register_hook(lambda g: g * math.inf)
        return model, tok

    monkeypatch.setattr(train_mod, "build_model", poisoned)
    cfg = tiny(tmp_path)
    summary = train(cfg)
    assert summary["skipped_steps"] == cfg.steps * cfg.minibatches
    assert [m["skipped"] for m in rows(tmp_path / "run")] == [cfg.minibatches] * cfg.steps
    fresh, _ = real_build(cfg, torch.device("cpu"))
    trained, _ = real_build(cfg, torch.device("cpu"), path=str(latest_checkpoint(tmp_path / "run")))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), trained.parameters(), strict=True))


@pytest.mark.parametrize("loss", ["troll", "ppo_clip"])
@pytest.mark.parametrize("minibatches", [1, 2])
def test_old_policy_from_the_first_forward_equals_recomputation(
    tmp_path, monkeypatch, varied_reward, loss, minibatches
):
    """Taking the first minibatch's old policy from its own forward pass (train.old_policy_from_forward) gives
    the metrics of the full no-grad recomputation, up to float rounding. K >= V keeps every support full, so a
    rounding-level difference cannot swap a token in or out of a near-uniform row's top K."""
    import troll.train as train_mod

    cfg = dict(loss=loss, minibatches=minibatches, steps=2, k=300)
    scored = []  # samples per no-grad old-policy pass
    real_old_policy = train_mod.old_policy
    monkeypatch.setattr(
        train_mod, "old_policy", lambda c, m, ro, v: scored.append(len(ro)) or real_old_policy(c, m, ro, v)
    )
    train(tiny(tmp_path / "reuse", **cfg))
    assert scored == ([8, 8] if minibatches == 2 else [])  # 16 samples per step; the first minibatch is skipped
    scored.clear()
    monkeypatch.setattr(train_mod, "old_policy_from_forward", lambda cfg, model: False)
    train(tiny(tmp_path / "recompute", **cfg))
    assert scored == [16, 16]  # the reference: every sample scored by the no-grad pass
    a, b = rows(tmp_path / "reuse" / "run"), rows(tmp_path / "recompute" / "run")
    for ra, rb in zip(a, b, strict=True):
        for key in ra:
            if not key.startswith(TIMING_KEYS):
                assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-6), key


def test_reused_old_policy_equals_the_no_grad_pass(tmp_path):
    """The anchor built from the (grad-enabled) update forward equals old_policy's no-grad recomputation."""
    import troll.train as train_mod
    from troll.rollout import HFGenerator

    cfg = tiny(tmp_path, k=16)
    model, tok = build_model(cfg, torch.device("cpu"))
    prompts = [tok.encode(q) for q in ("12+34=", "5+77=", "90+9=")]
    ro = HFGenerator(model, tok).generate(prompts, n=3, max_new_tokens=4, seed=0)
    rows_ = torch.tensor([4, 0, 7, 2])
    ref = train_mod.old_policy(cfg, model, ro.select(rows_), len(tok))
    got = train_mod.anchor_from_logits(cfg, train_mod.forward(cfg, model, ro, rows_, len(tok)), ro, rows_)
    assert not got.logp.requires_grad
    for f in ("idx", "mask"):
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    for f in ("logp", "log_rest"):
        torch.testing.assert_close(getattr(got, f), getattr(ref, f), rtol=1e-6, atol=1e-6)


def test_old_policy_from_forward_only_without_dropout(tmp_path):
    import troll.train as train_mod

    cfg = tiny(tmp_path)
    model, _ = build_model(cfg, torch.device("cpu"))
    assert model.training and train_mod.old_policy_from_forward(cfg, model)  # Llama, attention_dropout 0
    assert not train_mod.old_policy_from_forward(dataclasses.replace(cfg, old_policy="behaviour"), model)
    model.config.attention_dropout = 0.1  # applied functionally in train mode
    assert not train_mod.old_policy_from_forward(cfg, model)
    nested = {"text_config": {"attn_pdrop": 0.2}, "hidden_dropout": 0, "id2label": {0: "a"}}
    assert train_mod._dropout_rates(nested) == [0.2, 0.0]
    model.eval()
    assert train_mod.old_policy_from_forward(cfg, model)
    model.config.attention_dropout = 0.0
    model.model.layers[0].mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.1))
    assert not train_mod.old_policy_from_forward(cfg, model.train())  # an nn.Dropout module that fires
    assert train_mod.old_policy_from_forward(cfg, model.eval())
