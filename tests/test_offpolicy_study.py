"""The off-policy study (study/offpolicy.py, offpolicy_grid.py, offpolicy_report.py): its grid, the shared warm-start
per seed, the paired report."""

import json
import math
import statistics
from pathlib import Path

import pytest

from study import offpolicy, offpolicy_report


def row(lr, source, anchor, loss, seed, before, after):
    return dict(lr=lr, source=source, anchor=anchor, loss=loss, seed=seed, eval_before=before, eval_after=after,
                kl_update_mean=0.01, mismatch_kl=0.0)  # fmt: skip


def test_paired_differences_and_their_t_interval():
    """Paired on the seed: the baseline's final accuracy is subtracted seed by seed; the interval is the 95%
    t-interval of those differences (t_{0.975, 2} = 4.3027), by hand."""
    rows = []
    for seed, (clip, troll) in enumerate([(0.5, 0.6), (0.4, 0.6), (0.7, 1.0)]):
        rows += [row(1e-4, "stale8", "behaviour", "ppo_clip", seed, 0.45, clip)]
        rows += [row(1e-4, "stale8", "behaviour", "troll", seed, 0.45, troll)]
    cells = {c["loss"]: c for c in offpolicy_report.paired(rows)}
    diffs = [0.1, 0.2, 0.3]
    assert cells["troll"]["diff"] == pytest.approx(0.2)
    assert cells["troll"]["half"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    assert cells["troll"]["n"] == 3 and cells["troll"]["after"] == pytest.approx((0.6 + 0.6 + 1.0) / 3)
    assert cells["ppo_clip"]["below"] == 1  # seed 1 ended at 0.4 < 0.45
    assert cells["ppo_clip"]["diff"] == 0.0 and sum(diffs) / 3 == pytest.approx(cells["troll"]["diff"])
    table = offpolicy_report.report(rows)
    assert "+0.200 ± 0.248" in table and "1/3" in table
    against_troll = {c["loss"]: c for c in offpolicy_report.paired(rows, baseline="troll")}
    assert against_troll["ppo_clip"]["diff"] == pytest.approx(-0.2) and against_troll["troll"]["diff"] == 0.0


def test_grid_crosses_anchors_only_where_the_sampler_differs():
    args = offpolicy.parse(["--seeds", "0", "1", "--lrs", "1e-4"])
    runs = offpolicy.grid(args)
    assert len(runs) == 2 * (2 + 3 * 2) * 4  # seeds x (none, epochs + 3 sources x 2 anchors) x losses
    assert {r.anchor for r in runs if r.source in ("none", "epochs")} == {"recompute"}
    stale = offpolicy.config(offpolicy.Run(1e-4, 0, "stale8", "recompute", "troll"), args)
    assert (stale.staleness, stale.is_correction, stale.old_policy, stale.sft_steps) == (8, "tis", "recompute", 0)
    bf16 = offpolicy.config(offpolicy.Run(1e-4, 1, "bf16", "behaviour", "cispo"), args)
    assert (bf16.rollout_dtype, bf16.old_policy, bf16.is_correction) == ("bfloat16", "behaviour", "none")
    assert bf16.model.endswith("warm-s1")  # every run of a seed starts from that seed's warm-start
    first = [r.seed for r in runs[:8]]
    assert first == [0] * 4 + [1] * 4  # cell by cell: every seed of a cell before the next cell


@pytest.mark.slow
def test_a_small_study_shares_warm_starts_reports_and_refuses_other_settings(tmp_path, capsys):
    out, results = tmp_path / "runs", tmp_path / "results.jsonl"
    argv = ["--seeds", "0", "1", "--lrs", "1e-4", "--sources", "none", "stale2", "--losses", "troll", "ppo_clip",
            "--steps", "2", "--eval_size", "20", "--sft_steps", "20", "--out", str(out), "--results", str(results),
            "--jobs", "2"]  # fmt: skip
    finished = offpolicy.main(argv)
    assert len(finished) == 2 * (1 + 2) * 2
    for seed in (0, 1):
        assert (out / f"warm-s{seed}" / "warm.json").is_file()
        configs = [json.loads((out / r["name"] / "config.json").read_text()) for r in finished if r["seed"] == seed]
        assert {c["model"] for c in configs} == {str(out / f"warm-s{seed}")} and {c["sft_steps"] for c in configs} == {
            0
        }
        assert len({r["eval_before"] for r in finished if r["seed"] == seed and r["source"] == "none"}) == 1
    assert offpolicy.main(argv) == []  # everything recorded: nothing to run
    offpolicy.main(["--results", str(results), "--report", "--figures", str(tmp_path / "fig")])
    assert "| 0.0001 | stale2 | behaviour | troll | 2 |" in capsys.readouterr().out
    assert (tmp_path / "fig" / "offpolicy_paired.png").stat().st_size > 1000
    with pytest.raises(SystemExit) as refused:  # the recorded runs were made with 2 steps
        offpolicy.main([*argv[:-6], "--steps", "3", "--out", str(out), "--results", str(results)])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.startswith("python -m study.offpolicy: error:") and "steps)" in err


REPO = Path(__file__).resolve().parents[1]


def sweep_row(loss, setting, seed, after, rates=None):
    r = row(1e-4, "none", "recompute", loss, seed, 0.3, after) | {"setting": setting}
    return r | ({"behaviour_rate": rates} if rates is not None else {})


def test_a_setting_runs_with_its_own_loss_and_keeps_the_old_names():
    """The grid's setting dimension: `default` runs for every loss under the run's old name; every other setting
    runs only with its loss, under a name of its own, with its trust-region size in the config."""
    args = offpolicy.parse(["--seeds", "0", "--lrs", "1e-4", "--sources", "none", "--losses", "troll", "ppo_clip",
                            "dppo", "--settings", "default", "eps0.2", "clip0.2-0.28"])  # fmt: skip
    runs = {(r.loss, r.setting): r for r in offpolicy.grid(args)}
    assert set(runs) == {("troll", "default"), ("troll", "eps0.2"), ("ppo_clip", "default"),
                         ("ppo_clip", "clip0.2-0.28"), ("dppo", "default")}  # fmt: skip
    assert runs["troll", "default"].name == "troll_none_recompute_lr0.0001_s0"  # the committed rows' names
    assert runs["troll", "eps0.2"].name == "troll-eps0.2_none_recompute_lr0.0001_s0"
    assert offpolicy.config(runs["troll", "eps0.2"], args).eps == 0.2
    higher = offpolicy.config(runs["ppo_clip", "clip0.2-0.28"], args)
    assert (higher.clip_low, higher.clip_high, higher.task) == (0.2, 0.28, "addition")
    assert offpolicy.setting_of({"loss": "troll"}) == "default"  # a row from before settings existed
    caps = ["--seeds", "0", "--lrs", "3e-4", "--sources", "none", "--losses", "dppo", "cispo", "--settings",
            "default", "cap2", "cap20", "cap10000", "eh1", "eh5"]  # fmt: skip
    with pytest.raises(SystemExit):  # a setting of a loss not run (PPO-clip's clip0.3) is refused, not dropped
        offpolicy.parse([*caps, "clip0.3"])
    args = offpolicy.parse(caps)
    caps = {(r.loss, r.setting): offpolicy.config(r, args) for r in offpolicy.grid(args)}
    assert {k: c.dppo_cap for k, c in caps.items() if k[0] == "dppo"} == {
        ("dppo", "default"): 10.0,
        ("dppo", "cap2"): 2.0,
        ("dppo", "cap20"): 20.0,
        ("dppo", "cap10000"): 10000.0,
    }  # 10 by default
    assert {k: c.clip_high for k, c in caps.items() if k[0] == "cispo"} == {
        ("cispo", "default"): 0.2, ("cispo", "eh1"): 1.0, ("cispo", "eh5"): 5.0}  # fmt: skip


@pytest.mark.parametrize(
    "results, extra",
    [
        ("study/offpolicy.jsonl", []),
        ("study/sweep.jsonl", []),
        ("study/rare.jsonl", ["--task", "rare", "--vocab_size", "1024", "--out", "runs/rare"]),
        ("study/rare_earlier.jsonl", ["--task", "rare", "--vocab_size", "1024", "--out", "runs/rare"]),
        ("study/rare_dppo_cap.jsonl", ["--task", "rare", "--vocab_size", "1024", "--out", "runs/rare"]),
        ("study/lora.jsonl", ["--out", "runs/lora"]),
    ],
)
def test_the_committed_rows_are_what_the_grid_makes_now(results, extra, tmp_path, monkeypatch, capsys):
    """Every committed row (written before the setting dimension, by the sweep, the rare-task or the LoRA study) matches
    the config the grid makes now, so the study counts it as done: nothing is refused or re-run."""
    monkeypatch.chdir(tmp_path)  # no run folders or warm-starts of this machine's own
    rows = list(offpolicy.read_results(REPO / results).values())
    cells = {(r["lr"], r["source"], r["anchor"]) for r in rows}
    for lr, source, anchor in sorted(cells):
        mine = [r for r in rows if (r["lr"], r["source"], r["anchor"]) == (lr, source, anchor)]
        for loss in sorted({r["loss"] for r in mine}):
            for setting in sorted({offpolicy.setting_of(r) for r in mine if r["loss"] == loss}):
                seeds = [str(r["seed"]) for r in mine if (r["loss"], offpolicy.setting_of(r)) == (loss, setting)]
                cell = ["--lrs", str(lr), "--sources", source, "--anchors", anchor, "--losses", loss]
                offpolicy.main(["--dry-run", "--results", str(REPO / results), *cell, "--settings", setting,
                                "--seeds", *seeds, *extra])  # fmt: skip
                n = len(seeds)
                assert capsys.readouterr().out.startswith(f"{n} runs, {n} done, 0 to run"), (source, loss, setting)


def test_best_against_best_picks_each_losss_best_setting_and_its_held_out_choice():
    """By hand: TROLL's best is eps0.2 (mean 0.7 against 0.6), PPO-clip's clip0.3 (0.633 against 0.6); the paired
    differences [0.1, -0.1, 0.2] give 0.067 ± 4.3027 * 0.1528 / sqrt(3). Leaving each seed out, PPO-clip's choice
    flips to default on seed 1 (0.6 against 0.5 on seeds 0 and 2): differences [0.1, 0.2, 0.2]."""
    values = {("troll", "default"): [0.5, 0.6, 0.7], ("troll", "eps0.2"): [0.6, 0.8, 0.7],
              ("ppo_clip", "default"): [0.6, 0.6, 0.6], ("ppo_clip", "clip0.3"): [0.5, 0.9, 0.5]}  # fmt: skip
    rows = [sweep_row(loss, s, seed, v) for (loss, s), vs in values.items() for seed, v in enumerate(vs)]
    assert offpolicy_report.best_settings(rows) == {(1e-4, "none", "recompute", "troll"): "eps0.2",
                                             (1e-4, "none", "recompute", "ppo_clip"): "clip0.3"}  # fmt: skip
    (cell,) = offpolicy_report.best_vs_best(rows)
    assert (cell["best"], cell["best_baseline"], cell["n"]) == ("eps0.2", "clip0.3", 3)
    assert cell["diff"][0] == pytest.approx(0.2 / 3)
    assert cell["diff"][1] == pytest.approx(4.302653 * statistics.stdev([0.1, -0.1, 0.2]) / math.sqrt(3), rel=1e-5)
    assert cell["held_out"][0] == pytest.approx(0.5 / 3)
    assert cell["held_out"][1] == pytest.approx(4.302653 * statistics.stdev([0.1, 0.2, 0.2]) / math.sqrt(3), rel=1e-5)
    table = offpolicy_report.report_best(rows)
    assert "| eps0.2 | 0.700 | clip0.3 | 0.633 | +0.067 ± 0.379 | +0.167 ± 0.143 |" in table
    assert "troll eps0.2" in offpolicy_report.report(rows)  # the paired table names the setting
    assert offpolicy_report.report_best([r for r in rows if r["setting"] == "default"]) == ""  # nothing swept


def test_adoption_is_the_first_step_past_the_threshold_and_is_paired_like_accuracy():
    assert offpolicy_report.adoption_step({"behaviour_rate": [0.01, 0.2, 0.6, 0.9]}) == 3
    assert offpolicy_report.adoption_step({"behaviour_rate": [0.01, 0.2, 0.6, 0.9]}, threshold=0.1) == 2
    assert offpolicy_report.adoption_step({"behaviour_rate": [0.01, 0.02]}) == 3  # never: censored at steps + 1
    rates = {"troll": [[0.0, 0.6], [0.0, 0.0], [0.7, 0.8]], "ppo_clip": [[0.0, 0.0], [0.0, 0.0], [0.0, 0.9]]}
    rows = [sweep_row(loss, "default", s, 0.5, r) for loss, rs in rates.items() for s, r in enumerate(rs)]
    cells = {c["loss"]: c for c in offpolicy_report.paired(rows)}
    assert cells["troll"]["adopt"] == pytest.approx((2 + 3 + 1) / 3) and cells["troll"]["adopted"] == 2
    assert cells["troll"]["adopt_diff"][0] == pytest.approx((-1 + 0 - 1) / 3)  # seeds: 2-3, 3-3, 1-2
    assert cells["ppo_clip"]["rate_last"] == pytest.approx(0.3)
    assert cells["troll"]["rate_diff"][0] == pytest.approx((0.6 + 0.0 - 0.1) / 3)  # last steps, seed by seed
    assert cells["troll"]["rate_diff"][1] == pytest.approx(4.302653 * statistics.stdev([0.6, 0.0, -0.1]) / math.sqrt(3))
    assert "| troll | 3 | 0.233 | 0.467 | +0.167 ± 0.940 | 2.0 | -0.7 ± 1.4 | 2/3 |" in offpolicy_report.report(rows)


@pytest.mark.slow
def test_a_small_rare_task_grid_runs_end_to_end_and_its_warm_starts_are_kept_apart(tmp_path, capsys):
    """--task rare: the warm-start measures how rare the behaviour is, every run logs its rate per step, the
    report adds the adoption table, and a warm-start of another task is refused."""
    out, results = tmp_path / "runs", tmp_path / "results.jsonl"
    argv = ["--task", "rare", "--vocab_size", "300", "--seeds", "0", "--lrs", "1e-4", "--sources", "none",
            "--losses", "troll", "ppo_clip", "--settings", "default", "eps0.2", "--steps", "2", "--eval_size", "20",
            "--sft_steps", "20", "--out", str(out), "--results", str(results)]  # fmt: skip
    finished = offpolicy.main(argv)
    assert sorted(r["name"] for r in finished) == ["ppo_clip_none_recompute_lr0.0001_s0",
                                                   "troll-eps0.2_none_recompute_lr0.0001_s0",
                                                   "troll_none_recompute_lr0.0001_s0"]  # fmt: skip
    for r in finished:
        assert len(r["behaviour_rate"]) == 2 and all(0 <= x <= 1 for x in r["behaviour_rate"])
        assert r["config"]["task"] == "rare" and r["setting"] in ("default", "eps0.2")
    warm = json.loads((out / "warm-s0" / "warm.json").read_text())
    assert (warm["task"], warm["vocab_size"], warm["behaviour_samples"]) == ("rare", 300, 8192)
    assert 0 <= warm["reward_rate"] <= warm["behaviour_rate"] <= 1
    assert len(json.loads((out / "warm-s0" / "tokenizer.json").read_text())["model"]["vocab"]) == 300
    offpolicy.main(["--results", str(results), "--report"])
    assert "step rate >= 0.5" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        offpolicy.main(["--seeds", "0", "--lrs", "1e-4", "--sources", "none", "--losses", "dppo", "--sft_steps",
                        "20", "--out", str(out), "--results", str(tmp_path / "other.jsonl"), "--dry-run"])  # fmt: skip
    assert refused.value.code == 2 and "was warm-started with --task rare" in capsys.readouterr().err  # addition


def test_lora_is_a_setting_of_every_loss_on_the_seeds_frozen_warm_start():
    args = offpolicy.parse(["--seeds", "0", "--lrs", "1e-3", "--sources", "none", "--losses", "troll", "ppo_clip",
                            "--settings", "default", "lora8", "--out", "runs/x"])  # fmt: skip
    runs = {(r.loss, r.setting): r for r in offpolicy.grid(args)}
    assert set(runs) == {(loss, s) for loss in ("troll", "ppo_clip") for s in ("default", "lora8")}
    assert runs["troll", "default"].name == "troll_none_recompute_lr0.001_s0"  # full fine-tuning keeps its name
    assert runs["troll", "lora8"].name == "troll-lora8_none_recompute_lr0.001_s0"
    cfg = offpolicy.config(runs["troll", "lora8"], args)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) == (8, 16.0, "all-linear")
    assert (cfg.model, cfg.sft_steps) == (str(Path("runs/x/warm-s0")), 0)  # the seed's warm-start is the base


