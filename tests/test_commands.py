"""Every command refuses bad input with one line naming the problem: exit 2, no traceback (issue 22).

Each case runs the command as a subprocess (`sys.executable -m ...` or `sys.executable bench/x.py`), the way a user
does. Every refusal is one line on stderr, argparse's own (a bad flag value) too (troll.base.cli.Parser): no usage
block.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from study import figures
from study import run as study_run
from troll.base.config import PRESETS, Config
from troll.tools.plot import figure

WORDS = Config(**PRESETS["smollm2-words"])  # bench/trl_compare.py's real-model defaults
WORDS_HALF = WORDS.prompts_per_step * WORDS.samples_per_prompt // 2

ROOT = Path(__file__).resolve().parents[1]
GOOD = {"question": "What is 6 * 7?", "answer": "6 * 7 = 42\n#### 42"}


def command(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE", **(env or {})},
    )


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """Assert exit 2, no traceback, no usage block, and one error line naming `words`; returns that line."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert ": error: " in lines[-1], result.stderr
    for word in words:
        assert word in lines[-1], (word, lines[-1])
    return lines[-1]


# ------------------------------------------------------------------------------------------ troll.tools.evaluate


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gsm8k")
    (path / "test.jsonl").write_text(json.dumps(GOOD) + "\n")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A folder that holds every file a model folder needs (never loaded: the tests stop before)."""
    path = tmp_path_factory.mktemp("model")
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (path / name).write_text("{}")
    return path


def evaluate(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return command("-m", "troll", "evaluate", *argv, env=env)


@pytest.mark.parametrize("missing", ["./no/such/model", "/no/such/model", "runs/x/checkpoints/step-000250"])
def test_evaluate_missing_model_path(missing, data_dir):
    refused(evaluate("--model", missing, "--data", str(data_dir)), f"model path {missing} does not exist")


def test_evaluate_folder_without_model_names_the_missing_files(tmp_path, data_dir):
    (tmp_path / "config.json").write_text("{}")
    line = refused(evaluate("--model", str(tmp_path), "--data", str(data_dir)), str(tmp_path), "not a model folder")
    assert "weights" in line and "tokenizer" in line and "config.json" not in line


@pytest.mark.slow
def test_evaluate_run_directory(tmp_path, data_dir, model_dir):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "eval_acc": 0.1}\n')
    refused(evaluate("--model", str(run), "--data", str(data_dir)), "run directory without checkpoints")
    (run / "checkpoints" / "latest").write_text("step-000250")
    refused(evaluate("--model", str(run), "--data", str(data_dir)), "names 'step-000250'", "not a checkpoint")
    # a complete run directory resolves to its latest checkpoint, and says so (the model here is no real model:
    # loading it fails later, which is not what this test is about)
    (run / "checkpoints" / "step-000250").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (run / "checkpoints" / "step-000250" / name).write_text("{}")
    result = evaluate("--model", str(run), "--data", str(data_dir), "--limit", "1", "--out", str(tmp_path / "e"))
    assert f"evaluating its latest checkpoint, {run / 'checkpoints' / 'step-000250'}" in result.stderr


def test_evaluate_model_file_not_folder(tmp_path, data_dir):
    (tmp_path / "model.bin").write_text("x")
    refused(evaluate("--model", str(tmp_path / "model.bin"), "--data", str(data_dir)), "is not a folder")


@pytest.mark.parametrize("offline", ["", "1"])
def test_evaluate_unknown_hub_name_fails_fast(offline, data_dir, tmp_path):
    """No hub is reachable from the test machine (or HF_HUB_OFFLINE says not to try): not a minute of retries."""
    env = {"HF_HUB_OFFLINE": offline, "HF_HOME": str(tmp_path / "hf")}  # an empty cache
    start = time.perf_counter()
    result = evaluate("--model", "nobody/no-such-model-troll", "--data", str(data_dir), env=env)
    assert time.perf_counter() - start < 30  # interpreter start-up included; the lookup itself is < 3 s
    line = refused(result, "nobody/no-such-model-troll")
    assert "not in the local cache" in line or "not a model on the hub" in line, line


@pytest.mark.slow
def test_evaluate_bad_data_and_numbers(tmp_path, model_dir, data_dir):
    refused(evaluate("--model", str(model_dir), "--data", str(tmp_path / "none")), "does not exist")
    (tmp_path / "empty").mkdir()
    refused(evaluate("--model", str(model_dir), "--data", str(tmp_path / "empty")), "has no test.jsonl")
    (tmp_path / "empty" / "test.jsonl").write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    refused(evaluate("--model", str(model_dir), "--data", str(tmp_path / "empty")), "test.jsonl line 1", "UTF-8")
    (tmp_path / "empty" / "test.jsonl").write_text("\n")
    refused(evaluate("--model", str(model_dir), "--data", str(tmp_path / "empty")), "holds no rows")
    refused(evaluate("--model", str(model_dir), "--data", str(data_dir), "--limit", "0"), "--limit must be >= 1")
    refused(evaluate("--model", str(model_dir), "--data", str(data_dir), "--max_new_tokens", "0"), "--max_new_tokens")
    (tmp_path / "file").write_text("")
    refused(evaluate("--model", str(model_dir), "--data", str(data_dir), "--out", str(tmp_path / "file")), "--out")
    refused(evaluate("--model", str(model_dir), "--limit", "x"), "--limit")


EVALUATE_FLAGS = [  # (flags after --model, words of the error line): settings that cannot act, and bad values
    (["--temperature", "0.7"], ["--temperature acts only with --samples N > 0", "drop --temperature"]),
    (["--seed", "1"], ["--seed acts only with --samples N > 0", "drop --seed"]),
    (["--samples", "-1"], ["--samples must be >= 0"]),
    (["--samples", "4", "--temperature", "nan"], ["--temperature must be > 0 and finite"]),
    (["--task", "addition", "--data", "openai/gsm8k"], ["--data acts only with --task gsm8k", "not --task addition"]),
    (["--task", "addition", "--chat", "true"], ["--chat acts only with --task gsm8k", "drop --chat"]),
    (["--task", "chess"], ["--task", "invalid choice", "gsm8k"]),
    (["--max-new-tokens", "8"], ["unrecognized arguments: --max-new-tokens", "--help lists the flags"]),
]


@pytest.mark.parametrize(("flags", "words"), EVALUATE_FLAGS, ids=[" ".join(flags) for flags, _ in EVALUATE_FLAGS])
def test_evaluate_refuses_a_flag_that_cannot_act(tmp_path, model_dir, flags, words):
    refused(evaluate("--model", str(model_dir), *flags, "--out", str(tmp_path / "e")), *words)
    assert not (tmp_path / "e").exists()


def test_evaluate_scores_a_run_on_its_own_task(tmp_path, model_dir, data_dir):
    """A run's checkpoint is scored on the task it was trained on: another is refused naming both, and so is a run
    whose config.json is missing or damaged (it says which task)."""
    from troll.base.config import Config

    run = tmp_path / "run"
    shutil.copytree(model_dir, run / "checkpoints" / "step-000001")
    Config(task="addition").save(run / "config.json")
    refused(evaluate("--model", str(run), "--task", "gsm8k"), f"{run} was trained on addition; pass --task addition")
    line = refused(evaluate("--model", str(run), "--data", str(data_dir)), "--data acts only with --task gsm8k")
    assert f"({run} was trained on addition)" in line
    (run / "config.json").write_bytes(b"\xff")
    refused(evaluate("--model", str(run)), f"{run / 'config.json'} is damaged", f"--out {run} --resume true")


# ------------------------------------------------------------------------------------------------ troll.tools.plot


def plot(*argv: str) -> subprocess.CompletedProcess:
    return command("-m", "troll", "plot", *argv)


@pytest.mark.slow
def test_plot_missing_or_empty_run(tmp_path):
    refused(plot(str(tmp_path / "nope"), "--out", str(tmp_path / "p")), f"run directory {tmp_path / 'nope'}")
    refused(plot(str(tmp_path), "--out", str(tmp_path / "p")), "metrics.jsonl does not exist")
    (tmp_path / "metrics.jsonl").write_text("")
    refused(plot(str(tmp_path), "--out", str(tmp_path / "p")), "metrics.jsonl is empty")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "unplotted": 2}\n')
    refused(plot(str(tmp_path), "--out", str(tmp_path / "p")), "none of the runs logged")
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"step": 1, "reward": 0.5}\n{"step": 2, "rew\n{"step": 3, "reward": 0.5}\n', ["line 2", "not valid JSON"]),
        ('{"step": 1, "reward": 0.5}\n[1]\n', ["line 2", "expected a JSON object"]),
        ('{"step": 1, "reward": 0.5}\n{"reward": 0.5}\n', ["line 2: step is missing"]),
        ('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": "high"}\n', ['line 2: reward is "high", expected']),
        (b'{"step": 1, "reward": 0.5}\n{"step": 2, "x": "\xff"}\n', ["line 2", "not UTF-8"]),
        ('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.5\n', ["line 2", "not valid JSON"]),  # ends in \n
    ],
)
def test_plot_damaged_metrics_name_file_and_line(tmp_path, text, words):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    refused(plot(str(tmp_path), "--out", str(tmp_path / "p")), *words)
    assert not (tmp_path / "p").exists()


def test_plot_tolerates_a_torn_last_line(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0, "eval_acc": 0.2}\n{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    result = plot(str(run), "--out", str(tmp_path / "p"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["metrics.png"]
    assert result.stdout.strip() == str(tmp_path / "p" / "metrics.png")
    (warning,) = result.stderr.strip().splitlines()
    assert f"{run / 'metrics.jsonl'} line 3: skipped a torn last line" in warning
    with pytest.warns(UserWarning, match="torn last line"):  # the figure's panels: the complete rows' metrics
        fig = figure([run])
    assert [ax.get_title() for ax in fig.axes] == ["Training reward", "Held-out accuracy"]


@pytest.mark.slow
def test_plot_out_is_a_file_and_two_runs_of_one_name(tmp_path):
    for name in ("a/run", "b/run"):
        (tmp_path / name).mkdir(parents=True)
        (tmp_path / name / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    (tmp_path / "file").write_text("")
    refused(plot(str(tmp_path / "a/run"), "--out", str(tmp_path / "file")), "file")
    refused(plot(str(tmp_path / "a/run"), str(tmp_path / "b/run")), "two runs are named 'run'")


# ------------------------------------------------------------------------------------- study.figures / run


def test_figures_missing_empty_or_damaged_results(tmp_path):
    path = tmp_path / "results.jsonl"
    refused(command("-m", "study.figures", str(path)), f"results file {path} does not exist")
    path.write_text("")
    refused(command("-m", "study.figures", str(path)), "holds no finished runs")
    path.write_text('{"name": "x", "variant": "troll-rest"}\n')
    refused(command("-m", "study.figures", str(path)), "run 'x' lacks", "eval_after")
    path.write_text('{"name": "x"\n')
    refused(command("-m", "study.figures", str(path)), "line 1", "not valid JSON")


SMALL = ["--variants", "troll-rest", "--lrs", "1e-3", "--off_policy", "2x2", "--seeds", "0", "--steps", "2"]


def test_study_refuses_a_run_made_with_other_settings(tmp_path):
    out, results = tmp_path / "runs", tmp_path / "results.jsonl"
    args = study_run.parse([*SMALL, "--out", str(out), "--results", str(results)])
    (name,) = [r.name for r in study_run.grid(args)]
    (out / name).mkdir(parents=True)
    cfg = study_run.config(study_run.grid(args)[0], args)
    cfg.save(out / name / "config.json")
    argv = ["-m", "study.run", *SMALL, "--out", str(out), "--results", str(results), "--dry-run"]
    assert command(*argv).returncode == 0  # the same settings: resumed, not refused
    line = refused(command(*argv[:-1], "--eval_size", "16", "--dry-run"), f"run {name}", "eval_size was 400, now 16")
    assert str(out / name / "config.json") in line
    (out / name / "config.json").unlink()  # a results row (committed file: no config) with other steps
    committed = json.loads((ROOT / "study" / "results.jsonl").read_text().splitlines()[0])  # a row as declared
    row = {k: committed[k] for k in figures.FIELDS} | {"name": name, "eval_problems": 400}
    results.write_text(json.dumps(row | {"steps": 40}) + "\n")
    refused(command(*argv), f"run {name}", "steps was 40, now 2")
    results.write_text(json.dumps(row | {"steps": 2}) + "\n")
    assert command(*argv).returncode == 0
    results.write_text('{"name": \n')
    refused(command(*argv), "results.jsonl line 1")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--off_policy", "4y1"], ["--off_policy", "MINIBATCHESxEPOCHS"]),
        (["--seeds", "0", "0"], ["lists a run twice"]),
        (["--lrs", "nan"], ["lr must be > 0"]),
        (["--jobs", "0"], ["--jobs must be >= 1"]),
        (["--variants", "nope"], ["--variants"]),
    ],
)
def test_study_bad_flags(tmp_path, flags, words):
    refused(command("-m", "study.run", "--out", str(tmp_path), "--dry-run", *flags), *words)


def test_study_out_and_results_paths(tmp_path):
    (tmp_path / "file").write_text("")
    argv = ["-m", "study.run", "--dry-run"]
    refused(command(*argv, "--out", str(tmp_path / "file")), "--out", "is a file")
    refused(command(*argv, "--out", str(tmp_path), "--results", str(tmp_path)), "--results", "folder")


# ---------------------------------------------------------------------------------------------------- bench


@pytest.mark.slow
@pytest.mark.parametrize(
    ("script", "flags", "words"),
    [
        ("projection.py", ["--n", "0"], ["--n", "must be >= 1"]),
        ("projection.py", ["--n", str(10**12)], ["--n 1000000000000 tokens x --v 151936 logits", "GiB free here"]),
        ("rollout.py", ["--prompts", str(10**12)], ["--prompts 1000000000000 x --n 8 x --max-new 256", "free here"]),
        ("rollout.py", ["--hidden", str(10**12)], ["--hidden 1000000000000 x --layers 4", "free here"]),
        ("projection.py", ["--device", "bogus"], ["--device", "not a torch device"]),
        ("projection.py", ["--lr", "0.1"], ["--lr applies to real logits"]),
        ("projection.py", ["--logits", "nope"], ["--logits nope", "not a model folder"]),
        ("real_logits.py", ["--ks", "0"], ["--ks", ">= 1"]),
        ("real_logits.py", ["--json", "/no/such/folder/x.json"], ["--json", "folder does not exist"]),
        ("real_shapes.py", ["--models", "nope"], ["--models", "expected a comma list"]),
        ("real_shapes.py", ["--rows", "0"], ["--rows"]),
        ("real_shapes.py", ["--json", "/no/such/folder/x.json"], ["--json", "folder does not exist"]),
        ("records.py", ["--records_samples", "0"], ["--records_samples 0 records nothing", "pass 1 or more"]),
        ("rollout.py", ["--heads", "3"], ["multiple of --heads"]),
        ("rollout.py", ["--prompts", "x"], ["--prompts", "not an integer"]),
        ("sparse_models.py", ["--delta", "1"], ["--delta must be in [0, 1)"]),
        ("sparse_models.py", ["--eps", "-1"], ["--eps", "> 0"]),
        ("step.py", ["--repeats", "0"], ["--repeats", "must be >= 1"]),
        ("trl_compare.py", ["--lr", "inf"], ["--lr", "finite"]),
        ("trl_compare.py", ["--prompts", "3", "--n", "3", "--minibatches", "2"], ["divisible"]),
        ("trl_compare.py", ["--n", "1"], ["--n", "must be >= 2"]),  # a group of one: every advantage 0
        ("trl_compare.py", ["--model", "smollm2"], ["--model", "invalid choice"]),
        ("trl_compare.py", ["--sides", "troll,troll_shared,trl"], ["--sides", "troll_clip"]),  # a real model's side
        (
            "trl_compare.py",
            ["--model", "smollm2-135m-instruct", "--sides", "troll,troll_clip,trl"],
            ["--sides", "troll_shared", "--model smollm2-135m-instruct"],
        ),
        (
            "trl_compare.py",
            ["--model", "smollm2-135m-instruct", "--sides", "troll,troll_shared_system,trl"],
            ["--sides", "trl_system", "together"],
        ),  # TRL on the same prompts, or no comparison
        (
            "trl_compare.py",
            ["--model", "smollm2-135m-instruct", "--minibatches", str(WORDS_HALF)],
            [f"--minibatches {WORDS_HALF}", f"--prompts {WORDS.prompts_per_step}", "whole groups"],
        ),  # the preset's samples in half as many minibatches: more minibatches than groups
        (
            "trl_compare.py",
            ["--model", "smollm2-135m-instruct", "--prompts", "3", "--minibatches", "5"],
            ["divisible"],
        ),  # the real model's defaults filled in before the checks: 3 x 4 samples
        ("trl_compare.py", ["--prompts", "100000000"], ["--prompts 100000000", "--n 8", "--max_new 5", "free"]),
        ("step.py", ["--prompts_per_step", "100000000", "--sft_steps", "0"], ["--prompts_per_step 100000000", "free"]),
        ("records.py", ["--max_new_tokens", "100000", "--sft_steps", "0"], ["--max_new_tokens 100000", "positions"]),
        ("records.py", ["--vocab_size", "1000000000000", "--sft_steps", "0"], ["--vocab_size 1000000000000", "free"]),
        ("step.py", ["--vocab_size", "1000000000000", "--sft_steps", "0"], ["--vocab_size 1000000000000", "free"]),
        ("trl_compare.py", ["--seed", "1" + "0" * 30], ["seed must be below 2**63"]),  # in this command's name
        ("trl_compare.py", ["--max_new", "100000"], ["--max_new 100000", "positions"]),  # past its positions
    ],
)
def test_bench_bad_arguments(script, flags, words):
    refused(command(str(ROOT / "bench" / script), *flags), *words)


BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("[!_]*.py"))


def test_every_bench_script_is_listed():
    assert BENCHES == [
        "projection", "real_logits", "real_shapes", "records", "rollout", "sparse_models", "step", "trl_compare"
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", BENCHES)
def test_bench_runs_as_a_module_and_as_a_file(name, tmp_path):
    """`python -m bench.<name>` from the repository root and `python bench/<name>.py` from anywhere, neither with
    PYTHONPATH: both import bench._util and print the help (the two run at once, one per core)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_WAIT_POLICY": "PASSIVE"}
    ways = [(["-m", f"bench.{name}"], ROOT), ([str(ROOT / "bench" / f"{name}.py")], tmp_path)]
    procs = [
        subprocess.Popen([sys.executable, *argv, "--help"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
        for argv, cwd in ways
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and out.startswith(f"usage: python bench/{name}.py"), (proc.args, err[-2000:])


def test_bench_step_times_the_textbook_clip_beside_ours():
    """bench/step.py's fourth variant, PPO-clip as TRL computes it (whole logits), in the table and the SUMMARY."""
    argv = ["--repeats", "1", "--warmup", "0", "--sft_steps", "0", "--prompts_per_step", "4"]
    res = subprocess.run([sys.executable, "bench/step.py", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    rows = {line.split()[0] for line in res.stdout.splitlines() if line.strip()}
    assert {"troll", "troll-paper", "clip", "textbook"} <= rows
    summary = res.stdout.splitlines()[-1]
    assert summary.startswith("SUMMARY step") and re.search(r"against the textbook clip \d+\.\d\dx", summary)


@pytest.mark.slow
def test_bench_step_levers_times_every_lever_against_today():
    """bench/step.py --compare levers: a row per lever (today's AdamW loop and the fused one among them), each paired
    to today's step, and a SUMMARY naming the best against the target of a third."""
    from bench.step import LEVERS

    argv = ["--compare", "levers", "--repeats", "1", "--warmup", "0", "--sft_steps", "0", "--prompts_per_step", "4"]
    res = subprocess.run([sys.executable, "bench/step.py", *argv], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=os.environ | {"OMP_WAIT_POLICY": "PASSIVE"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    table = res.stdout.split("median wall s")[1].splitlines()[1:-1]
    assert [line.split("  ")[0].strip() for line in table] == list(LEVERS), table
    assert re.search(r"\| +1\.00x \|", table[0]) and "today+fused" in LEVERS
    assert re.fullmatch(r"SUMMARY levers: .+ / today \d\.\d\dx the step \(target <= 0\.33x\): (NOT )?met; .+",
                        res.stdout.splitlines()[-1])  # fmt: skip


def test_a_run_logged_to_a_file_has_no_bar_redraws_and_a_line_per_evaluation(tmp_path):
    """stdout and stderr sent to files (a pipe here, as `> log 2>&1`): no progress bar draws (no carriage returns),
    and every evaluation is one line with its step, so a log reads as the run went."""
    res = command("-m", "troll", "train", "--steps", "4", "--eval_every", "2", "--sft_steps", "3", "--eval_size", "4",
                  "--prompts_per_step", "4", "--samples_per_prompt", "2", "--out", str(tmp_path / "run"))  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    assert "\r" not in res.stdout + res.stderr and "it/s" not in res.stdout + res.stderr
    evals = [line for line in res.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in evals] == ["step 2/4", "step 4/4"], res.stdout
    assert all(re.fullmatch(r"step \d/4: eval \d\.\d{3}, reward \d\.\d\d, kl max \d\.\d{3}", x)
               for x in evals)  # fmt: skip


@pytest.mark.slow
def test_an_evaluation_with_its_output_piped_draws_no_bar(tmp_path):
    """troll.tools.evaluate loading a model and sampling, stdout and stderr piped: the figures, its progress as lines,
    and no bar (the weights' loading bar of transformers drew here before troll.base.cli.run_command turned the
    libraries' bars off)."""
    from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer
    from troll.tasks import addition

    tokenizer = train_tokenizer(addition.corpus(), vocab_size=64)
    save_tiny(tiny_llama(tokenizer, hidden=32, layers=1, heads=2), tokenizer, tmp_path / "model")
    data = ["--data", str(ROOT / "tests" / "data" / "gsm8k"), "--limit", "2"]
    res = command("-m", "troll", "evaluate", "--model", str(tmp_path / "model"), *data, "--max_new_tokens", "2",
                  "--samples", "2", "--out", str(tmp_path / "eval"))  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    progress = r"evaluate: [12]/2 problems, [24] samples, \d+ s spent, about \d+ s left"  # troll.tools.evaluate's lines
    assert all(re.fullmatch(progress, line) for line in res.stderr.splitlines()), res.stderr[-2000:]
    assert res.stderr.endswith("evaluate: 2/2 problems, 4 samples, 0 s spent, about 0 s left\n"), res.stderr
    assert "\r" not in res.stdout + res.stderr and "it/s" not in res.stdout + res.stderr
    assert res.stdout.startswith("gsm8k greedy pass@1: ") and len(res.stdout.splitlines()) == 5
