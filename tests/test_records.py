"""Per-token records (troll.run.records): the figures as the update saw them, checked against an independent dense
float64 computation; which samples and steps are recorded; the row's size bound; the reader's one-line refusals."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from troll.base.cli import UsageError
from troll.losses import LOSSES
from troll.rollout import Batch, Rollouts
from troll.run import records
from troll.sparse import sparsify
from troll.tasks import addition

f64 = torch.float64
B, T, V = 6, 4, 7


class Tokenizer:
    """Decodes id i as a letter, so a token's text names its id; id 0 is the special end token ("<e>"), which a
    completion's text leaves out (troll.tasks.task.decode)."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<e>" if i == 0 else chr(ord("a") + i % 26) for i in ids if i or not skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens=False):
        return [self.decode(ids, skip_special_tokens) for ids in seqs]

    def __len__(self):
        return V


def cfg_of(**kw):
    base = dict(records_samples=4, records_every=0, eval_every=5, steps=12, micro_batch_tokens=2 * (2 + T),
                support="rest", k=V, delta=0.0, eps=0.05, level="token", clip_low=0.2, clip_high=0.28,
                loss="troll", logits_chunk=0, bf16=False, max_new_tokens=T, max_prompt_len=2)  # fmt: skip
    return SimpleNamespace(**(base | kw))


