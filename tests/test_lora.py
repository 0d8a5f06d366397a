"""LoRA adapters (troll/lora.py) against PEFT's own merge and a plain transformers forward: the adapted policy starts
at the base, the sampler's merged weights compute it, only adapters train and are checkpointed, resume is bit-exact,
the export loads as a plain model, and vLLM follows the trainer after every push."""

import copy
import dataclasses
import math
import subprocess
import sys

import pytest
import torch

pytest.importorskip("peft")

from test_train import rows, straight_and_resumed, tiny  # noqa: E402

from troll import lora  # noqa: E402
from troll.base.checkpoint import read_jsonl  # noqa: E402
from troll.base.config import Config  # noqa: E402
from troll.models.build import adapt, base_dtype, build_model  # noqa: E402
from troll.models.tiny import tiny_llama, train_tokenizer  # noqa: E402
from troll.run.harness import RunError  # noqa: E402
from troll.tasks.task import encode  # noqa: E402
from troll.tools.export import export  # noqa: E402
from troll.train import train  # noqa: E402

TOKENS = torch.tensor([[5, 17, 42, 9, 33, 2, 71, 8]])


@pytest.fixture
def varied_reward(monkeypatch):
    """A reward a random policy can earn (1 for an odd-length completion), so every update moves the adapters."""
    monkeypatch.setattr("troll.tasks.addition.reward", lambda completion, gold: float(len(completion) % 2))


def base_model():
    tok = train_tokenizer(["1+2=3", "40+2=42"], vocab_size=64)
    return tiny_llama(tok, hidden=64, layers=2, heads=2, seed=0)


def randomise(model, seed: int = 1) -> None:
    """Seeded adapters with nonzero B (PEFT starts B at 0 and A from the global RNG), so the LoRA model differs from
    its base and two models built alike are equal."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def logits(model, tokens=TOKENS):
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_adapters_start_at_the_base_and_only_they_train():
    base = base_model()
    reference = logits(base)
    model = lora.add_adapters(base, rank=4, alpha=8)
    assert lora.is_lora(model) and torch.equal(logits(model), reference)  # B = 0: exactly the base
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trained}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}  # all-linear
    assert not any("lm_head" in n or "embed" in n for n in trained)


def test_engine_weights_compute_the_lora_model():
    """The merged tensors, loaded by name into a plain copy of the base, give the LoRA model's logits (PEFT's own
    forward: base layer plus the adapter path), and equal PEFT's merge_and_unload."""
    base = base_model()
    plain = copy.deepcopy(base)
    model = lora.add_adapters(base, rank=4, alpha=8)
    randomise(model)
    merged = dict(lora.engine_weights(model))
    assert set(merged) == set(plain.state_dict())  # the base model's own names, every tensor
    plain.load_state_dict(merged)
    want = logits(model)
    assert (logits(plain) - want).abs().max() < 1e-5 and (logits(plain) - logits(base_model())).abs().max() > 1e-2
    peft_merged = lora.merge(copy.deepcopy(model)).state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, peft_merged[name], rtol=1e-6, atol=1e-6)


def test_base_weights_are_the_frozen_base_without_copies():
    base = base_model()
    want = {k: v.clone() for k, v in base.state_dict().items()}
    model = lora.add_adapters(base, rank=4, alpha=8)
    randomise(model)
    got = lora.base_weights(model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert lora.unwrap(model) is model.get_base_model() and lora.unwrap(base) is base


def test_named_targets_and_an_unknown_target():
    model = lora.add_adapters(base_model(), rank=2, alpha=2, target="q_proj, v_proj")
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="not found|target"):
        lora.add_adapters(base_model(), rank=2, alpha=2, target="no_such_layer")


def test_bf16_base_with_float32_adapters():
    """Under bf16 autocast the frozen base is held in bf16 (2 B/param) and the adapters stay float32."""
    cfg = Config(lora_rank=4, bf16=True)
    assert base_dtype(cfg) == torch.bfloat16 and base_dtype(Config()) == torch.float32
    model = adapt(cfg, base_model())
    for name, p in model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else torch.bfloat16), name
    assert adapt(Config(), base_model()).__class__.__name__ == "LlamaForCausalLM"  # rank 0: the model itself


