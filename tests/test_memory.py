"""troll.models.memory: the fixed-cost arithmetic, monotonicity of the micro-batch in GPU memory, and the errors; the
LoRA model's terms, adapter counts against PEFT's, the two phases of a colocated step, and the fits table."""

import dataclasses

import pytest

from troll.models.memory import (
    GIB,
    LORA,
    LORA_MEASURED,
    MEASURED,
    PAPER_MODELS,
    VLLM_ASLEEP,
    VLLM_RUNTIME,
    Shape,
    candidates,
    colocated_micro_batch_tokens,
    fits_cell,
    fits_table,
    fixed_bytes,
    kv_bytes_per_token,
    linear_shapes,
    lora_act_bytes,
    lora_cpu_excess,
    lora_extra_bytes,
    lora_params,
    lora_peak_bytes,
    lora_run,
    micro_batch_tokens,
    peak_bytes,
    phases,
    shape,
    trainer_resident_bytes,
    vllm_fractions,
    vllm_min_bytes,
)

TOY = Shape(params=100_000_000, vocab=1000, act_ckpt=1e5, act_full=1e6, extra=5e8)


def test_fixed_cost_by_hand():
    # 1e8 params: 16 B (float32 weights, grads, exp_avg, exp_avg_sq) + 2 B (bf16 autocast copy) + 1 GiB runtime
    assert fixed_bytes(100_000_000) == 1_800_000_000 + 2**30
    # peak = fixed + extra + act x N (+ share x N x V x 12 unchunked)
    assert peak_bytes(TOY, 1000) == 1_800_000_000 + 2**30 + 500_000_000 + 1e5 * 1000
    assert peak_bytes(TOY, 1000, grad_checkpointing=False) == 1_800_000_000 + 2**30 + 500_000_000 + 1e6 * 1000
    unchunked = peak_bytes(TOY, 1000, chunked=False, completion_share=0.5)
    assert unchunked == pytest.approx(peak_bytes(TOY, 1000) + 0.5 * 1000 * 1000 * 12)
    assert peak_bytes(TOY, 1000, activation_scale=0.5) == pytest.approx(peak_bytes(TOY, 1000) - 0.5e5 * 1000)


def test_candidates_are_powers_of_two_and_one_and_a_half():
    assert candidates(1024, 8192) == [1024, 1536, 2048, 3072, 4096, 6144, 8192]


@pytest.mark.parametrize("name", sorted(MEASURED))
@pytest.mark.parametrize("ckpt", [True, False])
def test_monotone_in_gpu_memory(name, ckpt):
    prev = 0
    for gb in (24, 32, 40, 48, 80, 96, 141):
        try:
            n = micro_batch_tokens(name, gb, 0.3, ckpt)
        except ValueError:
            assert prev == 0, f"{name} fitted on a smaller GPU but not on {gb} GiB"
            continue
        assert n >= prev
        assert peak_bytes(name, n, ckpt) <= 0.7 * gb * GIB * 0.9
        prev = n


def test_result_is_the_largest_that_fits():
    n = micro_batch_tokens(TOY, 24, 0.3)
    budget = 0.7 * 24 * GIB * 0.9
    assert peak_bytes(TOY, n) <= budget
    bigger = [c for c in candidates(1024) if c > n]
    assert not bigger or peak_bytes(TOY, bigger[0]) > budget


def test_chunked_and_checkpointing_never_allow_less():
    for gb in (24, 40, 80):
        assert micro_batch_tokens(TOY, gb) >= micro_batch_tokens(TOY, gb, chunked=False)
        assert micro_batch_tokens(TOY, gb) >= micro_batch_tokens(TOY, gb, grad_checkpointing=False)
        assert micro_batch_tokens(TOY, gb, vllm_fraction=0.5) <= micro_batch_tokens(TOY, gb, vllm_fraction=0.3)


def test_error_when_nothing_fits():
    with pytest.raises(ValueError, match="does not fit"):
        micro_batch_tokens("qwen2.5-1.5b", 8, 0.3)
    huge = Shape(params=10**10, vocab=1000, act_ckpt=1.0, act_full=1.0, extra=0.0)  # 180 GB of fixed cost
    with pytest.raises(ValueError, match="does not fit"):
        micro_batch_tokens(huge, 80, 0.0)
    with pytest.raises(ValueError, match="vllm_fraction"):
        micro_batch_tokens(TOY, 24, 1.0)


def test_names():
    assert shape("Qwen/Qwen2.5-0.5B-Instruct") is MEASURED["qwen2.5-0.5b"]
    assert shape(TOY) is TOY
    with pytest.raises(ValueError, match="no measured shape"):
        shape("llama-7b")


# ----------------------------------------------------------------------------- LoRA and vLLM colocated


