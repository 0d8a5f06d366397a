"""The run around the RL loop: its directory, resume, checkpoints, metrics, evaluations and summary.

    with Run.open(cfg, claim=False) as run:  # a new run, or the checkpoint to resume from; nothing written yet
        ... build the model from run.checkpoint (None: fresh weights), load the data, check them ...
        run.claim()                   # <out> made or claimed, locked, marked, config.json written
        run.begin(acc, records, extra, model, tokenizer, opt, sched)       # new run: step-0 evaluation, checkpoint
        run.restore(opt, sched)                                            # resumed run: optimiser, schedule, logs
        for step in run.steps():                                           # tqdm over the remaining RL steps
            run.record(step, row, evaluation, model, tokenizer, opt, sched)  # log, evaluation, checkpoint if due
        summary = run.finish(eval_problems)

Files (troll.base.checkpoint writes them crash-safe): config.json (the config in force), metrics.jsonl (one row per RL
step, one row {"step", "eval_acc"} per evaluation, the first at step 0), samples.jsonl (a few completions per
evaluation), checkpoints/ (the last two, each with the run's state), summary.json (eval_before, eval_after = the
last evaluation, eval_best and its step, the warm-start's record, resume changes, wall clock and CPU time (user and
system, every thread of the process) over all sessions), tensorboard/ with `--log_to tensorboard`; .troll-run and
.lock, the folder's marker and lock (Rules).

Rules:
- Nothing is written before everything checkable is checked: `Run.open` only reads (and locks a folder that is
  already a run's: `.lock` is the one file it may add), troll.train checks the model and the data, then `claim`
  makes `out` (or claims an empty one) and writes the marker, then config.json (on resume, one missing or damaged is
  written again from the checkpoint's settings, a damaged one kept as config.json.damaged: Config.resumed, which
  reads them at parse time, writes nothing, and reads a checkpoint only in a folder troll.base.outputs.run_marker reads
  as a run's).
  Exceptions raised by third-party code (transformers, peft, tokenizers, safetensors) while the run starts become
  a RunError naming the package (`starting`); a bug in troll keeps its traceback.
- A run writes only in a folder that is its own, told by what troll wrote there, never by file names alone: a new
  or empty folder (nothing but troll's lock in it), which `claim` marks by writing `.troll-run` first ({"kind":
  "troll run", "folder": "made" | "empty" | "adopted"}); a folder holding that marker; or a run made before the
  marker existed, recognised by a config.json that Config.load accepts (every field) beside a whole checkpoint,
  and marked "adopted" when it is resumed. Any other folder is refused before anything is written in it, naming
  it: a new or empty --out is the way forward. A symbolic link where the run writes (its files, their temporary
  files, the lock, the marker, checkpoints/' entries) is refused, never written through. The lock is created
  exclusively or opened as it is, never through a link, and rewritten only when it holds troll's "pid N".
- One run per directory: a lock file (`.lock`, flock) refuses a second process on the same `out` while the first
  lives. A new run refuses a directory holding a whole checkpoint (resume it) or a summary.json (a finished run's)
  beside its other files, naming them. A marked folder that troll made or found empty, with neither, is a start
  that failed before its first checkpoint, of any config: its files of the names in RUN_FILES and START_FILES (the
  only ones the run writes) are removed, anything else in it is left, and the run starts, saying so. A whole
  checkpoint is never removed. `--resume true` with no checkpoint yet starts from the beginning too, saying so.
- `--steps` below the steps the resumed checkpoint has done is refused, naming its step.
- Resume continues from the newest checkpoint that is whole; a damaged one is named and the older one used.
  Metrics and samples rows past it are dropped (the resumed run writes them again), and one line says so: the
  checkpoint, its step, and how many steps done after it before the stop are computed again (`restore`). A finished
  run (checkpoint at `steps`, summary.json written) is left untouched, but for a missing or damaged config.json,
  written again. The settings in `troll.base.config.RESUME_CHANGEABLE` may differ on resume: they take effect from that
  step (the learning rate given is the one used) and are recorded in summary.json's `changes`; any other
  difference is refused, naming the fields. State saved by an older troll without every key this one writes is
  refused, as troll.base.config refuses such a config.json.
- `RunError` is a problem with the run directory that the user fixes; the command line prints it on one line.
- `claim_folder` marks a run's folder ahead of the run, for a caller that keeps its own files in it
  (study.runner's log.txt): the folder is then the run's, and its other files stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import importlib.util
import json
import math
import os
import re
import shutil
import stat
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from troll.base.checkpoint import (
    append_jsonl,
    check_checkpoint,
    complete_checkpoints,
    load_trainer_state,
    read_jsonl,
    save_checkpoint,
    truncate_jsonl,
    write_json,
)
from troll.base.cli import UsageError
from troll.base.config import RESUME_CHANGEABLE, Config, settings, with_added
from troll.base.metrics import Logger, logger_missing
from troll.base.outputs import RUN_FOLDERS, RUN_MARKER, RUN_MARKER_KIND
from troll.models import memory
from troll.run.runfiles import summary_problem

RUN_FILES = ("config.json", "metrics.jsonl", "samples.jsonl", "tokens.jsonl", "summary.json", "checkpoints", "base")
# what a start that failed before its first checkpoint may leave besides RUN_FILES (troll.train, troll.base.checkpoint)
START_FILES = (".tmp-base", "engine-init", "tensorboard")
LOCK = ".lock"  # the run's lock (flock), holding "pid N" of its holder
LOCK_TEXT = re.compile(rb"pid \d+\n")
# written first when a run claims its folder: the folder is troll's (troll.base.outputs, which Config.resumed reads too)
MARKER, MARKER_KIND = RUN_MARKER, RUN_MARKER_KIND
# the marker's "folder", how the run came to own it; a failed start is cleaned up only where troll made the folder
# or found it empty, so that every file there of a name in RUN_FILES or START_FILES is the run's own
CLEANABLE = ("made", "empty")
FOLDERS = RUN_FOLDERS  # and adopted: a run made before the marker, marked when resumed (`_older_run`)
# packages whose exceptions during start-up are about the user's model, files or settings (`starting`)
THIRD_PARTY = ("transformers", "peft", "tokenizers", "safetensors", "huggingface_hub")
# what trainer.pt holds besides the optimiser and schedule; `config`: the settings it was written with
STATE_KEYS = ("step", "eval_before", "eval_after", "eval_best", "eval_best_step", "skipped_steps", "changes")
STATE_KEYS += ("pending", "config")


class RunError(UsageError):
    """A problem with the run directory that the user must resolve; the message says how."""


def device_of(cfg: Config) -> torch.device:
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(auto if cfg.device == "auto" else cfg.device)


def auto_micro_batch(cfg: Config, device: torch.device) -> int:
    """`--micro_batch_tokens auto`: the largest micro-batch troll.models.memory's fitted model says this GPU holds
    (beside vLLM's share, with the chunked output layer if `logits_chunk`); on CPU the field's default. A LoRA run is
    sized by its own model, both phases of a colocated step, vLLM asleep during the update (`memory.phases`)."""
    if device.type != "cuda":
        return Config.micro_batch_tokens
    gib = torch.cuda.get_device_properties(device).total_memory / memory.GIB
    vllm = cfg.vllm_gpu_memory if cfg.backend == "vllm" else 0.0
    if cfg.lora_rank:
        run = memory.lora_run(cfg.lora_rank, vllm, cfg.lora_targets, cfg.bf16, cfg.grad_checkpointing, cfg.logits_chunk)
        return memory.colocated_micro_batch_tokens(cfg.model, gib, run)
    return memory.micro_batch_tokens(cfg.model, gib, vllm, cfg.grad_checkpointing, chunked=cfg.logits_chunk > 0)


def environment_missing(cfg: Config) -> str | None:
    """What the run asks for that this machine lacks (a CUDA device, vLLM, peft for LoRA), with the fix; or None.
    Checked before anything is written."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda, but torch sees no CUDA device here: pass --device cpu (or auto)"
    if cfg.backend == "vllm" and importlib.util.find_spec("vllm") is None:
        return "--backend vllm needs the optional vllm package, which is not installed: pass --backend hf or install it"
    if cfg.lora_rank and importlib.util.find_spec("peft") is None:
        return "--lora_rank needs the optional peft package, which is not installed: pip install -e '.[lora]'"
    return None


def check_sources(cfg: Config) -> None:
    """The model and the data the run reads can be had, checked before any work: a missing path, a run directory
    given as --model, malformed data or an unreachable hub name is a RunError naming it (troll.models.sources'
    checks)."""
    from troll.models import sources
    from troll.tasks import gsm8k

    try:
        if cfg.model != "tiny":
            try:
                path, note = sources.resolve_model(cfg.model)
            except (OSError, ValueError) as e:  # the flag named: a preset may have set it
                raise ValueError(f"--model {cfg.model}: {e}") from None
            if note:  # a run directory: training starts from a model folder, not from a run
                raise ValueError(f"--model {cfg.model} is a run directory: pass one of its checkpoints, e.g. {path}")
        if cfg.task == "gsm8k":
            sources.check_hub_data(cfg.data)
            if Path(cfg.data).expanduser().exists() or not gsm8k.is_hub_name(cfg.data):
                test = gsm8k.load_gsm8k("test", cfg.data)  # a local source: read and checked row by row
                gsm8k.check_held_out(gsm8k.load_gsm8k("train", cfg.data), test, cfg.data)
    except (OSError, ValueError) as e:
        raise RunError(str(e)) from None


def raised_by(error: BaseException) -> str | None:
    """The third-party package (THIRD_PARTY) whose code raised `error`, or None: the innermost frame of its
    traceback that is troll's or one of theirs decides (frames of the standard library and torch in between are
    skipped: json raising inside transformers is transformers')."""
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_globals.get("__name__", ""))
        tb = tb.tb_next
    for module in reversed(frames):
        top = module.split(".")[0]
        if top == "troll":
            return None
        if top in THIRD_PARTY:
            return top
    return None


