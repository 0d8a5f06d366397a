"""What per-token records (troll.records) cost a run: one RL step with records and without, paired, on tiny-cpu.

    python bench/records.py                   # tiny-cpu preset, 10 rounds
    python bench/records.py --repeats 20 --records_samples 8

Each round starts both variants from the same weights, optimiser and scheduler state (restored from a snapshot,
untimed) and the same step index, so both sample the same rollouts; `off` runs `troll.train.rl_step` as the loop
does between evaluations, `on` with a `troll.records.Recorder` (the loss wrapped, the figures of `records_samples`
samples taken from its inputs, p(y) read after the update, the row built). The order alternates between rounds.
Reported: the median step time (wall and CPU user) of each, the median of the per-round ratios on / off, the
bytes of a row against `row_bytes_bound`, and whether both variants' update metrics agree exactly (records change
nothing the run computes). A run records only at its evaluated steps (every `eval_every`, 25 in tiny-cpu), so its
overhead is the per-step one divided by eval_every; both are printed. Target: under 5% of the run's time.
`--records_samples 0` is refused: records of no sample have no cost to measure.
"""

from __future__ import annotations

import dataclasses
import json
import os
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
from troll.cli import Parser, run_command  # noqa: E402
from troll.config import Config  # noqa: E402
from troll.policy import build_model  # noqa: E402
from troll.records import Recorder, row_bytes_bound  # noqa: E402
from troll.start import make_generator, make_optimizer  # noqa: E402
from troll.task import load_task  # noqa: E402
from troll.warmstart import warm_start_task  # noqa: E402

PROG = "python bench/records.py"  # the name in each of its lines, argparse's own and run_command's

COMPARED = ("reward", "policy", "regression", "kl_before_mean", "kl_after_max", "frac_active", "grad_norm")


def main() -> None:
    ap = Parser(prog=PROG, description=__doc__.split("\n")[0],
                epilog="Other flags go to troll.config.Config (e.g. --records_samples 8).")  # fmt: skip
    ap.add_argument("--repeats", type=int_at_least(1), default=10, help="measured rounds (each runs both)")
    ap.add_argument("--warmup", type=int_at_least(0), default=1, help="untimed rounds first")
    a, rest = ap.parse_known_args()
    cfg = Config.from_args(["--preset", "tiny-cpu", *rest], prog=ap.prog)
    if cfg.records_samples < 1:  # `on` would record nothing: its cost is not the one this measures
        ap.error(f"--records_samples {cfg.records_samples} records nothing, so there is no cost to measure: pass 1 "
                 "or more")  # fmt: skip
    torch.manual_seed(cfg.seed)
    model, tokenizer = build_model(cfg, torch.device("cpu"))
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


if __name__ == "__main__":
    run_command(PROG, main)
