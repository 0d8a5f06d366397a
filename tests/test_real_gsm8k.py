"""GSM8K before and after the real-model study's best runs (study/real_gsm8k.py): which models it evaluates, its
refusals before anything is written, its report against a hand computation, a damaged summary named, and the
rehearsal end to end after a tiny study (slow)."""

import json
import math
import statistics
from pathlib import Path

import pytest

from study import real, real_gsm8k
from troll.base.cli import run_command

T1 = 12.706205  # t_{0.975} with 1 degree of freedom


def refused(argv, capsys) -> str:
    """The one line a refused command prints (as `python -m study.real_gsm8k` runs it); it must exit 2."""
    with pytest.raises(SystemExit) as e:
        run_command(real_gsm8k.PROG, lambda: real_gsm8k.main(argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{real_gsm8k.PROG}: error:"), err
    return err


def row(loss, lr, seed, after=0.5):
    return {"name": real.Run(loss, lr, seed).name, "loss": loss, "lr": lr, "seed": seed, "eval_before": 0.4,
            "eval_after": after, "step_s": 10.0, "model": "smollm2-135m-instruct", "config": {}}  # fmt: skip


def study(tmp_path: Path, seeds=(0, 1)) -> list[str]:
    """A study's results (the sweep on seed 0: TROLL best at 1e-5, PPO-clip at 2e-5; seed 1 at those), its
    warm-starts and its runs' final models as files; returns the flags that name them."""
    rows = [row("troll", 1e-5, 0, 0.6), row("troll", 2e-5, 0, 0.5), row("ppo_clip", 1e-5, 0, 0.4),
            row("ppo_clip", 2e-5, 0, 0.45), row("troll", 1e-5, 1), row("ppo_clip", 2e-5, 1)]  # fmt: skip
    out = tmp_path / "runs"
    for r in rows:
        (out / r["name"] / "final").mkdir(parents=True)
        (out / r["name"] / "final" / "model.safetensors").write_bytes(b"weights")
    for seed in seeds:
        (out / f"warm-s{seed}").mkdir(parents=True)
        (out / f"warm-s{seed}" / "warm.json").write_text("{}")
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--out", str(out), "--results", str(tmp_path / "r.jsonl")]


def test_it_evaluates_each_seeds_warm_start_then_each_losss_run_at_its_best_lr(tmp_path, capsys):
    flags = study(tmp_path)
    args = real_gsm8k.parse([*flags, "--data", "tests/data/gsm8k", "--seeds", "0", "1"])
    rows = list(real.read_results(Path(args.results), real.FIELDS, real.PROG).values())
    runs = tmp_path / "runs"
    assert real_gsm8k.evaluations(args, rows) == [
        ("warm-s0", runs / "warm-s0"), ("troll_lr1e-05_s0", runs / "troll_lr1e-05_s0" / "final"),
        ("ppo_clip_lr2e-05_s0", runs / "ppo_clip_lr2e-05_s0" / "final"), ("warm-s1", runs / "warm-s1"),
        ("troll_lr1e-05_s1", runs / "troll_lr1e-05_s1" / "final"),
        ("ppo_clip_lr2e-05_s1", runs / "ppo_clip_lr2e-05_s1" / "final"),
    ]  # fmt: skip
    argv = real_gsm8k.evaluate_argv(args, runs / "warm-s0", "warm-s0")
    assert argv == ["--model", str(runs / "warm-s0"), "--task", "gsm8k", "--data", "tests/data/gsm8k", "--limit",
                    "200", "--max_new_tokens", "256", "--out", str(runs / "gsm8k" / "warm-s0"), "--backend", "hf",
                    "--samples", "8", "--seed", "0"]  # fmt: skip
    assert real_gsm8k.main([*flags, "--data", "tests/data/gsm8k", "--dry-run"]) == []
    out = capsys.readouterr().out
    assert "3 evaluations of at most 200 problems x 9 completions; at most about 162 min" in out  # 3 x 1800 x 1.8 s
    assert not (runs / "gsm8k").exists()


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "--data is needed to evaluate"),
        (["--report", "--data", "x"], "--data cannot act with --report"),
        (["--report", "--limit", "3"], "--limit cannot act with --report"),
        (["--data", "x", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["--data", "x", "--samples", "-1"], "--samples must be >= 0"),
        (["--data", "x", "--seeds", "0", "0"], "--seeds lists 0 twice"),
        (["--data", "x", "--seeds", "2"], "warm-s2 holds no warm-start (no warm.json): run python -m study.real"),
    ],
)
def test_a_bad_flag_is_refused_in_one_line_before_anything_is_written(argv, says, tmp_path, capsys):
    assert says in refused([*study(tmp_path), *argv], capsys)
    assert not (tmp_path / "runs" / "gsm8k").exists()


def test_a_missing_model_or_a_foreign_file_is_refused_before_the_first_evaluation(tmp_path, capsys):
    flags = [*study(tmp_path), "--data", "tests/data/gsm8k", "--seeds", "0", "1"]
    (tmp_path / "runs" / "troll_lr1e-05_s1" / "final" / "model.safetensors").unlink()
    assert "troll_lr1e-05_s1/final holds no model (model.safetensors)" in refused(flags, capsys)
    (tmp_path / "runs" / "troll_lr1e-05_s1" / "final" / "model.safetensors").write_bytes(b"weights")
    (tmp_path / "runs" / "warm-s1" / "warm.json").unlink()
    assert "warm-s1 holds no warm-start (no warm.json)" in refused(flags, capsys)
    (tmp_path / "runs" / "warm-s1" / "warm.json").write_text("{}")
    (tmp_path / "runs" / "warm-s2").mkdir()
    (tmp_path / "runs" / "warm-s2" / "warm.json").write_text("{}")
    assert "has no troll run at its best lr 1e-05 on seed 2" in refused([*flags, "--seeds", "2"], capsys)
    mine = tmp_path / "runs" / "gsm8k" / "ppo_clip_lr2e-05_s1" / "summary.json"
    mine.parent.mkdir(parents=True)
    mine.write_text("mine")
    assert "summary.json" in refused(flags, capsys)
    assert mine.read_text() == "mine" and sorted(p.name for p in mine.parents[1].iterdir()) == ["ppo_clip_lr2e-05_s1"]
    (tmp_path / "r.jsonl").write_text(json.dumps(row("troll", 1e-5, 0) | {"stage": "stability"}) + "\n")
    assert "holds no loss with a best lr" in refused(flags, capsys)


