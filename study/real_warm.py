"""The real-model study's warm-starts (design: study/real.py): one per seed, the `smollm2-words` preset's supervised
warm-start run once into <out>/warm-s<seed> (model, tokenizer and warm.json), from which every run of that seed
starts RL; made in a folder of its own and checked to ask the preset's prompts token for token before it is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from functools import partial
from pathlib import Path

from study.runner import save_warm
from troll.base import outputs
from troll.base.cli import UsageError
from troll.base.config import PRESETS, Config

PRESET = "smollm2-words"
# --model: the preset's model, or the tiny local one for rehearsals (its prompt limit: module docstring)
MODELS: dict[str, dict] = {"smollm2-135m-instruct": {}, "tiny": dict(model="tiny", max_prompt_len=256)}
WARM_LOG = "# python -m study.real: the warm-start of seed {seed}"  # a warm-start log's first line: its own


def preset(model: str) -> dict:
    """The preset's settings for `model` (`MODELS`)."""
    return PRESETS[PRESET] | MODELS[model]


def warm_dir(args: argparse.Namespace, seed: int) -> Path:
    return Path(args.out) / f"warm-s{seed}"


def warm_config(args: argparse.Namespace, seed: int) -> Config:
    """The seed's warm-start: the preset's, at most --sft_steps supervised steps."""
    return Config(**(preset(args.model) | dict(seed=seed, sft_steps=args.sft_steps, out=str(warm_dir(args, seed)))))


def warm_log(args: argparse.Namespace, seed: int) -> outputs.Target:
    """<out>/warm-s<seed>.log, the warm-start's output: the study's own when it starts with its line (WARM_LOG)."""
    return outputs.log_file(Path(args.out) / f"warm-s{seed}.log", WARM_LOG.format(seed=seed), "--out")


def warm_problem(folder: Path) -> str | None:
    """Why a warm-start may not be put at `folder` (it has no warm.json), in one line, or None: new, or an empty
    folder, which the finished warm-start replaces whole; a link, a file or a folder with files is refused."""
    keep = "so it is left as it is: move it away, or choose another --out"
    if folder.is_symlink():
        return f"{folder} is a symbolic link, where a warm-start goes, {keep}"
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, where a warm-start goes, {keep}"
    if folder.is_dir() and any(folder.iterdir()):
        return f"{folder} holds files but no warm.json, so it is no finished warm-start of this study, {keep}"
    return None


def warm_record(args: argparse.Namespace, seed: int) -> dict | None:
    """The seed's warm.json (what made it and how long it took), None when there is none."""
    path = warm_dir(args, seed) / "warm.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_warm_starts(args: argparse.Namespace) -> None:
    """Every seed's warm-start, where one is made, is this command's (its model and step limit); one to make has
    its folder free and its log new or the study's own. A UsageError names the first that is not."""
    for seed in args.seeds:
        record = warm_record(args, seed)
        if record is None:
            outputs.check([warm_log(args, seed)])
            if problem := warm_problem(warm_dir(args, seed)):
                raise UsageError(problem)
            continue
        made = {"model": record.get("model"), "sft_steps": record.get("sft_limit")}
        for flag, was in made.items():
            if was != getattr(args, flag):
                raise UsageError(
                    f"{warm_dir(args, seed)} was warm-started with --{flag} {was}: give that, or choose another --out"
                )


def same_prompts(cfg: Config, tokenizer, saved: Path, task) -> None:
    """The tokenizer saved in `saved` asks the task's first training and held-out problems token for token as the
    run's model does (its chat template kept; the preset's task is asked as GSM8K is: troll.tasks.gsm8k.make_prompt); a
    UsageError if not."""
    from transformers import AutoTokenizer

    from troll.tasks.gsm8k import make_prompt
    from troll.tasks.task import encode

    again = AutoTokenizer.from_pretrained(saved)
    questions = [r["question"] for r in task.train[:4] + task.test[:4]]
    asked = encode(tokenizer, [task.prompt(q) for q in questions])
    if asked != encode(again, [make_prompt(q, again, chat=cfg.chat) for q in questions]):
        raise UsageError(f"{saved}: the saved tokenizer does not ask the preset's prompts (its chat template changed)")


def warm_start(seed: int, args: argparse.Namespace) -> dict:
    """The preset's warm-start for `seed`, saved whole to warm_dir (model, tokenizer, warm.json); returns its
    record (troll.run.warmstart's, and `warm_s`, its wall time)."""
    import torch

    from troll.models.build import build_model
    from troll.run.harness import device_of
    from troll.run.warmstart import warm_start_task
    from troll.tasks.task import load_task

    cfg, out, t0 = warm_config(args, seed), warm_dir(args, seed), time.time()
    torch.manual_seed(seed)
    model, tokenizer = build_model(cfg, device_of(cfg))
    task, _ = load_task(cfg, tokenizer)
    with outputs.writing(warm_log(args, seed), keep_on_error=True) as log, contextlib.redirect_stdout(log):
        print(WARM_LOG.format(seed=seed), flush=True)  # its first line: the log is the study's own
        record = warm_start_task(cfg, model, tokenizer, task)
    record |= {"warm_s": round(time.time() - t0, 1)}
    made = {"seed": seed, "model": args.model, "sft_limit": args.sft_steps, "preset": PRESET}
    save_warm(out, model, tokenizer, made | record, warm_problem, partial(same_prompts, cfg, tokenizer, task=task))
    return record
