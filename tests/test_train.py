"""The RL loop (troll/train.py) on CPU with tiny local models: every loss runs, resume is exact and leaves a finished
run alone, checkpoints fail loudly, the GSM8K recipe runs end to end with a stand-in for Qwen, and the tiny task
learns."""

import dataclasses
import json
import math

import pytest
import torch

from troll.base.checkpoint import complete_checkpoints, load_trainer_state
from troll.base.config import Config
from troll.losses import LOSSES
from troll.models.build import build_model
from troll.train import train

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
    monkeypatch.setattr("troll.tasks.addition.reward", lambda completion, gold: float(len(completion) % 2))


def all_rows(path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def rows(path) -> list[dict]:
    """The RL step rows of metrics.jsonl (evaluation rows left out)."""
    return [m for m in all_rows(path) if "eval_acc" not in m]


def evals(path) -> list[tuple[int, float]]:
    return [(m["step"], m["eval_acc"]) for m in all_rows(path) if "eval_acc" in m]


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_two_rl_steps_for_every_loss(tmp_path, loss, varied_reward, capsys):
    cfg = tiny(tmp_path, loss=loss)
    summary = train(cfg)
    out = tmp_path / "run"
    gain = summary["eval_after"] - summary["eval_before"]
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert printed.startswith(f"gain: {gain:+.3f}, 95% interval [") and printed.endswith(
        f"over {summary['eval_problems']} problems (unpaired)"
    )
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
    trained, _ = build_model(cfg, torch.device("cpu"), path=str(complete_checkpoints(out)[0]))
    changed = [not torch.equal(a, b) for a, b in zip(fresh.parameters(), trained.parameters(), strict=True)]
    assert any(changed)
    keys = {"eval_before", "eval_after", "eval_best", "eval_best_step", "wall_clock_s", "cpu_s"}
    assert set(json.loads((out / "summary.json").read_text())) >= keys
    assert 0.0 <= summary["eval_after"] <= 1.0
    assert [s for s, _ in evals(out)] == [0, 2]  # before RL, and after the last step
    assert json.loads((out / "config.json").read_text())["loss"] == loss


def test_behaviour_policy_as_anchor(tmp_path, varied_reward):
    train(tiny(tmp_path, old_policy="behaviour", k=8))
    m = rows(tmp_path / "run")
    assert len(m) == 2 and m[0]["kl_before_max"] >= 0 and math.isfinite(m[1]["policy"])


@pytest.mark.slow
def test_vllm_backend_two_steps(tmp_path, monkeypatch, varied_reward):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    train(tiny(tmp_path, backend="vllm", old_policy="behaviour", k=8, eval_every=1))  # evaluation runs on the engine
    m = rows(tmp_path / "run")
    assert len(m) == 2 and m[1]["time_sync"] > 0 and math.isfinite(m[1]["policy"])
    assert [s for s, _ in evals(tmp_path / "run")] == [0, 1, 2]
    assert all(0.0 <= acc <= 1.0 for _, acc in evals(tmp_path / "run"))


@pytest.mark.slow
def test_vllm_backend_stale_bf16_rollouts_resume_exactly(tmp_path, monkeypatch, varied_reward):
    """--staleness and --rollout_dtype bfloat16 on the vLLM engine: the mismatch metrics see the bf16 sampler, and
    a run resumed at step 2 (a fresh engine, the pending batch from the checkpoint) repeats step 3 exactly."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    kw = dict(backend="vllm", staleness=1, rollout_dtype="bfloat16", save_every=1)
    train(tiny(tmp_path / "a", steps=3, **kw))
    m = rows(tmp_path / "a" / "run")
    assert len(m) == 3 and all(math.isfinite(r["policy"]) for r in m)
    assert m[0]["mismatch_logratio_absmax"] > 1e-4 and m[0]["mismatch_kl"] >= 0
    first = tiny(tmp_path / "b", steps=2, **kw)
    train(first)
    train(dataclasses.replace(first, steps=3, resume=True))
    b = rows(tmp_path / "b" / "run")
    for key in m[2]:
        if not key.startswith(TIMING_KEYS):
            assert m[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key


def straight_and_resumed(tmp_path, **kw) -> tuple[list[dict], list[dict]]:
    """`tiny(**kw)` run straight to step 3 in tmp_path/a, and to step 2 then resumed to 3 in tmp_path/b: the step
    rows of each."""
    train(tiny(tmp_path / "a", steps=3, **kw))
    first = tiny(tmp_path / "b", steps=2, **kw)
    train(first)
    train(dataclasses.replace(first, steps=3, resume=True))
    return rows(tmp_path / "a" / "run"), rows(tmp_path / "b" / "run")


@pytest.mark.parametrize("epochs, staleness, rollout_dtype", [(1, 0, "auto"), (2, 0, "auto"), (1, 2, "bfloat16")])
def test_resume_equals_uninterrupted(tmp_path, varied_reward, epochs, staleness, rollout_dtype):
    """Resumed at step 2, step 3 is the uninterrupted run's step 3, also with batches sampled ahead (the pending
    ones are in the checkpoint) by a bf16 sampler."""
    a, b = straight_and_resumed(tmp_path, save_every=1, epochs=epochs, staleness=staleness, rollout_dtype=rollout_dtype)
    assert [m["step"] for m in b] == [1, 2, 3]
    for key in a[2]:
        if not key.startswith(TIMING_KEYS):
            assert a[2][key] == pytest.approx(b[2][key], rel=1e-6, abs=1e-9), key


def test_cpu_time_counts_every_session_of_a_resumed_run(tmp_path, varied_reward, monkeypatch):
    """summary.json's cpu_s is this process's CPU time over the run's sessions: a run resumed in a process whose clock
    starts lower (patched here, as a new process's does) adds its own time to what the checkpoint recorded."""
    import troll.run.harness as harness

    first = tiny(tmp_path, steps=2, save_every=1)
    train(first)
    before = json.loads((tmp_path / "run" / "summary.json").read_text())["cpu_s"]
    recorded = load_trainer_state(complete_checkpoints(tmp_path / "run")[0])["cpu_s"]
    assert 0 < recorded <= before + 0.05  # summary.json rounds to 0.1 s
    clock, wall = harness.time.process_time, harness.time.time
    new_process = {"time": staticmethod(wall), "process_time": staticmethod(lambda: clock() - 1e6)}
    monkeypatch.setattr(harness, "time", type("NewProcess", (), new_process))
    start = clock()
    train(dataclasses.replace(first, steps=3, resume=True))
    session = clock() - start
    after = json.loads((tmp_path / "run" / "summary.json").read_text())["cpu_s"]
    assert recorded < after <= recorded + session + 0.1  # rounded to 0.1 s


def test_gsm8k_preset_one_step_with_a_local_stand_in(tmp_path, gsm8k_dir):
    """The GPU recipe's code path on CPU: chat template, GSM8K from disk, reward, update, evaluation."""
    from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer
    from troll.tasks.gsm8k import load_gsm8k

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
    assert len(m) == 1 and math.isfinite(m[0]["policy"]) and evals(tmp_path / "run")[-1] == (1, summary["eval_after"])
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and "completion" in samples[0]


@pytest.mark.slow
def test_tiny_cpu_run_learns(tmp_path):
    """README's main command, shortened to 50 RL steps: the warm-start stops at its target, so held-out accuracy
    starts near it (measured on 1,000 problems, seeds 0-2: 0.30-0.37), and TROLL raises it fast (seed 0, 1,000
    problems: 0.30 -> 0.70 at step 50 with two torch threads, 0.32 -> 0.68 with one)."""
    cfg = Config.from_args(
        ["--preset", "tiny-cpu", "--out", str(tmp_path / "run"), "--steps", "50", "--eval_size", "500"]
    )
    summary = train(cfg)
    print(f"\ntiny-cpu: eval {summary['eval_before']:.3f} -> {summary['eval_after']:.3f}")
    assert summary["sft_reached"] and summary["sft_probe_acc"] >= cfg.sft_target
    assert 0.2 < summary["eval_before"] < 0.5  # held-out accuracy lands near the probe's target
    assert summary["eval_after"] > summary["eval_before"] + 0.2


def test_plot_overlays_runs(tmp_path):
    """One figure, <out>/metrics.png: a panel per metric some run logged, titled in words, each run one colour in
    every panel, one legend; the task's behaviour_rate gets its panel when a run logs it (tiny-rare), only that run's
    curve; the per-update KL's panel also shows each run's mean over its steps (the figure the README quotes)."""
    from troll.tools.plot import PANELS, figure, plot_runs, read_metrics, series

    def titles(fig) -> list[str]:
        return [ax.get_title() for ax in fig.axes]

    for name, kl in (("troll", 0.05), ("clip", 0.3)):
        (tmp_path / name).mkdir()
        lines = [json.dumps({"step": 0, "eval_acc": 0.2})]
        lines += [json.dumps({"step": s, "reward": s / 10, "kl_after_max": kl}) for s in range(1, 6)]
        lines += [json.dumps({"step": 5, "eval_acc": 0.4})]
        (tmp_path / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert series(read_metrics(tmp_path / "troll"), "eval_acc") == [(0, 0.2), (5, 0.4)]  # the curve starts at 0
    written = plot_runs([tmp_path / "troll", tmp_path / "clip"], tmp_path / "plots")
    assert written == tmp_path / "plots" / "metrics.png" and written.stat().st_size > 1000
    assert [p.name for p in (tmp_path / "plots").iterdir()] == ["metrics.png"]  # one figure, nothing else
    fig = figure([tmp_path / "troll", tmp_path / "clip"])
    assert titles(fig) == ["Training reward", "Held-out accuracy", "Largest per-token KL, projected"]
    assert [ax.get_ylabel() for ax in fig.axes] == [PANELS[k][1] for k in ("reward", "eval_acc", "kl_after_max")]
    assert [[line.get_color() for line in ax.lines] for ax in fig.axes] == [["C0", "C1"]] * 3  # a colour per run
    assert len(fig.legends) == 1 and [t.get_text() for t in fig.legends[0].get_texts()] == ["troll", "clip"]
    assert all(ax.get_legend() is None for ax in fig.axes)  # the legend once, for the figure
    eval_acc = fig.axes[1].lines[0].get_xydata().tolist()
    assert eval_acc == [[0, 0.2], [5, 0.4]]

    with (tmp_path / "troll" / "metrics.jsonl").open("a") as f:  # a tiny-rare run logs its behaviour's rate
        f.write("".join(json.dumps({"step": s, "behaviour_rate": s / 20}) + "\n" for s in range(1, 6)))
    fig = figure([tmp_path / "troll", tmp_path / "clip"])
    assert titles(fig) == [PANELS[k][0] for k in ("reward", "eval_acc", "behaviour_rate", "kl_after_max")]
    assert [line.get_color() for line in fig.axes[2].lines] == ["C0"]  # the run that logged it
    for name, kls in (("troll", (0.018, 0.020)), ("clip", (0.020, 0.022))):  # --kl_update_vocab: the exact update KL
        with (tmp_path / name / "metrics.jsonl").open("a") as f:
            f.write("".join(json.dumps({"step": s, "kl_update_mean": kl}) + "\n" for s, kl in enumerate(kls, 6)))
    fig = figure([tmp_path / "troll", tmp_path / "clip"])
    assert titles(fig)[3] == "Per-update KL, network"
    panel = fig.axes[3]  # each run's curve, then its mean over steps, dashed, in the panel's own legend
    assert [line.get_color() for line in panel.lines] == ["C0", "C0", "C1", "C1"]
    assert [t.get_text() for t in panel.get_legend().get_texts()] == ["mean 0.019", "mean 0.021"]
    assert figure([tmp_path / "clip"], keys=("behaviour_rate",)) is None  # nothing to draw: no figure
    assert plot_runs([tmp_path / "clip"], tmp_path / "none", keys=("behaviour_rate",)) is None
    assert not (tmp_path / "none").exists()
    with pytest.raises(FileNotFoundError, match="run directory .*nope does not exist"):
        plot_runs([tmp_path / "nope"], tmp_path / "plots")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        plot_runs([tmp_path / "empty"], tmp_path / "plots")


def test_a_batch_is_drawn_for_the_largest_seed():
    """collect seeds batch i with (seed * 1,000,003 + i) mod 2**63: the largest seed a config takes (2**63 - 1)
    draws its prompts (it overflowed torch's seed before), and a small seed is its own formula."""
    from troll.models.tiny import train_tokenizer
    from troll.tasks import addition
    from troll.tasks.task import load_task
    from troll.train import collect

    class Seeds:
        def __init__(self):
            self.seen = []

        def generate(self, prompts, n, max_new_tokens, temperature=1.0, top_k_logprobs=0, seed=None):
            self.seen.append(seed)
            raise StopIteration

    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    for seed, want in ((2**63 - 1, (2**63 - 1) * 1_000_003 + 5), (3, 3 * 1_000_003 + 5)):
        cfg = Config(seed=seed)
        task, _ = load_task(cfg, tok)
        gen = Seeds()
        with pytest.raises(StopIteration):
            collect(cfg, 5, tok, gen, task)
        assert gen.seen == [want % 2**63]


def test_plot_by_loss_draws_each_seed_thin_and_each_losss_mean_thick(tmp_path, capsys):
    """--by loss: each run a thin line in its loss's colour (config.json's loss), each loss's mean over its runs at
    every step a thick line, one legend entry per loss naming its runs; a run without config.json is one line."""
    from troll.base.config import Config
    from troll.tools.plot import figure, main

    runs = []
    for loss, seed, acc in (("troll", 0, 0.5), ("ppo_clip", 0, 0.3), ("troll", 1, 0.7), ("ppo_clip", 1, 0.1)):
        run = tmp_path / f"{loss}-s{seed}"
        run.mkdir()
        Config(loss=loss, seed=seed).save(run / "config.json")
        rows = [{"step": 0, "eval_acc": 0.2}, {"step": 1, "reward": acc, "entropy": acc / 2}]
        rows += [{"step": 2, "eval_acc": acc}] + ([{"step": 3, "eval_acc": 1.0}] if seed else [])
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(run)
    fig = figure(runs, by="loss")
    accuracy = fig.axes[1]
    assert accuracy.get_title() == "Held-out accuracy"
    thin, thick = accuracy.lines[:4], accuracy.lines[4:]
    assert [line.get_color() for line in thin] == ["C0", "C1", "C0", "C1"] and {x.get_lw() for x in thin} == {0.7}
    assert [line.get_color() for line in thick] == ["C0", "C1"] and {x.get_lw() for x in thick} == {2.2}
    assert thick[0].get_xydata().tolist() == [[0, 0.2], [2, 0.6], [3, 1.0]]  # step 3: the one run that has it
    assert thick[1].get_xydata().tolist() == [[0, 0.2], [2, pytest.approx(0.2)], [3, 1.0]]
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "troll (2 runs: thin; their mean: thick)", "ppo_clip (2 runs: thin; their mean: thick)"
    ]  # fmt: skip
    (runs[0] / "config.json").unlink()
    with pytest.raises(SystemExit) as e:
        main([*map(str, runs), "--by", "loss", "--out", str(tmp_path / "plots")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "troll-s0/config.json is missing" in err and "--by run" in err
    assert not (tmp_path / "plots").exists()


def test_non_finite_gradient_skips_the_step(tmp_path, monkeypatch, varied_reward):
    import troll.run.start as start_mod

    real_build = start_mod.build_model

    def poisoned(*args, **kw):
        model, tok = real_build(*args, **kw)
        model.lm_head.weight.register_hook(lambda g: g * math.inf)
        return model, tok

    monkeypatch.setattr(start_mod, "build_model", poisoned)
    cfg = tiny(tmp_path)
    summary = train(cfg)
    assert summary["skipped_steps"] == cfg.steps * cfg.minibatches
    assert [m["skipped"] for m in rows(tmp_path / "run")] == [cfg.minibatches] * cfg.steps
    fresh, _ = real_build(cfg, torch.device("cpu"))
    trained, _ = real_build(cfg, torch.device("cpu"), path=str(complete_checkpoints(tmp_path / "run")[0]))
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), trained.parameters(), strict=True))


