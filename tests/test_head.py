"""The chunked output layer (troll/head.py): the same numbers as full logits, in value and gradient (float64),
for the one-pass op and for every loss, with tied and untied output layers, temperature and a padded vocabulary."""

import math

import pytest
import torch

import troll.head as head_module
from troll.head import LMHead, gather_logprobs, topk
from troll.losses import LOSSES
from troll.sparse import sparsify


def make_head(n=10, h=6, v=23, vocab=20, seed=0, bias=True, chunk_rows=3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) * 1.5).requires_grad_(True)
    b = (torch.randn(v, generator=g, dtype=torch.float64)).requires_grad_(True) if bias else None
    return LMHead(hidden, weight, b, temperature=0.7, vocab_size=vocab, chunk_rows=chunk_rows)


def reference_logits(head: LMHead) -> torch.Tensor:
    """The unchunked output layer, written out: [N, V] logits with the padded ids at -inf."""
    x = head.hidden @ head.weight.T + (0 if head.bias is None else head.bias)
    x = x / head.temperature
    return x.masked_fill(torch.arange(x.shape[-1]) >= head.vocab_size, -math.inf)


def leaves(head: LMHead) -> list[torch.Tensor]:
    return [t for t in (head.hidden, head.weight, head.bias) if t is not None]


@pytest.mark.parametrize("bias", [True, False])
def test_gather_from_the_head_equals_gather_from_logits(bias):
    head = make_head(bias=bias)
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(20, generator=g)[:4] for _ in range(10)])
    mask = torch.ones(10, 4, dtype=torch.bool)
    mask[2, 2:] = False
    w = torch.randn(10, 4, generator=g, dtype=torch.float64)
    out_head = gather_logprobs(head, idx, mask)
    out_ref = gather_logprobs(reference_logits(head), idx, mask)
    for a, b in zip(out_head, out_ref, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)

    def loss(out):
        return (torch.where(mask, out[0], 0.0) * w).sum() + (out[1] * torch.arange(10.0)).sum()

    got = torch.autograd.grad(loss(out_head), leaves(head))
    want = torch.autograd.grad(loss(out_ref), leaves(head))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)

    def f(hidden, weight, *b):
        hd = LMHead(hidden, weight, b[0] if b else None, 0.7, 20, chunk_rows=3)
        lp, lr, _ = gather_logprobs(hd, idx, mask)
        return torch.where(mask, lp, 0.0), lr

    assert torch.autograd.gradcheck(f, tuple(leaves(head)))


