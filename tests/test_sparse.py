"""Sparse supports (troll/sparse.py) against a plain per-row reference and dense full-vocabulary math (float64)."""

import math

import numpy as np
import pytest
import torch

from troll.project import project_dense, project_sparse
from troll.sparse import (
    TAIL_PROB,
    build_support,
    cat_rows,
    gather_logprobs,
    paper_model,
    sparsify,
    sparsify_topk,
    support_kl,
    tail_error_bound,
)


def reference_sparsify(logits: np.ndarray, tok: int, k: int, delta: float):
    """One row, written out the slow obvious way: {id: exact log p}, log of the dropped mass, and the paper's
    renormalised {id: log p_hat} with its tail value."""
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
    dropped = [i for i in range(len(logits)) if i not in kept]
    log_rest = np.logaddexp.reduce(logp[dropped]) if dropped else -math.inf
    z = sum(math.exp(logp[i]) for i in kept) + len(dropped) * TAIL_PROB
    paper = {i: logp[i] - math.log(z) for i in kept}
    return {i: logp[i] for i in kept}, log_rest, paper, math.log(TAIL_PROB) - math.log(z)


def peaked_logits(n: int, v: int, seed: int, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g, dtype=dtype)
    top = torch.randint(0, v, (n, 6), generator=g)
    return x.scatter_add(-1, top, 20 + 3 * torch.rand(n, 6, generator=g, dtype=dtype))


def rows_of_many_entropies(n: int, v: int, seed: int) -> torch.Tensor:
    """Logits whose rows range from near one-hot to near uniform (temperatures 0.05 .. 20)."""
    g = torch.Generator().manual_seed(seed)
    temps = torch.logspace(math.log10(0.05), math.log10(20), n, dtype=torch.float64)[:, None]
    return torch.randn(n, v, generator=g, dtype=torch.float64) * 3 / temps


def as_dict(d, r: int, values: torch.Tensor) -> dict[int, float]:
    return {int(i): float(x) for i, x, m in zip(d.idx[r], values[r], d.mask[r], strict=True) if m}


@pytest.mark.parametrize("k,delta", [(4, 1e-5), (8, 1e-3), (64, 1e-5), (3, 0.2)])
def test_matches_reference_rule(k, delta):
    logits = peaked_logits(12, 40, seed=k)
    logits[:4] = torch.randn(4, 40, dtype=torch.float64) * 0.5  # flat rows hit the K cap
    tok = torch.randint(0, 40, (12,))
    s = sparsify(logits, tok, k=k, delta=delta)
    assert s.idx.shape[1] == int(s.size.max()) <= min(k, 40) + 1  # compacted to the largest kept set
    assert (s.mask.long().diff(dim=-1) <= 0).all()  # live slots first
    paper_logp, paper_tail, count = paper_model(s)
    for r in range(12):
        exact, log_rest, paper, tail = reference_sparsify(logits[r].numpy(), int(tok[r]), k, delta)
        got = as_dict(s, r, s.logp)
        assert got.keys() == exact.keys()
        assert all(abs(got[i] - exact[i]) < 1e-12 for i in exact)
        assert abs(float(s.log_rest[r]) - log_rest) < 1e-12 or log_rest == float(s.log_rest[r]) == -math.inf
        assert all(abs(as_dict(s, r, paper_logp)[i] - paper[i]) < 1e-12 for i in paper)
        assert abs(float(paper_tail[r]) - tail) < 1e-12 and int(count[r]) == 40 - len(exact)
        assert abs(float(s.to_dense(TAIL_PROB)[r].exp().sum()) - 1.0) < 1e-12
        assert abs(float(s.to_dense()[r].exp().sum()) - 1.0) < 1e-12


def test_peaked_rows_keep_few_tokens_and_sampled_token_is_always_kept():
    logits = peaked_logits(64, 1000, seed=1)
    tok = torch.randint(0, 1000, (64,))  # mostly unlikely tokens
    s = sparsify(logits, tok)
    assert s.size.max() <= 7 + 1 and s.size.min() >= 2
    assert ((s.idx == tok[:, None]) & s.mask).any(-1).all()
    assert all(len(set(s.idx[r][s.mask[r]].tolist())) == int(s.size[r]) for r in range(64))


