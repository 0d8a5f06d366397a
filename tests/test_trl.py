"""troll.integrations.trl: TROLL inside TRL's GRPOTrainer, on CPU with a tiny local model.

The loss test is the contract: on one generated batch, with the model moved away from the policy that produced it,
`TROLLGRPOTrainer.compute_loss` equals `troll.losses.troll_loss` computed here from the same completions
(`completion_logits` on unpadded prompts, q from a copy of the generating weights), in value and in gradient, for
every supported loss type and GSPO's sequence level; and with the sampler's log-probs, for the decoupled correction
in each of its modes, with the weight from those log-probs (`behaviour_logp`, or TRL's mode's `is_weight`).

The sampler's log-probs enter at TRL's own seam: `GRPOTrainer._generate_single_turn` returns (completion ids,
log-probs), which its vLLM branch fills from the engine and its transformers branch leaves None; TRL pads them
into the batch field "sampling_per_token_logps". `inject_sampler` wraps that method to return the generating
model's log-prob of each sampled token plus noise (so mu != q) and one None (a token vLLM could not score). TRL's
vLLM colocate path runs on the installed vLLM CPU build too: `test_vllm_colocate_first_batch` holds the contract
with vLLM's own log-probs, and `test_vllm_colocate_trains` trains two steps, full and LoRA, through the trainer's
weight sync (TRL's own fails there, docs/results.md), checking that the engine follows the trainer.
"""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from datasets import Dataset

from troll.integrations import trl as trl_integration
from troll.integrations.is_weights import trl_is_weight
from troll.integrations.trl import TRL_VERSIONS, TROLLConfig, TROLLGRPOTrainer, check_trl_version, old_policy
from troll.losses import troll_loss
from troll.models.tiny import tiny_llama, train_tokenizer
from troll.policy import completion_logits
from troll.run.diagnostics import mismatch_at
from troll.sparse import sparsify
from troll.tasks import addition

ROOT = Path(__file__).resolve().parents[1]
EPS = 0.05


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(addition.corpus(), vocab_size=300)


def parity(completions: list[str], **_: object) -> list[float]:
    """A coin-flip reward on an untrained model, so every group has real advantages."""
    return [float(sum(map(ord, c)) % 2) for c in completions]


