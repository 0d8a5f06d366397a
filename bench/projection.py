"""Cost of the TROLL loss next to PPO-clip at LLM scale: time and peak memory of one loss + backward.

    .venv/bin/python bench/projection.py                      # N = 4096 tokens, V = 151,936 (Qwen), float32, cpu
    .venv/bin/python bench/projection.py --paper              # also the paper's sparse model (4th variant)
    .venv/bin/python bench/projection.py --device cuda --dtype bfloat16 --n 16384
    .venv/bin/python bench/projection.py --logits smollm2     # a real model's logits: N = 2048, V = 49,152
    .venv/bin/python bench/projection.py --head 72 --profile  # supports at the cap K = 64; then where the time goes

What one call of each variant does (logits [N, V] with requires_grad, old logits [N, V] a constant, sampled
tokens y [N], advantages A [N]); every pass over the full vocabulary is included:
  troll:       the old-policy pass as the trainer runs it, `sparsify(old_logits, y, K, DELTA)` under no_grad;
               then `troll.losses.troll_loss` (rest model, the default: p gathered at q's kept set plus one exact
               rest atom, `project_sparse` with eps 0.05, loss mean(-A * exp(log pi*(y) - log q(y))) +
               mean(KL(p || stopgrad(pi*))) over the atoms), and backward;
  troll-paper: (with --paper) the same with support="paper": p's own top-K support (K, DELTA) and the union;
  clip:        the same old-policy pass, then `troll.losses.ppo_clip` (clip 0.2): p(y) comes from the same
               gather op as troll's (`head.gather_logprobs` via `build_support`, no [N, V] log-softmax kept for
               backward), and backward;
  naive:       old log-prob of y (logsumexp + gather, no grad), `log_softmax` of the logits over V (kept for
               backward), gather y, ratio, mean(-min(r A, clip(r, 0.8, 1.2) A)), backward.
The losses get the logits viewed as [N, 1, V] (N responses of one token, tokens/mask [N, 1], adv [N]), so
token-mean aggregation is the plain mean over the N tokens. Inputs in bf16/fp16 are computed in float32 in
every variant (the troll package does it; naive calls .float()). The time is also split into the no-grad pass
over the old logits and the update (forward + backward). troll vs clip isolates the trust region (both share the
old-policy pass and the gather); troll vs naive is against the textbook PPO-clip implementation.

Data: peaked synthetic logits. Each row has N(0, 1) logits plus 5-10 "head" tokens at 25 + N(0, 1.5^2), so the
head holds all but ~1e-6 of the mass and the old policy's sparse support keeps exactly those 5-10 tokens. The
old logits add N(0, 0.1^2) everywhere and a per-row perturbation of the head logits, sized so that about a
third of the tokens have KL(p || q) > eps. The sampled token is drawn from the old policy's head. Both policies
keep the same head, so the two sparse models see the same tokens here (same projection up to rounding): troll vs
troll-paper compares their cost only (notebooks/02_sparse_supports.ipynb compares their accuracy). `--head H`
puts H head tokens in every row instead: with H = 72 the cap K = 64 binds on every row and the rest atom holds
about 0.3% of the mass (a real model's text: the cap binds on 96% of rows, rest median 0.5%), so the supports are
of a real model's size.

Profile (`--profile`): after the timed rounds, torch.profiler over one troll call and one naive call (old pass,
loss, backward), printed as a table of the ops with the most time (on the GPU with CUDA, else on the host), with
their calls and input shapes: which passes over [N, V] the time goes to.

Real logits (`--logits smollm2`, or `--logits <model folder>`): the same variants, timing and figures on a real
model's distributions, made by `bench.real_logits.real_pair` (its docstring has the details). q is
SmolLM2-135M-Instruct's teacher-forced logits at the first N positions of the chat-formatted GSM8K gold solutions
of the first test problems of `--data` (the committed 100-problem sample by default; where they hold fewer than N
positions, all of them are repeated in order, and the output says so); p is the same model after a real Adam step
(`--lr`, `--update_steps`) of every weight (`--update all`, the default) or of its output layer only (`--update
head`, one forward of the model less) on a policy-gradient loss with one N(0, 1) advantage per problem, which is
also each row's advantage here; y is the gold token. V is then the model's vocabulary, 49,152 (not Qwen's
151,936: the output says so), and N defaults to 2,048 (4,096 synthetic). Unlike the synthetic head, a real
distribution's mass 1 - 1e-5 needs thousands of tokens, so the cap K = 64 binds on almost every row (96%): the
old support holds about 62 tokens and a rest atom of real mass (median 0.5%), and the two sparse models see
different tokens (troll vs troll-paper then differ in what they project too; bench/real_logits.py measures that
over K and delta). Making the data (the model's passes over the solutions and the update: about 4 minutes on 2
busy cores) is not timed.

Timing: a warm-up call of each on 256 rows, then `--repeats` full rounds; each round runs the variants in turn,
in an order that alternates between rounds (forward, then reversed) so that the load of other processes hits
all alike; medians (and the minimum wall time, the steadiest estimate on a busy machine) are reported (cuda:
synchronised). Besides wall time, the host CPU time of the process (getrusage: user and sys) is printed: on a
shared machine user time is the steadier measure of the work done. Sys time is the kernel handing out fresh
pages: glibc returns every large freed block to the OS, so each new [N, V] buffer is page-faulted again (~1 s
per 2.5 GB with 4 KB pages; a GPU's caching allocator has no such cost). This script therefore sets torch's
THP_MEM_ALLOC_ENABLE=1 (2 MB transparent huge pages for large CPU tensors, several times cheaper to fault in)
unless the environment sets it; THP_MEM_ALLOC_ENABLE=0 measures with 4 KB pages. OMP_WAIT_POLICY=PASSIVE is set
too, as in the other bench scripts (unless the environment sets it): OpenMP threads spinning for a core another
process holds make the real model's passes (`--logits`) several times slower on a busy machine.

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
runtime). "What all need anyway" is the inputs plus the gradient, so "beyond grad" is the pure overhead of
each method and "absolute" the whole footprint; the ratios and the SUMMARY use the absolute peak.

Also printed for troll (and troll-paper): the dual solver's iterations (mean, max over projected tokens), the
fraction projected, the unconverged fraction, the old support's mean size (kept tokens per row) and its rest
atom's mass (median, mean), the mean support size (atoms), the sparse KL(p || q) before and KL(pi* || q) after
(means over all tokens) and the largest |KL(pi* || q) - eps| over the atoms on projected tokens as the solver
reports it. The last line is a one-line SUMMARY with the targets: troll vs clip (same gather) <= 1.10x time and
<= 1.05x peak memory (with real logits, followed by their source and V).
"""

