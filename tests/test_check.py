"""The acceptance command (troll/tools/check.py) at a tiny shape on CPU, and the stand-in model it builds
(troll/models/standin.py): the whole command end to end with each backend, the report's files and fields, a failing
check's exit status and line, bad flags; the stand-in's tokenizer reloads as itself and its model has the published
shape."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from troll.base.config import PRESETS, Config
from troll.models import memory
from troll.models.standin import ARCHS, VOCAB, model_config, save_standin, standin_tokenizer
from troll.tasks.gsm8k import load_gsm8k, make_prompt
from troll.tools import check

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ["run", "weight sync", "sleep/wake", "finite loss", "chunked head", "memory", "resume",
          "TROLL / clip update time"]  # fmt: skip


def command(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "troll", "check", *argv], capture_output=True, text=True, env=env)


def texts(gsm8k_dir: Path) -> list[str]:
    return [r["question"] + "\n" + r["answer"] for r in load_gsm8k("train", str(gsm8k_dir), limit=300)]


# ----------------------------------------------------------------------------- the stand-in


def test_standin_tokenizer_reloads_as_itself(tmp_path, gsm8k_dir):
    """AutoTokenizer picks the class from the folder's model_type (qwen2); the stand-in's tokenizer is that class,
    so the reloaded tokenizer has the same size and ids as the one the run started with (docs/vllm_cpu.md)."""
    from transformers import AutoTokenizer

    path = save_standin("tiny", texts(gsm8k_dir), tmp_path / "m")
    built = standin_tokenizer(texts(gsm8k_dir))
    loaded = AutoTokenizer.from_pretrained(path)
    assert type(loaded).__name__ == type(built).__name__ == "Qwen2Tokenizer" and len(loaded) == len(built)
    for r in load_gsm8k("test", str(gsm8k_dir), limit=30):
        prompt = make_prompt(r["question"], loaded, chat=True)
        assert (
            loaded(prompt, add_special_tokens=False)["input_ids"]
            == built(prompt, add_special_tokens=False)["input_ids"]
        )
        assert loaded.decode(built(r["answer"])["input_ids"]) == r["answer"]  # byte-level BPE: lossless
    assert prompt.endswith("<|im_start|>assistant\n") and loaded.eos_token == "<|im_end|>"


def test_standin_tokenizer_padded_to_the_real_size(gsm8k_dir):
    """Qwen2.5's 151,665 ids, special tokens last; filler ids never come out of encoding."""
    tok = standin_tokenizer(texts(gsm8k_dir), size=ARCHS["qwen2.5-0.5b"]["tok"])
    assert len(tok) == 151_665 and tok.convert_ids_to_tokens(151_664) == "<|im_end|>" == tok.eos_token
    ids = [i for t in texts(gsm8k_dir)[:50] for i in tok(t)["input_ids"]]
    assert max(ids) < 2048  # learned merges only


def test_standin_shapes_are_the_published_ones():
    """Parameter counts of the configs match the published models (memory.MEASURED holds the same counts)."""
    from transformers import AutoModelForCausalLM

    from troll.models.memory import MEASURED

    for name in ("qwen2.5-0.5b", "qwen3-0.6b"):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(model_config(name))
        assert sum(p.numel() for p in model.parameters()) == MEASURED[name].params
        assert model.get_output_embeddings().weight.shape == (VOCAB, ARCHS[name]["hidden"])


PUBLISHED = {"qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096, "qwen3-8b": 8_190_735_360,
             "llama3.1-8b": 8_030_261_248}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_standin_shapes_of_the_papers_models(name):
    """Qwen3-1.7B / 4B / 8B and Llama-3.1-8B on the meta device (no weights): the published parameter counts
    (a tied embedding once), tied or not, and troll.models.memory's arithmetic gives the same count."""
    from transformers import AutoModelForCausalLM

    from troll.models.memory import arch_params

    config = model_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED[name] == arch_params(name)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == ARCHS[name]["tied"] == (name in ("qwen3-1.7b", "qwen3-4b"))
    assert model.get_output_embeddings().weight.shape == (ARCHS[name]["vocab"], ARCHS[name]["hidden"])
    if name == "llama3.1-8b":
        assert config.model_type == "llama" and config.vocab_size == 128_256
        assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["rope_theta"] == 500_000
    with torch.device("meta"):  # cut to 2 layers at the full width (bench/real_shapes.py)
        cut = AutoModelForCausalLM.from_config(model_config(name, layers=2))
    assert len(cut.model.layers) == 2 and cut.config.hidden_size == ARCHS[name]["hidden"]


