"""Peak memory and time of the old-policy pass and one update at the real Qwen shapes: TROLL vs PPO-clip,
chunked output layer (`LMHead`) vs full logits, gradient checkpointing on vs off.

    .venv/bin/python bench/real_shapes.py                     # default plan (~20 min on 2 idle cores)
    .venv/bin/python bench/real_shapes.py --plan quick        # Qwen2.5-0.5B, ckpt on, 4 variants (~3 min)
    .venv/bin/python bench/real_shapes.py --plan full         # every model x variant x row count (~1.5 h)
    .venv/bin/python bench/real_shapes.py --models qwen3-0.6b --rows 1,2 --losses troll --heads chunked
    .venv/bin/python bench/real_shapes.py --models qwen2.5-0.5b --rows 2 --heads chunked,compiled --ckpt on
    .venv/bin/python bench/real_shapes.py --lora 32 --layers 2 --response 1024 --models qwen3-1.7b --rows 1,2 \
        --losses troll --heads chunked --ckpt on                # LoRA, the model cut to 2 layers
        (troll/models/memory.py)

Models (published configs, `MODELS` from troll.models.standin, which lists them all; random weights, float32 on CPU;
Qwen's vocabulary 151,936 = the output layer, tokenizer 151,665 / 151,669 ids, the rest masked as in training):
    qwen2.5-0.5b  24 layers, hidden 896,  14 heads / 2 KV heads (head_dim 64),  MLP 4,864,  qkv bias   0.49B
    qwen3-0.6b    28 layers, hidden 1024, 16 heads / 8 KV heads (head_dim 128), MLP 3,072,  q/k RMSNorm 0.60B
    qwen2.5-1.5b  28 layers, hidden 1536, 12 heads / 2 KV heads (head_dim 128), MLP 8,960,  qkv bias   1.54B
    qwen3-1.7b, qwen3-4b, qwen3-8b, llama3.1-8b   the papers' models (troll.models.standin), for the LoRA variant
`--layers n` cuts a model to its first n layers at the full width (a 4B or 8B model does not fit 24 GB of RAM in
float32): troll/models/memory.py extrapolates per layer. `--lora r` trains rank-r PEFT adapters on all-linear
(`troll.lora.add_adapters`, alpha 32) on the frozen base instead of every weight: the optimiser and "fixed" then
hold the adapters only. `--response 1024` (the presets' completion limit) fills the chunked head's 1,024 rows at
one row, so its [chunk, V] buffers are the same at every row count and the fit's slope is activations only.
A GPU run holds float32 weights too (policy.build_model) and computes under bf16 autocast; here everything is
float32, so activations and logits are counted at 4 bytes (troll/models/memory.py derives the GPU figure and says
which terms scale).

Batch (GSM8K-shaped, fabricated, `make_batch`): `--rows` rows, each laid out as `policy.pack` does: a
left-padded prompt of P = 250 columns (row 0 has 250 real tokens, the others 150-250) and a right-padded
completion of T = `--response` columns (row 0 fills it, the others half to all of it). Default T = 262, so a
row is 512 tokens: typical GSM8K chain-of-thought answers are 150-300 tokens (the presets allow up to 1,024),
and 1-2 rows keep one variant near a minute on 2 cores. Memory is fitted per token by varying the number of
rows at a fixed row width (1 and 2 rows: 512 and 1,024 tokens), so attention's per-row cost stays the same.
Token ids are uniform in the tokenizer's range; advantages alternate +1 / -1.

Each variant runs in its own process (this script with `--child`), so its peaks are its own. Phases:
    fixed   build the model + AdamW states (allocated as zeros; for qwen2.5-1.5b they would not fit next to
            the rest in 24 GB RAM, so they are counted, 2 x params x 4 bytes, and the step is skipped);
            reported: resident memory after it (VmRSS) and the build time.
    old     the old-policy pass: no-grad forward + `sparsify` (K = 64, delta = 1e-5), at `--old_temperature`
            (default 0.3: the old policy differs from the current one, as in every minibatch after the first;
            on the near-uniform random model 0.3 makes TROLL project every token, ~5 solver iterations each:
            its most expensive case. The fraction projected / clipped is printed, column "proj").
    update  forward, loss (`troll_loss` with the default rest model / `ppo_clip`), backward, grad-clip, AdamW;
            also its peak up to the loss ("fwd": weights + saved activations, before any gradient exists).
Peak of a phase = VmHWM after the phase, reset before it (/proc/self/clear_refs 5); glibc is told to mmap
every allocation >= 1 MB (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the resident set at once. Times are
wall clock with OMP_WAIT_POLICY=PASSIVE, one repetition (the old pass warms the kernels the update uses).

`--heads compiled`: the chunked head with its pass through torch.compile (`--compile_head`, troll.head), both
functions compiled on a 3-row head first (not timed), beside `chunked` as "compiled/chunked" (update and old pass).

Ratios printed: TROLL / clip, compiled / chunked and chunked / unchunked, of the update's peak (absolute, and its
excess over the fixed cost) and of its time. SUMMARY checks the project's targets at the Qwen2.5-0.5B shape with
checkpointing on (the presets'): TROLL's chunked update peak < PPO-clip's unchunked and <= 1.02x PPO-clip's chunked;
TROLL / clip time <= 1.05x (both chunked); chunked / unchunked time <= 1.10x (same micro-batch, both losses).
The "fit" section prints the per-token coefficients (peaks over fixed vs tokens) that troll/models/memory.py holds.

`--json FILE` also writes the raw results there, replacing a file of that name as a tool's `-o` does, whole (a
temporary file beside it, renamed over it: troll.base.outputs); a folder or a symbolic link there is refused before the
first variant runs, the link left as it is and never written through.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import subprocess
import sys
import time
from itertools import product
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if not __package__:  # run as a file (python bench/x.py): the repository root on the path, for `bench` and its troll
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._util import comma_list, int_at_least, positive_float  # noqa: E402
from troll.base import outputs  # noqa: E402
from troll.base.cli import Parser, run_command
from troll.head import LMHead, gather_logprobs  # noqa: E402
from troll.lora import add_adapters  # noqa: E402
from troll.losses import ppo_clip, troll_loss  # noqa: E402
from troll.models.standin import ARCHS, build  # noqa: E402
from troll.policy import packed_logits  # noqa: E402
from troll.run.diagnostics import proc_status_bytes, reset_peak_rss  # noqa: E402
from troll.sparse import sparsify  # noqa: E402

PROG = "python bench/real_shapes.py"  # the name in each of its lines, argparse's own and run_command's

MODELS = {name: arch for name, arch in ARCHS.items() if name != "tiny"}  # the published shapes (troll.models.standin)
LORA_ALPHA = 32.0  # the adapters' scale; B = 0 at the start, so it changes no memory
COUNT_ADAM = {"qwen2.5-1.5b"}  # AdamW states counted, not allocated (module docstring)
LOSSES = {"troll": troll_loss, "clip": ppo_clip}
HEADS = ("chunked", "full", "compiled")  # the output layer: LMHead, whole logits, LMHead through torch.compile
KWARGS = {"troll": dict(eps=0.05, alpha=1.0), "clip": dict(eps_low=0.2, eps_high=0.2)}
PROMPT = 250
GB = 1e9


def make_batch(rows: int, response: int, vocab: int, seed: int = 0):
    """ids, attn [B, P+T]; completion ids, mask [B, T]; adv [B] (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    plen = [PROMPT] + torch.randint(150, PROMPT + 1, (rows - 1,), generator=g).tolist()
    rlen = [response] + torch.randint(response // 2, response + 1, (rows - 1,), generator=g).tolist()
    ids = torch.zeros(rows, PROMPT + response, dtype=torch.long)
    attn = torch.zeros_like(ids, dtype=torch.bool)
    mask = torch.zeros(rows, response, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(plen, rlen, strict=True)):
        ids[b, PROMPT - p : PROMPT + r] = torch.randint(0, vocab, (p + r,), generator=g)
        attn[b, PROMPT - p :] = True
        mask[b, :r] = True
    adv = torch.tensor([1.0 if b % 2 == 0 else -1.0 for b in range(rows)])
    return ids, attn, ids[:, PROMPT:], mask, adv


def policy(model, ids, attn, T: int, chunk: int, temperature: float, vocab: int, compiled: bool = False):
    """Current policy at the completion positions, as the trainer computes it (`policy.packed_logits`): full
    logits [B, T, V] (chunk 0), or an LMHead over the hidden states [B, T, H] in `chunk`-row chunks (the presets'
    1,024 rows), its pass through torch.compile when `compiled` (troll.head)."""
    x = packed_logits(model, ids, attn, T, temperature, vocab, chunk_rows=chunk)
    return dataclasses.replace(x, compiled=True) if compiled else x


def warm_compiled(model, vocab: int, rows_out: int) -> None:
    """Compile the chunked head's two functions (dynamic shapes) on 3 rows of the model's output layer."""
    weight = model.get_output_embeddings().weight
    hidden = torch.randn(3, weight.shape[1], requires_grad=True)
    head = LMHead(hidden, weight.detach(), None, 1.0, vocab, chunk_rows=3, compiled=True)
    logp, log_rest, _ = gather_logprobs(head, torch.zeros(3, 2, dtype=torch.long), torch.ones(3, 2, dtype=torch.bool))
    (logp.sum() + log_rest.sum()).backward()


def _status(key: str) -> float:
    return proc_status_bytes(key) / GB


def _reset_peak() -> None:
    gc.collect()
    reset_peak_rss()


def child(spec: dict) -> dict:
    """One variant in this process: returns GB and seconds per phase."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build(spec["model"], layers=spec.get("layers") or None)
    base_params = sum(p.numel() for p in model.parameters())
    if spec["ckpt"]:
        model.gradient_checkpointing_enable()
    if spec.get("lora"):  # PEFT adapters on the frozen base (troll.lora), as policy.adapt adds them
        model = add_adapters(model, spec["lora"], LORA_ALPHA, "all-linear")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-6)
    count_adam = spec["model"] in COUNT_ADAM and not spec.get("lora")
    if not count_adam:
        for p in params:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }
    vocab, rows_out = MODELS[spec["model"]]["tok"], MODELS[spec["model"]]["vocab"]
    ids, attn, comp, mask, adv = make_batch(spec["rows"], spec["response"], vocab)
    T = comp.shape[1]
    gc.collect()
    adam = 8 * n_params / GB if count_adam else 0.0
    out = dict(spec, params=n_params, base_params=base_params, fixed=_status("VmRSS") + adam,
               t_fixed=time.perf_counter() - t0)  # fmt: skip
    chunk = spec.get("chunk", 1024) if spec["head"] in ("chunked", "compiled") else 0
    if spec["head"] == "compiled":  # compile both chunk functions on a small head first: no compile time timed
        warm_compiled(model, vocab, rows_out)

    _reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        x = policy(model, ids, attn, T, chunk, spec["old_temperature"], vocab, spec["head"] == "compiled")
        old = sparsify(x.reshape(-1, rows_out), comp.reshape(-1), k=64, delta=1e-5)
    del x
    out |= dict(old=_status("VmHWM") + adam, t_old=time.perf_counter() - t0)

    _reset_peak()
    t0 = time.perf_counter()
    x = policy(model, ids, attn, T, chunk, 1.0, vocab, spec["head"] == "compiled")
    loss, metrics = LOSSES[spec["loss"]](x, comp, mask, adv, old, agg="token-mean", norm_len=T, **KWARGS[spec["loss"]])
    out |= dict(fwd=_status("VmHWM") + adam)  # the update's peak up to the loss: weights + saved activations
    loss.backward()
    del x, loss
    t1 = time.perf_counter()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    if not count_adam:
        opt.step()
    opt.zero_grad(set_to_none=True)
    out |= dict(update=_status("VmHWM") + adam, t_fwd_bwd=t1 - t0, t_update=time.perf_counter() - t0)
    return out | dict(tokens=ids.numel(), completion=comp.numel(), frac_active=metrics["frac_active"])


def run_child(spec: dict) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20), OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, __file__, "--child", json.dumps(spec)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        return dict(spec, error=(res.stderr.strip().splitlines() or ["?"])[-1])
    return json.loads(res.stdout.strip().splitlines()[-1])


def plan(args) -> list[dict]:
    """The variants to run: (model, loss, head, ckpt, rows)."""
    base = dict(response=args.response, old_temperature=args.old_temperature, lora=args.lora, layers=args.layers,
                chunk=args.chunk)  # fmt: skip
    grid = []
    if args.plan == "quick":
        grid = list(product(["qwen2.5-0.5b"], ["troll", "clip"], ["chunked", "full"], [True], [1]))
    elif args.plan == "full":
        grid = list(product(MODELS, LOSSES, ["chunked", "full"], [True, False], [1, 2]))
    elif args.plan == "default":
        small = "qwen2.5-0.5b"
        grid = list(product([small], LOSSES, ["chunked", "full"], [True, False], [2]))  # every comparison
        grid += list(product([small], ["troll"], ["chunked"], [True, False], [1]))  # the fit's 2nd point
        grid += [(small, "troll", "full", True, 1)] + list(
            product([small], ["troll"], ["chunked", "full"], [True], [4])
        )
        grid += list(product(["qwen3-0.6b", "qwen2.5-1.5b"], ["troll"], ["chunked"], [True, False], [1, 2]))
    if args.models or args.losses or args.heads or args.ckpt or args.rows:  # an explicit grid
        pick = lambda s, d: s.split(",") if s else d  # noqa: E731
        ckpt = [c == "on" for c in pick(args.ckpt, ["on", "off"])]
        rows = [int(r) for r in pick(args.rows, ["2"])]
        grid = list(product(pick(args.models, list(MODELS)), pick(args.losses, list(LOSSES)),
                            pick(args.heads, ["chunked", "full"]), ckpt, rows))  # fmt: skip
    return [dict(base, model=m, loss=lo, head=h, ckpt=c, rows=r) for m, lo, h, c, r in grid]


def _name(r: dict) -> str:
    """The model as measured: "qwen3-8b/L2+lora32" is Qwen3-8B cut to 2 layers, rank-32 adapters."""
    return r["model"] + (f"/L{r['layers']}" if r.get("layers") else "") + (f"+lora{r['lora']}" if r.get("lora") else "")


def _key(r: dict, **change) -> tuple:
    r = r | change
    return (_name(r), r["loss"], r["head"], r["ckpt"], r["rows"])


def report(results: list[dict]) -> None:
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"FAILED {_key(r)}: {r['error']}")
    print(f"\n{'model':13} {'loss':5} {'head':7} {'ckpt':4} {'tokens':>6} | {'fixed':>6} {'old':>6} {'update':>6}"
          f" {'upd-fix':>7} {'fwd':>6} GB | {'build':>5} {'old':>6} {'fwd+bwd':>7} {'update':>6} s | proj")  # fmt: skip
    for r in ok:
        print(f"{_name(r):13} {r['loss']:5} {r['head']:7} {'on' if r['ckpt'] else 'off':4} {r['tokens']:6d} | "
              f"{r['fixed']:6.2f} {r['old']:6.2f} {r['update']:6.2f} {r['update'] - r['fixed']:7.2f} "
              f"{r.get('fwd', float('nan')):6.2f}    | "
              f"{r['t_fixed']:5.1f} {r['t_old']:6.1f} {r['t_fwd_bwd']:7.1f} {r['t_update']:6.1f}   | "
              f"{r['frac_active']:.3f}")  # fmt: skip
    by = {_key(r): r for r in ok}
    print("\nratios (update phase): peak = absolute peak, excess = peak - fixed, time = fwd+bwd+step")
    for r in ok:
        if r["loss"] == "troll" and (c := by.get(_key(r, loss="clip"))):
            print(f"  TROLL/clip        {_key(r)[2:]} {r['model']:13}: peak {r['update'] / c['update']:.3f}  "
                  f"excess {(r['update'] - r['fixed']) / (c['update'] - c['fixed']):.3f}  "
                  f"time {r['t_update'] / c['t_update']:.3f}")  # fmt: skip
    for r in ok:
        if r["head"] == "compiled" and (c := by.get(_key(r, head="chunked"))):
            print(f"  compiled/chunked  {r['loss']:5} ckpt={'on ' if r['ckpt'] else 'off'} rows={r['rows']} "
                  f"{r['model']:13}: peak {r['update'] / c['update']:.3f}  time {r['t_update'] / c['t_update']:.3f}  "
                  f"old pass {r['t_old'] / c['t_old']:.3f}")  # fmt: skip
    for r in ok:
        if r["head"] == "chunked" and (f := by.get(_key(r, head="full"))):
            print(f"  chunked/unchunked {r['loss']:5} ckpt={'on ' if r['ckpt'] else 'off'} rows={r['rows']} "
                  f"{r['model']:13}: peak {r['update'] / f['update']:.3f}  "
                  f"excess {(r['update'] - r['fixed']) / (f['update'] - f['fixed']):.3f}  "
                  f"time {r['t_update'] / f['t_update']:.3f}")  # fmt: skip
    fit(ok)
    summary(by)


def fit(ok: list[dict]) -> None:
    """Update peak over fixed cost = intercept + slope x tokens, per (model, head, ckpt), from two row counts."""
    print("\nfit: peak - fixed = intercept + slope x tokens (TROLL; bytes per padded token), of the update's peak")
    print('  (end of backward: grads + [V, H] buffers; hides the activations) and of its forward ("fwd": activations)')
    groups: dict[tuple, list[dict]] = {}
    for r in ok:
        if r["loss"] == "troll":
            groups.setdefault((_name(r), r["head"], r["ckpt"]), []).append(r)
    for (m, h, c), rs in sorted(groups.items()):
        pts = sorted({r["tokens"]: r for r in rs}.values(), key=lambda r: r["tokens"])
        if len(pts) < 2:
            continue
        a, b = pts[0], pts[-1]
        comp = b["completion"] / b["tokens"]
        for phase in ("update", "fwd"):
            if phase not in a or phase not in b:
                continue
            slope = ((b[phase] - b["fixed"]) - (a[phase] - a["fixed"])) * GB / (b["tokens"] - a["tokens"])
            icpt = (a[phase] - a["fixed"]) * GB - slope * a["tokens"]
            print(f"  {m:13} {h:7} ckpt={'on ' if c else 'off'} {phase:6}: slope {slope / 1e3:8.1f} kB/token  "
                  f"intercept {icpt / GB:5.2f} GB  (params {a['params'] / 1e9:.3f}B, fixed {a['fixed']:.2f} GB, "
                  f"completion share {comp:.3f}, tokens {a['tokens']}..{b['tokens']})")  # fmt: skip


def summary(by: dict) -> None:
    m = "qwen2.5-0.5b"
    heads = ("chunked", "full")
    rows = next((n for n in (2, 1, 4) if all((m, lo, h, True, n) in by for lo in LOSSES for h in heads)), None)
    if rows is None:
        print("\nSUMMARY: targets need qwen2.5-0.5b, ckpt on, troll+clip x chunked+full at one row count")
        return
    tc, cc, tf, cf = (by[(m, lo, h, True, rows)] for lo, h in
                      (("troll", "chunked"), ("clip", "chunked"), ("troll", "full"), ("clip", "full")))  # fmt: skip
    checks = [
        (f"TROLL chunked peak {tc['update']:.2f} GB < clip unchunked {cf['update']:.2f} GB",
         tc["update"] < cf["update"]),
        (f"TROLL/clip chunked peak {tc['update'] / cc['update']:.3f} <= 1.02 (excess "
         f"{(tc['update'] - tc['fixed']) / (cc['update'] - cc['fixed']):.3f})", tc["update"] <= 1.02 * cc["update"]),
        (f"TROLL/clip chunked time {tc['t_update'] / cc['t_update']:.3f} <= 1.05",
         tc["t_update"] <= 1.05 * cc["t_update"]),
        (f"chunked/unchunked time troll {tc['t_update'] / tf['t_update']:.3f}, clip "
         f"{cc['t_update'] / cf['t_update']:.3f} <= 1.10",
         tc["t_update"] <= 1.10 * tf["t_update"] and cc["t_update"] <= 1.10 * cf["t_update"]),
    ]  # fmt: skip
    print(f"\nSUMMARY (qwen2.5-0.5b, ckpt on, {tc['tokens']} tokens): "
          + "; ".join(f"{s} [{'met' if ok else 'NOT met'}]" for s, ok in checks))  # fmt: skip


def main() -> None:
    ap = Parser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--plan", default="default", choices=["quick", "default", "full"])
    ap.add_argument("--models", type=comma_list(MODELS), help="comma list of " + ",".join(MODELS))
    ap.add_argument("--losses", type=comma_list(LOSSES), help="comma list of troll,clip")
    ap.add_argument("--heads", type=comma_list(HEADS), help="comma list of " + ",".join(HEADS))
    ap.add_argument("--ckpt", type=comma_list(["on", "off"]), help="comma list of on,off")
    ap.add_argument("--rows", help="comma list of row counts (default 2)")
    ap.add_argument("--response", type=int_at_least(1), default=262, help="completion columns T (row = 250 + T tokens)")
    ap.add_argument("--old_temperature", type=positive_float, default=0.3)
    ap.add_argument("--lora", type=int_at_least(0), default=0, help="rank-r adapters on all-linear (0: full FT)")
    ap.add_argument("--layers", type=int_at_least(0), default=0, help="cut the model to this many layers (0: all)")
    ap.add_argument("--chunk", type=int_at_least(1), default=1024, help="the chunked head's rows")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args()
    if args.rows and not all(r.isdigit() and int(r) >= 1 for r in args.rows.split(",")):
        ap.error(f"--rows {args.rows!r}: expected a comma list of row counts >= 1, e.g. 1,2")
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    results_file = outputs.named(Path(args.json), "--json") if args.json else None
    if results_file is not None:  # before the first variant runs: a folder or a link there is refused
        outputs.check([results_file])
        if not results_file.path.parent.is_dir():
            ap.error(f"--json {args.json}: its folder does not exist")
    results = []
    for spec in plan(args):
        t0 = time.perf_counter()
        results.append(run_child(spec))
        print(f"ran {_key(spec)} in {time.perf_counter() - t0:.0f} s", flush=True)
    if results_file is not None:
        outputs.write(results_file, json.dumps(results, indent=1) + "\n")
    report(results)


if __name__ == "__main__":  # Ctrl-C: one line, then SIGINT
    run_command(PROG, main)