def test_gradient_checkpointing_and_the_chunked_head_give_the_same_adapter_gradients():
    """The frozen embedding gives checkpointed blocks no input that requires grad; `_trainable` fixes that, and the
    chunked output layer (troll.head) reaches the adapters exactly as full logits do."""
    from troll.head import gather_logprobs
    from troll.policy import packed_logits

    grads = []
    for ckpt, chunk in ((False, 0), (True, 0), (True, 3)):
        base = base_model()
        if ckpt:
            base.gradient_checkpointing_enable()
        model = lora.add_adapters(base, rank=4, alpha=8)
        randomise(model)
        model.train()
        attn = torch.ones_like(TOKENS, dtype=torch.bool)
        out = packed_logits(model, TOKENS, attn, 4, 1.0, chunk_rows=chunk).reshape(4, -1)  # [4, V] or its LMHead
        ids = torch.tensor([[7, 11]] * 4)
        logp, log_rest, _ = gather_logprobs(out, ids, torch.ones_like(ids, dtype=torch.bool))
        (logp.sum() + log_rest.sum()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    for other in grads[1:]:
        for name, g in grads[0].items():
            assert other[name] is not None and torch.allclose(other[name], g, atol=1e-5), name


def test_missing_peft_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[lora\]'"):
        lora.add_adapters(base_model(), rank=2, alpha=2)


def test_lora_run_checkpoints_adapters_and_keeps_its_base_once(tmp_path, varied_reward):
    cfg = tiny(tmp_path, lora_rank=4, lora_alpha=8, steps=2, save_every=1)
    train(cfg)
    out = tmp_path / "run"
    base = build_model(Config(), torch.device("cpu"))[0]  # the tiny model of seed 0, before any update
    saved = lora.base_weights(build_model(dataclasses.replace(cfg, lora_rank=0), torch.device("cpu"), out / "base")[0])
    assert all(torch.equal(saved[k], v) for k, v in base.state_dict().items())  # sft_steps 0: the seed's model
    ckpt = out / "checkpoints" / "step-000002"
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()
    size = sum(f.stat().st_size for f in ckpt.iterdir())
    assert size < sum(f.stat().st_size for f in (out / "base").iterdir())  # adapters + AdamW states, not the base
    model, _ = build_model(cfg, torch.device("cpu"), ckpt)
    assert lora.is_lora(model) and any(p.requires_grad for p in model.parameters())
    moved = [n for n, p in model.named_parameters() if "lora_B" in n and p.abs().max() > 0]
    assert moved  # the adapters trained (B starts at 0)
    for name, tensor in lora.base_weights(model).items():
        assert torch.equal(tensor, saved[name]), name  # the base did not


@pytest.mark.slow
def test_lora_resume_is_bit_exact(tmp_path, varied_reward):
    """Resumed at step 2, step 3 is the uninterrupted run's: metrics and every adapter weight bit for bit."""
    kw = dict(lora_rank=4, lora_alpha=8, save_every=1)
    a, b = straight_and_resumed(tmp_path, **kw)
    assert [m["step"] for m in b] == [1, 2, 3]
    for key in a[2]:
        if not key.startswith(("time_", "tokens_per_s", "peak_memory_mb")):
            assert a[2][key] == b[2][key] or (math.isnan(a[2][key]) and math.isnan(b[2][key])), key
    cfg = tiny(tmp_path / "a", **kw)
    wa = build_model(cfg, torch.device("cpu"), tmp_path / "a" / "run" / "checkpoints" / "step-000003")[0]
    wb = build_model(cfg, torch.device("cpu"), tmp_path / "b" / "run" / "checkpoints" / "step-000003")[0]
    sa, sb = wa.state_dict(), wb.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
def test_export_merges_a_run_into_a_plain_model(tmp_path, varied_reward):
    """The export loads as a plain model that computes the LoRA model, with the run's tokenizer: it encodes the raw
    prompt as training did, and carries no chat template (the addition task never used one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    train(tiny(tmp_path, lora_rank=4, lora_alpha=8, steps=2))
    out = tmp_path / "run"
    lora_model, tokenizer = build_model(Config.load(out / "config.json"), torch.device("cpu"), out / "checkpoints" /
                                        "step-000002")  # fmt: skip
    ids = torch.tensor([tokenizer.encode("12+34=")])
    done = subprocess.run([sys.executable, "-m", "troll", "export", str(out), "--out", str(tmp_path / "merged")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not lora.is_lora(merged) and (tmp_path / "merged" / "tokenizer.json").is_file()
    assert (logits(merged, ids) - logits(lora_model, ids)).abs().max() < 1e-5
    for folder in (tmp_path / "merged", out / "base", out / "checkpoints" / "step-000002"):
        saved = AutoTokenizer.from_pretrained(folder)
        assert saved.chat_template is None and encode(saved, ["12+34="]) == ids.tolist(), folder


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["{run}", "--out", "{run}"], "exists"),  # the run itself: never overwritten
        (["{tmp}/nowhere", "--out", "{tmp}/m"], "not a LoRA run"),
        ([], "required"),
    ],
)
def test_export_misuse_is_one_line(tmp_path, argv, problem):
    (tmp_path / "run").mkdir()
    argv = [a.format(run=tmp_path / "run", tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, "-m", "troll", "export", *argv], capture_output=True, text=True)
    assert done.returncode == 2 and problem in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "m").exists()


def test_lora_run_without_its_base_names_it(tmp_path, varied_reward):
    import shutil

    train(tiny(tmp_path, lora_rank=4, lora_alpha=8, steps=1, save_every=1))
    shutil.rmtree(tmp_path / "run" / "base")
    with pytest.raises(RunError, match="base is missing"):  # one line on the command line, nothing written
        train(dataclasses.replace(tiny(tmp_path, lora_rank=4, lora_alpha=8), steps=2, resume=True))


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_vllm_follows_the_lora_model_after_every_push(tmp_path, monkeypatch, targets):
    """A Qwen2-architecture stand-in (q/k/v bias, tied embeddings) with adapters on all linears or on q and v only
    (a fused q/k/v projection half adapted): after each change of the adapters the engine's log-probs equal the
    trainer's, and a push that did nothing would be caught (the adapters move the probe far beyond tolerance)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from troll.models.standin import save_standin
    from troll.models.vllm_engine import VLLMGenerator

    path = save_standin("tiny", ["1+2=3", "40+2=42", "the sum of 7 and 5"], tmp_path / "standin")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = lora.add_adapters(AutoModelForCausalLM.from_pretrained(path), rank=4, alpha=8, target=targets)
    engine = VLLMGenerator(path, tokenizer, max_model_len=64, dtype="float32")
    try:
        for seed in (1, 2):
            randomise(model, seed)
            before = engine.probe_logprobs(model)
            assert (before[0] - before[1]).abs().max() > 1e-2  # the engine is behind: the change is visible
            engine.push_weights(model)  # raises if the engine disagrees after the push
            assert engine.last_sync_error < 1e-4
        ro = engine.generate([[5, 6, 7]], 2, 4, top_k_logprobs=0, seed=0)
        assert ro.completion_ids.shape[0] == 2
    finally:
        engine.close()


def test_lora_config_checks():
    with pytest.raises(ValueError, match="lora_rank must be >= 0"):
        Config(lora_rank=-1)
    with pytest.raises(ValueError, match="lora_targets"):
        Config(lora_targets=" , ")
    with pytest.raises(ValueError, match="lora_alpha"):
        Config(lora_alpha=float("nan"))
    assert Config.from_args(["--lora_rank", "8", "--lora_targets", "q_proj,v_proj"]).lora_rank == 8


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_backend_lora_run(tmp_path, monkeypatch, varied_reward):
    """The LoRA loop on the vLLM engine: every push (after each update, and at the start of the run) passes the
    engine's self-check against the trainer, so the sampler samples the trainer's policy."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    train(tiny(tmp_path, backend="vllm", lora_rank=4, lora_alpha=8, eval_every=1))
    m = rows(tmp_path / "run")
    assert len(m) == 2 and all(r["time_sync"] > 0 and math.isfinite(r["policy"]) for r in m)
    assert all(abs(r["mismatch_logratio_absmax"]) < 1e-3 for r in m)  # float32 engine: the trainer's policy


@pytest.mark.slow
def test_tiny_lora_run_learns(tmp_path):
    """The LoRA commands of docs/usage.md on CPU, 50 RL steps: only the adapters train, on the frozen warm-started
    model, and held-out accuracy rises (seed 0, 500 problems: 0.304 -> 0.562 at step 50). The export, loaded with
    plain transformers and prompted with the raw problem as docs/usage.md does, answers as the trainer's own last
    evaluation did."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = Config.from_args(
        ["--preset", "tiny-lora", "--out", str(tmp_path / "run"), "--steps", "50", "--eval_size", "500"]
    )
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lr) == (8, 16.0, 3e-4)
    summary = train(cfg)
    assert summary["sft_reached"] and 0.2 < summary["eval_before"] < 0.5
    assert summary["eval_after"] > summary["eval_before"] + 0.15

    export(tmp_path / "run", tmp_path / "merged")
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="chat_template is not set"):
        tok.apply_chat_template([{"role": "user", "content": "04+85="}])
    last = [r for r in read_jsonl(tmp_path / "run" / "samples.jsonl") if r["step"] == 50]  # troll's own evaluation
    assert len(last) == cfg.samples_to_log
    for r in last:
        ids = tok(r["question"], return_tensors="pt")  # the raw prompt, "04+85=" (docs/usage.md)
        out = model.generate(**ids, max_new_tokens=cfg.max_new_tokens, do_sample=False)
        assert tok.decode(out[0, ids.input_ids.shape[1] :], skip_special_tokens=True) == r["completion"], r