def test_lora_against_full_fine_tuning_each_at_its_own_best_learning_rate():
    """By hand: full fine-tuning's best lr is 1e-4 (mean 0.6 against 0.5), LoRA's 1e-3 (0.633 against 0.583); the
    paired differences [0.2, -0.2, 0.1] give 0.033 ± 4.3027 * 0.2082 / sqrt(3). Leaving seed 2 out, both choices
    flip (full: 3e-4, 0.6 against 0.55 on seeds 0 and 1; LoRA: 3e-3, 0.6 against 0.55), so seed 2 scores
    0.55 - 0.3; seeds 0 and 1 keep the choices: held-out differences [0.2, -0.2, 0.25]."""
    values = {("default", 1e-4): [0.5, 0.6, 0.7], ("default", 3e-4): [0.7, 0.5, 0.3],
              ("lora8", 1e-3): [0.7, 0.4, 0.8], ("lora8", 3e-3): [0.6, 0.6, 0.55]}  # fmt: skip
    rows = [sweep_row("troll", s, seed, v) | {"lr": lr, "wall_clock_s": 20.0}
            for (s, lr), vs in values.items() for seed, v in enumerate(vs)]  # fmt: skip
    (cell,) = offpolicy_report.lora_vs_full(rows)
    assert (cell["lr"], cell["lr_full"], cell["n"], cell["loss"]) == (1e-3, 1e-4, 3, "troll")
    assert cell["after"] == pytest.approx(1.9 / 3) and cell["after_baseline"] == pytest.approx(0.6)
    assert cell["diff"][0] == pytest.approx(0.1 / 3)
    assert cell["diff"][1] == pytest.approx(4.302653 * statistics.stdev([0.2, -0.2, 0.1]) / math.sqrt(3), rel=1e-5)
    assert cell["held_out"][0] == pytest.approx(0.25 / 3)
    assert cell["held_out"][1] == pytest.approx(4.302653 * statistics.stdev([0.2, -0.2, 0.25]) / math.sqrt(3), rel=1e-5)
    table = offpolicy_report.report_lora(rows)
    assert "| troll | none | LoRA (lora8) | **0.001** | 3 | 0.633 | +0.333 | 0/3 | 0.0100 | 20 |" in table
    assert "| troll | none | full (default) | 0.0003 | 3 | 0.500 | +0.200 | 0/3 |" in table  # 0.3 is not below 0.3
    assert "| 0.001 | 0.633 | 0.0001 | 0.600 | 3 | +0.033 ± 0.517 | +0.083 ± 0.613 |" in table
    assert offpolicy_report.report_lora([r for r in rows if r["setting"] == "default"]) == ""  # no LoRA ran
    assert offpolicy_report.best_vs_best(rows) == []  # the learning rate is not a trust-region setting
