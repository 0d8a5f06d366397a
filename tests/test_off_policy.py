"""Off-policy data in the losses: the decoupled objective's weight w = sg(min(q(y) / mu(y), is_cap)), and TRL's modes
(troll.integrations.is_weights: token / sequence, truncate / mask), handed to the losses as is_weight.

Expected numbers are derived by hand from docs/algorithm.md (section 10) or computed in float64 from dense
log-softmaxes written out here, never read back from troll.losses."""

import math

import pytest
import torch
from scipy.optimize import brentq

from troll.integrations.is_weights import trl_is_weight
from troll.losses import LOSSES, cispo, dppo, ppo_clip, troll_loss
from troll.sparse import sparsify


def binary(p_y: float, q_y: float, adv: float):
    """One token over V = 2 with y = 0: logits (float64 leaf) with p(y) = p_y, old q(y) = q_y."""
    logits = torch.tensor([p_y, 1 - p_y], dtype=torch.float64).log().view(1, 1, 2).requires_grad_(True)
    tokens = torch.tensor([[0]])
    old = sparsify(torch.tensor([[q_y, 1 - q_y]], dtype=torch.float64).log(), tokens.view(-1), k=2, delta=0.0)
    return logits, tokens, torch.ones(1, 1, dtype=torch.bool), torch.tensor([adv], dtype=torch.float64), old


def mu(value: float) -> torch.Tensor:
    return torch.tensor([[math.log(value)]], dtype=torch.float64)


def value_and_grad(fn, args, **kw):
    loss, metrics = fn(*args, **kw)
    (g,) = torch.autograd.grad(loss, args[0])
    return float(loss.detach()), g.view(-1), metrics


def score(p_y: float) -> torch.Tensor:
    """d log p(y) / d logits for V = 2, y = 0: onehot(y) - p."""
    return torch.tensor([1 - p_y, -(1 - p_y)], dtype=torch.float64)


# --- hand-computed single tokens ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn,p_y,adv,mu_y,cap,w,base,grad_factor",
    [
        # ppo_clip, r = 1.2 (edge, unclipped): L = -w r A; dL/dz = -w A r (onehot - p)
        (ppo_clip, 0.60, 1.0, 0.25, math.inf, 2.0, -1.2, -1.2),  # w = 0.5 / 0.25 = 2
        (ppo_clip, 0.60, 1.0, 0.25, 1.5, 1.5, -1.2, -1.2),  # truncated: w = the cap
        (ppo_clip, 0.65, 1.0, 0.40, math.inf, 1.25, -1.2, 0.0),  # r = 1.3 clipped at 1.2: flat
        (ppo_clip, 0.65, -1.0, 0.80, math.inf, 0.625, 1.3, 1.3),  # pessimistic branch keeps the gradient
        # dppo, D = 0.05 < 0.15: L = -w A r log p(y); dL/dz = -w A r (onehot - p)
        (dppo, 0.55, 1.0, 0.40, math.inf, 1.25, -1.1 * math.log(0.55), -1.1),
        # cispo, r = 1.6 capped at 1.2: L = -w A 1.2 log p(y)
        (cispo, 0.80, 2.0, 0.625, math.inf, 0.8, -2.4 * math.log(0.8), -2.4),
        (cispo, 0.80, 2.0, 0.10, 3.0, 3.0, -2.4 * math.log(0.8), -2.4),  # q / mu = 5, capped at 3
        # troll inside the ball (KL(p || q) = 8e-4 < eps): pi* = p, L = -w A p / q, no regression
        (troll_loss, 0.52, 1.0, 0.40, math.inf, 1.25, -1.04, -1.04),
        (troll_loss, 0.52, -1.0, 0.25, 1.0, 1.0, 1.04, 1.04),  # cap 1: w = min(2, 1)
    ],
)
def test_weighted_losses_by_hand(fn, p_y, adv, mu_y, cap, w, base, grad_factor):
    """Every q(y) is 0.5. Value: w times the uncorrected loss; gradient: w times the uncorrected gradient (w is a
    constant). A capped weight equals the cap exactly."""
    args = binary(p_y, 0.5, adv)
    loss, g, m = value_and_grad(fn, args, behaviour_logp=mu(mu_y), is_cap=cap)
    assert loss == pytest.approx(w * base, abs=1e-12)
    torch.testing.assert_close(g, w * grad_factor * score(p_y), atol=1e-12, rtol=0)
    assert m["is_weight_mean"] == m["is_weight_max"] == pytest.approx(w, abs=1e-12)
    assert m["is_frac_truncated"] == (1.0 if 0.5 / mu_y > cap else 0.0)
    if 0.5 / mu_y > cap:
        assert m["is_weight_max"] == cap  # exactly the cap, not exp(log cap)


