"""The merge rule for metrics of parts (troll/base/metrics.py), shared by troll.train and troll.integrations.trl."""

import pytest

from troll.base.metrics import merge


def test_max_min_and_weighted_mean():
    parts = [(0.25, {"kl_max": 0.1, "ratio_min": 0.9, "policy": 1.0}), (0.75, {"kl_max": 0.3, "ratio_min": 0.95})]
    parts.append((0.75, {"policy": 3.0}))
    assert merge(parts) == pytest.approx({"kl_max": 0.3, "ratio_min": 0.9, "policy": 2.5})


def test_a_largest_magnitude_merges_as_a_max():
    parts = [(1.0, {"mismatch_logratio_absmax": 0.5}), (3.0, {"mismatch_logratio_absmax": 0.1})]
    assert merge(parts) == {"mismatch_logratio_absmax": 0.5}


def test_a_key_counts_only_where_it_was_logged_and_zero_weights_give_the_mean():
    parts = [(0.5, {"entropy": 1.0}), (1.0, {"grad_norm": 2.0}), (1.0, {"grad_norm": 4.0}), (0.0, {"x": 1.0})]
    parts.append((0.0, {"x": 3.0}))
    assert merge(parts) == {"entropy": 1.0, "grad_norm": 3.0, "x": 2.0}
    assert merge([]) == {}


@pytest.mark.slow
def test_optional_backends_are_imported_only_when_asked_for():
    """Importing the trainer and its config loads neither tensorboard nor wandb (`--log_to none`, the default)."""
    import subprocess
    import sys

    code = "import sys, troll.train, troll.base.metrics; print(sorted({'wandb', 'tensorboard'} & set(sys.modules)))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


def test_wandb_logger_sends_numeric_keys_at_the_row_step(tmp_path, monkeypatch):
    """W&B itself is not installed here: a stand-in module records what Logger sends it."""
    import importlib.machinery
    import sys
    import types

    from troll.base.metrics import Logger

    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: calls.append(("init", kw)) or fake
    fake.log = lambda data, step: calls.append(("log", data, step))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logger = Logger("wandb", tmp_path / "my-run", {"lr": 1e-4})
    logger.log({"step": 3, "reward": 0.5, "skipped": 0, "note": "text", "flag": True})
    logger.close()
    assert calls[0] == (
        "init",
        {"project": "troll", "name": "my-run", "dir": str(tmp_path / "my-run"), "config": {"lr": 1e-4}},
    )
    assert calls[1:] == [("log", {"reward": 0.5, "skipped": 0.0}, 3), ("finish",)]


def test_no_logger_does_nothing(tmp_path):
    from troll.base.metrics import Logger

    logger = Logger("none", tmp_path, {})
    logger.log({"step": 1, "reward": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []
