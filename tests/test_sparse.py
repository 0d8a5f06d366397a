"""Sparse supports (troll/sparse.py) against a plain per-row reference and dense full-vocabulary math."""

import math

import numpy as np
import pytest
import torch

from troll.sparse import (
    TAIL_PROB,
    cat_rows,
    sparsify,
    sparsify_topk,
    support_kl,
    tail_error_bound,
    union,
)


def reference_sparsify(logits: np.ndarray, tok: int, k: int, delta: float, tau: float = TAIL_PROB):
    """One row, written out the slow obvious way: returns {id: log p_hat} and the tail log-prob."""
    logp = logits - np.logaddexp.reduce(logits)
    order = np.argsort(-logp, kind="stable")
    kept, mass = [], 0.0
    for i in order[:k]:
        if mass >= 1 - delta:
            break
        kept.append(int(i))
        mass += math.exp(logp[i])
    if tok not in kept:
        kept.append(tok)
    z = sum(math.exp(logp[i]) for i in kept) + (len(logits) - len(kept)) * tau
    return {i: logp[i] - math.log(z) for i in kept}, math.log(tau) - math.log(z)


def lift(s, row: int) -> torch.Tensor:
    """A SparseDist row as a dense [V] log-prob vector (kept values, tail value elsewhere)."""
    out = torch.full((s.vocab_size,), float(s.tail_logp[row]), dtype=torch.float64)
    m = s.mask[row]
    out[s.idx[row][m]] = s.logp[row][m].double()
    return out


def peaked_logits(n: int, v: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=dtype)
    top = torch.randint(0, v, (n, 6), generator=g)
    return x.scatter_add(-1, top, 20 + 3 * torch.rand(n, 6, generator=g, dtype=dtype))


@pytest.mark.parametrize("k,delta", [(4, 1e-5), (8, 1e-3), (64, 1e-5), (3, 0.2)])
def test_matches_reference_rule(k, delta):
    logits = peaked_logits(12, 40, seed=k)
    logits[:4] = torch.randn(4, 40, dtype=torch.float64) * 0.5  # flat rows hit the K cap
    tok = torch.randint(0, 40, (12,))
    s = sparsify(logits, tok, k=k, delta=delta)
    assert s.idx.shape == (12, min(k, 40) + 1)
    for r in range(12):
        ref, ref_tail = reference_sparsify(logits[r].numpy(), int(tok[r]), k, delta)
        got = {int(i): float(v) for i, v, m in zip(s.idx[r], s.logp[r], s.mask[r], strict=True) if m}
        assert got.keys() == ref.keys()
        assert all(abs(got[i] - ref[i]) < 1e-12 for i in ref)
        assert abs(float(s.tail_logp[r]) - ref_tail) < 1e-12
        assert int(s.tail_count[r]) == 40 - len(ref)
        assert abs(float(lift(s, r).exp().sum()) - 1.0) < 1e-12
    torch.testing.assert_close(s.to_dense(), torch.stack([lift(s, r) for r in range(12)]), atol=0, rtol=0)


def test_peaked_rows_keep_few_tokens_and_sampled_token_is_always_kept():
    logits = peaked_logits(64, 1000, seed=1)
    tok = torch.randint(0, 1000, (64,))  # mostly unlikely tokens
    s = sparsify(logits, tok)
    assert s.size.max() <= 7 + 1 and s.size.min() >= 2
    assert ((s.idx == tok[:, None]) & s.mask).any(-1).all()


def test_logits_and_logprobs_agree_and_gradient_flows():
    logits = peaked_logits(5, 30, seed=2)
    tok = torch.arange(5)
    a, b = sparsify(logits + 5.0, tok, k=8), sparsify(torch.log_softmax(logits, -1), tok, k=8)
    torch.testing.assert_close(a.logp, b.logp)
    x = logits.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda y: (sparsify(y, tok, k=8).logp, sparsify(y, tok, k=8).tail_logp), (x,))


def test_topk_path_equals_full_path():
    """The behaviour policy from an engine's top-K log-probs equals sparsifying its full logits."""
    logits = peaked_logits(10, 200, seed=3)  # float64: no rounding flips at the 1 - delta boundary
    tok = torch.randint(0, 200, (10,))
    logp = torch.log_softmax(logits, -1)
    top_logp, top_idx = logp.topk(20, -1)
    perm = torch.randperm(20)  # engines need not return them sorted
    s_top = sparsify_topk(
        top_logp[:, perm], top_idx[:, perm], logp.gather(-1, tok[:, None])[:, 0], tok, 200, delta=1e-5
    )
    s_full = sparsify(logits, tok, k=20, delta=1e-5)
    for r in range(10):
        torch.testing.assert_close(lift(s_top, r), lift(s_full, r), atol=1e-12, rtol=0)