def test_topk_of_the_head_equals_topk_of_logits():
    head = make_head(n=9, v=40, vocab=37, chunk_rows=2)
    torch.testing.assert_close(topk(head, 5), reference_logits(head).topk(5, -1).indices)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(
    "name,kw",
    [
        ("troll", {}),
        ("troll", {"support": "paper"}),
        ("troll", {"level": "sequence", "agg": "seq-mean-token-mean"}),
        ("ppo_clip", {}),
        ("ppo_clip", {"support": "paper", "level": "sequence"}),
        ("dppo", {"divergence": "binary_tv"}),
        ("dppo", {"divergence": "topk_kl"}),
        ("cispo", {}),
    ],
)
def test_every_loss_equals_its_unchunked_value_and_gradient(name, kw, tied, compiled=False):
    """Loss from LMHead(hidden [B, T, H], weight) == loss from its full logits [B, T, V], value and gradient, and
    the old policy sparsified from a head equals the one from logits. Tied: the output weight is also the
    embedding table that made the hidden states, so its gradient has two paths."""
    b, t, h, v, vocab = 3, 4, 5, 17, 15
    g = torch.Generator().manual_seed(2)
    emb = (torch.randn(v, h, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    out_w = emb if tied else (torch.randn(v, h, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    tokens = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    with torch.no_grad():
        old_hidden = torch.tanh(emb[ids] + 0.3 * torch.randn(b, t, h, generator=g, dtype=torch.float64))
        old_head = LMHead(old_hidden.reshape(-1, h), out_w, None, 0.9, vocab, chunk_rows=5)
        old = sparsify(old_head, tokens.view(-1), k=4, delta=1e-3)
        old_ref = sparsify(reference_logits(old_head), tokens.view(-1), k=4, delta=1e-3)
    for f in ("idx", "mask"):
        assert torch.equal(getattr(old, f), getattr(old_ref, f))
    torch.testing.assert_close(old.logp, old_ref.logp, atol=1e-12, rtol=0)
    torch.testing.assert_close(old.log_rest, old_ref.log_rest, atol=1e-12, rtol=0)
    params = [emb] if tied else [emb, out_w]

    def run(chunked: bool):
        hidden = torch.tanh(emb[ids])  # the "network": embedding, then the output layer
        head = LMHead(hidden, out_w, None, 0.9, vocab, chunk_rows=5, compiled=compiled)
        x = head if chunked else reference_logits(head.reshape(b * t, -1)).view(b, t, v)
        loss, m = LOSSES[name](x, tokens, mask, adv, old, k=4, delta=1e-3, **kw)
        return loss, m, torch.autograd.grad(loss, params)

    loss_c, m_c, g_c = run(True)
    loss_u, m_u, g_u = run(False)
    torch.testing.assert_close(loss_c, loss_u, atol=1e-12, rtol=0)
    for a, b_ in zip(g_c, g_u, strict=True):
        torch.testing.assert_close(a, b_, atol=1e-12, rtol=1e-10)
    assert m_c.keys() == m_u.keys() and all(m_c[key] == pytest.approx(m_u[key], abs=1e-10) for key in m_c)
    if name == "troll" and kw.get("support", "rest") == "rest":
        assert 0 < m_c["frac_active"] < 1  # the projection binds on some tokens, not all


def test_head_errors_name_the_problem():
    w = torch.randn(10, 4)
    with pytest.raises(ValueError, match="disagree"):
        LMHead(torch.randn(3, 5), w)
    with pytest.raises(ValueError, match="temperature"):
        LMHead(torch.randn(3, 4), w, temperature=0.0)
    with pytest.raises(ValueError, match="vocab_size"):
        LMHead(torch.randn(3, 4), w, vocab_size=11)
    with pytest.raises(ValueError, match="chunk_rows"):
        LMHead(torch.randn(3, 4), w, chunk_rows=0)


def test_frozen_output_layer_gets_no_gradient():
    """LoRA's frozen output layer: the hidden states' gradient is the unchunked one, and no [V, H] gradient is made."""
    head = make_head(bias=False)
    head.weight.requires_grad_(False)
    g = torch.Generator().manual_seed(2)
    idx = torch.stack([torch.randperm(20, generator=g)[:4] for _ in range(10)])
    mask = torch.ones(10, 4, dtype=torch.bool)
    got = torch.autograd.grad(gather_logprobs(head, idx, mask)[0].sum(), head.hidden)[0]
    want = torch.autograd.grad(gather_logprobs(reference_logits(head), idx, mask)[0].sum(), head.hidden)[0]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    gather_logprobs(head, idx, mask)[1].sum().backward()
    assert head.weight.grad is None and head.hidden.grad is not None


# ----------------------------------------------------------------------------- the compiled path


def head_outputs(head: LMHead, idx: torch.Tensor, mask: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """logp, log_rest, entropy and the gradients of hidden, weight and bias under a fixed weighting."""
    lp, lr, ent = gather_logprobs(head, idx, mask)
    loss = (torch.where(mask, lp, 0.0) * w).sum() + (lr * torch.linspace(-1, 1, len(lr), dtype=lr.dtype)).sum()
    return [lp, lr, ent, *torch.autograd.grad(loss, leaves(head))]


@pytest.mark.slow  # torch.compile takes seconds a shape on CPU
@pytest.mark.parametrize(("n", "v", "vocab", "chunk"), [(10, 23, 20, 3), (1, 1003, 1000, 8), (37, 1003, 1003, 16)])
def test_the_compiled_chunk_pass_is_the_eager_one_to_rounding(n, v, vocab, chunk, monkeypatch):
    """`LMHead(compiled=True)`: the same op through torch.compile (C++ here, Triton on CUDA: tests/test_gpu.py) on
    odd shapes (a vocabulary not a multiple of any block, one row, padded output rows, a short last chunk, masked
    slots). float64: equal to the eager path to 1e-12. float32: its error against the float64 truth at most the
    eager float32 path's plus 2e-6 (the sums run in another order)."""
    g = torch.Generator().manual_seed(n)
    hidden, weight, bias = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((n, 16), (v, 16), (v,)))
    idx = torch.stack([torch.randperm(vocab, generator=g)[:6] for _ in range(n)])
    mask = torch.rand(n, 6, generator=g) < 0.7
    mask[:, 0] = True
    w = torch.randn(n, 6, generator=g, dtype=torch.float64)
    asked: list[str] = []  # the functions the op had compiled: the fused path ran, forward and backward
    real = head_module.compiled
    monkeypatch.setattr(head_module, "compiled", lambda fn: asked.append(fn.__name__) or real(fn))

    def run(dtype: torch.dtype, fused: bool) -> list[torch.Tensor]:
        head = LMHead(*(t.to(dtype).requires_grad_() for t in (hidden, weight * 2, bias)), 0.7, vocab, chunk, fused)
        asked.clear()
        out = [t.detach().double() for t in head_outputs(head, idx, mask, w.to(dtype))]
        chunks = -(-n // chunk)
        assert asked == (["chunk_stats"] * chunks + ["chunk_grad"] * chunks if fused else []), asked
        return out

    truth, fused64 = run(torch.float64, False), run(torch.float64, True)
    eager32, fused32 = run(torch.float32, False), run(torch.float32, True)
    for name, t, f64, e32, f32 in zip(("logp", "log_rest", "entropy", "hidden", "weight", "bias"), truth, fused64,
                                      eager32, fused32, strict=True):  # fmt: skip
        torch.testing.assert_close(f64, t, atol=1e-12, rtol=1e-10, msg=name)
        ok = torch.isfinite(t)
        assert torch.equal(ok, torch.isfinite(f32)), name  # -inf (no rest) where the truth has it
        err_eager, err_fused = (float((x[ok] - t[ok]).abs().max()) for x in (e32, f32))
        assert err_fused <= err_eager + 2e-6, (name, err_fused, err_eager)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_troll_through_the_compiled_head_equals_full_logits(tied):
    """The same check as for the eager head, through the compiled pass (float64): TROLL's loss and gradient."""
    test_every_loss_equals_its_unchunked_value_and_gradient("troll", {}, tied, compiled=True)
