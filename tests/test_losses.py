"""Behaviour-locking tests for troll/losses.py and troll/advantages.py.

Expected numbers are written from the formulas in docs/algorithm.md (by hand, or with scipy/math for the
projection of a two-token distribution), never read back from the code under test."""

import inspect
import itertools
import math

import pytest
import torch
from scipy.optimize import brentq

from troll.advantages import advantages, dr_grpo, grpo, reinforce_pp
from troll.aggregate import DEFAULT_AGG, aggregate
from troll.losses import LOSSES, cispo, dppo, dppo_divergence, ppo_clip, troll_loss
from troll.project import project_sparse
from troll.sparse import atom_kl, build_support, sparsify


def binary(p_y: float, q_y: float, adv: float, y: int = 0):
    """One token over V = 2: logits (float64 leaf) with p(y) = p_y, old q(y) = q_y."""
    p = torch.tensor([p_y, 1 - p_y], dtype=torch.float64) if y == 0 else torch.tensor([1 - p_y, p_y]).double()
    q = torch.tensor([q_y, 1 - q_y], dtype=torch.float64) if y == 0 else torch.tensor([1 - q_y, q_y]).double()
    logits = p.log().view(1, 1, 2).clone().requires_grad_(True)
    tokens = torch.tensor([[y]])
    old = sparsify(q.log().view(1, 2), tokens.view(-1), k=2, delta=0.0)
    return logits, tokens, torch.ones(1, 1, dtype=torch.bool), torch.tensor([adv], dtype=torch.float64), old


def grad_of(loss_fn, *args, **kw):
    logits = args[0]
    loss, metrics = loss_fn(*args, **kw)
    (g,) = torch.autograd.grad(loss, logits)
    return float(loss.detach()), g.view(-1), metrics


# --- PPO-clip -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p_y,adv,expected_loss,clipped",
    [
        (0.60, 1.0, -1.2, False),  # r = 1.2: at the edge, unclipped branch
        (0.65, 1.0, -1.2, True),  # r = 1.3 > 1.2 with A > 0: flat, zero gradient
        (0.35, -1.0, 0.8, True),  # r = 0.7 < 0.8 with A < 0: flat, zero gradient
        (0.65, -1.0, 1.3, False),  # r = 1.3 with A < 0: pessimistic branch keeps the gradient
        (0.35, 1.0, -0.7, False),  # r = 0.7 with A > 0: keeps the gradient
    ],
)
def test_ppo_clip_values_and_zero_gradient_region(p_y, adv, expected_loss, clipped):
    loss, g, m = grad_of(ppo_clip, *binary(p_y, 0.5, adv))
    assert loss == pytest.approx(expected_loss, abs=1e-9)
    r = p_y / 0.5
    expected_g = (
        torch.zeros(2, dtype=torch.float64)
        if clipped
        else -adv * r * torch.tensor([1 - p_y, -(1 - p_y)], dtype=torch.float64)
    )
    torch.testing.assert_close(g, expected_g.double(), atol=1e-9, rtol=0)
    assert m["frac_active"] == (1.0 if clipped else 0.0)


def test_clip_higher():
    loss, g, _ = grad_of(ppo_clip, *binary(0.62, 0.5, 1.0), eps_high=0.28)  # r = 1.24 < 1.28: not clipped
    assert loss == pytest.approx(-1.24) and g.abs().sum() > 0


# --- CISPO ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p_y,eps_high,cap", [(0.55, None, 1.1), (0.8, None, 1.2), (0.6, 0.28, 1.2), (0.8, 0.28, 1.28)])
def test_cispo_value_and_gradient(p_y, eps_high, cap):
    """L = -A * sg(min(r, 1 + eps_high)) * log p(y); dL/dz = -A * min(r, 1 + eps_high) * (onehot(y) - p); r = 2 p_y;
    eps_high defaults to 0.2 (as ppo_clip's and the trainer's --clip_high)."""
    kw = {} if eps_high is None else {"eps_high": eps_high}
    loss, g, _ = grad_of(cispo, *binary(p_y, 0.5, 2.0), **kw)
    assert loss == pytest.approx(-2.0 * cap * math.log(p_y), abs=1e-9)
    torch.testing.assert_close(g, -2.0 * cap * torch.tensor([1 - p_y, -(1 - p_y)], dtype=torch.float64))


# --- DPPO -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p_y,adv,masked",
    [
        (0.80, 1.0, True),  # A > 0, D = 0.3 > 0.15, p > q: moving further out -> blocked
        (0.80, -1.0, False),  # A < 0 pulls p(y) back towards q: allowed
        (0.20, -1.0, True),  # A < 0, D = 0.3, p < q: further out -> blocked
        (0.20, 1.0, False),  # A > 0 pulls back: allowed
        (0.55, 1.0, False),  # D = 0.05 below threshold: allowed either way
        (0.45, -1.0, False),
    ],
)
def test_dppo_mask_truth_table(p_y, adv, masked):
    loss, g, m = grad_of(dppo, *binary(p_y, 0.5, adv), divergence="binary_tv")
    r = min(p_y / 0.5, 2.0)
    if masked:
        assert loss == 0.0 and g.abs().max() == 0.0 and m["frac_active"] == 1.0
    else:
        assert loss == pytest.approx(-adv * r * math.log(p_y))
        torch.testing.assert_close(g, -adv * r * torch.tensor([1 - p_y, -(1 - p_y)], dtype=torch.float64))