def test_union_matches_dense_lift_and_kl_counts_the_tail():
    v = 60
    new_logits, old_logits = peaked_logits(8, v, seed=4), peaked_logits(8, v, seed=5)
    tok = torch.randint(0, v, (8,))
    new, old = sparsify(new_logits, tok, k=5), sparsify(old_logits, tok, k=5)
    u = union(new, old)
    assert (u.tail_count > 0).all()
    # compacted: live slots first, in id order, and no column that is padding in every row
    assert u.idx.shape[1] == int(u.mask.sum(-1).max()) < new.idx.shape[1] + old.idx.shape[1]
    assert (u.mask.long().diff(dim=-1) <= 0).all()
    assert ((u.idx.diff(dim=-1) > 0) | ~u.mask[:, 1:]).all()
    dense_kl = []
    for r in range(8):
        p, q = lift(new, r), lift(old, r)
        m = u.mask[r]
        ids = u.idx[r][m]
        assert len(set(ids.tolist())) == len(ids)
        assert set(ids.tolist()) == set(new.idx[r][new.mask[r]].tolist()) | set(old.idx[r][old.mask[r]].tolist())
        torch.testing.assert_close(u.lp[r][m].double(), p[ids])
        torch.testing.assert_close(u.lq[r][m].double(), q[ids])
        dense_kl.append(float((p.exp() * (p - q)).sum()))
    torch.testing.assert_close(support_kl(u), torch.tensor(dense_kl, dtype=torch.float64), atol=1e-12, rtol=1e-10)


def test_kl_equals_dense_when_nothing_dropped():
    lp, lq = torch.randn(6, 15, dtype=torch.float64), torch.randn(6, 15, dtype=torch.float64)
    tok = torch.zeros(6, dtype=torch.long)
    u = union(sparsify(lp, tok, k=15, delta=0.0), sparsify(lq, tok, k=15, delta=0.0))
    assert (u.tail_count == 0).all()
    p, q = torch.log_softmax(lp, -1), torch.log_softmax(lq, -1)
    torch.testing.assert_close(support_kl(u), (p.exp() * (p - q)).sum(-1), atol=1e-14, rtol=0)


def test_sparsification_error_within_theorem_bound():
    """KL(p || p_hat) <= log(m + c tau) + (1 - m) log((1 - m) / tau) <= delta log(delta / tau) + c tau.

    With the paper's K = 64 and delta = 1e-5 this is about 1.6e-4 (ALGORITHM.md section 3)."""
    v, delta = 5000, 1e-5
    logits = peaked_logits(32, v, seed=6)
    logits[:8] = torch.randn(8, v, dtype=torch.float64) * 2 + peaked_logits(8, v, seed=7) * 0.6  # K cap binds
    tok = torch.randint(0, v, (32,))
    s = sparsify(logits, tok, k=64, delta=delta)
    p = torch.log_softmax(logits, -1)
    for r in range(32):
        kept = s.idx[r][s.mask[r]]
        m = p[r][kept].exp().sum()
        err = float((p[r].exp() * (p[r] - lift(s, r))).sum())
        bound = float(tail_error_bound(m, s.tail_count[r].double()))
        assert 0 <= err <= bound * (1 + 1e-9) + 1e-15
        if m >= 1 - delta:
            assert bound <= delta * math.log(delta / TAIL_PROB) + v * TAIL_PROB + 1e-12
    assert (s.size[:8] == 65).any()  # some rows really hit the cap
    paper = delta * math.log(delta / TAIL_PROB)
    assert abs(paper - 1.6e-4) < 1e-5


def test_masked_logits_are_dropped_into_the_tail():
    logits = peaked_logits(3, 20, seed=8)
    logits[:, 10:] = -math.inf
    s = sparsify(logits, torch.zeros(3, dtype=torch.long), k=64, delta=0.0)
    assert (s.size == 10).all() and (s.tail_count == 10).all() and torch.isfinite(s.logp).all()
    assert (s.idx[s.mask] < 10).all()


def test_errors_name_the_problem():
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(10))
    with pytest.raises(ValueError, match="zero probability"):
        y = x.clone()
        y[1, 4] = -math.inf
        sparsify(y, torch.tensor([0, 4, 0]))
    with pytest.raises(ValueError, match="all -inf row"):
        sparsify(torch.full((2, 4), -math.inf), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sparsify(x, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        sparsify(x, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="lie in"):
        sparsify(x, torch.tensor([0, 10, 0]))
    with pytest.raises(ValueError, match="log-probabilities"):
        sparsify_topk(
            x[:, :4].abs(), torch.zeros(3, 4, dtype=torch.long), x[:, 0], torch.zeros(3, dtype=torch.long), 10
        )
    s = sparsify(x, torch.zeros(3, dtype=torch.long), k=2)
    with pytest.raises(ValueError, match="vocab"):
        union(s, sparsify(torch.randn(3, 12), torch.zeros(3, dtype=torch.long), k=2))
    u = union(s, s)
    off = [int(i) for i in torch.argsort(x[2]) if i != 0][0]  # row 2's least likely token other than y = 0
    with pytest.raises(ValueError, match="not on the support"):
        u.position(torch.tensor([0, 0, off]))


def test_select_and_cat_rows_round_trip():
    logits = peaked_logits(6, 30, seed=9)
    tok = torch.randint(0, 30, (6,))
    s = sparsify(logits, tok, k=5)
    back = cat_rows([s.select(torch.tensor([0, 1, 2])), s.select(torch.tensor([3, 4, 5]))])
    for name in ("idx", "logp", "mask", "tail_logp", "tail_count"):
        assert torch.equal(getattr(back, name), getattr(s, name)), name
    with pytest.raises(ValueError, match="one vocabulary size"):
        cat_rows([s, sparsify(torch.randn(2, 40), torch.zeros(2, dtype=torch.long), k=5)])