def make_trainer(
    tokenizer, tmp_path: Path, model=None, peft_config=None, reward=parity, **overrides
) -> TROLLGRPOTrainer:
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=6,
        temperature=0.7,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        troll_eps=EPS,
        bf16=False,  # TRL's default is bf16 autocast, also on CPU; float32 here for exact comparisons
    )
    data = Dataset.from_list([{"prompt": r["question"]} for r in addition.problems("train")[:64]])
    return TROLLGRPOTrainer(
        model=model or tiny_llama(tokenizer, hidden=64, layers=2, heads=2, seed=0),
        reward_funcs=[reward],
        args=TROLLConfig(**(settings | overrides)),
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def inject_sampler(trainer: TROLLGRPOTrainer, noise: float = 0.6) -> list[list[float | None]]:
    """Make `trainer._generate_single_turn` (TRL's seam, module docstring) return sampler log-probs: the generating
    model's log-prob of each sampled token plus N(0, noise^2), None at the first token of the first completion.
    Returns the list the log-probs of the last call are written to (one list per completion, as TRL gets them)."""
    original, record = trainer._generate_single_turn, []
    g = torch.Generator().manual_seed(2)

    def generate(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        completions, logprobs = original(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)
        assert logprobs is None and len(completions) == len(prompt_ids)  # transformers' branch: no log-probs
        T = max(map(len, completions))
        padded = torch.tensor([c + [0] * (T - len(c)) for c in completions])
        with torch.no_grad():
            logits = completion_logits(
                trainer.model, prompt_ids, padded, trainer.temperature, trainer.model.config.vocab_size
            )
        lp = torch.log_softmax(logits, -1).gather(-1, padded[..., None])[..., 0]
        lp = lp + noise * torch.randn(lp.shape, generator=g)
        record[:] = [lp[i, : len(c)].tolist() for i, c in enumerate(completions)]
        record[0][0] = None  # vLLM's way of saying it could not score a token
        return completions, [list(r) for r in record]

    trainer._generate_single_turn = generate
    return record


CONTRACT = [  # loss_type, level, agg, support, chunk
    ("dapo", "token", "token-mean", "rest", 0),
    ("bnpo", "token", "token-mean", "rest", 0),
    ("grpo", "token", "seq-mean-token-mean", "rest", 0),
    ("dr_grpo", "token", "seq-mean-token-sum-norm", "rest", 0),
    ("dapo", "sequence", "token-mean", "rest", 0),
    ("dapo", "token", "token-mean", "paper", 0),
    ("dapo", "token", "token-mean", "rest", 7),
]
DAPO = CONTRACT[0]
CORRECTED = [  # (*CONTRACT row, vllm_importance_sampling_mode, clip_min, clip_max)
    *[(*row, "truncate", None, 2.0) for row in CONTRACT if row[1] == "token"],
    (*CONTRACT[4], "truncate", None, 1.1),  # GSPO averages the noise: a lower cap, so that it binds
    (*DAPO, "token_truncate", 0.8, 2.0),
    (*DAPO, "token_mask", 0.8, 2.0),
    (*DAPO, "sequence_truncate", None, 2.0),
    (*DAPO, "sequence_mask", 0.5, 2.0),
    (*CONTRACT[4], "sequence_mask", None, 2.0),  # GSPO with TRL's sequence mask
]


def one_batch(trainer) -> tuple[dict, list[list[int]]]:
    """TRL's batch for 2 training prompts x 4 completions, and each prompt's ids without padding."""
    prompts = [r["question"] for r in addition.problems("train")[:2]]
    batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(4)])
    unpadded = [ids[m.bool()].tolist() for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
    return batch, unpadded


def check_contract(
    trainer, agg, level, support, sampler=None, mode=None, clip_min=None, cap=None, move: float = 0.05
) -> dict:
    """Generate one batch of 2 prompts x 4, move the trained weights (by N(0, move^2) each; a LoRA model's trained
    weights are its adapters), and assert that the trainer's compute_loss equals troll_loss at the trainer's
    troll_eps (test_loss_equals_troll_loss), the correction's reference built from sampler(batch) -> log mu(y)
    [B, T] (NaN: unscored): troll_loss's own behaviour_logp and is_cap for "truncate" without a floor, else TRL's
    mode's weight (trl_is_weight) as is_weight. Returns the mismatch metrics the reference expects (empty without a
    sampler)."""
    model = trainer.model
    trained = [p for p in model.parameters() if p.requires_grad]
    model.train()
    torch.manual_seed(1)
    batch, unpadded = one_batch(trainer)
    comp, mask = batch["completion_ids"], batch["completion_mask"].bool()
    V = model.config.vocab_size
    with torch.no_grad():
        q_logits = completion_logits(model, unpadded, comp, 0.7, V)  # the weights that generated the batch
        for p in trained:
            p.add_(move * torch.randn_like(p))

    loss = trainer.compute_loss(model, batch)
    loss.backward()
    got = [p.grad.clone() for p in trained]
    model.zero_grad()

    old = sparsify(q_logits.flatten(0, 1), comp.flatten(), k=64, delta=1e-5)
    correction, expected, weight_metrics = {}, {}, {}
    if sampler is not None:
        lq_y = torch.log_softmax(q_logits, -1).gather(-1, comp[..., None])[..., 0]
        mu = sampler(batch)
        scored = ~torch.isnan(mu)
        behaviour = torch.where(scored, mu, lq_y)
        if mode == "truncate" and not clip_min:  # the plain loop's correction, inside troll_loss
            correction = dict(behaviour_logp=behaviour, is_cap=cap)
        else:  # TRL's mode, from the loss's q(y)
            old_y = old.logp_at(comp.flatten()).view(comp.shape)
            weight, weight_metrics = trl_is_weight(old_y - behaviour, mask, mode, cap, clip_min or 0.0, level)
            correction = dict(is_weight=weight)
        expected = mismatch_at(lq_y, mu, mask & scored)
    want, metrics = troll_loss(
        completion_logits(model, unpadded, comp, 0.7, V),
        comp,
        mask,
        batch["advantages"],
        old,
        eps=trainer.args.troll_eps,
        agg=agg,
        norm_len=6,
        level=level,
        support=support,
        **correction,
    )
    metrics |= weight_metrics
    assert batch["num_items_in_batch"] == mask.sum()  # so TRL's dapo normaliser is troll's token mean here
    want.backward()

    assert metrics["frac_active"] > 0.1 and metrics["kl_before_max"] > trainer.args.troll_eps  # the region binds
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-7)
    for g, p in zip(got, trained, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)
    logged = trainer._metrics["train"]
    assert logged["troll/kl_after_max"] == [pytest.approx(metrics["kl_after_max"])]
    assert logged["troll/frac_active"] == [pytest.approx(metrics["frac_active"])]
    if sampler is None:
        assert "troll/mismatch_kl" not in logged and "is_weight_mean" not in metrics  # no sampler log-probs
        return expected
    for key in ("is_weight_mean", "is_weight_max", "is_frac_truncated"):
        assert logged[f"troll/{key}"] == [pytest.approx(metrics[key])]
    for key, value in expected.items():
        assert logged[f"troll/{key}"] == [pytest.approx(value, rel=1e-4, abs=1e-6)]
    return expected | {key: metrics[key] for key in ("is_weight_mean", "is_weight_max", "is_frac_truncated")}


