"""The evaluation command (troll/evaluate.py): greedy pass@1 with the training reward, on a tiny local model."""

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
