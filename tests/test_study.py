"""The study's tooling (study/run.py, study/figures.py): a 2-run grid of very short runs
finishes, writes its results file, is skipped when run again, and the figures render from it; the figure functions
on a synthetic results file."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_commands import command, refused

from study import bandit, figures, offpolicy, run, runner
from study.figures import plot_study, read_results
from troll.base.checkpoint import read_jsonl
from troll.base.cli import UsageError

ROOT = Path(__file__).resolve().parents[1]

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


# ------------------------------------------------------------- the studies' shared rules (study/runner.py, issue 40)


def parser_of_two_flags() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--losses", nargs="+", default=["a", "b"])
    return p


@dataclass(frozen=True)
class Pair:
    loss: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.loss}_s{self.seed}"


FLAGS = {"seeds": lambda run: run.seed, "losses": lambda run: run.loss}


def problem(*argv: str, runs: list | None = None) -> str:
    p = parser_of_two_flags()
    args = p.parse_args(argv)
    if runs is None:
        runs = [Pair(loss, seed) for loss in args.losses for seed in args.seeds if loss != "c"]  # c makes no run
    return runner.grid_problem(p, args, runs, FLAGS, "c runs nowhere")


def test_a_list_flag_value_given_twice_or_making_no_run_is_refused():
    assert runner.repeats([0, 1, 0, 2, 1]) == [0, 1] and runner.repeats([]) == []
    assert problem() == "" and problem("--seeds", "3", "4") == ""
    assert problem("--seeds", "0", "0").startswith("--seeds lists 0 twice: the grid lists a run twice")
    assert "--losses lists b twice" in problem("--losses", "b", "a", "b")
    # two values that give one run name (a name prints lr with 6 digits) are one run
    assert "the grid lists a run twice (a_s0)" in problem(runs=[Pair("a", 0), Pair("a", 0)])
    line = problem("--losses", "a", "c")
    assert line.startswith("--losses c makes no run with the other flags given (c runs nowhere)"), line
    # not given: the default list, of which the other flags may pick a part, is not refused
    assert problem(runs=[Pair("a", 0)]) == ""
    assert runner.show((4, 1)) == "4x1" and runner.show(1e-4) == "0.0001" and runner.show("x") == "x"


def test_a_foreign_row_is_named_with_its_line():
    fields = {"name": runner.NAME, "loss": runner.one_of(("troll", "ppo_clip")), "seed": runner.SEED}
    assert runner.foreign_row({"name": "a", "loss": "troll", "seed": 0}, fields) == ""
    assert runner.foreign_row({"name": "a", "seed": 0}, fields) == "lacks loss"
    assert runner.foreign_row({"name": "a", "loss": "bandit", "seed": 0}, fields) == (
        "its loss 'bandit' is none of troll, ppo_clip"
    )


def test_check_rows_counts_lines_past_blank_ones(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"name": "a", "loss": "troll"}\n\n{"name": "b"}\n')
    with pytest.raises(runner.ForeignRow, match=rf"{path} line 3: the row of run 'b' lacks loss: not a row of S"):
        runner.check_rows(path, read_jsonl(path), {"name": runner.NAME, "loss": runner.NAME}, "S")
    with pytest.raises(UsageError, match="line 3"):
        runner.read_results(path, {"name": runner.NAME, "loss": runner.NAME}, "S")
    assert list(runner.read_results(path)) == ["a", "b"]  # without fields: any row


def test_a_paired_difference_without_its_baseline_or_with_one_seed_is_not_nan():
    assert runner.pm(0.1, 0.02) == "+0.100 ± 0.020" and runner.pm(1.0, 0.5, "+.1f", ".1f") == "+1.0 ± 0.5"
    assert runner.pm(math.nan, math.nan) == "-" and runner.pm(0.1, math.nan) == "+0.100 (1 seed)"


@pytest.mark.parametrize(
    ("module", "stem"),
    [(offpolicy, s) for s in ("offpolicy", "rare", "rare_dppo_cap", "rare_earlier", "lora", "sweep")]
    + [(bandit, "bandit")],
)
def test_the_committed_results_files_hold_their_studys_rows(module, stem):
    assert module.read_results(ROOT / "study" / f"{stem}.jsonl", module.FIELDS, module.PROG)


# The studies' commands: a dry run with a small grid (the rules are checked before anything is written)
DRY = {
    "study.run": ["--dry-run", "--steps", "2"],
    "study.offpolicy": ["--dry-run", "--lrs", "1e-4", "--sources", "none", "stale2"],
    "study.bandit": ["--dry-run", "--cells", "issue", "qwen"],
}


def study_command(module: str, tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python -m module` with its --out (where it has one and reads it: not in a report) and --results in
    tmp_path."""
    where = ["--results", str(tmp_path / "results.jsonl")]
    report = {"--report", "--figures"} & set(argv)
    where += [] if module == "study.bandit" or report else ["--out", str(tmp_path / "runs")]
    return command("-m", module, *where, *argv)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "argv", "words"),
    [
        ("study.offpolicy", ["--seeds", "0", "0"], ["--seeds lists 0 twice", "lists a run twice"]),
        ("study.offpolicy", ["--losses", "troll", "cispo", "troll"], ["--losses lists troll twice"]),
        ("study.bandit", ["--seeds", "0", "0"], ["--seeds lists 0 twice", "lists a run twice"]),
        ("study.bandit", ["--variants", "clip-0.2", "clip-0.2"], ["--variants lists clip-0.2 twice"]),
        ("study.run", ["--lrs", "1e-4", "3e-4", "0.0001"], ["--lrs lists 0.0001 twice"]),
    ],
)
def test_a_value_given_twice_is_refused_in_one_line(tmp_path, module, argv, words):
    refused(study_command(module, tmp_path, *DRY[module], *argv), *words)
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "argv", "words"),
    [
        ("study.offpolicy", ["--losses", "ppo_clip", "--settings", "default", "eps0.1"], ["--settings eps0.1"]),
        ("study.offpolicy", ["--sources", "none", "--anchors", "behaviour"], ["--anchors behaviour"]),
        ("study.offpolicy", ["--losses", "troll", "--settings", "eps0.1", "clip0.3"], ["--settings clip0.3"]),
        ("study.bandit", ["--cells", "qwen", "--variants", "troll-0.05", "cispo"], ["--variants cispo"]),
        ("study.bandit", ["--cells", "issue", "qwen", "--variants", "cispo"], ["--cells qwen"]),
        ("study.run", ["--off_policy", "1x1", "--variants", "troll-rest", "cispo"], ["--variants cispo"]),
        ("study.offpolicy", ["--seeds", "-1"], ["seed must be >= 0"]),  # a value every run's config refuses
    ],
)
def test_a_value_that_makes_no_run_is_refused_in_one_line(tmp_path, module, argv, words):
    line = refused(study_command(module, tmp_path, *DRY[module], *argv), *words)
    assert "Traceback" not in line
    assert not list(tmp_path.iterdir())


