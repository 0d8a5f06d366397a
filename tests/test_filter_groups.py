"""--filter_groups (DAPO's dynamic sampling, without its resampling): the update trains only on groups whose rewards
differ. Locked here: `has_signal` against a loop over the groups, the batch `collect` keeps (exactly the samples of
groups with signal, drawn as the unfiltered batch draws them, groups numbered anew), what the step's row says about
everything drawn, a batch with no signal kept whole."""

import random

import pytest
import torch
from test_shared_prompt import HalfFinished, _step_inputs

from troll.advantages import has_signal
from troll.run.diagnostics import StepTimer, step_row


def _reference_signal(rewards: list[float], group: list[int]) -> list[bool]:
    """A sample's group has signal when two of its rewards differ: a loop over each group's rewards."""
    by_group: dict[int, set[float]] = {}
    for r, g in zip(rewards, group, strict=True):
        by_group.setdefault(g, set()).add(r)
    return [len(by_group[g]) > 1 for g in group]


@pytest.mark.parametrize("seed", range(20))
def test_has_signal_matches_a_loop(seed):
    rng = random.Random(seed)
    groups = rng.randint(1, 6)
    group = [rng.randrange(groups) for _ in range(rng.randint(1, 24))]
    values = rng.choice([(0.0, 1.0), (0.0, 0.5, 1.0, -2.0), (3.0,)])
    rewards = [rng.choice(values) for _ in group]
    got = has_signal(torch.tensor(rewards), torch.tensor(group))
    assert got.tolist() == _reference_signal(rewards, group)


def test_has_signal_refuses_what_advantages_refuse():
    with pytest.raises(ValueError, match="NaN or inf"):
        has_signal(torch.tensor([0.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="both be"):
        has_signal(torch.zeros(3), torch.zeros(2, dtype=torch.long))


def _collect(monkeypatch, rewards: list[float], **kw):
    """The tiny run's batch 0 (4 prompts x 4 samples: test_shared_prompt's) with the given rewards, filtered or not,
    and the task it was drawn from."""
    import troll.train
    from troll.tasks.task import load_task

    monkeypatch.setattr(troll.train, "rewards_of", lambda task, texts, golds, finished: list(rewards))
    cfg, model, tok, batch = _step_inputs(**kw)
    return cfg, model, tok, load_task(cfg, tok)[0], batch


def test_collect_keeps_exactly_the_groups_with_signal(monkeypatch):
    """Groups 1 and 3 have signal (their rewards differ), 0 and 2 do not: the filtered batch is the unfiltered batch's
    samples 4-7 and 12-15, in order, as groups 0 and 1, with their rewards, advantages, problems and golds; the step
    row's reward and signal share are those of all 16 samples drawn."""
    rewards = [0.0] * 4 + [1.0, 0.0, 0.0, 1.0] + [1.0] * 4 + [0.0, 0.0, 0.0, 1.0]
    *_, whole = _collect(monkeypatch, rewards)
    cfg, model, tok, task, kept = _collect(monkeypatch, rewards, filter_groups=True)
    idx = torch.tensor([4, 5, 6, 7, 12, 13, 14, 15])
    assert torch.equal(kept.ro.completion_ids, whole.ro.completion_ids[idx])
    assert torch.equal(kept.ro.completion_mask, whole.ro.completion_mask[idx])
    assert [whole.ro.prompt_ids[i] for i in idx.tolist()] == kept.ro.prompt_ids
    assert kept.ro.group.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert torch.equal(kept.rewards, whole.rewards[idx]) and torch.equal(kept.adv, whole.adv[idx])
    assert kept.adv.ne(0).all() and whole.adv[[0, 1, 2, 3, 8, 9, 10, 11]].eq(0).all()
    assert kept.train_rows == [whole.train_rows[i] for i in idx.tolist()]
    assert kept.golds == [whole.golds[i] for i in idx.tolist()]
    assert torch.equal(kept.drawn[0], whole.rewards) and torch.equal(kept.drawn[1], whole.ro.group)
    assert torch.equal(kept.rng_state, whole.rng_state)  # the minibatches are shuffled as the whole batch's

    from troll.sparse import sparsify  # a stand-in old policy: the row reads only its mismatch with the sampler

    logits = torch.zeros(len(kept.ro) * kept.ro.completion_ids.shape[1], len(tok))
    trainer = sparsify(logits, kept.ro.completion_ids.reshape(-1), k=4, delta=0.0)
    timer = StepTimer()
    for phase in ("old_policy", "update", "kl_update", "sync"):
        with timer(phase):
            pass
    row = step_row(0, kept, [kept], trainer, {}, 0, 1e-5, timer, torch.device("cpu"), task, tok)
    assert row["reward"] == pytest.approx(sum(rewards) / 16)
    assert row["signal_frac"] == pytest.approx(0.5) and row["trained_frac"] == pytest.approx(0.5)


def test_a_step_on_the_kept_groups_trains_on_signal_only(monkeypatch):
    """rl_step on a filtered batch: every token it trains on has an advantage (frac_no_signal 0); the row says so."""
    import troll.train
    from troll.run.start import make_optimizer

    rewards = [0.0] * 4 + [1.0, 0.0, 0.0, 1.0] + [1.0] * 4 + [0.0, 0.0, 0.0, 1.0]
    cfg, model, tok, task, _ = _collect(monkeypatch, rewards, filter_groups=True)
    opt, sched = make_optimizer(cfg, model)
    row = troll.train.rl_step(cfg, 0, model, tok, HalfFinished(model, tok), opt, sched, task)
    assert row["frac_no_signal"] == 0.0 and row["signal_frac"] == 0.5 and row["trained_frac"] == 0.5


def test_a_batch_without_signal_stays_whole(monkeypatch):
    *_, whole = _collect(monkeypatch, [1.0] * 16, filter_groups=True)
    assert len(whole.ro) == 16 and whole.drawn is None and whole.adv.eq(0).all()
