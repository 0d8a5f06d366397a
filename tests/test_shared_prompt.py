"""The shared prompt (troll.policy.shared_prompt_logits, --share_prompt): each distinct prompt forwarded once, its KV
cache gathered for every completion of it, gives the per-sample pass's logits and, through every loss, its gradient.

The reference is the plain per-sample pass (`completion_logits`: every sample's prompt forwarded with it); float64 on
a tiny Llama, so any difference beyond rounding (a wrong position id, a mask letting padding in, a cache row of the
wrong prompt, a gradient not summed over the group) is orders of magnitude above the 1e-10 tolerance. transformers'
RMSNorm computes in float32 whatever the model's dtype, so its backward rounds a gradient to float32: summed over a
group before that rounding (shared) or after it (per sample), two exact gradients then differ by float32's 1e-7. The
tiny model's norms here compute in the model's dtype (`_exact_norms`), so float64 is float64 throughout.
"""

import pytest
import torch

from troll.head import LMHead
from troll.losses import LOSSES
from troll.models.tiny import tiny_llama, train_tokenizer
from troll.policy import completion_logits, shared_prompt_logits
from troll.sparse import sparsify
from troll.tasks import addition

TOL = dict(rtol=0, atol=1e-10)


def _exact_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Every RMSNorm of `model` computed in its own dtype (transformers' casts to float32: module docstring)."""
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            eps = module.variance_epsilon

            def forward(h: torch.Tensor, weight: torch.Tensor = module.weight, eps: float = eps) -> torch.Tensor:
                return weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

            module.forward = forward
    return model


def _tiny(seed: int = 0):
    tok = train_tokenizer(addition.corpus(), vocab_size=64)
    model = _exact_norms(tiny_llama(tok, hidden=32, layers=2, heads=4, seed=seed).double())
    return tok, model


def _batch(tok, n: int = 3, seed: int = 0):
    """Prompts of different lengths (so left padding is exercised), each repeated n times in shuffled order as an
    update's micro-batch holds them, and right-padded completions of different lengths (one of a single token)."""
    g = torch.Generator().manual_seed(seed)
    texts = ["12+34=", "5+7=", "99+1=", "3+3="]
    prompts = [tok.encode(t) for t in texts for _ in range(n)]
    order = torch.randperm(len(prompts), generator=g).tolist()
    prompts = [prompts[i] for i in order]
    B, T = len(prompts), 5
    ids = torch.randint(4, len(tok), (B, T), generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = 1
    mask = torch.arange(T) < lengths[:, None]
    return prompts, ids.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("chunk_rows", [0, 3])
def test_shared_prompt_equals_the_per_sample_pass_in_value(chunk_rows):
    tok, model = _tiny()
    prompts, ids, _ = _batch(tok)
    vocab = len(tok) - 2  # an output layer padded past the tokenizer: those ids stay masked
    with torch.no_grad():
        plain = completion_logits(model, prompts, ids, 0.7, vocab)
        shared = shared_prompt_logits(model, prompts, ids, 0.7, vocab, chunk_rows)
    if chunk_rows:
        assert isinstance(shared, LMHead)
        shared = shared.reshape(-1, plain.shape[-1]).logits().reshape(plain.shape)
    assert plain.dtype == shared.dtype == torch.float64
    torch.testing.assert_close(shared, plain, **TOL)
    assert (shared[..., vocab:] == -torch.inf).all()


def test_a_single_token_completion_needs_only_the_prompt():
    tok, model = _tiny()
    prompts = [tok.encode("12+34="), tok.encode("5+7="), tok.encode("12+34=")]
    ids = torch.tensor([[7], [8], [9]])
    with torch.no_grad():
        shared = shared_prompt_logits(model, prompts, ids, 1.0, len(tok))
        torch.testing.assert_close(shared, completion_logits(model, prompts, ids, 1.0, len(tok)), **TOL)


@pytest.mark.parametrize("loss", ["troll", "ppo_clip", "dppo", "cispo"])
def test_shared_prompt_gives_every_loss_the_per_sample_gradient(loss):
    """The whole update's input: the loss of a micro-batch whose samples share prompts, through the chunked head
    too for TROLL; every parameter's gradient equal to the per-sample pass's, and the loss itself."""
    tok, model = _tiny()
    prompts, ids, mask = _batch(tok, seed=1)
    vocab = len(tok)
    with torch.no_grad():  # the old policy: the network moved a little, so ratios differ from 1 and the region acts
        old_model = _tiny(seed=3)[1]
        old_logits = completion_logits(old_model, prompts, ids, 1.0, vocab)
    old = sparsify(old_logits.reshape(-1, vocab), ids.reshape(-1), k=16, delta=1e-5)
    adv = torch.randn(len(prompts), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    T = ids.shape[1]
    grads, values = [], []
    for scorer, chunk in [(completion_logits, 0), (shared_prompt_logits, 0), (shared_prompt_logits, 4)]:
        if chunk and loss != "troll":
            continue
        model.zero_grad(set_to_none=True)
        logits = scorer(model, prompts, ids, 1.0, vocab, chunk)
        value, _ = LOSSES[loss](logits, ids, mask, adv, old.samples(torch.arange(len(prompts)), T), norm_len=T)
        value.backward()
        values.append(value.detach())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert grads[0].abs().max() > 1e-3  # a gradient that is there to compare
    for value, grad in zip(values[1:], grads[1:], strict=True):
        torch.testing.assert_close(value, values[0], **TOL)
        torch.testing.assert_close(grad, grads[0], **TOL)


def test_gradient_checkpointing_is_refused():
    """Checkpointed layers drop the cache, so the completions would run without their prompt: refused, not wrong."""
    tok, model = _tiny()
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing"):
        shared_prompt_logits(model, [tok.encode("1+1=")], torch.tensor([[5, 6]]), 1.0, len(tok))


# ----------------------------------------------------------------------------- in the RL step (troll.train)


def _step_inputs(**kw):
    """A tiny run's config, model, task and one collected batch (4 prompts x 4 samples)."""
    from troll.base.config import Config
    from troll.models.build import build_model
    from troll.tasks.task import load_task
    from troll.train import collect

    cfg = Config(**(dict(sft_steps=0, prompts_per_step=4, samples_per_prompt=4, minibatches=2, max_new_tokens=4) | kw))
    model, tok = build_model(cfg, torch.device("cpu"))
    task, _ = load_task(cfg, tok)
    return cfg, model, tok, collect(cfg, 0, tok, HalfFinished(model, tok), task)


class HalfFinished:
    """The tiny model's sampler, every other sample marked as ended by EOS (an untrained model rarely samples it)."""

    def __init__(self, model, tok):
        from troll.rollout import HFGenerator

        self.inner = HFGenerator(model, tok)

    def generate(self, *args, **kw):
        ro = self.inner.generate(*args, **kw)
        ro.finished[::2] = True
        return ro

    def push_weights(self, model):
        self.inner.push_weights(model)


def test_minibatches_of_whole_groups():
    """--minibatch_by group: every pass holds each sample once, each minibatch is whole groups, and the split repeats
    from the batch's random state; --minibatch_by sample keeps today's split of shuffled samples."""
    import dataclasses

    from troll.train import minibatches_of

    cfg, _, _, batch = _step_inputs(minibatch_by="group", epochs=2)
    parts = minibatches_of(cfg, batch)
    assert len(parts) == cfg.epochs * cfg.minibatches
    group = batch.ro.group
    for epoch in (parts[:2], parts[2:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(len(batch.ro)))
    for part in parts:
        groups = set(group[part].tolist())
        assert len(part) == 4 * len(groups) == 8  # whole groups of 4, two a minibatch
    assert [p.tolist() for p in minibatches_of(cfg, batch)] == [p.tolist() for p in parts]
    assert len({tuple(sorted(set(group[p].tolist()))) for p in parts}) > 1  # shuffled, not one fixed split
    by_sample = minibatches_of(dataclasses.replace(cfg, minibatch_by="sample"), batch)
    assert any(len(set(group[p].tolist())) > 2 for p in by_sample)  # samples of 3 or more groups in a minibatch


def test_the_old_policy_pass_with_a_shared_prompt_is_the_per_sample_one():
    """troll.train.old_policy with --share_prompt: the same sparse anchor as the per-sample pass, within float32's
    rounding (the tiny model in float32, as a run has it)."""
    import dataclasses

    from troll.train import old_policy

    cfg, model, tok, batch = _step_inputs()
    plain = old_policy(cfg, model, batch.ro, len(tok))
    shared = old_policy(dataclasses.replace(cfg, share_prompt=True), model, batch.ro, len(tok))
    assert torch.equal(plain.idx, shared.idx)
    torch.testing.assert_close(shared.logp, plain.logp, rtol=0, atol=2e-5)


def test_mask_overlong_leaves_cut_samples_out_of_the_loss():
    """--mask_overlong: a sample cut at max_new_tokens has no token in the loss's mask; finished ones keep theirs,
    and the rewards are those of the batch without the setting."""
    cfg, _, _, masked = _step_inputs(mask_overlong=True, max_new_tokens=2)
    _, _, _, plain = _step_inputs(max_new_tokens=2)
    cut = ~plain.ro.finished
    assert cut.any() and (~cut).any()
    assert not masked.ro.completion_mask[cut].any()
    assert torch.equal(masked.ro.completion_mask[~cut], plain.ro.completion_mask[~cut])
    assert torch.equal(masked.rewards, plain.rewards)