def test_gather_logprobs_equals_dense_and_passes_gradcheck():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 15, generator=g, dtype=torch.float64) * 2
    x[3, 10:] = -math.inf  # masked tokens
    idx = torch.stack([torch.randperm(15, generator=g)[:5] for _ in range(7)])
    idx[3] = torch.arange(5)
    mask = torch.ones(7, 5, dtype=torch.bool)
    mask[0, 3:] = False
    idx[6] = torch.tensor([0, 1, 2, 3, 4])
    x[6, 5:] = -math.inf  # nothing left outside: the rest is empty
    logp, log_rest, entropy = gather_logprobs(x, idx, mask)
    ref = torch.log_softmax(x, -1)
    live_idx = torch.where(mask, idx, idx[:, :1])
    torch.testing.assert_close(logp, ref.gather(-1, live_idx), atol=1e-13, rtol=0)
    rest = torch.ones_like(x, dtype=torch.bool).scatter(-1, live_idx, False)
    torch.testing.assert_close(log_rest, torch.where(rest, ref, -math.inf).logsumexp(-1), atol=1e-13, rtol=0)
    assert log_rest[6] == -math.inf
    torch.testing.assert_close(entropy, -torch.where(ref > -math.inf, ref.exp() * ref, 0.0).sum(-1))
    leaf = x.clone().requires_grad_(True)

    def f(y):
        lp, lr, _ = gather_logprobs(y, idx, mask)
        return torch.where(mask, lp, 0.0), torch.where(torch.isfinite(lr), lr, 0.0)

    assert torch.autograd.gradcheck(f, (leaf,))


def test_rest_mass_is_accurate_in_float32_when_tiny():
    """A rest of 1e-9 (far below float32's 1 - sum resolution of 6e-8) comes out to float32 accuracy, and one
    below float32's range relative to the row's top (1e-87) through the log-space fallback."""
    for rest, v in ((1e-9, 1000), (1e-87, 300)):
        x = torch.zeros(2, v)
        x[:, 1:] = math.log(rest / (v - 1))  # token 0 holds 1 - rest (log-probs up to a constant)
        s = sparsify(x, torch.zeros(2, dtype=torch.long), k=64, delta=1e-5)
        assert s.logp.dtype == torch.float32 and (s.size == 1).all()
        assert abs(float(s.log_rest[0]) - math.log(rest)) < 1e-5 * abs(math.log(rest))
    x = torch.zeros(1, 1000)
    x[0, 1:] = math.log(1e-9 / 999)
    p = torch.zeros(1, 1000, requires_grad=True)
    with torch.no_grad():
        p[0, 1:] = math.log(1e-8 / 999)
    s = build_support(p, torch.tensor([0]), sparsify(x, torch.tensor([0])))
    ref = math.log(1e-8) - math.log(1e-9)
    assert abs(float((s.lp[0, -1] - s.lq[0, -1]).detach()) - ref) < 1e-4


def test_logits_and_logprobs_agree_and_gradient_flows():
    logits = peaked_logits(5, 30, seed=2)
    logits[:2] = torch.randn(2, 30, dtype=torch.float64)  # the K cap binds: a real rest
    tok = torch.arange(5)
    a, b = sparsify(logits + 5.0, tok, k=8), sparsify(torch.log_softmax(logits, -1), tok, k=8)
    torch.testing.assert_close(a.logp, b.logp)
    torch.testing.assert_close(a.log_rest, b.log_rest)
    x = logits.clone().requires_grad_(True)

    def f(y):
        d = sparsify(y, tok, k=8)
        return torch.where(d.mask, d.logp, 0.0), d.log_rest

    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("k", [20, 200])
