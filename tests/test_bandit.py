"""The rare-token bandit (study/bandit.py, its simulator study/bandit_sim.py) and the growth bound of one update
(troll/growth.py).

References are independent of the code under test: scipy's root finder and Lambert W for the growth bound,
scipy's rel_entr over the whole vocabulary for the update KL, the Zipf formula for the initial rows.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.special import lambertw, rel_entr

from study import bandit as b
from study import bandit_sim as sim
from troll.growth import clip_growth, kl_ball_growth, kl_bern

ROOT = Path(__file__).resolve().parents[1]
SMALL = b.Cell("clean", 2, 0.1, 4000)  # a small vocabulary: seconds, not minutes


# --- the growth bound ----------------------------------------------------------------------------------


def bern_kl(x: float, q: float) -> float:
    return x * math.log(x / q) + (1 - x) * math.log((1 - x) / (1 - q))


@pytest.mark.parametrize("eps", [0.01, 0.05, 0.2])
def test_kl_ball_growth_is_the_root_scipy_finds(eps):
    qs = [1e-8, 1e-6, 1e-4, 1e-3, 0.005, 0.05, 0.3, 0.6, 0.9]
    got = kl_ball_growth(torch.tensor(qs, dtype=torch.float64), eps)
    for q, x in zip(qs, got.tolist(), strict=True):
        if -math.log(q) <= eps:  # all the mass fits in the ball
            assert x == 1.0
            continue
        ref = brentq(lambda x, q=q: bern_kl(x, q) - eps, q, 1 - 1e-15, xtol=1e-300, rtol=1e-15)
        assert x == pytest.approx(ref, rel=1e-12), (q, eps)
        assert bern_kl(x, q) <= eps * (1 + 1e-12)


def test_kl_ball_growth_reaches_one_only_when_all_mass_fits():
    q = torch.tensor([0.94, 0.96], dtype=torch.float64)  # -log q = 0.062, 0.041 against eps = 0.05
    assert kl_ball_growth(q, 0.05).tolist()[1] == 1.0 and kl_ball_growth(q, 0.05).tolist()[0] < 1.0


def test_small_q_asymptote_and_the_clip():
    """x* ~ (eps - q) / W((eps / q - 1) / e) as q -> 0 (docs/algorithm.md, section 11); the clip: q (1 + eps)."""
    eps = 0.05
    for q, tol in ((1e-4, 0.02), (1e-6, 2e-3), (1e-9, 2e-4)):
        asym = (eps - q) / lambertw((eps / q - 1) / math.e).real
        assert float(kl_ball_growth(torch.tensor(q), eps)) == pytest.approx(asym, rel=tol)
    q = torch.tensor([1e-4, 0.005, 0.3, 0.9], dtype=torch.float64)
    assert clip_growth(q, 0.2).tolist() == pytest.approx([1.2e-4, 0.006, 0.36, 1.0])
    assert bool((kl_ball_growth(q[:3], eps) > clip_growth(q[:3], 0.2)).all())  # the ball allows more below ~0.7


def test_the_quoted_growth_factors():
    """The figures quoted at eps = 0.05 (troll/growth.py, docs/algorithm.md section 11, docs/results.md): the root's
    growth factor x* / q is 8.1 at q = 0.005 and 129 at 1e-4; the Lambert-W form gives 8.2 and 129, within 0.8%; the
    leading order (eps / q) / log(eps / q) only 4.3 and 80, so that form is not where the figures come from."""
    eps = 0.05
    for q, root_quoted, w_quoted, short_quoted in ((0.005, 8.1, 8.2, 4.3), (1e-4, 129, 129, 80)):
        root = float(kl_ball_growth(torch.tensor(q, dtype=torch.float64), eps)) / q
        lambert = (eps / q - 1) / lambertw((eps / q - 1) / math.e).real
        short = (eps / q) / math.log(eps / q)
        digits = 1 if root < 100 else 0
        assert round(root, digits) == root_quoted and round(lambert, digits) == w_quoted, (q, root, lambert)
        assert round(short, digits) == short_quoted, (q, short)
        assert abs(lambert / root - 1) < 0.008 and short / root < 0.63  # W: close; the log alone: about half


def test_kl_bern_and_bad_input():
    assert float(
        kl_bern(torch.tensor(0.3, dtype=torch.float64), torch.tensor(0.1, dtype=torch.float64))
    ) == pytest.approx(bern_kl(0.3, 0.1), rel=1e-14)
    assert float(kl_bern(torch.tensor(1.0), torch.tensor(0.25))) == pytest.approx(math.log(4))
    for bad_q in (0.0, 1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="q must"):
            kl_ball_growth(torch.tensor([bad_q]), 0.05)
    for bad_eps in (0.0, -1.0, math.inf, True):
        with pytest.raises(ValueError, match="eps"):
            kl_ball_growth(torch.tensor([0.1]), bad_eps)


# --- the bandit ----------------------------------------------------------------------------------------


def test_initial_rows_are_zipf_with_the_good_token_at_the_stated_ranks():
    init = sim.initial_table(32_000, seed=3)
    assert init["ranks"] == [1, 4, 21, 68, 372] and init["decoy_ranks"] == [2, 3, 20, 67, 371]
    k = np.arange(1, 32_001, dtype=np.float64)
    zipf = k**-sim.ZIPF / (k**-sim.ZIPF).sum()
    p = torch.log_softmax(init["table"].double(), -1).exp().numpy()
    for c, (rank, target) in enumerate(zip(init["ranks"], b.TARGETS, strict=True)):
        np.testing.assert_allclose(np.sort(p[c])[::-1], zipf, rtol=1e-5)  # float32 logits
        good, decoy = int(init["good"][c]), int(init["decoy"][c])
        assert int((p[c] > p[c, good]).sum()) == rank - 1  # the good token's rank
        assert int((p[c] > p[c, decoy]).sum()) == init["decoy_ranks"][c] - 1
        assert init["q0"][c] == pytest.approx(zipf[rank - 1]) and 0.7 < init["q0"][c] / target < 1.3
    assert zipf[0] == pytest.approx(0.296, abs=1e-3) and zipf[:64].sum() == pytest.approx(0.826, abs=1e-3)
    assert not torch.equal(init["table"][0], init["table"][1])
    assert torch.equal(sim.initial_table(32_000, seed=3)["table"], init["table"])
    assert not torch.equal(sim.initial_table(32_000, seed=4)["table"], init["table"])


def test_rewards_pay_as_stated():
    good, decoy = torch.tensor([5]), torch.tensor([7])
    tokens = torch.tensor([[5, 5, 7, 7, 1]])
    u = torch.tensor([[0.1, 0.7, 0.3, 0.5, 0.0]], dtype=torch.float64)
    assert sim.rewards(tokens, good, decoy, u, "clean").tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]
    assert sim.rewards(tokens, good, decoy, u, "noisy").tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]


def test_update_kl_is_the_exact_kl_over_the_vocabulary():
    run = b.bandit(SMALL, "cispo", seed=0, steps=3, samples=16, trace=True)
    assert len(run["trace"]) == 3
    for step, t in enumerate(run["trace"]):
        new, old = t["logp_new"].exp().numpy(), t["logp_old"].exp().numpy()
        dense = rel_entr(new, old).sum(-1)  # KL(p_new || p_old) per context, over all V
        np.testing.assert_allclose(run["kl_update_ctx"][step], dense, rtol=1e-5, atol=1e-15)
        assert run["kl_update_mean"][step] == pytest.approx(dense.mean(), rel=1e-5)
        assert run["kl_update_max"][step] == pytest.approx(dense.max(), rel=1e-5)
    assert max(run["kl_update_max"]) > 0  # something moved


def test_losses_see_the_same_samples_across_a_seed():
    """The stream is a function of (seed, step): every variant of a seed draws the same uniforms, so contexts whose
    rows agree get the same samples (all of them at step 0), and another seed draws others."""
    runs = {v: b.bandit(SMALL, v, seed=1, steps=3, samples=16, trace=True) for v in ("troll-0.05", "clip-0.2")}
    a, c = runs["troll-0.05"]["trace"], runs["clip-0.2"]["trace"]
    assert torch.equal(a[0]["tokens"], c[0]["tokens"])
    for x, y in zip(a, c, strict=True):
        same_row = (x["logp_old"] == y["logp_old"]).all(-1)
        assert torch.equal(x["tokens"][same_row], y["tokens"][same_row])
    assert torch.equal(sim.draws(1, 2, 5, 16)[0], sim.draws(1, 2, 5, 16)[0])
    assert not torch.equal(sim.draws(1, 2, 5, 16)[0], sim.draws(2, 2, 5, 16)[0])
    other = b.bandit(SMALL, "troll-0.05", seed=2, steps=1, samples=16, trace=True)["trace"][0]["tokens"]
    assert not torch.equal(other, a[0]["tokens"])


def test_samples_follow_the_policy():
    """Inverse-CDF sampling: the empirical frequencies match the row's probabilities."""
    logp = torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64).log()
    u = torch.rand(1, 200_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    freq = torch.bincount(sim.sample(logp, u)[0], minlength=4) / 200_000
    torch.testing.assert_close(freq.double(), logp.exp()[0], atol=5e-3, rtol=0)


def test_a_tiny_study_runs_reports_draws_and_refuses_other_settings(tmp_path, capsys):
    results = tmp_path / "bandit.jsonl"
    argv = ["--cells", "issue", "noisy", "--variants", "troll-0.05", "clip-0.2", "--seeds", "0", "1"]
    argv += ["--steps", "2", "--samples", "16", "--vocab", "2000", "--results", str(results)]
    rows = b.main(argv)
    assert sorted(r["name"] for r in rows) == sorted(
        f"{cell}_{v}_s{s}" for cell in ("issue", "noisy") for v in ("troll-0.05", "clip-0.2") for s in (0, 1)
    )
    for r in rows:
        assert len(r["p_good"]) == 5 and all(len(c) == 3 for c in r["p_good"]) and len(r["kl_update_mean"]) == 2
        assert r["settings"]["vocab"] == 2000 and r["settings"]["steps"] == 2
        assert all(1 <= s <= 3 for s in r["steps_to"]) and 0 <= r["auc"] <= 1
    assert b.main(argv) == []  # resumed: nothing left to run
    capsys.readouterr()
    b.main(["--results", str(results), "--report", "--figures", str(tmp_path / "fig")])
    out = capsys.readouterr().out
    assert "| issue | troll-0.05 | 2 |" in out and "| noisy | clip-0.2 | 2 |" in out
    assert "| issue | troll | troll-0.05 |" in out  # best against best
    assert (tmp_path / "fig" / "bandit_steps.png").is_file() and (tmp_path / "fig" / "bandit_curves.png").is_file()
    with pytest.raises(SystemExit) as refused:
        b.main([*argv[:-8], "--steps", "3", "--samples", "16", "--vocab", "2000", "--results", str(results)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("python -m study.bandit: error:") and "steps" in err


def test_paired_differences_and_best_against_best():
    """Hand-made rows: the report pairs by seed and picks each loss's best setting by mean auc."""

    def row(variant, seed, auc, steps):
        fixed = {"kl_update_mean": [0.01], "kl_update_max": [0.02], "collapsed": [False], "settings": {"steps": 20}}
        return {
            "cell": "issue",
            "variant": variant,
            "seed": seed,
            "auc": auc,
            "final": auc,
            "steps_to": [0, 0, steps],
        } | fixed

    rows = [row("clip-0.2", s, 0.3 + 0.01 * s, 10) for s in range(3)]
    rows += [row("clip-higher", s, 0.35 + 0.01 * s, 9) for s in range(3)]
    rows += [row("troll-0.05", s, 0.5 + 0.02 * s, 6 + s) for s in range(3)]
    rows += [row("troll-0.2", s, 0.4, 5) for s in range(3)]
    table = {c["variant"]: c for c in b.summary(rows)}
    assert table["troll-0.05"]["d_auc"] == pytest.approx(0.21) and table["troll-0.05"]["d_steps"] == pytest.approx(-3)
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t(0.975, 2) * stdev([0.2, 0.21, 0.22]) / sqrt(3)
    assert table["troll-0.05"]["h_auc"] == pytest.approx(half)
    best = {x["loss"]: x for x in b.best_vs_best(rows)}
    assert best["troll"]["best"] == "troll-0.05" and best["ppo_clip"]["best"] == "clip-higher"
    assert best["troll"]["d_auc"] == pytest.approx(0.16) and best["troll"]["n"] == 3
    # one seed: the difference without a half-width; no baseline: "-" and the report says which is missing
    one = b.report([r for r in rows if r["seed"] == 0])
    assert "nan" not in one and "+0.200 (1 seed)" in one
    alone = b.report([r for r in rows if r["variant"] != "clip-0.2"])
    assert "nan" not in alone and "No clip-0.2 run in cell issue: its paired columns there are '-'." in alone


def command(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "study.bandit", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--samples", "1"], "--samples must be >= 2"),
        (["--vocab", "10"], "--vocab must be"),
        (["--seeds", "-1"], "--seeds must be >= 0"),
        (["--cells", "qwen", "--variants", "dppo"], "the grid is empty"),
        (["--cells", "nope"], "invalid choice"),
        (["--report", "--results", "/nonexistent/bandit.jsonl"], "holds no results"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, words):
    result = command(*argv)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()  # one line, argparse's own refusals too (troll.base.cli.Parser)
    assert len(lines) == 1 and lines[0].startswith("python -m study.bandit: error:") and words in lines[0], lines
