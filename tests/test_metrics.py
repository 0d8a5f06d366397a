"""The merge rule for metrics of parts (troll/metrics.py), shared by troll.train and troll.integrations.trl."""

import pytest

from troll.metrics import merge


def test_max_min_and_weighted_mean():
    parts = [(0.25, {"kl_max": 0.1, "ratio_min": 0.9, "policy": 1.0}), (0.75, {"kl_max": 0.3, "ratio_min": 0.95})]
    parts.append((0.75, {"policy": 3.0}))
    assert merge(parts) == pytest.approx({"kl_max": 0.3, "ratio_min": 0.9, "policy": 2.5})


def test_a_key_counts_only_where_it_was_logged_and_zero_weights_give_the_mean():
    parts = [(0.5, {"entropy": 1.0}), (1.0, {"grad_norm": 2.0}), (1.0, {"grad_norm": 4.0}), (0.0, {"x": 1.0})]
    parts.append((0.0, {"x": 3.0}))
    assert merge(parts) == {"entropy": 1.0, "grad_norm": 3.0, "x": 2.0}
    assert merge([]) == {}
