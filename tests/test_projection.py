"""The trust-region projection (troll/project.py, troll/dual.py) against independent references:
a generic constrained optimiser (scipy SLSQP), a generic root finder (scipy brentq), finite differences
(torch.autograd.gradcheck in float64), and the dense full-vocabulary computation."""

import math

import numpy as np
import pytest
import torch
from scipy.optimize import brentq, minimize

from troll.dual import solve_dual
from troll.project import project_dense, project_sparse
from troll.sparse import atom_kl, build_support, sparsify

EPS = 0.05


def dense_kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis from log-probs, 0 * log 0 = 0."""
    lp, lq = torch.log_softmax(lp.double(), -1), torch.log_softmax(lq.double(), -1)
    return torch.where(lp > -math.inf, lp.exp() * (lp - lq), 0.0).sum(-1)


def mixed_batch(n: int = 8, v: int = 10, seed: int = 0, dtype=torch.float64):
    """Rows alternate between far apart (active) and nearly equal (inactive) policies."""
    g = torch.Generator().manual_seed(seed)
    lq = torch.randn(n, v, generator=g, dtype=dtype) * 2
    lp = lq + torch.randn(n, v, generator=g, dtype=dtype) * torch.tensor([2.0, 0.01] * (n // 2), dtype=dtype)[:, None]
    return lp, lq


def test_kl_constraint_active_and_identity_inactive():
    lp, lq = mixed_batch(16)
    before = dense_kl(lp, lq)
    assert (before[0::2] > EPS).all() and (before[1::2] < EPS).all()
    out = project_dense(lp, lq, EPS)
    after = dense_kl(out, lq)
    assert torch.allclose(out.exp().sum(-1), torch.ones(16, dtype=torch.float64))
    assert (after[0::2] - EPS).abs().max() <= 1e-9
    torch.testing.assert_close(out[1::2], torch.log_softmax(lp[1::2], -1), atol=1e-14, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_matches_generic_constrained_optimiser(seed):
    """SLSQP over the simplex: min KL(pi || p) s.t. KL(pi || q) <= eps."""
    rng = np.random.default_rng(seed)
    v = 6
    lq = torch.tensor(rng.normal(size=v) * 1.5)
    lp = lq + torch.tensor(rng.normal(size=v) * 2.0)
    p, q = torch.softmax(lp, -1).numpy(), torch.softmax(lq, -1).numpy()

    def klnp(x, y):
        return float(np.sum(x * (np.log(x) - np.log(y))))

    res = minimize(
        lambda x: klnp(x, p),
        q.copy(),
        method="SLSQP",
        bounds=[(1e-10, 1.0)] * v,
        constraints=[
            {"type": "eq", "fun": lambda x: x.sum() - 1.0},
            {"type": "ineq", "fun": lambda x: EPS - klnp(x, q)},
        ],
        options={"ftol": 1e-14, "maxiter": 500},
    )
    assert res.success, res.message
    ours = project_dense(lp, lq, EPS).exp().numpy()
    assert klnp(q, p) > EPS  # the case is not trivially inside the region
    np.testing.assert_allclose(ours, res.x, atol=2e-5)
    assert klnp(ours, p) <= res.fun + 1e-7  # no feasible point is better


def test_dual_root_matches_brentq():
    """t* from our safeguarded Newton equals a generic bracketing root finder on KL(pi_t || q) = eps."""
    lp, lq = mixed_batch(8, 12, seed=3)
    lp, lq = torch.log_softmax(lp, -1), torch.log_softmax(lq, -1)
    sol = solve_dual(lp - lq, lq, EPS)
    for i in range(8):
        a, b = (lp[i] - lq[i]).numpy(), lq[i].numpy()

        def f(t, a=a, b=b):
            s = b + t * a
            logz = np.log(np.exp(s - s.max()).sum()) + s.max()
            w = np.exp(s - logz)
            return t * (w * a).sum() - logz - EPS

        if f(1.0) > 0:
            assert sol.active[i]
            assert abs(sol.t[i].item() - brentq(f, 1e-12, 1.0, xtol=1e-15)) < 1e-9
        else:
            assert not sol.active[i] and sol.t[i] == 1.0 and sol.iters[i] == 0


@pytest.mark.parametrize("max_iter", [50, 2])
def test_reported_kl_is_the_kl_at_the_returned_t(max_iter):
    """kl_before / kl_after are KL(pi_t || q) at t = 1 and at the returned t (a plain numpy evaluation),
    whether the solve converged or stopped at max_iter; unconverged rows are reported as such."""
    lp, lq = mixed_batch(8, 12, seed=4)
    lp, lq = torch.log_softmax(lp, -1), torch.log_softmax(lq, -1)
    sol = solve_dual(lp - lq, lq, EPS, max_iter=max_iter)

    def kl_at(i: int, t: float) -> float:
        a, b = (lp[i] - lq[i]).numpy(), lq[i].numpy()
        w = np.exp(b + t * a)
        w /= w.sum()
        return float((w * (np.log(w) - b)).sum())

    for i in range(8):
        assert sol.kl_before[i].item() == pytest.approx(kl_at(i, 1.0), rel=1e-12, abs=1e-15)
        assert sol.kl_after[i].item() == pytest.approx(kl_at(i, sol.t[i].item()), rel=1e-10, abs=1e-15)
    assert bool(sol.active.any())
    residual = (sol.kl_after - EPS).abs()[sol.active]
    if max_iter == 50:
        assert bool(sol.converged.all()) and float(residual.max()) <= 1e-12
    else:
        assert not bool(sol.converged[sol.active].all()) and float(residual.max()) > 1e-12
        assert bool((sol.iters <= max_iter).all())


def test_gradcheck_dense_mixed_active_inactive():
    lp, lq = mixed_batch(6, 7, seed=1)
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: project_dense(x, lq, EPS), (lp,))


def test_gradcheck_dense_from_logits_invariant_to_shift():
    """Logits and log-probs give the same projection and the same gradient."""
    lp, lq = mixed_batch(4, 6, seed=2)
    logits = (lp + 3.7).requires_grad_(True)
    logp = torch.log_softmax(lp, -1).requires_grad_(True)
    w = torch.randn(4, 6, dtype=torch.float64)
    (project_dense(logits, lq, EPS) * w).sum().backward()
    (project_dense(logp, lq, EPS) * w).sum().backward()
    # The Jacobian wrt logits equals the Jacobian wrt log-probs times d logp / d logits.
    g_via_logp = torch.autograd.grad(torch.log_softmax(logits, -1), logits, logp.grad)[0]
    torch.testing.assert_close(logits.grad, g_via_logp)
    assert torch.autograd.gradcheck(lambda x: project_dense(x, lq, EPS), (logits,))


@pytest.mark.parametrize("model", ["rest", "paper"])
def test_gradcheck_sparse_mixed_active_inactive(model):
    lp, lq = mixed_batch(6, 9, seed=4)
    tok = torch.tensor([0, 1, 2, 3, 4, 5])
    old = sparsify(lq, tok, k=5, delta=1e-3)
    lp.requires_grad_(True)

    def f(x):
        pr = project_sparse(build_support(x, tok, old, model, k=5, delta=1e-3), EPS)
        return pr.logp

    pr = project_sparse(build_support(lp, tok, old, model, k=5, delta=1e-3), EPS)
    assert pr.dual.active.any() and (~pr.dual.active).any() and pr.support.mask[:, -1].any()
    assert torch.autograd.gradcheck(f, (lp,))


def test_detach_dual_changes_gradient_only_on_active_tokens():
    lp, lq = mixed_batch(6, 8, seed=5)
    w = torch.randn(6, 8, dtype=torch.float64)
    grads = []
    for detach in (False, True):
        x = lp.clone().requires_grad_(True)
        (project_dense(x, lq, EPS, detach_dual=detach) * w).sum().backward()
        grads.append(x.grad)
    active = dense_kl(lp, lq) > EPS
    assert (grads[0][active] - grads[1][active]).abs().max() > 1e-3
    torch.testing.assert_close(grads[0][~active], grads[1][~active])


@pytest.mark.parametrize("model", ["rest", "paper"])
def test_sparse_equals_dense_when_nothing_dropped(model):
    """K = V, delta = 0: both sparse models are the dense projection, in value and in gradient."""
    lp, lq = mixed_batch(8, 20, seed=6)
    tok = torch.randint(0, 20, (8,))
    old = sparsify(lq, tok, k=20, delta=0.0)

    def sparse_y(x):
        return project_sparse(build_support(x, tok, old, model, k=20, delta=0.0), EPS).log_pi_y

    def dense_y(x):
        return project_dense(x, lq, EPS).gather(-1, tok[:, None])[:, 0]

    pr = project_sparse(build_support(lp, tok, old, model, k=20, delta=0.0), EPS)
    s = pr.support
    assert (s.count == 0).all() and s.mask[:, :-1].sum(-1).eq(20).all() and pr.dual.active.any()
    dense = project_dense(lp, lq, EPS)
    torch.testing.assert_close(pr.logp[:, :-1], dense.gather(-1, s.idx), atol=1e-12, rtol=0)
    torch.testing.assert_close(pr.dual.kl_before, dense_kl(lp, lq), atol=1e-12, rtol=0)
    jac_sparse = torch.autograd.functional.jacobian(sparse_y, lp)
    jac_dense = torch.autograd.functional.jacobian(dense_y, lp)
    torch.testing.assert_close(jac_sparse, jac_dense, atol=1e-10, rtol=0)
    assert torch.autograd.gradcheck(sparse_y, (lp.clone().requires_grad_(True),))


def test_rest_model_solves_the_coarse_problem_and_bounds_the_true_kl():
    """With q's support S plus one rest atom R: on the atoms, pi* is the dense projection of the coarse pair
    (an independent computation on U + 1 entries); densely, pi*(v) = pi*(R) p(v) / p(R) on R, and its true KL is
    exactly eps + pi*(R) KL(p|R || q|R). The solution is also the generic optimiser's (scipy SLSQP)."""
    g = torch.Generator().manual_seed(12)
    n, v = 12, 40
    lq = torch.randn(n, v, generator=g, dtype=torch.float64) * torch.linspace(0.3, 4, n, dtype=torch.float64)[:, None]
    lp = lq + torch.randn(n, v, generator=g, dtype=torch.float64) * 1.5
    tok = torch.randint(0, v, (n,), generator=g)
    s = build_support(lp, tok, sparsify(lq, tok, k=4, delta=1e-3))
    pr = project_sparse(s, EPS)
    act = pr.dual.active
    assert act.float().mean() > 0.5 and s.mask[:, -1].all()
    dead = ~s.mask
    coarse = project_dense(s.lp.detach().masked_fill(dead, -math.inf), s.lq.masked_fill(dead, -math.inf), EPS)
    torch.testing.assert_close(pr.logp.detach()[s.mask], coarse[s.mask], atol=1e-12, rtol=0)
    p, q = torch.log_softmax(lp, -1), torch.log_softmax(lq, -1)
    for r in torch.nonzero(act)[:, 0].tolist():
        kept = s.idx[r][s.mask[r, :-1]]
        rest = torch.ones(v, dtype=torch.bool)
        rest[kept] = False
        pi = p[r] - s.lp[r, -1].detach() + pr.logp[r, -1].detach()  # p's shape inside R
        pi[kept] = pr.logp[r, : len(kept)].detach()
        assert abs(float(pi.exp().sum()) - 1) < 1e-12
        p_r, q_r = p[r, rest] - p[r, rest].logsumexp(0), q[r, rest] - q[r, rest].logsumexp(0)
        within = float((p_r.exp() * (p_r - q_r)).sum())
        true = float((pi.exp() * (pi - q[r])).sum())
        assert true == pytest.approx(EPS + float(pr.logp[r, -1].exp()) * within, abs=1e-10)
        assert true >= EPS - 1e-10
    r = int(torch.nonzero(act)[0, 0])  # one row against a generic optimiser on the coarse problem
    live = s.mask[r]
    a_p, a_q = s.lp[r][live].detach().exp().numpy(), s.lq[r][live].exp().numpy()

    def obj(x):
        return float(np.sum(x * np.log(x / a_p)))

    cons = {"type": "ineq", "fun": lambda x: EPS - float(np.sum(x * np.log(x / a_q)))}
    eq = {"type": "eq", "fun": lambda x: float(np.sum(x)) - 1}
    res = minimize(
        obj,
        a_q,
        constraints=[cons, eq],
        bounds=[(1e-12, 1)] * len(a_q),
        method="SLSQP",
        options={"ftol": 1e-14, "maxiter": 500},
    )
    np.testing.assert_allclose(res.x, pr.logp[r][live].detach().exp().numpy(), atol=1e-6)


