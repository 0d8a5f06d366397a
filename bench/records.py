"""What per-token records (troll.run.records) cost a run: one RL step with records and without, paired, on tiny-cpu;
and with --read_mib, what opening a long run's records costs troll.tools.inspect.

    python bench/records.py                   # tiny-cpu preset, 10 rounds
    python bench/records.py --repeats 20 --records_samples 8
    python bench/records.py --read_mib 55 --read_steps 30000    # a long GSM8K run's tokens.jsonl, opened

Each round starts both variants from the same weights, optimiser and scheduler state (restored from a snapshot,
untimed) and the same step index, so both sample the same rollouts; `off` runs `troll.train.rl_step` as the loop
does between evaluations, `on` with a `troll.run.records.Recorder` (the loss wrapped, the figures of `records_samples`
samples taken from its inputs, p(y) read after the update, the row built). The order alternates between rounds.
Reported: the median step time (wall and CPU user) of each, the median of the per-round ratios on / off, the
bytes of a row against `row_bytes_bound`, and whether both variants' update metrics agree exactly (records change
nothing the run computes). A run records only at its evaluated steps (every `eval_every`, 25 in tiny-cpu), so its
overhead is the per-step one divided by eval_every; both are printed. Target: under 5% of the run's time.
`--records_samples 0` is refused: records of no sample have no cost to measure.

With --read_mib N: a synthetic run folder (config.json, and a tokens.jsonl of about N MiB: --read_steps rows of
`records_samples` samples, each of as many tokens as the size asks, figures drawn at random with a fixed seed, as
the recorder writes them) in a temporary folder, then two timings on it: `troll inspect RUN --out
page.html` (in this process, its output set aside), which reads each row's step from its line and whole only the
rows its page shows (troll.run.records.Records), and `troll.run.records.read`, every row read whole and checked (as
troll.tools.inspect read them before issue 53). Target: the command within seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads slow a busy CPU down many times
if not __package__:  # run as a file: the repository root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import troll.train as train  # noqa: E402
from bench._util import cpu_user, int_at_least, median  # noqa: E402
from bench.step import restore, snapshot  # noqa: E402
from troll.base.cli import Parser, run_command  # noqa: E402
from troll.base.config import Config  # noqa: E402
from troll.models.build import build_model  # noqa: E402
from troll.run import records  # noqa: E402
from troll.run.records import Recorder, row_bytes_bound  # noqa: E402
from troll.run.start import check_size, check_step, make_generator, make_optimizer  # noqa: E402
from troll.run.warmstart import warm_start_task  # noqa: E402
from troll.tasks.task import load_task  # noqa: E402

PROG = "python bench/records.py"  # the name in each of its lines, argparse's own and run_command's

COMPARED = ("reward", "policy", "regression", "kl_before_mean", "kl_after_max", "frac_active", "grad_norm")


def main() -> None:
    ap = Parser(prog=PROG, description=__doc__.split("\n")[0],
                epilog="Other flags go to troll.base.config.Config (e.g. --records_samples 8).")  # fmt: skip
    ap.add_argument("--repeats", type=int_at_least(1), default=10, help="measured rounds (each runs both)")
    ap.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed rounds first")
    ap.add_argument("--read_mib", type=int_at_least(1), default=None, help="instead: time troll.tools.inspect on a "
                    "synthetic tokens.jsonl of about this many MiB")  # fmt: skip
    ap.add_argument("--read_steps", type=int_at_least(1), default=30_000, help="with --read_mib: the recorded steps "
                    "(rows) in it (default: 30000)")  # fmt: skip
    a, rest = ap.parse_known_args()
    cfg = Config.from_args(["--preset", "tiny-cpu", *rest], prog=ap.prog)
    if a.read_mib is not None:
        return reading(ap, a, cfg)
    if cfg.records_samples < 1:  # `on` would record nothing: its cost is not the one this measures
        ap.error(f"--records_samples {cfg.records_samples} records nothing, so there is no cost to measure: pass 1 "
                 "or more")  # fmt: skip
    torch.manual_seed(cfg.seed)
    check_size(cfg)  # what --vocab_size implies, before the model is built (troll.run.start)
    model, tokenizer = build_model(cfg, torch.device("cpu"))
    check_step(cfg, model)  # what the counts imply for this model, in one line before any step (troll.run.start)
    task, _ = load_task(cfg, tokenizer)
    if cfg.sft_steps:
        warm_start_task(cfg, model, tokenizer, task)
    tmp = tempfile.TemporaryDirectory()
    generator = make_generator(cfg, model, tokenizer, Path(tmp.name))
    opt, sched = make_optimizer(cfg, model)
    shape = f"{cfg.prompts_per_step} prompts x {cfg.samples_per_prompt} samples x <= {cfg.max_new_tokens} tokens"
    print(f"step: {shape}, loss {cfg.loss}, records of {cfg.records_samples} samples; {a.warmup} warm-up + "
          f"{a.repeats} rounds")  # fmt: skip
    snap = snapshot(model, opt, sched)
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    sizes, same = [], True
    for r in range(a.warmup + a.repeats):
        rows = {}
        for name in ("off", "on")[:: -1 if r % 2 else 1]:
            restore(snap, model, opt, sched)
            recorder = Recorder(cfg, tokenizer, r) if name == "on" else None
            u, t = cpu_user(), time.perf_counter()
            rows[name] = train.rl_step(dataclasses.replace(cfg), r, model, tokenizer, generator, opt, sched, task,
                                       recorder=recorder)  # fmt: skip
            if recorder:
                sizes.append(len((json.dumps(recorder.row()) + "\n").encode()))
            m = {"wall": time.perf_counter() - t, "user": cpu_user() - u}
            if r >= a.warmup:
                runs[name].append(m)
        same &= all(rows["on"].get(k) == rows["off"].get(k) for k in COMPARED)
        snap = snapshot(model, opt, sched)  # continue from the round's last state
        print(f"  round {r + 1 - a.warmup:>2}: off {runs['off'][-1]['wall'] if r >= a.warmup else 0:.3f} s, "
              f"on {runs['on'][-1]['wall'] if r >= a.warmup else 0:.3f} s")  # fmt: skip
    paired = median(on["wall"] / off["wall"] for on, off in zip(runs["on"], runs["off"], strict=True))
    paired_user = median(on["user"] / off["user"] for on, off in zip(runs["on"], runs["off"], strict=True))
    for name, ms in runs.items():
        wall, user = median(m["wall"] for m in ms), median(m["user"] for m in ms)
        print(f"{name:>4}: median step {wall:.3f} s wall, {user:.3f} s CPU user")
    print(f"records on / off, per recorded step (paired median): {paired:.3f} wall, {paired_user:.3f} CPU user")
    print(f"per run (records every {cfg.eval_every} steps): {1 + (paired - 1) / cfg.eval_every:.4f} wall")
    print(f"bytes per recorded step: median {median(sizes):.0f}, max {max(sizes)} (bound {row_bytes_bound(cfg)})")
    print(f"update metrics identical with and without records: {'yes' if same else 'NO'}")



def sample(rng: random.Random, index: int, tokens: int) -> dict:
    """One recorded sample of `tokens` tokens, its figures drawn as the recorder writes them (troll.run.records: the
    probabilities to 4 digits, the KL and the log-ratios whole)."""
    texts = [rng.choice([" 4", "7", " +", "=", "####", " the", "<|im_end|>"]) for _ in range(tokens)]
    prob = [records.fig(rng.random()) for _ in range(4 * tokens)]
    log_r = [rng.gauss(0, 0.1) for _ in range(tokens)]
    return {"index": index, "adv": records.fig(rng.gauss(0, 1)), "reward": float(rng.random() < 0.5),
            "prompt": "Question: Tom has 47 apples and buys 38 more. How many apples does he have now?\nAnswer:",
            "train_row": rng.randrange(7473), "gold": "85", "completion": "".join(texts), "text": texts,
            "q": prob[:tokens], "p_before": prob[tokens : 2 * tokens], "p": prob[2 * tokens : 3 * tokens],
            "p_after": prob[3 * tokens :], "kl": [abs(rng.gauss(0, 0.03)) for _ in range(tokens)],
            "projected": [int(rng.random() < 0.2) for _ in range(tokens)], "log_ratio": log_r,
            "log_ratio_proj": [x * 0.8 for x in log_r], "clipped": [int(abs(x) > 0.2) for x in log_r]}  # fmt: skip


def synthetic_run(folder: Path, cfg: Config, mib: int, steps: int) -> int:
    """A run folder holding config.json and a tokens.jsonl of about `mib` MiB over `steps` rows (64 distinct rows,
    each written with its own step); returns the file's size in bytes."""
    rng = random.Random(0)
    per_row = mib * 2**20 / steps

    def row(tokens: int) -> dict:
        samples = [sample(rng, i, tokens) for i in range(cfg.records_samples)]
        return {"step": 1, "loss": cfg.loss, "eps": cfg.eps, "clip_low": cfg.clip_low, "clip_high": cfg.clip_high,
                "level": cfg.level, "samples": samples}  # fmt: skip

    one = len(json.dumps(row(1))) - len(json.dumps(row(0)))  # a token's bytes, all samples
    tokens = max(1, math.floor((per_row - len(json.dumps(row(0)))) / one))
    kinds = []
    for _ in range(64):  # each row to the size asked: the prompts lengthened by what the tokens leave
        made = row(tokens)
        pad = max(0, round(per_row) - len(json.dumps(made)) - 1) // len(made["samples"])
        for s in made["samples"]:
            s["prompt"] = ("Q: " * pad)[:pad] + s["prompt"]
        kinds.append(json.dumps(made).removeprefix('{"step": 1, '))
    (folder / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    with open(folder / records.FILE, "w") as f:
        for step in range(1, steps + 1):
            f.write(f'{{"step": {step}, {kinds[step % len(kinds)]}\n')
    return (folder / records.FILE).stat().st_size


def reading(ap: Parser, a: argparse.Namespace, cfg: Config) -> None:
    """--read_mib: troll.tools.inspect and troll.run.records.read timed on a synthetic long run (module docstring)."""
    from troll.tools import inspect

    if cfg.records_samples < 1:
        ap.error(f"--records_samples {cfg.records_samples} records nothing, so there is no file to read: pass 1 or "
                 "more")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        run.mkdir()
        size = synthetic_run(run, cfg, a.read_mib, a.read_steps)
        print(f"tokens.jsonl: {size / 2**20:.1f} MiB, {a.read_steps} recorded steps of {cfg.records_samples} samples")
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            inspect.main([str(run), "--out", str(Path(tmp) / "page.html")])
        opened = time.perf_counter() - t
        page = (Path(tmp) / "page.html").stat().st_size
        print(f"troll inspect RUN --out page.html: {opened:.2f} s (page {page // 1024} KB)")
        t = time.perf_counter()
        rows = records.read(run)
        print(f"troll.run.records.read, every row read whole and checked: {time.perf_counter() - t:.2f} s ({len(rows)} "
              "rows)")  # fmt: skip


if __name__ == "__main__":
    run_command(PROG, main)
