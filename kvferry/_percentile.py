"""Nearest-rank percentiles, the one rule every figure kvferry reports uses (p50 <= p99 always, every value one
that was measured)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["nearest_rank"]


def nearest_rank(ordered: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0 < q <= 100) of ``ordered`` (sorted ascending); None for no values."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