def test_troll_active_projection_weighted():
    """p = (0.9, 0.1), q = (0.5, 0.5): projected (KL 0.368 > eps). With mu(y) = 0.4, w = 1.25:
    L = -w A pi*(y) / q(y) + alpha KL(p || pi*) (pi* from brentq on the interpolation), and only the policy term's
    gradient is scaled by w."""
    p, q, eps, adv, w = [0.9, 0.1], [0.5, 0.5], 0.05, 1.5, 1.25

    def pi(t):
        x = [q[i] ** (1 - t) * p[i] ** t for i in range(2)]
        return [v / sum(x) for v in x]

    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b, strict=True))

    star = pi(brentq(lambda t: kl(pi(t), q) - eps, 1e-9, 1.0, xtol=1e-15))
    args = binary(0.9, 0.5, adv)
    loss, g, m = value_and_grad(troll_loss, args, eps=eps, delta=0.0, behaviour_logp=mu(0.4))
    assert loss == pytest.approx(-w * adv * star[0] / q[0] + kl(p, star), abs=1e-9)
    assert m["frac_active"] == 1.0 and m["regression"] == pytest.approx(kl(p, star), abs=1e-9)
    _, g_policy, _ = value_and_grad(troll_loss, args, eps=eps, delta=0.0, alpha=0.0)
    _, g_full, _ = value_and_grad(troll_loss, args, eps=eps, delta=0.0)
    torch.testing.assert_close(g, w * g_policy + (g_full - g_policy), atol=1e-12, rtol=0)


# --- the weight's modes by hand (docs/algorithm.md, 10f) ------------------------------------------------------

# Three responses of two tokens over V = 2, y = 0 everywhere, p = q = (0.5, 0.5): every ratio is 1, nothing is
# projected or clipped, so the loss is token-mean(-w A) (named at every level, as TRL's default loss_type dapo
# does; sequence's own default is a mean over responses) and its gradient at each token -w A (onehot(y) - p) / 5.
# rho = q(y) / mu(y) per token (response 2 has one real token); with floor 0.6 and cap 2:
RHO = [[2.5, 1.0], [1.25, 0.4], [1.2, 1.0]]
ADV = [1.0, -2.0, 0.5]
HAND = [  # (mode, level, w per token, share of real tokens outside [0.6, 2])
    ("truncate", "token", [[2.0, 1.0], [1.25, 0.6], [1.2, 0.0]], 0.4),  # clamp(rho, 0.6, 2)
    ("token_truncate", "sequence", [[2.0, 1.0], [1.25, 0.6], [1.2, 0.0]], 0.4),  # per token at every level
    ("token_mask", "token", [[0.0, 1.0], [1.25, 0.0], [1.2, 0.0]], 0.4),  # rho, or 0 outside
    # R = prod_t rho = (2.5, 0.5, 1.2): clamped to (2, 0.6, 1.2), or masked to (0, 0, 1.2)
    ("sequence_truncate", "token", [[2.0, 2.0], [0.6, 0.6], [1.2, 0.0]], 0.8),
    ("sequence_mask", "token", [[0.0, 0.0], [0.0, 0.0], [1.2, 0.0]], 0.8),
    # GSPO: the geometric mean per response, sqrt(2.5) and sqrt(0.5), inside the bounds
    ("truncate", "sequence", [[2.5**0.5] * 2, [0.5**0.5] * 2, [1.2, 0.0]], 0.0),
]


