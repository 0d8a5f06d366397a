"""Helpers shared by the benchmarks (`from bench._util import ...`): the benchmark reward and small measuring tools.

Reward. An untrained model never adds correctly, so the addition reward would be 0 for every sample, every
advantage 0 and the update a no-op in value (though not in cost). The benches therefore score completions with
`parity_reward`: 1.0 when the sum of the completion text's code points is odd, else 0.0. On the untrained tiny
model (near-uniform over ~260 byte tokens) that is a fair coin per sample, so almost every group of 8 carries a
non-zero advantage. (`odd_length_reward`, 1.0 for an odd number of characters, is the other option: on the
untrained model nearly every completion runs to max_new_tokens = 5 characters, so most groups tie and carry
no signal.) Both take the completion text with special tokens removed, as troll's `Task.reward` does.

Argument types (`int_at_least`, from troll.base.config, `positive_float`, `comma_list`): a bad value is an argparse
error naming the flag (exit 2, no traceback), before anything is built or measured.
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
from collections.abc import Callable, Iterable

from troll.base.config import int_at_least  # noqa: F401  (the benchmarks import it from here)


def parity_reward(completion: str, gold: str = "") -> float:
    """1.0 when the sum of the code points of `completion` is odd (module docstring)."""
    return float(sum(map(ord, completion)) % 2)


def odd_length_reward(completion: str, gold: str = "") -> float:
    """1.0 when `completion` has an odd number of characters."""
    return float(len(completion) % 2)


REWARDS = {"parity": parity_reward, "odd_length": odd_length_reward}


def cpu_user() -> float:
    """CPU user seconds of this process so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def comma_list(allowed: Iterable[str]) -> Callable[[str], str]:
    """An argparse type: a comma-separated list of `allowed` words, returned as given."""
    allowed = list(allowed)

    def parse(text: str) -> str:
        bad = [x for x in text.split(",") if x not in allowed]
        if bad or not text:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma list of {','.join(allowed)}")
        return text

    return parse