def test_dppo_divergences():
    """Binary-KL of Bernoulli(0.8) vs Bernoulli(0.5) = 0.8 ln 1.6 + 0.2 ln 0.4 = 0.1927 > 0.05: blocked.
    Over V = 2 the top-K + rest divergences equal the binary ones (TV 0.3 > 0.15; KL 0.1927 > 0.05)."""
    for div in ("binary_kl", "topk_tv", "topk_kl"):
        loss, g, m = grad_of(dppo, *binary(0.8, 0.5, 1.0), divergence=div)
        assert m["frac_active"] == 1.0 and g.abs().max() == 0.0, div
        loss, g, m = grad_of(dppo, *binary(0.52, 0.5, 1.0), divergence=div)  # KL 8e-4, TV 0.02: allowed
        assert m["frac_active"] == 0.0 and g.abs().max() > 0, div
    with pytest.raises(ValueError, match="divergence"):
        dppo(*binary(0.8, 0.5, 1.0), divergence="nope")


@pytest.mark.parametrize("divergence", ["binary_kl", "topk_kl"])
def test_dppo_kl_runs_from_the_behaviour_policy_to_p(divergence):
    """The authors' KL is KL(mu || p), not KL(p || mu): at p(y) = 0.21, mu(y) = 0.1 (over V = 2),
    KL(Bern 0.1 || Bern 0.21) = 0.1 ln(0.1 / 0.21) + 0.9 ln(0.9 / 0.79) = 0.0431 < 0.05: allowed, while the other
    direction, 0.21 ln 2.1 + 0.79 ln(0.79 / 0.9) = 0.0528, would mask it (A > 0 and p > mu)."""
    mu_to_p = 0.1 * math.log(0.1 / 0.21) + 0.9 * math.log(0.9 / 0.79)
    assert mu_to_p < 0.05 < 0.21 * math.log(2.1) + 0.79 * math.log(0.79 / 0.9)
    loss, g, m = grad_of(dppo, *binary(0.21, 0.1, 1.0), divergence=divergence)
    assert m["frac_active"] == 0.0 and loss == pytest.approx(-2.1 * math.log(0.21), abs=1e-12)
    loss, g, m = grad_of(dppo, *binary(0.23, 0.1, 1.0), divergence=divergence)  # KL(mu || p) = 0.0571: masked
    assert m["frac_active"] == 1.0 and g.abs().max() == 0.0


def test_dppo_topk_divergences_equal_the_dense_top_k_plus_rest():
    """DPPO's TopK-TV / TopK-KL: p and q on q's kept set plus one "rest" bucket, from the full distributions; the
    KL from the behaviour policy q to p, as the authors' compute_topk_kl."""
    logits, tokens, _, _, old = ragged_batch(seed=5)
    b, t, v = logits.shape
    s = build_support(logits.detach().view(-1, v), tokens.view(-1), old)
    p = torch.log_softmax(logits.detach().view(-1, v), -1).exp()
    q = torch.log_softmax(ragged_batch(seed=5, old_logits=True).view(-1, v), -1).exp()
    for r in range(b * t):
        kept = old.idx[r][old.mask[r]]
        rest = torch.ones(v, dtype=torch.bool)
        rest[kept] = False
        pk, qk = torch.cat([p[r, kept], p[r, rest].sum()[None]]), torch.cat([q[r, kept], q[r, rest].sum()[None]])
        tv, kl = float(0.5 * (pk - qk).abs().sum()), float((qk * (qk / pk).log()).sum())  # KL(q || p), as DPPO's
        assert float(dppo_divergence("topk_tv", s)[r]) == pytest.approx(tv, abs=1e-12)
        assert float(dppo_divergence("topk_kl", s)[r]) == pytest.approx(kl, abs=1e-12)


def authors_dppo(logits, old_logits, tokens, mask, adv, kept, divergence, cap):
    """DPPO as its authors write it (sail-sg/Stable-RL, verl/trainer/ppo/core_algos.py: compute_policy_loss_with_mask,
    _compute_token_mask_for_policy_loss; actor utils compute_topk_kl), here from dense log-probs over V, token-mean:

        L = mean_t(-A sg(min(exp(min(log p(y) - log mu(y), 20)), c)) valid log p(y))
        valid = 1 - where(A > 0, invalid_pos, invalid_neg), with, for D and thresholds 0.15 (TV) / 0.05 (KL):
          binary_tv  invalid_pos = p(y) - mu(y) > thr,  invalid_neg = p(y) - mu(y) < -thr
          binary_kl  D = mu(y) log(mu(y) / p(y)) + (1 - mu(y)) log((1 - mu(y)) / (1 - p(y)))
          topk_*     D over mu's top-k (`kept`) plus one rest bucket: KL(mu || p), or half the L1 distance
          *_kl, topk_tv  invalid_pos = D > thr and p(y) > mu(y),  invalid_neg = D > thr and p(y) < mu(y)
    """
    lp, lq = torch.log_softmax(logits, -1), torch.log_softmax(old_logits, -1)
    lp_y, lq_y = lp.gather(-1, tokens[..., None])[..., 0], lq.gather(-1, tokens[..., None])[..., 0]
    with torch.no_grad():
        p_y, q_y = lp_y.exp(), lq_y.exp()
        thr = 0.15 if divergence.endswith("tv") else 0.05
        if divergence == "binary_tv":
            pos, neg = p_y - q_y > thr, p_y - q_y < -thr
        else:
            if divergence == "binary_kl":
                d = q_y * (lq_y - lp_y) + (1 - q_y) * torch.log((1 - q_y) / (1 - p_y))
            else:
                pk, qk = lp.exp() * kept, lq.exp() * kept  # mu's top-k, zero elsewhere
                p_rest, q_rest = 1 - pk.sum(-1), 1 - qk.sum(-1)
                if divergence == "topk_kl":
                    d = torch.where(kept, qk * (lq - lp), 0.0).sum(-1) + q_rest * torch.log(q_rest / p_rest)
                else:
                    d = 0.5 * ((pk - qk).abs().sum(-1) + (p_rest - q_rest).abs())
            pos, neg = (d > thr) & (p_y > q_y), (d > thr) & (p_y < q_y)
        valid = 1.0 - torch.where(adv[:, None] > 0, pos, neg).double()
        ratio = torch.exp((lp_y - lq_y).clamp(max=20.0)).clamp(max=cap)
    per_token = -adv[:, None] * ratio * valid * lp_y
    return per_token[mask].sum() / mask.sum()


