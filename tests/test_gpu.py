"""What only a GPU can show: the loss, the projection, the chunked output layer, LoRA on a bf16 base, a learning run,
resume and one update's peak memory, on the device, against float64 CPU references and CPU-tested behaviour.

    python -m pytest -m gpu tests/test_gpu.py                          # on a CUDA GPU (every test skips without one)
    TROLL_TEST_DEVICE=cpu python -m pytest -m gpu tests/test_gpu.py    # the same tests on CPU: a rehearsal

The data is made on CPU from seeded generators and moved to the device, so a rehearsal and a GPU run see the same
numbers; only the arithmetic differs. Tests that need torch.cuda's memory statistics skip on CPU."""

import gc
import math
import os
from pathlib import Path

import pytest
import torch
from test_train import TIMING_KEYS, rows, tiny

from troll.base.checkpoint import complete_checkpoints
from troll.base.config import Config
from troll.head import LMHead
from troll.losses import LOSSES, troll_loss
from troll.models.build import adapt, build_model
from troll.project import project_dense, project_sparse
from troll.rollout import Batch, Rollouts
from troll.run.start import make_optimizer
from troll.sparse import atom_kl, build_support, sparsify, support_kl
from troll.train import minibatches_of, old_policy, train, update

pytestmark = pytest.mark.gpu

EPS = 0.05  # the trust region's radius (troll_loss's default)
NO_GPU = "no CUDA GPU; TROLL_TEST_DEVICE=cpu rehearses these tests on CPU"
DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(scope="module")
def device() -> torch.device:
    """$TROLL_TEST_DEVICE (cuda or cpu; default cuda; another is refused once, tests/conftest.py); every test skips
    where it is cuda and none is available."""
    name = os.environ.get("TROLL_TEST_DEVICE", "cuda")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip(NO_GPU)
    return torch.device(name)