def batch_of(seed=0):
    """B samples of T tokens (the last two shorter), a q from other logits, advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([4, 4, 3, 4, 2, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]
    tokens = torch.randint(V, (B, T), generator=g)
    q_logits = torch.randn(B, T, V, generator=g, dtype=f64)
    ro = Rollouts(
        prompt_ids=[[1, 2]] * B, completion_ids=tokens, completion_mask=mask, logprobs=torch.zeros(B, T),
        top_idx=None, top_logp=None, finished=torch.ones(B, dtype=torch.bool), group=torch.zeros(B, dtype=torch.long),
        temperature=1.0,
    )  # fmt: skip
    adv = torch.tensor([1.5, -0.7, 0.9, -1.2, 0.0, 2.0], dtype=torch.float32)
    rows, golds = [10 + i for i in range(B)], ["b" * (i % 3) for i in range(B)]
    return Batch(ro, (adv > 0).float(), adv, torch.Generator().get_state(), 0.0, 0.0, rows, golds), q_logits


def dense_projected_ratio(lp: torch.Tensor, lq: torch.Tensor, y: int, eps: float) -> float:
    """pi*(y) / q(y) by bisection on t of the geometric path pi_t ~ q^(1 - t) p^t (float64, no troll code)."""

    def path(t):
        s = lq + t * (lp - lq)
        return s - torch.logsumexp(s, -1)

    def kl(t):
        lpi = path(t)
        return float((lpi.exp() * (lpi - lq)).sum())

    if kl(1.0) <= eps:
        return math.exp(float(lp[y] - lq[y]))
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if kl(mid) <= eps else (lo, mid)
    return math.exp(float(path(lo)[y] - lq[y]))


def close(got, want, rel=1.2e-3, abs_=1e-12):
    return got is not None and abs(got - want) <= rel * abs(want) + abs_


@pytest.mark.parametrize("loss", ["troll", "ppo_clip", "cispo"])
def test_records_match_a_dense_float64_computation_and_leave_the_loss_alone(loss):
    cfg = cfg_of(loss=loss)
    batch, q_logits = batch_of()
    ro = batch.ro
    old = sparsify(q_logits.reshape(-1, V), ro.completion_ids.reshape(-1), k=V, delta=0.0)  # q exact: K = V
    scale = torch.tensor([0.05, 1.5, 0.1, 2.0], dtype=f64)[:, None]  # some positions move little, some a lot
    p_logits = q_logits + scale * torch.randn(B, T, V, generator=torch.Generator().manual_seed(1), dtype=f64)
    minibatches = [torch.tensor([3, 0, 5]), torch.tensor([1, 4, 2])]  # two optimiser steps, two calls each
    rec = records.Recorder(cfg, Tokenizer(), step=4)
    wrapped = rec.watch(LOSSES[loss], batch, minibatches)
    kwargs = {"support": "rest", "k": V, "delta": 0.0} | ({"eps": 0.05} if loss == "troll" else {})
    for mb in minibatches:
        for rows in ro.micro_batches(cfg.micro_batch_tokens, mb):
            args = (p_logits[rows], ro.completion_ids[rows], ro.completion_mask[rows], batch.adv[rows],
                    old.samples(rows, T))  # fmt: skip
            got, _ = wrapped(*args, **kwargs)
            want, _ = LOSSES[loss](*args, **kwargs)
            assert torch.equal(got, want)  # the wrapper passes the loss through untouched
    row = rec.row()
    assert records.row_problem(json.loads(json.dumps(row))) is None  # what the recorder writes, the reader reads
    assert row["step"] == 5 and row["loss"] == loss and (row["clip_low"], row["clip_high"]) == (0.2, 0.28)
    picked = [s["index"] for s in row["samples"]]
    assert picked == records.pick(batch.adv, 4) == [0, 1, 3, 5]
    seen = {"projected": 0, "inside": 0, "clipped": 0}
    for s in row["samples"]:
        i, a = s["index"], float(batch.adv[s["index"]])
        n = int(ro.completion_mask[i].sum())
        assert len(s["text"]) == n and s["adv"] == pytest.approx(a, rel=1e-3)
        assert s["p_after"] == s["p_before"] == [None] * n  # no model given, `after` not called: unknown, not made up
        ids = ro.completion_ids[i, :n].tolist()
        assert (s["prompt"], s["train_row"], s["gold"]) == ("bc", 10 + i, batch.golds[i])  # what re-checks it
        assert s["completion"] == "".join(chr(ord("a") + y) for y in ids if y)  # the end token left out
        for t in range(n):
            y = int(ro.completion_ids[i, t])
            lp, lq = torch.log_softmax(p_logits[i, t], -1), torch.log_softmax(q_logits[i, t], -1)
            kl = float((lp.exp() * (lp - lq)).sum())
            r = math.exp(float(lp[y] - lq[y]))
            assert s["text"][t] == Tokenizer().decode([y])
            assert close(s["q"][t], math.exp(float(lq[y]))) and close(s["p"][t], math.exp(float(lp[y])))
            assert abs(s["kl"][t] - kl) <= 1e-12 and s["projected"][t] == int(kl > 0.05)  # exact: float64 in, kept
            assert s["log_ratio"][t] == pytest.approx(math.log(r), abs=1e-12)
            assert close(math.exp(s["log_ratio_proj"][t]), dense_projected_ratio(lp, lq, y, 0.05))
            assert s["clipped"][t] == int((a > 0 and r > 1.28) or (a < 0 and r < 0.8))
            seen["projected" if kl > 0.05 else "inside"] += 1
            seen["clipped"] += s["clipped"][t]
    assert all(seen.values()), seen  # the case covers projected, inside and clipped tokens


def test_a_sample_trained_twice_is_recorded_as_its_last_pass_saw_it():
    """With two epochs the p recorded is the second pass's (the network the last update of that sample saw)."""
    cfg = cfg_of(records_samples=2)
    batch, q_logits = batch_of()
    ro = batch.ro
    old = sparsify(q_logits.reshape(-1, V), ro.completion_ids.reshape(-1), k=V, delta=0.0)
    everything = torch.arange(B)
    rec = records.Recorder(cfg, Tokenizer(), step=0)
    wrapped = rec.watch(LOSSES["troll"], batch, [everything, everything])
    shift = 0.0
    for _ in range(2):
        for rows in ro.micro_batches(cfg.micro_batch_tokens, everything):
            logits = q_logits[rows] + shift
            logits[..., 0] += 3.0 * (shift > 0)  # the second pass moves mass onto token 0
            wrapped(logits, ro.completion_ids[rows], ro.completion_mask[rows], batch.adv[rows], old.samples(rows, T))
        shift = 1.0
    for s in rec.row()["samples"]:
        y = int(ro.completion_ids[s["index"], 0])
        logits = q_logits[s["index"], 0].clone()
        logits[0] += 3.0
        assert close(s["p"][0], float(torch.softmax(logits, -1)[y]))


