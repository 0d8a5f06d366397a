"""How the metrics of parts (micro-batches, processes) combine into one row, the rule stated once:

    key ending in "_max"   the max over the parts
    key ending in "_min"   the min over the parts
    any other key          the mean weighted by each part's weight (equal weights: the plain mean)

A part without a key does not count for it. troll.train weights micro-batches by their share of the minibatch
(the same shares that weight their losses); troll.integrations.trl gives every process weight 1.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def merge(parts: Sequence[tuple[float, Mapping[str, float]]]) -> dict[str, float]:
    """One value per key from (weight, metrics) parts (module docstring); a zero total weight gives the mean."""
    out: dict[str, float] = {}
    for key in sorted({k for _, m in parts for k in m}):
        vals = [(w, m[key]) for w, m in parts if key in m]
        if key.endswith("_max"):
            out[key] = max(v for _, v in vals)
        elif key.endswith("_min"):
            out[key] = min(v for _, v in vals)
        else:
            total = sum(w for w, _ in vals)
            out[key] = sum(w * v for w, v in vals) / total if total else sum(v for _, v in vals) / len(vals)
    return out