FOREIGN = {  # a row of each study, and a row with none of any study's fields
    "bandit": {"name": "issue_clip-0.2_s0", "cell": "issue", "variant": "clip-0.2", "seed": 0, "auc": 0.5},
    "offpolicy": {"name": "troll_none_recompute_lr0.0001_s0", "lr": 1e-4, "seed": 0, "source": "none",
                  "anchor": "recompute", "loss": "troll", "eval_before": 0.3, "eval_after": 0.4},
    "other": {"name": "x", "accuracy": 0.5},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "argv", "row"),
    [
        ("study.offpolicy", ["--report"], "bandit"),
        ("study.offpolicy", ["--report"], "other"),
        ("study.offpolicy", ["--figures", "figs"], "bandit"),
        ("study.offpolicy", DRY["study.offpolicy"], "bandit"),  # running into another study's file: refused too
        ("study.bandit", ["--report"], "offpolicy"),
        ("study.bandit", ["--report"], "other"),
        ("study.bandit", DRY["study.bandit"], "offpolicy"),
        ("study.figures", [], "offpolicy"),
        ("study.run", DRY["study.run"], "bandit"),
    ],
)
def test_a_report_over_another_studys_rows_is_one_line_naming_the_file_and_line(tmp_path, module, argv, row):
    path = tmp_path / "results.jsonl"
    text = json.dumps(FOREIGN[row]) + "\n"
    good = {"study.offpolicy": "offpolicy", "study.bandit": "bandit"}.get(module)
    if good:  # a row of the study first: the foreign row is on line 2
        text = json.dumps(json.loads((ROOT / "study" / f"{good}.jsonl").read_text().splitlines()[0])) + "\n" + text
    path.write_text(text)
    line_no = 2 if good else 1
    if module == "study.figures":
        result = command("-m", module, str(path), "--out", str(tmp_path / "figs"))
    else:
        result = study_command(module, tmp_path, *argv)
    prog = "study.run" if module == "study.figures" else module
    refused(result, f"{path} line {line_no}", f"not a row of python -m {prog}", "--results must name")
    assert path.read_text() == text  # the results file untouched, nothing else written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.jsonl"]