def padded(rows: list[list[float | None]], T: int) -> torch.Tensor:
    """Per-completion log-probs (None: unscored) as [B, T], NaN where unscored, 0 past each row's end."""
    mu = torch.zeros(len(rows), T)
    for i, row in enumerate(rows):
        mu[i, : len(row)] = torch.tensor([math.nan if x is None else x for x in row])
    return mu


@pytest.mark.parametrize(
    ("loss_type", "level", "agg", "support", "chunk", "mode", "clip_min", "cap"),
    [(*row, None, None, None) for row in CONTRACT] + CORRECTED,
)
def test_loss_equals_troll_loss(tokenizer, tmp_path, loss_type, level, agg, support, chunk, mode, clip_min, cap):
    """TRL's compute_loss on a generated batch equals troll_loss on full logits (the reference: q from the
    unpadded prompts before a weight perturbation), in value and every gradient; chunk > 0: TRL's side runs the
    chunked output layer, old-policy pass included. With `mode`, the sampler reports log-probs that differ from
    q (inject_sampler) and the reference is troll_loss weighted from them (log q(y) where the sampler gave None) in
    that mode, with floor clip_min and cap; the mismatch metrics are logged as mismatch_at computes them."""
    settings = {"vllm_importance_sampling_mode": mode, "vllm_importance_sampling_clip_min": clip_min} if mode else {}
    settings |= {"vllm_importance_sampling_clip_max": cap} if mode else {}
    trainer = make_trainer(
        tokenizer,
        tmp_path,
        loss_type=loss_type,
        importance_sampling_level=level,
        troll_support=support,
        troll_logits_chunk=chunk,
        **settings,
    )
    sampled = inject_sampler(trainer) if mode else None
    sampler = (lambda batch: padded(sampled, batch["completion_ids"].shape[1])) if mode else None
    out = check_contract(trainer, agg, level, support, sampler, mode, clip_min, cap)
    if mode:  # the weight is real: some tokens re-weighted, some bounded (capped, floored or masked)
        assert out["is_weight_max"] > 1.0 and 0 < out["is_frac_truncated"] < 1 and out["mismatch_kl"] > 0.01


def lora(rank: int = 8) -> Any:
    """PEFT's LoRA on every linear layer of the decoder, no dropout (so the loss scores the policy that sampled)."""
    from peft import LoraConfig

    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0)


def test_peft_config_loss_equals_troll_loss(tokenizer, tmp_path):
    """With peft_config, TRL wraps the model in LoRA adapters, and the contract holds for them: with the adapters
    moved away from the ones that generated the batch, compute_loss equals troll_loss in value and in every
    adapter's gradient, and nothing else has a gradient. (Adapters on the decoder's linear layers move this tiny
    model's outputs less than moving every weight: a larger move and a tighter region, so that it binds.)"""
    pytest.importorskip("peft")
    trainer = make_trainer(tokenizer, tmp_path, peft_config=lora(), troll_eps=0.01)
    names = [name for name, p in trainer.model.named_parameters() if p.requires_grad]
    assert names and all(".lora_A." in name or ".lora_B." in name for name in names)
    check_contract(trainer, "token-mean", "token", "rest", move=0.3)
    assert all(p.grad is None for p in trainer.model.parameters() if not p.requires_grad)


