"""Per-token records: what the trust region did to each token of a few sampled completions, as the update saw it.

At the steps that are due (`due`: every `records_every` RL steps, or with 0 at the evaluated steps, the last step
included) the run writes one row to `<out>/tokens.jsonl` for `records_samples` of the step's samples (`pick`: half
with the highest advantage, the rest with the lowest; ties to the lower index), each completion token with

    text            the token's text (tokenizer.decode of the one id, at most TEXT_CHARS characters)
    q               q(y): the old policy the trust region is anchored to (the recomputed network, or the sampler)
    p_before        p(y): the network before the step's update
    p               p(y): the network at the minibatch pass that trained the sample (the last epoch's), as the loss
                    saw it
    p_after         p(y): the network after the step's whole update
    kl              KL(p || q) in nats at this position: over all next-token candidates (the run's sparse support),
                    before the projection, which compares it to eps
    projected       1 where kl > eps: the projection moved the position
    log_ratio       log p(y) - log q(y), the raw log-ratio
    log_ratio_proj  log pi*(y) - log q(y), the projected policy's (= log_ratio where not projected)
    clipped         1 where PPO-clip at the run's range cuts the token's gradient (`cut`): A > 0 and r > 1 + clip_high,
                    or A < 0 and r < 1 - clip_low, r = exp(log_ratio), or with --level sequence the response's GSPO
                    ratio exp(mean_t log_ratio_t)

and per sample what re-checks its reward, and its figures:

    index           its index in the batch
    adv, reward     its advantage and reward
    prompt          the prompt, whole (its last TEXT_CHARS characters per prompt token, --max_prompt_len, at most)
    train_row       the index of its problem in the task's training split (troll.tasks.task.Task.train)
    gold            the gold answer its reward was scored against (at most GOLD_CHARS characters: every task's is
                    shorter)
    completion      the completion's text as the reward scored it (troll.tasks.task.decode: special tokens removed; at
                    most TEXT_CHARS characters per token, --max_new_tokens), so task.reward(completion, gold) is
                    its reward

(train_row and gold are null for a batch sampled ahead, --staleness, and pickled in a checkpoint before records kept
them). Every run records the same fields, whatever its loss: the projection is computed with troll.project at the
config's eps (0.05 unless given) under PPO-clip, DPPO or CISPO too, as a diagnostic: what the other method would
have done. Exact where it decides: kl, log_ratio and log_ratio_proj keep every digit of their float64 value, and
`clipped` is computed from the stored log_ratio by `cut`, so every flag re-derives from the file (projected: kl >
eps; clipped: `cut`), at the sequence level's 3e-4 clip range too; the probabilities and the advantage keep 4
significant digits.
A row is at most `row_bytes_bound(cfg)` bytes (samples x max_new_tokens tokens, each bounded).

How the values are taken: `Recorder.watch` wraps the step's loss function (troll.train's `loss_fn` seam) and
replays the update's order of calls (`minibatches_of`, then `Rollouts.micro_batches` within each), so it knows which
samples each call holds; for the recorded ones it recomputes the support and projection from the call's own inputs
under no_grad. The loss's value and gradient are untouched (the run is the same bit for bit, records on or off).
`Recorder.watch` reads p(y) before the update and `Recorder.after` after it, one sample at a time (no [T, V] tensor
with the chunked head).

The file's schema is declared once, in troll.base.schema's terms (ROW, SAMPLE: each field's kind, whether null is
allowed, its range, per token or not, the versions of the file that have it: version 1 stored the ratios themselves
at 4 digits and no p_before; version 2 the prompt's last 160 characters, no train_row, gold or completion). A step
or a sample's index is at most 2**53 - 1 (MAX_INTEGER): the page's numbers (JavaScript's) tell every such integer
apart. `read`, the reader, checks every row against it and returns it in the newest version's fields (`upgraded`): a
missing, empty or damaged file, or a row whose field is missing, unknown or not as declared, is one UsageError
naming the file, the line and the field, with the way forward; never a traceback. `Records` reads a long run's file
as troll.tools.inspect needs it: every row's step from the head of its line, and whole (checked, upgraded) only the rows
asked for, so a page of 40 steps out of 30,000 reads 40 rows whole. torch is imported where the recorder runs, so
the reader loads without it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from troll.base.checkpoint import json_object
from troll.base.cli import UsageError
from troll.base.schema import Spec, fields_problem, first_problem, shown

if TYPE_CHECKING:
    from torch import Tensor

    from troll.sparse import SparseDist

FILE = "tokens.jsonl"
TEXT_CHARS = 32  # a token's text is cut to this many characters
GOLD_CHARS = 100  # the gold answer is kept whole up to this many characters (every task's is shorter)
MAX_INTEGER = 2**53 - 1  # the largest step or index: JavaScript's numbers tell every integer up to it apart
DIGITS = 4  # significant digits of the floats that decide nothing (probabilities, advantage, reward)


# ----------------------------------------------------------------------------- the file's schema

PROBABILITY = Spec("number", null=True, low=0, high=1, per_token=True)
ROW: dict[str, Spec] = {  # a row: one recorded step
    "step": Spec("integer", low=1, high=MAX_INTEGER),
    "loss": Spec("string"),
    "eps": Spec("number", low=0),
    "clip_low": Spec("number", low=0),
    "clip_high": Spec("number", low=0),
    "level": Spec("string", choices=("token", "sequence")),
    "samples": Spec("list", words="a list of samples"),  # each an object as SAMPLE declares
}
SAMPLE: dict[str, Spec] = {  # one recorded sample: its figures, then its tokens' (columnar)
    "index": Spec("integer", low=0, high=MAX_INTEGER),
    "adv": Spec("number", null=True),
    "reward": Spec("number", null=True),
    "prompt": Spec("string"),  # versions 1 and 2: its last 160 characters
    "train_row": Spec("integer", null=True, low=0, since=3),
    "gold": Spec("string", null=True, since=3),
    "completion": Spec("string", null=True, since=3),
    "text": Spec("string", per_token=True),
    "q": PROBABILITY,
    "p_before": replace(PROBABILITY, since=2),
    "p": PROBABILITY,
    "p_after": PROBABILITY,
    "kl": Spec("number", null=True, per_token=True),  # >= 0, but float32 rounding leaves some KLs near 0 below it
    "projected": Spec("flag", per_token=True),
    "ratio": Spec("number", null=True, low=0, per_token=True, until=1),  # version 1: 4 digits, not exact
    "ratio_proj": Spec("number", null=True, low=0, per_token=True, until=1),
    "log_ratio": Spec("number", null=True, per_token=True, since=2),
    "log_ratio_proj": Spec("number", null=True, per_token=True, since=2),
    "clipped": Spec("flag", per_token=True),
}
VERSION = 3  # the newest version of the file; `read` reads every version and returns the newest's fields
FIELDS = tuple(k for k, spec in SAMPLE.items() if spec.per_token and spec.until is None)  # per token, columnar
SAMPLE_KEYS = tuple(k for k, spec in SAMPLE.items() if spec.until is None)  # the newest version's, in order
ROW_KEYS = tuple(ROW)


def row_problem(row: dict, version: int = VERSION) -> tuple[str, str] | None:
    """The first field of `row` that is not as version `version` of the file declares it (ROW, SAMPLE), as (the
    field's path, e.g. "samples[0].kl[3]", what is wrong with it), or None."""
    if found := fields_problem(row, ROW, version, "", FILE):
        return found
    for i, sample in enumerate(row["samples"]):
        where = f"samples[{i}]"
        if type(sample) is not dict:
            return where, f"is {shown(sample)}, expected an object"
        if found := fields_problem(sample, SAMPLE, version, where + ".", FILE):
            return found
        tokens = len(sample["text"])
        for k in (k for k, spec in SAMPLE.items() if spec.per_token and k in sample):
            if len(sample[k]) != tokens:
                return f"{where}.{k}", f"holds {len(sample[k])} values for {tokens} tokens (one per token of text)"
    return None


def due(cfg: Any, step: int) -> bool:
    """Whether RL step `step` (0-based) writes records: every `records_every` steps, or (0) at the evaluated
    steps, and at the last step; never with records_samples = 0."""
    if cfg.records_samples <= 0:
        return False
    every = cfg.records_every or cfg.eval_every
    return (step + 1) % every == 0 or step + 1 == cfg.steps


def pick(adv: Tensor, n: int) -> list[int]:
    """The `n` samples to record, sorted: ceil(n / 2) with the highest advantage, the rest with the lowest (ties
    to the lower index), so a rewarded rare completion and a failed one both show."""
    n = min(n, len(adv))
    top = sorted(range(len(adv)), key=lambda i: (-float(adv[i]), i))[: (n + 1) // 2]
    low = [i for i in sorted(range(len(adv)), key=lambda i: (float(adv[i]), i)) if i not in top][: n - len(top)]
    return sorted(top + low)


def fig(x: float) -> float | None:
    """A float kept to DIGITS significant digits; None for NaN or inf (JSON has neither)."""
    return float(f"{x:.{DIGITS}g}") if math.isfinite(x) else None


def exact(x: float) -> float | None:
    """A float kept whole (JSON writes the shortest repr that reads back to the same float64); None for NaN or inf."""
    return float(x) if math.isfinite(x) else None


def ratio(log_ratio: float) -> float:
    """exp(log_ratio), inf past a float's range (a stored log-ratio over 709.78: no real step makes one, a hand-edited
    file may)."""
    try:
        return math.exp(log_ratio)
    except OverflowError:
        return math.inf


def cut(adv: float | None, log_ratio: Sequence[float | None], level: str, clip_low: float,
        clip_high: float) -> list[int]:  # fmt: skip
    """PPO-clip's cut flags of one response: 1 where A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low, with
    r = exp(log_ratio) per token, or (level "sequence") GSPO's exp(mean_t log_ratio_t) for every token; a token with
    no log-ratio (null) is never cut. The rule the recorder applies to the very values it stores."""
    known = [x for x in log_ratio if x is not None]
    if level == "sequence":
        seq = ratio(math.fsum(known) / len(known)) if known else None
        ratios = [seq] * len(log_ratio)
    else:
        ratios = [None if x is None else ratio(x) for x in log_ratio]
    a = adv or 0.0
    return [int(r is not None and ((a > 0 and r > 1 + clip_high) or (a < 0 and r < 1 - clip_low))) for r in ratios]


def row_bytes_bound(cfg: Any) -> int:
    """An upper bound on one row's size in bytes: every token's text at TEXT_CHARS escaped characters (6 bytes
    each, "\\u2603"), every float at its longest repr, the prompt and the completion at TEXT_CHARS escaped characters
    a token, the gold at GOLD_CHARS."""
    short, whole = len("-1.234e-100, "), len("-1.2345678901234567e-100, ")  # fig's longest, exact's longest
    per_token = (TEXT_CHARS * 6 + 4) + 4 * short + 3 * whole + 2 * len("0, ") + TEXT_CHARS * 6  # + the completion's
    texts = (cfg.max_prompt_len * TEXT_CHARS + GOLD_CHARS) * 6
    per_sample = 300 + texts + len(SAMPLE_KEYS) * 20 + cfg.max_new_tokens * per_token
    return 300 + cfg.records_samples * per_sample


class Recorder:
    """The records of one RL step (module docstring): `watch` the loss, then `after` the update, then `row`."""

    def __init__(self, cfg: Any, tokenizer: Any, step: int) -> None:
        self.cfg, self.tokenizer, self.step = cfg, tokenizer, step
        self.samples: dict[int, dict] = {}  # batch index -> its record, the last pass that trained it
        self.picked: list[int] = []
        self.before: dict[int, list[float | None]] = {}  # batch index -> p(y) before the update

    def watch(self, loss_fn: Callable, batch: Any, minibatches: Sequence[Tensor], model: Any = None) -> Callable:
        """`loss_fn` wrapped: each call returns what loss_fn returns, and records the picked samples it holds.
        The calls come in the update's order (troll.train.update): per minibatch, its micro-batches. With `model`
        (the network before the update) each picked sample's p(y) before the update is read first."""
        ro = batch.ro
        self.picked = pick(batch.adv, self.cfg.records_samples)
        self.before = {i: self._p(model, batch, i) for i in self.picked} if model is not None else {}
        calls = [rows for mb in minibatches for rows in ro.micro_batches(self.cfg.micro_batch_tokens, mb)]
        count = iter(range(len(calls) + 1))

        def recorded(logits: Any, tokens: Tensor, mask: Tensor, adv: Tensor, old: SparseDist, **kw: Any) -> Any:
            out = loss_fn(logits, tokens, mask, adv, old, **kw)
            n = next(count)
            rows = calls[n].tolist() if n < len(calls) else []
            if len(rows) != tokens.shape[0]:
                raise RuntimeError("troll.run.records: the loss's calls no longer follow troll.train.update's order")
            for j, i in enumerate(rows):
                if i in self.picked:
                    self.samples[i] = self._record(logits, tokens, mask, adv, old, j, i, batch)
            return out

        return recorded

    def _record(self, logits: Any, tokens: Tensor, mask: Tensor, adv: Tensor, old: SparseDist, j: int, i: int,
                batch: Any) -> dict:  # fmt: skip
        """Sample `i` of the batch, row `j` of this call: its tokens as the loss saw them."""
        import torch

        with torch.no_grad():
            return self._figures(logits, tokens, mask, adv, old, j, i, batch)

    def _figures(self, logits: Any, tokens: Tensor, mask: Tensor, adv: Tensor, old: SparseDist, j: int, i: int,
                 batch: Any) -> dict:  # fmt: skip
        import torch

        from troll.head import LMHead
        from troll.project import project_sparse
        from troll.sparse import build_support

        cfg, T = self.cfg, tokens.shape[1]
        if not torch.equal(tokens[j].cpu(), batch.ro.completion_ids[i]):
            raise RuntimeError("troll.run.records: the loss's calls no longer follow troll.train.update's order")
        real = mask[j].bool()
        n = int(real.sum())
        one = replace(logits, hidden=logits.hidden[j]) if isinstance(logits, LMHead) else logits[j]
        one = one.detach()
        q_rows = old.select(torch.arange(j * T, (j + 1) * T, device=old.idx.device))
        s = build_support(one, tokens[j], q_rows, cfg.support, cfg.k, cfg.delta)
        proj = project_sparse(s, cfg.eps)
        log_r = [exact(x) for x in (s.lp_y - s.lq_y).double()[:n].tolist()]
        a = float(adv[j])
        ids = tokens[j][:n].tolist()
        return {
            "index": i,
            "adv": fig(a),
            "reward": fig(float(batch.rewards[i])),
            **self._source(batch, i),
            "text": [self.tokenizer.decode([t])[:TEXT_CHARS] for t in ids],
            "q": _figs(s.lq_y[:n].double().exp()),
            "p_before": self.before.get(i, [None] * n),
            "p": _figs(s.lp_y[:n].double().exp()),
            "p_after": [],
            "kl": [exact(x) for x in proj.dual.kl_before[:n].double().tolist()],
            "projected": [int(x) for x in proj.dual.active[:n].tolist()],
            "log_ratio": log_r,
            "log_ratio_proj": [exact(x) for x in (proj.log_pi_y.detach() - s.lq_y).double()[:n].tolist()],
            "clipped": cut(fig(a), log_r, cfg.level, cfg.clip_low, cfg.clip_high),
        }

    def _source(self, batch: Any, i: int) -> dict:
        """Sample `i`'s prompt (whole), its problem's row in task.train, the gold and the completion as the reward
        scored it: what re-checks its reward. A completion cut at max_new_tokens fills its row (T = max_new_tokens)
        whether or not the loss masks it (--mask_overlong); a finished one is its real tokens."""
        from troll.tasks.task import decode

        cfg, rows, golds, ro = self.cfg, batch.train_rows, batch.golds, batch.ro  # None: a batch pickled before
        ids = ro.completion_ids[i] if not ro.finished[i] else ro.completion_ids[i][ro.completion_mask[i]]
        [completion] = decode(self.tokenizer, [ids.tolist()])
        return {
            "prompt": self.tokenizer.decode(batch.ro.prompt_ids[i])[-cfg.max_prompt_len * TEXT_CHARS :],
            "train_row": None if rows is None else rows[i],
            "gold": None if golds is None else golds[i][:GOLD_CHARS],
            "completion": completion[: cfg.max_new_tokens * TEXT_CHARS],
        }

    def after(self, model: Any, batch: Any) -> None:
        """p(y) under the network after the update, for every recorded sample."""
        for i, rec in self.samples.items():
            rec["p_after"] = self._p(model, batch, i)

    def _p(self, model: Any, batch: Any, i: int) -> list[float | None]:
        """p(y) of sample `i`'s completion tokens under `model` (one sample per forward, no gradient)."""
        import torch

        from troll.head import gather_logprobs
        from troll.policy import rollout_logits

        ro, vocab = batch.ro, len(self.tokenizer)
        with torch.no_grad():
            x = rollout_logits(model, ro, torch.tensor([i]), vocab, self.cfg.logits_chunk, self.cfg.bf16)
            x = x.reshape(-1, x.shape[-1])
            ids = ro.completion_ids[i].to(x.device)[:, None]
            logp, _, _ = gather_logprobs(x, ids, torch.ones_like(ids, dtype=torch.bool))
        return _figs(logp[: int(ro.completion_mask[i].sum()), 0].double().exp())

    def row(self) -> dict:
        """The step's row for tokens.jsonl (step counts from 1, as metrics.jsonl's)."""
        cfg = self.cfg
        head = {"step": self.step + 1, "loss": cfg.loss, "eps": cfg.eps, "clip_low": cfg.clip_low}
        head |= {"clip_high": cfg.clip_high, "level": cfg.level}
        for rec in self.samples.values():  # `after` not called: the figures after the update are unknown
            rec["p_after"] = rec["p_after"] or [None] * len(rec["text"])
        return head | {"samples": [self.samples[i] for i in sorted(self.samples)]}


def _figs(x: Tensor) -> list[float | None]:
    return [fig(v) for v in x.tolist()]


def upgraded(row: dict) -> dict:
    """A row of any version in the newest version's fields: version 1's ratios as log-ratios (4 digits, so its flags
    re-derive only as closely), its p before the update unknown (null); versions 1 and 2's problem row, gold and
    completion unknown (null)."""
    def log(rs: list) -> list:
        return [None if r is None or r <= 0 else math.log(r) for r in rs]

    samples = []
    for s in row["samples"]:
        if "ratio" in s:
            s = {k: v for k, v in s.items() if k not in ("ratio", "ratio_proj")} | {
                "p_before": [None] * len(s["text"]), "log_ratio": log(s["ratio"]),
                "log_ratio_proj": log(s["ratio_proj"])}  # fmt: skip
        samples.append({k: s.get(k) for k in SAMPLE_KEYS})
    return row | {"samples": samples}


# ----------------------------------------------------------------------------- reading

HEAD = re.compile(rb'\{"step": ?(0|[1-9][0-9]{0,15})[,}]')  # a row's line as json.dumps writes it begins so
DAMAGED = "the per-token records are damaged"


class Records:
    """A run's `<out>/tokens.jsonl`, indexed: `steps`, each row's step in file order, read from the head of its line
    (`{"step": N, ...`; a line that does not begin so, or whose step the schema refuses, and the last line are read
    whole at once); `rows(steps)`, the rows at those steps read whole, each checked against the schema (ROW, SAMPLE:
    any version of the file) and in the newest version's fields (`upgraded`). A missing, empty or damaged file, or
    a damaged row read whole, is a UsageError naming the file, and for a row its line and field, with the way
    forward; a torn last line (what a crash leaves) is skipped, as resume drops it. A row not asked for is not read
    past its step."""

    def __init__(self, out: Path) -> None:
        self.path = Path(out) / FILE
        if not self.path.exists():
            raise UsageError(
                f"{self.path} does not exist: the run has no per-token records (made before they existed, or with "
                "--records_samples 0); run it again, or resume it with --records_samples 4"
            )
        try:
            lines = self.path.read_bytes().split(b"\n")  # the last item is b"" when the file ends in a newline
        except OSError as e:
            raise UsageError(f"{self.path} cannot be read ({e.strerror or e}): restore it, or remove it (resume starts "
                             "it again)") from None  # fmt: skip
        self.index: list[tuple[int, int, bytes]] = []  # (step, line number, the line) of each row, in file order
        self.whole: dict[int, dict] = {}  # line number -> its row, checked, for the lines read whole already
        torn = False
        for n, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            head = HEAD.match(raw)
            if head and ROW["step"].accepts(int(head[1])) and n < len(lines):
                self.index.append((int(head[1]), n, raw))
                continue
            row = self._read(n, raw, last=n == len(lines))
            torn |= row is None
            if row is not None:
                self.whole[n] = row
                self.index.append((row["step"], n, raw))
        if not self.index and torn:
            raise UsageError(f"{self.path} holds only a torn line (a run stopped while writing it): {DAMAGED}; resume "
                             "the run to rewrite them")  # fmt: skip
        if not self.index:
            raise UsageError(f"{self.path} holds no records yet: they are written at the evaluated steps (or "
                             "--records_every)")  # fmt: skip
        self.steps = [step for step, _, _ in self.index]

    def rows(self, steps: Collection[int] | None = None) -> list[dict]:
        """The rows at `steps` (default: every row), in file order, read whole, checked and upgraded."""
        found = []
        for step, n, raw in self.index:
            if steps is not None and step not in steps:
                continue
            row = self.whole[n] if n in self.whole else self._read(n, raw, last=False)
            if row["step"] != step:  # a key given twice: JSON keeps the last
                raise UsageError(f"{self.path} line {n}: step is given twice ({step}, then {row['step']}): {DAMAGED}; "
                                 f"restore the file, or delete line {n} to inspect the other steps")  # fmt: skip
            found.append(upgraded(row))
        return found

    def _read(self, n: int, raw: bytes, last: bool) -> dict | None:
        """Line `n`'s row, checked against the schema; None for a torn last line (`last`: no newline after it)."""
        where = f"{self.path} line {n}"
        row, problem = json_object(raw)
        if problem is not None:
            if last:
                return None  # a torn tail: skipped, as resume drops it
            raise UsageError(f"{where}: {problem}: {DAMAGED}; resume the run to rewrite them")
        if found := first_problem(lambda v: row_problem(row, v), VERSION):  # no version has the row
            field, what = found
            raise UsageError(f"{where}: {field} {what}: {DAMAGED}; restore the file, or delete line {n} to inspect "
                             "the other steps")  # fmt: skip
        return row


def read(out: Path) -> list[dict]:
    """Every row of `<out>/tokens.jsonl`, read whole and checked (`Records`)."""
    return Records(out).rows()