@contextlib.contextmanager
def starting(what: str = "starting the run") -> Iterator[None]:
    """Around a part of a run's start-up (before its first step), `what` it does ("loading --model X"): an
    exception raised by third-party code (`raised_by`) becomes a RunError naming that, the package and what it
    said; the same command runs again after the fix (a failed start is restarted, a resume resumes). Anything
    raised in troll's own code (a RunError of an inner `starting` too) passes unchanged."""
    try:
        yield
    except Exception as e:
        package = raised_by(e)
        if package is None:
            raise
        said = " ".join(str(e).split())[:400] or "no message"
        raise RunError(
            f"{what} failed in {package} ({type(e).__name__}: {said}); fix it, then run the same command again"
        ) from e


class Run:
    """One run directory, held (locked) by this process from `open` (an `out` that exists) or `claim` (a new one)
    to the end of its `with` block."""

    def __init__(self, cfg: Config, lock: Any, checkpoint: Path | None, state: dict | None) -> None:
        self.cfg, self.out, self.lock = cfg, Path(cfg.out), lock
        self.checkpoint, self.state = checkpoint, state
        self.leftover: list[str] = []  # the files of a failed start, removed by `claim`
        self.folder: str | None = None  # how the run owns `out` (`_ownership`); None: new or empty
        self.device = device_of(cfg)
        self.t_start = time.time() - (state or {}).get("wall_clock_s", 0.0)
        self.cpu_start = time.process_time() - (state or {}).get("cpu_s", 0.0)  # this process's CPU, every thread
        self.metrics, self.samples = self.out / "metrics.jsonl", self.out / "samples.jsonl"
        self.tokens = self.out / "tokens.jsonl"  # per-token records (troll.run.records)
        self.logger: Logger | None = None
        self.bar: Any = None

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.logger is not None:
            self.logger.close()
        if self.lock is not None:
            self.lock.close()

    # ------------------------------------------------------------------ opening: new, restarted or resumed

    @classmethod
    def open(cls, cfg: Config, claim: bool = True) -> Run:
        """The run in `cfg.out`: new, restarted after a failed start, or resumed from its newest whole checkpoint,
        decided by reading only (a folder that is a run's already is locked at once; one that is neither a run's nor
        empty is refused, `_ownership`). With `claim` the run claims `out` at once (`claim`); troll.train passes
        False, checks the model and the data, then claims."""
        if missing := logger_missing(cfg.log_to):  # before anything is written, as the command line does
            raise ImportError(missing)
        if missing := environment_missing(cfg):
            raise RunError(missing)
        out = Path(cfg.out)
        if out.exists() and not out.is_dir():
            raise RunError(f"--out {out} cannot be a run directory (it is a file): choose another --out")
        folder = _ownership(out) if out.is_dir() else None  # read only: a folder not troll's gets no lock
        lock = _lock(out) if folder is not None else None  # a run's folder now; a new or empty one when claimed
        try:
            if lock is not None:
                folder = _ownership(out)  # again, under the lock
                _check_links(out)
            checkpoint, state = _pick_checkpoint(out) if cfg.resume else (None, None)
            leftover = _check_fresh(out, folder) if state is None else []
            if state is not None:
                cfg = _resumed_config(cfg, state)
                if state["step"] > cfg.steps:
                    raise RunError(
                        f"--steps {cfg.steps} is below the {state['step']} steps done by {checkpoint}: pass --steps "
                        f"{state['step']} or more"
                    )
            if cfg.micro_batch_tokens == 0:
                cfg = dataclasses.replace(cfg, micro_batch_tokens=auto_micro_batch(cfg, device_of(cfg)))
                print(f"micro_batch_tokens auto: {cfg.micro_batch_tokens}")
            run = cls(cfg, lock, checkpoint, state)
            run.leftover, run.folder = leftover, folder
            if claim:
                run.claim()
        except BaseException:
            if lock is not None:
                lock.close()
            raise
        return run

    def claim(self) -> None:
        """The run's first write, once everything checkable is checked: `out` made (or, empty, claimed) and locked if
        it was new or empty at `open` (and checked again: another process may have written there since), the marker
        written where it is missing (`_write_marker`: first), a failed start's files removed, config.json written,
        and a resumed run's summary.json removed (`finish` writes it again)."""
        out, made = self.out, False
        if self.lock is None:
            made = _make(out)
            _ownership(out)  # a folder that is not troll's (written since `open`) is refused before it is locked
            self.lock = _lock(out)
            self.folder = _ownership(out)
            if self.state is None:
                self.leftover = _check_fresh(out, self.folder)
        _check_links(out)
        if self.folder is None:
            self.folder = "made" if made else "empty"
            _write_marker(out, self.folder)
        elif self.folder == "older":
            self.folder = "adopted"
            _write_marker(out, self.folder)
        if self.leftover:
            print(f"{out}: a run stopped before its first checkpoint here ({', '.join(self.leftover)}); starting this "
                  "run from the beginning")  # fmt: skip
            for name in self.leftover:  # no link among them (`_check_links`)
                path = out / name
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
            self.leftover = []
        if not self.finished:
            self._write_config(self.cfg)
        summary = out / "summary.json"
        if self.state is not None and not self.finished and summary.exists():  # finish() writes it from the state
            summary.unlink()
            print(f"{summary} removed: it is written again when the run ends at step {self.cfg.steps}")

    @property
    def finished(self) -> bool:
        """A run at its last step whose summary.json reads as declared (troll.run.runfiles.SUMMARY; a damaged one is
        written again by `finish`)."""
        if self.state is None or self.state["step"] < self.cfg.steps:
            return False
        try:
            return summary_problem(json.loads((self.out / "summary.json").read_text())) is None
        except (OSError, ValueError):
            return False

    def summary(self) -> dict:
        """A finished run's summary.json, untouched; its config.json written again only when it is missing or
        damaged (`_write_config`), from the settings of the checkpoint it finished with."""
        if _config_damage(self.out / "config.json") is not None:
            self._write_config(dataclasses.replace(self.cfg, **with_added(self.state["config"])))
        print(f"{self.out} finished at step {self.state['step']} (--steps {self.cfg.steps}): nothing to do")
        return read_json_object(self.out / "summary.json")

    def _write_config(self, cfg: Config) -> None:
        """Write config.json, `cfg`, in the run's own folder (claimed or locked, no link there: `_check_links`). On
        resume, one that is missing or damaged (Config.resumed then read the run's settings from its checkpoint) is
        said, and a damaged one kept as config.json.damaged: the link-free name renamed, never written through."""
        path = self.out / "config.json"
        damage = None if self.state is None else _config_damage(path)
        if damage == "damaged":
            os.replace(path, path.with_name(f"{path.name}.damaged"))
        cfg.save(path)
        if damage is not None:
            kept = f" (the damaged one kept as {path.name}.damaged)" if damage == "damaged" else ""
            print(f"{path} was {damage}: written again from {self.checkpoint / 'trainer.pt'}{kept}")

    # ------------------------------------------------------------------ the first step, or the restored one

    def begin(self, acc: float, records: list[dict], extra: dict, model: Any, tokenizer: Any, opt: Any, sched: Any):
        """A new run: the evaluation before RL (step 0), the state with `extra` (warm-start record, dropped
        prompts), and the step-0 checkpoint."""
        for path in (self.metrics, self.samples, self.tokens):
            path.write_text("")
        self.state = {"step": 0, "eval_before": acc, "eval_after": acc, "eval_best": acc, "eval_best_step": 0}
        self.state |= {"skipped_steps": 0, "changes": [], "pending": [], **extra}  # pending: batches sampled ahead
        self._open_logger()
        self._log([{"step": 0, "eval_acc": acc}], [{"step": 0, **r} for r in records[: self.cfg.samples_to_log]])
        self._save(model, tokenizer, opt, sched)

    def restore(self, opt: Any, sched: Any) -> None:
        """A resumed run: optimiser and schedule from the checkpoint, at the learning rate in force now; logs cut
        back to the checkpoint's step, after the line that says what is resumed (`_resuming`)."""
        opt.load_state_dict(self.state.pop("optimizer"))
        sched.load_state_dict(self.state.pop("scheduler"))
        sched.base_lrs = [self.cfg.lr for _ in sched.base_lrs]  # a changed --lr takes effect from this step
        for group, factor in zip(opt.param_groups, sched.lr_lambdas, strict=True):
            group["lr"], group["initial_lr"] = self.cfg.lr * factor(sched.last_epoch), self.cfg.lr
        sched._last_lr = [g["lr"] for g in opt.param_groups]
        print(self._resuming())
        for path in (self.metrics, self.samples, self.tokens):
            truncate_jsonl(path, self.state["step"])
        self._open_logger()

    def _resuming(self) -> str:
        """The line a resumed run starts with: the checkpoint, its step, and how many steps after it had been done
        before the stop (the last step in metrics.jsonl: steps run in order), which this run computes again
        (`restore` drops their rows)."""
        step, total = self.state["step"], self.cfg.steps
        with warnings.catch_warnings():  # a damaged line is said once, when `restore` drops it
            warnings.simplefilter("ignore")
            rows = read_jsonl(self.metrics, torn_tail=True, skip_damaged=True) if self.metrics.is_file() else []
        last = max((s for r in rows if type(s := r.get("step")) is int), default=step)
        if last <= step:
            return f"resuming from {self.checkpoint} at step {step} of {total}; no step after it had been done"
        again = f"step {last}" if last == step + 1 else f"steps {step + 1}-{last}"
        return (
            f"resuming from {self.checkpoint} at step {step} of {total}; recomputing {last - step} step"
            f"{'s' if last - step > 1 else ''} done after it before the stop ({again})"
        )

    # ------------------------------------------------------------------ the loop

    def steps(self) -> Iterator[int]:
        print(f"eval before RL: {self.state['eval_before']:.3f}")
        start, total = self.state["step"], self.cfg.steps
        # a bar on a terminal only (disable=None): stderr sent to a file gets no redraws, a line per evaluation
        self.bar = tqdm(range(start, total), desc=f"rl/{self.cfg.loss}", initial=start, total=total, disable=None)
        return iter(self.bar)

    def eval_due(self, step: int) -> bool:
        return (step + 1) % self.cfg.eval_every == 0 or step + 1 == self.cfg.steps

    def record(
        self,
        step: int,
        row: dict,
        evaluation: tuple[float, list[dict]] | None,
        model: Any,
        tokenizer: Any,
        opt: Any,
        sched: Any,
        tokens: dict | None = None,
    ) -> None:
        """Log step `step`'s metrics row, its evaluation (if any) and its per-token records (if any); checkpoint
        when due."""
        if tokens is not None:
            append_jsonl(self.tokens, [tokens])
        s = self.state
        s["step"], s["skipped_steps"] = step + 1, s["skipped_steps"] + row["skipped"]
        rows, samples = [row], []
        if evaluation is not None:
            acc, records = evaluation
            rows.append({"step": step + 1, "eval_acc": acc})
            samples = [{"step": step + 1, **r} for r in records[: self.cfg.samples_to_log]]
            s["eval_after"] = acc
            if acc > s["eval_best"]:
                s["eval_best"], s["eval_best_step"] = acc, step + 1
            # kl: the largest KL to q of the policy the loss weighs, pi* under TROLL, p itself under the baselines
            tqdm.write(f"step {step + 1}/{self.cfg.steps}: eval {acc:.3f}, reward {row['reward']:.2f}, "
                       f"kl max {row['kl_after_max']:.3f}")  # fmt: skip
        self._log(rows, samples)
        unconverged = row.get("dual_frac_unconverged", 0.0)
        self.bar.set_postfix(
            reward=f"{row['reward']:.2f}", acc=f"{s['eval_after']:.2f}", kl=f"{row['kl_after_max']:.3f}",
            **({"UNCONVERGED": f"{unconverged:.2g}"} if unconverged else {}),
        )  # fmt: skip
        if (step + 1) % self.cfg.save_every == 0 or step + 1 == self.cfg.steps:
            self._save(model, tokenizer, opt, sched)

    def finish(self, eval_problems: int) -> dict:
        """Write summary.json; returns the summary."""
        summary = {k: v for k, v in self.state.items() if k not in ("step", "pending", "config")}
        summary |= {"wall_clock_s": round(time.time() - self.t_start, 1), "steps": self.cfg.steps,
                    "cpu_s": round(time.process_time() - self.cpu_start, 1)}  # fmt: skip
        summary |= {"loss": self.cfg.loss, "seed": self.cfg.seed, "eval_problems": eval_problems}
        write_json(self.out / "summary.json", summary)
        print(
            f"eval: {summary['eval_before']:.3f} -> {summary['eval_after']:.3f} (best {summary['eval_best']:.3f} at "
            f"step {summary['eval_best_step']}) in {summary['wall_clock_s']} s; {self.out / 'summary.json'}"
        )
        if eval_problems:
            low, high = gain_interval(summary["eval_before"], summary["eval_after"], eval_problems)
            gain = summary["eval_after"] - summary["eval_before"]
            print(f"gain: {gain:+.3f}, 95% interval [{low:+.3f}, {high:+.3f}] over {eval_problems} problems (unpaired)")
        return summary

    # ------------------------------------------------------------------ internals

    def _open_logger(self) -> None:
        self.logger = Logger(self.cfg.log_to, self.out, dataclasses.asdict(self.cfg))

    def _log(self, rows: list[dict], samples: list[dict]) -> None:
        append_jsonl(self.metrics, rows)
        if samples:
            append_jsonl(self.samples, samples)
        for r in rows:
            self.logger.log(r)

    def _save(self, model: Any, tokenizer: Any, opt: Any, sched: Any) -> None:
        state = self.state | {
            "wall_clock_s": time.time() - self.t_start,
            "cpu_s": time.process_time() - self.cpu_start,
            "config": settings(dataclasses.asdict(self.cfg)),
        }
        save_checkpoint(self.out, model, tokenizer, opt, sched, state)