def test_peft_config_trains_only_the_adapters(tokenizer, tmp_path):
    """Two TROLL steps with peft_config: every base weight is bit-identical afterwards, every adapter has moved,
    and each step's update stays in the trust region."""
    pytest.importorskip("peft")
    eps = 0.01  # as in test_peft_config_loss_equals_troll_loss
    settings = dict(max_steps=2, num_iterations=2, learning_rate=5e-2, troll_eps=eps)
    trainer = make_trainer(tokenizer, tmp_path, peft_config=lora(), **settings)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(h["troll/kl_after_max"] <= eps + 1e-5 for h in logs)
    assert max(h["troll/kl_before_max"] for h in logs) > eps  # the second pass over a batch is projected back
    moved = {name: not torch.equal(p, trainer.model.get_parameter(name)) for name, p in before.items()}
    adapters = {name for name in moved if ".lora_" in name}
    assert len(adapters) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
    assert all(moved[name] for name in adapters) and not any(moved[name] for name in moved.keys() - adapters)


def kl_at_a_fresh_batch(trainer: TROLLGRPOTrainer) -> float:
    """The largest per-token KL(p || q), before any update, between the policy the loss scores (the model in train
    mode, as during training) and the old policy q stored with a freshly generated batch (troll_loss's
    kl_before_max): 0 when they are one policy. The adapters are moved first (PEFT starts B at 0, where the
    adapters' output, dropped out or not, is 0)."""
    model = trainer.model
    model.train()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in (p for p in model.parameters() if p.requires_grad):
            p.add_(0.3 * torch.randn_like(p))
    batch, unpadded = one_batch(trainer)
    comp, mask = batch["completion_ids"], batch["completion_mask"].bool()
    V = model.config.vocab_size
    with torch.no_grad():
        logits = completion_logits(model, unpadded, comp, 0.7, V)
        _, metrics = troll_loss(logits, comp, mask, batch["advantages"], old_policy(batch, V), eps=EPS)
    return metrics["kl_before_max"]


def test_lora_dropout_is_refused_as_the_policy_it_scores_is_not_the_one_that_sampled(tokenizer, tmp_path, monkeypatch):
    """PEFT's lora_dropout makes every forward pass a different random policy, so the loss's policy differs from the
    sampler's and from the stored q before any update (the plain loop's adapters have none, troll.lora): measured
    at a fresh batch, the KL between them is nonzero with lora_dropout=0.1 and 0 without. TROLLGRPOTrainer refuses
    lora_dropout > 0 (in peft_config, or a PeftModel's adapter), naming it, unless disable_dropout=True, where TRL
    sets every dropout to 0 and the KL is 0 again."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    dropped = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.1)
    with pytest.raises(ValueError, match=r"lora_dropout=0.1\): the policy the loss scores would differ"):
        make_trainer(tokenizer, tmp_path, peft_config=dropped)
    wrapped = get_peft_model(tiny_llama(tokenizer, hidden=64, layers=2, heads=2, seed=0), dropped)
    assert sum(isinstance(m, torch.nn.Dropout) and m.p == 0.1 for m in wrapped.modules()) == 2 * 7  # as PEFT builds
    with pytest.raises(ValueError, match="lora_dropout"):
        make_trainer(tokenizer, tmp_path, model=wrapped)

    assert kl_at_a_fresh_batch(make_trainer(tokenizer, tmp_path, peft_config=lora())) < 1e-6  # no dropout: one policy
    off = make_trainer(tokenizer, tmp_path, peft_config=dropped, disable_dropout=True)
    assert not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in off.model.modules())
    assert kl_at_a_fresh_batch(off) < 1e-6
    monkeypatch.setattr(trl_integration, "check_no_lora_dropout", lambda *_: None)  # what the refusal keeps out
    assert kl_at_a_fresh_batch(make_trainer(tokenizer, tmp_path, peft_config=dropped)) > 1e-3


@pytest.mark.parametrize("support", ["rest", "paper"])
@pytest.mark.parametrize("loss_type, level", [("dapo", "token"), ("grpo", "token"), ("dr_grpo", "token"),
                                              ("dapo", "sequence")])  # fmt: skip
def test_a_step_without_signal_leaves_the_weights_bit_identical(tokenizer, tmp_path, loss_type, level, support):
    """Every reward equal, so every advantage 0: TRL's first optimiser step on the TROLL loss leaves every weight
    bit-identical, as it does with TRL's own loss (AdamW turns a gradient of rounding noise into a full step)."""
    settings = dict(max_steps=1, loss_type=loss_type, troll_support=support, importance_sampling_level=level)
    trainer = make_trainer(tokenizer, tmp_path, reward=lambda completions, **_: [1.0] * len(completions), **settings)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert log["troll/frac_no_signal"] == 1.0
    assert all(torch.equal(p, trainer.model.get_parameter(name)) for name, p in before.items())


