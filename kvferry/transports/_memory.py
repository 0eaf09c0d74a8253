"""Registered memory: range lookups that refuse what lies outside, and byte views of registered ranges."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import numpy as np
import numpy.typing as npt

from kvferry.errors import RegionError
from kvferry.transports.base import Fragments, Registration
from kvferry.transports.wire import RegionInfo

if TYPE_CHECKING:
    import torch

__all__ = ["CopyPlan", "RegionTable", "TensorRegistration", "byte_view", "device_of", "region_infos"]

#: copies longer than this are cut so the event loop gets a turn between pieces
COPY_SLICE_BYTES = 4 << 20


def device_of(tensor: torch.Tensor) -> str:
    if tensor.device.type == "cpu":
        return "cpu"
    if tensor.device.type == "cuda":
        return f"cuda:{tensor.device.index if tensor.device.index is not None else 0}"
    raise ValueError(f"cannot register memory on device {tensor.device}")


class TensorRegistration(Registration):
    """The registration handle every transport hands out; ``backend`` holds the library's own handle."""

    __slots__ = ("_active", "_tensors", "backend", "infos")

    def __init__(self, tensors: Sequence[torch.Tensor], backend: Any = None) -> None:
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError("registered tensors must be contiguous")
            if tensor.numel() == 0:
                raise ValueError("cannot register an empty tensor")
            device_of(tensor)
        self._tensors = tuple(tensors)
        self._active = True
        self.backend = backend
        self.infos = region_infos(self._tensors)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self._tensors

    @property
    def active(self) -> bool:
        return self._active

    def deactivate(self) -> None:
        self._active = False

    @property
    def nbytes(self) -> int:
        return sum(info.length for info in self.infos)

    def __repr__(self) -> str:
        state = "active" if self._active else "deregistered"
        return f"<Registration [{len(self._tensors)} tensors, {self.nbytes} bytes | {state}]>"


def region_infos(tensors: Sequence[torch.Tensor]) -> tuple[RegionInfo, ...]:
    return tuple(RegionInfo(t.data_ptr(), t.numel() * t.element_size(), device_of(t)) for t in tensors)


class RegionTable:
    """Registered ranges, for checking that fragments lie inside them.

    Ranges may overlap. A fragment ``[a, a + n)`` is inside iff some range with ``start <= a`` ends at or
    after ``a + n``; the range with the largest end among those starting at or before ``a`` decides, so one
    ``searchsorted`` over a running maximum answers every fragment at once.
    """

    __slots__ = ("_best", "_best_end", "_starts", "regions")

    def __init__(self, regions: Sequence[RegionInfo]) -> None:
        self.regions = tuple(regions)
        starts = np.array([r.address for r in self.regions], dtype=np.uint64)
        ends = np.array([r.address + r.length for r in self.regions], dtype=np.uint64)
        order = np.argsort(starts, kind="stable")
        self._starts = starts[order]
        best = np.empty(len(order), dtype=np.int64)
        best_end = np.empty(len(order), dtype=np.uint64)
        current, current_end = -1, 0
        for i, j in enumerate(order):
            if current < 0 or int(ends[j]) > current_end:
                current, current_end = int(j), int(ends[j])
            best[i], best_end[i] = current, current_end
        self._best = best
        self._best_end = best_end

    def __len__(self) -> int:
        return len(self.regions)

    def locate(self, fragments: Fragments, what: str) -> npt.NDArray[np.int64]:
        """The index (into ``regions``) of a registered range holding each fragment.

        :raises ~kvferry.errors.RegionError: naming the first fragment outside every range.
        """
        if len(fragments) == 0:
            return np.empty(0, dtype=np.int64)
        if not self.regions:
            raise RegionError(f"{what}: no memory is registered")
        addresses = fragments[:, 0]
        ends = addresses + fragments[:, 1]
        pos = np.searchsorted(self._starts, addresses, side="right").astype(np.int64) - 1
        ok = pos >= 0
        clipped = np.maximum(pos, 0)
        ok &= self._best_end[clipped] >= ends
        if not bool(ok.all()):
            bad = int(np.flatnonzero(~ok)[0])
            raise RegionError(
                f"{what}: fragment {bad} [{int(addresses[bad]):#x}, +{int(fragments[bad, 1])}) "
                "is outside every registered region"
            )
        return self._best[clipped]


class _CudaArray:
    """Just enough of ``__cuda_array_interface__`` for torch to view a raw device range."""

    def __init__(self, address: int, length: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (length,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
        }


def byte_view(info: RegionInfo) -> Any:
    """A uint8 view of a registered range: a numpy array for host memory, a torch tensor for CUDA memory.

    The caller guarantees the range stays registered (alive) while the view is used.
    """
    if info.device == "cpu":
        buffer = (ctypes.c_uint8 * info.length).from_address(info.address)
        return np.ctypeslib.as_array(buffer)
    import torch

    return torch.as_tensor(_CudaArray(info.address, info.length), device=info.device)


class CopyPlan:
    """Row-by-row copies between two sets of registered ranges in one process."""

    def __init__(
        self,
        src: Fragments,
        src_regions: RegionTable,
        dst: Fragments,
        dst_regions: RegionTable,
    ) -> None:
        self.src, self.dst = src, dst
        self.src_index = src_regions.locate(src, "source")
        self.dst_index = dst_regions.locate(dst, "destination")
        self.src_regions, self.dst_regions = src_regions, dst_regions

    async def run(self) -> None:
        """Copy every row, yielding to the event loop between slices; CUDA copies are synchronised at the end."""
        views: dict[tuple[int, int], Any] = {}

        def view(table: RegionTable, side: int, index: int) -> Any:
            key = (side, index)
            if key not in views:
                views[key] = byte_view(table.regions[index])
            return views[key]

        uses_cuda = False
        since_yield = 0
        for row in range(len(self.src)):
            s_info = self.src_regions.regions[int(self.src_index[row])]
            d_info = self.dst_regions.regions[int(self.dst_index[row])]
            s_view = view(self.src_regions, 0, int(self.src_index[row]))
            d_view = view(self.dst_regions, 1, int(self.dst_index[row]))
            s_off = int(self.src[row, 0]) - s_info.address
            d_off = int(self.dst[row, 0]) - d_info.address
            length = int(self.src[row, 1])
            on_host = s_info.device == "cpu" and d_info.device == "cpu"
            uses_cuda |= not on_host
            done = 0
            while done < length:
                n = min(COPY_SLICE_BYTES, length - done)
                a, b = s_off + done, d_off + done
                if on_host:
                    d_view[b : b + n] = s_view[a : a + n]
                else:
                    _torch_copy(d_view, b, s_view, a, n)
                done += n
                since_yield += n + 4096
                if since_yield >= COPY_SLICE_BYTES:
                    since_yield = 0
                    await anyio.lowlevel.checkpoint()
        if uses_cuda:
            import torch

            await anyio.to_thread.run_sync(torch.cuda.synchronize)


def _torch_copy(dst: Any, d_off: int, src: Any, s_off: int, n: int) -> None:
    import torch

    d = dst[d_off : d_off + n] if isinstance(dst, torch.Tensor) else torch.from_numpy(dst[d_off : d_off + n])
    s = src[s_off : s_off + n] if isinstance(src, torch.Tensor) else torch.from_numpy(src[s_off : s_off + n])
    d.copy_(s, non_blocking=True)
