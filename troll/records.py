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

`read` is the reader for troll.inspect: a missing, empty or damaged file is a UsageError naming it and the way
forward, never a traceback. torch is imported where the recorder runs, so the reader loads without it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from troll.cli import UsageError

if TYPE_CHECKING:
    from torch import Tensor

    from troll.sparse import SparseDist

FILE = "tokens.jsonl"
FIELDS = ("text", "q", "p", "p_after", "kl", "projected", "ratio", "ratio_proj", "clipped")  # per token, columnar
SAMPLE_KEYS = ("index", "adv", "reward", "prompt", *FIELDS)
ROW_KEYS = ("step", "loss", "eps", "clip_low", "clip_high", "level", "samples")
TEXT_CHARS = 32  # a token's text is cut to this many characters
PROMPT_CHARS = 160  # the prompt's last this many characters
DIGITS = 4  # significant digits of every float


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
    """The rows of `<out>/tokens.jsonl`, checked; a UsageError naming the file and the way forward when it is
    missing, empty or damaged (a torn last line, what a crash leaves, is skipped as resume would)."""
    from troll.checkpoint import read_jsonl

    path = Path(out) / FILE
    if not path.is_file():
        raise UsageError(
            f"{path} does not exist: the run has no per-token records (made before they existed, or with "
            "--records_samples 0); run it again, or resume it with --records_samples 4"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a torn tail: skipped, as resume drops it
            rows = read_jsonl(path, torn_tail=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"{e}: the per-token records are damaged; resume the run to rewrite them") from None
    if not rows:
        raise UsageError(f"{path} holds no records yet: they are written at the evaluated steps (or --records_every)")
    for n, row in enumerate(rows, start=1):
        problem = _row_problem(row)
        if problem:
            raise UsageError(f"{path} row {n}: {problem}: the per-token records are damaged; resume the run to "
                             "rewrite them")  # fmt: skip
    return rows


def _row_problem(row: dict) -> str | None:
    """What is wrong with one row of tokens.jsonl, or None."""
    missing = [k for k in ROW_KEYS if k not in row]
    if missing:
        return f"lacks {missing}"
    if not isinstance(row["step"], int) or not isinstance(row["samples"], list):
        return "step is not an integer or samples not a list"
    for s in row["samples"]:
        if not isinstance(s, dict) or any(k not in s for k in SAMPLE_KEYS):
            return f"a sample lacks one of {list(SAMPLE_KEYS)}"
        lengths = {len(s[k]) if isinstance(s[k], list) else -1 for k in FIELDS}
        if len(lengths) != 1 or -1 in lengths:
            return "a sample's per-token fields are not lists of one length"
        for k in FIELDS[1:]:
            if any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))) for v in s[k]):
                return f"a sample's {k} holds a value that is not a number"
        if any(not isinstance(t, str) for t in s["text"]):
            return "a sample's text holds a value that is not a string"
    return None

