"""The real-model study (study/real.py): its refusals, its runs for given flags (the sweep, then each loss at its
best lr, every run from its seed's warm-start with the preset's task), the paired report by hand, and a tiny study
end to end (slow)."""

import json
import math
import shlex
import statistics
from dataclasses import asdict
from pathlib import Path

import pytest

from study import real, real_gsm8k, real_report, real_time, real_warm
from troll.base.cli import run_command
from troll.base.config import PRESETS, Config, settings

T2, T1 = 4.302653, 12.706205  # t_{0.975} with 2 and 1 degrees of freedom


def refused(argv, capsys) -> str:
    """The one line a refused command prints (run as `python -m study.real` runs it); it must exit 2."""
    with pytest.raises(SystemExit) as e:
        run_command(real.PROG, lambda: real.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("python -m study.real: error:"), err
    return err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--report", "--steps", "2"], "--steps cannot act with --report"),
        (["--report", "--dry-run"], "--dry-run cannot act with --report"),
        (["--report", "--lrs", "1e-5"], "--lrs cannot act with --report"),
        (["--lrs", "1e-5", "--sweep_seeds", "1"], "--sweep_seeds cannot act with a single --lrs value"),
        (["--seeds", "0", "1", "--sweep_seeds", "3"], "--sweep_seeds 3 is more than the 2 --seeds"),
        (["--sweep_seeds", "0"], "--sweep_seeds must be >= 1"),
        (["--seeds", "0", "0"], "--seeds lists 0 twice"),
        (["--losses", "troll", "troll"], "--losses lists troll twice"),
        (["--lrs", "1e-5", "0"], "--lrs must be positive"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--model", "gpt2"], "--model"),
        (["--report", "--stability", "2"], "--stability cannot act with --report"),
        (["--stability", "1"], "--stability takes distinct multiples above 1 of the best lr, got 1"),
        (["--stability", "2", "2.0"], "--stability takes distinct multiples above 1 of the best lr, got 2 2"),
        (["--stability", "inf"], "--stability takes distinct multiples above 1"),
        (["--seeds", "0", "1", "--stability_seeds", "3"], "--stability_seeds 3 must be in 0..2"),
        (["--stability_seeds", "-1"], "--stability_seeds -1 must be in 0..5"),
        (["--stability", "3", "--stability_seeds", "0"], "--stability cannot act with --stability_seeds 0"),
        (["--lrs", "100", "--stability", "1e307"], "lr must be > 0 and finite, got inf"),  # checked before any run
    ],
)
def test_a_flag_that_cannot_act_or_a_bad_value_is_refused_in_one_line(argv, says, capsys, tmp_path):
    err = refused([*argv, "--results", str(tmp_path / "r.jsonl")], capsys)
    assert says in err
    assert not (tmp_path / "r.jsonl").exists()


def test_the_sweep_then_each_loss_at_its_best_lr_every_run_from_its_seeds_warm_start():
    args = real.parse(["--seeds", "0", "1", "2", "--out", "runs/x"])
    assert (args.losses, args.lrs, args.sweep_seeds) == (["troll", "ppo_clip"], [5e-6, 1e-5, 2e-5], 1)
    assert [r.name for r in real.sweep(args)] == [
        "troll_lr5e-06_s0", "ppo_clip_lr5e-06_s0", "troll_lr1e-05_s0", "ppo_clip_lr1e-05_s0", "troll_lr2e-05_s0",
        "ppo_clip_lr2e-05_s0",
    ]  # fmt: skip
    later = real.at_best(args, {"troll": 1e-5, "ppo_clip": 2e-5})
    assert [r.name for r in later] == ["troll_lr1e-05_s1", "ppo_clip_lr2e-05_s1", "troll_lr1e-05_s2",
                                       "ppo_clip_lr2e-05_s2"]  # fmt: skip
    grid = real.parse(["--seeds", "0", "1", "--sweep_seeds", "2", "--lrs", "1e-5", "2e-5", "--losses", "troll"])
    assert len(real.sweep(grid)) == 4 and real.at_best(grid, {"troll": 1e-5}) == []  # the full grid: no later seeds
    preset = Config(**PRESETS["smollm2-words"])
    for run in real.sweep(args) + later:
        cfg = real.config(run, args)
        assert (cfg.model, cfg.sft_steps, cfg.loss, cfg.lr, cfg.seed) == (f"runs/x/warm-s{run.seed}", 0, run.loss,
                                                                          run.lr, run.seed)  # fmt: skip
        asked = ("task", "chat", "max_prompt_len", "max_new_tokens", "prompts_per_step", "samples_per_prompt",
                 "minibatches", "steps", "eval_size", "eval_every")  # fmt: skip
        assert {k: getattr(cfg, k) for k in asked} == {k: getattr(preset, k) for k in asked}
        assert (cfg.task, cfg.chat, cfg.out) == ("words", True, f"runs/x/{run.name}")
    warm = real_warm.warm_config(args, 2)
    assert (warm.model, warm.sft_steps, warm.sft_target, warm.sft_lr, warm.sft_probe, warm.seed) == (
        "smollm2-135m-instruct", 40, 0.15, preset.sft_lr, preset.sft_probe, 2)  # fmt: skip
    tiny = real.config(real.Run("troll", 1e-5, 0), real.parse(["--model", "tiny"]))
    assert (tiny.max_prompt_len, tiny.task, tiny.chat, tiny.max_new_tokens) == (256, "words", True, 24)


