"""Micro-batching leaves the update unchanged (troll.train.update): for every loss, level and aggregation, the
gradient accumulated over micro-batches, down to one row each, equals the gradient of the minibatch's loss in one
call (the loss on all its rows, outside `update`), in float64, with ragged completions and completions that are all
padding; and the merged metrics do not depend on the micro-batching either."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor
from transformers import LlamaConfig, LlamaForCausalLM

from troll.base.config import ACTS_ONLY, Config
from troll.losses import AGGREGATIONS, LEVELS, LOSSES
from troll.policy import rollout_logits
from troll.rollout import Batch, Rollouts
from troll.sparse import SparseDist
from troll.train import old_policy, update

VOCAB = 24
CHUNK = 4  # --logits_chunk: the chunked output layer keeps the float64 weights' precision (troll.head)
RTOL = 1e-12  # of the largest gradient entry: float64 sums in another order
ONE_ROW, ONE_CALL = 1, 10**6  # micro_batch_tokens: one row per micro-batch; the whole minibatch in one call
CASES = [
    (loss, level, agg)
    for loss in LOSSES
    for level in LEVELS
    if level == "token" or ACTS_ONLY["level"][1](loss)  # dppo and cispo: per token only
    for agg in AGGREGATIONS
]
# metrics that are the minibatch's aggregate (the loss's terms) or a mean over its real tokens, hence the same
# however the minibatch is split; dual_eta/t/iters_mean (over projected tokens only) are left out
INVARIANT = ("policy", "regression", "entropy", "frac_no_signal", "frac_active", "ratio_mean", "kl_before_mean",
             "kl_after_mean", "ratio_min", "ratio_max", "kl_before_max")  # fmt: skip


@functools.cache
def models() -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A tiny float64 Llama (the anchor of the old policy) and a perturbed copy (the policy being trained), so
    ratios differ from 1 and the trust region and the clip bind on some tokens."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        anchor = LlamaForCausalLM(config).double()
        current = LlamaForCausalLM(config).double()
        current.load_state_dict(anchor.state_dict())
        with torch.no_grad():
            for p in current.parameters():
                p.add_(0.3 * torch.randn_like(p))
    return anchor, current


def make_batch(shapes: list[tuple[int, int]], seed: int) -> Batch:
    """Rollouts of len(shapes) samples, (prompt length >= 1, completion length >= 0) each, random tokens and
    advantages; a completion of length 0 is a row of padding only."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(shapes), max(1, *(n for _, n in shapes))
    lengths = torch.tensor([n for _, n in shapes])
    mask = torch.arange(T) < lengths[:, None]
    ids = torch.where(mask, torch.randint(1, VOCAB, (B, T), generator=g), 0)
    ro = Rollouts(
        prompt_ids=[torch.randint(1, VOCAB, (p,), generator=g).tolist() for p, _ in shapes],
        completion_ids=ids,
        completion_mask=mask,
        logprobs=torch.zeros(B, T),
        top_idx=None,
        top_logp=None,
        finished=lengths < T,
        group=torch.zeros(B, dtype=torch.long),
        temperature=0.7,
    )
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return Batch(ro, torch.zeros(B), adv, torch.Generator().get_state(), 0.0, 0.0)


class GradientTap(torch.optim.SGD):
    """An optimiser that moves nothing (lr 0) and records the gradient each of its steps would apply."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(params, lr=0.0)
        self.grads: list[Tensor] = []

    def step(self, closure: None = None) -> None:  # type: ignore[override]
        self.grads.append(flat_grad(self.param_groups[0]["params"]))


def flat_grad(params: list[Tensor]) -> Tensor:
    """Every parameter's gradient as one vector [P] (0 where a parameter has none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def config(loss: str, level: str, agg: str, micro_batch_tokens: int) -> Config:
    # grad_clip far above any norm: the clip multiplies by exactly 1
    return Config(loss=loss, level=level, agg=agg, micro_batch_tokens=micro_batch_tokens, logits_chunk=CHUNK,
                  k=4, grad_clip=1e300, device="cpu")  # fmt: skip