def offpolicy_rows(losses: tuple[str, ...], seeds: tuple[int, ...]) -> list[dict]:
    """Rows of the rare task's off-policy study (behaviour rates per step), made up."""
    return [
        {"name": f"{loss}_none_recompute_lr0.0001_s{seed}", "lr": 1e-4, "seed": seed, "source": "none",
         "anchor": "recompute", "loss": loss, "eval_before": 0.3, "eval_after": 0.4 + 0.01 * seed + 0.1 * i,
         "kl_update_mean": 0.01, "mismatch_kl": 0.0, "behaviour_rate": [0.1, 0.3 + 0.1 * i, 0.6]}
        for i, loss in enumerate(losses)
        for seed in seeds
    ]  # fmt: skip


@pytest.mark.slow
def test_the_offpolicy_report_without_its_baseline_says_so_instead_of_nan(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in offpolicy_rows(("troll", "cispo"), (0, 1))))
    result = command("-m", "study.offpolicy", "--report", "--results", str(path))
    assert result.returncode == 0, result.stderr
    assert "nan" not in result.stdout, result.stdout
    assert "No ppo_clip run at its default setting in these results" in result.stdout
    assert "these rows ran troll, cispo" in result.stdout
    assert "| troll | 2 | 0.405 |" in result.stdout  # the columns it can compute are there
    # one seed of the baseline: the difference without a half-width, not "± nan"
    path.write_text("".join(json.dumps(r) + "\n" for r in offpolicy_rows(("troll", "ppo_clip"), (0,))))
    result = command("-m", "study.offpolicy", "--report", "--results", str(path))
    assert result.returncode == 0 and "nan" not in result.stdout, result.stdout
    assert "-0.100 (1 seed)" in result.stdout and "No ppo_clip" not in result.stdout


# ----------------------------------------------------------------------------- a flag that cannot act is refused


def test_the_flags_given_are_those_typed_not_the_defaults(monkeypatch):
    p = runner.argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lrs", nargs="+", type=float, default=[1e-4])
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--name", default="x")
    argv = ["--lrs", "-1", "2", "--steps=40", "--dry-run", "--steps", "3", "--", "--name"]
    assert runner.given(p, argv) == ["--lrs", "--steps", "--dry-run"]  # each once; a default typed is given
    assert runner.given(p, []) == []
    monkeypatch.setattr(runner.sys, "argv", ["prog", "--name=y"])
    assert runner.given(p, None) == ["--name"]  # argv None: the command line, as argparse reads it


def test_a_flag_is_refused_only_in_a_mode_it_cannot_act_in():
    p = runner.argparse.ArgumentParser()
    for flag in ("--a", "--b", "--c"):
        p.add_argument(flag)
    acts, modes = (
        {"--a": ("run",), "--b": ("report", "figures")},
        {m: f"with {m}" for m in ("run", "report", "figures")},
    )
    assert runner.inert_flag(p, ["--a", "1", "--c", "2"], acts, ["run"], modes) == ""  # --c: in every mode
    assert runner.inert_flag(p, ["--b=1"], acts, ["figures"], modes) == ""
    line = runner.inert_flag(p, ["--c", "1", "--b", "1", "--a", "1"], acts, ["run"], modes)
    assert line == "--b cannot act with run: it acts only with report or with figures; drop it"  # the first typed
    assert runner.inert_flag(p, ["--a", "1"], acts, ["report", "figures"], modes).startswith(
        "--a cannot act with report and with figures: it acts only with run"
    )


