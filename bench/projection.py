"""Cost of the sparse TROLL projection next to PPO-clip at LLM scale: time and peak memory of one loss + backward.

    .venv/bin/python bench/projection.py                      # N = 4096 tokens, V = 151,936 (Qwen), float32, cpu
    .venv/bin/python bench/projection.py --device cuda --dtype bfloat16 --n 16384

What one call of each variant does (logits [N, V] with requires_grad, old logits [N, V] a constant, sampled
tokens y [N], advantages A [N]); both include every pass over the full vocabulary:
  troll: sparsify the old policy (no grad) and the current one (with grad), `project_sparse` (eps 0.05), loss
         mean(-A * exp(log pi*(y) - log q(y))) + mean(KL(p || stopgrad(pi*))) on the union support, backward;
  clip:  old log-prob of y (logsumexp + gather, no grad), log-softmax of the logits over V, gather y, ratio,
         mean(-min(r A, clip(r, 0.8, 1.2) A)), backward.
Inputs in bf16/fp16 are upcast to float32 in both variants (sparsify does it; clip calls .float()).
The time is also split into the no-grad pass over the old logits and the update (forward + backward).

Data: peaked synthetic logits. Each row has N(0, 1) logits plus 5-10 "head" tokens at 25 + N(0, 1.5^2), so the
head holds all but ~1e-6 of the mass and the sparse support keeps exactly those 5-10 tokens. The old logits add
N(0, 0.1^2) everywhere and a per-row perturbation of the head logits, sized so that about a third of the tokens
have KL(p || q) > eps. The sampled token is drawn from the old policy's head.

Timing: a warm-up call of each on 256 rows, then `--repeats` full rounds that alternate the order (clip, troll /
troll, clip) so that the load of other processes hits both alike; medians (and the minimum wall time, the
steadiest estimate on a busy machine) are reported (cuda: synchronised).
Besides wall time, the host CPU time of the process (getrusage: user and sys) is printed: on a shared machine
user time is the steadier measure of the work done. Sys time is the kernel handing out fresh pages: glibc returns
every large freed block to the OS, so each new [N, V] buffer is page-faulted again (~1 s per 2.5 GB with 4 KB
pages; a GPU's caching allocator has no such cost). This script therefore sets torch's THP_MEM_ALLOC_ENABLE=1
(2 MB transparent huge pages for large CPU tensors, several times cheaper to fault in) unless the environment
sets it; THP_MEM_ALLOC_ENABLE=0 measures with 4 KB pages.

Peak memory, per call: the highest memory in use during the call minus what was in use right before it
(the logits, old logits, tokens, advantages). The call's gradient of the logits (N V elements) is part of it.
  cuda: torch.cuda.reset_peak_memory_stats / memory_allocated / max_memory_allocated (tensor memory).
  cpu:  torch has no CPU allocator statistics, so this uses the process resident set (RSS): the kernel's
        high-water mark is reset before the call (echo 5 > /proc/self/clear_refs, Linux >= 4.0) and VmHWM is read
        after it, minus VmRSS before it. That is `ru_maxrss` of a fresh process, without re-creating 5 GB of
        logits per call. It is exact for the big tensors: glibc serves allocations above 32 MB with mmap and
        unmaps them when freed, so nothing large hides in the heap between calls, and a call's pages are
        resident once written (no swap on this machine). Small allocations can stay in the heap: a few MB.
Three memory figures: extra (peak minus before); extra beyond the logits' gradient (extra - N V * itemsize);
absolute (before + extra: the inputs, the gradient and all temporaries; on cpu also the ~0.3 GB Python + torch
runtime). "What both need anyway" is the inputs plus the gradient, so "beyond grad" is the pure overhead of
each method and "absolute" the whole footprint; the SUMMARY shows both, absolute first.

Also printed: the dual solver's iterations (mean, max over projected tokens), the fraction projected, the mean
kept-support sizes, and the largest |KL(pi* || q) - eps| on projected tokens, both as the solver reports it and
recomputed in float64 from the returned (float32) projection. The last line is a one-line SUMMARY.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import statistics
import time

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read at torch's first CPU allocation (module docstring)

import torch  # noqa: E402

from troll.project import Projection, project_sparse  # noqa: E402
from troll.sparse import kl, sparsify  # noqa: E402

EPS, CLIP, K, DELTA = 0.05, 0.2, 64, 1e-5
GB = 1e9


def make_batch(n: int, v: int, dtype: torch.dtype, device: str, seed: int = 0, head_peak: float = 25.0):
    """Peaked logits, perturbed old logits, sampled tokens and advantages (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    h = 10  # head slots; each row uses 5-10 of them, at distinct ids (increasing offsets that sum to < v)
    used = torch.arange(h) < torch.randint(5, h + 1, (n, 1), generator=g)
    idx = (torch.randint(v, (n, 1), generator=g) + torch.randint(1, v // h, (n, h), generator=g).cumsum(1)) % v
    head = head_peak + 1.5 * torch.randn(n, h, generator=g)
    shift = 0.45 * torch.randn(n, 1, generator=g).abs() * torch.randn(n, h, generator=g)
    logits = torch.empty(n, v, dtype=dtype, device=device)
    old = torch.empty_like(logits)
    torch.manual_seed(seed)
    logits.normal_()
    old.normal_(std=0.1).add_(logits)
    idx_d, used_d = idx.to(device), used.to(device)
    for x, hv in ((logits, head), (old, head + shift)):  # unused slots keep the value already there
        x.scatter_(1, idx_d, torch.where(used_d, hv.to(device, dtype), x.gather(1, idx_d)))
    pick = torch.multinomial((head + shift).masked_fill(~used, -math.inf).softmax(-1), 1, generator=g)
    tokens = idx.gather(1, pick)[:, 0].to(device)
    adv = torch.randn(n, generator=g).to(device)
    return logits.requires_grad_(), old, tokens, adv


def troll_loss(logits, old_logits, tokens, adv, marks):
    with torch.no_grad():
        old = sparsify(old_logits, tokens, K, DELTA)
    marks.append(time.perf_counter())
    new = sparsify(logits, tokens, K, DELTA)
    proj = project_sparse(new, old, EPS)
    log_pi, _, log_q = proj.at(tokens)
    s = proj.support
    reg = kl(s.lp, proj.logp.detach(), s.mask, s.lp_tail, proj.tail_logp.detach(), s.tail_count)
    loss = (-adv * torch.exp(log_pi - log_q)).mean() + reg.mean()
    loss.backward()
    return proj, new.size.double().mean().item(), old.size.double().mean().item()


def clip_loss(logits, old_logits, tokens, adv, marks):
    with torch.no_grad():
        x = old_logits.float()
        old_logp = x.gather(1, tokens[:, None])[:, 0] - x.logsumexp(-1)
        del x
    marks.append(time.perf_counter())
    logp = logits.float().log_softmax(-1).gather(1, tokens[:, None])[:, 0]
    ratio = torch.exp(logp - old_logp)
    loss = -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()
    loss.backward()


def _proc(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def measure(fn, args, device: str) -> dict:
    """Run fn(*args, marks) once; seconds (wall, old pass, host cpu user/sys), peak extra and before bytes, out."""
    args[0].grad = None
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc("VmRSS")
    ru = resource.getrusage(resource.RUSAGE_SELF)
    marks = [time.perf_counter()]
    out = fn(*args, marks)
    if cuda:
        torch.cuda.synchronize()
    marks.append(time.perf_counter())
    peak = torch.cuda.max_memory_allocated() if cuda else _proc("VmHWM")
    ru2 = resource.getrusage(resource.RUSAGE_SELF)
    args[0].grad = None
    return dict(
        wall=marks[2] - marks[0],
        old=marks[1] - marks[0],
        user=ru2.ru_utime - ru.ru_utime,
        sys=ru2.ru_stime - ru.ru_stime,
        extra=peak - before,
        before=before,
        out=out,
    )


def troll_report(proj: Projection) -> dict[str, float]:
    """Solver statistics plus the constraint residual recomputed in float64 from the projection's values."""
    st = proj.stats()
    s, act = proj.support, proj.dual.active
    lp, tail = proj.logp.detach().double(), proj.tail_logp.detach().double()
    kl_out = kl(lp, s.lq.double(), s.mask, tail, s.lq_tail.double(), s.tail_count)
    st["residual_recomputed"] = float((kl_out - EPS).abs()[act].max()) if bool(act.any()) else 0.0
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096, help="tokens")
    ap.add_argument("--v", type=int, default=151_936, help="vocabulary size")
    ap.add_argument("--repeats", type=int, default=3, help="measured rounds (after a small warm-up)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.device == "cpu" and not os.access("/proc/self/clear_refs", os.W_OK):
        raise SystemExit("cpu peak memory needs a writable /proc/self/clear_refs (Linux)")

    t0 = time.perf_counter()
    args = make_batch(a.n, a.v, getattr(torch, a.dtype), a.device, a.seed)
    grad_bytes = args[0].numel() * args[0].element_size()
    print(
        f"N={a.n} V={a.v} dtype={a.dtype} device={a.device} threads={torch.get_num_threads()} repeats={a.repeats} "
        f"THP={os.environ['THP_MEM_ALLOC_ENABLE']}; logits {grad_bytes / GB:.2f} GB each, "
        f"data made in {time.perf_counter() - t0:.1f} s"
    )
    variants = {"clip": clip_loss, "troll": troll_loss}
    few = min(a.n, 256)  # warm-up (thread pool, lazy initialisation, kernels) on a few rows: cheap
    warm = (args[0].detach()[:few].clone().requires_grad_(), *(x[:few] for x in args[1:]))
    for fn in variants.values():
        measure(fn, warm, a.device)
    del warm
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(a.repeats):
        for name in list(variants)[:: -1 if r % 2 else 1]:
            m = measure(variants[name], args, a.device)
            print(
                f"  round {r + 1}: {name:5s} {m['wall']:6.2f} s wall, cpu user {m['user']:6.2f} s sys "
                f"{m['sys']:6.2f} s, peak extra {m['extra'] / GB:5.2f} GB"
            )
            out = m.pop("out")
            if name == "troll":
                proj, new_size, old_size = out
                st = troll_report(proj)
            del out
            runs[name].append(m)

    med = {}
    print(
        f"\nmedians  {'wall s':>7s} {'(min)':>6s} {'old pass':>8s} {'update':>7s} {'cpu user':>8s} {'sys':>6s} | "
        f"{'extra GB':>8s} {'beyond grad':>11s} {'absolute':>8s}"
    )
    for name, ms in runs.items():
        md = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
        md["update"] = statistics.median(m["wall"] - m["old"] for m in ms)
        md["cpu"] = statistics.median(m["user"] + m["sys"] for m in ms)
        md["min"] = min(m["wall"] for m in ms)
        md["beyond"], md["absolute"] = md["extra"] - grad_bytes, md["before"] + md["extra"]
        med[name] = md
        print(
            f"{name:8s} {md['wall']:7.2f} {md['min']:6.2f} {md['old']:8.2f} {md['update']:7.2f} {md['user']:8.2f} "
            f"{md['sys']:6.2f} | {md['extra'] / GB:8.2f} {md['beyond'] / GB:11.2f} {md['absolute'] / GB:8.2f}"
        )
    x = {k: med["troll"][k] / med["clip"][k] if med["clip"][k] else math.nan for k in med["troll"]}
    print(
        f"troll/clip: time {x['wall']:.2f}x (min {x['min']:.2f}x, update only {x['update']:.2f}x; host cpu time "
        f"{x['cpu']:.2f}x, user {x['user']:.2f}x); peak memory absolute {x['absolute']:.2f}x, extra {x['extra']:.2f}x, "
        f"beyond the logits' gradient {x['beyond']:.2f}x"
    )
    print(
        f"projection: {st['frac_projected']:.1%} of tokens projected, solver iterations mean {st['iters_mean']:.2f} "
        f"max {st['iters_max']:.0f}, unconverged {st['frac_unconverged']:.1%}; kept support mean new {new_size:.2f} "
        f"old {old_size:.2f} union {st['support_size_mean']:.2f}; KL(p||q) mean {st['kl_before_mean']:.3f} "
        f"max {st['kl_before_max']:.2f}"
    )
    print(
        f"residual |KL(pi*||q) - eps| on projected tokens: max {st['residual_max']:.1e} (solver, float64), "
        f"{st['residual_recomputed']:.1e} (recomputed in float64 from the returned projection)"
    )
    print(
        f"SUMMARY projection: time {x['wall']:.2f}x clip (min {x['min']:.2f}x, cpu user {x['user']:.2f}x), peak memory "
        f"{x['absolute']:.2f}x clip (beyond logits+grad {x['beyond']:.2f}x), iters mean {st['iters_mean']:.1f} "
        f"max {st['iters_max']:.0f}, residual {max(st['residual_max'], st['residual_recomputed']):.1e}"
    )


if __name__ == "__main__":
    main()