def gain_interval(before: float, after: float, n: int) -> tuple[float, float]:
    """The 95% interval of after - before, two accuracies on the same n problems, taken as independent (the normal
    approximation of two proportions, for the hundreds of problems a run evaluates): wider than a paired interval
    where the two evaluations agree on problems."""
    half = 1.959964 * math.sqrt((before * (1 - before) + after * (1 - after)) / n)
    return after - before - half, after - before + half


def read_json_object(path: Path) -> dict:
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RunError(f"{path} cannot be read ({e})") from None
    if not isinstance(obj, dict):
        raise RunError(f"{path} does not hold a JSON object")
    return obj


def claim_folder(out: str | Path) -> None:
    """Make `out` a run's folder ahead of the run, for a caller that keeps its own files in it (study.runner's
    log.txt), which would leave the folder neither empty nor troll's: a new or empty folder is made or claimed and
    marked (`_write_marker`), one that is a run's already is left as it is, any other is refused (a RunError)."""
    out = Path(out)
    made = _make(out)
    if _ownership(out) is not None:
        return
    with contextlib.closing(_lock(out)):
        if _ownership(out) is None:  # again, under the lock
            _write_marker(out, "made" if made else "empty")


def _config_damage(path: Path) -> str | None:
    """Whether a run's config.json is "missing", "damaged" (not a file, or not JSON), or None: it reads."""
    if not path.exists():
        return "missing"
    try:
        json.loads(path.read_bytes())
    except (OSError, ValueError):  # a folder, not UTF-8, not JSON
        return "damaged"
    return None


