"""Per-token records: what the trust region did to each token of a few sampled completions, as the update saw it.

At the steps that are due (`due`: every `records_every` RL steps, or with 0 at the evaluated steps, the last step
included) the run writes one row to `<out>/tokens.jsonl` for `records_samples` of the step's samples (`pick`: half
with the highest advantage, the rest with the lowest; ties to the lower index), each completion token with

    text        the token's text (tokenizer.decode of the one id, at most TEXT_CHARS characters)
    q           q(y): the old policy the trust region is anchored to (the recomputed network, or the sampler)
    p           p(y): the network at the minibatch pass that trained the sample (the last epoch's), as the loss saw it
    p_after     p(y): the network after the step's whole update
    kl          KL(p || q) before the projection, on the run's sparse support (what the projection compares to eps)
    projected   1 where kl > eps: the projection moved the token
    ratio       p(y) / q(y), the raw ratio
    ratio_proj  pi*(y) / q(y), the ratio of the projected policy (= ratio where not projected)
    clipped     1 where PPO-clip at the run's range would have cut the token's gradient: A > 0 and r > 1 + clip_high,
                or A < 0 and r < 1 - clip_low (r: the token's ratio; with --level sequence the response's GSPO ratio
                exp(mean_t log r_t))

and per sample its index in the batch, advantage, reward and the prompt's last PROMPT_CHARS characters. Every run
records the same fields, whatever its loss: the projection is computed with troll.project at the config's eps
(0.05 unless given) under PPO-clip, DPPO or CISPO too, as a diagnostic. Floats keep 4 significant digits; a row
is at most `row_bytes_bound(cfg)` bytes (samples x max_new_tokens tokens, each bounded).

How the values are taken: `Recorder.watch` wraps the step's loss function (troll.train's `loss_fn` seam) and
replays the update's order of calls (`minibatches_of`, then `Rollouts.micro_batches` within each), so it knows which
samples each call holds; for the recorded ones it recomputes the support and projection from the call's own inputs
under no_grad. The loss's value and gradient are untouched (the run is the same bit for bit, records on or off).
`Recorder.after` reads p(y) after the update, one sample at a time (no [T, V] tensor with the chunked head).

The file's schema is declared once, in troll.schema's terms (ROW, SAMPLE: each field's kind, whether null is
allowed, its range, per token or not, the version of the file that first has it). `read`, the reader for
troll.inspect, checks every row against it: a missing, empty or damaged file, or a row whose field is missing,
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
DIGITS = 4  # significant digits of every float


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
    "p": PROBABILITY,
    "p_after": PROBABILITY,
    "kl": Spec("number", null=True, per_token=True),  # >= 0, but float32 rounding leaves some KLs near 0 below it
    "projected": Spec("flag", per_token=True),
    "ratio": Spec("number", null=True, low=0, per_token=True),
    "ratio_proj": Spec("number", null=True, low=0, per_token=True),
    "clipped": Spec("flag", per_token=True),
}
VERSION = 1  # the newest version of the file: a field added later gets since=2, and its readers read both
FIELDS = tuple(k for k, spec in SAMPLE.items() if spec.per_token)  # per token, columnar
SAMPLE_KEYS = tuple(SAMPLE)
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
        for k in FIELDS:
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


def row_bytes_bound(cfg: Any) -> int:
    """An upper bound on one row's size in bytes: every token's text at TEXT_CHARS escaped characters, every
    float at its longest repr, the prompt at PROMPT_CHARS escaped characters."""
    longest_float = len("-1.234e-100, ")
    per_token = (TEXT_CHARS * 6 + 4) + 7 * longest_float + 2 * len("0, ")
    per_sample = 200 + PROMPT_CHARS * 6 + len(FIELDS) * 20 + cfg.max_new_tokens * per_token
    return 300 + cfg.records_samples * per_sample


class Recorder:
    """The records of one RL step (module docstring): `watch` the loss, then `after` the update, then `row`."""

    def __init__(self, cfg: Any, tokenizer: Any, step: int) -> None:
        self.cfg, self.tokenizer, self.step = cfg, tokenizer, step
        self.samples: dict[int, dict] = {}  # batch index -> its record, the last pass that trained it
        self.picked: list[int] = []

    def watch(self, loss_fn: Callable, batch: Any, minibatches: Sequence[Tensor]) -> Callable:
        """`loss_fn` wrapped: each call returns what loss_fn returns, and records the picked samples it holds.
        The calls come in the update's order (troll.train.update): per minibatch, its micro-batches."""
        ro = batch.ro
        self.picked = pick(batch.adv, self.cfg.records_samples)
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
        log_r = (s.lp_y - s.lq_y).double()[:n]
        log_rs = (proj.log_pi_y.detach() - s.lq_y).double()[:n]
        a = float(adv[j])
        r_clip = log_r.mean().exp().expand(n) if cfg.level == "sequence" and n else log_r.exp()
        clipped = ((a > 0) & (r_clip > 1 + cfg.clip_high)) | ((a < 0) & (r_clip < 1 - cfg.clip_low))
        ids = tokens[j][:n].tolist()
        prompt = self.tokenizer.decode(batch.ro.prompt_ids[i])
        return {
            "index": i,
            "adv": fig(a),
            "reward": fig(float(batch.rewards[i])),
            "prompt": prompt[-PROMPT_CHARS:],
            "text": [self.tokenizer.decode([t])[:TEXT_CHARS] for t in ids],
            "q": _figs(s.lq_y[:n].double().exp()),
            "p": _figs(s.lp_y[:n].double().exp()),
            "p_after": [],
            "kl": _figs(proj.dual.kl_before[:n]),
            "projected": [int(x) for x in proj.dual.active[:n].tolist()],
            "ratio": _figs(log_r.exp()),
            "ratio_proj": _figs(log_rs.exp()),
            "clipped": [int(x) for x in clipped.tolist()],
        }

    def after(self, model: Any, batch: Any) -> None:
        """p(y) under the network after the update, for every recorded sample (one sample per forward)."""
        import torch

        from troll.head import gather_logprobs
        from troll.policy import rollout_logits

        ro, vocab = batch.ro, len(self.tokenizer)
        with torch.no_grad():
            for i, rec in self.samples.items():
                x = rollout_logits(model, ro, torch.tensor([i]), vocab, self.cfg.logits_chunk, self.cfg.bf16)
                x = x.reshape(-1, x.shape[-1])
                ids = ro.completion_ids[i].to(x.device)[:, None]
                logp, _, _ = gather_logprobs(x, ids, torch.ones_like(ids, dtype=torch.bool))
                rec["p_after"] = _figs(logp[: len(rec["text"]), 0].double().exp())

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
    return rows
