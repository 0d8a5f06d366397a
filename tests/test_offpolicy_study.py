"""The off-policy study (study/offpolicy.py): its grid, the shared warm-start per seed, the paired report."""

import json
import math

import pytest

from study import offpolicy


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
    cells = {c["loss"]: c for c in offpolicy.paired(rows)}
    diffs = [0.1, 0.2, 0.3]
    assert cells["troll"]["diff"] == pytest.approx(0.2)
    assert cells["troll"]["half"] == pytest.approx(4.302653 * 0.1 / math.sqrt(3), rel=1e-5)
    assert cells["troll"]["n"] == 3 and cells["troll"]["after"] == pytest.approx((0.6 + 0.6 + 1.0) / 3)
    assert cells["ppo_clip"]["below"] == 1  # seed 1 ended at 0.4 < 0.45
    assert cells["ppo_clip"]["diff"] == 0.0 and sum(diffs) / 3 == pytest.approx(cells["troll"]["diff"])
    table = offpolicy.report(rows)
    assert "+0.200 ± 0.248" in table and "1/3" in table
    against_troll = {c["loss"]: c for c in offpolicy.paired(rows, baseline="troll")}
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
