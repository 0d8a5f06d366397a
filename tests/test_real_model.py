"""A real pretrained LM end to end (slow): SmolLM2-135M-Instruct, made from its PyPI package by troll.models.packaged,
runs two RL steps of the `smollm2-words` preset under every loss with the transformers sampler and with vLLM's CPU
build, and vLLM follows its tied output layer after a weight push."""

from __future__ import annotations

import json
import math

import pytest
import torch

from troll.base.config import PRESETS, Config
from troll.losses import LOSSES
from troll.models.build import build_model
from troll.rollout import HFGenerator
from troll.tasks.task import encode, load_task
from troll.train import train

pytestmark = pytest.mark.slow
SHORT = dict(steps=2, sft_steps=1, sft_probe=4, prompts_per_step=2, samples_per_prompt=4, minibatches=2,
             max_new_tokens=12, eval_every=2, eval_size=4, save_every=2, device="cpu")  # fmt: skip


def rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("backend", ["hf", "vllm"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_two_steps_of_the_real_model_preset_under_every_loss(tmp_path, monkeypatch, loss, backend):
    if backend == "vllm":
        pytest.importorskip("vllm")
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    cfg = Config(**(PRESETS["smollm2-words"] | SHORT | dict(loss=loss, backend=backend, out=str(tmp_path / "run"))))
    assert train(cfg)["steps"] == 2
    steps = [r for r in rows(tmp_path / "run") if "eval_acc" not in r]
    evals = [r["eval_acc"] for r in rows(tmp_path / "run") if "eval_acc" in r]
    assert len(steps) == 2 and len(evals) == 2 and all(0 <= a <= 1 for a in evals)
    assert all(math.isfinite(r["policy"]) and 0 <= r["frac_active"] <= 1 for r in steps)
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file()


def test_vllm_follows_the_real_models_tied_output_layer(monkeypatch):
    """SmolLM2 ties its output layer to the embeddings: after an update and a push, vLLM's greedy decoding and
    sampled log-probs are the trained model's (a push that missed lm_head would keep the old output layer)."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from troll.models.packaged import folder
    from troll.models.vllm_engine import VLLMGenerator

    cfg = Config(**(PRESETS["smollm2-words"] | SHORT))
    model, tok = build_model(cfg, torch.device("cpu"))
    assert model.config.tie_word_embeddings
    task, _ = load_task(cfg, tok)
    prompts = encode(tok, [task.prompt(r["question"]) for r in task.test[:3]])
    engine = VLLMGenerator(folder(cfg.model), tok, max_model_len=256, max_top_k=8, dtype="float32", seed=0)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        ids = torch.tensor([prompts[0]])
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        model.eval()
        engine.push_weights(model)  # checks the engine against the model itself (check_sync)
        assert engine.greedy(prompts, 8) == HFGenerator(model, tok).greedy(prompts, 8)
    finally:
        engine.close()


def test_the_shared_prompt_on_the_real_model_is_within_float32s_own_error():
    """--share_prompt on SmolLM2 in float32 (its RMSNorm included): TROLL's loss and every gradient differ from the
    float64 per-sample truth by no more than the float32 per-sample pass does (twice its error, plus 1e-7 for a
    gradient entry the float32 pass gets exactly)."""
    from troll.policy import completion_logits, shared_prompt_logits
    from troll.sparse import sparsify

    cfg = Config(**(PRESETS["smollm2-words"] | SHORT))
    model, tok = build_model(cfg, torch.device("cpu"))
    task, _ = load_task(cfg, tok)
    prompts = encode(tok, [task.prompt(r["question"]) for r in task.train[:2]])
    prompts = [p for p in prompts for _ in range(2)]  # two groups of two, as a micro-batch holds them
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 20000, (4, 6), generator=g)
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, 4:] = False
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])

    def loss_and_grad(scorer, m):
        m.zero_grad(set_to_none=True)
        logits = scorer(m, prompts, ids, 1.0, len(tok))
        with torch.no_grad():  # an anchor a little away from p, so the projection acts on some tokens
            moved = logits.detach() + 0.3 * torch.randn(logits.shape, generator=g)
            old = sparsify(moved.reshape(-1, len(tok)).float(), ids.reshape(-1), k=16, delta=1e-5)
        value, _ = LOSSES["troll"](logits, ids, mask, adv.to(logits.dtype), old.samples(torch.arange(4), 6), norm_len=6)
        value.backward()
        return [value.detach(), *(p.grad.detach().clone() for p in m.parameters())]  # in the model's own dtype

    def error(got: list, want: list) -> float:  # the largest difference over the loss and every gradient entry,
        return max((x.double() - y).abs().max().item() for x, y in zip(got, want, strict=True))  # tensor by tensor

    g.manual_seed(1)
    plain = loss_and_grad(completion_logits, model)
    g.manual_seed(1)
    shared = loss_and_grad(shared_prompt_logits, model)
    g.manual_seed(1)
    truth = loss_and_grad(completion_logits, model.double())
    for part in (slice(0, 1), slice(1, None)):  # the loss, then the gradients
        assert error(shared[part], truth[part]) <= 2 * error(plain[part], truth[part]) + 1e-7
    assert max(t.abs().max().item() for t in truth[1:]) > 1e-3