def test_adapter_count_is_peft_own_count():
    """lora_params = L x r x sum (in + out) over the adapted linears: PEFT's trainable parameters on the tiny
    stand-in, all-linear (not the output layer) and a named subset."""
    pytest.importorskip("peft")
    from troll.lora import add_adapters
    from troll.models.standin import build

    for rank, targets in ((4, "all-linear"), (8, "q_proj,v_proj")):
        model = add_adapters(build("tiny", vocab=320), rank, 32.0, targets)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert trainable == lora_params("tiny", rank, targets)
    # by hand, Qwen3-8B at rank 32: q, o (4096 + 4096), k, v (4096 + 1024), gate, up, down (4096 + 12288), 36 layers
    assert lora_params("Qwen/Qwen3-8B", 32) == 36 * 32 * (2 * 8192 + 2 * 5120 + 3 * 16384) == 87_293_952
    with pytest.raises(ValueError, match="not linear layers"):
        lora_params("qwen3-8b", 32, "lm_head")


def test_lora_peak_by_hand():
    """The LoRA model's terms add up (module docstring), Qwen3-1.7B at 16,384 tokens, share 0.8, chunk 1,024."""
    P, A, V, H, L = 1_720_574_976, 34_865_152, 151_936, 2048, 28
    s = LORA["qwen3-1.7b"]
    act = L * H * 4 + s.other + s.layer  # checkpointed layer inputs, the rest of the forward, one layer recomputed
    assert lora_act_bytes("qwen3-1.7b") == pytest.approx(act) and 4e5 < act < 5e5
    assert lora_act_bytes("qwen3-1.7b", grad_checkpointing=False) == pytest.approx(L * s.layer + s.other)
    head = 2 * 1024 * V * 4  # the chunked head's two [chunk, V] float32 buffers: 1.245 GB
    assert lora_extra_bytes("qwen3-1.7b", 5000, bf16=False) == head
    assert lora_extra_bytes("qwen3-1.7b", 512, bf16=False) == 2 * 512 * V * 4  # fewer completion rows than chunk
    gpu = 2 * P + 18 * A + GIB + head + 4 * V * H + 2 * 1024 * V + act * 16384  # bf16 base; the head's copies
    assert lora_peak_bytes("Qwen/Qwen3-1.7B", 16384) == pytest.approx(gpu)
    cpu = 4 * P + 16 * A + GIB + head + act * 16384  # float32, no autocast
    assert lora_peak_bytes("qwen3-1.7b", 16384, bf16=False) == pytest.approx(cpu)
    unchunked = lora_peak_bytes("qwen3-1.7b", 1000, bf16=False, chunk=0)
    assert unchunked == pytest.approx(4 * P + 16 * A + GIB + (act + 0.8 * V * 12) * 1000)
    # CPU dress rehearsal (troll.tools.check): head buffers at the completion rows + activations (+ the adapters'
    # grads and AdamW states in step 1; later the previous step's grads are resident when the window opens), or the old
    # policy's pass over the batch (head buffers at its completion rows), whichever is larger
    assert lora_cpu_excess("qwen3-1.7b", 600, 128) == pytest.approx(2 * 128 * V * 4 + act * 600 + 12 * A)
    assert lora_cpu_excess("qwen3-1.7b", 600, 128, first_step=False) == pytest.approx(2 * 128 * V * 4 + act * 600)
    assert lora_cpu_excess("qwen3-1.7b", 173, 32, first_step=False, anchor_rows=128) == pytest.approx(
        2 * 128 * V * 4
    )  # the dress rehearsal's step 2: the old policy's pass is the peak
    assert lora_cpu_excess("qwen3-1.7b", 173, 32, first_step=True, anchor_rows=128) == pytest.approx(
        2 * 32 * V * 4 + act * 173 + 12 * A
    )


def layer_count(name: str) -> int:
    """5 H + 3 (q + 2 kv) + 4 I: the floats one layer saves per token, counted (troll.models.memory's LORA comment)."""
    lin = linear_shapes(name)
    h, q, kv, mlp = lin["q_proj"][0], lin["q_proj"][1], lin["k_proj"][1], lin["gate_proj"][1]
    return 5 * h + 3 * (q + 2 * kv) + 4 * mlp


def test_derived_lora_terms_follow_the_stated_formula():
    """The widths not measured: other = 5 x H x 4, layer = 1.07 x 4 x layer_count; the measured widths lie within
    7% above the same count and at 4.2-5.0 x H x 4 (module docstring)."""
    for name in set(LORA) - set(LORA_MEASURED):
        assert LORA[name].other == 5 * linear_shapes(name)["q_proj"][0] * 4
        assert LORA[name].layer == pytest.approx(1.07 * 4 * layer_count(name))
    for name in LORA_MEASURED:
        assert 1.0 <= LORA[name].layer / (4 * layer_count(name)) <= 1.07
        assert 4.2 <= LORA[name].other / (4 * linear_shapes(name)["q_proj"][0]) <= 5.01