from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # read at torch's first CPU allocation (module docstring)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as every bench script (bench/README.md): no spinning threads
if not __package__:  # run as a file (python bench/x.py): the repository root on the path, for `bench` and its troll
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench._util import int_at_least  # noqa: E402
from bench.real_logits import add_real_flags, real_pair, real_settings  # noqa: E402
from troll.base.cli import Parser, free_memory, gib, run_command  # noqa: E402
from troll.losses import ppo_clip, troll_loss  # noqa: E402
from troll.sparse import sparsify  # noqa: E402

PROG = "python bench/projection.py"  # the name in each of its lines, argparse's own and run_command's

EPS, CLIP, K, DELTA = 0.05, 0.2, 64, 1e-5
TARGET_TIME, TARGET_MEMORY = 1.10, 1.05  # troll / clip (same gather)
GB = 1e9
SYNTHETIC, N_SYNTHETIC, N_REAL, V_QWEN = "synthetic", 4096, 2048, 151_936
LOGIT_BYTES = 20  # peak memory per logit of the batch, float32 on CPU (19.5 measured: --n 3000 over --n 1000, V_QWEN)


def make_batch(
    n: int, v: int, dtype: torch.dtype, device: str, seed: int = 0, head_peak: float = 25.0, head: int | None = None
):
    """Peaked logits, perturbed old logits, sampled tokens and advantages (module docstring); `head` tokens in every
    row's head (None: 5-10)."""
    g = torch.Generator().manual_seed(seed)
    h = head or 10  # head slots; each row uses 5-10 of them (or all), at distinct ids (increasing offsets, sum < v)
    used = torch.arange(h) < (torch.full((n, 1), h) if head else torch.randint(5, h + 1, (n, 1), generator=g))
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


