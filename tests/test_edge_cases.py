"""The math library never returns a silent NaN: each edge case gives its defined answer or a ValueError naming the
input (issue 22). References are computed independently: scipy's optimiser on the primal, mpmath at 50 digits,
hand-computed sums."""

import math
import warnings

import mpmath
import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from troll.aggregate import aggregate
from troll.dual import solve_dual
from troll.losses import LOSSES, troll_loss
from troll.project import project_dense, project_sparse
from troll.sparse import build_support, sparsify, sparsify_topk

F64 = torch.float64
EPS = 0.05


def primal_projection(p: np.ndarray, q: np.ndarray, eps: float) -> np.ndarray:
    """argmin KL(pi || p) s.t. KL(pi || q) <= eps over pi on p's support (elsewhere KL(pi || p) is infinite), by
    SLSQP on softmax parameters: no closed form, no dual."""
    live = p > 0
    lp, lq = np.log(p[live]), np.log(q[live])

    def dist(z):
        w = np.exp(z - z.max())
        return w / w.sum()

    def kl(w, lref):
        return float((w * (np.log(w) - lref)).sum())

    res = minimize(
        lambda z: kl(dist(z), lp),
        lq.copy(),
        method="SLSQP",
        constraints=[{"type": "ineq", "fun": lambda z: eps - (kl(dist(z), lq) + 0.0)}],
        options={"ftol": 1e-15, "maxiter": 1000},
    )
    out = np.zeros_like(p)
    out[live] = dist(res.x)
    return out


# --- p gives zero probability to a token where q has mass ------------------------------------------------

P_DEAD = [0.2, 0.3, 0.0, 0.48, 0.02]  # token 2 masked in the current logits
Q_DEAD = [0.5, 0.3, 0.01, 0.16, 0.03]  # q(2) = 0.01 < 1 - exp(-0.05): the projection exists


def test_zero_probability_token_of_p_projects_to_the_primal_solution():
    """pi* gives the token no mass (else KL(pi* || p) is infinite) and solves the primal: dense, sparse and the
    loss agree with SLSQP, and the loss and its gradient are finite."""
    p, q = torch.tensor([P_DEAD], dtype=F64), torch.tensor([Q_DEAD], dtype=F64)
    ref = primal_projection(p[0].numpy(), q[0].numpy(), EPS)
    dense = project_dense(p.log(), q.log(), EPS)
    np.testing.assert_allclose(dense[0].exp().numpy(), ref, atol=2e-6)
    assert dense[0, 2] == -math.inf

    tok = torch.tensor([0])
    logits = p.log().view(1, 1, 5).clone().requires_grad_(True)
    for k in (5, 4):  # every token its own atom; or token 2 (q's least likely) alone in the rest atom
        old = sparsify(q.log(), tok, k=k, delta=0.0)
        pr = project_sparse(build_support(logits.view(1, 5), tok, old), EPS)
        assert bool(pr.dual.converged.all()) and bool(pr.dual.active.all())
        assert k == 5 or pr.support.lp[0, -1] == -math.inf  # k = 4: the rest atom has no p-mass
        ref_y = ref[0]
        assert math.exp(float(pr.log_pi_y.detach())) == pytest.approx(ref_y, abs=2e-6)
        adv = torch.tensor([1.0], dtype=F64)
        loss, metrics = troll_loss(logits, tok.view(1, 1), torch.ones(1, 1, dtype=torch.bool), adv, old, eps=EPS)
        pn = np.array(P_DEAD)
        live = pn > 0  # the regression term KL(p || pi*) over tokens (every token is an atom here)
        kl_p_ref = float((pn[live] * (np.log(pn[live]) - np.log(ref[live]))).sum())
        assert float(loss.detach()) == pytest.approx(-ref_y / Q_DEAD[0] + kl_p_ref, abs=1e-5)
        assert metrics["kl_after_max"] == pytest.approx(EPS, abs=1e-10)
        (g,) = torch.autograd.grad(loss, logits)
        assert bool(torch.isfinite(g).all()) and float(g.abs().sum()) > 0


