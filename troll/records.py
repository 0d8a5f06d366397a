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

and per sample its index in the batch, advantage, reward and the prompt's last PROMPT_CHARS characters. Every run
records the same fields, whatever its loss: the projection is computed with troll.project at the config's eps
(0.05 unless given) under PPO-clip, DPPO or CISPO too, as a diagnostic: what the other method would have done.
Exact where it decides: kl, log_ratio and log_ratio_proj keep every digit of their float64 value, and `clipped` is
computed from the stored log_ratio by `cut`, so every flag re-derives from the file (projected: kl > eps; clipped:
`cut`), at the sequence level's 3e-4 clip range too; the probabilities and the advantage keep 4 significant digits.
A row is at most `row_bytes_bound(cfg)` bytes (samples x max_new_tokens tokens, each bounded).

How the values are taken: `Recorder.watch` wraps the step's loss function (troll.train's `loss_fn` seam) and
replays the update's order of calls (`minibatches_of`, then `Rollouts.micro_batches` within each), so it knows which
samples each call holds; for the recorded ones it recomputes the support and projection from the call's own inputs
under no_grad. The loss's value and gradient are untouched (the run is the same bit for bit, records on or off).
`Recorder.watch` reads p(y) before the update and `Recorder.after` after it, one sample at a time (no [T, V] tensor
with the chunked head).

The file's schema is declared once, in troll.schema's terms (ROW, SAMPLE: each field's kind, whether null is
allowed, its range, per token or not, the versions of the file that have it: version 1 stored the ratios themselves
at 4 digits and no p_before). `read`, the reader for troll.inspect, checks every row against it and returns it in
the newest version's fields (`upgraded`): a missing, empty or damaged file, or a row whose field is missing,
unknown or not as declared, is one UsageError naming the file, the line and the field, with the way forward; never
a traceback. torch is imported where the recorder runs, so the reader loads without it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from troll.cli import UsageError
from troll.schema import Spec, fields_problem, first_problem, shown

if TYPE_CHECKING:
    from torch import Tensor

    from troll.sparse import SparseDist

FILE = "tokens.jsonl"
TEXT_CHARS = 32  # a token's text is cut to this many characters
PROMPT_CHARS = 160  # the prompt's last this many characters
DIGITS = 4  # significant digits of the floats that decide nothing (probabilities, advantage, reward)


# ----------------------------------------------------------------------------- the file's schema