def test_topk_path_equals_full_path(k):
    """The behaviour policy from an engine's top-K log-probs equals sparsifying its full logits, rest included,
    when K covers the support (k = 200 = V: the engine returns everything)."""
    logits = peaked_logits(10, 200, seed=3)  # float64: no rounding flips at the 1 - delta boundary
    logits[:2] = torch.randn(2, 200, dtype=torch.float64) * 0.3  # the cap binds: the kept set is the top K
    tok = torch.randint(0, 200, (10,))
    logp = torch.log_softmax(logits, -1)
    top_logp, top_idx = logp.topk(k, -1)
    perm = torch.randperm(k)  # engines need not return them sorted
    tok_logp = logp.gather(-1, tok[:, None])[:, 0]
    s_top = sparsify_topk(top_logp[:, perm], top_idx[:, perm], tok_logp, tok, 200, delta=1e-5)
    s_full = sparsify(logits, tok, k=k, delta=1e-5)
    for r in range(10):
        assert as_dict(s_top, r, s_top.logp) == pytest.approx(as_dict(s_full, r, s_full.logp), abs=1e-12)
    torch.testing.assert_close(s_top.log_rest[2:], s_full.log_rest[2:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s_top.log_rest[:2], s_full.log_rest[:2], atol=1e-12, rtol=1e-12)


def test_rest_model_atoms_equal_the_dense_coarse_graining():
    v = 60
    g = torch.Generator().manual_seed(4)
    old_logits = rows_of_many_entropies(16, v, seed=4)
    new_logits = old_logits + torch.randn(16, v, generator=g, dtype=torch.float64)
    tok = torch.randint(0, v, (16,), generator=g)
    old = sparsify(old_logits, tok, k=5)
    s = build_support(new_logits, tok, old)
    lp, lq = torch.log_softmax(new_logits, -1), torch.log_softmax(old_logits, -1)
    for r in range(16):
        kept = old.idx[r][old.mask[r]]
        rest = torch.ones(v, dtype=torch.bool)
        rest[kept] = False
        u = int(old.size[r])
        torch.testing.assert_close(s.lp[r, :u], lp[r, kept], atol=1e-13, rtol=0)
        torch.testing.assert_close(s.lq[r, :u], lq[r, kept], atol=1e-13, rtol=0)
        torch.testing.assert_close(s.lp[r, -1], lp[r, rest].logsumexp(-1), atol=1e-13, rtol=0)
        torch.testing.assert_close(s.lq[r, -1], lq[r, rest].logsumexp(-1), atol=1e-13, rtol=0)
        assert int(s.idx[r, s.y[r]]) == int(tok[r])
    torch.testing.assert_close(s.lp_y, lp.gather(-1, tok[:, None])[:, 0])
    torch.testing.assert_close(s.entropy, -(lp.exp() * lp).sum(-1))


@pytest.mark.parametrize("k,delta", [(1, 1e-5), (4, 1e-5), (16, 1e-3), (64, 0.0)])
def test_rest_model_kl_never_exceeds_the_true_kl(k, delta):
    """KL_c(p || q) <= KL(p || q) (log-sum inequality) on rows from near one-hot to near uniform, with the gap
    r_p KL(p|R || q|R); equality where nothing is dropped."""
    v = 300
    g = torch.Generator().manual_seed(k)
    old_logits = rows_of_many_entropies(64, v, seed=k)
    new_logits = old_logits + torch.randn(64, v, generator=g, dtype=torch.float64) * torch.rand(64, 1, generator=g)
    tok = torch.randint(0, v, (64,), generator=g)
    s = build_support(new_logits, tok, sparsify(old_logits, tok, k=k, delta=delta))
    lp, lq = torch.log_softmax(new_logits, -1), torch.log_softmax(old_logits, -1)
    true = (lp.exp() * (lp - lq)).sum(-1)
    coarse = support_kl(s)
    assert (coarse <= true + 1e-12).all()
    rest = torch.ones(64, v, dtype=torch.bool).scatter(-1, torch.where(s.mask[:, :-1], s.idx, s.idx[:, :1]), False)
    lp_r = torch.where(rest, lp - lp.masked_fill(~rest, -math.inf).logsumexp(-1, keepdim=True), -math.inf)
    lq_r = torch.where(rest, lq - lq.masked_fill(~rest, -math.inf).logsumexp(-1, keepdim=True), -math.inf)
    gap = s.lp[:, -1].exp() * torch.where(rest, lp_r.exp() * (lp_r - lq_r), 0.0).sum(-1)
    torch.testing.assert_close(coarse + torch.where(s.mask[:, -1], gap, 0.0), true, atol=1e-12, rtol=1e-10)


def test_paper_model_matches_dense_lift_and_kl_counts_the_tail():
    v = 60
    new_logits, old_logits = peaked_logits(8, v, seed=4), peaked_logits(8, v, seed=5)
    tok = torch.randint(0, v, (8,))
    new, old = sparsify(new_logits, tok, k=5), sparsify(old_logits, tok, k=5)
    s = build_support(new_logits, tok, old, "paper", k=5)
    assert (s.count > 0).all() and s.mask[:, -1].all()
    # compacted: live single atoms first, in id order
    u = s.mask[:, :-1]
    assert s.idx.shape[1] == int(u.sum(-1).max()) < new.idx.shape[1] + old.idx.shape[1]
    assert (u.long().diff(dim=-1) <= 0).all() and ((s.idx.diff(dim=-1) > 0) | ~u[:, 1:]).all()
    p_hat, q_hat = new.to_dense(TAIL_PROB), old.to_dense(TAIL_PROB)
    dense_kl = []
    for r in range(8):
        ids = s.idx[r][u[r]]
        assert set(ids.tolist()) == set(new.idx[r][new.mask[r]].tolist()) | set(old.idx[r][old.mask[r]].tolist())
        torch.testing.assert_close(s.lp[r][: len(ids)], p_hat[r, ids])
        torch.testing.assert_close(s.lq[r][: len(ids)], q_hat[r, ids])
        dense_kl.append(float((p_hat[r].exp() * (p_hat[r] - q_hat[r])).sum()))
    torch.testing.assert_close(support_kl(s), torch.tensor(dense_kl, dtype=torch.float64), atol=1e-12, rtol=1e-10)
    lp = torch.log_softmax(new_logits, -1)
    torch.testing.assert_close(s.lp_y, lp.gather(-1, tok[:, None])[:, 0])  # exact, not renormalised


@pytest.mark.parametrize("model", ["rest", "paper"])
def test_kl_equals_dense_when_nothing_dropped(model):
    lp, lq = torch.randn(6, 15, dtype=torch.float64), torch.randn(6, 15, dtype=torch.float64)
    tok = torch.zeros(6, dtype=torch.long)
    s = build_support(lp, tok, sparsify(lq, tok, k=15, delta=0.0), model, k=15, delta=0.0)
    assert (s.count == 0).all() and not s.mask[:, -1].any()
    p, q = torch.log_softmax(lp, -1), torch.log_softmax(lq, -1)
    torch.testing.assert_close(support_kl(s), (p.exp() * (p - q)).sum(-1), atol=1e-14, rtol=0)


def test_the_paper_model_overstates_a_peaked_row_and_the_rest_model_does_not():
    """q = [0.999995, 4e-6, 1e-6], p = [0.997, 0.002, 0.001], y = 0: the true KL is 0.0163 (inside eps = 0.05).
    The paper's model keeps only token 0 of q and charges p's tokens 1, 2 the tail 1e-12: KL 0.0606."""
    q = torch.tensor([[0.999995, 4e-6, 1e-6]], dtype=torch.float64).log()
    p = torch.tensor([[0.997, 0.002, 0.001]], dtype=torch.float64).log()
    y = torch.tensor([0])
    old = sparsify(q, y)
    true = float((p.exp() * (p - q)).sum())
    assert true == pytest.approx(0.0163, abs=1e-4)
    assert float(support_kl(build_support(p, y, old, "paper"))) == pytest.approx(0.0606, abs=1e-4)
    coarse = float(support_kl(build_support(p, y, old, "rest")))
    assert coarse <= true and coarse == pytest.approx(0.0162, abs=1e-4)
    torch.testing.assert_close(project_dense(p, q, 0.05), p)  # the dense projection leaves p alone
    rest = project_sparse(build_support(p, y, old, "rest"), 0.05)
    assert not rest.dual.active.any()
    paper = project_sparse(build_support(p, y, old, "paper"), 0.05)
    assert paper.dual.active.all()
    s = paper.support  # the paper's model moves p to about [0.9975, 0.00166, 0.00084]
    moved = dict(zip(s.idx[0].tolist(), paper.logp[0, :-1].exp().tolist(), strict=True))
    assert moved[0] == pytest.approx(0.9975, abs=1e-4) and moved[1] == pytest.approx(0.00166, abs=2e-5)


def test_sparsification_error_within_theorem_bound():
    """The paper's model: KL(p || p_hat) <= log(m + c tau) + (1 - m) log((1 - m) / tau) <= delta log(delta / tau)
    + c tau, about 1.6e-4 with the paper's K = 64 and delta = 1e-5 (docs/algorithm.md, section 3)."""
    v, delta = 5000, 1e-5
    logits = peaked_logits(32, v, seed=6)
    logits[:8] = torch.randn(8, v, dtype=torch.float64) * 2 + peaked_logits(8, v, seed=7) * 0.6  # K cap binds
    tok = torch.randint(0, v, (32,))
    s = sparsify(logits, tok, k=64, delta=delta)
    p = torch.log_softmax(logits, -1)
    p_hat = s.to_dense(TAIL_PROB)
    count = v - s.size
    for r in range(32):
        m = torch.where(s.mask[r], s.logp[r], -math.inf).logsumexp(-1).exp()
        err = float((p[r].exp() * (p[r] - p_hat[r])).sum())
        bound = float(tail_error_bound(m, count[r].double()))
        assert 0 <= err <= bound * (1 + 1e-9) + 1e-15
        if m >= 1 - delta:
            assert bound <= delta * math.log(delta / TAIL_PROB) + v * TAIL_PROB + 1e-12
    assert (s.size[:8] == 65).any()  # some rows really hit the cap
    assert abs(delta * math.log(delta / TAIL_PROB) - 1.6e-4) < 1e-5


def test_masked_logits_are_dropped_into_the_rest():
    logits = peaked_logits(3, 20, seed=8)
    logits[:, 10:] = -math.inf
    s = sparsify(logits, torch.zeros(3, dtype=torch.long), k=64, delta=0.0)
    assert (s.size == 10).all() and torch.isfinite(s.logp).all() and (s.idx[s.mask] < 10).all()
    assert (s.log_rest == -math.inf).all()  # nothing but masked tokens outside
    support = build_support(logits.clone().requires_grad_(True), torch.zeros(3, dtype=torch.long), s)
    assert not support.mask[:, -1].any() and torch.isfinite(support.lp).all()


def test_errors_name_the_problem():
    x = torch.randn(3, 10, generator=torch.Generator().manual_seed(10))
    tok = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="zero probability"):
        y = x.clone()
        y[1, 4] = -math.inf
        sparsify(y, torch.tensor([0, 4, 0]))
    with pytest.raises(ValueError, match="no finite entry"):
        sparsify(torch.full((2, 4), -math.inf), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN"):
        sparsify(x.clone().index_fill_(1, torch.tensor([3]), math.nan), tok)
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sparsify(x, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        sparsify(x, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="lie in"):
        sparsify(x, torch.tensor([0, 10, 0]))
    for bad_k in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="k must be"):
            sparsify(x, tok, k=bad_k)
    for bad_delta in (math.nan, -0.1, 1.0):
        with pytest.raises(ValueError, match="delta must be"):
            sparsify(x, tok, delta=bad_delta)
    top_logp, top_idx = torch.log_softmax(x, -1).topk(4, -1)
    with pytest.raises(ValueError, match="log-probabilities"):
        sparsify_topk(top_logp.abs() + 1, top_idx, x[:, 0], tok, 10)
    with pytest.raises(ValueError, match="top-K ids must lie in"):
        sparsify_topk(top_logp, top_idx + 10, top_logp[:, 0], tok, 10)
    s = sparsify(x, tok, k=2)
    with pytest.raises(ValueError, match="over 10 tokens"):
        build_support(torch.randn(3, 12), tok, s)
    with pytest.raises(ValueError, match="unknown sparse model"):
        build_support(x, tok, s, "dense")
    off = [int(i) for i in torch.argsort(x[2]) if i != 0][0]  # row 2's least likely token other than y = 0
    with pytest.raises(ValueError, match="sampled tokens"):
        build_support(x, torch.tensor([0, 0, off]), s)


def test_select_and_cat_rows_round_trip():
    logits = peaked_logits(6, 30, seed=9)
    logits[5] = torch.randn(30, dtype=torch.float64) * 0.1  # a wide row: the parts have different widths
    tok = torch.randint(0, 30, (6,))
    s = sparsify(logits, tok, k=9)
    a, b = s.select(torch.tensor([0, 1, 2])), s.select(torch.tensor([3, 4, 5]))
    back = cat_rows([a, b])
    for name in ("idx", "logp", "mask", "log_rest"):
        assert torch.equal(getattr(back, name), getattr(s, name)), name
    narrow = sparsify(logits[:3], tok[:3], k=9)
    assert narrow.idx.shape[1] < s.idx.shape[1]
    both = cat_rows([narrow, b])
    assert both.idx.shape == s.idx.shape and torch.equal(both.mask, s.mask)
    for r in range(6):
        assert as_dict(both, r, both.logp) == as_dict(s, r, s.logp)
    with pytest.raises(ValueError, match="one vocabulary size"):
        cat_rows([s, sparsify(torch.randn(2, 40), torch.zeros(2, dtype=torch.long), k=5)])