def test_a_run_that_would_not_ask_the_presets_problems_is_refused(monkeypatch):
    """`config` compares every run's asking settings (`ASKED`) with the preset's: a run that lost the chat template
    (here: a Config that drops it for runs, which start with sft_steps 0) is a ValueError naming the field."""
    args = real.parse([])
    make = real.Config

    def drifting(**kw):
        return make(**(kw | ({"chat": False} if kw.get("sft_steps") == 0 else {})))

    monkeypatch.setattr(real, "Config", drifting)
    with pytest.raises(ValueError, match="would not ask the preset's problems: chat changed"):
        real.config(real.Run("troll", 1e-5, 0), args)


def row(loss, lr, seed, after, before=0.4, step_s=50.0, **extra):
    return {"name": real.Run(loss, lr, seed).name, "loss": loss, "lr": lr, "seed": seed, "eval_before": before,
            "eval_after": after, "step_s": step_s, "model": "smollm2-135m-instruct", "config": {}, **extra}  # fmt: skip


def write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Seed 0 sweeps; TROLL's best is 1e-5 (0.50), PPO-clip's 2e-5 (0.48); seeds 1 and 2 run those only
SWEEP = {("troll", 5e-6): 0.40, ("troll", 1e-5): 0.50, ("troll", 2e-5): 0.45,
         ("ppo_clip", 5e-6): 0.42, ("ppo_clip", 1e-5): 0.44, ("ppo_clip", 2e-5): 0.48}  # fmt: skip


def study_rows(troll_later, clip_later):
    rows = [row(loss, lr, 0, after, step_s=60.0 if loss == "troll" else 40.0) for (loss, lr), after in SWEEP.items()]
    rows += [row("troll", 1e-5, s, a, step_s=60.0) for s, a in zip((1, 2), troll_later, strict=True)]
    return rows + [row("ppo_clip", 2e-5, s, a, step_s=40.0) for s, a in zip((1, 2), clip_later, strict=True)]


