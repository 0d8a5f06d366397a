"""The supervised warm-start (troll/run/warmstart.py): the one-forward `greedy_solves` equals greedy decoding (the
reference: transformers `generate`); `warm_start` stops at the first step where the batch it fitted and then the
probe reach the target (checked against the loop written out with `generate`); a missed target is reported."""

import pytest
import torch

from troll.base.config import Config
from troll.models.build import build_model
from troll.policy import completion_logits
from troll.rollout import HFGenerator
from troll.run.warmstart import adamw, answer_batch, greedy_solves, warm_start
from troll.tasks import addition

ROWS = addition.problems("train")
SFT = dict(lr=1e-3, batch=64, seed=0, probe=256)
TARGET = 0.1


def prompt(question: str) -> str:
    return question


def fresh():
    return build_model(Config(seed=0), torch.device("cpu"))


@pytest.fixture(scope="module")
def partly_trained():
    """A model stopped at 10% of the probe solved: some problems solved, most not."""
    model, tokenizer = fresh()
    record = warm_start(model, tokenizer, ROWS, prompt, steps=600, target=TARGET, **SFT)
    return model, tokenizer, record


@pytest.mark.slow
def test_greedy_solves_equals_greedy_decoding(partly_trained):
    model, tokenizer, _ = partly_trained
    rows = ROWS[:256] + addition.problems("test")[:256]
    prompts, answers, mask = answer_batch(tokenizer, rows, prompt)
    solved = greedy_solves(model, prompts, answers, mask, len(tokenizer))
    decoded = HFGenerator(model, tokenizer).greedy(prompts, max_new_tokens=6)  # room to run past the eos
    expected = [out == ids[m].tolist() for out, ids, m in zip(decoded, answers, mask, strict=True)]
    assert solved.tolist() == expected
    assert 0 < sum(expected) < len(rows)  # both outcomes occur, so the comparison can fail
    # for addition the reward is an exact match, so the solved share is greedy pass@1
    texts = tokenizer.batch_decode(decoded, skip_special_tokens=True)
    rewards = [addition.reward(t, r["gold"]) for t, r in zip(texts, rows, strict=True)]
    assert solved.float().mean().item() == pytest.approx(sum(rewards) / len(rows))


def test_answer_batch_pads_and_masks_answers_of_any_length():
    _, tokenizer = fresh()
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "10+90=", "answer": "100"}]
    prompts, answers, mask = answer_batch(tokenizer, rows, prompt)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    two, one, zero = (tokenizer.convert_tokens_to_ids(c) for c in "210")
    assert answers.tolist() == [[two, eos, pad, pad], [one, zero, zero, eos]]
    assert mask.tolist() == [[True, True, False, False], [True, True, True, True]]
    assert prompts == [tokenizer("1+1=")["input_ids"], tokenizer("10+90=")["input_ids"]]


@pytest.mark.slow
def test_warm_start_stops_at_the_first_step_where_batch_and_probe_meet_the_target(partly_trained):
    """The reference: the same supervised steps written out, the batch's solved share read from generate on the
    batch before the step, the probe's from generate after it; the first step where both reach the target. The
    optimiser is warm_start's own: over hundreds of float32 steps, rounding apart (fused against torch's loop)
    moves the step where the target is met."""
    _, _, record = partly_trained
    model, tokenizer = fresh()
    generator = HFGenerator(model, tokenizer)
    opt = adamw(list(model.parameters()), lr=SFT["lr"])  # warm_start's optimiser, itself locked to torch's loop below
    gen = torch.Generator().manual_seed(SFT["seed"])
    probe = ROWS[: SFT["probe"]]

    def greedy_accuracy(rows) -> float:
        texts = tokenizer.batch_decode(generator.greedy([tokenizer(r["question"])["input_ids"] for r in rows], 4))
        return sum(t == r["answer"] + tokenizer.eos_token for t, r in zip(texts, rows, strict=True)) / len(rows)

    for step in range(1, record["sft_steps_run"] + 1):
        drawn = [ROWS[i] for i in torch.randint(len(ROWS), (SFT["batch"],), generator=gen).tolist()]
        batch_acc = greedy_accuracy(drawn)
        prompts, ids, mask = answer_batch(tokenizer, drawn, prompt)
        nll = -torch.log_softmax(completion_logits(model, prompts, ids, 1.0, len(tokenizer)), -1)
        loss = (nll.gather(-1, ids[..., None])[..., 0] * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        met = batch_acc >= TARGET and greedy_accuracy(probe) >= TARGET
        assert met == (step == record["sft_steps_run"]), step  # not before, and at the step it stopped
    assert record["sft_reached"] and record["sft_probe_acc"] == pytest.approx(greedy_accuracy(probe))
    assert loss.item() == pytest.approx(record["sft_loss"], rel=1e-5)


def test_warm_start_reports_a_missed_target_and_rejects_a_bad_one():
    model, tokenizer = fresh()
    before = [p.detach().clone() for p in model.parameters()]
    missed = warm_start(model, tokenizer, ROWS, prompt, steps=3, target=1.0, **SFT)
    assert missed["sft_steps_run"] == 3 and not missed["sft_reached"] and missed["sft_probe_acc"] < 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # it trained
    plain = warm_start(model, tokenizer, ROWS, prompt, steps=3, **SFT)  # no target: every step, then one probe
    assert plain["sft_steps_run"] == 3 and plain["sft_reached"] and 0.0 <= plain["sft_probe_acc"] < 1.0
    with pytest.raises(ValueError, match="target must be in"):
        warm_start(model, tokenizer, ROWS, prompt, steps=3, target=1.5, **SFT)


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_is_torchs_default_adamw_to_float_rounding(weight_decay):
    """The fused optimiser troll builds (on CPU here) against torch's default per-tensor AdamW, in float64 over five
    steps of the same gradients: the weights agree to 1e-12 and the moments too."""
    torch.manual_seed(0)
    weights = [torch.randn(7, 5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    fused = [torch.nn.Parameter(w.clone()) for w in weights]
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = adamw(fused, lr=1e-2, weight_decay=weight_decay)
    ref = torch.optim.AdamW(plain, lr=1e-2, weight_decay=weight_decay)
    assert opt.defaults["fused"] and not ref.defaults["fused"]
    for _ in range(5):
        grads = [torch.randn_like(w) for w in weights]
        for params, o in ((fused, opt), (plain, ref)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.clone()
            o.step()
    for p, q in zip(fused, plain, strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-12)
        assert (p - weights[0 if p.dim() == 2 else 1]).abs().max() > 1e-3  # the steps moved the weights
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(opt.state[p][key], ref.state[q][key], rtol=0, atol=1e-12)