@pytest.mark.parametrize("loss", ["troll", "ppo_clip"])
def test_old_policy_is_the_model_before_the_update(tmp_path, varied_reward, loss):
    """The recomputed old policy is the model's own no-grad pass right before the update: with one minibatch the
    loss sees p = q on every token, so every ratio is 1, KL(p || q) = 0 and nothing is projected or clipped."""
    train(tiny(tmp_path, loss=loss, minibatches=1))
    for m in rows(tmp_path / "run"):
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-5) and m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
        assert m["kl_before_max"] < 1e-6 and m["frac_active"] == 0.0


def test_resuming_a_finished_run_changes_nothing(tmp_path, capsys):
    """README's `--resume true` on a finished run says so and leaves every file of the run as it was (the lock
    file, which names the process holding the directory, aside)."""
    out = tmp_path / "run"
    summary = train(tiny(tmp_path, steps=1))

    def files() -> dict:
        return {p: p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}

    before = files()
    capsys.readouterr()
    again = train(Config.from_args(["--out", str(out), "--resume", "true"]))
    assert "nothing to do" in capsys.readouterr().out
    assert again == summary
    assert files() == before


def test_eval_curve_starts_at_step_0_and_summary_keeps_the_best(tmp_path, varied_reward):
    summary = train(tiny(tmp_path, steps=3, eval_every=1))
    curve = evals(tmp_path / "run")
    assert [s for s, _ in curve] == [0, 1, 2, 3]
    assert summary["eval_before"] == curve[0][1] and summary["eval_after"] == curve[-1][1]
    best = max(acc for _, acc in curve)
    assert summary["eval_best"] == best and dict(curve)[summary["eval_best_step"]] == best
    assert summary["eval_best_step"] == min(s for s, acc in curve if acc == best)  # the first time it was reached