def test_the_paired_report_against_a_hand_computation(tmp_path, capsys):
    """By hand: differences TROLL(1e-5) - PPO-clip(2e-5) on seeds 0, 1, 2 are 0.02, 0.10, -0.05: mean 0.0233, half
    4.3027 * sd / sqrt(3) = 0.186, which holds 0: noise. The lrs chosen without the seed they score: seed 0 is the
    only sweep seed, so seeds 1 and 2 only: 0.10, -0.05, half 12.706 * sd / sqrt(2)."""
    rows = study_rows([0.55, 0.35], [0.45, 0.40])
    assert real_report.best_lr(rows, "troll") == (1e-5, [0]) and real_report.best_lr(rows, "ppo_clip") == (2e-5, [0])
    assert real_report.best_lr(rows, "troll", without=0) is None
    assert real_report.best_lr(rows, "troll", without=1) == (1e-5, [0])
    c = real_report.compare(rows, "troll")
    diffs, held = [0.02, 0.10, -0.05], [0.10, -0.05]
    assert (c["lr"], c["lr_baseline"], c["n"], c["held_out_n"]) == (1e-5, 2e-5, 3, 2)
    assert c["diff"][0] == pytest.approx(statistics.fmean(diffs))
    assert c["diff"][1] == pytest.approx(T2 * statistics.stdev(diffs) / math.sqrt(3), rel=1e-5)
    assert c["held_out"][0] == pytest.approx(0.025)
    assert c["held_out"][1] == pytest.approx(T1 * statistics.stdev(held) / math.sqrt(2), rel=1e-5)
    assert (c["step_s"], c["step_s_baseline"]) == (60.0, 40.0)
    real.main(["--report", "--results", str(write(tmp_path / "r.jsonl", rows))])
    out = capsys.readouterr().out
    assert "| troll | 1e-05 (best) | 0,1,2 | 0.400 | 0.467 | +0.067 | 1/3 | 60.0 |" in out  # seed 2 ended at 0.35
    assert "| ppo_clip | 5e-06 | 0 | 0.400 | 0.420 | +0.020 | 0/1 | 40.0 |" in out
    assert "troll at lr 1e-05 - ppo_clip at lr 2e-05 (chosen on seeds 0), 3 seeds: 0.467 - 0.443 = +0.023 ± 0.186: " \
           "the interval contains 0: noise" in out  # fmt: skip
    assert "2 seeds: +0.025 ± 0.953: the interval contains 0: noise" in out
    assert "seconds per RL step at those lrs: troll 60.0, ppo_clip 40.0" in out

    # differences 0.02, 0.03, 0.025: 0.025 ± 4.3027 * 0.005 / sqrt(3) = 0.012, which excludes 0; without the sweep
    # seed: 0.03, 0.025, ± 12.706 * 0.00354 / sqrt(2) = 0.032, which holds 0
    ahead = study_rows([0.48, 0.445], [0.45, 0.42])
    real.main(["--report", "--results", str(write(tmp_path / "a.jsonl", ahead))])
    out = capsys.readouterr().out
    assert "3 seeds: 0.475 - 0.450 = +0.025 ± 0.012: the interval excludes 0: troll ahead" in out
    assert "2 seeds: +0.027 ± 0.032: the interval contains 0: noise" in out


def test_the_cost_line_sums_the_runs_wall_and_cpu_time_by_hand():
    """By hand: wall 3600 + 1800 + 900 s = 1.75 h; CPU 7200 + 3600 s = 3.00 h, which one run did not record."""
    rows = [row("troll", 1e-5, 0, 0.5, wall_clock_s=3600.0, cpu_s=7200.0),
            row("ppo_clip", 1e-5, 0, 0.5, wall_clock_s=1800.0, cpu_s=3600.0),
            row("troll", 1e-5, 1, 0.5, wall_clock_s=900.0)]  # fmt: skip
    assert real_report.cost(rows) == ("Cost: 3 runs, 1.75 wall hours and 3.00 CPU hours (2 of the runs recorded it), "
                                      "summed over runs (warm-starts not counted).")  # fmt: skip
    assert real_report.cost(rows[2:]) == ("Cost: 1 runs, 0.25 wall hours and CPU time not recorded, summed over runs "
                                          "(warm-starts not counted).")  # fmt: skip
    assert real_report.report(rows, real.MODELS).endswith(real_report.cost(rows))


def test_the_verdict_says_noise_only_when_the_interval_holds_0():
    assert real_report.verdict(0.01, 0.05, 3, "troll", "ppo_clip").startswith("the interval contains 0: noise")
    assert real_report.verdict(-0.04, 0.05, 3, "troll", "ppo_clip").startswith("the interval contains 0: noise")
    assert real_report.verdict(0.1, 0.05, 3, "troll", "ppo_clip") == "the interval excludes 0: troll ahead"
    assert real_report.verdict(-0.1, 0.05, 3, "troll", "ppo_clip") == "the interval excludes 0: ppo_clip ahead"
    assert real_report.verdict(0.1, math.nan, 1, "troll", "ppo_clip") == "nothing to conclude"  # one seed: no interval


def test_ties_go_to_the_smaller_lr_and_a_loss_without_a_sweep_seed_has_no_best():
    rows = [row("troll", 1e-5, 0, 0.5), row("troll", 2e-5, 0, 0.5), row("troll", 1e-5, 1, 0.3)]
    assert real_report.best_lr(rows, "troll") == (1e-5, [0])
    assert real_report.best_lr([row("troll", 1e-5, 0, 0.5), row("troll", 2e-5, 1, 0.6)], "troll") is None