@pytest.mark.parametrize("fn", [troll_loss, ppo_clip])
@pytest.mark.parametrize(("mode", "level", "w", "frac"), HAND)
def test_weight_modes_by_hand(fn, mode, level, w, frac):
    """TRL's mode gives the weight (trl_is_weight, from log q(y) - log mu(y)) and its metrics; the loss weighs by it."""
    logits = torch.full((3, 2, 2), math.log(0.5), dtype=torch.float64, requires_grad=True)
    tokens = torch.zeros(3, 2, dtype=torch.long)
    mask = torch.tensor([[True, True], [True, True], [True, False]])
    old = sparsify(torch.full((6, 2), math.log(0.5), dtype=torch.float64), tokens.view(-1), k=2, delta=0.0)
    lmu = (0.5 / torch.tensor(RHO, dtype=torch.float64)).log()  # mu(y) = q(y) / rho
    adv = torch.tensor(ADV, dtype=torch.float64)
    lq_y = old.logp_at(tokens.view(-1)).view(tokens.shape)
    weight, m = trl_is_weight(lq_y - lmu, mask, is_mode=mode, is_cap=2.0, is_floor=0.6, level=level)
    args = (logits, tokens, mask, adv, old)
    loss, g, m_loss = value_and_grad(fn, args, level=level, agg="token-mean", is_weight=weight)
    assert not any(key.startswith("is_") for key in m_loss)  # a handed-in weight's metrics are its maker's
    w = torch.tensor(w, dtype=torch.float64)
    assert loss == pytest.approx(float(-(w * adv[:, None]).sum() / 5), abs=1e-12)
    grad = -(w * adv[:, None])[..., None] * torch.tensor([0.5, -0.5], dtype=torch.float64) / 5
    torch.testing.assert_close(g, grad.view(-1), atol=1e-12, rtol=0)
    assert m["is_frac_truncated"] == pytest.approx(frac, abs=1e-12)
    assert m["is_weight_max"] == pytest.approx(float(w[mask].max()), abs=1e-12)
    assert m["is_weight_mean"] == pytest.approx(float(w[mask].mean()), abs=1e-12)


@pytest.mark.parametrize(
    ("name", "level"), [(name, "token") for name in sorted(LOSSES)] + [("troll", "sequence"), ("ppo_clip", "sequence")]
)
def test_trl_truncate_is_the_losses_own_weight_bit_for_bit(name, level):
    """TRL's "truncate" without a floor is the plain loop's capped weight: handed in as is_weight it gives the loss,
    gradient and metrics of behaviour_logp with is_cap, bit for bit."""
    logits, tokens, mask, adv, old, _, lmu = batch(seed=3)
    kw = {"level": level} if name in ("troll", "ppo_clip") else {}
    own, m_own = LOSSES[name](logits, tokens, mask, adv, old, behaviour_logp=lmu, is_cap=1.5, **kw)
    lq_y = old.logp_at(tokens.view(-1)).view(tokens.shape)
    weight, m_weight = trl_is_weight(lq_y - lmu, mask, is_cap=1.5, level=level)
    given, m_given = LOSSES[name](logits, tokens, mask, adv, old, is_weight=weight, **kw)
    assert torch.equal(own, given) and m_own == m_given | m_weight and 0 < m_weight["is_frac_truncated"] < 1
    (g_own,) = torch.autograd.grad(own, logits)
    (g_given,) = torch.autograd.grad(given, logits)
    assert torch.equal(g_own, g_given)


def test_bad_weight_modes_are_refused():
    """TRL's modes: an unknown mode, a floor outside [0, 1], a cap below 1 are refused by trl_is_weight; a loss
    refuses a handed-in weight that is no [B, T] float tensor, not finite or negative on a real token, or that
    comes with behaviour_logp or is_cap (each of which shapes a weight of the loss's own)."""
    logits, tokens, mask, adv, old, _, lmu = batch()
    log_rho = old.logp_at(tokens.view(-1)).view(tokens.shape) - lmu
    with pytest.raises(ValueError, match="unknown is_mode"):
        trl_is_weight(log_rho, mask, is_mode="per_token")
    for floor in (-0.1, 1.5, math.nan, True):
        with pytest.raises(ValueError, match="is_floor"):
            trl_is_weight(log_rho, mask, is_floor=floor)
    for cap in (0.5, math.nan, True):
        with pytest.raises(ValueError, match="is_cap"):
            trl_is_weight(log_rho, mask, is_cap=cap)
    weight, _ = trl_is_weight(log_rho, mask, is_mode="token_mask", is_cap=2.0)
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        troll_loss(logits, tokens, mask, adv, old, is_weight=weight, is_cap=2.0)
    with pytest.raises(ValueError, match="pass one of them"):
        troll_loss(logits, tokens, mask, adv, old, is_weight=weight, behaviour_logp=lmu)
    for bad, match in ((weight[:, :2], "is_weight must have the shape"), (weight > 0, "is_weight must be a float"),
                       (-weight, "is_weight is negative"), (weight * math.nan, "is_weight contains NaN")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            troll_loss(logits, tokens, mask, adv, old, is_weight=bad)


# --- batches against a float64 dense reference ----------------------------------------------------------


def batch(seed: int = 0, b: int = 3, t: int = 4, v: int = 6, scale: float = 0.05):
    """Float64 batch: old logits, current logits near them, ragged mask, and behaviour log-probs log q(y) + noise
    (q / mu spans about 0.3 to 3), NaN on padding (never read)."""
    g = torch.Generator().manual_seed(seed)
    old_logits = torch.randn(b, t, v, generator=g, dtype=torch.float64)
    logits = (old_logits + scale * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    tokens = torch.randint(0, v, (b, t), generator=g)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)[:b, :t]
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)[:b]
    old = sparsify(old_logits.view(-1, v), tokens.view(-1), k=v, delta=0.0)
    lq_y = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None])[..., 0]
    lmu = (lq_y + 1.1 * torch.randn(b, t, generator=g, dtype=torch.float64)).masked_fill(~mask, math.nan)
    return logits, tokens, mask, adv, old, old_logits, lmu


