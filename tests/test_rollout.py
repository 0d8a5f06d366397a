"""Rollout backends lock-in: both return what the teacher-forced model says they sampled from.

One tiny Llama (output layer padded 64 rows past the tokenizer, like Qwen; EOS row scaled so
that both EOS- and length-finished samples occur) is built once per module; one vLLM engine
serves every vLLM test. vLLM tests skip only when vllm is not installed.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer
from troll.models.vllm_engine import VLLMGenerator, import_vllm
from troll.policy import completion_logits
from troll.rollout import HFGenerator, Rollouts

PAD_ROWS = 64  # output-layer rows past the tokenizer
MAX_NEW = 24
TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model_dir, tokenizer, prompts): a saved tiny Llama whose output layer is padded past the tokenizer."""
    texts = [
        f"Tom has {a} apples and buys {b} more. How many apples does Tom have? {a + b}"
        for a in range(20)
        for b in range(20)
    ]
    tok = train_tokenizer(texts, vocab_size=512)
    model = tiny_llama(tok, hidden=64, layers=2, heads=2, seed=0, vocab_size=len(tok) + PAD_ROWS)
    with torch.no_grad():  # a larger EOS row makes EOS likely enough that both finish reasons show up
        model.lm_head.weight[tok.eos_token_id] *= 8
    path = save_tiny(model, tok, tmp_path_factory.mktemp("tiny"))
    questions = ["Tom has 3 apples.", "How many apples does Tom have?", "Tom buys 12 more apples and eats 1.", "4"]
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
        for q in questions
    ]
    return path, tok, prompts


@pytest.fixture
def model(tiny):
    """A fresh copy of the saved model (tests may train it)."""
    return AutoModelForCausalLM.from_pretrained(tiny[0])


@pytest.fixture(scope="module")
def engine(tiny):
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        gen = VLLMGenerator(tiny[0], tiny[1], max_model_len=128, max_top_k=8, dtype="float32", seed=0)
    yield gen
    gen.close()


@pytest.fixture(params=["hf", "hf-shared", "vllm"])
def backend(request, tiny, model):
    """(generator, model it must agree with); hf-shared forwards each prompt once for its samples (--share_prompt)."""
    if request.param.startswith("hf"):
        return HFGenerator(model, tiny[1], max_model_len=128, share_prompt=request.param == "hf-shared"), model
    return request.getfixturevalue("engine"), model


def teacher(model, ro: Rollouts, vocab_size: int) -> torch.Tensor:
    """Teacher-forced log pi(. | context) at each completion position: [B, T, V]."""
    with torch.no_grad():
        return completion_logits(model, ro.prompt_ids, ro.completion_ids, ro.temperature, vocab_size).log_softmax(-1)


def test_tiny_tokenizer_and_model(tiny, model):
    path, tok, prompts = tiny
    text = tok.decode(prompts[0])
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert model.dtype == torch.float32 and not model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.shape[0] == len(tok) + PAD_ROWS
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        tiny_llama(tok, vocab_size=len(tok) - 1)


