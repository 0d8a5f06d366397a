"""The declared schemas of a run's metrics.jsonl and summary.json (troll.base.schema's terms), and their readers.

metrics.jsonl (troll.run.harness writes it: troll.run.diagnostics.step_row's row per RL step, and {"step", "eval_acc"}
per evaluation, the first at step 0) holds one JSON object per line. Every row has an integer `step` >= 0; every other
value is a number. The fields a reader uses are declared with their ranges (METRICS); a field it does not know is
allowed, as a number (`OTHER`), since every version added metrics: the first (5feb24e, 2026-11-22) wrote reward,
accuracy, the lengths, lr, skipped, the loss's metrics, peak_memory_mb and eval_acc; later ones added the exact
update KL and the phases' times (kl_update_*, time_*, f168c13), the sampler's mismatch (mismatch_*, 74f718b) and
behaviour_rate (5e5a2c5). A metric that is not finite is written as json.dumps writes it (NaN, Infinity) and read as
such where its field allows it: the loss's metrics can be one, the row's own figures cannot.

summary.json (troll.run.harness.Run.finish) holds the run's evaluations, its skipped steps and cost, and how it was run.
Version 1 (5feb24e) had eval_before, eval_after, skipped_steps, wall_clock_s, steps, loss, seed, eval_problems; version
2 (00b8941) added eval_best and eval_best_step; version 3 (9b0eb00) `changes`, the settings changed on resume; version 4
`cpu_s`, the run's CPU seconds over all its sessions. Any other field (the warm-start record, the prompts dropped) is
allowed.

`read_metrics` and `read_summary` check each row or the object against its table: a mismatch is one SchemaError
(a UsageError and a ValueError) naming the file, the line and the field, with the way forward. Nothing here imports
torch.
"""

from __future__ import annotations

from pathlib import Path

from troll.base.schema import Problem, Spec, fields_problem, first_problem, read_json_checked, read_jsonl_checked, shown

METRICS_FILE, SUMMARY_FILE = "metrics.jsonl", "summary.json"

SHARE = Spec("number", low=0, high=1, required=False)  # a fraction of samples, problems or tokens
NONNEGATIVE = Spec("number", low=0, required=False)
METRICS: dict[str, Spec] = {  # a row: one RL step's metrics, or one evaluation
    "step": Spec("integer", low=0),
    "eval_acc": SHARE,
    "reward": Spec("number", required=False),
    "accuracy": SHARE,
    "response_len_mean": NONNEGATIVE,
    "response_len_max": NONNEGATIVE,
    "truncated_frac": SHARE,
    "lr": NONNEGATIVE,
    "skipped": Spec("integer", low=0, required=False),
    "behaviour_rate": SHARE,
    "frac_active": Spec("float", low=0, high=1, required=False),  # the loss's: NaN where the loss went NaN
    "grad_norm": NONNEGATIVE,  # written only for an optimiser step taken: a finite norm
    "tokens_per_s": NONNEGATIVE,
    "peak_memory_mb": NONNEGATIVE,
    **{f"time_{phase}": NONNEGATIVE for phase in ("generate", "score", "old_policy", "update", "kl_update", "sync")},
}
OTHER = Spec("float")  # any other metric: a number, NaN and infinities as json.dumps writes them

RATE = Spec("number", low=0, high=1)
SUMMARY: dict[str, Spec] = {
    "eval_before": RATE,
    "eval_after": RATE,
    "eval_best": Spec("number", low=0, high=1, since=2),
    "eval_best_step": Spec("integer", low=0, since=2),
    "skipped_steps": Spec("integer", low=0),
    "changes": Spec("list", since=3),
    "wall_clock_s": Spec("number", low=0),
    "steps": Spec("integer", low=1),
    "loss": Spec("string"),
    "seed": Spec("integer"),
    "eval_problems": Spec("integer", low=0),
    "cpu_s": Spec("number", low=0, since=4),
}
SUMMARY_VERSION = 4


def metrics_problem(row: dict) -> Problem | None:
    """The first field of a metrics.jsonl row that is not as METRICS (or OTHER) declares, or None."""
    return fields_problem(row, METRICS, 1, file=METRICS_FILE, other=OTHER)


def summary_problem(summary: dict, oldest: int = 1) -> Problem | None:
    """The first field of summary.json that no version from SUMMARY_VERSION down to `oldest` has as declared (the
    whole file, "(the file)", when it is not an object), or None."""
    if type(summary) is not dict:
        return "(the file)", f"is {shown(summary)}, expected a JSON object"
    return first_problem(lambda v: _summary_fields(summary, v), SUMMARY_VERSION, oldest)


def _summary_fields(summary: dict, version: int) -> Problem | None:
    """SUMMARY's fields as declared, those of `version` present; a field of a later version is as declared where
    present, and any other field is the run's record (warm start, dropped prompts), not checked."""
    for k, spec in SUMMARY.items():
        if k not in summary:
            if spec.since <= version:
                return k, "is missing"
        elif not spec.accepts(summary[k]):
            return k, f"is {shown(summary[k])}, expected {spec.wants()}"
    return None


def read_metrics(run: str | Path) -> list[dict]:
    """The rows of <run>/metrics.jsonl, each checked against METRICS (a torn last line skipped with a warning, as a
    run killed mid-write leaves one); FileNotFoundError for a missing run or file, a ValueError naming the file, the
    line and the field for a row that is not as declared."""
    if not Path(run).is_dir():
        raise FileNotFoundError(f"run directory {run} does not exist")
    path = Path(run) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (is {run} a run directory?)")
    forward = "the run's metrics are damaged; restore the file, or resume the run (--resume true) to rewrite them"
    return read_jsonl_checked(path, metrics_problem, forward)


def read_summary(run: str | Path, oldest: int = 1) -> dict:
    """<run>/summary.json, checked against SUMMARY (any version from `oldest` on): a SchemaError naming the file and
    the field when it is not JSON, not an object, or not as declared."""
    path = Path(run) / SUMMARY_FILE
    forward = "the run's summary is damaged; resume the run (--resume true) to write it again"
    return read_json_checked(path, lambda s: summary_problem(s, oldest), forward)