def reference(name, logits, tokens, mask, adv, old_logits, lmu, cap, agg, level="token"):
    """The corrected loss written out densely in float64 from docs/algorithm.md; returns (loss, w [B, T])."""
    lp_y = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    lq_y = torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None])[..., 0]
    m = mask.double()
    log_w = torch.where(mask, lq_y - lmu, 0.0)
    if level == "sequence":
        log_w = ((log_w * m).sum(-1) / m.sum(-1))[:, None].expand_as(log_w)
    w = torch.minimum(log_w.exp(), torch.tensor(cap, dtype=torch.float64))
    r = (lp_y - lq_y).exp()
    a = adv[:, None]
    if level == "sequence":  # GSPO, clipping off: per response -w_i A_i s_i, s_i = exp(mean_t log r_t)
        s = ((lp_y - lq_y) * m).sum(-1) / m.sum(-1)
        assert agg == "seq-mean-token-mean"
        return -(w[:, 0] * adv * s.exp()).mean(), w
    if name == "troll":  # inside the ball: pi* = p
        x = -w * a * r
    elif name == "ppo_clip":
        x = -w * torch.minimum(r * a, r.clamp(0.8, 1.2) * a)
    elif name == "dppo":
        d = (lp_y.exp() - lq_y.exp()).abs()
        blocked = ((a > 0) & (d > 0.15) & (r > 1)) | ((a < 0) & (d > 0.15) & (r < 1))
        x = -w * a * r.detach().clamp_max(2.0) * (~blocked) * lp_y
    else:  # cispo
        x = -w * a * r.detach().clamp_max(1.2) * lp_y
    x = torch.where(mask, x, 0.0)
    if agg == "token-mean":
        return x.sum() / m.sum(), w
    return (x.sum(-1) / m.sum(-1)).mean(), w


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("cap", [math.inf, 1.5])
def test_token_level_against_dense_reference(name, agg, cap):
    logits, tokens, mask, adv, old, old_logits, lmu = batch(scale=0.3)
    kw = {"eps": 0.5} if name == "troll" else {}  # a wide ball: nothing projected, pi* = p
    loss, m = LOSSES[name](logits, tokens, mask, adv, old, agg=agg, behaviour_logp=lmu, is_cap=cap, **kw)
    if name == "troll":
        assert m["frac_active"] == 0.0
    expected, w = reference(name, logits, tokens, mask, adv, old_logits, lmu, cap, agg)
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
    (g,) = torch.autograd.grad(loss, logits)
    (g_ref,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0)
    raw = torch.where(mask, (torch.log_softmax(old_logits, -1).gather(-1, tokens[..., None])[..., 0] - lmu), 0).exp()
    assert m["is_weight_mean"] == pytest.approx(float(w[mask].mean()), abs=1e-12)
    assert m["is_weight_max"] == pytest.approx(float(w[mask].max()), abs=1e-12)
    assert m["is_frac_truncated"] == pytest.approx(float((raw[mask] > cap).double().mean()), abs=1e-12)
    if cap < math.inf:
        assert 0 < m["is_frac_truncated"] < 1 and m["is_weight_max"] == cap  # the batch has both kinds
    else:
        assert m["is_weight_max"] > 1.5 and m["is_frac_truncated"] == 0.0