def test_rest_model_projects_no_token_that_is_inside():
    """A near-uniform policy and a tiny perturbation of it (true KL ~ 1e-6): the K cap binds on every row. The
    paper's model sees a large KL and projects; the rest model never does (its KL is a lower bound)."""
    g = torch.Generator().manual_seed(13)
    n, v = 64, 2000
    lq = 0.3 * torch.randn(n, v, generator=g, dtype=torch.float64)
    lp = lq + 2e-3 * torch.randn(n, v, generator=g, dtype=torch.float64)
    tok = torch.randint(0, v, (n,), generator=g)
    old = sparsify(lq, tok)
    assert (old.size >= 64).all()
    true = dense_kl(lp, lq)
    assert true.max() < 1e-5
    rest = project_sparse(build_support(lp, tok, old, "rest"), EPS)
    paper = project_sparse(build_support(lp, tok, old, "paper"), EPS)
    assert not rest.dual.active.any() and (rest.dual.kl_before <= true + 1e-12).all()
    assert paper.dual.active.float().mean() > 0.25 and paper.dual.kl_before.mean() > 100 * true.mean()


def test_float32_lands_on_the_feasible_side():
    g = torch.Generator().manual_seed(7)
    n, v = 2048, 500
    lq = torch.randn(n, v, generator=g) * 2
    lq[:, :5] += 10
    lp = lq + torch.randn(n, v, generator=g) * 1.5
    tok = torch.randint(0, v, (n,), generator=g)
    for pr_logp, lq_full, active in (
        (project_dense(lp, lq, EPS), torch.log_softmax(lq.double(), -1), dense_kl(lp, lq) > EPS),
    ):
        assert pr_logp.dtype == torch.float32
        k = dense_kl(pr_logp, lq_full)[active] - EPS
        assert k.min() >= -1e-5 and k.max() <= 1e-6
    for model in ("rest", "paper"):
        pr = project_sparse(build_support(lp, tok, sparsify(lq, tok), model), EPS)
        s, act = pr.support, pr.dual.active
        assert act.float().mean() > 0.3
        k32 = atom_kl(pr.logp, s.lq, s.mask)[act] - EPS
        k64 = atom_kl(pr.logp.double(), s.lq.double(), s.mask)[act] - EPS
        for k in (k32, k64):
            assert k.min() >= -1e-5 and k.max() <= 1e-6
        assert pr.dual.converged.all() and pr.dual.iters.max() <= 12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs_are_solved_in_float32(dtype):
    lp, lq = mixed_batch(8, 30, seed=8, dtype=torch.float32)
    out = project_dense(lp.to(dtype), lq.to(dtype), EPS)
    assert out.dtype == torch.float32
    k = dense_kl(out, lq.to(dtype).float())
    active = dense_kl(lp.to(dtype).float(), lq.to(dtype).float()) > EPS
    assert (k[active] - EPS).abs().max() <= 1e-5 and (k <= EPS + 1e-6).all()
    tok = torch.zeros(8, dtype=torch.long)
    pr = project_sparse(build_support(lp.to(dtype), tok, sparsify(lq.to(dtype), tok)), EPS)
    assert pr.logp.dtype == torch.float32 and torch.isfinite(pr.logp).all()