def _package_loss(loss_fn, logits, old_logits, tokens, adv, marks, **kwargs):
    """Old-policy pass (no grad, as train.py's anchor), then a troll.losses loss on [N, 1, V] and backward."""
    with torch.no_grad():
        old = sparsify(old_logits, tokens, K, DELTA)
    marks.append(time.perf_counter())
    n, v = logits.shape
    mask = torch.ones(n, 1, dtype=torch.bool, device=logits.device)
    loss, metrics = loss_fn(logits.view(n, 1, v), tokens.view(n, 1), mask, adv, old, **kwargs)
    loss.backward()
    rest = old.log_rest.double().exp()
    return metrics | {
        "old_size_mean": float(old.size.double().mean()),
        "old_rest_median": float(rest.median()),
        "old_rest_mean": float(rest.mean()),
    }


def troll(logits, old_logits, tokens, adv, marks):
    return _package_loss(troll_loss, logits, old_logits, tokens, adv, marks, eps=EPS)


def troll_paper(logits, old_logits, tokens, adv, marks):
    return _package_loss(troll_loss, logits, old_logits, tokens, adv, marks, eps=EPS, support="paper", k=K, delta=DELTA)


def clip(logits, old_logits, tokens, adv, marks):
    return _package_loss(ppo_clip, logits, old_logits, tokens, adv, marks, eps_low=CLIP, eps_high=CLIP)


def naive_clip(logits, old_logits, tokens, adv, marks):
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


def real_batch(a, dtype: torch.dtype) -> tuple[tuple, int, str, str]:
    """Logits (with requires_grad), old logits, tokens and advantages of a real model (module docstring), its V,
    name, and a line saying what they are."""
    settings = real_settings(a)  # the flags' checks (a UsageError names the flag), before any work
    pair = real_pair(settings, a.n, a.seed, a.device)
    args = (pair.new.to(dtype).requires_grad_(), pair.old.to(dtype), pair.tokens, pair.adv)
    return args, pair.vocab_size, pair.name, pair.describe()