def _make(out: Path) -> bool:
    """Make folder `out` and its parents; whether this call made it (False: it was there)."""
    try:
        out.mkdir(parents=True)
        return True
    except FileExistsError as e:
        if out.is_dir():
            return False
        raise RunError(f"--out {out} cannot be a run directory ({e.strerror}): choose another --out") from None
    except (NotADirectoryError, PermissionError) as e:
        raise RunError(f"--out {out} cannot be a run directory ({e.strerror})") from None


def _ownership(out: Path) -> str | None:
    """Whose folder `out` is, read only: None when it is empty (nothing in it but troll's lock), the marker's
    "folder" when troll claimed it (FOLDERS), "older" for a run made before the marker (`_older_run`). Any other
    folder is a RunError naming it: a run writes only where every file of its names is its own."""
    entries = sorted(p.name for p in out.iterdir() if not (p.name == LOCK and _troll_lock(p)))
    if not entries:
        return None
    marker = out / MARKER
    if marker.is_symlink() or (marker.exists() and not marker.is_file()):
        what = "a symbolic link" if marker.is_symlink() else "a folder" if marker.is_dir() else "not a regular file"
        raise RunError(f"{marker} is {what}, not the marker file troll writes: move it away, or choose another --out")
    if marker.exists():
        try:
            mark = json.loads(marker.read_bytes())
        except (OSError, ValueError) as e:  # not UTF-8 or not JSON
            mark, why = None, f"it cannot be read: {type(e).__name__}"
        else:
            why = "it is not troll's marker"
        if isinstance(mark, dict) and mark.get("kind") == MARKER_KIND and mark.get("folder") in FOLDERS:
            return mark["folder"]
        if _older_run(out):
            return "older"  # its marker is written again when the run is resumed
        raise RunError(
            f"{marker} is damaged ({why}), and {out} holds no run troll recognises without it (a config.json beside "
            "a whole checkpoint): choose another --out"
        )
    if _older_run(out):
        return "older"
    shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
    raise RunError(
        f"--out {out} is not empty and holds no troll run ({shown}; no {MARKER}): a run writes only in a new or "
        "empty folder, or in its own: choose a new or empty --out"
    )