@pytest.mark.parametrize("module", [run, offpolicy, bandit])
def test_each_studys_table_names_its_own_flags_and_modes(module):
    """ACTS is the rule: every flag it names is one of the command's, every mode one of MODES; the flags that choose
    the mode act in every mode (not in the table), and with no flag the command runs the grid."""
    flags = {max(a.option_strings, key=len) for a in module.parser()._actions if a.option_strings}
    assert set(module.ACTS) <= flags
    assert {m for where in module.ACTS.values() for m in where} <= set(module.MODES)
    assert not {"--report", "--figures", "--calibrate", "--help"} & set(module.ACTS)
    assert module.modes(module.parse([])) == ["run"]


# Each study's flags that cannot act in a mode: (argv, the refusal's words)
INERT = {
    offpolicy: [
        (["--report", "--sources", "none"], "--sources cannot act with --report: it acts only without --report"),
        (["--report", "--seeds", "0"], "--seeds cannot act with --report"),
        (["--figures", "f", "--dry-run"], "--dry-run cannot act with --figures"),
        (["--report", "--out=runs/x"], "--out cannot act with --report"),
        (["--report", "--task", "rare", "--vocab_size", "1024"], "--task cannot act with --report"),
        (["--report", "--figures", "f", "--jobs", "2"], "--jobs cannot act with --report and with --figures"),
        (["--threshold", "0.4"], "--threshold cannot act without --report or --figures: it acts only with --report"),
        (["--dry-run", "--baseline", "dppo"], "--baseline cannot act without --report or --figures"),
        (["--figures", "f", "--baseline", "dppo"], "--baseline cannot act with --figures: it acts only with --report"),
        (["--report", "--name", "rare"], "--name cannot act with --report: it acts only with --figures"),
        (["--figures="], "--figures names the folder"),
    ],
    bandit: [
        (["--report", "--cells", "issue"], "--cells cannot act with --report"),
        (["--figures", "f", "--vocab", "2000"], "--vocab cannot act with --figures"),
        (["--report", "--steps", "20"], "--steps cannot act with --report"),  # a default typed is given
        (["--report", "--dry-run"], "--dry-run cannot act with --report"),
        (["--figures", ""], "--figures names the folder"),
    ],
    run: [
        (["--calibrate", "--dry-run"], "--dry-run cannot act with --calibrate: it acts only without --calibrate"),
        (["--calibrate", "--seeds", "1"], "--seeds cannot act with --calibrate"),
        (["--calibrate", "--jobs", "2"], "--jobs cannot act with --calibrate"),
        (["--calibrate", "--limit", "2"], "--limit cannot act with --calibrate"),
        (["--calibrate", "--results", "r.jsonl"], "--results cannot act with --calibrate"),
        (["--dry-run", "--limit", "144"], "--limit 144 cannot act: the grid has 144 runs"),
        (["--dry-run", "--seeds", "0", "--variants", "cispo", "--limit", "12"], "the grid has 12 runs"),
    ],
}


