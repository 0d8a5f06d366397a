"""The study's tooling (study/run.py, study/figures.py): a 2-run grid of very short runs
finishes, writes its results file, is skipped when run again, and the figures render from it; the figure functions
on a synthetic results file."""

from __future__ import annotations

import json
import random

import pytest

from study import figures, run
from study.figures import plot_study, read_results

SMOKE = ["--variants", "troll-rest", "ppo_clip", "--lrs", "1e-3", "--off_policy", "2x2", "--seeds", "0"]
SMOKE += ["--steps", "2", "--eval_every", "2", "--eval_size", "16", "--sft_steps", "60"]


def synthetic_rows() -> list[dict]:
    rng = random.Random(0)
    rows = []
    for variant in ("troll-rest", "troll-paper", "ppo_clip"):
        for lr in (1e-4, 1e-3):
            for mb, ep in ((1, 1), (4, 1), (1, 4), (8, 4)):
                if (mb, ep) == (1, 1) and variant != "troll-rest":
                    continue
                for seed in (0, 1, 2):
                    kl = [rng.random() * 0.01 * mb * ep for _ in range(5)]
                    rows.append(
                        dict(variant=variant, lr=lr, minibatches=mb, epochs=ep, off_policy=mb * ep, seed=seed)
                        | dict(eval_before=0.3, eval_after=rng.random(), kl_update_mean=kl)
                        | dict(kl_update_max=[k * 10 for k in kl], name=f"{variant}-{lr}-{mb}-{ep}-{seed}")
                    )
    return rows


@pytest.mark.slow
def test_figures_from_a_synthetic_results_file(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_rows()))
    assert read_results(path) == synthetic_rows()
    written = plot_study(read_results(path), tmp_path / "direct")
    assert [p.name for p in written] == ["accuracy_vs_off_policy.png", "kl_update.png"]
    assert all(p.stat().st_size > 5000 for p in written)
    figures.main([str(path), "--out", str(tmp_path / "cli")])
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["accuracy_vs_off_policy.png", "kl_update.png"]
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(SystemExit):
        figures.main([str(tmp_path / "empty.jsonl")])


def test_grid_lists_on_policy_once_and_estimates(capsys, tmp_path):
    args = run.parse(["--out", str(tmp_path), "--seeds", "0", "1"])
    runs = run.grid(args)
    on_policy = [r for r in runs if (r.minibatches, r.epochs) == (1, 1)]
    assert len(on_policy) == len(args.lrs) * 2 and {r.variant for r in on_policy} == {"troll-rest"}
    assert len(runs) == 2 * len(args.lrs) * (1 + 5 * 3)  # per seed and lr: 1x1 once, 3 settings x 5 variants
    assert [r.seed for r in runs] == sorted(r.seed for r in runs)  # seed by seed
    run.main(["--out", str(tmp_path), "--dry-run", "--limit", "3"])
    out = capsys.readouterr().out
    assert "3 runs" in out and "min one at a time" in out and out.count("troll-rest_lr") == 3
    assert not list(tmp_path.iterdir())  # nothing ran
    with pytest.raises(SystemExit):
        run.parse(["--lrs", "0"])  # every run's config is checked first


def test_the_study_keeps_the_task_and_warm_start_it_ran_with(tmp_path):
    args = run.parse(["--out", str(tmp_path)])
    for r in run.grid(args):  # sums written the usual way, 250 supervised steps of 64, no target: as committed
        cfg = run.config(r, args)
        assert (cfg.reverse_sum, cfg.sft_steps, cfg.sft_batch, cfg.sft_target) == (False, 250, 64, 0.0)


@pytest.mark.slow
def test_a_two_run_study_finishes_resumes_and_draws(tmp_path, capsys):
    out, results = tmp_path / "runs", tmp_path / "results.jsonl"
    argv = [*SMOKE, "--out", str(out), "--results", str(results)]
    rows = run.main(argv)
    assert [r["variant"] for r in rows] and len(read_results(results)) == 2
    for r in read_results(results):
        assert r["loss"] in ("troll", "ppo_clip") and (r["minibatches"], r["epochs"], r["off_policy"]) == (2, 2, 4)
        assert len(r["reward"]) == len(r["kl_update_mean"]) == len(r["kl_update_max"]) == len(r["frac_active"]) == 2
        assert all(m > 0 for m in r["kl_update_max"]) and r["eval_curve"][0][0] == 0 and r["eval_curve"][-1][0] == 2
        assert 0 <= r["eval_before"] <= 1 and r["eval_best"] >= r["eval_after"]
        assert not (out / r["name"] / "checkpoints").exists() and (out / r["name"] / "log.txt").is_file()
    files = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    text = results.read_text()
    capsys.readouterr()
    again = run.main(argv)  # every run finished: nothing runs, nothing changes
    assert "2 finished" in capsys.readouterr().out
    assert sorted(r["name"] for r in again) == sorted(r["name"] for r in rows)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == files and results.read_text() == text
    figures.main([str(results), "--out", str(tmp_path / "figs")])
    assert all(p.stat().st_size > 5000 for p in (tmp_path / "figs").iterdir())
    capsys.readouterr()  # a fresh machine with only the (committed) results file: nothing runs again either
    moved = run.main([*SMOKE, "--out", str(tmp_path / "fresh"), "--results", str(results)])
    assert "2 finished" in capsys.readouterr().out and sorted(r["name"] for r in moved) == sorted(
        r["name"] for r in rows
    )
    assert not (tmp_path / "fresh").exists() or not any((tmp_path / "fresh").iterdir())