def run_update(cfg: Config, batch: Batch, old: SparseDist, minibatches: list[Tensor]) -> tuple[list[Tensor], dict]:
    """`update` on the current model: each minibatch's gradient (one per optimiser step) and the merged metrics."""
    model = models()[1]
    opt = GradientTap(list(model.parameters()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    metrics, skipped = update(cfg, model, opt, sched, batch, old, minibatches, LOSSES[cfg.loss])
    assert skipped == 0
    return opt.grads, metrics


def reference(cfg: Config, batch: Batch, old: SparseDist, minibatch: Tensor) -> Tensor:
    """The gradient of the minibatch's loss: the loss on all its rows in one call, by definition its aggregate."""
    model, ro = models()[1], batch.ro
    model.zero_grad(set_to_none=True)
    T = ro.completion_ids.shape[1]
    loss, _ = LOSSES[cfg.loss](
        rollout_logits(model, ro, minibatch, VOCAB, CHUNK),
        ro.completion_ids[minibatch],
        ro.completion_mask[minibatch],
        batch.adv[minibatch],
        old.samples(minibatch, T),
        agg=cfg.agg,
        norm_len=T,
        **cfg.loss_kwargs(),
    )
    loss.backward()
    return flat_grad(list(model.parameters()))


def check_micro_batching(
    loss: str, level: str, agg: str, batch: Batch, minibatches: list[Tensor], micro_batch_tokens: int
) -> None:
    """`update` with `micro_batch_tokens`, and in one call, each give every minibatch the reference gradient (to
    RTOL of its largest entry; exactly 0 where that is 0) and the same invariant metrics."""
    split, whole = config(loss, level, agg, micro_batch_tokens), config(loss, level, agg, ONE_CALL)
    old = old_policy(whole, models()[0], batch.ro, VOCAB)
    assert old.logp.dtype == torch.float64
    (got, metrics), (one, one_metrics) = (run_update(c, batch, old, minibatches) for c in (split, whole))
    for mb, g, g1 in zip(minibatches, got, one, strict=True):
        ref = reference(whole, batch, old, mb)
        scale = float(ref.abs().max())
        for grad in (g, g1):
            err = float((grad - ref).abs().max())
            assert err <= RTOL * scale, f"max |grad - reference| = {err:.3g} against {scale:.3g}"
    assert "policy" in metrics and metrics.keys() == one_metrics.keys()  # a row without a real token has them too
    for key in INVARIANT:
        if key in one_metrics:
            assert metrics[key] == pytest.approx(one_metrics[key], rel=1e-10, abs=1e-12), key


# every shape of a batch: ragged prompts and completions, completions of padding only, one to seven rows
shapes = st.lists(st.tuples(st.integers(1, 3), st.integers(0, 4)), min_size=1, max_size=7)


@pytest.mark.parametrize("loss,level,agg", CASES)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=shapes, rows=st.integers(1, 3), split=st.booleans(), seed=st.integers(0, 2**16))
def test_micro_batches_give_the_minibatch_gradient(
    loss: str, level: str, agg: str, shapes: list[tuple[int, int]], rows: int, split: bool, seed: int
) -> None:
    batch = make_batch(shapes, seed)
    order = torch.randperm(len(shapes), generator=torch.Generator().manual_seed(seed))
    minibatches = list(order.chunk(2)) if split and len(shapes) > 1 else [order]
    width = max(p for p, _ in shapes) + batch.ro.completion_ids.shape[1]  # padded tokens per row
    check_micro_batching(loss, level, agg, batch, minibatches, rows * width)


@pytest.mark.parametrize("loss,level,agg", CASES)
def test_one_empty_completion_in_eight_with_single_rows(loss: str, level: str, agg: str) -> None:
    """The issue's case: eight samples, one all padding, `--micro_batch_tokens` forcing one row per micro-batch
    (weighting by rows made the gradient 7/8 of the minibatch's at level=sequence); and a minibatch whose every
    row is padding, whose gradient is exactly 0."""
    batch = make_batch([(2, 3), (1, 0), (3, 4), (2, 1), (1, 4), (3, 2), (2, 4), (1, 3)], seed=1)
    check_micro_batching(loss, level, agg, batch, [torch.arange(8)], ONE_ROW)
    empty = make_batch([(2, 0), (1, 0), (3, 0)], seed=2)
    check_micro_batching(loss, level, agg, empty, [torch.arange(3)], ONE_ROW)