@pytest.mark.parametrize("loss", ["troll", "ppo_clip"])
def test_chunked_output_layer_gives_the_same_anchor_loss_and_gradient(tmp_path, loss):
    """`--logits_chunk 5`: the trainer's old-policy pass and its loss go through the chunked output layer (no
    [tokens, V] logits) and give the same old policy, loss and parameter gradients as full logits."""
    import troll.train as train_mod
    from troll.policy import rollout_logits
    from troll.rollout import HFGenerator

    cfg = tiny(tmp_path, loss=loss, k=16)
    model, tok = build_model(cfg, torch.device("cpu"))
    prompts = [tok.encode(q) for q in ("12+34=", "5+77=", "90+9=")]
    ro = HFGenerator(model, tok).generate(prompts, n=3, max_new_tokens=4, seed=0)
    rows_ = torch.tensor([4, 0, 7, 2, 8])
    adv = torch.linspace(-1, 1, len(rows_))
    olds = {
        chunk: train_mod.old_policy(dataclasses.replace(cfg, logits_chunk=chunk), model, ro.select(rows_), len(tok))
        for chunk in (0, 5)
    }
    with torch.no_grad():  # a different current policy, so that the trust region binds on some tokens
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    out = {}
    for chunk, old in olds.items():
        c = dataclasses.replace(cfg, logits_chunk=chunk)
        model.zero_grad()
        x = rollout_logits(model, ro, rows_, len(tok), chunk)
        ids, mask = ro.completion_ids[rows_], ro.completion_mask[rows_]
        loss_value, m = LOSSES[loss](x, ids, mask, adv, old, **c.loss_kwargs())
        loss_value.backward()
        out[chunk] = (old, loss_value, m, [p.grad.clone() for p in model.parameters()])
    (o0, l0, m0, g0), (o5, l5, m5, g5) = out[0], out[5]
    assert torch.equal(o0.idx, o5.idx) and torch.equal(o0.mask, o5.mask)
    torch.testing.assert_close(o0.logp, o5.logp)
    torch.testing.assert_close(o0.log_rest, o5.log_rest)
    torch.testing.assert_close(l0, l5)
    for a, b in zip(g0, g5, strict=True):  # float32, summed in another order: 1e-4 of the largest entry
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    assert m0.keys() == m5.keys() and all(m0[k] == pytest.approx(m5[k], rel=1e-4, abs=1e-6) for k in m0)
    if loss == "troll":
        assert m0["frac_active"] > 0