def test_vllm_needs_its_weights_and_a_kv_cache():
    # KV per token: 2 (K, V) x 36 layers x 8 KV heads x 128 x 2 B; vLLM's least share: bf16 weights + runtime + KV
    assert kv_bytes_per_token("qwen3-8b") == 2 * 36 * 8 * 128 * 2 == 147_456
    assert kv_bytes_per_token("meta-llama/Llama-3.1-8B-Instruct") == 2 * 32 * 8 * 128 * 2
    assert vllm_min_bytes("qwen3-8b") == 2 * 8_190_735_360 + VLLM_RUNTIME + 8 * 1536 * 147_456
    lo, hi = vllm_fractions("qwen3-8b", 80, lora_run(32, 0.5))
    assert lo * 80 * GIB >= vllm_min_bytes("qwen3-8b") > (lo - 0.05) * 80 * GIB
    resident = 2 * 8_190_735_360 + 12 * 87_293_952 + GIB
    assert resident + hi * 80 * GIB <= 80 * GIB < resident + (hi + 0.05) * 80 * GIB


def test_phases_and_what_must_hold():
    run = lora_run(32, 0.3)
    p = phases("qwen3-1.7b", 24, 8192, run)
    assert p.generation == pytest.approx(trainer_resident_bytes("qwen3-1.7b", 32) + 0.3 * 24 * GIB)
    assert p.update == pytest.approx(lora_peak_bytes("qwen3-1.7b", 8192) + VLLM_ASLEEP)
    assert p.update_budget == pytest.approx(0.9 * 24 * GIB)
    awake = phases("qwen3-1.7b", 24, 8192, dataclasses.replace(run, sleep=False))
    assert awake.update_budget == pytest.approx(0.9 * 0.7 * 24 * GIB)  # micro_batch_tokens' rule
    assert not p.problems
    assert any("vLLM" in x for x in phases("qwen3-8b", 24, 1024, lora_run(32, 0.3)).problems)  # 16 GB of weights
    assert any("generation" in x for x in phases("qwen3-8b", 24, 1024, lora_run(32, 0.9)).problems)
    # no engine (hf backend): no vLLM share, no vLLM check, the whole GPU less the margin
    alone = phases("qwen3-8b", 24, 1024, lora_run(32, 0.0))
    assert alone.vllm_need == 0 and alone.update_budget == pytest.approx(0.9 * 24 * GIB)


@pytest.mark.parametrize("name", ["qwen3-1.7b", "qwen3-4b", "qwen3-8b", "llama3.1-8b"])
def test_sleep_never_allows_less_and_sizes_are_monotone(name):
    prev = 0
    for gb in (24, 40, 48, 80, 141):
        lo, hi = vllm_fractions(name, gb, lora_run(32, 0.5))
        if lo > hi:
            assert prev == 0
            continue
        run = lora_run(32, lo)
        n = colocated_micro_batch_tokens(name, gb, run)
        assert n >= prev and not phases(name, gb, n, run).problems
        try:
            assert colocated_micro_batch_tokens(name, gb, dataclasses.replace(run, sleep=False)) <= n
        except ValueError:
            pass
        prev = n
    assert prev > 0


def test_full_fine_tuning_sizes_are_unchanged():
    """The full-FT sizing (micro_batch_tokens) and the fits table's full-FT figures stay as they were."""
    assert micro_batch_tokens("qwen2.5-0.5b", 24) == 16384 and micro_batch_tokens("qwen3-0.6b", 24) == 8192
    assert micro_batch_tokens("qwen2.5-1.5b", 80) == 49152


def test_fits_table_is_reproducible():
    table = fits_table()
    assert table.splitlines()[0] == "| model, LoRA rank 32 | 24 GB | 40 GB | 80 GB |"
    assert all(f"| {m} |" in table for m in PAPER_MODELS)
    assert "does not fit" in fits_cell("qwen3-8b", 24)


def test_auto_micro_batch_uses_the_lora_model(monkeypatch):
    import torch

    from troll.base.config import Config
    from troll.run.harness import auto_micro_batch

    gpu = type("Props", (), {"total_memory": 24 * GIB})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    cfg = Config.from_args(["--preset", "gsm8k-qwen3-1.7b-lora", "--micro_batch_tokens", "auto"])
    want = colocated_micro_batch_tokens("Qwen/Qwen3-1.7B", 24, lora_run(32, cfg.vllm_gpu_memory))
    assert auto_micro_batch(cfg, torch.device("cuda")) == want
    full = dataclasses.replace(cfg, lora_rank=0, model="Qwen/Qwen3-0.6B", vllm_gpu_memory=0.3)  # full FT: as before
    assert auto_micro_batch(full, torch.device("cuda")) == micro_batch_tokens("qwen3-0.6b", 24, 0.3) == 8192