def _older_run(out: Path) -> bool:
    """Whether `out` holds a run made before troll marked its folders: a config.json (a file, not a link) that
    Config.load accepts, every field present, beside a whole checkpoint (`check_checkpoint`). Another program's
    config.json, or checkpoints not in troll's layout, are not one."""
    config = out / "config.json"
    if config.is_symlink() or not config.is_file():
        return False
    try:
        Config.load(config)
        return any(not c.is_symlink() and check_checkpoint(c) is None for c in complete_checkpoints(out))
    except (OSError, ValueError):
        return False


def _write_marker(out: Path, folder: str) -> None:
    """Write <out>/.troll-run, {"kind": "troll run", "folder": how the run owns `out`}: created exclusively and never
    through a link; a damaged one, beside an older run's files (`_ownership`), is replaced whole."""
    marker, mark = out / MARKER, {"kind": MARKER_KIND, "folder": folder}
    if marker.exists():
        write_json(marker, mark)
        print(f"{marker} could not be read: written again (the run is recognised by its config.json and checkpoint)")
        return
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(mark) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _link_refused(path: Path) -> RunError:
    return RunError(
        f"{path} is a symbolic link, and troll never writes through one: remove the link (what it points to is left "
        "alone), or choose another --out"
    )


def _check_links(out: Path) -> None:
    """A RunError for a symbolic link where the run writes: a name of RUN_FILES or START_FILES, the lock, the
    marker, W&B's folder, their temporary files, or an entry of checkpoints/ (`latest`, step-*)."""
    names = {LOCK, MARKER, "wandb", *RUN_FILES, *START_FILES}
    paths = [out / n for n in sorted(names | {f"{n}.tmp" for n in names} | {f".{n}.tmp" for n in names})]
    checkpoints = out / "checkpoints"
    if checkpoints.is_dir() and not checkpoints.is_symlink():
        paths += sorted(checkpoints.iterdir())
    if link := next((p for p in paths if p.is_symlink()), None):
        raise _link_refused(link)


