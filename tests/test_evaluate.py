"""The evaluation command (troll/tools/evaluate.py): greedy pass@1 with the training reward, pass@k and maj@k from
samples (against an enumeration of every k-subset and hand counts), the task it scores, on tiny local models."""

import importlib.util
import itertools
import json
import math
import re
import shutil
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from troll.base.config import Config
from troll.models.tiny import save_tiny, tiny_llama, train_tokenizer
from troll.tasks import addition, gsm8k, words
from troll.tools.evaluate import (
    answer_rule,
    decode,
    encode,
    gsm8k_equal,
    ks,
    load_generator,
    main,
    maj_at_k,
    pass_at_k,
    score,
    too_many,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, gsm8k_dir):
    rows = gsm8k.load_gsm8k("train", str(gsm8k_dir), limit=200)
    tok = train_tokenizer([r["question"] + r["answer"] for r in rows], vocab_size=512)
    return save_tiny(
        tiny_llama(tok, hidden=64, layers=1, heads=2, vocab_size=len(tok) + 8), tok, tmp_path_factory.mktemp("tiny")
    )


def test_score_uses_the_training_reward():
    rows = [{"question": "q1", "gold": "42"}, {"question": "q2", "gold": "7"}, {"question": "q3", "gold": "5"}]
    acc, records = score(rows, ["so #### 42", "\\boxed{7}", "it is 15"], gsm8k.reward)
    assert acc == pytest.approx(2 / 3)
    assert [r["reward"] for r in records] == [1.0, 1.0, 0.0]