def vllm_first_batch(out: str) -> dict:
    """The contract through TRL's vLLM colocate path (worker of test_vllm_colocate_first_batch): the engine loads
    the tiny model from disk, samples batch 0 after TRL's first weight sync (the same weights), and the batch's
    "sampling_per_token_logps" are vLLM's. Returns check_contract's metrics and the engine's dtype."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from troll.models.tiny import save_tiny

    made = train_tokenizer(addition.corpus(), vocab_size=300)
    path = save_tiny(tiny_llama(made, hidden=64, layers=2, heads=2, seed=0), made, Path(out) / "tiny")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    trainer = make_trainer(tokenizer, Path(out) / "run", model=model, **VLLM)
    result = check_contract(
        trainer, "token-mean", "token", "rest", lambda batch: batch["sampling_per_token_logps"], "truncate", None, 2.0
    )
    result["dtype"] = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
    return result


def run_worker(tmp_path: Path, call: str) -> dict:
    """`test_trl.<call>` in a new process (the engine initialises torch.distributed in its process), in vLLM's
    in-process mode with a 1 GiB KV cache; returns what it returns."""
    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); import test_trl; "
    code += f"json.dump(test_trl.{call}, open(sys.argv[1] + '/out.json', 'w'))"
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env |= {"OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((tmp_path / "out.json").read_text())


VLLM = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=128, vllm_gpu_memory_utilization=0.3)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_colocate_first_batch(tmp_path):
    """TRL's own vLLM path (colocate, the installed vLLM CPU build): the loss equals troll_loss with
    behaviour_logp = vLLM's log-probs, and the mismatch logged is vLLM's bf16 against the trainer's float32."""
    pytest.importorskip("vllm")
    out = run_worker(tmp_path, "vllm_first_batch(sys.argv[1])")
    assert out["dtype"] == "torch.bfloat16"  # vLLM's "auto" for a float32 checkpoint; the trainer runs float32
    assert 1e-3 < out["mismatch_logratio_absmax"] < 1.0 and out["mismatch_kl"] > 0
    assert out["is_weight_max"] > 1.0  # the correction acts on vLLM's real mismatch


PROBE = torch.randint(270, (32,), generator=torch.Generator().manual_seed(1234))  # ids of the tiny tokenizer


def engine_probe(llm: Any) -> torch.Tensor:
    """The engine's log-probs of PROBE[1:] given its prefix (prompt log-probs: temperature 1, no mask), as
    troll.models.vllm_engine.VLLMGenerator.probe_logprobs scores them."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, flat_logprobs=True)
    flat = llm.generate([{"prompt_token_ids": PROBE.tolist()}], params, use_tqdm=False)[0].prompt_logprobs
    return torch.tensor([flat.logprobs[s] for s in flat.start_indices[1:]])


@torch.no_grad()
def model_probe(model: Any) -> torch.Tensor:
    """The training model's log-probs of PROBE[1:] given its prefix, the way engine_probe scores them."""
    logits = model(input_ids=PROBE[None]).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, PROBE[1:, None])[:, 0]