def _troll_lock(path: Path) -> bool:
    """Whether `path` is a lock troll wrote: a file, not a link, that is empty or holds "pid N"."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with open(path, "rb") as f:
            text = f.read(65)
    except OSError:
        return False
    return text == b"" or LOCK_TEXT.fullmatch(text) is not None


def _lock(out: Path) -> Any:
    """An exclusive lock on <out>/.lock for this process's lifetime (released when the file is closed). The file is
    created exclusively, or opened as it is, never through a link; its holder's pid is written in it only when troll
    created it or it holds troll's "pid N" (a file of someone else's is never truncated)."""
    path, flags = out / LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd, created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644), True
    except FileExistsError:
        try:
            fd, created = os.open(path, flags), False
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _link_refused(path) from None
            raise
    f = os.fdopen(fd, "r+b")  # noqa: SIM115 (held open until the run ends)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RunError(f"{path} is not a file, so it cannot be the run's lock: move it, or choose another --out")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            holder = f.read(64).decode("utf-8", "replace").strip() or "another process"
            message = f"{out} is in use by a running troll.train ({holder}): wait for it, or choose another --out"
            raise RunError(message) from e
        if created or LOCK_TEXT.fullmatch(f.read(65)):
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}\n".encode())
            f.flush()
    except BaseException:
        f.close()
        raise
    return f


def _check_fresh(out: Path, folder: str | None) -> list[str]:
    """Whether a new run may start in `out`, owned as `folder` says (`_ownership`), read only: the files there that
    a failed start left (removed by `Run.claim`), empty when there are none. A whole checkpoint (resume it) or a
    summary.json (a finished run's) is refused: neither is ever removed. Files are removed only where troll made
    the folder or found it empty (CLEANABLE): there every file of the run's names is its own."""
    present = [name for name in (*RUN_FILES, *START_FILES) if (out / name).exists()]
    if folder is None or not present:
        return []
    if complete_checkpoints(out):
        raise RunError(f"{out} already holds a run: pass --resume true to continue it, or choose another --out")
    if "summary.json" in present:
        raise RunError(
            f"{out} holds files this run would overwrite ({', '.join(present)}), written by another run or a "
            "finished one: choose another --out, or remove them"
        )
    if folder not in CLEANABLE:
        raise RunError(
            f"{out} holds an older troll's run with no checkpoint left ({', '.join(present)}): troll removes only "
            "files it wrote in a folder it made or found empty; choose another --out"
        )
    return present


def _pick_checkpoint(out: Path) -> tuple[Path | None, dict | None]:
    """The newest whole checkpoint and its state; a damaged one is named and skipped. (None, None) when there is
    no checkpoint yet."""
    candidates = complete_checkpoints(out)
    for ckpt in candidates:
        problem = check_checkpoint(ckpt)
        state = None
        if problem is None:
            try:
                state = load_trainer_state(ckpt)
            except Exception as e:  # torch.load raises several types on a damaged file
                problem = f"{ckpt / 'trainer.pt'} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        if state is None:
            print(f"checkpoint damaged: {problem}")
            continue
        if ckpt != candidates[0]:
            print(f"resuming from the older checkpoint {ckpt}")
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise RunError(
                f"{ckpt / 'trainer.pt'} lacks {missing} (written by an older troll): finish that run with the troll "
                "that started it, or start a new one"
            )
        return ckpt, state
    if candidates:
        raise RunError(f"no checkpoint in {out / 'checkpoints'} is whole (see above): start a new run in another --out")
    print(f"{out}: no checkpoint to resume from yet")
    return None, None


def _resumed_config(cfg: Config, state: dict) -> Config:
    """`cfg` checked against the config the checkpoint was written with: only RESUME_CHANGEABLE fields may differ;
    their changes are recorded in the state from this step on."""
    saved, given = state["config"], settings(dataclasses.asdict(cfg))
    changed = {k: v for k, v in given.items() if saved[k] != v}
    fixed = sorted(set(changed) - set(RESUME_CHANGEABLE))
    if fixed:
        was = ", ".join(f"{k}={saved[k]!r} (given {changed[k]!r})" for k in fixed)
        raise RunError(f"cannot change on resume: {was}; start a new run (another --out) to change them")
    if changed:
        print(f"resuming at step {state['step']} with " + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
        state["changes"] = [*state["changes"], {"step": state["step"], **changed}]
    return cfg