@pytest.mark.parametrize("divergence", ["binary_tv", "binary_kl", "topk_tv", "topk_kl"])
@pytest.mark.parametrize("cap", [2.0, 10.0, 20.0])
def test_dppo_is_its_authors_formula_in_value_and_gradient(divergence, cap):
    """troll.losses.dppo on the sparse rest model equals the authors' loss computed densely, in value and in the
    gradient of every logit, for every divergence and cap; the batch has masked, capped and zero-advantage tokens."""
    g = torch.Generator().manual_seed(11)
    b, t, v = 4, 5, 9
    old_logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 1.5
    logits = (old_logits + 1.2 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 3:], mask[2, 4:] = False, False
    adv = torch.tensor([1.0, -1.5, 0.0, 0.7], dtype=torch.float64)
    old = sparsify(old_logits.view(-1, v), tokens.view(-1), k=4, delta=1e-3)
    kept = torch.zeros(b * t, v, dtype=torch.bool)
    kept.scatter_(1, old.idx.clamp_min(0), old.mask)
    kept = kept.view(b, t, v)

    loss, metrics = dppo(logits, tokens, mask, adv, old, divergence=divergence, ratio_cap=cap)
    (grad,) = torch.autograd.grad(loss, logits)
    want = authors_dppo(logits, old_logits, tokens, mask, adv, kept, divergence, cap)
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    assert 0 < metrics["frac_active"] < 1, "some tokens masked, some not"
    log_r = (torch.log_softmax(logits, -1) - torch.log_softmax(old_logits, -1)).detach()
    ratio = log_r.gather(-1, tokens[..., None]).exp()
    assert float(ratio[mask].max()) > 2.0, "the cap binds at c = 2"


def test_dppo_ratio_cap_is_a_setting_and_refuses_below_one():
    """c truncates the weight of a token whose ratio is above it: r = 1.6 at p(y) = 0.8, q(y) = 0.5 with an allowed
    move (A < 0 pulls back), so c = 1.25 gives 1.25 and c = 10 gives 1.6; c < 1 or NaN is refused."""
    for cap, weight in ((1.25, 1.25), (10.0, 1.6), (math.inf, 1.6)):
        loss, g, _ = grad_of(dppo, *binary(0.8, 0.5, -1.0), ratio_cap=cap)
        assert loss == pytest.approx(weight * math.log(0.8), abs=1e-12)
    for bad in (0.5, math.nan, True):
        with pytest.raises(ValueError, match="ratio_cap"):
            dppo(*binary(0.8, 0.5, -1.0), ratio_cap=bad)


def test_gspo_clip_range_is_the_papers_at_sequence_level():
    """At level="sequence" ppo_clip's unset range is GSPO's (3e-4, 4e-4), not PPO's 0.2: a sequence ratio of
    1.01 is clipped (flat, no gradient) under GSPO's range and not under 0.2. Per token the default stays 0.2."""
    logits, tokens, mask, adv, old = binary(0.505, 0.5, 1.0)  # r = 1.01
    cases = (({}, True), ({"eps_low": 3e-4, "eps_high": 4e-4}, True), ({"eps_low": 0.2, "eps_high": 0.2}, False))
    for kw, clipped in cases:
        loss, m = ppo_clip(logits, tokens, mask, adv, old, level="sequence", **kw)
        (g,) = torch.autograd.grad(loss, logits)
        assert m["frac_active"] == (1.0 if clipped else 0.0), kw
        assert float(loss.detach()) == pytest.approx(-(1.0004 if clipped else 1.01), abs=1e-12), kw
        assert (g.abs().max() == 0) == clipped, kw
    loss, m = ppo_clip(logits, tokens, mask, adv, old)  # per token: 0.2, not clipped
    assert m["frac_active"] == 0.0 and float(loss.detach()) == pytest.approx(-1.01, abs=1e-12)