@pytest.mark.parametrize("scale", [1.0, 2e-3])
def test_sequence_level_clip_reads_the_responses_ratio_and_re_derives_from_the_file(scale):
    """Under --level sequence PPO-clip clips GSPO's sequence ratio: every token of a response is cut or none; the
    flags re-derive exactly from the stored log-ratios, at GSPO's 3e-4 clip range too (scale 2e-3: sequence ratios
    within 1e-3 of 1, some inside the range and some out)."""
    cfg = cfg_of(level="sequence", clip_low=3e-4, clip_high=4e-4, records_samples=6)
    batch, q_logits = batch_of()
    ro = batch.ro
    old = sparsify(q_logits.reshape(-1, V), ro.completion_ids.reshape(-1), k=V, delta=0.0)
    noise = torch.randn(B, T, V, generator=torch.Generator().manual_seed(2), dtype=f64)
    p_logits = q_logits + scale * noise
    rec = records.Recorder(cfg, Tokenizer(), step=0)
    wrapped = rec.watch(LOSSES["ppo_clip"], batch, [torch.arange(B)])
    for rows in ro.micro_batches(cfg.micro_batch_tokens, torch.arange(B)):
        wrapped(p_logits[rows], ro.completion_ids[rows], ro.completion_mask[rows], batch.adv[rows],
                old.samples(rows, T), level="sequence")  # fmt: skip
    row = json.loads(json.dumps(rec.row()))  # as the file holds it
    flags = set()
    for s in row["samples"]:
        a, n = float(batch.adv[s["index"]]), len(s["text"])
        lp = torch.log_softmax(p_logits[s["index"], :n], -1)
        lq = torch.log_softmax(q_logits[s["index"], :n], -1)
        y = ro.completion_ids[s["index"], :n, None]
        truth = math.exp(float((lp.gather(-1, y) - lq.gather(-1, y)).mean()))  # GSPO's ratio, dense float64
        seq = math.exp(math.fsum(s["log_ratio"]) / n)  # from the file alone
        assert seq == pytest.approx(truth, rel=1e-14)
        want = int((a > 0 and seq > 1 + 4e-4) or (a < 0 and seq < 1 - 3e-4))
        assert s["clipped"] == [want] * n
        flags |= {(want, a > 0)} if a else set()
    if scale < 1:
        assert {f for f, _ in flags} == {0, 1}, flags  # both sides of the 3e-4 range occur


def test_which_samples_and_steps_are_recorded():
    adv = torch.tensor([0.0, 2.0, -1.0, 2.0, -1.0, 0.5])
    assert records.pick(adv, 4) == [1, 2, 3, 4]  # the two highest, the two lowest, ties to the lower index
    assert records.pick(adv, 3) == [1, 2, 3] and records.pick(adv, 1) == [1] and records.pick(adv, 99) == list(range(6))
    cfg = cfg_of(eval_every=5, steps=12)
    assert [s for s in range(12) if records.due(cfg, s)] == [4, 9, 11]  # the evaluated steps, the last included
    assert [s for s in range(12) if records.due(cfg_of(records_every=3, steps=12), s)] == [2, 5, 8, 11]
    assert not any(records.due(cfg_of(records_samples=0), s) for s in range(12))


def test_a_row_stays_within_its_byte_bound():
    cfg = cfg_of(max_new_tokens=3, records_samples=2, max_prompt_len=5)
    worst, most = -1.234e-100, records.MAX_INTEGER
    sample = {"index": most, "adv": worst, "reward": worst, "prompt": "\u2603" * 5 * records.TEXT_CHARS,
              "train_row": most, "gold": "\u2603" * records.GOLD_CHARS, "completion": "\u2603" * 3 * records.TEXT_CHARS}
    sample |= {"text": ["\u2603" * records.TEXT_CHARS] * 3, "projected": [1] * 3, "clipped": [1] * 3}
    sample |= {k: [worst] * 3 for k in ("q", "p_before", "p", "p_after")}
    sample |= {k: [-1.2345678901234567e-100] * 3 for k in ("kl", "log_ratio", "log_ratio_proj")}  # exact: longest
    row = {"step": most, "loss": "ppo_clip", "eps": worst, "clip_low": worst, "clip_high": worst,
           "level": "sequence", "samples": [sample] * 2}  # fmt: skip
    assert len((json.dumps(row) + "\n").encode()) <= records.row_bytes_bound(cfg)
    assert records.fig(1 / 3) == 0.3333 and records.fig(float("nan")) is None and records.fig(math.inf) is None
    assert records.exact(1 / 3) == 1 / 3 and records.exact(-math.inf) is None