def vllm_colocate_steps(out: str, adapters: bool) -> dict:
    """Two TROLL steps through TRL's vLLM colocate path on the CPU build (worker of test_vllm_colocate_trains), the
    whole model or LoRA adapters (peft_config), with a float32 engine: TRL builds it with vLLM's dtype "auto"
    (bf16 for this checkpoint), which the CPU backend repacks only on CPUs with bf16 matrix instructions (AVX512-BF16,
    AMX); float32 layers it repacks wherever oneDNN runs, so TRL's own sync fails here on any x86 CPU. Every sync
    is probed: the engine's log-probs of PROBE before and after it against the trainer's. Returns per sync its step,
    error (the engine after it against the trainer), stale (the engine before it against the trainer) and seconds;
    the global step at each generation; the logged mismatch per step; which parameters changed; the engine's
    dtype; the training time; and what TRL's own sync (VLLMGeneration.sync_weights) then does."""
    import functools
    import time
    import traceback

    import trl.generation.vllm_generation as trl_vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from troll.models.tiny import save_tiny

    made = train_tokenizer(addition.corpus(), vocab_size=300)
    path = save_tiny(tiny_llama(made, hidden=64, layers=2, heads=2, seed=0), made, Path(out) / "tiny")
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    trl_vllm.LLM = functools.partial(trl_vllm.LLM, dtype="float32")  # the engine TRL builds (docstring)
    settings = dict(max_steps=2, learning_rate=5e-2 if adapters else 1e-2, troll_eps=0.01 if adapters else EPS)
    trainer = make_trainer(tokenizer, Path(out) / "run", model, lora() if adapters else None, **settings, **VLLM)
    gen = trainer.vllm_generation
    syncs, generations, sync, generate = [], [], gen.sync_weights, gen.generate

    def probed_sync() -> None:
        stale, start = engine_probe(gen.llm), time.perf_counter()
        sync()
        seconds, ref = time.perf_counter() - start, model_probe(trainer.model)
        error, stale = (engine_probe(gen.llm) - ref).abs().max().item(), (stale - ref).abs().max().item()
        syncs.append(dict(step=trainer.state.global_step, error=error, stale=stale, seconds=seconds))

    def counted_generate(*args: Any, **kwargs: Any) -> Any:
        generations.append(trainer.state.global_step)
        return generate(*args, **kwargs)

    gen.sync_weights, gen.generate = probed_sync, counted_generate
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    logs = [h for h in trainer.state.log_history if "loss" in h]
    changed = {name: not torch.equal(p, trainer.model.get_parameter(name)) for name, p in before.items()}
    try:  # last: with LoRA, TRL's sync merges the adapters into the base first, and fails before it unmerges
        type(gen).sync_weights(gen)  # TRL's own
        trl_sync = "ok"
    except Exception as e:  # recorded, with the frame that raised, and asserted on by the test
        frame = traceback.extract_tb(e.__traceback__)[-1]
        trl_sync = f"{type(e).__name__}: {e} ({Path(frame.filename).name}:{frame.lineno}, {frame.name})"
    return dict(
        syncs=syncs,
        generations=generations,
        mismatch=[h["troll/mismatch_logratio_absmax"] for h in logs],
        changed=changed,
        dtype=str(gen.llm.llm_engine.model_config.dtype),
        seconds=seconds,
        trl_sync=trl_sync,
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
def test_vllm_colocate_trains(tmp_path, adapters):
    """Two TROLL steps through TRL's vLLM colocate path on the CPU build, where TRL's own weight sync fails on the
    repacked layers: TROLLGRPOTrainer's sync (vLLM's in-place reload_weights) runs before each generation, and
    after the first update the engine follows the trainer: its probe log-probs, off by 0.1 or more before the
    sync, match the trainer's to float32 precision after it, and step 2's samples show the same small mismatch as
    step 1's. With peft_config only the adapters train and the engine gets them merged."""
    pytest.importorskip("vllm")
    out = run_worker(tmp_path, f"vllm_colocate_steps(sys.argv[1], {adapters})")
    assert out["dtype"] == "torch.float32"
    assert "'Parameter' object has no attribute 'weight_loader'" in out["trl_sync"], out["trl_sync"]
    assert out["generations"] == [0, 1] and [s["step"] for s in out["syncs"]] == [0, 1]  # a sync before each
    first, second = out["syncs"]
    assert first["stale"] < 1e-3 and first["error"] < 1e-3  # the engine loaded these weights from disk
    assert second["stale"] > 0.1 and second["error"] < 1e-3  # the update moved the model; the sync moved the engine
    assert all(m < 1e-3 for m in out["mismatch"]), out["mismatch"]  # step 2 sampled with the updated weights
    adapter = {name: moved for name, moved in out["changed"].items() if ".lora_" in name}
    base = {name: moved for name, moved in out["changed"].items() if ".lora_" not in name}
    assert bool(adapter) == adapters and all(adapter.values())
    assert all(base.values()) if not adapters else not any(base.values())


@pytest.mark.parametrize("mode", ["truncate", "sequence_truncate"])
def test_corrected_loss_by_hand_at_the_old_policy(tokenizer, tmp_path, mode):
    """Before any update p = q: every ratio is 1 and nothing is projected, so the trainer's dapo loss is
    token-mean(-w A), with w written out here from a float64 log-softmax of the model (q) and TRL's batch field
    (mu; the unscored token takes w = 1): min(q(y) / mu(y), 2) per token, or min(prod_t q / mu, 2) per response."""
    trainer = make_trainer(tokenizer, tmp_path, vllm_importance_sampling_mode=mode)
    inject_sampler(trainer)
    model = trainer.model
    model.train()
    torch.manual_seed(1)
    batch, unpadded = one_batch(trainer)
    comp, mask, adv = batch["completion_ids"], batch["completion_mask"].bool(), batch["advantages"].double()
    with torch.no_grad():
        logits = completion_logits(model, unpadded, comp, 0.7, model.config.vocab_size).double()
        loss = trainer.compute_loss(model, batch)
    lq = torch.log_softmax(logits, -1).gather(-1, comp[..., None])[..., 0]
    mu = batch["sampling_per_token_logps"].double()
    assert mu[mask].isnan().sum() == 1  # the token the sampler could not score
    log_rho = torch.where(mask & ~mu.isnan(), lq - mu, 0.0)
    if mode == "sequence_truncate":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(log_rho)
    w = log_rho.exp().clamp(max=2.0)
    assert 0 < int((w[mask] == 2.0).sum()) < int(mask.sum())  # the cap binds, and not everywhere
    want = -(w * adv[:, None])[mask].sum() / mask.sum()
    assert float(loss) == pytest.approx(float(want), abs=1e-6)
    assert abs(float(want) - float(-(adv[:, None].expand_as(w))[mask].mean())) > 1e-2  # w changed the loss


def test_correction_off_keeps_the_plain_loss_and_logs_the_mismatch(tokenizer, tmp_path):
    """vllm_importance_sampling_correction=False with sampler log-probs: the loss is the uncorrected troll_loss
    (no is_* metrics), and the mismatch is logged all the same."""
    trainer = make_trainer(tokenizer, tmp_path, vllm_importance_sampling_correction=False)
    inject_sampler(trainer)
    trainer.model.train()
    batch, _ = one_batch(trainer)
    assert "sampling_per_token_logps" in batch and "troll_behaviour_logp" not in batch
    trainer.compute_loss(trainer.model, batch)
    logged = trainer._metrics["train"]
    assert "troll/is_weight_mean" not in logged and logged["troll/mismatch_kl"][0] > 0.01


def test_a_few_steps_train_within_the_region(tokenizer, tmp_path):
    trainer = make_trainer(tokenizer, tmp_path, max_steps=4, num_iterations=2, learning_rate=5e-2)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 4 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    # the second pass over each batch starts outside the region and is projected back onto it
    assert max(h["troll/kl_before_max"] for h in logs) > EPS
    assert max(h["troll/frac_active"] for h in logs) > 0
    assert all(h["troll/kl_after_max"] <= EPS + 1e-5 for h in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))