def test_chunked_output_layer_runs_end_to_end(tmp_path, varied_reward):
    train(tiny(tmp_path, logits_chunk=5))
    m = rows(tmp_path / "run")
    assert len(m) == 2 and all(math.isfinite(r["policy"]) and r["grad_norm"] > 0 for r in m)


def one_step_setup(cfg: Config):
    """What train() builds before its loop, to call rl_step directly: model, tokenizer, task, generator, optimiser."""
    from troll.rollout import HFGenerator
    from troll.run.start import make_optimizer
    from troll.tasks.task import load_task

    torch.manual_seed(cfg.seed)
    model, tok = build_model(cfg, torch.device("cpu"))
    task, _ = load_task(cfg, tok)
    opt, sched = make_optimizer(cfg, model)
    return model, tok, task, HFGenerator(model, tok), opt, sched


def test_epochs_take_every_pass_and_the_second_starts_off_policy(tmp_path, varied_reward):
    """--epochs 2 --minibatches 2: 4 optimiser steps per RL step, each a loss call on one micro-batch. The old
    policy is computed once, before the first pass: epoch 1's first minibatch sees p = q (ratio 1, KL 0), epoch 2's
    first minibatch sees a network that has moved."""
    import troll.train as train_mod

    cfg = tiny(tmp_path, epochs=2, minibatches=2, micro_batch_tokens=100_000)
    model, tok, task, gen, opt, sched = one_step_setup(cfg)
    calls: list[dict] = []

    def recording_loss(*args, **kw):
        loss, m = LOSSES[cfg.loss](*args, **kw)
        calls.append(m)
        return loss, m

    row = train_mod.rl_step(cfg, 0, model, tok, gen, opt, sched, task, loss_fn=recording_loss)
    assert len(calls) == 4 and sched.last_epoch == 4 and row["skipped"] == 0  # 2 epochs x 2 minibatches
    first, second_epoch = calls[0], calls[2]
    assert first["ratio_min"] == pytest.approx(1.0, abs=1e-5) and first["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert first["kl_before_max"] < 1e-6
    assert second_epoch["kl_before_max"] > 1e-4 and second_epoch["ratio_max"] > 1.0 + 1e-3
    assert row["kl_before_max"] == max(m["kl_before_max"] for m in calls)  # the row merges every pass


def test_epochs_multiply_optimiser_steps_and_the_lr_schedule(tmp_path, varied_reward):
    """steps x epochs x minibatches optimiser steps in all (the scheduler counts them); cosine decays over all of
    them: after RL step 1 of 2, half of them are done and the lr is lr x 0.5 x (1 + cos(pi / 2)) = lr / 2."""
    cfg = tiny(tmp_path, steps=2, epochs=2, minibatches=2, lr_schedule="cosine")
    train(cfg)
    state = torch.load(complete_checkpoints(tmp_path / "run")[0] / "trainer.pt", weights_only=False)
    assert state["scheduler"]["last_epoch"] == 8
    lrs = [m["lr"] for m in rows(tmp_path / "run")]
    assert lrs[0] == pytest.approx(cfg.lr / 2) and lrs[1] == pytest.approx(0.0, abs=1e-12)


def test_update_kl_is_the_dense_kl_of_the_network(tmp_path, varied_reward):
    """kl_update_mean/max: KL(p_new || p_old) over all V at the step's real completion tokens, against a direct
    float64 computation from two copies of the network (before and after the step) on the same rollouts."""
    import copy

    import troll.train as train_mod
    from troll.policy import completion_logits
    from troll.run.diagnostics import UpdateKL

    cfg = tiny(tmp_path, epochs=2, minibatches=2)
    model, tok, task, gen, opt, sched = one_step_setup(cfg)
    seen = []
    real_generate = gen.generate
    gen.generate = lambda *a, **kw: seen.append(real_generate(*a, **kw)) or seen[-1]
    before = copy.deepcopy(model)
    row = train_mod.rl_step(cfg, 0, model, tok, gen, opt, sched, task, probe=UpdateKL(cfg, len(tok)))
    (ro,) = seen
    with torch.no_grad():
        lp_new, lp_old = (
            torch.log_softmax(
                completion_logits(m, ro.prompt_ids, ro.completion_ids, ro.temperature, len(tok)).double(), -1
            )
            for m in (model, before)
        )
    kl = (lp_new.exp() * (lp_new - lp_old)).sum(-1)[ro.completion_mask]
    assert float(kl.max()) > 1e-4  # the step moved the network
    assert row["kl_update_mean"] == pytest.approx(float(kl.mean()), rel=1e-3, abs=1e-7)
    assert row["kl_update_max"] == pytest.approx(float(kl.max()), rel=1e-3, abs=1e-7)
    assert row["kl_update_max"] >= row["kl_update_mean"] > 0


def test_update_kl_only_for_small_vocabularies(tmp_path, varied_reward):
    """--kl_update_vocab below V (here 0): no extra pass, no kl_update keys."""
    train(tiny(tmp_path, kl_update_vocab=0))
    m = rows(tmp_path / "run")
    assert all("kl_update_mean" not in r and r["time_kl_update"] < 1e-3 for r in m)


def test_metrics_go_to_tensorboard_too(tmp_path, varied_reward):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train(tiny(tmp_path, log_to="tensorboard", kl_update_vocab=4096))
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2]
    assert [e.step for e in events.Scalars("eval_acc")] == [0, 2]
    assert [e.value for e in events.Scalars("reward")] == pytest.approx([m["reward"] for m in rows(tmp_path / "run")])
    assert "kl_update_max" in events.Tags()["scalars"]