def main(argv: list[str] | None = None) -> dict:
    ap = Parser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument(
        "--logits",
        default=SYNTHETIC,
        help=f"{SYNTHETIC} (default), smollm2 (SmolLM2-135M-Instruct on GSM8K, troll model) or a model folder",
    )
    ap.add_argument("--n", type=int_at_least(1), help=f"tokens (default {N_SYNTHETIC}; {N_REAL} with real logits)")
    ap.add_argument("--v", type=int_at_least(2), help=f"vocabulary size, synthetic logits only (default {V_QWEN})")
    ap.add_argument("--repeats", type=int_at_least(1), default=3, help="measured rounds (after a small warm-up)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int_at_least(0), default=0)
    ap.add_argument("--paper", action="store_true", help="also run troll with the paper's sparse model")
    ap.add_argument("--head", type=int_at_least(1), help="synthetic: tokens in every row's head (default 5-10; 72: "
                    f"the cap K = {K} binds on every row, as on a real model's text)")  # fmt: skip
    ap.add_argument("--profile", action="store_true", help="then torch.profiler of one troll and one naive call")
    add_real_flags(ap)  # --data, --update, --lr, --update_steps: real logits only
    a = ap.parse_args(argv)
    synthetic = a.logits == SYNTHETIC
    for flag in ("--v", "--head", "--data", "--update", "--lr", "--update_steps"):  # each for one kind of logits
        if getattr(a, flag[2:]) is not None and synthetic is (flag not in ("--v", "--head")):
            mine = flag in ("--v", "--head")
            applies = "synthetic logits (the real ones have the model's)" if mine else "real logits"
            ap.error(f"{flag} applies to {applies}: drop it, or {'drop' if mine else 'add'} --logits smollm2")
    a.n = a.n or (N_SYNTHETIC if synthetic else N_REAL)
    a.v = a.v or V_QWEN
    if a.head is not None and a.head > a.v // 2:
        ap.error(f"--head {a.head} needs a vocabulary of at least {2 * a.head} (--v {a.v}): give a smaller --head")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        ap.error(f"--device {a.device!r} is not a torch device (cpu, cuda, cuda:1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {a.device}: no CUDA GPU is available")
    if device.type not in ("cpu", "cuda"):
        ap.error(f"--device {a.device}: this bench measures cpu or cuda")
    size = a.n * (a.v if synthetic else V_QWEN) * LOGIT_BYTES  # real logits: the model's vocabulary, at most Qwen's
    if device.type == "cpu" and (free := free_memory()) is not None and size > free:
        counts = f"--n {a.n} tokens x --v {a.v}" if synthetic else f"--n {a.n} tokens x the model's vocabulary"
        ap.error(f"{counts} logits take about {gib(size)} with the projections' copies, more than the {gib(free)} free "
                 "here: pass a smaller --n" + (" or --v" if synthetic else ""))  # fmt: skip
    if a.device == "cpu" and not os.access("/proc/self/clear_refs", os.W_OK):
        raise SystemExit("cpu peak memory needs a writable /proc/self/clear_refs (Linux)")

    t0 = time.perf_counter()
    if synthetic:
        args = make_batch(a.n, a.v, getattr(torch, a.dtype), a.device, a.seed, head=a.head)
        heads = f"{a.head} head tokens a row" if a.head else "5-10 head tokens a row"
        v, vocab, source, note = a.v, "", SYNTHETIC, f"synthetic peaked logits, {heads} (module docstring)"
    else:
        args, v, source, note = real_batch(a, getattr(torch, a.dtype))
        vocab = f" (the model's vocabulary, not Qwen's {V_QWEN:,})" if v != V_QWEN else " (the model's vocabulary)"
    grad_bytes = args[0].numel() * args[0].element_size()
    print(
        f"N={a.n} V={v}{vocab} dtype={a.dtype} device={a.device} threads={torch.get_num_threads()} "
        f"repeats={a.repeats} THP={os.environ['THP_MEM_ALLOC_ENABLE']}; logits {grad_bytes / GB:.2f} GB each, "
        f"data made in {time.perf_counter() - t0:.1f} s"
    )
    print(f"logits: {note}")
    variants = {"troll": troll, "clip": clip, "naive": naive_clip}
    if a.paper:
        variants["troll-paper"] = troll_paper
    few = min(a.n, 256)  # warm-up (thread pool, lazy initialisation, kernels) on a few rows: cheap
    warm = (args[0].detach()[:few].clone().requires_grad_(), *(x[:few] for x in args[1:]))
    for fn in variants.values():
        measure(fn, warm, a.device)
    del warm
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    stats: dict[str, dict] = {}
    for r in range(a.repeats):
        for name in list(variants)[:: -1 if r % 2 else 1]:
            m = measure(variants[name], args, a.device)
            print(
                f"  round {r + 1}: {name:11s} {m['wall']:6.2f} s wall, cpu user {m['user']:6.2f} s sys "
                f"{m['sys']:6.2f} s, peak extra {m['extra'] / GB:5.2f} GB"
            )
            out = m.pop("out")
            if name.startswith("troll"):
                stats[name] = out
            runs[name].append(m)

    med = {}
    print(
        f"\nmedians     {'wall s':>7s} {'(min)':>6s} {'old pass':>8s} {'update':>7s} {'cpu user':>8s} {'sys':>6s} | "
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
            f"{name:11s} {md['wall']:7.2f} {md['min']:6.2f} {md['old']:8.2f} {md['update']:7.2f} {md['user']:8.2f} "
            f"{md['sys']:6.2f} | {md['extra'] / GB:8.2f} {md['beyond'] / GB:11.2f} {md['absolute'] / GB:8.2f}"
        )

    def ratio(num: str, den: str) -> dict[str, float]:
        return {k: med[num][k] / med[den][k] if med[den][k] else math.nan for k in med[num]}

    pairs = [("troll", "clip"), ("troll", "naive")] + ([("troll-paper", "clip")] if a.paper else [])
    x = {pair: ratio(*pair) for pair in pairs}
    head = f"{'time':>6s} {'(min)':>6s} {'update':>6s} {'cpu user':>8s} | {'memory':>6s} {'extra':>6s}"
    print(f"\nratios            {head}")
    for (num, den), r in x.items():
        print(
            f"{num + '/' + den:17s} {r['wall']:5.2f}x {r['min']:5.2f}x {r['update']:5.2f}x {r['user']:7.2f}x | "
            f"{r['absolute']:5.2f}x {r['extra']:5.2f}x"
        )
    print("  (time: median wall; memory: absolute peak; extra: peak minus what was in use before the call)")
    for name, st in stats.items():
        print(
            f"{name}: {st['frac_active']:.1%} of tokens projected, solver iterations mean {st['dual_iters_mean']:.2f} "
            f"max {st['dual_iters_max']:.0f}, unconverged {st['dual_frac_unconverged']:.1%}; old support "
            f"{st['old_size_mean']:.2f} tokens, rest atom mass median {st['old_rest_median']:.2e} mean "
            f"{st['old_rest_mean']:.2e}; atoms {st['dual_support_size_mean']:.2f} + 1; sparse KL(p||q) mean "
            f"{st['kl_before_mean']:.3f} max {st['kl_before_max']:.2f}, KL(pi*||q) mean {st['kl_after_mean']:.3f}; "
            f"residual |KL(pi*||q) - eps| max {st['dual_residual_max']:.1e}"
        )
    tc, tn, st = x["troll", "clip"], x["troll", "naive"], stats["troll"]
    ok = tc["wall"] <= TARGET_TIME and tc["absolute"] <= TARGET_MEMORY
    print(
        f"SUMMARY projection: troll vs clip (same gather) time {tc['wall']:.2f}x (min {tc['min']:.2f}x, cpu user "
        f"{tc['user']:.2f}x; target <= {TARGET_TIME:.2f}x), peak memory {tc['absolute']:.2f}x (target <= "
        f"{TARGET_MEMORY:.2f}x): {'met' if ok else 'NOT met'}; vs naive clip time {tn['wall']:.2f}x, memory "
        f"{tn['absolute']:.2f}x; {st['frac_active']:.0%} projected, iters mean {st['dual_iters_mean']:.1f} "
        f"max {st['dual_iters_max']:.0f}" + ("" if synthetic else f"; logits {source}, V = {v:,}")
    )
    if a.profile:
        for name in ("troll", "naive"):
            print(f"\nprofile of one {name} call (forward and backward), the ops with the most time:")
            print(profile(variants[name], args, device))
    return {"stats": stats, "medians": med, "ratios": x}


def profile(fn, args, device: torch.device, rows: int = 20) -> str:
    """torch.profiler's table of one call of `fn` (old pass, loss, backward): the `rows` ops with the most time on
    the device (CUDA) or the host, with their calls and shapes, so the work goes where the time is."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    args[0].grad = None
    with torch_profile(activities=activities, record_shapes=True) as prof:
        fn(*args, [])
        if cuda:
            torch.cuda.synchronize()
    args[0].grad = None
    table = prof.key_averages(group_by_input_shape=True)
    return table.table(
        sort_by="cuda_time_total" if cuda else "self_cpu_time_total", row_limit=rows, max_name_column_width=40
    )


if __name__ == "__main__":  # Ctrl-C: one line, exit 130
    run_command(PROG, main)