def good_row(step=1):
    sample = {"index": 0, "adv": 1.0, "reward": 1.0, "prompt": "1+2=", "text": ["3", "#"], "q": [0.5, 0.01],
              "p_before": [0.5, 0.015], "p": [0.5, 0.02], "p_after": [0.6, 0.03], "kl": [0.0, 0.07],
              "projected": [0, 1], "log_ratio": [0.0, math.log(2.0)], "log_ratio_proj": [0.0, math.log(1.5)],
              "clipped": [0, 1], "train_row": 12, "gold": "3#", "completion": "3#"}  # fmt: skip
    return {"step": step, "loss": "troll", "eps": 0.05, "clip_low": 0.2, "clip_high": 0.2, "level": "token",
            "samples": [sample]}  # fmt: skip


def sample_with(**fields):
    return good_row() | {"samples": [good_row()["samples"][0] | fields]}


def line_of(row: dict) -> str:
    return json.dumps(row) + "\n"


@pytest.mark.parametrize(
    "content, says",
    [
        (None, "does not exist"),
        ("", "holds no records yet"),
        ("\n" + json.dumps(good_row())[:50], "holds only a torn line"),
        ("{not json\n" + line_of(good_row()), "line 1: not valid JSON"),
        (line_of({"step": 1}), "line 1: loss is missing"),
        (line_of(sample_with(q=[0.5])), "line 1: samples[0].q holds 1 values for 2 tokens"),
        (line_of(sample_with(kl=["x", 1])), 'line 1: samples[0].kl[0] is "x", expected a number or null'),
        # the rows: each passed the old checks and ended troll.tools.inspect in a traceback
        (line_of(sample_with(adv="1.5")), 'line 1: samples[0].adv is "1.5", expected a number or null'),
        (line_of(sample_with(reward=[1.0])), "line 1: samples[0].reward is [1.0], expected a number or null"),
        (line_of(sample_with(prompt=12)), "line 1: samples[0].prompt is 12, expected a string"),
        (line_of(sample_with(projected=[0, None])), "line 1: samples[0].projected[1] is null, expected 0 or 1"),
        (line_of(sample_with(clipped=None)), "line 1: samples[0].clipped is null, expected a list with one value"),
        # ranges, flags, choices, non-finite numbers, unknown fields; the line counted in the file, blank ones too
        (line_of(sample_with(q=[0.5, 1.2])), "line 1: samples[0].q[1] is 1.2, expected a number in [0, 1] or null"),
        (line_of(sample_with(projected=[0, True])), "line 1: samples[0].projected[1] is true, expected 0 or 1"),
        (line_of(sample_with(p_before=[1.0, -2.0])), "line 1: samples[0].p_before[1] is -2.0, expected a number in"),
        (line_of(sample_with(ratio=[1.0, 2.0])), "line 1: samples[0].ratio is not a field of tokens.jsonl (version 3)"),
        (line_of(good_row()).replace('"adv": 1.0', '"adv": NaN'), "line 1: samples[0].adv is NaN"),
        (line_of(good_row()).replace('"reward": 1.0', '"reward": 1' + "0" * 400), "line 1: samples[0].reward is 1000"),
        (line_of(good_row() | {"level": "word"}), 'line 1: level is "word", expected one of "token", "sequence"'),
        (line_of(good_row() | {"step": 0}), "line 1: step is 0, expected an integer in [1, 9007199254740991]"),
        # a step or an index the page's numbers cannot tell from the next one
        (line_of(good_row() | {"step": 2**53}), "line 1: step is 9007199254740992, expected an integer in [1, 9007"),
        (line_of(sample_with(index=2**53 + 1)), "line 1: samples[0].index is 9007199254740993, expected an integer"),
        (line_of(sample_with(gold=85)), "line 1: samples[0].gold is 85, expected a string or null"),
        (line_of(sample_with(train_row=-1)), "line 1: samples[0].train_row is -1, expected an integer >= 0 or null"),
        (line_of(good_row() | {"samples": [[]]}), "line 1: samples[0] is [], expected an object"),
        (line_of(sample_with(entropy=[1, 2])), "line 1: samples[0].entropy is not a field of tokens.jsonl"),
        (line_of(good_row()) + "\n" + line_of(good_row(2) | {"eps": "0.05"}), 'line 3: eps is "0.05", expected a'),
    ],
)
def test_missing_or_damaged_records_are_one_usage_error_naming_the_file_line_and_field(tmp_path, content, says):
    if content is not None:
        (tmp_path / records.FILE).write_text(content)
    with pytest.raises(UsageError) as e:
        records.read(tmp_path)
    message = str(e.value)
    assert message.startswith(str(tmp_path / records.FILE)) and "\n" not in message
    assert says in message, message