def test_micro_batch_tokens_auto(tmp_path, monkeypatch):
    """`--micro_batch_tokens auto` (0): troll.models.memory's largest micro-batch on a GPU, written to config.json; on
    CPU the default 4096."""
    from troll.models import memory
    from troll.run.harness import auto_micro_batch

    cfg = Config.from_args(["--preset", "gsm8k-qwen2.5-0.5b", "--micro_batch_tokens", "auto"])
    assert cfg.micro_batch_tokens == 0
    gpu = type("Props", (), {"total_memory": 24 * memory.GIB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    want = memory.micro_batch_tokens("Qwen/Qwen2.5-0.5B-Instruct", 24, 0.3, grad_checkpointing=True, chunked=True)
    assert auto_micro_batch(cfg, torch.device("cuda")) == want == 16384
    unchunked = dataclasses.replace(cfg, logits_chunk=0)
    assert auto_micro_batch(unchunked, torch.device("cuda")) < want
    assert auto_micro_batch(cfg, torch.device("cpu")) == 4096
    train(tiny(tmp_path, micro_batch_tokens=0, steps=1))
    assert json.loads((tmp_path / "run" / "config.json").read_text())["micro_batch_tokens"] == 4096


def test_staleness_trains_on_the_batch_sampled_k_steps_earlier(tmp_path, varied_reward, monkeypatch):
    """--staleness 2: step 0 samples batches 0, 1, 2 (seeds s0, s0 + 1, s0 + 2) with the initial weights and trains
    on batch 0; each later step samples one batch and trains on the oldest. The mismatch metrics see it: the
    network that trains batch 0 is the one that sampled it (log-ratio 0), later ones have moved past it."""
    import troll.train as train_mod

    cfg = tiny(tmp_path, steps=4, staleness=2)
    sampled, trained = [], []
    real_collect, real_update = train_mod.collect, train_mod.update

    def collect(cfg, index, *args):
        sampled.append((index, real_collect(cfg, index, *args)))
        return sampled[-1][1]

    def update(cfg, model, opt, sched, batch, *args):
        trained.append(batch)
        return real_update(cfg, model, opt, sched, batch, *args)

    monkeypatch.setattr(train_mod, "collect", collect)
    monkeypatch.setattr(train_mod, "update", update)
    train(cfg)
    assert [i for i, _ in sampled] == [0, 1, 2, 3, 4, 5]
    assert all(t is b for t, (_, b) in zip(trained, sampled, strict=False)) and len(trained) == 4  # step s: batch s
    m = rows(tmp_path / "run")
    assert m[0]["mismatch_logratio_absmax"] < 1e-5 and m[0]["mismatch_kl"] < 1e-9
    assert all(r["mismatch_logratio_absmax"] > 1e-3 for r in m[1:])


def test_bf16_sampler_is_a_refreshed_copy(tmp_path, varied_reward):
    """--rollout_dtype bfloat16 with transformers: a bf16 copy samples (its log-probs differ from the float32
    trainer's at step 1, before any update) and push_weights copies every update into it."""
    from troll.rollout import HFGenerator

    train(tiny(tmp_path, rollout_dtype="bfloat16", minibatches=1))
    m = rows(tmp_path / "run")
    assert m[0]["mismatch_logratio_absmax"] > 1e-4  # nothing has moved yet: this is the precision alone
    model, tok = build_model(tiny(tmp_path), torch.device("cpu"))
    gen = HFGenerator(model, tok, dtype=torch.bfloat16)
    assert gen.model is not model and next(gen.model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    gen.push_weights(model)
    for a, b in zip(gen.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16))
    assert HFGenerator(model, tok).model is model


@pytest.mark.parametrize("support", ["rest", "paper"])
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_step_without_signal_leaves_the_weights_bit_identical(tmp_path, monkeypatch, loss, support):
    """Every reward equal, so every advantage 0: the first optimiser step leaves every weight as it was, under every
    loss and both sparse models (AdamW with zero gradients and no weight decay does nothing), and the metrics say
    the whole batch had no signal."""
    monkeypatch.setattr("troll.tasks.addition.reward", lambda completion, gold: 1.0)
    cfg = tiny(tmp_path, loss=loss, support=support, steps=1, save_every=1)
    before = build_model(cfg, torch.device("cpu"))[0].state_dict()
    train(cfg)
    after = build_model(cfg, torch.device("cpu"), tmp_path / "run" / "checkpoints" / "step-000001")[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    (m,) = rows(tmp_path / "run")
    assert m["frac_no_signal"] == 1.0 and m["grad_norm"] == 0.0 and m["skipped"] == 0


def test_a_third_party_exception_while_starting_is_a_run_error(tmp_path):
    """troll.run.harness.starting: an exception raised in transformers (a folder that is not a model) becomes a
    RunError naming what was done, the package, and that the same command runs after the fix; one raised in
    troll's own code (or the test's) keeps its type and traceback."""
    from transformers import AutoConfig

    from troll.run.harness import RunError, raised_by, starting

    with pytest.raises(RunError, match=r"loading x failed in transformers \(ValueError: .*run the same command again"):
        with starting("loading x"):
            AutoConfig.from_pretrained(str(tmp_path))
    with pytest.raises(KeyError) as bug, starting():
        _ = {}["a bug"]
    assert raised_by(bug.value) is None


def test_the_gain_interval_covers_the_true_gain_95_times_in_100():
    """troll.run.harness.gain_interval against simulation: two evaluations of n problems drawn at known accuracies;
    the interval holds the true difference in about 95% of 4,000 draws (within the draws' own error, +-0.01), at
    the hundreds of problems a run evaluates (at 100 the normal approximation holds it 94% of the time)."""
    import numpy as np

    from troll.run.harness import gain_interval

    rng = np.random.default_rng(0)
    for before, after, n in ((0.42, 0.6, 500), (0.1, 0.15, 200), (0.5, 0.5, 300)):
        a, b = rng.binomial(n, before, 4000) / n, rng.binomial(n, after, 4000) / n
        held = [lo <= after - before <= hi for lo, hi in (gain_interval(x, y, n) for x, y in zip(a, b, strict=True))]
        assert abs(np.mean(held) - 0.95) < 0.01, (before, after, n, np.mean(held))
    low, high = gain_interval(0.414, 0.594, 500)
    assert (round(low, 3), round(high, 3)) == (0.119, 0.241)  # the figure docs/results.md quotes