def test_the_baselines_defaults_and_where_they_come_from():
    """Each baseline's default, locked to where it comes from (docs/algorithm.md, section 6):
    - DPPO's ratio cap c = 10: the fallback in sail-sg/Stable-RL's compute_policy_loss_with_mask,
      config.get("clip_ratio_c", 10.0) (verl's merged dppo_tv / dppo_kl: 20). It is not what their runs get unset:
      their config's own clip_ratio_c (dual-clip PPO's constant) defaults to 3.0 and wins, and verl's DPPO example
      sets 10000, no cap in effect. The studies sweep 2, 10, 20 and 10000 and keep 10 (docs/algorithm.md, section
      6); thresholds 0.15 (TV) and 0.05 (KL): the authors' and verl's DPPO run scripts;
    - GSPO's clip range (3e-4, 4e-4): the GSPO paper, section 5.1 (and verl's GSPO recipe scripts);
    - CISPO's eps_high 0.2 (cap 1.2): verl's CISPO example (clip_ratio_high=0.2, clip_ratio_low=10: no lower bound);
      the MiniMax-M1 paper tunes only this bound and gives no value;
    - PPO's 0.2 / 0.2.
    The trainer's config holds the same values (troll.base.config imports no torch)."""
    from troll import losses
    from troll.base import config

    assert losses.DPPO_RATIO_CAP == 10.0
    assert losses.DPPO_THRESHOLDS == {"binary_tv": 0.15, "binary_kl": 0.05, "topk_tv": 0.15, "topk_kl": 0.05}
    assert losses.CLIP_RANGE == {"token": (0.2, 0.2), "sequence": (3e-4, 4e-4)}
    defaults = {
        name: {k: v.default for k, v in inspect.signature(fn).parameters.items()} for name, fn in LOSSES.items()
    }
    assert defaults["dppo"]["ratio_cap"] == losses.DPPO_RATIO_CAP and defaults["dppo"]["divergence"] == "binary_tv"
    assert defaults["cispo"]["eps_high"] == 0.2
    assert (config.DPPO_CAP, config.CLIP_RANGE) == (losses.DPPO_RATIO_CAP, losses.CLIP_RANGE)
    assert config.Config(loss="dppo").loss_kwargs()["ratio_cap"] == 10.0
    assert config.Config(loss="cispo").loss_kwargs()["eps_high"] == 0.2
    gspo = config.Config(loss="ppo_clip", level="sequence").loss_kwargs()
    assert (gspo["eps_low"], gspo["eps_high"]) == (3e-4, 4e-4)


# --- TROLL ----------------------------------------------------------------------------------------------


def test_troll_on_a_two_token_case_matches_the_formula():
    """p = (0.9, 0.1), q = (0.5, 0.5): KL(p||q) = 0.368 > eps. pi_t = q^(1-t) p^t / Z with KL(pi_t||q) = eps
    (root found with brentq); L = -A pi*(y)/q(y) + alpha KL(p || pi*)."""
    p, q, eps, adv = [0.9, 0.1], [0.5, 0.5], 0.05, 1.5

    def pi(t):
        w = [q[i] ** (1 - t) * p[i] ** t for i in range(2)]
        return [x / sum(w) for x in w]

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))

    t_star = brentq(lambda t: kl(pi(t), q) - eps, 1e-9, 1.0, xtol=1e-15)
    star = pi(t_star)
    expected = -adv * star[0] / q[0] + 1.0 * kl(p, star)
    loss, m = troll_loss(*binary(0.9, 0.5, adv), eps=eps, delta=0.0)
    assert float(loss.detach()) == pytest.approx(expected, abs=1e-9)
    assert m["frac_active"] == 1.0 and m["kl_after_max"] == pytest.approx(eps, abs=1e-9)
    assert m["kl_before_max"] == pytest.approx(kl(p, q), abs=1e-12)
    assert m["regression"] == pytest.approx(kl(p, star), abs=1e-9)


def test_troll_inside_region_is_the_importance_weighted_policy_gradient():
    g = torch.Generator().manual_seed(0)
    b, t, v = 3, 4, 6
    base = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    logits = (base + 0.01 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    old_logp = torch.log_softmax(base, -1)
    old = sparsify(old_logp.view(-1, v), tokens.view(-1), k=v, delta=0.0)
    loss, m = troll_loss(logits, tokens, mask, adv, old, delta=0.0)
    assert m["frac_active"] == 0.0 and m["regression"] == 0.0
    (g_troll,) = torch.autograd.grad(loss, logits)
    # The plain importance-weighted policy gradient, written out directly:
    logp_y = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    ratio = (logp_y - old_logp.gather(-1, tokens[..., None])[..., 0]).exp()
    plain = (-adv[:, None] * ratio * mask).sum() / mask.sum()
    (g_plain,) = torch.autograd.grad(plain, logits)
    assert float(loss.detach()) == pytest.approx(float(plain.detach()), abs=1e-12)
    torch.testing.assert_close(g_troll, g_plain, atol=1e-12, rtol=0)


def ragged_batch(seed=0, b=3, t=4, v=7, old_logits=False):
    """Float64 batch with active and inactive tokens, dropped tails and ragged masks (or just its old logits)."""
    g = torch.Generator().manual_seed(seed)
    old_logits_ = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    if old_logits:
        return old_logits_
    old_logits = old_logits_
    scale = torch.tensor([2.0, 0.01, 2.0, 0.01], dtype=torch.float64)[:t].view(1, t, 1)
    logits = (old_logits + scale * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)[:b, :t]
    old = sparsify(old_logits.view(-1, v), tokens.view(-1), k=4, delta=1e-3)
    return logits, tokens, mask, torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:b], old


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_the_textbook_clip_is_ppo_clip_in_value_and_gradient(agg):
    """troll.tools.watch.textbook_clip, the reference the update comparison times (whole logits, one log-softmax), is
    this repository's ppo_clip per token: the same loss, clip share and gradient, in float64 on a ragged batch."""
    from troll.tools.watch import textbook_clip

    logits, tokens, mask, adv, old = ragged_batch()
    ours, m = ppo_clip(logits, tokens, mask, adv, old, k=4, delta=1e-3, agg=agg, norm_len=5)
    (g_ours,) = torch.autograd.grad(ours, logits)
    ref, r = textbook_clip(logits, tokens, mask, adv, old, eps_low=0.2, eps_high=0.2, agg=agg, norm_len=5, k=4)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert 0 < m["frac_active"] < 1 and r["frac_active"] == pytest.approx(m["frac_active"])
    torch.testing.assert_close(ref, ours, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_ref, g_ours, rtol=1e-10, atol=1e-12)
    for refused in ({"level": "sequence"}, {"behaviour_logp": torch.zeros(mask.shape)}):
        with pytest.raises(ValueError, match="per token"):
            textbook_clip(logits, tokens, mask, adv, old, **refused)


