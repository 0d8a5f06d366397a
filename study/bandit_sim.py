"""The rare-token bandit's simulator: a table-of-logits policy trained by the project's own losses on its own
sparse old policy, one generated token per context (the study around it: study/bandit.py).

Design, stated once:
- Policy: a table of logits [C, V] in float32 (the trainer's precision), one row (a next-token distribution) per
  context, trained by Adam (no weight decay, betas (0.9, 0.999), one optimiser for the whole run, as the trainer).
- Initial rows: Zipf, p(rank k) proportional to k^-1.35 over k = 1..V: a long-tailed, high-entropy position (at
  V = 32,000 the top token has 0.30, the top 64 hold 83% of the mass, entropy 4.0 nats), the kind of position
  where RL's choice of token matters. Each context and seed places the ranks on its own random permutation of the
  ids (which changes nothing for the losses, all of which treat ids alike); the shape is the same for every seed.
- One rewarded ("good") token per context, at the rank whose initial probability is closest to each of TARGETS:
  0.3, 0.05, 0.005, 1e-3, 1e-4 (ranks 1, 4, 21, 68, 372 at V = 32,000), so C = 5 contexts per run.
- An RL step: G = 64 samples per context (`samples`) from the current table by inverse-CDF sampling with
  uniforms from a generator seeded by (seed, step) (`draws`), so every variant of a seed starts from the same table
  and sees the same random numbers: identical samples while the policies agree, and the same noisy rewards for
  the same samples. Rewards, then GRPO advantages per context (troll.advantages.grpo). A context whose rewards are
  all equal carries no signal (every advantage 0) and is left out of the batch, as DAPO's dynamic sampling does
  (without drawing replacements; a step with no signal anywhere makes no update): the V-sized work goes to the
  contexts that teach something. Then the old policy as the trainer builds it (troll.sparse.sparsify, K = 64,
  delta = 1e-5: the rest model), then `passes` Adam steps on the whole batch with the loss (troll.losses,
  token-mean over the batch, each loss's own defaults but its setting).
- Rewards: `clean` pays 1 for the good token, 0 for any other. `noisy` pays the good token 1 with probability 0.6
  and a decoy, the neighbouring rank (one rank more likely; the second for a top-ranked good token), 1 with
  probability 0.4. In the few samples a rare token gets, the decoy looks as good as the good token about half the
  time, and it starts more likely; a loss that moves fast on little evidence can put most of the mass on the
  decoy before the good token is seen, after which the good token is hardly sampled again. So moving fast can
  cost, and speed alone does not win.
- Measured per run: p(good) per context after every step; the steps until p(good) >= THRESHOLD = 0.5 (censored:
  steps + 1 when it never does); the policy's expected reward after every step (mean over contexts; the best is 1
  clean, 0.6 noisy) and its mean over the run (`auc`: speed and level in one number); the exact KL(p_new || p_old)
  of each step's update over all V (troll.run.diagnostics.dense_kl, float64) per context; and collapse: a context
  ends with a token other than the good one holding more than half of the mass and the good token below its
  initial probability (or a non-finite logit, which ends the run).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

TARGETS = (0.3, 0.05, 0.005, 1e-3, 1e-4)  # the good token's initial probability, one context each
ZIPF = 1.35
THRESHOLD = 0.5
NOISY = (0.6, 0.4)  # noisy reward: P(pay 1) for the good token and for the decoy
K, DELTA = 64, 1e-5  # the trainer's sparse old policy


@dataclass(frozen=True)
class Cell:
    reward: str  # "clean" or "noisy"
    passes: int  # Adam steps on each batch
    lr: float
    vocab: int


def initial_table(vocab: int, seed: int, targets: Sequence[float] = TARGETS) -> dict:
    """The initial logits [C, V] (float32, Zipf rows, ids permuted per context and seed), the good and decoy token ids
    [C], their ranks (1-based) and the good token's initial probability [C] (module docstring)."""
    import torch

    logp = -ZIPF * torch.arange(1, vocab + 1, dtype=torch.float64).log()
    logp = logp - logp.logsumexp(0)
    ranks = [int((logp.exp() - t).abs().argmin()) + 1 for t in targets]
    decoys = [r - 1 if r > 1 else 2 for r in ranks]
    gen = torch.Generator().manual_seed(seed)
    perms = torch.stack([torch.randperm(vocab, generator=gen) for _ in targets])  # perms[c, k - 1]: id of rank k
    table = torch.empty(len(targets), vocab, dtype=torch.float64).scatter_(1, perms, logp.expand(len(targets), -1))
    rows = torch.arange(len(targets))
    return {
        "table": table.float(),
        "good": perms[rows, torch.tensor(ranks) - 1],
        "decoy": perms[rows, torch.tensor(decoys) - 1],
        "ranks": ranks,
        "decoy_ranks": decoys,
        "q0": [float(logp[r - 1].exp()) for r in ranks],
    }


def draws(seed: int, step: int, contexts: int, samples: int):
    """The step's uniforms [C, G] for sampling and for the noisy rewards: a function of (seed, step) only."""
    import torch

    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    u = torch.rand(2, contexts, samples, generator=gen, dtype=torch.float64)
    return u[0], u[1]


