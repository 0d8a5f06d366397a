"""The task an RL run trains on: problems, a prompt template, a reward, and the text <-> token plumbing around them.

    task, dropped = load_task(cfg, tokenizer)      # Task(train, test, prompt, reward); rows dropped per split
    ids = encode(tokenizer, [task.prompt(r["question"]) for r in rows])
    texts = decode(tokenizer, completion_ids)      # special tokens (EOS, padding) removed
    texts = decode_rollouts(tokenizer, ro)         # the same for sampled troll.rollout.Rollouts, one per sample
    acc, records = evaluate(generator, tokenizer, task, max_new_tokens)   # greedy pass@1 on task.test

Rows are dicts {question, answer (reference solution), gold (the final answer)}. Four tasks: `addition`
(troll.tasks.addition, the tiny CPU task), `rare` (its variant whose rewarded answer format starts rare; `behaviour`
tells a completion that shows it, logged per step as behaviour_rate), `gsm8k` (troll.tasks.gsm8k) and `words`
(troll.tasks.words: arithmetic word problems, prompted and scored as GSM8K is, the real model's CPU task). The reward
maps (completion text, gold) to 0.0 or 1.0; a completion stopped at the token limit is scored by what it completed
(`rewards_of`: GSM8K's format drops a number the limit may have cut, "#### 8" of "#### 85", so it is no answer).
Training, the supervised warm-start and troll.tools.evaluate all go through these functions, so a prompt is tokenised, a
completion decoded and a problem scored the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from troll.tasks import addition, gsm8k, words

if TYPE_CHECKING:
    from troll.rollout import Generator, Rollouts


# tasks prompted and scored as GSM8K is (troll.tasks.gsm8k.make_prompt, troll.tasks.gsm8k.reward): a model trained on
# one of them is scored on another by troll.tools.evaluate (a words run's GSM8K accuracy before and after)
GSM8K_FORMAT = ("gsm8k", "words")


@dataclass
class Task:
    train: list[dict]  # rows with question, answer, gold
    test: list[dict]
    prompt: Callable[[str], str]  # question -> prompt text (special tokens included)
    reward: Callable[[str, str], float]  # (completion text, gold) -> 0.0 or 1.0
    behaviour: Callable[[str], bool] | None = None  # the rewarded behaviour to watch, if the task names one
    cut: Callable[[str], str] | None = None  # what a completion stopped at the token limit completed (None: all of it)


def encode(tokenizer: Any, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of prompts that already hold any special tokens they need (chat templates do)."""
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def decode(tokenizer: Any, seqs: Sequence[Sequence[int]]) -> list[str]:
    """Completion texts of token id sequences, special tokens (EOS, padding) removed."""
    return tokenizer.batch_decode([list(ids) for ids in seqs], skip_special_tokens=True)


def decode_rollouts(tokenizer: Any, ro: Rollouts) -> list[str]:
    """The completion texts of rollouts `ro`: each sample's real tokens (they come first in its row) decoded."""
    return decode(tokenizer, ro.tokens())


def rewards_of(task: Task, texts: Sequence[str], golds: Sequence[str], finished: Any) -> list[float]:
    """Each completion's reward; one stopped at the token limit (`finished` False, [B] bool) is scored by what it
    completed (`task.cut`: for a GSM8K-format task, a number the limit may have cut is no answer)."""
    return _rewards(task.reward, task.cut, texts, golds, [bool(f) for f in finished])


def _rewards(
    reward: Callable[[str, str], float],
    cut: Callable[[str], str] | None,
    texts: Sequence[str],
    golds: Sequence[str],
    finished: Sequence[bool],
) -> list[float]:
    cut = cut or (lambda t: t)
    return [reward(t if f else cut(t), g) for t, g, f in zip(texts, golds, finished, strict=True)]


def score(
    rows: Sequence[dict],
    completions: Sequence[str],
    reward_fn: Callable[[str, str], float],
    finished: Sequence[bool] | None = None,
    cut: Callable[[str], str] | None = None,
) -> tuple[float, list[dict]]:
    """Accuracy in [0, 1] and one record {question, gold, completion, reward} per problem. A completion not
    `finished` (stopped at the token limit; None: all finished) is scored by what it completed (`cut`, as
    `rewards_of`)."""
    golds = [r["gold"] for r in rows]
    done = [True] * len(rows) if finished is None else finished
    rewards = _rewards(reward_fn, cut, completions, golds, done)
    records = [
        {"question": r["question"], "gold": r["gold"], "completion": c, "reward": x}
        for r, c, x in zip(rows, completions, rewards, strict=True)
    ]
    return (sum(rewards) / max(len(records), 1)), records


def stopped(ids: Sequence[Sequence[int]], max_new_tokens: int, eos: Sequence[int]) -> list[bool]:
    """Whether each completion (token ids) finished on its own: shorter than the limit, or ending in an EOS id; the
    rest were stopped at the token limit."""
    return [len(x) < max_new_tokens or (len(x) > 0 and x[-1] in eos) for x in ids]


def load_task(cfg: Any, tokenizer: Any) -> tuple[Task, dict[str, int]]:
    """The task `cfg.task` (a troll.base.config.Config): its data, prompt template and reward. Prompts longer than
    `cfg.max_prompt_len` tokens are dropped; returns the task and how many rows each split lost."""
    if cfg.task in ("addition", "rare"):
        rare = cfg.task == "rare"
        train, test = (addition.problems(split, reverse=cfg.reverse_sum, rare=rare) for split in ("train", "test"))
        task = Task(train, test, lambda q: q, addition.reward, addition.marked if rare else None)
    else:  # GSM8K, or word problems asked and scored as GSM8K is

        def prompt(q: str) -> str:
            return gsm8k.make_prompt(q, tokenizer, chat=cfg.chat, system=cfg.system)

        splits = [words.problems(s) if cfg.task == "words" else gsm8k.load_gsm8k(s, cfg.data) for s in gsm8k.SPLITS]
        task = Task(*splits, prompt, gsm8k.reward, cut=gsm8k.cut_number)
    if cfg.eval_size:
        task.test = task.test[: cfg.eval_size]
    dropped = {}
    for split in ("train", "test"):
        rows = getattr(task, split)
        lengths = [len(ids) for ids in encode(tokenizer, [task.prompt(r["question"]) for r in rows])]
        keep = [r for r, n in zip(rows, lengths, strict=True) if n <= cfg.max_prompt_len]
        if not keep:
            shortest = min(lengths, default=0)
            raise ValueError(
                f"every {split} prompt is longer than --max_prompt_len {cfg.max_prompt_len} (the shortest has "
                f"{shortest} tokens): pass --max_prompt_len {shortest} or more"
            )
        dropped[split] = len(rows) - len(keep)
        setattr(task, split, keep)
    return task, dropped


def evaluate(generator: Generator, tokenizer: Any, task: Task, max_new_tokens: int) -> tuple[float, list[dict]]:
    """Greedy pass@1 on the held-out problems through the rollout backend's own `greedy`, and one record each (a
    completion stopped at the token limit scored by what it completed, as in training)."""
    prompts = encode(tokenizer, [task.prompt(r["question"]) for r in task.test])
    ids = generator.greedy(prompts, max_new_tokens)
    finished = stopped(ids, max_new_tokens, generator.eos_token_ids)
    return score(task.test, decode(tokenizer, ids), task.reward, finished, task.cut)