@pytest.mark.parametrize("level,agg", [("token", "token-mean"), ("sequence", "seq-mean-token-mean")])
def test_troll_policy_term_gradcheck_end_to_end(level, agg):
    """The policy term has no stop-gradient: its autograd gradient (through sparsify, the union, the projection
    and the implicit dual gradient) must equal finite differences of its value."""
    logits, tokens, mask, adv, old = ragged_batch()
    _, m = troll_loss(logits, tokens, mask, adv, old, k=4, delta=1e-3)
    assert 0 < m["frac_active"] < 1 and m["dual_support_size_mean"] < 2 * 4 + 2
    assert torch.autograd.gradcheck(
        lambda x: troll_loss(x, tokens, mask, adv, old, k=4, delta=1e-3, level=level, agg=agg, alpha=0.0)[0], (logits,)
    )


def test_troll_regression_term_gradient_treats_projection_as_constant():
    """alpha * KL(p || sg(pi*)): its gradient is that of KL(p || c) with c = pi* frozen (checked by gradcheck)."""
    logits, tokens, mask, adv, old = ragged_batch(seed=3)
    b, t, v = logits.shape
    full, _ = troll_loss(logits, tokens, mask, adv, old, k=4, delta=1e-3, alpha=2.0)
    policy_only, _ = troll_loss(logits, tokens, mask, adv, old, k=4, delta=1e-3, alpha=0.0)
    (g_full,) = torch.autograd.grad(full, logits)
    (g_pol,) = torch.autograd.grad(policy_only, logits)
    with torch.no_grad():
        proj = project_sparse(build_support(logits.view(-1, v), tokens.view(-1), old), 0.05)
        frozen = proj.logp.clone()

    def reg(x):
        s = build_support(x.view(-1, v), tokens.view(-1), old)
        tok_kl = atom_kl(s.lp, frozen, s.mask).view(b, t)
        return 2.0 * (tok_kl * mask).sum() / mask.sum()

    x = logits.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(reg, (x,))
    (g_reg,) = torch.autograd.grad(reg(x), x)
    torch.testing.assert_close(g_full - g_pol, g_reg)


def test_troll_rest_model_regression_term_is_the_dense_kl():
    """Rest model: KL(p || sg(pi*)) over the atoms equals the full-vocabulary KL(p || pi*), where pi* keeps p's
    shape inside the rest atom (the within-rest terms cancel); the ratio uses the exact q(y)."""
    logits, tokens, mask, adv, old = ragged_batch(seed=6)
    b, t, v = logits.shape
    _, m = troll_loss(logits, tokens, mask, adv, old)
    s = build_support(logits.detach().view(-1, v), tokens.view(-1), old)
    proj = project_sparse(s, 0.05)
    assert proj.dual.active.any() and s.mask[:, -1].all()
    lp = torch.log_softmax(logits.detach().view(-1, v), -1)
    dense = []
    for r in range(b * t):
        kept = old.idx[r][old.mask[r]]
        pi = lp[r] - s.lp[r, -1] + proj.logp[r, -1]
        pi[kept] = proj.logp[r, : len(kept)]
        dense.append(float((lp[r].exp() * (lp[r] - pi)).sum()))
    dense = torch.tensor(dense, dtype=torch.float64).view(b, t)
    assert m["regression"] == pytest.approx(float((dense * mask).sum() / mask.sum()), abs=1e-12)
    lq_y = torch.log_softmax(ragged_batch(seed=6, old_logits=True), -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(s.lq_y.view(b, t), lq_y, atol=1e-13, rtol=0)


def test_gspo_sequence_ratio_straight_through():
    """Value: s_i = exp(mean_t log r_t) on every token; gradient: s_i * d log r_t (each token's own)."""
    logits, tokens, mask, adv, old = ragged_batch(seed=1)
    _, m = ppo_clip(logits, tokens, mask, adv, old, level="sequence", eps_low=10.0, eps_high=10.0)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    b, t = tokens.shape
    old_logits = ragged_batch(seed=1, old_logits=True)
    log_q = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None])[..., 0]  # exact, dense
    log_r = (logp - log_q) * mask
    s = torch.exp(log_r.sum(-1) / mask.sum(-1))
    expected = -(adv * s).mean()  # seq-mean-token-mean of a per-sequence constant
    loss, _ = ppo_clip(
        logits, tokens, mask, adv, old, level="sequence", eps_low=10.0, eps_high=10.0, agg="seq-mean-token-mean"
    )
    assert float(loss) == pytest.approx(float(expected), abs=1e-12)
    (g1,) = torch.autograd.grad(loss, logits)
    (g2,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(g1, g2)
    assert m["ratio_max"] == pytest.approx(float(s.max()))


GSPO_LENGTHS = (7, 1, 4, 2, 6, 3)  # ragged: a token mean weighs the 7-token response 7 times the 1-token one


def gspo_batch(seed=0, v=5):
    """Float64 responses of the lengths above (right-padded). Responses 0, 2 and 5 move by ~1e-5 (s_i inside GSPO's
    range), the others by ~0.3 (s_i outside it): with these advantages one is clipped flat (3: s = 0.74, A < 0),
    two keep the pessimistic unclipped branch (1: s = 1.35, A < 0; 4: s = 0.93, A > 0)."""
    g = torch.Generator().manual_seed(seed)
    b, t = len(GSPO_LENGTHS), max(GSPO_LENGTHS)
    old_logits = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2
    scale = torch.tensor([1e-5, 0.3, 1e-5, 0.3, 0.3, 1e-5], dtype=torch.float64).view(b, 1, 1)
    logits = (old_logits + scale * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.arange(t)[None, :] < torch.tensor(GSPO_LENGTHS)[:, None]
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.7, -1.0], dtype=torch.float64)
    old = sparsify(old_logits.view(-1, v), tokens.view(-1), k=3, delta=1e-3)
    return logits, tokens, mask, adv, old, old_logits