@pytest.mark.parametrize("name", ["troll", "ppo_clip"])
@pytest.mark.parametrize("cap", [math.inf, 1.5])
def test_sequence_level_weight_matches_gspo_ratio(name, cap):
    """level="sequence": w_i = min(exp(mean_t log(q / mu)), cap) per response; with clipping out of the way the
    loss is -mean_i(w_i A_i s_i) (seq-mean-token-mean), value and gradient."""
    logits, tokens, mask, adv, old, old_logits, lmu = batch(seed=3)  # w_i = (2.56, 0.12, 1.19)
    kw = {"eps": 5.0} if name == "troll" else {"eps_low": 0.99, "eps_high": 10.0}
    loss, m = LOSSES[name](
        logits,
        tokens,
        mask,
        adv,
        old,
        level="sequence",
        agg="seq-mean-token-mean",
        behaviour_logp=lmu,
        is_cap=cap,
        **kw,
    )
    expected, w = reference(name, logits, tokens, mask, adv, old_logits, lmu, cap, "seq-mean-token-mean", "sequence")
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), abs=1e-12)
    (g,) = torch.autograd.grad(loss, logits)
    (g_ref,) = torch.autograd.grad(expected, logits)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0)
    assert m["is_weight_mean"] == pytest.approx(float(w[mask].mean()), abs=1e-12)  # token-weighted
    assert m["is_weight_max"] == pytest.approx(float(w[:, 0].max()), abs=1e-12)
    if cap < math.inf:  # response 0 (4 of the 8 real tokens) is capped
        assert m["is_frac_truncated"] == 0.5 and m["is_weight_max"] == cap


TOKEN_AGGS = [("token", "token-mean"), ("token", "seq-mean-token-sum-norm")]
SEQUENCE_AGG = [("sequence", "seq-mean-token-mean")]


@pytest.mark.parametrize(
    "name,level,agg",
    [(name, *la) for name in sorted(LOSSES) for la in TOKEN_AGGS]
    + [(name, *la) for name in ("troll", "ppo_clip") for la in SEQUENCE_AGG],
)
def test_weight_one_is_the_uncorrected_loss_bit_for_bit(name, level, agg):
    """behaviour_logp = log q(y) (the old policy's own value at y): w = 1 exactly, so loss, gradient and every
    metric equal the uncorrected ones bit for bit; without behaviour_logp there are no is_* metrics."""
    logits, tokens, mask, adv, old, _, _ = batch(seed=2, scale=1.0)
    kw = {"level": level} if name in ("troll", "ppo_clip") else {}
    lq_y = old.logp_at(tokens.view(-1)).view(tokens.shape).masked_fill(~mask, 0.0)
    plain, m0 = LOSSES[name](logits, tokens, mask, adv, old, agg=agg, **kw)
    corrected, m1 = LOSSES[name](logits, tokens, mask, adv, old, agg=agg, behaviour_logp=lq_y, **kw)
    assert torch.equal(plain, corrected)
    (g0,) = torch.autograd.grad(plain, logits)
    (g1,) = torch.autograd.grad(corrected, logits)
    assert torch.equal(g0, g1)
    assert not any(key.startswith("is_") for key in m0)
    assert m1 == m0 | {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_frac_truncated": 0.0}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_weight_is_a_constant_and_padding_is_ignored(name):
    """No gradient reaches behaviour_logp (the weight is sg(.)), and padding (NaN here, anything) changes nothing."""
    logits, tokens, mask, adv, old, _, lmu = batch(seed=3)
    leaf = lmu.clone().requires_grad_(True)
    loss, _ = LOSSES[name](logits, tokens, mask, adv, old, behaviour_logp=leaf)
    g_logits, g_mu = torch.autograd.grad(loss, (logits, leaf), allow_unused=True)
    assert g_mu is None or g_mu.abs().max() == 0
    assert torch.isfinite(g_logits).all() and g_logits[~mask].abs().max() == 0
    for fill in (0.0, math.inf, -1e30):
        other, _ = LOSSES[name](logits, tokens, mask, adv, old, behaviour_logp=lmu.masked_fill(~mask, fill))
        assert torch.equal(loss.detach(), other.detach()), fill


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_bad_behaviour_inputs_are_refused(name):
    logits, tokens, mask, adv, old, _, lmu = batch()
    fn = LOSSES[name]
    with pytest.raises(ValueError, match="behaviour_logp must have the shape"):
        fn(logits, tokens, mask, adv, old, behaviour_logp=lmu[:, :2])
    with pytest.raises(ValueError, match="behaviour_logp must be a float tensor"):
        fn(logits, tokens, mask, adv, old, behaviour_logp=tokens)
    with pytest.raises(ValueError, match="behaviour_logp must be a float tensor"):
        fn(logits, tokens, mask, adv, old, behaviour_logp=lmu.tolist())
    for bad in (math.nan, math.inf, -math.inf):
        x = lmu.clone()
        x[0, 1] = bad  # a real token
        with pytest.raises(ValueError, match="behaviour_logp contains NaN or inf"):
            fn(logits, tokens, mask, adv, old, behaviour_logp=x)
    for cap in (0.5, 0.0, -1.0, math.nan, True, "2"):
        with pytest.raises(ValueError, match="is_cap"):
            fn(logits, tokens, mask, adv, old, behaviour_logp=lmu, is_cap=cap)
    with pytest.raises(ValueError, match="needs behaviour_logp"):
        fn(logits, tokens, mask, adv, old, is_cap=2.0)
    fn(logits, tokens, mask, adv, old, behaviour_logp=lmu, is_cap=1)  # an int cap of 1 is fine


# --- bias: the expected gradient under mu-sampled data --------------------------------------------------


Q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)  # pi_old, the anchor
MU = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)  # the sampler
REWARD = torch.tensor([1.0, 0.0, 0.5, -1.0], dtype=torch.float64)  # the advantage of each one-token response