def test_command_writes_predictions_and_summary(tmp_path, tiny_dir, gsm8k_dir, capsys):
    summary = main(
        [
            "--model",
            str(tiny_dir),
            "--data",
            str(gsm8k_dir),
            "--limit",
            "4",
            "--max_new_tokens",
            "6",
            "--backend",
            "hf",
            "--out",
            str(tmp_path / "eval"),
        ]
    )
    assert summary["n"] == 4 and 0.0 <= summary["accuracy"] <= 1.0 and summary["chat"] and summary["task"] == "gsm8k"
    assert summary["samples"] == 0 and "pass@k" not in summary and "temperature" not in summary
    preds = [json.loads(x) for x in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 4 and {"question", "gold", "completion", "extracted", "reward"} <= preds[0].keys()
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["accuracy"] == summary["accuracy"]
    assert capsys.readouterr().out.startswith("gsm8k greedy pass@1: ")


@pytest.mark.slow
def test_vllm_greedy_equals_transformers_greedy(tiny_dir, monkeypatch):
    """The command's two backends (padded output layer: the vLLM side masks it with its logits processor)."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = encode(tok, [gsm8k.make_prompt(q, tok, chat=True) for q in ("Tom has 3 apples.", "What is 4+5?")])
    hf = load_generator("hf", str(tiny_dir), tok, 256).greedy(prompts, 8)
    engine = load_generator("vllm", str(tiny_dir), tok, 256)
    try:
        assert engine.greedy(prompts, 8) == hf and decode(tok, hf)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_lora_run_is_evaluated_as_its_export(tmp_path):
    """`troll.tools.evaluate` on a LoRA run (its latest checkpoint: adapters on the run's base, merged in memory) gives
    the predictions of the merged model `troll.tools.export` writes, on the run's own task (addition, its tokenizer
    without a chat template) where the export is told it; another task for the run is refused naming both; `--backend
    vllm` on it names troll.tools.export (issue 40: it said the checkpoint lacked a config and weights)."""
    from test_commands import command, refused

    run, merged = tmp_path / "run", tmp_path / "merged"
    tiny = ["--sft_steps", "0", "--steps", "1", "--eval_size", "4", "--prompts_per_step", "2"]
    trained = command("-m", "troll", "train", "--out", str(run), "--lora_rank", "4", "--lr", "0.05", *tiny)
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = command("-m", "troll", "export", str(run), "--out", str(merged))
    assert exported.returncode == 0, exported.stderr[-3000:]
    flags = ["--limit", "3", "--max_new_tokens", "8", "--backend", "hf"]
    predictions, said = {}, {}
    for name, model, task in (("run", run, []), ("merged", merged, ["--task", "addition"])):
        out = tmp_path / f"eval-{name}"
        done = command("-m", "troll", "evaluate", "--model", str(model), *task, *flags, "--out", str(out))
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert json.loads((out / "summary.json").read_text())["task"] == "addition"
        predictions[name], said[name] = (out / "predictions.jsonl").read_text(), done.stderr
    assert f"its adapters merged into the run's base {run / 'base'}" in said["run"], said["run"][-3000:]
    assert predictions["run"] == predictions["merged"] and predictions["run"].count("\n") == 3
    other = command("-m", "troll", "evaluate", "--model", str(run), "--task", "gsm8k", "--out", str(tmp_path / "g"))
    refused(other, f"{run} was trained on addition; pass --task addition")
    assert not (tmp_path / "g").exists()
    ckpt = run / "checkpoints" / "step-000001"
    if importlib.util.find_spec("vllm") is None:
        return  # --backend vllm is refused for the missing package first
    vllm = command("-m", "troll", "evaluate", "--model", str(ckpt), *flags[:-1], "vllm", "--out", str(tmp_path / "v"))
    line = vllm.stderr.strip().splitlines()[-1]
    assert vllm.returncode == 2 and "Traceback" not in vllm.stderr, vllm.stderr[-3000:]
    assert "LoRA adapters" in line and f"troll export {ckpt}" in line, line


# ------------------------------------------------------------------------------------------ pass@k and maj@k


def subsets_with_a_correct_one(n: int, c: int, k: int) -> float:
    """pass@k by its definition: the share of the k-subsets of n samples (the first c correct) holding a correct one."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(j < c for j in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 8))
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(subsets_with_a_correct_one(n, c, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases_and_large_n():
    for k in range(1, 11):
        assert pass_at_k(10, 0, k) == 0.0 and pass_at_k(10, 10, k) == 1.0
        assert pass_at_k(10, 3, k) == (1.0 if k > 7 else pytest.approx(1 - math.comb(7, k) / math.comb(10, k)))
    assert pass_at_k(10, 1, 10) == 1.0 and pass_at_k(10, 0, 10) == 0.0  # k = n: any correct sample
    assert pass_at_k(16, 5, 1) == pytest.approx(5 / 16)  # k = 1: the share correct
    # C(2000, 1000) overflows a float: the exact ratio of integers against the product form
    exact = 1 - Fraction(math.comb(1997, 1000), math.comb(2000, 1000))
    assert pass_at_k(2000, 3, 1000) == pytest.approx(float(exact), rel=1e-12)
    for n, c, k in ((3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(n, c, k)


def test_ks_are_powers_of_two_below_n_and_n():
    assert [ks(n) for n in (1, 2, 3, 6, 8)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4, 6], [1, 2, 4, 8]]


def test_gsm8k_equal_is_the_rewards_equality():
    assert gsm8k_equal("42", "42.0") and gsm8k_equal("$42", "42") and gsm8k_equal("42 dollars", "42")
    assert gsm8k_equal("1,000", "1000") and not gsm8k_equal("142", "42") and not gsm8k_equal("-3", "3")


def test_maj_at_k_by_hand():
    maj = lambda answers, gold, k: maj_at_k(answers, gold, k, gsm8k_equal)  # noqa: E731
    # 42, 42.0 and $42 are one answer: 3 votes against 2 for 7
    answers = ["7", "42", "42.0", "7", "$42"]
    assert [maj(answers, "42", k) for k in range(1, 6)] == [0.0, 0.0, 1.0, 0.0, 1.0]  # k = 2, 4: ties, 7 came first
    assert [maj(answers, "7", k) for k in range(1, 6)] == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert [maj(["42", "7", "7.00", "42"], "42", k) for k in range(1, 5)] == [1.0, 1.0, 0.0, 1.0]
    # no answer casts no vote: 5 wins once it is the only answer, and loses to nothing
    assert [maj([None, None, "5", None], "5", k) for k in range(1, 5)] == [0.0, 0.0, 1.0, 1.0]
    assert maj([None, "3", None, "5", "5"], "5", 4) == 0.0 and maj([None, "3", None, "5", "5"], "5", 5) == 1.0
    # the winner is compared with the gold by the reward's rule
    assert maj(["$1,000", "999"], "1000", 2) == 1.0 and maj(["1000.5", "1000"], "1000", 2) == 0.0
    for k in (0, 6):
        with pytest.raises(ValueError, match="maj@k"):
            maj(answers, "42", k)


def test_answer_rules_follow_the_tasks_reward():
    extract, equal = answer_rule(gsm8k.reward)
    assert extract("so 6 * 7 = 42 apples") == "42" and extract("no number") is None and equal("42.0", "42")
    extract, equal = answer_rule(addition.reward)  # an exact match of the completion
    assert extract(" 980 ") == "980" and extract("  ") is None
    assert equal("980", "980") and not equal("98", "980") and not equal("980#", "980")
    assert maj_at_k(["980", "98", None, "98", "980", "980"], "980", 6, equal) == 1.0


def test_counts_are_checked_against_the_memory_they_keep():
    """problems x (1 + samples) x max_new_tokens tokens, each KEPT_BYTES_PER_TOKEN, against the memory free: None
    when they fit or the memory is unknown, else one line naming the three counts and how to lower them."""
    gib = 2**30
    assert too_many(1319, 64, 1024, 16 * gib) is None and too_many(10**6, 10**6, 10**6, None) is None
    line = too_many(2, 10**9, 2, 3 * gib)
    assert line is not None and "\n" not in line
    for said in ("2 problems", "--samples 1000000000", "--max_new_tokens 2", "up to 179 GiB", "3 GiB free",
                 "pass a smaller --samples, --max_new_tokens or --limit"):  # fmt: skip
        assert said in line, (said, line)
    assert "keep up to more than 10^" in too_many(1, 10**400, 1, gib)  # beyond a float: no OverflowError


def test_max_new_tokens_past_the_models_positions_is_one_line(tmp_path, tiny_dir, gsm8k_dir, capsys):
    """The hf backend's model has 2,048 positions (troll.models.tiny): --max_new_tokens past them after the longest
    prompt is refused once the model is loaded, before any token is generated, naming how many fit; nothing written."""
    model = ["--model", str(tiny_dir), "--data", str(gsm8k_dir), "--limit", "2", "--backend", "hf"]
    with pytest.raises(SystemExit) as e:
        main([*model, "--max_new_tokens", "4000", "--out", str(tmp_path / "e")])
    line = capsys.readouterr().err.strip().splitlines()[-1]  # after the weights' loading bar (main, not the command)
    assert e.value.code == 2 and line.startswith("troll evaluate: error: "), line
    assert re.search(r"--max_new_tokens 4000 after the longest prompt \((\d+) tokens\) runs past the model's 2048 "
                     r"positions: pass at most (\d+)$", line), line  # fmt: skip
    assert not (tmp_path / "e").exists()


@pytest.mark.parametrize(("flag", "value"), [("--samples", str(10**12)), ("--max_new_tokens", str(10**15)),
                                             ("--samples", "1" + "0" * 400)])  # fmt: skip
def test_an_absurd_count_is_one_line_before_the_model_loads(tmp_path, tiny_dir, gsm8k_dir, capsys, monkeypatch,
                                                            flag, value):  # fmt: skip
    """An absurd --samples or --max_new_tokens is refused in one line before the model loads, nothing written."""
    monkeypatch.setattr("troll.tools.evaluate.load_generator", lambda *a: pytest.fail("the model was loaded"))
    model = ["--model", str(tiny_dir), "--data", str(gsm8k_dir), "--limit", "2"]
    line = refusal([*model, flag, value, "--out", str(tmp_path / "e")], capsys)
    assert f"{flag} {value}" in line and "free here" in line
    assert not (tmp_path / "e").exists()


# ------------------------------------------------------------------------------------------ sampled end to end


@pytest.fixture(scope="module")
def coin_dir(tmp_path_factory) -> Path:
    """A tiny model that ignores its prompt: every position's hidden state is the same vector (equal embeddings, the
    layers' outputs zeroed) and only the output rows of "4" and EOS are not zero, so each next token is "4" or EOS,
    about half and half. Its samples of a problem whose gold is 4 or 44 are right, wrong or without an answer by
    chance ("4", "44", "")."""
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    model = tiny_llama(tok, hidden=32, layers=1, heads=2)
    with torch.no_grad():
        model.model.embed_tokens.weight.fill_(1.0)  # after the final RMSNorm: a vector of ones
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for token in (tok.convert_tokens_to_ids("4"), tok.eos_token_id):
            model.lm_head.weight[token] = 10.0 / model.config.hidden_size  # logit 10; every other token's 0
    return save_tiny(model, tok, tmp_path_factory.mktemp("coin"))


@pytest.fixture(scope="module")
def coin_data(tmp_path_factory) -> Path:
    """Six GSM8K-format problems with golds 4 and 44, in a folder without train.jsonl (evaluate reads test.jsonl)."""
    path = tmp_path_factory.mktemp("coin-data")
    rows = [{"question": f"Problem {i}?", "answer": f"#### {4 if i % 2 else 44}"} for i in range(6)]
    (path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def majority_right(answers: list[str | None], gold: str) -> float:
    """maj@k counted by hand for numeric answers: votes per value, a tie to the value seen first."""
    values = [Fraction(a) for a in answers if a is not None]
    if not values:
        return 0.0
    votes = Counter(values)
    winner = max(dict.fromkeys(values), key=lambda v: votes[v])  # values in order of first occurrence
    return float(winner == Fraction(gold))


def test_samples_give_pass_at_k_and_maj_at_k(tmp_path, coin_dir, coin_data, capsys):
    flags = ["--model", str(coin_dir), "--data", str(coin_data), "--max_new_tokens", "4", "--backend", "hf"]
    flags += ["--samples", "8", "--temperature", "1.0", "--seed", "3"]
    summary = main([*flags, "--out", str(tmp_path / "a")])
    assert json.loads((tmp_path / "a" / "summary.json").read_text()) == summary
    assert (summary["task"], summary["n"], summary["samples"], summary["temperature"], summary["seed"]) == (
        "gsm8k", 6, 8, 1.0, 3
    )  # fmt: skip
    assert list(summary["pass@k"]) == list(summary["maj@k"]) == ["1", "2", "4", "8"]
    preds = [json.loads(x) for x in (tmp_path / "a" / "predictions.jsonl").read_text().splitlines()]
    assert [p["gold"] for p in preds] == ["44", "4"] * 3 and all(len(p["samples"]) == 8 for p in preds)
    for p in preds:
        for s in p["samples"]:
            assert s["extracted"] == gsm8k.extract_answer(s["completion"])
            assert s["reward"] == gsm8k.reward(gsm8k.cut_number(s["completion"]) if s["cut"] else s["completion"],
                                               p["gold"])  # fmt: skip
    assert {s["cut"] for p in preds for s in p["samples"]} == {True, False}  # both kinds, so the rule is tested
    rewards = [[s["reward"] for s in p["samples"]] for p in preds]
    mean = sum(map(sum, rewards)) / 48
    assert 0 < mean < 1 and len({s["completion"] for p in preds for s in p["samples"]}) > 2  # figures that can fail
    assert summary["pass@k"]["1"] == pytest.approx(mean)  # pass@1: the mean sample reward
    for k in (1, 2, 4, 8):
        chen = [1 - math.comb(8 - int(sum(r)), k) / math.comb(8, k) for r in rewards]
        assert summary["pass@k"][str(k)] == pytest.approx(sum(chen) / 6)
        by_hand = [majority_right([s["extracted"] for s in p["samples"][:k]], p["gold"]) for p in preds]
        assert summary["maj@k"][str(k)] == pytest.approx(sum(by_hand) / 6)
    assert summary["pass@k"]["8"] == pytest.approx(sum(any(r) for r in rewards) / 6)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 9 and lines[0].startswith("gsm8k greedy pass@1: ")
    assert lines[1].startswith(f"gsm8k pass@1: {summary['pass@k']['1']:.4f} (6 problems, 8 samples each")
    assert lines[-1].startswith(f"gsm8k maj@8: {summary['maj@k']['8']:.4f} ")
    again = main([*flags, "--out", str(tmp_path / "b")])  # the same seed: the same samples
    assert (tmp_path / "b" / "predictions.jsonl").read_bytes() == (tmp_path / "a" / "predictions.jsonl").read_bytes()
    assert again["pass@k"] == summary["pass@k"]


class Stopped(Exception):
    pass


def test_a_stopped_evaluation_continues_to_the_lines_an_unstopped_one_writes(tmp_path, coin_dir, coin_data, capsys,
                                                                              monkeypatch):  # fmt: skip
    """Blocks of 2 problems, calls of 3 samples (one problem a call with --samples 2): stopped after each number of
    problems, the same command keeps what was written and writes the rest, byte for byte the unstopped evaluation's
    predictions and figures; progress is a line on stderr; other settings start over."""
    from troll.tools import evaluate, predictions

    monkeypatch.setattr(evaluate, "HF_BLOCK", 2)
    monkeypatch.setattr(evaluate, "HF_CALL", 3)
    monkeypatch.setattr(evaluate, "PROGRESS_EVERY_S", 0.0)  # a line after each problem
    flags = ["--model", str(coin_dir), "--data", str(coin_data), "--max_new_tokens", "4", "--backend", "hf"]
    flags += ["--samples", "2", "--seed", "3"]
    whole = main([*flags, "--out", str(tmp_path / "whole")])
    lines = (tmp_path / "whole" / "predictions.jsonl").read_bytes()
    err = capsys.readouterr().err
    said = [x.split(",")[0] for x in err.splitlines() if x.startswith("evaluate: ")]
    assert said == [f"evaluate: {i}/6 problems" for i in range(1, 7)]
    real = predictions.completions
    for stop in range(6):

        def stopping(*args, stop=stop, **kwargs):
            done = kwargs.get("start", 0)
            for finished in real(*args, **kwargs):
                if done + len(finished) > stop:
                    yield finished[: stop - done]  # a call's first problems written, then the command stopped
                    raise Stopped
                done += len(finished)
                yield finished

        out = tmp_path / f"stopped-{stop}"
        monkeypatch.setattr(predictions, "completions", stopping)
        with pytest.raises(Stopped):
            main([*flags, "--out", str(out)])
        assert (
            len((out / "predictions.jsonl").read_bytes().splitlines()) == stop and not (out / "summary.json").exists()
        )
        monkeypatch.setattr(predictions, "completions", real)
        again = main([*flags, "--out", str(out)])
        assert (out / "predictions.jsonl").read_bytes() == lines, stop
        assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in whole.items() if k != "seconds"}
        assert (f"{stop} of 6 problems done" in capsys.readouterr().err) == (stop > 0)
    torn = tmp_path / "stopped-5" / "predictions.jsonl"
    torn.write_bytes(lines[: len(lines) // 2])  # stopped while a line was written: the torn line is done again
    main([*flags, "--out", str(torn.parent)])
    kept = lines[: len(lines) // 2].count(b"\n")
    assert torn.read_bytes() == lines and f"{kept} of 6 problems done" in capsys.readouterr().err
    main([*flags[:-2], "--seed", "4", "--out", str(torn.parent)])  # other settings: evaluated from the start
    assert "problems done" not in capsys.readouterr().err and torn.read_bytes() != lines
    main([*flags, "--out", str(torn.parent)])
    torn.write_bytes(re.sub(rb'"reward": [0-9.]+', b'"reward": 7', torn.read_bytes(), count=1))  # damaged
    main([*flags, "--out", str(torn.parent)])
    err = capsys.readouterr().err
    assert "predictions.jsonl line 1: reward is 7, expected a number in [0, 1]: the evaluation starts again" in err
    assert torn.read_bytes() == lines and "problems done" not in err


# ------------------------------------------------------------------------------------------ the task it scores


@pytest.fixture(scope="module")
def addition_dir(tmp_path_factory) -> Path:
    """A tiny model saved as an addition run saves it: its tokenizer has no chat template
    (troll.models.build.build_model)."""
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    tok.chat_template = None
    return save_tiny(tiny_llama(tok, hidden=32, layers=1, heads=2), tok, tmp_path_factory.mktemp("addition"))


def refusal(argv: list[str], capsys) -> str:
    """main(argv) must exit 2 with one line on stderr; returns it."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and ": error: " in err[0], err
    return err[0]


def test_addition_is_scored_with_its_own_rows_and_reward(tmp_path, addition_dir, gsm8k_dir, capsys):
    flags = ["--model", str(addition_dir), "--limit", "4", "--max_new_tokens", "4", "--backend", "hf"]
    summary = main([*flags, "--task", "addition", "--samples", "2", "--out", str(tmp_path / "e")])
    assert (summary["task"], summary["n"], summary["chat"]) == ("addition", 4, None)
    preds = [json.loads(x) for x in (tmp_path / "e" / "predictions.jsonl").read_text().splitlines()]
    rows = addition.problems("test")[:4]
    assert [(p["question"], p["gold"]) for p in preds] == [(r["question"], r["gold"]) for r in rows]
    for p in preds:
        assert p["reward"] == addition.reward(p["completion"], p["gold"])
        for s in p["samples"]:
            assert s["reward"] == addition.reward(s["completion"], p["gold"])
    capsys.readouterr()
    # GSM8K on a tokenizer without a chat template: plain prompts (auto); --chat true cannot be met
    gsm = ["--data", str(gsm8k_dir), "--limit", "2", "--max_new_tokens", "2", "--backend", "hf"]
    assert main(["--model", str(addition_dir), *gsm, "--out", str(tmp_path / "g")])["chat"] is False
    capsys.readouterr()
    assert "has no chat template" in refusal(["--model", str(addition_dir), *gsm, "--chat", "true"], capsys)
    line = refusal([*flags, "--task", "addition", "--data", str(gsm8k_dir)], capsys)
    assert "--data acts only with --task gsm8k, not --task addition: drop --data" in line
    assert "--chat acts only with --task gsm8k" in refusal([*flags, "--task", "rare", "--chat", "auto"], capsys)


def test_a_run_is_scored_on_its_own_task_and_settings(tmp_path, addition_dir, capsys):
    """A run directory (here an addition run with the sum written the usual way): its task and its settings by
    default, another task refused naming both, its config.json missing or damaged named with the way forward."""
    run = tmp_path / "run"
    shutil.copytree(addition_dir, run / "checkpoints" / "step-000001")
    (run / "checkpoints" / "latest").write_text("step-000001")
    Config(task="addition", reverse_sum=False).save(run / "config.json")
    flags = ["--model", str(run), "--limit", "3", "--max_new_tokens", "4", "--backend", "hf"]
    summary = main([*flags, "--out", str(tmp_path / "e")])
    assert "evaluating its latest checkpoint" in capsys.readouterr().err and summary["task"] == "addition"
    preds = [json.loads(x) for x in (tmp_path / "e" / "predictions.jsonl").read_text().splitlines()]
    assert [p["gold"] for p in preds] == [r["gold"] for r in addition.problems("test", reverse=False)[:3]]
    line = refusal([*flags, "--task", "gsm8k", "--out", str(tmp_path / "x")], capsys)
    assert f"--task gsm8k: {run} was trained on addition; pass --task addition" in line
    line = refusal([*flags, "--data", "openai/gsm8k", "--out", str(tmp_path / "x")], capsys)
    assert f"--data acts only with --task gsm8k, not --task addition ({run} was trained on addition)" in line
    (run / "config.json").write_text("{")
    line = refusal([*flags, "--out", str(tmp_path / "x")], capsys)
    assert f"{run / 'config.json'} is damaged" in line and f"--out {run} --resume true" in line
    (run / "config.json").unlink()
    (run / "checkpoints" / "step-000001" / "trainer.pt").write_bytes(b"")  # a troll checkpoint, its config gone
    assert f"{run / 'config.json'} is missing" in refusal([*flags, "--out", str(tmp_path / "x")], capsys)
    assert not (tmp_path / "x").exists()


def test_a_words_run_is_scored_on_words_by_default_and_on_gsm8k_when_asked(tmp_path, addition_dir, gsm8k_dir, capsys):
    """Word problems are asked and scored as GSM8K is (troll.tasks.task.GSM8K_FORMAT): a words run's GSM8K accuracy is a
    measurement, an addition score of it is not."""
    run = tmp_path / "run"
    shutil.copytree(addition_dir, run / "checkpoints" / "step-000001")
    (run / "checkpoints" / "latest").write_text("step-000001")
    Config(task="words").save(run / "config.json")
    flags = ["--model", str(run), "--limit", "3", "--max_new_tokens", "2", "--backend", "hf"]
    assert main([*flags, "--out", str(tmp_path / "w")])["task"] == "words"
    preds = [json.loads(x) for x in (tmp_path / "w" / "predictions.jsonl").read_text().splitlines()]
    assert [p["question"] for p in preds] == [r["question"] for r in words.problems("test")[:3]]
    gsm = main([*flags, "--task", "gsm8k", "--data", str(gsm8k_dir), "--out", str(tmp_path / "g")])
    assert (gsm["task"], gsm["n"]) == ("gsm8k", 3)
    capsys.readouterr()
    line = refusal([*flags, "--task", "addition", "--out", str(tmp_path / "x")], capsys)
    assert f"--task addition: {run} was trained on words; pass --task words" in line


def test_sampling_flags_act_only_with_samples(tiny_dir, capsys):
    model = ["--model", str(tiny_dir)]
    for flag, value in (("--temperature", "0.7"), ("--seed", "1")):
        line = refusal([*model, flag, value], capsys)
        assert f"{flag} acts only with --samples N > 0" in line and f"drop {flag}" in line
    assert "--samples must be >= 0" in refusal([*model, "--samples", "-1"], capsys)
    for bad in ("0", "-1", "nan", "inf"):
        line = refusal([*model, "--samples", "2", "--temperature", bad], capsys)
        assert "--temperature must be > 0 and finite" in line