def test_one_hot_and_near_one_hot():
    v = 8
    one_hot = torch.full((2, v), -math.inf, dtype=torch.float64)
    one_hot[:, 3] = 0.0
    torch.testing.assert_close(project_dense(one_hot, one_hot, EPS), one_hot)  # KL = 0: identity, no NaN
    # Near one-hot on different tokens: KL ~ 20, the projection pulls all the way back to eps.
    lp = torch.zeros(3, v, dtype=torch.float64)
    lq = torch.zeros(3, v, dtype=torch.float64)
    lp[:, 0], lq[:, 1] = 25.0, 25.0
    out = project_dense(lp, lq, EPS)
    assert torch.isfinite(out).all() and ((dense_kl(out, lq) - EPS).abs() <= 1e-9).all()
    tok = torch.zeros(3, dtype=torch.long)
    pr = project_sparse(build_support(lp, tok, sparsify(lq, tok)), EPS)
    assert ((pr.dual.kl_after - EPS).abs() <= 1e-9).all() and pr.dual.converged.all()


def test_near_uniform_is_inside():
    lq = torch.zeros(4, 50, dtype=torch.float64)
    lp = lq + 1e-3 * torch.randn(4, 50, dtype=torch.float64)
    torch.testing.assert_close(project_dense(lp, lq, EPS), torch.log_softmax(lp, -1))