def test_the_dry_run_lists_the_later_seeds_at_the_best_lrs_once_the_sweep_is_recorded(tmp_path, capsys):
    flags = ["--seeds", "0", "1", "2", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r.jsonl"),
             "--stability_seeds", "0"]  # fmt: skip
    args = real.parse(flags)
    rows = [r | {"config": settings(asdict(real.config(real.Run(r["loss"], r["lr"], 0), args)))}
            for r in study_rows([0.5, 0.5], [0.5, 0.5]) if r["seed"] == 0]  # fmt: skip
    rows = [r | {"steps": 60, "eval_problems": 500, "wall_clock_s": 1300.0} for r in rows]  # the preset's
    write(tmp_path / "r.jsonl", rows)
    assert real.main([*flags, "--dry-run"]) == []
    out = capsys.readouterr().out
    assert "sweep: seeds 0, every lr of every loss: 6 runs, 6 done" in out
    assert "then seeds 1 2 at each loss's best lr (troll 1e-05, ppo_clip 2e-05): 4 runs, 0 done" in out
    assert "  troll_lr1e-05_s1\n  ppo_clip_lr2e-05_s1\n  troll_lr1e-05_s2\n  ppo_clip_lr2e-05_s2\n" in out
    assert "warm-starts to make: 2 (seeds 1 2)" in out  # seed 0 has no run left to make
    # the time: 4 runs x their measured 1300 s, + 2 warm-starts x the built-in 200 s = 5600 s
    assert real_time.MEASURED["smollm2-135m-instruct"]["warm_s"] == 200
    assert "about 93 min one run at a time (4 runs x 21.7 min (50.0 s a step) + 2 warm-starts x 3.3 min" in out
    assert "measured: the mean of 6 finished run(s) of these settings" in out
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing
    err = refused([*flags, "--steps", "10", "--dry-run"], capsys)  # recorded with the preset's 60 steps
    assert "troll_lr5e-06_s0" in err and "other settings (steps): give the flags it was run with" in err


def test_the_stability_runs_take_each_losss_best_lr_times_the_multiples_on_the_first_seeds(tmp_path, capsys):
    """With TROLL's best at 1e-5 and PPO-clip's at 2e-5, --stability 2 4 on the first 2 seeds runs TROLL at 2e-5 and
    4e-5 and PPO-clip at 4e-5 and 8e-5 on seeds 0 and 1, but TROLL 2e-5 on seed 0, which the sweep made; before
    the sweep is recorded the dry run says how many at most."""
    flags = ["--seeds", "0", "1", "2", "--stability_seeds", "2", "--out", str(tmp_path / "runs"), "--results",
             str(tmp_path / "r.jsonl")]  # fmt: skip
    args = real.parse(flags)
    assert real.parse(["--seeds", "0", "1"]).stability_seeds == 2 and real.parse([]).stability_seeds == 3
    runs = real.stability(args, {"troll": 1e-5, "ppo_clip": 2e-5})
    assert [r.name for r in runs] == ["ppo_clip_lr4e-05_s0", "troll_lr4e-05_s0", "ppo_clip_lr8e-05_s0",
                                      "troll_lr2e-05_s1", "ppo_clip_lr4e-05_s1", "troll_lr4e-05_s1",
                                      "ppo_clip_lr8e-05_s1"]  # fmt: skip
    assert {r.stage for r in runs} == {"stability"} and runs[1].lr == 4e-5  # the lr its name says
    assert real.config(runs[1], args).lr == 4e-5
    assert real.main([*flags, "--dry-run"]) == []
    assert "then stability, each loss at 2 4 x its best lr on seeds 0 1: at most 8 runs, chosen when the sweep is " \
        "done" in capsys.readouterr().out  # fmt: skip
    rows = [r | {"config": settings(asdict(real.config(real.Run(r["loss"], r["lr"], 0), args)))}
            for r in study_rows([0.5, 0.5], [0.5, 0.5]) if r["seed"] == 0]  # fmt: skip
    write(tmp_path / "r.jsonl", rows)
    real.main([*flags, "--dry-run"])
    out = capsys.readouterr().out
    assert "then stability, each loss at 2 4 x its best lr on seeds 0 1: 7 runs, 0 done\n  ppo_clip_lr4e-05_s0\n" in out
    assert "warm-starts to make: 3 (seeds 0 1 2)" in out  # seed 0 has stability runs to make
    # 4 later runs + 7 stability runs at the built-in seconds a step x 60 + 4 x 500 x seconds a problem, + 3
    # warm-starts
    f = real_time.MEASURED["smollm2-135m-instruct"]
    minutes = (11 * (60 * f["step_s"] + 4 * 500 * f["eval_s"]) + 3 * f["warm_s"]) / 60
    assert (
        f"about {minutes:.0f} min one run at a time (11 runs x {(60 * f['step_s'] + 2000 * f['eval_s']) / 60:.1f}"
        in out
    )