def test_shapes_and_finish_reasons(backend, tiny):
    gen, _ = backend
    tok, prompts = tiny[1], tiny[2]
    n, K = 4, 5
    ro = gen.generate(prompts, n=n, max_new_tokens=MAX_NEW, top_k_logprobs=K, seed=0)
    B, T = len(prompts) * n, ro.completion_ids.shape[1]
    assert len(ro) == B and T <= MAX_NEW
    assert ro.completion_ids.dtype == torch.long and ro.completion_mask.dtype == torch.bool
    assert ro.logprobs.shape == (B, T) and ro.top_idx.shape == ro.top_logp.shape == (B, T, K)
    assert ro.group.tolist() == [i for i in range(len(prompts)) for _ in range(n)]
    assert all(ro.prompt_ids[b] == prompts[b // n] for b in range(B))
    lengths = ro.completion_mask.sum(-1)
    assert (ro.completion_mask == (torch.arange(T) < lengths[:, None])).all()  # right-padded
    last = ro.completion_ids.gather(1, (lengths - 1)[:, None]).squeeze(1)
    is_eos = ro.completion_ids == tok.eos_token_id
    # finished <=> the completion ends with its first EOS; truncated <=> MAX_NEW tokens, no EOS
    assert (last[ro.finished] == tok.eos_token_id).all()
    assert ((is_eos & ro.completion_mask).sum(-1)[ro.finished] == 1).all()
    assert (lengths[~ro.finished] == MAX_NEW).all() and not (is_eos & ro.completion_mask)[~ro.finished].any()
    assert ro.finished.any() and (~ro.finished).any()
    assert (ro.logprobs[~ro.completion_mask] == 0).all() and (ro.logprobs[ro.completion_mask] < 0).all()
    sub = ro.select(torch.tensor([1, 5]))
    assert sub.group.tolist() == [0, 1] and torch.equal(sub.top_idx[1], ro.top_idx[5])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forced(backend, tiny, temperature):
    """Sampled-token and top-K log-probs = log_softmax(mask(logits) / T) of a teacher-forced pass."""
    gen, model = backend
    K = 8
    ro = gen.generate(tiny[2], n=4, max_new_tokens=MAX_NEW, temperature=temperature, top_k_logprobs=K, seed=1)
    assert ro.temperature == temperature
    ref = teacher(model, ro, len(tiny[1]))  # [B, T, V]
    m = ro.completion_mask
    tok_ref = ref.gather(-1, ro.completion_ids[..., None]).squeeze(-1)
    assert (tok_ref - ro.logprobs)[m].abs().max() < TOL
    # Top-K, robust to near-ties: the returned ids carry the returned values under the teacher, and
    # those values are the teacher's K largest.
    assert (ref.gather(-1, ro.top_idx) - ro.top_logp)[m].abs().max() < TOL
    assert (ref.topk(K, -1).values - ro.top_logp)[m].abs().max() < TOL
    same_set = (ref.topk(K, -1).indices.sort(-1).values == ro.top_idx.sort(-1).values).all(-1)[m]
    assert same_set.float().mean() > 0.98


def test_no_top_k_and_seed(backend, tiny):
    gen, _ = backend
    a = gen.generate(tiny[2], n=2, max_new_tokens=8, seed=3)
    b = gen.generate(tiny[2], n=2, max_new_tokens=8, seed=3)
    assert a.top_idx is None and a.top_logp is None
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert not torch.equal(a.completion_ids[0::2], a.completion_ids[1::2])  # the n samples differ


def test_padded_vocab_never_sampled(backend, tiny):
    """64 of the output layer's rows are padding (~15% of the mass unmasked): never sampled or ranked."""
    gen, model = backend
    ro = gen.generate(tiny[2], n=8, max_new_tokens=MAX_NEW, temperature=1.5, top_k_logprobs=8, seed=4)
    V = len(tiny[1])
    assert ro.completion_ids.max() < V and ro.top_idx.max() < V
    with torch.no_grad():  # unmasked, the padded rows would carry real probability
        raw = model(input_ids=torch.tensor([tiny[2][0]])).logits[0, -1].softmax(-1)
    assert raw[V:].sum() > 0.05


def test_tokenizer_larger_than_model_raises(tiny, model):
    path, tok, _ = tiny
    big = copy.deepcopy(tok)
    big.add_tokens([f"<extra_{i}>" for i in range(PAD_ROWS + 1)])
    msg = f"{len(big)} tokens.*only {len(tok) + PAD_ROWS}"
    with pytest.raises(ValueError, match=msg):
        HFGenerator(model, big)
    with pytest.raises(ValueError, match=msg):  # raised before any engine starts
        VLLMGenerator(path, big)


def test_bad_input(backend, tiny):
    gen, _ = backend
    prompts = tiny[2]
    with pytest.raises(ValueError, match="empty batch"):
        gen.generate([], n=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 1 has 200 tokens"):
        gen.generate([prompts[0], [5] * 200], n=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="limit is 8"):
        gen.generate([[5] * 9], n=1, max_new_tokens=120)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        gen.generate([[]], n=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        gen.generate([[5, len(tiny[1])]], n=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        gen.generate(prompts, n=2, max_new_tokens=4, temperature=0.0)


def test_missing_vllm_is_a_clear_import_error(tiny, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match="install_vllm_cpu.sh"):
        import_vllm()
    with pytest.raises(ImportError, match="pip install vllm "):
        VLLMGenerator(tiny[0], tiny[1])


def test_hf_push_is_a_noop(tiny, model):
    gen = HFGenerator(model, tiny[1])
    gen.push_weights(model)
    with pytest.raises(ValueError, match="different model"):
        gen.push_weights(copy.deepcopy(model))


def test_hf_samples_in_eval_mode_and_restores_training(tiny, model):
    """No dropout while sampling, and the KV cache stays on under gradient checkpointing (train mode turns it off)."""
    model.gradient_checkpointing_enable()
    model.train()
    modes = []
    hook = model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    HFGenerator(model, tiny[1]).generate(tiny[2][:1], n=2, max_new_tokens=3, seed=0)
    hook.remove()
    assert modes and not any(modes) and model.training


def test_vllm_top_k_cap(engine, tiny):
    with pytest.raises(ValueError, match="max_top_k=8"):
        engine.generate(tiny[2], n=1, max_new_tokens=4, top_k_logprobs=9)


def test_vllm_weight_push(engine, tiny, model):
    """After an optimiser step the engine is stale (check_sync raises); after push_weights it matches."""
    V = len(tiny[1])
    engine.check_sync(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor(tiny[2][:1])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    try:
        with pytest.raises(RuntimeError, match="did not take effect"):
            engine.check_sync(model)  # a skipped push is caught
        stale = engine.generate(tiny[2], n=2, max_new_tokens=MAX_NEW, seed=5)
        err = teacher(model, stale, V).gather(-1, stale.completion_ids[..., None]).squeeze(-1) - stale.logprobs
        assert err[stale.completion_mask].abs().max() > 1e-2
        engine.push_weights(model)  # runs check_sync itself
        fresh = engine.generate(tiny[2], n=2, max_new_tokens=MAX_NEW, top_k_logprobs=4, seed=5)
        ref = teacher(model, fresh, V)
        err = ref.gather(-1, fresh.completion_ids[..., None]).squeeze(-1) - fresh.logprobs
        assert err[fresh.completion_mask].abs().max() < TOL
        assert (ref.gather(-1, fresh.top_idx) - fresh.top_logp)[fresh.completion_mask].abs().max() < TOL
    finally:  # leave the shared engine as the other tests expect it
        engine.push_weights(AutoModelForCausalLM.from_pretrained(tiny[0]))


def test_vllm_seeded_batch_with_chunked_prefill(engine, tiny):
    """> 4,096 prompt tokens in one call: prefill is chunked (vLLM 0.32 crashed here with per-request seeds)."""
    prompts = [[5 + i % 100] * 120 for i in range(40)]
    a = engine.generate(prompts, n=1, max_new_tokens=2, seed=6)
    b = engine.generate(prompts, n=1, max_new_tokens=2, seed=6)
    assert a.completion_ids.shape == (40, 2) and torch.equal(a.completion_ids, b.completion_ids)


def test_vllm_greedy_equals_transformers_greedy(tiny, engine, model):
    """Both backends' greedy decoding (evaluation, in training and in troll.tools.evaluate) give the same token ids."""
    _, tok, prompts = tiny
    engine.push_weights(model)
    ids = engine.greedy(prompts, 12)
    assert ids == HFGenerator(model, tok, greedy_batch=3).greedy(prompts, 12)  # two batches on the HF side
    assert all(len(x) <= 12 for x in ids)


def test_hf_greedy_stops_at_eos_and_matches_argmax(tiny, model):
    """HF greedy ids: each token is the teacher-forced argmax (padded rows masked), cut after the first EOS."""
    _, tok, prompts = tiny
    ids = HFGenerator(model, tok).greedy(prompts, MAX_NEW)
    V = len(tok)
    for p, c in zip(prompts, ids, strict=True):
        assert 0 < len(c) <= MAX_NEW and tok.eos_token_id not in c[:-1]
        assert len(c) == MAX_NEW or c[-1] == tok.eos_token_id
        logits = completion_logits(model, [p], torch.tensor([c]), 1.0, V)[0]
        assert logits.argmax(-1).tolist() == c


def test_a_shared_prompt_samples_what_each_sample_s_own_prompt_samples(tiny, model, monkeypatch):
    """--share_prompt in generation: the prompt forwarded once and its cache repeated for the n samples draws the
    same tokens from the same seed as transformers' repeated prompts, with the same log-probs."""
    tok, prompts = tiny[1], tiny[2]
    plain = HFGenerator(model, tok, max_model_len=128).generate(prompts, 4, MAX_NEW, 0.9, 5, seed=3)
    prefilled = []
    prefill = HFGenerator._prefill
    monkeypatch.setattr(HFGenerator, "_prefill", lambda self, *a: prefilled.append(a[0].shape) or prefill(self, *a))
    shared = HFGenerator(model, tok, max_model_len=128, share_prompt=True).generate(prompts, 4, MAX_NEW, 0.9, 5, seed=3)
    assert [s[0] for s in prefilled] == [len(prompts)]  # one forward of the 4 prompts, not of 16 copies
    assert torch.equal(shared.completion_ids, plain.completion_ids)
    assert torch.equal(shared.finished, plain.finished) and plain.finished.any() and (~plain.finished).any()
    torch.testing.assert_close(shared.logprobs, plain.logprobs, rtol=0, atol=1e-5)
    torch.testing.assert_close(shared.top_logp, plain.top_logp, rtol=0, atol=1e-5)


def test_sample_draws_the_tokens_generate_draws_without_their_scores(backend, tiny):
    """`sample` (evaluation's sampler: no scores kept) gives each backend's `generate` completions from the same
    seed, in the same layout (sample b = i * n + j), a final EOS included."""
    gen, _ = backend
    prompts = tiny[2]
    ro = gen.generate(prompts, 3, MAX_NEW, 0.9, seed=7)
    lengths = ro.completion_mask.sum(-1).tolist()
    want = [ids[:m] for ids, m in zip(ro.completion_ids.tolist(), lengths, strict=True)]
    got = gen.sample(prompts, 3, MAX_NEW, 0.9, seed=7)
    assert got == want and len({tuple(x) for x in got}) > 1
    assert any(x[-1] in gen.eos_token_ids for x in got) and any(len(x) == MAX_NEW for x in got)


def test_a_shared_prompt_of_one_token_still_gives_n_samples(tiny, model):
    """A prompt with no token before its last has nothing to prefill: transformers repeats it, and each prompt
    still gets its n samples (the shared path once returned one)."""
    tok = tiny[1]
    ro = HFGenerator(model, tok, max_model_len=128, share_prompt=True).generate([[5], tiny[2][0]], 3, 4, seed=0)
    assert len(ro) == 6 and ro.group.tolist() == [0, 0, 0, 1, 1, 1]