def test_standin_tokenizer_in_a_llama_folder_reloads_as_itself(tmp_path, gsm8k_dir):
    """A Llama-architecture folder (model_type llama) holding the stand-in tokenizer: AutoTokenizer reloads the
    class tokenizer_config.json names (Qwen2Tokenizer), with the same size and ids."""
    from transformers import AutoTokenizer

    built = standin_tokenizer(texts(gsm8k_dir), size=4096)
    model_config("llama3.1-8b", vocab=4096).save_pretrained(tmp_path)
    built.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(loaded).__name__ == type(built).__name__ == "Qwen2Tokenizer" and len(loaded) == len(built) == 4096
    for t in texts(gsm8k_dir)[:30]:
        assert loaded(t)["input_ids"] == built(t)["input_ids"]
    assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"


@pytest.mark.vllm
def test_standin_vllm_loads_the_same_tokenizer(tmp_path, gsm8k_dir):
    """vLLM's own tokenizer loading (used when its tokenizer is not skipped) gives the same ids."""
    pytest.importorskip("vllm")
    from vllm.tokenizers import get_tokenizer

    path = save_standin("tiny", texts(gsm8k_dir), tmp_path / "m")
    built = standin_tokenizer(texts(gsm8k_dir))
    engine_tok = get_tokenizer(str(path))
    for t in texts(gsm8k_dir)[:30]:
        assert engine_tok.encode(t, add_special_tokens=False) == built(t, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- the command


def read_report(out: Path) -> dict:
    report = json.loads((out / "report.json").read_text())
    assert (out / "report.md").read_text().startswith("# troll check: ")
    return report


@pytest.mark.slow
def test_check_end_to_end_transformers(tmp_path, gsm8k_dir):
    """The whole command at the tiny shape: a run, the update comparison, a resume in a new process, the report."""
    out = tmp_path / "check"
    res = command("--shape", "tiny", "--backend", "hf", "--data", str(gsm8k_dir), "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    report = read_report(out)
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert list(status) == CHECKS
    assert status["run"] == status["finite loss"] == status["chunked head"] == status["resume"] == "passed"
    assert status["weight sync"].startswith("not applicable") and status["sleep/wake"].startswith("not applicable")
    assert status["memory"].startswith("not applicable")  # no measured coefficients for the tiny shape
    times = report["update_time"]
    assert times["ratio"] > 0 and times["ratio_textbook"] > 0 and report["verdict"] == "passed"
    assert times["textbook_clip_s"] > 0 and times["textbook_clip_peak_bytes"] is None  # peaks: CUDA only
    assert times["troll_compiled_s"] > 0 and times["ratio_compiled_textbook"] > 0  # logits_chunk > 0: compiled too
    assert report["environment"]["torch"] == torch.__version__ and "vllm" in report["environment"]
    assert report["config"]["logits_chunk"] == 1024 and report["config"]["task"] == "gsm8k"
    assert report["model"].startswith("stand-in") and "| memory |" in res.stdout
    metrics = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "eval_acc" not in m] == [1, 2, 3]  # 2 steps, then 1 resumed


@pytest.mark.slow
@pytest.mark.vllm
def test_check_end_to_end_vllm(tmp_path, gsm8k_dir):
    """The same with the vLLM engine: every push's weight-sync figure is reported (one after each of the 2 steps:
    the engine loads the run's starting weights, so nothing is pushed before RL); sleep/wake does not apply on CPU
    and says so."""
    pytest.importorskip("vllm")
    out = tmp_path / "check"
    res = command("--shape", "tiny", "--data", str(gsm8k_dir), "--out", str(out), env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert res.returncode == 0, res.stderr[-2000:]
    checks = {c["name"]: c for c in read_report(out)["checks"]}
    assert checks["weight sync"]["status"] == "passed" and "2 pushes" in checks["weight sync"]["detail"]
    assert checks["sleep/wake"]["status"] == "not applicable (CPU: vLLM's sleep mode is GPU-only)"
    assert checks["resume"]["status"] == "passed"


def test_memory_check_against_the_model():
    """The memory check divides each window's measured bytes by troll.models.memory's prediction for its micro-batch; a
    measurement above 1.10x fails, and step 1 (gradients and AdamW states allocated) is predicted 12 B/param more."""
    from troll.models import memory

    cfg = Config(logits_chunk=1024, grad_checkpointing=True)
    params = memory.MEASURED["qwen2.5-0.5b"].params
    excess = memory.peak_bytes("qwen2.5-0.5b", 600, True, True, 0.1) - memory.fixed_bytes(params)
    windows = [
        {"baseline": 10e9, "peak": 10e9 + excess + 12 * params, "tokens": (600, 0.1)},
        {"baseline": 10e9, "peak": 10e9 + 0.5 * excess, "tokens": (600, 0.1)},
    ]
    status, detail, data = check.memory_check(cfg, "qwen2.5-0.5b", windows, "cpu", params)
    assert status == "passed" and [round(r["ratio"], 6) for r in data["steps"]] == [1.0, 0.5]
    windows[1]["peak"] = 10e9 + 1.2 * excess
    assert check.memory_check(cfg, "qwen2.5-0.5b", windows, "cpu", params)[0] == "FAILED"
    assert check.memory_check(cfg, "tiny", windows, "cpu", 1)[0].startswith("not applicable")


@pytest.mark.slow
def test_a_failed_check_exits_1_with_one_line(tmp_path, gsm8k_dir, monkeypatch, capsys):
    """A loss that returns NaN: the run goes on (the steps are skipped), the finite-loss check fails, the exit
    status is 1 and stderr ends with one line naming the check and the report (progress bars come before it)."""
    from troll.losses import LOSSES  # the dict troll.tools.watch.measure reads the run's loss from

    real = LOSSES["troll"]

    def nan_loss(*args, **kwargs):
        loss, metrics = real(*args, **kwargs)
        return loss * torch.nan, metrics

    monkeypatch.setitem(LOSSES, "troll", nan_loss)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    out = tmp_path / "check"
    argv = ["--shape", "tiny", "--backend", "hf", "--data", str(gsm8k_dir), "--out", str(out)]
    code = check.main(argv, isolate=False)  # in this process, so the patched loss is the run's
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("troll check")]
    assert code == 1 and len(err) == 1 and err[0].startswith("troll check: FAILED finite loss: ")  # the last line
    assert str(out / "report.md") in err[0]
    report = read_report(out)
    assert report["verdict"] == "FAILED: finite loss"


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--shape", "huge"], ["--shape", "invalid choice"]),
        (["--steps", "0"], ["--steps", "must be >= 1"]),
        (["--prompts", "two"], ["--prompts", "not an integer"]),
        (["--max_new_tokens", "-1"], ["--max_new_tokens", ">= 1"]),
        (["--data", "/no/such/folder"], ["--data", "train.jsonl"]),
        (["--model", "/no/such/model"], ["--model", "does not exist"]),
        (["--shape", "tiny", "--model", "Qwen/Qwen2.5-0.5B-Instruct"], ["--shape tiny", "drop --model"]),
        (["--out", str(ROOT / "README.md")], ["--out", "not an empty folder"]),
        pytest.param(
            ["--device", "cuda"],
            ["--device cuda", "no CUDA"],
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU"),
        ),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, words):
    res = command(*argv)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines[-1].startswith("troll check: error:"), res.stderr
    assert all(w in lines[-1] for w in words), lines[-1]