def test_version_range_is_enforced():
    check_trl_version("1.16.0")
    for bad in ("1.15.2", "1.17.0", "2.0.0"):
        with pytest.raises(ImportError, match=f"trl{TRL_VERSIONS}.*found trl {bad}.*pip install"):
            check_trl_version(bad)
    with pytest.raises(ImportError, match="needs TRL: pip install"):
        check_trl_version(None)


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("beta", 0.04),
        ("loss_type", "cispo"),
        ("top_entropy_quantile", 0.2),
        ("entropy_coef", 0.01),
        ("off_policy_mask_threshold", 0.5),
        ("epsilon", 0.28),
        ("epsilon_high", 0.28),
        ("epsilon_high", 0.2),  # set at all: it is not TRL's default (None)
        ("vllm_importance_sampling_mode", "per_token"),
        ("vllm_importance_sampling_clip_max", 0.5),
        ("vllm_importance_sampling_clip_min", 1.5),
        ("troll_eps", 0.0),
        ("troll_support", "dense"),
        ("troll_logits_chunk", -1),
    ],
)
def test_incompatible_settings_raise(tmp_path, setting, value):
    with pytest.raises(ValueError, match=setting):
        TROLLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{setting: value})


def test_a_clip_setting_names_troll_eps(tmp_path):
    """epsilon / epsilon_high would do nothing with TROLL: refused, naming the setting that plays their role."""
    for setting in ("epsilon", "epsilon_high"):
        with pytest.raises(ValueError, match=f"{setting} .*troll_eps; got 0.28"):
            TROLLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True, **{setting: 0.28})