def test_the_schema_declares_every_field_the_recorder_writes_and_reads_a_good_row(tmp_path):
    assert records.ROW_KEYS == ("step", "loss", "eps", "clip_low", "clip_high", "level", "samples")
    assert records.FIELDS == ("text", "q", "p_before", "p", "p_after", "kl", "projected", "log_ratio", "log_ratio_proj",
                              "clipped")  # fmt: skip
    assert set(good_row()["samples"][0]) == set(records.SAMPLE_KEYS) and set(good_row()) == set(records.ROW)
    assert records.row_problem(good_row()) is None and records.row_problem(sample_with(p_after=[None, None])) is None
    assert [records.SAMPLE[k].wants() for k in ("q", "projected", "index", "train_row")] == [
        "a number in [0, 1] or null", "0 or 1", "an integer in [0, 9007199254740991]", "an integer >= 0 or null"]
    assert all(spec.since <= records.VERSION for spec in (*records.ROW.values(), *records.SAMPLE.values()))
    assert records.cut(1.0, [0.0, math.log(2.0)], "token", 0.2, 0.2) == good_row()["samples"][0]["clipped"]
    empty = sample_with(**dict.fromkeys(records.FIELDS, []))
    (tmp_path / records.FILE).write_text("\n" + line_of(good_row(1)) + line_of(empty))
    assert [len(r["samples"][0]["text"]) for r in records.read(tmp_path)] == [2, 0]  # an empty completion is whole


def test_a_torn_last_line_is_skipped_as_resume_drops_it(tmp_path):
    (tmp_path / records.FILE).write_text(json.dumps(good_row(1)) + "\n" + json.dumps(good_row(2))[:50])
    assert [r["step"] for r in records.read(tmp_path)] == [1]


def test_a_version_1_file_reads_in_the_newest_fields(tmp_path):
    """Version 1 stored the ratios (4 digits) and no p before the update: read as log-ratios, p_before unknown."""
    v1 = {k: v for k, v in good_row()["samples"][0].items() if k not in ("p_before", "log_ratio", "log_ratio_proj",
                                                                         *NEW_IN_3)}  # fmt: skip
    v1 |= {"ratio": [1.0, 2.0], "ratio_proj": [1.0, 1.5]}
    (tmp_path / records.FILE).write_text(line_of(good_row() | {"samples": [v1]}))
    [row] = records.read(tmp_path)
    unknown = {"p_before": [None, None]} | dict.fromkeys(NEW_IN_3)
    assert row == good_row() | {"samples": [good_row()["samples"][0] | unknown]}
    assert records.row_problem(row) is None  # what the reader returns is a newest-version row


NEW_IN_3 = ("train_row", "gold", "completion")


def test_a_version_2_file_reads_with_its_reward_unchecked(tmp_path):
    """Version 2 kept no problem row, gold or completion: read as unknown (null); a version 2 row with one of them,
    or a version 3 row without, is refused."""
    v2 = {k: v for k, v in good_row()["samples"][0].items() if k not in NEW_IN_3}
    (tmp_path / records.FILE).write_text(line_of(good_row() | {"samples": [v2]}))
    [row] = records.read(tmp_path)
    assert row == good_row() | {"samples": [good_row()["samples"][0] | dict.fromkeys(NEW_IN_3)]}
    assert records.row_problem(row) is None
    half = good_row() | {"samples": [v2 | {"gold": "3#"}]}
    assert records.row_problem(half) == ("samples[0].train_row", "is missing")


def test_a_batch_pickled_before_it_kept_problems_and_golds_records_them_unknown():
    """A pending batch (--staleness) saved in a checkpoint before Batch kept train_rows and golds loads with both
    None (the class's defaults), and its records say so (null) instead of failing."""
    import pickle

    batch, q_logits = batch_of()
    for name in ("train_rows", "golds"):
        del batch.__dict__[name]  # what such a checkpoint pickled: the fields of then
    old = pickle.loads(pickle.dumps(batch))
    assert (old.train_rows, old.golds) == (None, None)
    ro = old.ro
    rec = records.Recorder(cfg_of(records_samples=2), Tokenizer(), step=0)
    q = sparsify(q_logits.reshape(-1, V), ro.completion_ids.reshape(-1), k=V, delta=0.0)
    wrapped = rec.watch(LOSSES["troll"], old, [torch.arange(B)])
    for rows in ro.micro_batches(rec.cfg.micro_batch_tokens, torch.arange(B)):
        wrapped(q_logits[rows], ro.completion_ids[rows], ro.completion_mask[rows], old.adv[rows], q.samples(rows, T))
    row = json.loads(json.dumps(rec.row()))
    assert records.row_problem(row) is None
    assert all((s["train_row"], s["gold"]) == (None, None) and s["completion"] for s in row["samples"])


def test_a_completion_cut_at_the_token_limit_is_recorded_whole_though_the_loss_masks_it():
    """--mask_overlong leaves a cut completion out of the loss (its mask all False): its reward was scored on all
    of its tokens, and so is the completion recorded."""
    batch, _ = batch_of()
    ro = batch.ro
    ro.finished[1], ro.completion_mask[1] = False, False  # sample 1: cut at T tokens, masked
    source = records.Recorder(cfg_of(), Tokenizer(), step=0)._source(batch, 1)
    assert source["completion"] == "".join(chr(ord("a") + y) for y in ro.completion_ids[1].tolist() if y)
    finished = records.Recorder(cfg_of(), Tokenizer(), step=0)._source(batch, 2)["completion"]  # 3 real tokens
    assert finished == "".join(chr(ord("a") + y) for y in ro.completion_ids[2, :3].tolist() if y)


def records_file(tmp_path, steps, damaged=()):
    """A tokens.jsonl of good rows at `steps`, those at `damaged` broken after their step (a field not as declared,
    then text that is not JSON)."""
    lines = []
    for step in steps:
        line = line_of(good_row(step))
        lines.append(line.replace('"eps": 0.05', '"eps": "x", ]{') if step in damaged else line)
    (tmp_path / records.FILE).write_text("".join(lines))


def test_records_read_a_row_whole_only_when_asked_for_it(tmp_path, monkeypatch):
    """A long run's file: every step known from its line's head, only the rows asked for read whole and checked
    (a damaged row not asked for is not read past its step; asked for, it is refused naming its line)."""
    records_file(tmp_path, range(1, 201), damaged={50, 150})
    checked = []
    monkeypatch.setattr(records, "row_problem", lambda row, v=records.VERSION: checked.append(row["step"]))
    recs = records.Records(tmp_path)
    assert recs.steps == list(range(1, 201)) and checked == []
    assert [r["step"] for r in recs.rows({7, 200, 999})] == [7, 200] and checked == [7, 200]
    monkeypatch.undo()
    with pytest.raises(UsageError, match=r"tokens.jsonl line 50: not valid JSON .*: the per-token records are dama"):
        recs.rows({50})
    with pytest.raises(UsageError, match=r"tokens.jsonl line 50: not valid JSON"):
        records.read(tmp_path)  # every row, read whole: the first damaged one refused


@pytest.mark.parametrize(
    "line, says",
    [
        (line_of(good_row(4)).replace('{"step": 4', '{"step": 3, "step": 4'),
         "line 2: step is given twice (3, then 4)"),  # JSON keeps the last
        ('{"step": 07, "loss": "troll"}', "line 2: not valid JSON"),  # a head that is not JSON is read whole
        ('{"step": 9007199254740992, "loss": "troll"}', "line 2: step is 9007199254740992, expected an integer in"),
        ('{"step":1e0}', "line 2: step is 1.0, expected an integer"),
    ],
)
def test_a_row_whose_head_is_not_as_written_is_read_whole(tmp_path, line, says):
    (tmp_path / records.FILE).write_text(line_of(good_row(1)) + line.strip() + "\n")
    with pytest.raises(UsageError) as e:
        records.Records(tmp_path).rows()
    assert says in str(e.value) and "\n" not in str(e.value), str(e.value)



class Digits:
    """A character tokenizer of the addition task: ids 1-13 are "0"-"9", "#", "+" and "=", id 0 the special end
    token."""

    CHARS = "0123456789#+="

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<e>" if i == 0 else self.CHARS[i - 1] for i in ids if i or not skip_special_tokens)

    def batch_decode(self, seqs, skip_special_tokens=False):
        return [self.decode(ids, skip_special_tokens) for ids in seqs]

    def encode(self, text):
        return [self.CHARS.index(c) + 1 for c in text if c in self.CHARS]

    def __len__(self):
        return 14


def test_a_record_re_checks_its_own_reward_from_the_file(tmp_path):
    """A step of the rare addition task recorded and written as a run writes it: reading tokens.jsonl back, each
    sample's prompt and gold are its problem's in the task (its train_row), and the task's reward of its completion
    is the reward it got: the right answer, a wrong one, one without the `#`, and one cut at the token limit."""
    train, tok = addition.problems("train", rare=True), Digits()
    picked = [3, 3, 17, 250]  # rows of task.train, one per sample (the first prompt drawn twice)
    answers = [train[3]["gold"] + "\0", "999#\0", train[17]["gold"][:-1] + "\0", train[250]["gold"] + "#"]
    ids = [[0 if c == "\0" else tok.encode(c)[0] for c in a] for a in answers]
    n, lengths = len(picked), torch.tensor([len(a) for a in ids])
    ro = Rollouts(
        prompt_ids=[tok.encode(train[i]["question"]) for i in picked],
        completion_ids=torch.tensor([a + [0] * (5 - len(a)) for a in ids]),
        completion_mask=torch.arange(5)[None, :] < lengths[:, None], logprobs=torch.zeros(n, 5), top_idx=None,
        top_logp=None,
        finished=torch.tensor([True, True, True, False]), group=torch.tensor([0, 0, 1, 2]), temperature=1.0,
    )  # fmt: skip
    golds = [train[i]["gold"] for i in picked]
    texts = tok.batch_decode(ids, skip_special_tokens=True)  # troll.tasks.task.decode_rollouts' texts
    rewards = torch.tensor([addition.reward(t, g) for t, g in zip(texts, golds, strict=True)])
    assert rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    batch = Batch(ro, rewards, rewards - 0.25, torch.Generator().get_state(), 0.0, 0.0, picked, golds)
    cfg = cfg_of(records_samples=n, max_new_tokens=5, micro_batch_tokens=64, max_prompt_len=8, k=14)
    logits = torch.randn(n, 5, 14, generator=torch.Generator().manual_seed(0), dtype=f64)
    old = sparsify(logits.reshape(-1, 14), ro.completion_ids.reshape(-1), k=14, delta=0.0)
    rec = records.Recorder(cfg, tok, step=0)
    wrapped = rec.watch(LOSSES["troll"], batch, [torch.arange(n)])
    wrapped(logits, ro.completion_ids, ro.completion_mask, batch.adv, old.samples(torch.arange(n), 5))
    (tmp_path / records.FILE).write_text(json.dumps(rec.row()) + "\n")
    [row] = records.read(tmp_path)
    for s in row["samples"]:
        problem = train[s["train_row"]]
        assert (s["prompt"], s["gold"]) == (problem["question"], problem["gold"])  # the prompt: the question
        assert addition.reward(s["completion"], s["gold"]) == s["reward"], s
    assert [s["reward"] for s in row["samples"]] == [1.0, 0.0, 0.0, 0.0]


def test_a_log_ratio_past_a_floats_range_is_an_infinite_ratio_not_a_crash():
    """A hand-edited log-ratio of 710 (exp overflows a float): the ratio is inf, and PPO-clip's rule cuts it for a
    positive advantage (the hypothesis test of troll.tools.inspect found the OverflowError)."""
    import math

    assert records.ratio(710.0) == math.inf and records.ratio(-800.0) == 0.0 and records.ratio(0.0) == 1.0
    assert records.cut(1.0, [710.0, 0.0], "token", 0.2, 0.2) == [1, 0]
    assert records.cut(1.0, [1420.0, 0.0], "sequence", 0.2, 0.2) == [1, 1]
