"""The int64 arrays the mapping passes around: their type, the empty one, and read-only marking.

Arrays the mapping keeps (per pair, per token range, per request) are handed out to many callers, so they are
made read-only: a caller that writes into one gets an error instead of corrupting every later plan.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["EMPTY", "Int64Array", "read_only"]

Int64Array = npt.NDArray[np.int64]

#: the empty int64 array (read-only, shared)
EMPTY: Int64Array = np.zeros(0, dtype=np.int64)
EMPTY.flags.writeable = False


def read_only(array: Int64Array) -> Int64Array:
    """``array``, marked read-only (in place)."""
    array.flags.writeable = False
    return array