def expected_gradient(name: str, p: torch.Tensor, weights: torch.Tensor, correct: bool, cap: float = math.inf):
    """sum_v weights(v) * dL(y = v) / dlogits on the V = 4 bandit (one response of one token, A = REWARD(v)): the
    exact expectation of the loss gradient over data drawn from `weights`, by enumerating the 4 tokens."""
    total = torch.zeros(4, dtype=torch.float64)
    for v in range(4):
        logits = p.log().view(1, 1, 4).clone().requires_grad_(True)
        tokens = torch.tensor([[v]])
        old = sparsify(Q.log().view(1, 4), tokens.view(-1), k=4, delta=0.0)
        kw = {"behaviour_logp": MU[v].log().view(1, 1), "is_cap": cap} if correct else {}
        loss, m = LOSSES[name](logits, tokens, torch.ones(1, 1, dtype=torch.bool), REWARD[v : v + 1], old, **kw)
        assert m["frac_active"] == 0.0  # inside every trust region: the surrogate's own gradient
        (g,) = torch.autograd.grad(loss, logits)
        total += weights[v] * g.view(-1)
    return total


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_only_the_weighted_estimator_is_unbiased_at_the_old_policy(name):
    """At p = pi_old = q the on-policy gradient of -J, J = E_p[R], is -q(j) (R(j) - E_q[R]) (softmax score). Data
    from mu != q: the corrected estimator's expectation equals it, the uncorrected one's does not; truncated at c,
    the expectation is that of the sub-probability min(q, c mu) in place of q (biased where the cap binds)."""
    on_policy = -Q * (REWARD - (Q * REWARD).sum())
    corrected = expected_gradient(name, Q, MU, correct=True)
    torch.testing.assert_close(corrected, on_policy, atol=1e-12, rtol=0)
    plain = expected_gradient(name, Q, MU, correct=False)
    assert (plain - on_policy).abs().max() > 0.1
    truncated = expected_gradient(name, Q, MU, correct=True, cap=1.5)  # q / mu = (0.25, 0.67, 1.5, 4): one capped
    q_c = torch.minimum(Q, 1.5 * MU)  # (0.1, 0.2, 0.3, 0.15)
    torch.testing.assert_close(truncated, -(q_c * REWARD)[:, None].mul(torch.eye(4, dtype=torch.float64) - Q).sum(0))
    assert (truncated - on_policy).abs().max() > 0.01


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_weighted_estimator_matches_the_on_policy_surrogate_gradient_inside_the_region(name):
    """After some updates (p != q, every token inside the trust region): E_mu[grad L_w] = E_q[grad L], the gradient
    the surrogate would have on data from pi_old itself; the plain estimator's E_mu[grad L] differs."""
    p = torch.softmax(Q.log() + torch.tensor([0.05, -0.04, 0.03, -0.02], dtype=torch.float64), -1)
    target = expected_gradient(name, p, Q, correct=False)
    torch.testing.assert_close(expected_gradient(name, p, MU, correct=True), target, atol=1e-12, rtol=0)
    assert (expected_gradient(name, p, MU, correct=False) - target).abs().max() > 0.1