# ----------------------------------------------------------------------------- the GPU engine's sleep sequence


class SleepyLLM:
    """A stand-in for vllm.LLM's sleep-mode bookkeeping (its documented levels): level 1 offloads the weights to
    CPU memory and frees the KV cache, level 2 discards both; wake_up(tags) brings back what it can; a reload
    writes new weights. generate asserts the engine has its weights and KV cache, as a real engine needs."""

    def __init__(self) -> None:
        self.weights, self.kv, self.version, self.calls = "gpu", True, 0, []

    def sleep(self, level: int) -> None:
        self.weights, self.kv = ("cpu" if level == 1 else "lost"), False

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is None or "weights" in tags:
            self.weights = "gpu" if self.weights == "cpu" else self.weights
        if tags is None or "kv_cache" in tags:
            self.kv = True

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        assert method == "reload_weights" and self.weights != "cpu"  # woken before a reload
        self.weights, self.version = "gpu", self.version + 1

    def reset_prefix_cache(self) -> None:
        pass

    def generate(self, requests: list, params: object, use_tqdm: bool = False) -> list:
        if self.weights != "gpu" or not self.kv:
            raise AssertionError(f"generate on a sleeping engine (weights {self.weights}, KV cache {self.kv})")
        self.calls.append(self.version)
        logprobs = SimpleNamespace(logprobs=[-0.5], token_ids=[1])  # flat: the sampled token only (K = 0)
        out = SimpleNamespace(token_ids=[1], index=0, finish_reason="stop", logprobs=logprobs)
        return [SimpleNamespace(outputs=[out]) for _ in requests]