def gspo_from_the_paper(logits, old_logits, tokens, mask, adv, eps_low=3e-4, eps_high=4e-4):
    """-J_GSPO, written from the GSPO paper's equation (Zheng et al. 2025), dense, one response at a time:
    J = (1/G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i), s_i = (pi(y_i|x) / pi_old(y_i|x))^(1/|y_i|),
    pi(y_i|x) the product of the response's token probabilities. Also returns each s_i (no gradient)."""
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    logp_old = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None])[..., 0]
    terms, ratios = [], []
    for i in range(len(adv)):
        real = mask[i]
        s_i = torch.exp((logp[i][real].sum() - logp_old[i][real].sum()) / real.sum())
        terms.append(torch.minimum(s_i * adv[i], torch.clamp(s_i, 1 - eps_low, 1 + eps_high) * adv[i]))
        ratios.append(float(s_i))
    return -torch.stack(terms).mean(), torch.tensor(ratios, dtype=torch.float64)


def test_gspo_is_the_papers_mean_over_sequences_by_default():
    """ppo_clip(level="sequence") with nothing else given is GSPO's objective: the paper's range and its mean over
    the responses, each counted once whatever its length (as verl's compute_policy_loss_gspo, which hard-codes
    seq-mean-token-mean), in value and gradient, against the independent formula above on ragged responses where
    all three branches occur. The token mean, the default before, weighs responses by length: another value."""
    logits, tokens, mask, adv, old, old_logits = gspo_batch()
    expected, s = gspo_from_the_paper(logits, old_logits, tokens, mask, adv)
    inside = (s >= 1 - 3e-4) & (s <= 1 + 4e-4)
    flat = ~inside & (((adv > 0) & (s > 1)) | ((adv < 0) & (s < 1)))  # clip binds: no gradient
    assert inside.tolist() == [True, False, True, False, False, True]
    assert flat.tolist() == [False, False, False, True, False, False]
    loss, m = ppo_clip(logits, tokens, mask, adv, old, level="sequence")
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
    (g,) = torch.autograd.grad(loss, logits)
    (g_ref,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0)
    assert g[3].abs().max() == 0 and all(g[i].abs().max() > 0 for i in (0, 1, 2, 4, 5))
    assert m["ratio_max"] == pytest.approx(float(s.max()), abs=1e-12)
    named, _ = ppo_clip(logits, tokens, mask, adv, old, level="sequence", agg="seq-mean-token-mean")
    assert torch.equal(loss, named)
    token_mean, _ = ppo_clip(logits, tokens, mask, adv, old, level="sequence", agg="token-mean")  # a given agg wins
    assert abs(float(token_mean.detach()) - float(expected.detach())) > 0.05
    per_token, _ = ppo_clip(logits, tokens, mask, adv, old)  # per token the default stays the token mean
    named, _ = ppo_clip(logits, tokens, mask, adv, old, agg="token-mean")
    assert torch.equal(per_token, named)