def test_masked_tokens_keep_zero_probability():
    lp, lq = mixed_batch(4, 10, seed=9)
    lp[:, 7:], lq[:, 7:] = -math.inf, -math.inf
    out = project_dense(lp, lq, EPS)
    assert (out[:, 7:] == -math.inf).all() and torch.isfinite(out[:, :7]).all()
    torch.testing.assert_close(out[:, :7], project_dense(lp[:, :7], lq[:, :7], EPS))
    lp2 = lp.clone()
    lp2[0, 7] = 0.0
    with pytest.raises(ValueError, match="logp_new has mass where logp_old has none"):
        project_dense(lp2, lq, EPS)


@pytest.mark.parametrize("eps", [1e-8, 1e-4, 0.5, 3.0, 1e3])
def test_small_and_large_eps(eps):
    lp, lq = mixed_batch(8, 12, seed=10)
    out = project_dense(lp, lq, eps)
    before, after = dense_kl(lp, lq), dense_kl(out, lq)
    active = before > eps
    assert ((after[active] - eps).abs() <= 1e-9).all()
    torch.testing.assert_close(out[~active], torch.log_softmax(lp[~active], -1))
    if eps >= 1e3:
        assert not active.any()


def test_zero_rows_and_all_zero_logits():
    empty = torch.zeros(0, 5, dtype=torch.float64)
    assert project_dense(empty, empty, EPS).shape == (0, 5)
    none = torch.zeros(0, dtype=torch.long)
    pr = project_sparse(build_support(empty, none, sparsify(empty, none)), EPS)
    assert pr.logp.shape[0] == 0
    zeros = torch.zeros(3, 5, dtype=torch.float64)  # uniform rows: identical policies, identity
    torch.testing.assert_close(project_dense(zeros, zeros, EPS), torch.full((3, 5), -math.log(5), dtype=torch.float64))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nan_and_inf_raise(bad):
    lp, lq = mixed_batch(2, 5)
    lp[1, 2] = bad
    with pytest.raises(ValueError, match="NaN"):
        project_dense(lp, lq, EPS)
    with pytest.raises(ValueError, match="NaN"):
        sparsify(lp, torch.zeros(2, dtype=torch.long))


def test_bad_arguments_raise():
    lp, lq = mixed_batch(2, 5)
    with pytest.raises(ValueError, match="shape"):
        project_dense(lp, lq[:, :4], EPS)
    with pytest.raises(ValueError, match="eps"):
        project_dense(lp, lq, 0.0)
    tokens = torch.zeros(2, dtype=torch.long)
    support = build_support(lp, tokens, sparsify(lq, tokens, k=3, delta=1e-3))
    for bad in (0.0, -0.1, math.nan, math.inf):  # the sparse projection is public too: a NaN must not pass silently
        with pytest.raises(ValueError, match="eps must be a positive finite number"):
            project_sparse(support, bad)
    all_masked = torch.full((1, 5), -math.inf, dtype=torch.float64)
    with pytest.raises(ValueError, match="no finite entry"):
        project_dense(all_masked, all_masked, EPS)


def test_batched_leading_dims():
    lp, lq = mixed_batch(6, 5, seed=11)
    out = project_dense(lp.view(2, 3, 5), lq.view(2, 3, 5), EPS)
    torch.testing.assert_close(out.view(6, 5), project_dense(lp, lq, EPS))