def test_zero_probability_token_infeasible_is_refused():
    """q puts 0.15 > 1 - exp(-eps) on the token p masks: no distribution with finite KL to p is within eps of q."""
    p = torch.tensor([[0.6, 0.3, 0.0, 0.08, 0.02]], dtype=F64)
    q = torch.tensor([[0.5, 0.3, 0.15, 0.04, 0.01]], dtype=F64)
    with pytest.raises(ValueError, match="zero probability .* within eps"):
        project_dense(p.log(), q.log(), EPS)
    old = sparsify(q.log(), torch.tensor([0]), k=5, delta=0.0)
    with pytest.raises(ValueError, match="zero probability .* within eps"):
        troll_loss(p.log().view(1, 1, 5), torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool), torch.ones(1), old)


# --- inputs without a defined answer -------------------------------------------------------------------------


def one_token(v: int = 5):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 1, v, generator=g, dtype=F64), torch.randn(1, v, generator=g, dtype=F64)
    return x, torch.tensor([[0]]), torch.ones(1, 1, dtype=torch.bool), torch.ones(1, dtype=F64), y


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("field", ["logp", "log_rest"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_nan_or_inf_in_old_policy_is_refused(loss, field, value):
    x, tok, mask, adv, y = one_token()
    old = sparsify(y, tok.view(-1), k=2, delta=0.0)
    getattr(old, field)[0, ...] = value
    with pytest.raises(ValueError, match=f"old.{field}"):
        LOSSES[loss](x, tok, mask, adv, old)


@pytest.mark.parametrize("which", ["a", "b"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_solve_dual_refuses_nan_and_plus_inf(which, value):
    a, b = torch.zeros(2, 3, dtype=F64), torch.full((2, 3), -math.log(3), dtype=F64)
    a[0, 0] = 1.0
    {"a": a, "b": b}[which][1, 1] = value
    with pytest.raises(ValueError, match=f"^{which} .*rows \\[1\\]"):
        solve_dual(a, b, EPS)


def test_solve_dual_refuses_a_row_without_atoms():
    with pytest.raises(ValueError, match="b .*no finite entry"):
        solve_dual(torch.zeros(2, 0), torch.zeros(2, 0), EPS)


def test_sparsify_topk_refuses_a_positive_sampled_log_prob():
    with pytest.raises(ValueError, match="token_logp"):
        sparsify_topk(torch.full((1, 2), -1.0), torch.tensor([[0, 1]]), torch.tensor([math.inf]), torch.tensor([2]), 5)


def test_project_dense_refuses_an_empty_vocabulary():
    with pytest.raises(ValueError, match="V >= 1"):
        project_dense(torch.zeros(2, 0), torch.zeros(2, 0), EPS)


# --- solver accuracy: tiny eps, huge logits --------------------------------------------------------------


def mp_kl(logp: torch.Tensor, logq: torch.Tensor) -> float:
    """KL(pi || q) at 50 digits for one row of log-probs, each renormalised (the rounding of the stored sum is
    not the projection's)."""
    mpmath.mp.dps = 50
    w = [mpmath.exp(mpmath.mpf(float(v))) for v in logp]
    u = [mpmath.exp(mpmath.mpf(float(v))) for v in logq]
    zw, zu = mpmath.fsum(w), mpmath.fsum(u)
    return float(mpmath.fsum(wi / zw * mpmath.log((wi / zw) / (ui / zu)) for wi, ui in zip(w, u, strict=True) if wi))


@pytest.mark.parametrize("eps", [1e-12, 1e-9, 1e-6])
def test_tiny_eps_is_met_relative_to_eps(eps):
    """float64: the projected KL (at 50 digits) is within eps (1 + 1e-3); float32: the KL of the solved atoms is
    at most eps, and the returned log-probs add only float32 rounding."""
    g = torch.Generator().manual_seed(5)
    lp, lq = torch.randn(6, 12, generator=g, dtype=F64) * 2, torch.randn(6, 12, generator=g, dtype=F64) * 2
    out = project_dense(lp, lq, eps)
    for i in range(6):
        assert mp_kl(out[i], lq[i]) <= eps * (1 + 1e-3)
        assert mp_kl(out[i], lq[i]) >= eps * (1 - 1e-3)
    tok = torch.zeros(6, dtype=torch.long)
    s = build_support(lp.float(), tok, sparsify(lq.float(), tok, k=12, delta=0.0))
    pr = project_sparse(s, eps)
    for i in range(6):
        live = s.mask[i]
        a = (s.lp[i, live] - s.lq[i, live]).double()
        at_t = s.lq[i, live].double() + float(pr.t[i]) * a
        assert mp_kl(at_t, s.lq[i, live].double()) <= eps
    assert float(pr.dual.kl_after.max()) <= eps


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_logit_of_1e20_converges(dtype):
    """A logit of 1e20 makes p a point mass: t* ~ 1e-20, reached by the log-space bracket; KL after = eps."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 1, 6, generator=g, dtype=F64)
    x[:, 0, 1] = 1e20
    lq = torch.log_softmax(torch.randn(4, 6, generator=g, dtype=F64), -1)
    out = project_dense(x[:, 0].to(dtype), lq.to(dtype), EPS).double()
    kl = (out.exp() * (out - lq)).sum(-1)
    assert bool((kl <= EPS * (1 + 1e-6)).all()) and bool((kl >= EPS * (1 - 1e-3)).all())
    tok = torch.tensor([[1], [0], [2], [1]])
    logits = x.to(dtype).requires_grad_(True)
    old = sparsify(lq.to(dtype), tok.view(-1), k=6, delta=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "did not converge" warning
        loss, m = troll_loss(logits, tok, torch.ones(4, 1, dtype=torch.bool), torch.ones(4, dtype=F64), old, eps=EPS)
    assert m["dual_frac_unconverged"] == 0.0 and m["kl_after_max"] <= EPS * (1 + 1e-9)
    (grad,) = torch.autograd.grad(loss, logits)
    assert bool(torch.isfinite(grad).all())


def test_unconverged_solve_is_reported_and_warned():
    """Both policies at 1e20 scale: log q + t (log p - log q) cancels two numbers of 1e20, whose rounding (1e4)
    leaves no KL to solve for. The loss says so: a metric and a warning with the count."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 8, generator=g, dtype=F64) * 1e20
    y = torch.randn(3, 8, generator=g, dtype=F64) * 1e20
    tok = torch.randint(0, 8, (1, 3), generator=g)
    old = sparsify(y, tok.view(-1), k=8, delta=0.0)
    with pytest.warns(RuntimeWarning, match=r"did not converge on \d+ of 3 tokens"):
        _, m = troll_loss(x, tok, torch.ones(1, 3, dtype=torch.bool), torch.ones(1, dtype=F64), old)
    assert m["dual_frac_unconverged"] > 0


# --- aggregation over empty responses --------------------------------------------------------------------

X = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
M = [[True, True, False], [False, False, False], [True, False, False]]


@pytest.mark.parametrize(
    "mode,norm_len,expected",
    [
        ("token-mean", None, (1 + 2 + 7) / 3),
        ("seq-mean-token-mean", None, ((1 + 2) / 2 + 7 / 1) / 2),  # the empty response is left out
        ("seq-mean-token-sum-norm", None, ((1 + 2) / 3 + 7 / 3) / 2),
        ("seq-mean-token-sum-norm", 4, ((1 + 2) / 4 + 7 / 4) / 2),
    ],
)
def test_aggregate_leaves_out_empty_responses(mode, norm_len, expected):
    x = torch.tensor(X, dtype=F64)
    x[1, 0] = math.nan  # padding is never read
    assert float(aggregate(x, torch.tensor(M), mode, norm_len)) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("shape", [(2, 3), (2, 0), (0, 3)])
def test_aggregate_of_nothing_is_zero_with_zero_gradient(mode, shape):
    x = torch.randn(shape, dtype=F64).requires_grad_(True)
    out = aggregate(x, torch.zeros(shape, dtype=torch.bool), mode)
    (g,) = torch.autograd.grad(out, x)
    assert float(out.detach()) == 0.0 and bool((g == 0).all())


def test_aggregate_refuses_bad_norm_len():
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3, dtype=torch.bool), "seq-mean-token-sum-norm", 0)


# --- empty batches ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("support", ["rest", "paper"])
@pytest.mark.parametrize("b,t", [(0, 3), (2, 0)])
def test_empty_batch_gives_zero_loss(loss, support, b, t):
    """No rows at all (B = 0 or T = 0): loss 0, an empty gradient, finite metrics."""
    x = torch.randn(b, t, 5, dtype=F64).requires_grad_(True)
    tok = torch.zeros(b, t, dtype=torch.long)
    old = sparsify(torch.randn(b * t, 5, dtype=F64), tok.view(-1))
    out, metrics = LOSSES[loss](
        x, tok, torch.ones(b, t, dtype=torch.bool), torch.ones(b, dtype=F64), old, support=support
    )
    (g,) = torch.autograd.grad(out, x)
    assert float(out.detach()) == 0.0 and g.shape == x.shape
    assert all(math.isfinite(v) for v in metrics.values())
