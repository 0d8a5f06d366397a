"""troll.memory: the fixed-cost arithmetic, monotonicity of the micro-batch in GPU memory, and the errors."""

import pytest

from troll.memory import (
    GIB,
    MEASURED,
    Shape,
    candidates,
    fixed_bytes,
    micro_batch_tokens,
    peak_bytes,
    shape,
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