@pytest.mark.parametrize(("module", "argv", "words"), [(m, a, w) for m, cases in INERT.items() for a, w in cases])
def test_a_flag_that_cannot_act_in_the_commands_mode_is_refused(module, argv, words, capsys):
    with pytest.raises(SystemExit) as refused_:
        module.parse(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert refused_.value.code == 2 and len(err) == 1 and words in err[0], err


# The flags that act in these modes: accepted (a refusal is only for a flag that cannot act)
ACTING = {
    offpolicy: [["--report", "--results", "r.jsonl", "--threshold", "0.5", "--baseline", "dppo"],
                ["--figures", "f", "--name", "n", "--threshold", "0.3"], ["--report", "--figures", "f", "--name", "n"],
                ["--dry-run", "--jobs", "2", "--task", "rare", "--vocab_size", "300", "--out", "runs/x"]],
    bandit: [["--report", "--figures", "f", "--results", "r.jsonl"], ["--dry-run", "--jobs", "2", "--vocab", "2000"]],
    run: [["--calibrate", "--out", "runs/x", "--lrs", "1e-3", "--steps", "2", "--variants", "ppo_clip"],
          ["--dry-run", "--limit", "143", "--jobs", "2", "--results", "r.jsonl"], ["--limit", "0"]],
}  # fmt: skip


@pytest.mark.parametrize(("module", "argv"), [(m, a) for m, cases in ACTING.items() for a in cases])
def test_a_flag_that_acts_in_the_commands_mode_is_accepted(module, argv):
    module.parse(argv)


def documented(path: Path) -> list[list[str]]:
    """The study commands (`python -m study.X ...`) in a markdown file's lines or a module's docstring, continued
    lines joined, comments dropped and the shell variables set before them ($R, $S, ...) expanded."""
    text = path.read_text()
    if path.suffix == ".py":
        text = text.split('"""')[1].replace("\\\\", "\\")
    commands, env, lines = [], {}, [line.strip() for line in text.splitlines()]
    for i, line in enumerate(lines):
        if m := re.fullmatch(r'([A-Z])="(.*)"', line):
            env[m[1]] = m[2]
        if not line.startswith("python -m study.") or (i and lines[i - 1].endswith("\\")):
            continue
        while line.endswith("\\"):
            i += 1
            line = line[:-1] + " " + lines[i]
        line = re.sub(r"\$([A-Z])\b", lambda m: env[m[1]], line.split(" #")[0])
        commands.append(shlex.split(line)[2:])
    return commands


@pytest.mark.parametrize(
    "path", ["study/README.md", "docs/results.md", "study/run.py", "study/offpolicy.py", "study/bandit.py"]
)
def test_every_documented_study_command_is_accepted(path):
    """The study commands the docs and the modules' docstrings give parse (study.figures has no mode flags; the
    README names the studies without their flags)."""
    modules = {"study.run": run, "study.offpolicy": offpolicy, "study.bandit": bandit}
    assert (commands := documented(ROOT / path))
    for module, *argv in commands:
        if module in modules:
            modules[module].parse(argv)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("module", "argv", "words"),
    [
        ("study.offpolicy", ["--report", "--sources", "none"], ["--sources cannot act with --report"]),
        ("study.offpolicy", ["--figures", "figs", "--baseline", "dppo"], ["--baseline", "only with --report"]),
        ("study.offpolicy", ["--dry-run", "--threshold", "0.4"], ["--threshold", "only with --report or with"]),
        ("study.bandit", ["--report", "--figures", "figs", "--cells", "issue"], ["--cells cannot act with --report"]),
        ("study.run", ["--calibrate", "--dry-run", "--steps", "1", "--eval_every", "1", "--sft_steps", "1",
                       "--eval_size", "2", "--out", "runs"], ["--dry-run cannot act with --calibrate"]),
        ("study.run", ["--dry-run", "--limit", "500", "--out", "runs"], ["--limit 500 cannot act", "has 144 runs"]),
    ],
)  # fmt: skip
def test_a_flag_that_cannot_act_is_refused_in_one_line_before_anything_is_written(tmp_path, module, argv, words):
    """Through the real commands: the refusal names the flag and where it acts; the results file is as it was and
    nothing else is written (no figures, no run folder, no calibration)."""
    path = tmp_path / "results.jsonl"
    if module == "study.bandit":  # the committed rows of one cell, the baseline's among them
        rows = [r for r in read_jsonl(ROOT / "study" / "bandit.jsonl") if r["cell"] == "issue"][:20]
    else:
        rows = offpolicy_rows(("troll", "ppo_clip"), (0, 1)) if module == "study.offpolicy" else synthetic_rows()
    path.write_text(text := "".join(json.dumps(r) + "\n" for r in rows))
    argv = [str(tmp_path / a) if a in ("figs", "runs") else a for a in argv]
    where = [] if "--calibrate" in argv else ["--results", str(path)]  # --calibrate reads no results file
    refused(command("-m", module, *where, *argv), *words)
    assert path.read_text() == text and [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("study", "flags"),
    [("run", ["--sft_steps", "0", "--eval_size", "2"]), ("offpolicy", ["--sft_steps", "1", "--eval_size", "2"]),
     ("real", ["--sft_steps", "1", "--eval_size", "2"]), ("bandit", ["--samples", "2"])],
)  # fmt: skip
def test_a_study_refuses_jobs_whose_processes_do_not_fit(tmp_path, study, flags):
    """--jobs of more worker processes than the memory free holds: one line naming it and how many fit, checked with
    the other flags (study.runner.jobs_problem): no process started, no file written (the work folder stays empty)."""
    res = subprocess.run([sys.executable, "-m", f"study.{study}", "--steps", "1", *flags, "--jobs", "1000000"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    line = refused(res, "--jobs 1000000: each job is a worker process", "pass at most")
    assert re.search(r"pass at most \d+$", line) and list(tmp_path.iterdir()) == []