def test_the_stability_table_against_a_hand_computation_and_its_runs_never_choose_the_lr(capsys):
    """TROLL's best 1e-5 (0.50 on the sweep seed) stays its best though its stability runs at 4e-5 score 0.90 on
    seeds 0-2: they do not choose. The table by hand: TROLL at 2e-5 on seeds 0-2 (the sweep's 0.45 and two stability
    runs, 0.30 and 0.15): mean 0.30, half 4.3027 * 0.15 / sqrt(3) = 0.373, 2 of 3 below their start (0.4); entropy
    over the first 10 and the last 10 of 12 steps."""
    ent = [1.0] * 2 + [0.5] * 8 + [0.1] * 2  # first 10: 0.6; last 10: (0.5 * 8 + 0.1 * 2) / 10 = 0.42
    rows = study_rows([0.55, 0.35], [0.45, 0.40])
    rows = [r | {"per_step": {"entropy": ent}} for r in rows]
    rows += [row("troll", 2e-5, s, a, stage="stability", per_step={"entropy": ent}) for s, a in ((1, 0.30), (2, 0.15))]
    rows += [row("troll", 4e-5, s, 0.90, stage="stability") for s in (0, 1, 2)]
    assert real_report.best_lr(rows, "troll") == (1e-5, [0])
    text = real_report.report(rows, real.MODELS)
    half = T2 * statistics.stdev([0.45, 0.30, 0.15]) / math.sqrt(3)
    assert f"| troll | 2e-05 | 2x | 0,1,2 | 0.300 ± {half:.3f} | 2/3 | 0.600 -> 0.420 |" in text
    assert (
        "| troll | 1e-05 | 1x | 0,1,2 | 0.467 ± " in text
        and "| troll | 4e-05 | 4x | 0,1,2 | 0.900 ± 0.000 | 0/3 |" in text
    )
    assert "| ppo_clip | 2e-05 | 1x | 0,1,2 | 0.443 ± " in text  # PPO-clip ran nothing above its best
    assert "troll at lr 1e-05 - ppo_clip at lr 2e-05" in text


def test_a_foreign_results_file_and_a_foreign_warm_start_are_refused(tmp_path, capsys):
    other = write(tmp_path / "o.jsonl", [{"name": "troll_none_recompute_lr0.0001_s0", "loss": "troll", "lr": 1e-4,
                                          "seed": 0, "eval_before": 0.1, "eval_after": 0.2}])  # fmt: skip
    assert "lacks model, step_s, config" in refused(["--report", "--results", str(other)], capsys)
    out = tmp_path / "runs"
    (out / "warm-s0").mkdir(parents=True)
    (out / "warm-s0" / "notes.txt").write_text("mine")
    flags = ["--seeds", "0", "--out", str(out), "--results", str(tmp_path / "r.jsonl"), "--dry-run"]
    assert "holds files but no warm.json" in refused(flags, capsys)
    (out / "warm-s0" / "warm.json").write_text(json.dumps({"model": "smollm2-135m-instruct", "sft_limit": 5}))
    assert "was warm-started with --sft_steps 5" in refused(flags, capsys)
    assert (out / "warm-s0" / "notes.txt").read_text() == "mine"


ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "path, module", [("study/README.md", real), ("study/real.py", real), ("study/README.md", real_gsm8k),
                     ("study/real_gsm8k.py", real_gsm8k)]
)  # fmt: skip
def test_every_documented_command_of_the_study_is_accepted(path, module):
    """The `python -m study.real` (and `study.real_gsm8k`) commands of the README and the modules' docstrings parse
    (continued lines joined, comments dropped)."""
    text = (ROOT / path).read_text().replace("\\\\", "\\")  # the docstring's source doubles the line-end backslash
    lines, commands = [line.strip() for line in text.splitlines()], []
    for i, line in enumerate(lines):
        if line.startswith(f"{module.PROG} "):
            while line.endswith("\\"):
                i += 1
                line = line[:-1] + " " + lines[i]
            commands.append(shlex.split(line.split(" #")[0])[2:])
    assert len(commands) >= (4 if module is real else 2)
    for _, *argv in commands:
        module.parse(argv)