def test_troll_at_sequence_level_is_a_mean_over_sequences_by_default():
    """troll_loss(level="sequence") defaults to seq-mean-token-mean for both terms: the policy term -mean_i A_i s_i
    with TROLL's projected ratios, the regression term mean_i of each response's mean KL(p || sg(pi*)). Bit for bit
    the named mode; with nothing projected (eps large) the policy term is GSPO's unclipped objective from the
    paper's formula. The token mean gives another value. The library's and the config's defaults are one table."""
    from troll.base import config

    logits, tokens, mask, adv, old, old_logits = gspo_batch()
    kw = dict(k=3, delta=1e-3, eps=0.01)
    loss, m = troll_loss(logits, tokens, mask, adv, old, level="sequence", **kw)
    named, m_named = troll_loss(logits, tokens, mask, adv, old, level="sequence", agg="seq-mean-token-mean", **kw)
    assert torch.equal(loss, named) and m == m_named and m["frac_active"] > 0 and m["regression"] > 0
    (g,) = torch.autograd.grad(loss, logits)
    (g_named,) = torch.autograd.grad(named, logits)
    assert torch.equal(g, g_named)
    token_mean, _ = troll_loss(logits, tokens, mask, adv, old, level="sequence", agg="token-mean", **kw)
    assert abs(float(token_mean.detach()) - float(loss.detach())) > 0.05
    free, m_free = troll_loss(logits, tokens, mask, adv, old, level="sequence", k=3, delta=1e-3, eps=50.0)
    expected, _ = gspo_from_the_paper(logits, old_logits, tokens, mask, adv, eps_low=1.0, eps_high=math.inf)
    assert m_free["frac_active"] == 0 and float(free.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
    (g_free,) = torch.autograd.grad(free, logits)
    (g_ref,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(g_free, g_ref, atol=1e-12, rtol=0)
    assert DEFAULT_AGG == config.DEFAULT_AGG == {"token": "token-mean", "sequence": "seq-mean-token-mean"}
    for fn in (troll_loss, ppo_clip):
        assert inspect.signature(fn).parameters["agg"].default is None  # resolved from level


def test_all_losses_share_one_signature_and_metric_keys():
    logits, tokens, mask, adv, old = ragged_batch(seed=2)
    keys = None
    for name, fn in LOSSES.items():
        loss, m = fn(logits, tokens, mask, adv, old, k=4, delta=1e-3)
        assert loss.dim() == 0 and math.isfinite(float(loss)), name
        (g,) = torch.autograd.grad(loss, logits)
        assert torch.isfinite(g).all() and g[~mask].abs().max() == 0, name  # padding gets no gradient
        common = {
            "policy",
            "regression",
            "kl_before_mean",
            "kl_before_max",
            "kl_after_mean",
            "kl_after_max",
            "frac_active",
            "ratio_mean",
            "ratio_min",
            "ratio_max",
            "entropy",
        }
        assert common <= m.keys(), (name, common - m.keys())
        keys = common if keys is None else keys


def test_loss_input_errors():
    logits, tokens, mask, adv, old = ragged_batch()
    with pytest.raises(ValueError, match="expected logits"):
        troll_loss(logits, tokens, mask, adv[:2], old)
    with pytest.raises(ValueError, match="old policy has"):
        troll_loss(logits[:2], tokens[:2], mask[:2], adv[:2], old)
    with pytest.raises(ValueError, match="NaN"):
        troll_loss(logits, tokens, mask, adv * math.nan, old)
    with pytest.raises(ValueError, match="aggregation"):
        troll_loss(logits, tokens, mask, adv, old, agg="mean")
    with pytest.raises(ValueError, match="level='tokens'"):
        troll_loss(logits, tokens, mask, adv, old, level="tokens")
    for alpha in (math.nan, -1.0, math.inf):
        with pytest.raises(ValueError, match="alpha"):
            troll_loss(logits, tokens, mask, adv, old, alpha=alpha)
    for eps in (0.0, math.nan, -0.1):
        with pytest.raises(ValueError, match="eps"):
            troll_loss(logits, tokens, mask, adv, old, eps=eps)
    with pytest.raises(ValueError, match="unknown sparse model"):
        troll_loss(logits, tokens, mask, adv, old, support="dense")
    with pytest.raises(ValueError, match="DPPO divergence"):
        dppo(logits, tokens, mask, adv, old, divergence="tv")
    for fn in LOSSES.values():
        with pytest.raises(ValueError, match="mask must be a bool"):
            fn(logits, tokens, mask.double(), adv, old)
        with pytest.raises(ValueError, match="mask must be a bool"):
            fn(logits, tokens, mask.long(), adv, old)


# --- aggregation and advantages ------------------------------------------------------------------------


def test_aggregation_modes_on_ragged_lengths():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0]])
    m = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    assert float(aggregate(x, m, "token-mean")) == pytest.approx((1 + 2 + 3 + 4 + 10 + 20) / 6)
    assert float(aggregate(x, m, "seq-mean-token-mean")) == pytest.approx((2.5 + 15.0) / 2)
    assert float(aggregate(x, m, "seq-mean-token-sum-norm")) == pytest.approx((10 / 4 + 30 / 4) / 2)
    assert float(aggregate(x, m, "seq-mean-token-sum-norm", norm_len=10)) == pytest.approx((1.0 + 3.0) / 2)
    assert float(aggregate(x, torch.zeros_like(m), "token-mean")) == 0.0  # no tokens: 0, not NaN


def test_grpo_by_hand_with_zero_variance_group():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5])
    grp = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    a = grpo(r, grp)
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of (1, 0, 1, 0)
    torch.testing.assert_close(a[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]) / (std + 1e-6))
    assert a[4:].abs().max() == 0  # zero-variance group and a group of one: no signal, no NaN
    torch.testing.assert_close(dr_grpo(r, grp), torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0, 0.0, 0.0]))


def test_reinforce_pp_batch_normalised():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])
    grp = torch.tensor([0, 0, 1, 1])
    d = torch.tensor([0.5, -0.5, 0.0, 0.0])  # group baseline removed
    expected = (d - d.mean()) / (d.std() + 1e-6)
    torch.testing.assert_close(reinforce_pp(r, grp), expected)
    with pytest.raises(ValueError, match="unknown advantage"):
        advantages("ppo", r, grp)
    with pytest.raises(ValueError, match="NaN"):
        grpo(torch.tensor([math.nan, 1.0]), torch.tensor([0, 0]))


# --- a toy: contextual bandit ---------------------------------------------------------------------------


def bandit_run(loss_name: str, lr: float, steps: int = 6, epochs: int = 16, seed: int = 0):
    """C contexts x V actions, a logit table as the policy; reward 1 for one good action per context.
    Each step: sample G actions per context from the current policy, GRPO advantages, `epochs` Adam steps
    on the same batch (the regime where a trust region matters). Returns, per step, the largest KL(pi* || q)
    the loss saw in any epoch (TROLL's projected policy; the network's own for clip), the max per-context
    KL(p_new || p_old) of the network after the update, and the final mean probability of the good action."""
    torch.manual_seed(seed)
    c, v, grp_size = 8, 12, 16
    table = torch.zeros(c, v, dtype=torch.float64, requires_grad=True)
    good = torch.randint(0, v, (c,))
    opt = torch.optim.Adam([table], lr=lr)
    seen, after = [], []
    for _ in range(steps):
        with torch.no_grad():
            old_logp = torch.log_softmax(table, -1).clone()
            actions = torch.distributions.Categorical(logits=old_logp).sample((grp_size,)).T  # [C, G]
        rewards = (actions == good[:, None]).double().reshape(-1)
        adv = grpo(rewards, torch.arange(c).repeat_interleave(grp_size))
        tokens = actions.reshape(-1, 1)  # B = C*G responses of one token
        old = sparsify(old_logp.repeat_interleave(grp_size, 0), tokens.view(-1), k=v, delta=0.0)
        mask = torch.ones_like(tokens, dtype=torch.bool)
        worst = 0.0
        for _ in range(epochs):
            logits = table.repeat_interleave(grp_size, 0).unsqueeze(1)
            loss, m = LOSSES[loss_name](logits, tokens, mask, adv, old, delta=0.0)
            worst = max(worst, m["kl_after_max"])
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            new_logp = torch.log_softmax(table, -1)
            after.append(float((new_logp.exp() * (new_logp - old_logp)).sum(-1).max()))
        seen.append(worst)
    return seen, after, float(torch.softmax(table, -1).gather(-1, good[:, None]).mean())


