"""The ceiling every transfer benchmark sets its figures against: a copy of the same bytes inside one process.

On host memory that is a memcpy (numpy's ``copyto`` of byte views: libc's ``memcpy``, one thread, the fastest
host copy we measured; torch's ``copy_`` of uint8 runs about 0.6x of it on ``cpu-2core``); on CUDA memory a
device copy (``copy_`` and a synchronise). A benchmark times it alternately with what it measures, so that load
from other processes hits both alike, and stores per point :func:`ratio_key`: the copy's seconds over the
point's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["CopyCeiling", "ratio_key"]


def ratio_key(device: str) -> str:
    """The name of a row's ratio to the ceiling: ``ratio_memcpy`` on the host, ``ratio_device_copy`` on CUDA."""
    return "ratio_memcpy" if device == "cpu" else "ratio_device_copy"


class CopyCeiling:
    """A copy of ``nbytes`` on ``device`` between two buffers of its own (touched once, so that page faults are
    not timed)."""

    def __init__(self, nbytes: int, device: str = "cpu", src: torch.Tensor | None = None) -> None:
        """``src``: copy from this uint8 tensor (at least ``nbytes`` long) instead of a buffer of our own."""
        import torch

        self.nbytes = nbytes
        self.device = device
        self._src = (
            src[:nbytes]
            if src is not None
            else torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
        )
        self._dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._copy: Callable[[], object]
        if device == "cpu":
            import numpy as np

            src_view, dst_view = self._src.numpy(), self._dst.numpy()
            self._copy = lambda: np.copyto(dst_view, src_view)
        else:
            self._copy = lambda: self._dst.copy_(self._src)
        self.run()  # first touch of both buffers

    @property
    def key(self) -> str:
        return ratio_key(self.device)

    def run(self) -> None:
        """Copy once and wait for it (the device synchronised)."""
        self._copy()
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize(self.device)

    def seconds(self) -> float:
        """One timed copy."""
        began = time.perf_counter()
        self.run()
        return time.perf_counter() - began