def test_correction_defaults(tmp_path):
    """On by default as in TRL's GRPO; truncated at the plain loop's cap; TRL's defaults for epsilon accepted."""
    args = TROLLConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert args.vllm_importance_sampling_correction is True
    assert (args.vllm_importance_sampling_mode, args.vllm_importance_sampling_clip_max) == ("truncate", 2.0)
    assert args.vllm_importance_sampling_clip_min is None and (args.epsilon, args.epsilon_high) == (0.2, None)


def test_needs_a_troll_config(tokenizer, tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="TROLLConfig"):
        TROLLGRPOTrainer(
            model=tiny_llama(tokenizer, hidden=64, layers=2, heads=2),
            reward_funcs=[parity],
            args=GRPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True),
            train_dataset=Dataset.from_list([{"prompt": "1+2="}]),
            processing_class=tokenizer,
        )


WORKER = """
import json, runpy, sys
import torch
main = runpy.run_path(sys.argv[1])["main"]
trainer = main(sys.argv[3:])
acc = trainer.accelerator
flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
logs = [h for h in trainer.state.log_history if "loss" in h]
out = {"rank": acc.process_index, "world": acc.num_processes, "backend": str(acc.state.backend),
       "prompts": [trainer._buffered_inputs[0]["prompt_ids"].tolist()],
       "params": flat.double().sum().item(), "params_sq": flat.double().square().sum().item(),
       "kl_after_max": [h["troll/kl_after_max"] for h in logs],
       "kl_before_max": [h["troll/kl_before_max"] for h in logs]}
with open(f"{sys.argv[2]}/rank{acc.process_index}.json", "w") as f:
    json.dump(out, f)
"""


@pytest.mark.slow
def test_two_processes_gloo(tmp_path, gsm8k_dir):
    """`accelerate launch --multi_gpu --num_processes 2` of the example script with --use_cpu: torchrun starts two
    processes, accelerate picks DDP over gloo; the ranks train on different prompts and end with identical weights.
    (`accelerate launch --cpu --num_processes 2` would start one process: its multi-CPU path needs mpirun.)"""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    cmd += ["--num_machines", "1"]
    cmd += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517", str(worker)]
    cmd += [str(ROOT / "examples" / "trl_gsm8k.py"), str(tmp_path), "--tiny", "--data", str(gsm8k_dir)]
    cmd += ["--limit", "32", "--max_steps", "2", "--use_cpu", "--output_dir", str(tmp_path / "run")]
    cmd += ["--max_completion_length", "8", "--num_generations", "4", "--per_device_train_batch_size", "4"]
    # a large step, so that the second pass over a batch really leaves the trust region
    cmd += ["--num_iterations", "2", "--learning_rate", "2e-1", "--disable_tqdm", "true", "--save_strategy", "no"]
    cmd += ["--bf16", "false"]
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2] and ranks[0]["backend"] == "gloo"
    assert ranks[0]["prompts"] != ranks[1]["prompts"]
    assert ranks[0]["params"] == ranks[1]["params"] and ranks[0]["params_sq"] == ranks[1]["params_sq"]
    assert max(ranks[0]["kl_before_max"]) > EPS and max(ranks[0]["kl_after_max"]) <= EPS + 1e-5
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()


def test_example_reward_reads_text_and_chat_completions():
    correctness = runpy.run_path(str(ROOT / "examples" / "trl_gsm8k.py"))["correctness"]
    chat = [{"role": "assistant", "content": "3 + 1 = 4\n#### 4"}]
    assert correctness([chat, "#### 5", "so 1,200 apples"], gold=["4", "4", "1200"]) == [1.0, 0.0, 1.0]