def sample(logp, u):
    """Inverse-CDF samples [C, G] from log-probs [C, V] with uniforms u [C, G] (float64)."""
    import torch

    cdf = logp.double().exp().cumsum(-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).clamp_max(logp.shape[-1] - 1)


def rewards(tokens, good, decoy, u, reward: str):
    """Rewards [C, G] of the samples (module docstring): clean 1[good]; noisy Bernoulli(0.6) / Bernoulli(0.4)."""
    hit = tokens == good[:, None]
    if reward == "clean":
        return hit.double()
    return ((hit & (u < NOISY[0])) | ((tokens == decoy[:, None]) & (u < NOISY[1]))).double()


def expected_reward(logp, good, decoy, reward: str) -> float:
    """The policy's expected reward, mean over contexts (logp [C, V])."""
    p = logp.exp()
    rows = range(p.shape[0])
    if reward == "clean":
        return float(p[rows, good].mean())
    return float((NOISY[0] * p[rows, good] + NOISY[1] * p[rows, decoy]).mean())


def simulate(
    cell: Cell, loss_name: str, kwargs: dict, seed: int, steps: int = 20, samples: int = 64, trace: bool = False
) -> dict:
    """One run of troll.losses' `loss_name` with `kwargs` (module docstring); returns its measurements. With
    `trace`, also "trace": per step the samples [C, G] and the log-probs [C, V] before and after the update."""
    import torch

    from troll.advantages import grpo
    from troll.losses import LOSSES
    from troll.run.diagnostics import dense_kl
    from troll.sparse import sparsify

    start = time.time()
    init = initial_table(cell.vocab, seed)
    good, decoy = init["good"], init["decoy"]
    table = init["table"].clone().requires_grad_(True)
    opt = torch.optim.Adam([table], lr=cell.lr)
    c = table.shape[0]
    ctx = torch.arange(c).repeat_interleave(samples)  # row i of the batch is a sample of context ctx[i]
    logp = table.detach().double().log_softmax(-1)
    p_good = [[float(x)] for x in logp.exp()[range(c), good]]
    reward_curve = [expected_reward(logp, good, decoy, cell.reward)]
    kl_mean, kl_max, kl_ctx, active, finite, steps_trace = [], [], [], [], True, []
    for step in range(steps):
        u_tok, u_rew = draws(seed, step, c, samples)
        tokens = sample(logp, u_tok)
        r = rewards(tokens, good, decoy, u_rew, cell.reward)
        signal = (r != r[:, :1]).any(-1)  # the contexts whose group has some reward variance
        rows = signal[ctx]
        if bool(rows.any()):  # a step without any signal makes no update (nothing to learn from)
            adv = grpo(r.reshape(-1)[rows], ctx[rows])
            y = tokens.reshape(-1)[rows]
            with torch.no_grad():
                old = sparsify(table.detach()[ctx[rows]], y, k=K, delta=DELTA)
            mask = torch.ones(len(y), 1, dtype=torch.bool)
            for _ in range(cell.passes):
                logits = table[ctx[rows]].unsqueeze(1)  # [B, 1, V]: each sample is a one-token response
                loss, metrics = LOSSES[loss_name](logits, y[:, None], mask, adv, old, **kwargs)
                opt.zero_grad()
                loss.backward()
                opt.step()
                active.append(metrics["frac_active"])
        new = table.detach().double().log_softmax(-1)
        if not bool(torch.isfinite(table).all()):
            finite = False
            break
        if trace:
            steps_trace.append({"tokens": tokens, "logp_old": logp, "logp_new": new})
        kl = dense_kl(new, logp)  # [C]: the exact KL of this step's update, over all V
        kl_mean.append(float(kl.mean()))
        kl_max.append(float(kl.max()))
        kl_ctx.append([float(x) for x in kl])
        logp = new
        for i, x in enumerate(logp.exp()[range(c), good]):
            p_good[i].append(float(x))
        reward_curve.append(expected_reward(logp, good, decoy, cell.reward))
    p_final = logp.exp()
    top = p_final.max(-1)
    other_top = (top.indices != good) & (top.values > 0.5)
    collapsed = [not finite or bool(o and p_final[i, good[i]] < init["q0"][i]) for i, o in enumerate(other_top)]
    steps_to = [next((s for s, p in enumerate(curve) if p >= THRESHOLD), steps + 1) for curve in p_good]

    def r6(x):  # six significant digits: the results file stays small
        return [r6(v) for v in x] if isinstance(x, list) else float(f"{x:.6g}")

    return {
        "ranks": init["ranks"],
        "decoy_ranks": init["decoy_ranks"],
        "q0": init["q0"],
        "p_good": r6(p_good),
        "steps_to": steps_to,
        "reward_curve": r6(reward_curve),
        "auc": statistics.fmean(reward_curve),
        "final": reward_curve[-1],
        "kl_update_mean": r6(kl_mean),
        "kl_update_max": r6(kl_max),
        "kl_update_ctx": r6(kl_ctx),
        "frac_active_mean": statistics.fmean(active) if active else math.nan,
        "collapsed": collapsed,
        "finite": finite,
        "wall_s": round(time.time() - start, 2),
    } | ({"trace": steps_trace} if trace else {})


# ----------------------------------------------------------------------------- the grid