def test_bandit_trust_region_troll_vs_clip():
    """Aggressive updates (Adam lr 0.1, 16 epochs per batch). What TROLL guarantees: the policy its loss
    optimises (pi*) never leaves the eps-ball, in any epoch. The network itself is only pulled back by the
    regression term, so it may overshoot eps; clip bounds neither and drifts further."""
    eps = 0.05
    t_seen, t_after, t_reward = bandit_run("troll", lr=0.1)
    c_seen, c_after, c_reward = bandit_run("ppo_clip", lr=0.1)
    r = [round(x, 3) for x in (*t_after, *c_after)]
    print(
        f"\nmax per-context KL(new || old) of the network after each update (eps = {eps}):"
        f"\n  troll {r[:6]} (projected policy max {max(t_seen):.4f}), final p(good) {t_reward:.3f}"
        f"\n  clip  {r[6:]}, final p(good) {c_reward:.3f}"
    )
    assert max(t_seen) <= eps + 1e-9  # exact: every token of every epoch
    assert max(c_after) > 5 * eps  # clipping the ratio does not bound the KL
    assert max(t_after) < max(c_after)
    assert t_reward > 5 / 12  # TROLL learns (uniform start: 1/12)


def test_baseline_ratio_is_exact_when_the_support_is_truncated():
    """Flat rows: top-4 of 50 tokens hold ~10% of the mass, so the sparse renormalisation is large. At identical
    policies every baseline's ratio must still be exactly 1 (it divides the exact p(y) by the exact q(y)), and TROLL
    (which works on the renormalised sparse distributions of both) sees KL 0 and ratio 1 too."""
    g = torch.Generator().manual_seed(4)
    logits = (0.1 * torch.randn(2, 5, 50, generator=g, dtype=torch.float64)).requires_grad_(True)
    tokens = torch.randint(0, 50, (2, 5), generator=g)
    mask = torch.ones(2, 5, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    old = sparsify(logits.detach().view(-1, 50), tokens.view(-1), k=4, delta=1e-5)
    assert float((-old.log_rest.exp()).log1p().exp().max()) < 0.2  # the kept mass really is small
    for (name, fn), support in itertools.product(LOSSES.items(), ("rest", "paper")):
        _, m = fn(logits, tokens, mask, adv, old, k=4, support=support)
        assert m["ratio_min"] == pytest.approx(1.0, abs=1e-12) and m["ratio_max"] == pytest.approx(1.0, abs=1e-12), name
        assert m["frac_active"] == 0.0 and m["kl_before_max"] == pytest.approx(0.0, abs=1e-12), name


# --- no signal, no push -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "support, moved", [("rest", False), ("paper", False), ("rest", True)], ids=["rest", "paper", "rest-moved"]
)
@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_batch_without_signal_has_an_exactly_zero_gradient(loss, support, moved):
    """Every advantage 0: every loss's gradient is exactly 0 (not 1e-9 of rounding, which Adam would turn into a
    full step), at p = q (the first minibatch of a step; both sparse models, as the trainer builds q) and with p
    moved inside the trust region (a later minibatch), and frac_no_signal says so. A nonzero advantage on the
    same batch gives a nonzero gradient. (Under the paper's model a p moved from q may be projected for no reason,
    section 3a, and then its regression term pulls with any advantage.)"""
    gen = torch.Generator().manual_seed(0)
    B, T, V = 3, 4, 200
    old_logits = torch.randn(B * T, V, generator=gen) * 2
    tokens = torch.randint(V, (B, T), generator=gen)
    old = sparsify(old_logits, tokens.view(-1), k=64, delta=1e-5)  # troll.train's anchor at the defaults
    shift = 0.02 * torch.randn(B * T, V, generator=gen) if moved else 0.0
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 3] = False
    for adv, silent in ((torch.zeros(B), True), (torch.tensor([1.0, 0.0, -1.0]), False)):
        logits = (old_logits + shift).view(B, T, V).clone().requires_grad_(True)
        value, metrics = LOSSES[loss](logits, tokens, mask, adv, old, support=support)
        (g,) = torch.autograd.grad(value, logits)
        assert (g == 0).all() == silent and metrics["frac_no_signal"] == pytest.approx(1.0 if silent else 4 / 11)
        if silent:
            assert value.item() == 0.0


def test_troll_regression_term_is_zero_where_nothing_is_projected():
    """An inactive token (KL(p || q) <= eps) adds exactly 0 to the regression term, in value and gradient; an
    active one adds KL(p || pi*) > 0."""
    logits, tokens, mask, _, old = binary(0.52, 0.5, 0.0)  # KL 8e-4 < eps: inactive
    _, g, m = grad_of(troll_loss, logits, tokens, mask, torch.zeros(1, dtype=torch.float64), old)
    assert m["frac_active"] == 0.0 and m["regression"] == 0.0 and (g == 0).all()
    logits, tokens, mask, _, old = binary(0.9, 0.5, 0.0)  # KL 0.37 > eps: projected
    _, g, m = grad_of(troll_loss, logits, tokens, mask, torch.zeros(1, dtype=torch.float64), old)
    assert m["frac_active"] == 1.0 and m["regression"] > 0 and g.abs().max() > 0
