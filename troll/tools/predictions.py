"""troll.tools.evaluate's work, done in order and kept as it goes: each problem's greedy completion and samples, its
line of predictions.jsonl written when they are done, so a stopped evaluation keeps what it did and continues.

    for finished in completions(generator, prompts, n, max_new_tokens, temperature, seed, block, per_call,
                                start=len(done)):
        for i, greedy, samples in finished:   # the problems a call finished
            ...score problem i, append its line...

The order (`calls`): the problems in blocks of `block` (the backend's greedy batch: troll.rollout.HFGenerator's 64,
the batches training evaluates in, so the greedy numbers agree); a block's greedy completions in one `greedy` call,
then its samples in `sample` calls of whole problems, n samples each and at most `per_call` samples a call (a
problem's samples share its prompt's forward: HFGenerator's share_prompt, vLLM's prefix); a problem whose n samples
are more than `per_call` is sampled alone in calls of `per_call` (the last takes what is left). Call c is seeded with
the c-th draw of random.Random(seed), every call drawing its seed whether it runs or not, so a call's samples never
depend on where an evaluation resumed: a resumed evaluation writes the lines an unstopped one writes. A resume that
starts inside a block (or a call) computes the whole of it again, as the unstopped one did, and yields only the
problems from `start` on.

The state a resume needs (`SETTINGS`, `read_done`): evaluation.json holds the settings that decide the predictions
(the model's folder name and its files' sizes and times, which a copy keeps, so a copied run continues; the task,
its data and problems, the backend, the lengths, the samples, their temperature and seed); predictions.jsonl's
lines are read through `PREDICTION` (troll.base.schema), and must be the first problems' in order. Other settings, no
such file, or a damaged one (said in one line): the evaluation starts over. Nothing here imports torch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from troll.base.schema import Spec, fields_problem, read_json_checked, read_jsonl_checked

if TYPE_CHECKING:
    from troll.rollout import Generator

SAMPLE: dict[str, Spec] = {  # one sample of a problem
    "completion": Spec("string"),
    "extracted": Spec("string", null=True),
    "reward": Spec("number", low=0, high=1),
    "cut": Spec("boolean"),
}
PREDICTION: dict[str, Spec] = {  # a line of predictions.jsonl: one problem
    "question": Spec("string"),
    "gold": Spec("string"),
    "completion": Spec("string"),
    "reward": Spec("number", low=0, high=1),
    "extracted": Spec("string", null=True),
    "cut": Spec("boolean"),
    "samples": Spec("list", required=False, words="a list of samples"),
}
SETTINGS: dict[str, Spec] = {  # evaluation.json's "settings": what decides the predictions
    "model": Spec("string"),
    "weights": Spec("list", words="the weights files' names, sizes and times"),
    "task": Spec("string"),
    "data": Spec("string", null=True),
    "chat": Spec("boolean", null=True),
    "problems": Spec("integer", low=1),
    "questions": Spec("string", words="a hash of the problems"),
    "backend": Spec("string", choices=("hf", "vllm")),
    "max_new_tokens": Spec("integer", low=1),
    "samples": Spec("integer", low=0),
    "temperature": Spec("number"),
    "seed": Spec("integer"),
}


def calls(problems: range, n: int, per_call: int) -> Iterator[tuple[range, int]]:
    """The `sample` calls of a block of problems, in order: (the call's problems, samples of each). Whole problems,
    per_call // n of them a call (at least one); a problem with more than per_call samples alone, in calls of
    per_call. n = 0 (greedy only): one call of the whole block, sampling nothing."""
    if n <= per_call:
        size = len(problems) if n == 0 else per_call // n
        for first in range(problems.start, problems.stop, size):
            yield range(first, min(first + size, problems.stop)), n
        return
    for i in problems:
        for done in range(0, n, per_call):
            yield range(i, i + 1), min(per_call, n - done)


def completions(
    generator: Generator,
    prompts: Sequence[list[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    block: int,
    per_call: int,
    start: int = 0,
) -> Iterator[list[tuple[int, list[int], list[list[int]]]]]:
    """(problem, its greedy completion, its n samples), token ids with a final EOS, for the problems from `start`
    in order: after each call, those it finished (module docstring)."""
    seeds = random.Random(seed)
    for first in range(0, len(prompts), block):
        problems = range(first, min(first + block, len(prompts)))
        greedy: list[list[int]] | None = None
        drawn: dict[int, list[list[int]]] = {i: [] for i in problems}
        for batch, m in calls(problems, n, per_call):
            call_seed = seeds.randrange(2**63)  # drawn whether the call runs or not
            if batch.stop <= start:
                continue
            if greedy is None:
                greedy = generator.greedy([prompts[i] for i in problems], max_new_tokens)
            if m:
                ids = generator.sample([prompts[i] for i in batch], m, max_new_tokens, temperature, call_seed)
                for k, i in enumerate(batch):
                    drawn[i] += ids[k * m : (k + 1) * m]
            done = [(i, greedy[i - first], drawn.pop(i)) for i in batch if len(drawn[i]) == n and i >= start]
            if done:
                yield done


def read_done(folder: Path, settings: dict, rows: Sequence[dict]) -> list[dict] | None:
    """The predictions of a stopped evaluation in `folder` with these `settings`, to continue from (a torn last line
    dropped: the evaluation stopped while writing it); None when there is none to continue (no evaluation.json, or
    other settings). A damaged file or line is a ValueError (a SchemaError for a field) naming the file, the line and
    the field, which troll.tools.evaluate prints before it starts over."""
    state, lines = folder / "evaluation.json", folder / "predictions.jsonl"
    if not (state.is_file() and lines.is_file()):
        return None
    forward = "the evaluation starts again from its first problem"
    saved = read_json_checked(state, lambda obj: fields_problem(obj, {"settings": Spec("object")}, 1), forward)
    if saved["settings"] != settings:
        return None
    n = settings["samples"]

    def problem(row: dict) -> tuple[str, str] | None:
        if found := fields_problem(row, PREDICTION, 1, file="predictions.jsonl"):
            return found
        samples = row.get("samples", [])
        if len(samples) != n or "samples" in row and not n:
            return "samples", f"holds {len(samples)} samples, expected {n}"
        for j, s in enumerate(samples):
            if type(s) is not dict:
                return f"samples[{j}]", "is not an object"
            if found := fields_problem(s, SAMPLE, 1, prefix=f"samples[{j}].", file="predictions.jsonl"):
                return found
        return None

    done = read_jsonl_checked(lines, problem, forward)
    for i, (row, want) in enumerate(zip(done, rows, strict=False)):
        if (row["question"], row["gold"]) != (want["question"], want["gold"]):
            raise ValueError(f"{lines} line {i + 1} is not problem {i + 1} of the evaluation's rows: {forward}")
    if len(done) > len(rows):
        raise ValueError(f"{lines} holds {len(done)} problems, more than the {len(rows)} evaluated: {forward}")
    return done


def weights_stamp(model_path: str) -> list[Any]:
    """The model's weights and config files as [name, size, modification time in ns], sorted: a model written again
    at the same path is another model. [] for a hub name."""
    folder = Path(model_path)
    if not folder.is_dir():
        return []
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin", ".json"))
    return [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files]