@pytest.fixture
def varied_reward(monkeypatch):
    """1 for an odd-length completion: a reward an untrained model earns, so every update moves the weights."""
    monkeypatch.setattr("troll.tasks.addition.reward", lambda completion, gold: float(len(completion) % 2))


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast for bf16 inputs (the GPU presets' forward), nothing for float32."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def assert_close_to_max(got: torch.Tensor, want: torch.Tensor, of_max: float, rtol: float = 0.0) -> None:
    """Every entry of `got` within of_max x max|want| + rtol x |its reference| of `want` (float64, CPU)."""
    got = got.detach().double().cpu()
    torch.testing.assert_close(got, want, rtol=rtol, atol=of_max * float(want.abs().max()))


def policies(b: int = 4, t: int = 64, v: int = 8192, seed: int = 0):
    """A float64 CPU batch over V tokens: old logits [B, T, V], current ones (far from the old on even positions,
    near on odd ones, so about half the tokens are projected), tokens sampled from the old policy, a ragged mask
    and advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(b, t, v, generator=g, dtype=torch.float64) * 2.5
    scale = torch.tensor([1.0, 0.02], dtype=torch.float64).repeat(t // 2).view(1, t, 1)
    new = old + scale * torch.randn(b, t, v, generator=g, dtype=torch.float64)
    tokens = torch.multinomial(torch.softmax(old.view(-1, v), -1), 1, generator=g).view(b, t)
    mask = torch.arange(t) < torch.tensor([t, t - 5, t // 2, 3])[:b, None]
    adv = torch.tensor([1.0, -1.5, 0.5, -0.25], dtype=torch.float64)[:b]
    return new, old, tokens, mask, adv


# ----------------------------------------------------------------------------- the loss and the projection


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_troll_loss_matches_float64_cpu(device, dtype):
    """troll_loss on the device (float32 logits, or bf16 logits under bf16 autocast) against the float64 CPU loss of
    the same logit values (the bf16-rounded ones for bf16), V = 8,192, k = 64, about half the tokens projected.

    Tolerances: the value to 1e-4 relative in both dtypes: bf16 inputs are computed in float32 (compute_dtype), and
    the float32 solver aims min(2e-6, 1e-3 eps) inside the ball (troll.project), which moves t* by about 2e-5 of
    itself and the ratios by as much; log-softmax over V in float32 adds ~1e-6. The gradient w.r.t. the logits:
    float32, every entry within 2e-4 of the largest (measured on CPU: 4e-5); bf16, the gradient is returned in bf16
    (8 bits of mantissa: rounding by up to 2^-9 of the entry), so 2^-7 of the entry is allowed on top."""
    new, old_logits, tokens, mask, adv = policies()
    v = new.shape[-1]
    old = sparsify(old_logits.view(-1, v), tokens.view(-1), k=64, delta=1e-5)
    x = new.to(dtype).to(device).requires_grad_(True)
    with autocast(device, dtype):
        loss, m = troll_loss(x, tokens.to(device), mask.to(device), adv.float().to(device), old.to(device))
    (grad,) = torch.autograd.grad(loss, x)
    x64 = x.detach().cpu().double().requires_grad_(True)
    loss64, m64 = troll_loss(x64, tokens, mask, adv, old)
    (grad64,) = torch.autograd.grad(loss64, x64)
    kl = support_kl(build_support(x64.detach().view(-1, v), tokens.view(-1), old))
    assert float((kl - EPS).abs().min()) > 1e-3  # no token on the region's edge, where float32 could decide otherwise
    assert 0.2 < m64["frac_active"] < 0.8 and m["frac_active"] == m64["frac_active"]  # the same tokens projected
    assert loss.dtype == torch.float32 and grad.dtype == dtype and grad.device.type == device.type
    assert loss.item() == pytest.approx(loss64.item(), rel=1e-4)
    assert_close_to_max(grad, grad64, of_max=2e-4, rtol=0.0 if dtype == torch.float32 else 2**-7)
    for key in ("policy", "regression", "kl_before_max", "kl_after_max", "entropy", "ratio_max"):
        assert m[key] == pytest.approx(m64[key], rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_projections_match_float64_cpu(device, dtype):
    """project_dense ([N, V] = [256, 8,192]) and project_sparse (on the rest model's atoms, k = 64) on the device,
    float32 or bf16 inputs under bf16 autocast, against float64 CPU on the same values: the projected log-probs,
    the gradient of sum_n c_n pi*_n(y_n) (through the implicit dual) w.r.t. the current logits, and the ball.

    Tolerances: log pi* within 3e-4 (measured on CPU: 7e-5): the float32 solver aims min(2e-6, 1e-3 eps) inside
    the ball, moving t* by ~2e-5 of itself and log pi* by that times |a - E a| (up to ~10 here); float32 rounding
    adds ~1e-6 of |log p|. Gradient: float32 within 1e-4 of its largest entry (measured: 6e-6); bf16 inputs get a
    bf16 gradient (rounded by up to 2^-9 of the entry), so 2^-7 of the entry on top. The ball: every projected
    token's KL(pi* || q), in float64 from the device's output, lies in [eps - 1e-5, eps + 1e-6]: the solver's
    margin below, the float32 log-probs' own rounding (~1e-7 of KL) above."""
    new, old_logits, tokens, _, _ = policies()
    v = new.shape[-1]
    y, c = tokens.view(-1), torch.linspace(-1.0, 1.0, tokens.numel(), dtype=torch.float64)
    q = old_logits.view(-1, v).to(dtype)  # the old policy at the inputs' precision: the same values on both sides
    old = sparsify(q.double(), y, k=64, delta=1e-5)
    xd = new.view(-1, v).to(dtype).to(device).requires_grad_(True)
    x64 = xd.detach().cpu().double().requires_grad_(True)

    def dense(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi* over V [N, V] and at the sampled tokens [N]."""
        out = project_dense(x, q.to(x.device, x.dtype), EPS)
        return out, out.gather(-1, y.to(x.device)[:, None])[:, 0]

    def sparse(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """log pi* on the rest model's atoms [N, U + 1] and at the sampled tokens [N]."""
        proj = project_sparse(build_support(x, y.to(x.device), old.to(x.device)), EPS)
        return proj.logp, proj.log_pi_y

    lq, s = torch.log_softmax(q.double(), -1), build_support(x64.detach(), y, old)
    every = torch.ones_like(lq, dtype=torch.bool)
    references = {  # log q, the live entries and KL(p || q) per row, float64 on CPU
        dense: (lq, every, atom_kl(torch.log_softmax(x64.detach(), -1), lq, every)),
        sparse: (s.lq, s.mask, support_kl(s)),
    }
    for project, (log_q, live, kl_before) in references.items():
        with autocast(device, dtype):
            out, at_y = project(xd)
        (grad,) = torch.autograd.grad((c.to(at_y) * at_y.exp()).sum(), xd)
        out64, at_y64 = project(x64)
        (grad64,) = torch.autograd.grad((c * at_y64.exp()).sum(), x64)
        projected = kl_before > EPS
        assert 0.3 < float(projected.double().mean()) < 0.7 and float((kl_before - EPS).abs().min()) > 1e-3
        assert out.dtype == torch.float32 and grad.dtype == dtype, project.__name__
        out = out.detach().double().cpu()
        torch.testing.assert_close(out[live], out64.detach()[live], rtol=0.0, atol=3e-4)
        assert_close_to_max(grad, grad64, of_max=1e-4, rtol=0.0 if dtype == torch.float32 else 2**-7)
        kl = atom_kl(out, log_q, live)[projected]
        assert EPS - 1e-5 <= float(kl.min()) and float(kl.max()) <= EPS + 1e-6, project.__name__


# ----------------------------------------------------------------------------- the chunked output layer


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chunked_head_equals_full_logits(device, dtype, compiled):
    """troll_loss from LMHead(hidden [4, 64, 64], weight [4,160, 64], temperature 0.9, vocabulary 4,096 of the
    4,160 rows) in chunks of 48 rows (the last one short) equals troll_loss from the full logits the unchunked
    path computes (policy.packed_logits: the matmul under autocast, .float(), / temperature, padded ids at -inf), on
    the device: the value and the gradients w.r.t. the hidden states and the output weight; the padded rows get no
    gradient at all.

    Tolerances: float32, the value to 1e-5 relative and every gradient entry within 1e-5 of the largest (the same
    products summed in other orders: chunk by chunk, and over 48 rows instead of 256; measured on CPU: 3e-7). bf16
    (hidden states and weight in bf16, autocast): both paths round the logits to bf16, so the value agrees to 1e-3
    relative (a logit rounded the other way by one bf16 ulp, 2^-8, moves the mean loss far less); the unchunked
    backward rounds dL/dlogits to bf16 (2^-9 of each entry) before its bf16 matmul, the chunked one multiplies in
    float32 and rounds once, and the sums over V cancel: every entry within 2e-2 of the largest (measured on CPU:
    6e-3). Compiled (`LMHead(compiled=True)`: Triton kernels on CUDA, C++ on CPU): the same tolerances."""
    b, t, h, v_out, vocab, temperature = 4, 64, 64, 4160, 4096, 0.9
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(v_out, h, generator=g, dtype=torch.float64) * 0.4
    old_hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64)
    scale = torch.tensor([0.5, 0.01], dtype=torch.float64).repeat(t // 2).view(1, t, 1)
    hidden = old_hidden + scale * torch.randn(b, t, h, generator=g, dtype=torch.float64)
    padded = torch.arange(v_out) >= vocab
    old_logits = (old_hidden @ weight.T / temperature).masked_fill(padded, -math.inf).view(-1, v_out)
    tokens = torch.multinomial(torch.softmax(old_logits, -1), 1, generator=g).view(b, t)
    old = sparsify(old_logits, tokens.view(-1), k=64, delta=1e-5).to(device)
    mask = (torch.arange(t) < torch.tensor([t, t - 5, t // 2, 3])[:, None]).to(device)
    adv = torch.tensor([1.0, -1.5, 0.5, -0.25], device=device)
    out = {}
    for chunked in (True, False):
        x, w = (z.to(dtype).to(device).requires_grad_(True) for z in (hidden, weight))
        with autocast(device, dtype):
            if chunked:
                logits = LMHead(x, w, None, temperature, vocab, chunk_rows=48, compiled=compiled)
            else:
                logits = (x @ w.T).float() / temperature
                logits = logits.masked_fill(padded.to(device), -math.inf)
            loss, m = troll_loss(logits, tokens.to(device), mask, adv, old)
        out[chunked] = (loss, m, *torch.autograd.grad(loss, (x, w)))
    (loss_c, m_c, gx_c, gw_c), (loss_u, m_u, gx_u, gw_u) = out[True], out[False]
    assert 0.2 < m_u["frac_active"] < 0.8 and m_c["frac_active"] == m_u["frac_active"]
    assert gx_c.dtype == gw_c.dtype == dtype and not gw_c[vocab:].any() and not gw_u[vocab:].any()
    bf16 = dtype == torch.bfloat16
    assert loss_c.item() == pytest.approx(loss_u.item(), rel=1e-3 if bf16 else 1e-5)
    for got, want in ((gx_c, gx_u), (gw_c, gw_u)):
        assert_close_to_max(got, want.double().cpu(), of_max=2e-2 if bf16 else 1e-5)


# ----------------------------------------------------------------------------- LoRA on a bf16 base


def random_batch(vocab: int, n: int = 8, completion: int = 6, seed: int = 0) -> Batch:
    """n rollouts of random tokens (prompts of 2-6 ids, ragged completions of up to `completion`), in groups of 4,
    with advantages +-1: a batch `troll.train.update` takes, without sampling."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(vocab, (int(k),), generator=g).tolist() for k in torch.randint(2, 7, (n,), generator=g)]
    lengths = torch.randint(1, completion + 1, (n,), generator=g)
    mask = torch.arange(completion) < lengths[:, None]
    ids = torch.randint(vocab, (n, completion), generator=g) * mask
    ro = Rollouts(prompts, ids, mask, torch.zeros(n, completion), None, None, lengths < completion,
                  torch.arange(n) // 4, 1.0)  # fmt: skip
    adv = torch.tensor([1.0, -1.0]).repeat(n // 2)
    return Batch(ro, (adv > 0).float(), adv, g.get_state(), 0.0, 0.0)


def test_lora_on_a_bf16_base_trains_only_the_float32_adapters(device, tmp_path):
    """The tiny-lora preset with bf16 autocast, gradient checkpointing and the chunked head (the GPU LoRA presets'
    path) on the device: three RL updates (troll.train.old_policy, then troll.train.update: TROLL, 2 minibatches
    each) on random rollouts. The base weights are bf16 and bit-identical to before (torch.equal) with no gradient,
    the adapters are float32 with finite gradients at every update, no step was skipped, and every adapter moved."""
    pytest.importorskip("peft")
    flags = ["--preset", "tiny-lora", "--bf16", "true", "--grad_checkpointing", "true", "--logits_chunk", "8"]
    cfg = Config.from_args([*flags, "--device", device.type, "--out", str(tmp_path / "run")])
    torch.manual_seed(cfg.seed)
    model, tok = build_model(cfg, device)
    model = adapt(cfg, model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert base and adapters and all(".lora_" in n for n in adapters)
    opt, sched = make_optimizer(cfg, model)
    for step in range(3):
        batch = random_batch(len(tok), seed=step)
        old = old_policy(cfg, model, batch.ro, len(tok))
        metrics, skipped = update(cfg, model, opt, sched, batch, old, minibatches_of(cfg, batch), LOSSES[cfg.loss])
        assert skipped == 0 and math.isfinite(metrics["policy"]) and 0 < metrics["grad_norm"] < math.inf
        for n, p in model.named_parameters():
            if n in adapters:
                assert p.dtype == torch.float32 and p.grad is not None and bool(torch.isfinite(p.grad).all()), n
            else:
                assert p.dtype == torch.bfloat16 and p.grad is None, n
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], w) for n, w in base.items())  # the frozen base: bit for bit
    moved = [n for n, w in adapters.items() if not torch.equal(params[n], w)]
    assert moved == list(adapters)


# ----------------------------------------------------------------------------- whole runs


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_tiny_cpu_run_learns_on_the_device(device, tmp_path, bf16):
    """test_train.test_tiny_cpu_run_learns on the device: README's main command shortened to 50 RL steps and 500
    held-out problems. The warm-start stops at its target, held-out accuracy starts near it (0.2-0.5) and TROLL
    raises it by more than 0.2 (seed 0 on CPU: 0.30 -> 0.70; on an H100: 0.36 -> 0.67). bf16 autocast (the GPU
    presets' forward) only on CUDA, the same thresholds (H100: 0.36 -> 0.65)."""
    if bf16 and device.type != "cuda":
        pytest.skip("bf16 autocast is the GPU recipe; on CPU the run takes float32 (the float32 case)")
    flags = ["--preset", "tiny-cpu", "--steps", "50", "--eval_size", "500", "--bf16", str(bf16).lower()]
    cfg = Config.from_args([*flags, "--device", device.type, "--out", str(tmp_path / "run")])
    summary = train(cfg)
    print(f"\ntiny-cpu on {device.type} ({'bf16' if bf16 else 'float32'}): eval {summary['eval_before']:.3f} -> "
          f"{summary['eval_after']:.3f}")  # fmt: skip
    assert summary["sft_reached"] and summary["sft_probe_acc"] >= cfg.sft_target
    assert 0.2 < summary["eval_before"] < 0.5
    assert summary["eval_after"] > summary["eval_before"] + 0.2


def final_weights(out: str) -> dict[str, torch.Tensor]:
    """The weights of run `out`'s newest checkpoint (its last step's), on CPU, by name."""
    ckpt = complete_checkpoints(Path(out))[0]
    model, _ = build_model(Config.load(Path(out) / "config.json"), torch.device("cpu"), path=ckpt)
    return dict(model.state_dict())


def test_resume_on_the_device_equals_the_straight_run(device, tmp_path, varied_reward):
    """test_train's tiny run (lr 1e-2, 16 samples a step, 2 minibatches) on the device: 4 steps straight, against 2
    steps then `--resume true` to 4 (a new model and optimiser from the step-2 checkpoint). On CPU the final weights
    and every step's row (timings aside) are bit-exact, as the CPU suite holds. On CUDA, where some kernels may sum
    in a different order from run to run (atomics), the final float32 weights agree to 1e-5 absolute (one
    lr-1e-2 Adam step moves a weight by up to 1e-2; rounding noise moves it by ~1e-7) and the rows to 1e-4 relative;
    the largest weight difference is printed, and in the assertion's message (0 on an H100, torch 2.11)."""
    kw = dict(device=device.type, save_every=2)
    straight, first = tiny(tmp_path / "a", steps=4, **kw), tiny(tmp_path / "b", steps=2, **kw)
    train(straight)
    train(first)
    train(Config.from_args(["--out", first.out, "--resume", "true", "--steps", "4"]))
    a, b = rows(Path(straight.out)), rows(Path(first.out))
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert complete_checkpoints(Path(first.out))[0].name == "step-000004"
    wa, wb = final_weights(straight.out), final_weights(first.out)
    assert wa.keys() == wb.keys()
    diff = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    start = build_model(straight, torch.device("cpu"))[0].state_dict()
    assert max(float((wa[k] - start[k]).abs().max()) for k in wa) > 1e-3  # the run moved the weights
    print(f"\nresumed vs straight on {device.type}: weights differ by up to {diff:.3g}")
    exact = device.type == "cpu"
    if exact:
        assert diff == 0.0 and all(torch.equal(wa[k], wb[k]) for k in wa)
    else:
        assert diff <= 1e-5, f"resumed and straight weights differ by up to {diff:.3g} on {device.type}"
    for ra, rb in zip(a, b, strict=True):
        for key in ra:
            if not key.startswith(TIMING_KEYS):
                assert ra[key] == (rb[key] if exact else pytest.approx(rb[key], rel=1e-4, abs=1e-7)), (ra["step"], key)


# ----------------------------------------------------------------------------- memory


def test_one_update_peak_memory_within_the_model(device, tmp_path):
    """One real update (troll.train.update: TROLL, one minibatch of one micro-batch) of the gsm8k-qwen2.5-0.5b
    preset's path (bf16 autocast, gradient checkpointing, the chunked head of 1,024 rows, AdamW's first step) on a
    stand-in of Qwen2.5-0.5B's real shape with random weights (troll.models.standin), 2 rows of 250 prompt + 1,024
    completion tokens of random ids: torch's peak allocation from just before the update, over what earlier tests
    left allocated, against troll.models.memory.peak_bytes - RUNTIME for that micro-batch, as troll.tools.check's memory
    check counts on a GPU. The model is meant as an upper bound: measured <= 1.10 x predicted (check's tolerance), and
    the window held at least the float32 weights, gradients and AdamW's two states (16 B/param). Prints the ratio (an
    H100, torch 2.11: 9.24 / 9.92 GiB = 0.93)."""
    if device.type != "cuda":
        pytest.skip("torch.cuda's memory statistics need a CUDA GPU")
    from troll.models import memory, standin
    from troll.tools.watch import update_tokens

    arch, prompt, completion = "qwen2.5-0.5b", 250, 1024
    flags = ["--preset", "gsm8k-qwen2.5-0.5b", "--backend", "hf", "--prompts_per_step", "1", "--samples_per_prompt",
             "2", "--minibatches", "1", "--micro_batch_tokens", str(2 * (prompt + completion))]  # fmt: skip
    cfg = Config.from_args([*flags, "--device", device.type, "--out", str(tmp_path / "run")])
    gc.collect()
    torch.cuda.empty_cache()
    left = torch.cuda.memory_allocated(device)
    model = standin.build(arch)
    model.gradient_checkpointing_enable()
    model = model.train().to(device)
    vocab = standin.ARCHS[arch]["tok"]  # the tokenizer's ids; the output layer has 151,936 rows
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (2, prompt + completion), generator=g)
    real, cut = torch.ones(2, completion, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)
    ro = Rollouts([r[:prompt].tolist() for r in ids], ids[:, prompt:], real, torch.zeros(2, completion), None, None,
                  cut, torch.zeros(2, dtype=torch.long), 1.0)  # fmt: skip
    batch = Batch(ro, torch.tensor([1.0, 0.0]), torch.tensor([1.0, -1.0]), g.get_state(), 0.0, 0.0)
    old = old_policy(cfg, model, ro, vocab)
    opt, sched = make_optimizer(cfg, model)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    _, skipped = update(cfg, model, opt, sched, batch, old, [torch.arange(2)], LOSSES[cfg.loss])
    torch.cuda.synchronize(device)
    measured = torch.cuda.max_memory_allocated(device) - left
    tokens, share = update_tokens(cfg, ro)
    predicted = memory.peak_bytes(arch, tokens, cfg.grad_checkpointing, cfg.logits_chunk > 0, share) - memory.RUNTIME
    params = sum(p.numel() for p in model.parameters())
    gib = memory.GIB
    print(f"\none update, {tokens} tokens: measured {measured / gib:.2f} GiB, predicted {predicted / gib:.2f} GiB, "
          f"ratio {measured / predicted:.3f}")  # fmt: skip
    assert skipped == 0 and tokens == 2 * (prompt + completion) and params == memory.shape(arch).params
    assert measured >= 16 * params
    assert measured <= 1.10 * predicted, f"measured / predicted = {measured / predicted:.3f}"