@pytest.mark.vllm
@pytest.mark.parametrize("level", [1, 2])
def test_engine_keeps_its_weights_through_the_training_loops_calls(level, monkeypatch):
    """troll.train's order of engine calls on a GPU: push, evaluation (greedy), rollout, update, push, evaluation,
    rollout, ... The engine sleeps after every call. At level 1 (the default) each call finds the weights of the
    last push; level 2 discards them at the first sleep, so the rollout after an evaluation has none (a
    RuntimeError before vLLM is asked)."""
    pytest.importorskip("vllm")
    import inspect

    from troll.models.vllm_engine import VLLMGenerator

    assert inspect.signature(VLLMGenerator).parameters["sleep_level"].default == 1  # what troll.train gets
    gen = object.__new__(VLLMGenerator)  # the engine's own logic around a stand-in for vllm.LLM
    gen.llm, gen.sleep_level, gen._asleep, gen._weights_lost = SleepyLLM(), level, False, False
    gen.vocab_size, gen.max_model_len, gen.max_top_k, gen.eos_token_ids = 100, 64, 4, [2]
    monkeypatch.setattr(VLLMGenerator, "check_sync", lambda self, model: 0.0)
    model = torch.nn.Linear(2, 2)
    gen.push_weights(model)
    gen.greedy([[5, 6]], 4)  # the evaluation before RL
    if level == 2:
        with pytest.raises(RuntimeError, match="lost its weights"):
            gen.generate([[5, 6]], 1, 4)
        return
    for _ in range(2):  # rollout, (update), push, evaluation
        gen.generate([[5, 6]], 1, 4)
        gen.push_weights(model)
        gen.greedy([[5, 6]], 4)
    assert gen.llm.calls == [1, 1, 2, 2, 3]  # every call saw the weights of the push before it