PROBABILITY = Spec("number", null=True, low=0, high=1, per_token=True)
ROW: dict[str, Spec] = {  # a row: one recorded step
    "step": Spec("integer", low=1),
    "loss": Spec("string"),
    "eps": Spec("number", low=0),
    "clip_low": Spec("number", low=0),
    "clip_high": Spec("number", low=0),
    "level": Spec("string", choices=("token", "sequence")),
    "samples": Spec("list", words="a list of samples"),  # each an object as SAMPLE declares
}
SAMPLE: dict[str, Spec] = {  # one recorded sample: its figures, then its tokens' (columnar)
    "index": Spec("integer", low=0),
    "adv": Spec("number", null=True),
    "reward": Spec("number", null=True),
    "prompt": Spec("string"),
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
VERSION = 2  # the newest version of the file; `read` reads every version and returns the newest's fields
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


def cut(adv: float | None, log_ratio: Sequence[float | None], level: str, clip_low: float,
        clip_high: float) -> list[int]:  # fmt: skip
    """PPO-clip's cut flags of one response: 1 where A > 0 and r > 1 + clip_high, or A < 0 and r < 1 - clip_low, with
    r = exp(log_ratio) per token, or (level "sequence") GSPO's exp(mean_t log_ratio_t) for every token; a token with
    no log-ratio (null) is never cut. The rule the recorder applies to the very values it stores."""
    known = [x for x in log_ratio if x is not None]
    if level == "sequence":
        seq = math.exp(math.fsum(known) / len(known)) if known else None
        ratios = [seq] * len(log_ratio)
    else:
        ratios = [None if x is None else math.exp(x) for x in log_ratio]
    a = adv or 0.0
    return [int(r is not None and ((a > 0 and r > 1 + clip_high) or (a < 0 and r < 1 - clip_low))) for r in ratios]


def row_bytes_bound(cfg: Any) -> int:
    """An upper bound on one row's size in bytes: every token's text at TEXT_CHARS escaped characters, every
    float at its longest repr, the prompt at PROMPT_CHARS escaped characters."""
    short, whole = len("-1.234e-100, "), len("-1.2345678901234567e-100, ")  # fig's longest, exact's longest
    per_token = (TEXT_CHARS * 6 + 4) + 4 * short + 3 * whole + 2 * len("0, ")
    per_sample = 200 + PROMPT_CHARS * 6 + len(FIELDS) * 20 + cfg.max_new_tokens * per_token
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
                raise RuntimeError("troll.records: the loss's calls no longer follow troll.train.update's order")
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
            raise RuntimeError("troll.records: the loss's calls no longer follow troll.train.update's order")
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
        prompt = self.tokenizer.decode(batch.ro.prompt_ids[i])
        return {
            "index": i,
            "adv": fig(a),
            "reward": fig(float(batch.rewards[i])),
            "prompt": prompt[-PROMPT_CHARS:],
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
    re-derive only as closely), its p before the update unknown (null)."""
    def log(rs: list) -> list:
        return [None if r is None or r <= 0 else math.log(r) for r in rs]

    samples = []
    for s in row["samples"]:
        if "ratio" in s:
            s = {k: v for k, v in s.items() if k not in ("ratio", "ratio_proj")} | {
                "p_before": [None] * len(s["text"]), "log_ratio": log(s["ratio"]),
                "log_ratio_proj": log(s["ratio_proj"])}  # fmt: skip
        samples.append({k: s[k] for k in SAMPLE_KEYS if k in s})
    return row | {"samples": samples}


# ----------------------------------------------------------------------------- reading


def read(out: Path) -> list[dict]:
    """The rows of `<out>/tokens.jsonl`, each checked against the schema (ROW, SAMPLE: any version of the file); a
    UsageError naming the file, and for a row its line and field, with the way forward, when it is missing, empty or
    damaged (a torn last line, what a crash leaves, is skipped as resume would)."""
    from troll.checkpoint import read_jsonl

    path = Path(out) / FILE
    if not path.exists():
        raise UsageError(
            f"{path} does not exist: the run has no per-token records (made before they existed, or with "
            "--records_samples 0); run it again, or resume it with --records_samples 4"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a torn tail: skipped, as resume drops it
            rows = read_jsonl(path, torn_tail=True)
        # the lines those rows are on: read_jsonl reads every non-blank line in order, skipping only a torn last one
        lines = [n for n, raw in enumerate(path.read_bytes().split(b"\n"), start=1) if raw.strip()]
    except OSError as e:
        raise UsageError(f"{path} cannot be read ({e.strerror or e}): restore it, or remove it (resume starts it "
                         "again)") from None  # fmt: skip
    except ValueError as e:  # read_jsonl's names the file and line; int's limit (4,300 digits) does not
        where = "" if str(e).startswith(str(path)) else f"{path}: "
        raise UsageError(f"{where}{e}: the per-token records are damaged; resume the run to rewrite them") from None
    if not rows and lines:
        raise UsageError(f"{path} holds only a torn line (a run stopped while writing it): the per-token records are "
                         "damaged; resume the run to rewrite them")  # fmt: skip
    if not rows:
        raise UsageError(f"{path} holds no records yet: they are written at the evaluated steps (or --records_every)")
    for n, row in zip(lines, rows, strict=False):
        if found := first_problem(lambda v, row=row: row_problem(row, v), VERSION):  # no version has the row
            where, what = found
            raise UsageError(f"{path} line {n}: {where} {what}: the per-token records are damaged; restore the file, "
                             f"or delete line {n} to inspect the other steps")  # fmt: skip
    return [upgraded(row) for row in rows]