@pytest.mark.slow
def test_a_tiny_study_end_to_end_shares_warm_starts_picks_the_best_and_reports(tmp_path, capsys):
    """The tiny model in place of SmolLM2 (`--model tiny`): the sweep on seed 0, the best lr on seed 1, then each
    loss at twice its best lr on seed 0 (a run the sweep made where that is 2e-5), one warm-start per seed shared by
    its runs, resumable, and the report's paired line and stability table."""
    out, results = tmp_path / "runs", tmp_path / "results.jsonl"
    argv = ["--model", "tiny", "--seeds", "0", "1", "--lrs", "1e-5", "2e-5", "--steps", "1", "--eval_size", "4",
            "--sft_steps", "1", "--out", str(out), "--results", str(results), "--stability", "2",
            "--stability_seeds", "1"]  # fmt: skip
    rows = real.main(argv)
    best = real.chosen(rows, real.parse(argv))
    stable = [f"{loss}_lr{2 * best[loss]:g}_s0" for loss in ("troll", "ppo_clip") if best[loss] == 2e-5]
    assert sorted(r["name"] for r in rows) == sorted(
        [f"{loss}_lr{lr:g}_s0" for loss in ("troll", "ppo_clip") for lr in (1e-5, 2e-5)]
        + [f"{loss}_lr{best[loss]:g}_s1" for loss in ("troll", "ppo_clip")]
        + stable
    )
    assert {r["stage"] for r in rows} == {"sweep", "best"} | ({"stability"} if stable else set())
    for seed in (0, 1):
        warm = json.loads((out / f"warm-s{seed}" / "warm.json").read_text())
        made = (warm["model"], warm["sft_limit"], warm["preset"], warm["sft_steps_run"])
        assert made == ("tiny", 1, "smollm2-words", 1)
        mine = [r for r in rows if r["seed"] == seed]
        assert {r["config"]["model"] for r in mine} == {str(out / f"warm-s{seed}")}
        asked = {(r["config"]["sft_steps"], r["config"]["task"], r["config"]["chat"]) for r in mine}
        assert asked == {(0, "words", True)}
        assert len({r["eval_before"] for r in mine}) == 1  # one warm-start: the same held-out accuracy before RL
    for r in rows:  # each run keeps its final model (no optimiser state) and no checkpoint
        final = out / r["name"] / "final"
        assert (final / "model.safetensors").is_file() and not (final / "trainer.pt").exists()
        assert not (out / r["name"] / "checkpoints").exists()
        assert r["steps"] == 1 and r["step_s"] > 0 and len(r["eval_curve"]) == 2 and r["eval_problems"] == 4
        assert 0 <= r["frac_active"] <= 1 and "kl_after_mean" in r and r["per_step"]["kl_before_mean"]
        assert 0 < r["cpu_s"] and 0 < r["wall_clock_s"]
    assert real.main(argv) == []  # everything recorded: nothing to run
    capsys.readouterr()
    real.main(["--report", "--results", str(results)])
    text = capsys.readouterr().out
    assert "troll at lr" in text and "| troll | " in text.split("Stability:")[1]
    assert text.strip().endswith(real_report.cost(rows)) and "not recorded" not in text
    assert "(steps)" in refused([*argv[:8], "--steps", "2", *argv[10:]], capsys)


def test_the_committed_study_reads_through_its_schema_and_reports_what_the_docs_say(capsys):
    """study/real_20steps.jsonl, the study docs/results.md reports: its 8 rows read through the study's checks, and the
    report gives the figures quoted there (the paired difference, its interval, the verdict)."""
    path = Path(__file__).resolve().parents[1] / "study" / "real_20steps.jsonl"
    real.main(["--report", "--results", str(path)])
    out = capsys.readouterr().out
    assert "| troll | 1e-05 (best) | 0,1,2 | 0.437 | 0.447 | +0.010 | 1/3 |" in out
    assert "| ppo_clip | 1e-05 (best) | 0,1,2 | 0.437 | 0.420 | -0.017 | 2/3 |" in out
    assert "3 seeds: 0.447 - 0.420 = +0.027 ± 0.288: the interval contains 0: noise" in out
    assert len(path.read_text().splitlines()) == 8