@pytest.mark.slow
@pytest.mark.vllm
def test_check_end_to_end_lora_vllm(tmp_path, gsm8k_dir):
    """A LoRA preset through the whole command with the vLLM engine: the engine follows base + adapters after every
    push and after a push of visibly changed weights, only adapters train, and the resume (adapters on the frozen
    base) continues."""
    pytest.importorskip("vllm")
    out = tmp_path / "check"
    res = command("--preset", "gsm8k-qwen3-1.7b-lora", "--shape", "tiny", "--data", str(gsm8k_dir), "--out", str(out),
                  env={"VLLM_CPU_KVCACHE_SPACE": "1"})  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    report = read_report(out)
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["weight sync"]["status"] == checks["resume"]["status"] == checks["run"]["status"] == "passed"
    assert report["config"]["lora_rank"] == 32 and (out / "run" / "checkpoints").is_dir()
    ckpt = next((out / "run" / "checkpoints").glob("step-*"))
    assert (ckpt / "adapter_model.safetensors").is_file() and not (ckpt / "model.safetensors").exists()


def test_memory_check_of_a_lora_run_uses_the_lora_model():
    """On CPU a LoRA update's excess memory is compared with memory.lora_cpu_excess (the adapters' gradients and
    AdamW states in step 1 only); 1.2x of it fails."""
    cfg = Config(**PRESETS["gsm8k-qwen3-1.7b-lora"])
    first = memory.lora_cpu_excess("qwen3-1.7b", 1000, 200, 32, first_step=True)
    later = memory.lora_cpu_excess("qwen3-1.7b", 1000, 200, 32, first_step=False)
    assert first - later == 12 * memory.lora_params("qwen3-1.7b", 32)
    windows = [{"tokens": (1000, 0.2), "baseline": 0, "peak": first}, {"tokens": (1000, 0.2), "baseline": 0,
               "peak": later}]  # fmt: skip
    status, _, data = check.memory_check(cfg, "qwen3-1.7b", windows, "cpu", 1)
    assert status == "passed" and [round(r["ratio"], 9) for r in data["steps"]] == [1.0, 1.0]
    windows[1]["peak"] = 1.2 * later
    assert check.memory_check(cfg, "qwen3-1.7b", windows, "cpu", 1)[0] == "FAILED"


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--backend", "hf", "--prompts", "100000000"],
            ["--prompts 100000000", "--samples 2", "151936 output rows", "free"],
        ),
        (["--max_new_tokens", "100000"], ["--max_new_tokens 100000", "32768 positions"]),
        (["--preset", "gsm8k-qwen3-8b-lora", "--samples", "10000000"], ["--samples 10000000", "free"]),
    ],
)
def test_counts_past_what_the_machine_holds_are_one_line_before_anything_is_written(tmp_path, flags, words):
    """The check's counts against the preset's model (its stand-in's shape, troll.models.standin), before its folder is
    made: one line in the check's own flags, exit 2, no folder (they used to end in a FAILED report inside it)."""
    from troll.run.harness import RunError

    out = tmp_path / "check"
    with pytest.raises(RunError) as e:
        check.main([*flags, "--out", str(out)], isolate=False)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value) and not out.exists()


@pytest.mark.parametrize("backend, per", [("hf", "the 151936 output rows of m (hf sampler)"), ("vllm", "--k 64 + 1")])
def test_the_count_check_names_what_its_sampler_keeps_a_token(monkeypatch, backend, per):
    """The hf sampler keeps a score per output row for each token, vLLM its --k + 1 log-probs: the line names the
    one the run's backend keeps, and its size is that count's bytes (troll.run.start.SCORE_BYTES each)."""
    from troll.run import start
    from troll.run.harness import RunError

    cfg = Config(model="m", backend=backend, prompts_per_step=1000, samples_per_prompt=8, max_new_tokens=256, k=64)
    rows = 151936 if backend == "hf" else 65
    size = 1000 * 8 * 256 * rows * start.SCORE_BYTES
    monkeypatch.setattr(start, "free_memory", lambda: size - 1)
    with pytest.raises(RunError, match=f"each scored over {re.escape(per)}, keep {re.escape(start.gib(size))}"):
        start.check_counts(cfg, None, 151936, {"--prompts_per_step": "--prompts"})
    monkeypatch.setattr(start, "free_memory", lambda: size)  # exactly enough: the next check (the kept batches) acts
    try:
        start.check_counts(cfg, None, 151936)
    except RunError as e:
        assert "each scored over" not in str(e)
