"""The evaluation command (troll/evaluate.py): greedy pass@1 with the training reward, on a tiny local model."""

import importlib.util
import json

import pytest

from troll import gsm8k
from troll.evaluate import decode, encode, greedy_generator, main, score
from troll.tiny import save_tiny, tiny_llama, train_tokenizer


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
            "--max-new-tokens",
            "6",
            "--backend",
            "hf",
            "--out",
            str(tmp_path / "eval"),
        ]
    )
    assert summary["n"] == 4 and 0.0 <= summary["accuracy"] <= 1.0 and summary["chat"]
    preds = [json.loads(x) for x in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert len(preds) == 4 and {"question", "gold", "completion", "extracted", "reward"} <= preds[0].keys()
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["accuracy"] == summary["accuracy"]
    assert "GSM8K greedy pass@1" in capsys.readouterr().out


@pytest.mark.slow
def test_vllm_greedy_equals_transformers_greedy(tiny_dir, monkeypatch):
    """The command's two backends (padded output layer: the vLLM side masks it with its logits processor)."""
    pytest.importorskip("vllm")
    from transformers import AutoTokenizer

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = encode(tok, [gsm8k.make_prompt(q, tok, chat=True) for q in ("Tom has 3 apples.", "What is 4+5?")])
    hf = greedy_generator("hf", str(tiny_dir), tok, 256).greedy(prompts, 8)
    engine = greedy_generator("vllm", str(tiny_dir), tok, 256)
    try:
        assert engine.greedy(prompts, 8) == hf and decode(tok, hf)
    finally:
        engine.close()


@pytest.mark.slow
def test_a_lora_run_is_evaluated_as_its_export(tmp_path, gsm8k_dir):
    """`troll.evaluate` on a LoRA run (its latest checkpoint: adapters on the run's base, merged in memory) gives
    the predictions of the merged model `troll.export` writes; `--backend vllm` on it names troll.export (issue 40:
    it said the checkpoint lacked a config and weights)."""
    from test_commands import command

    run, merged = tmp_path / "run", tmp_path / "merged"
    tiny = ["--sft_steps", "0", "--steps", "1", "--eval_size", "4", "--prompts_per_step", "2"]
    trained = command("-m", "troll.train", "--out", str(run), "--lora_rank", "4", "--lr", "0.05", *tiny)
    assert trained.returncode == 0, trained.stderr[-3000:]
    exported = command("-m", "troll.export", str(run), "--out", str(merged))
    assert exported.returncode == 0, exported.stderr[-3000:]
    flags = ["--data", str(gsm8k_dir), "--limit", "3", "--max-new-tokens", "8", "--backend", "hf"]
    predictions, said = {}, {}
    for name, model in (("run", run), ("merged", merged)):
        done = command("-m", "troll.evaluate", "--model", str(model), *flags, "--out", str(tmp_path / f"eval-{name}"))
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
        predictions[name], said[name] = (tmp_path / f"eval-{name}" / "predictions.jsonl").read_text(), done.stderr
    assert f"its adapters merged into the run's base {run / 'base'}" in said["run"], said["run"][-3000:]
    assert predictions["run"] == predictions["merged"] and predictions["run"].count("\n") == 3
    ckpt = run / "checkpoints" / "step-000001"
    if importlib.util.find_spec("vllm") is None:
        return  # --backend vllm is refused for the missing package first
    refused = command("-m", "troll.evaluate", "--model", str(ckpt), *flags[:-1], "vllm", "--out", str(tmp_path / "v"))
    line = refused.stderr.strip().splitlines()[-1]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert "LoRA adapters" in line and f"python -m troll.export {ckpt}" in line, line