def summary(path: Path, greedy: float, pass1: float, pass2: float) -> None:
    path.mkdir(parents=True)
    made = {"model": "m", "task": "gsm8k", "accuracy": greedy, "n": 200, "samples": 2, "backend": "hf",
            "pass@k": {"1": pass1, "2": pass2}, "maj@k": {"1": pass1}}  # fmt: skip
    (path / "summary.json").write_text(json.dumps(made))


def test_the_report_against_a_hand_computation(tmp_path, capsys):
    """TROLL minus its warm-start on seeds 0 and 1: greedy pass@1 0.06 and 0.02 (mean 0.04, half-width 12.706 * sd /
    sqrt(2) = 0.254), pass@1 0.03 and 0.01, pass@2 0.04 and 0.01: no transfer shown; PPO-clip's run on seed 1 is not
    evaluated yet (one seed)."""
    flags = [*study(tmp_path), "--seeds", "0", "1"]
    evals = tmp_path / "runs" / "gsm8k"
    summary(evals / "warm-s0", 0.04, 0.03, 0.05)
    summary(evals / "troll_lr1e-05_s0", 0.10, 0.06, 0.09)
    summary(evals / "ppo_clip_lr2e-05_s0", 0.05, 0.03, 0.06)
    summary(evals / "warm-s1", 0.05, 0.04, 0.07)
    summary(evals / "troll_lr1e-05_s1", 0.07, 0.05, 0.08)
    assert real_gsm8k.main([*flags, "--report"]) == []
    out = capsys.readouterr().out
    assert "| troll_lr1e-05_s0 | 200 | 0.100 | 0.060 | 0.090 | +0.060 |" in out
    assert "| warm-s1 | 200 | 0.050 | 0.040 | 0.070 | - |" in out and "ppo_clip_lr2e-05_s1" not in out
    half = [T1 * statistics.stdev(d) / math.sqrt(2) for d in ([0.06, 0.02], [0.03, 0.01], [0.04, 0.01])]
    assert (f"- troll, 2 seed(s): greedy pass@1 +0.040 ± {half[0]:.3f}, pass@1 +0.020 ± {half[1]:.3f}, pass@2 "
            f"+0.025 ± {half[2]:.3f}: no transfer shown (every interval holds 0)") in out  # fmt: skip
    assert "- ppo_clip, 1 seed(s): greedy pass@1 +0.010 (1 seed)" in out
    summary(evals / "ppo_clip_lr2e-05_s1", 0.25, 0.2, 0.3)  # +0.20 and +0.01 on the two seeds: still noise
    (evals / "troll_lr1e-05_s1" / "summary.json").write_text(json.dumps({"accuracy": 1.5, "n": 200}))
    err = refused([*flags, "--report"], capsys)
    assert "troll_lr1e-05_s1/summary.json: accuracy is 1.5, expected a number in [0, 1]" in err
    (evals / "troll_lr1e-05_s1" / "summary.json").unlink()
    (evals / "troll_lr1e-05_s1").rmdir()
    summary(evals / "troll_lr1e-05_s1", 0.11, 0.07, 0.11)  # +0.06, +0.03, +0.04 on seed 1, as on seed 0
    real_gsm8k.main([*flags, "--report"])
    assert "- troll, 2 seed(s): greedy pass@1 +0.060 ± 0.000" in (out := capsys.readouterr().out)
    assert "a change beyond the noise" in out.split("- troll")[1].split("\n")[0]


@pytest.mark.slow
def test_the_rehearsal_after_a_tiny_study_evaluates_before_and_after_and_continues(tmp_path, capsys):
    """study.real on the tiny model (one seed, one lr each), then this command on the repository's GSM8K sample:
    the warm-start and both runs' final models evaluated, the report's rows, and a second call that reads the
    finished evaluations back."""
    flags = ["--out", str(tmp_path / "runs"), "--results", str(tmp_path / "r.jsonl")]
    real.main(["--model", "tiny", "--seeds", "0", "--lrs", "1e-5", "--steps", "1", "--eval_size", "4", "--sft_steps",
               "1", "--stability_seeds", "0", *flags])  # fmt: skip
    data = str(Path(__file__).resolve().parent / "data" / "gsm8k")  # the repository's sample of GSM8K
    argv = [*flags, "--data", data, "--limit", "2", "--samples", "2", "--max_new_tokens", "4"]
    made = real_gsm8k.main(argv)
    assert [(s["n"], s["samples"], s["task"]) for s in made] == [(2, 2, "gsm8k")] * 3
    out = capsys.readouterr().out
    for label in ("warm-s0", "troll_lr1e-05_s0", "ppo_clip_lr1e-05_s0"):
        assert f"| {label} | 2 | " in out and (tmp_path / "runs" / "gsm8k" / label / "predictions.jsonl").is_file()
    again = real_gsm8k.main(argv)  # continued: every problem read back, none generated again
    assert [{k: v for k, v in s.items() if k != "seconds"} for s in again] == [
        {k: v for k, v in s.items() if k != "seconds"} for s in made
    ]
