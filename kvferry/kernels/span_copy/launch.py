"""Launches of the span copy's kernel: compiled once per configuration through Triton's JIT, then launched
straight through the driver (:class:`DriverLaunch`) or, where that does not qualify, by calling the compiled
kernel (:class:`Launcher`). Triton's own launcher builds launch metadata and binds every argument in Python on
each call; the direct launches skip that host work.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

from kvferry.kernels.span_copy.cuda import cuda_driver, current_stream, on_ordinal, ordinal, param_sizes
from kvferry.kernels.span_copy.kernel import copy_kernel

log = logging.getLogger("kvferry.kernels.span_copy")

__all__ = ["ARGUMENTS", "DriverLaunch", "Launcher", "Pointer", "launcher"]

#: the kernel's own parameters: the base, the table and the ids (pointers), the number of pieces (int32)
ARGUMENTS = 4


class Pointer:
    """What Triton takes for a pointer argument: an address and an element type (bytes by default)."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: Any = None) -> None:
        import torch

        self.address = address
        self.dtype = torch.uint8 if dtype is None else dtype

    def data_ptr(self) -> int:
        return self.address

    def __repr__(self) -> str:
        return f"<Pointer {self.address:#x} {self.dtype}>"


class DriverLaunch:
    """``cuLaunchKernel`` of one compiled kernel whose arguments are three pointers and an int32, through ctypes.

    Made only for a kernel whose parameters are exactly those four plus Triton's scratch pointers (which must be
    unused: no scratch memory, one CTA per program, no cooperative or programmatic launch), as the driver
    reports them (``cuFuncGetParamInfo``); anything else launches through Triton.
    """

    __slots__ = ("_block", "_function", "_launch", "_lock", "_params", "_shared", "_values")

    def __init__(self, launch: Any, function: int, block: int, shared: int, num_params: int) -> None:
        import ctypes

        self._launch, self._function, self._block, self._shared = launch, function, block, shared
        # the argument values, and the array of their addresses cuLaunchKernel reads (scratch pointers: NULL)
        scratch = [ctypes.c_uint64(0) for _ in range(num_params - ARGUMENTS)]
        self._values = (ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int32(), *scratch)
        self._params = (ctypes.c_void_p * num_params)(*(ctypes.addressof(v) for v in self._values))
        # ctypes lets go of the GIL during the call: one launch at a time reads the shared argument values
        self._lock = threading.Lock()

    @classmethod
    def of(cls, compiled: Any) -> DriverLaunch | None:
        """The driver launch of a kernel Triton compiled and loaded, or None when it does not qualify."""
        metadata = getattr(compiled, "metadata", None)
        function = getattr(compiled, "function", None)
        if metadata is None or not isinstance(function, int) or not function:
            return None
        if (
            getattr(metadata, "num_ctas", 1) != 1
            or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False)
            or getattr(metadata, "global_scratch_size", 0)
            or getattr(metadata, "profile_scratch_size", 0)
        ):
            return None
        driver = cuda_driver()
        if driver is None:
            return None
        sizes = param_sizes(driver, function)
        if (
            sizes is None
            or sizes[:ARGUMENTS] != [8, 8, 8, 4]
            or len(sizes) > ARGUMENTS + 2
            or any(n != 8 for n in sizes[ARGUMENTS:])
        ):
            return None
        return cls(
            driver.cuLaunchKernel, function, 32 * int(metadata.num_warps), int(metadata.shared), len(sizes)
        )

    def __call__(
        self, grid: tuple[int, int, int], stream: int, base: int, table: int, ids: int, count: int
    ) -> bool:
        """Queue the kernel on ``stream`` over ``grid`` programs; False when the driver refused (nothing was
        queued)."""
        with self._lock:
            values = self._values
            values[0].value, values[1].value, values[2].value, values[3].value = base, table, ids, count
            status = self._launch(
                self._function, *grid, self._block, 1, 1, self._shared, stream, self._params, None
            )
        return int(status) == 0

    def __repr__(self) -> str:
        return f"<DriverLaunch {len(self._params)} parameters, {self._block} threads, {self._shared} shared>"


class Launcher:
    """Launches of the kernels, compiled once per configuration: the first launch of a configuration goes through
    Triton's JIT (which compiles and caches); later ones go straight to the driver (:class:`DriverLaunch`), or
    where that does not qualify, call the compiled kernel directly, which saves the JIT's argument binding and
    cache lookup.

    The compiled kernel was specialised on the alignment of its pointer arguments; every launch passes a base
    aligned to 256 bytes and a table from torch's device or pinned host allocator (aligned to 512), as the
    first did.
    """

    __slots__ = ("_compiled", "direct_launches", "driver_launches", "jit_launches")

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], tuple[Any, DriverLaunch | None] | None] = {}
        self.direct_launches = 0
        self.driver_launches = 0
        self.jit_launches = 0

    @staticmethod
    def key(index: int, constants: dict[str, Any]) -> tuple[Any, ...]:
        """What one compiled kernel is kept under: the device and the constants."""
        return (index, *sorted(constants.items()))

    def launch(
        self,
        device: Any,
        grid: tuple[int, int, int],
        table: int,
        count: int,
        base: int,
        constants: dict[str, Any],
        ids: int = 0,
        key: tuple[Any, ...] | None = None,
        stream: int | None = None,
    ) -> None:
        """Launch ``grid`` programs (x, y, z) over the ``count`` rows of the table at device address ``table``
        (and, for an indexed table, the ids at device address ``ids``). ``key``: :meth:`key` of the device and
        ``constants``, when the caller keeps it; ``stream``: the device's current stream, when the caller has
        it (and made the device current: :func:`~kvferry.kernels.span_copy.cuda.on_ordinal`)."""
        import torch

        index = ordinal(device)
        key = self.key(index, constants) if key is None else key
        entry = self._compiled.get(key)
        if entry is not None:
            compiled, driver = entry
            current = contextlib.nullcontext() if stream is not None else on_ordinal(index)
            if stream is None:
                stream = current_stream(index)
            with current:
                if driver is not None and driver(grid, stream, base, table, ids, count):
                    self.driver_launches += 1
                    return
                try:
                    from triton import knobs

                    kernel_constants = {k: v for k, v in constants.items() if k != "num_warps"}
                    args = (
                        Pointer(base),
                        Pointer(table, torch.int64),
                        Pointer(ids, torch.int64),
                        count,
                        *kernel_constants.values(),
                    )
                    compiled.run(
                        *grid,
                        stream,
                        compiled.function,
                        compiled.packed_metadata,
                        compiled.launch_metadata(grid, stream, *args),
                        knobs.runtime.launch_enter_hook,
                        knobs.runtime.launch_exit_hook,
                        *args,
                    )
                    self.direct_launches += 1
                    return
                except (ImportError, AttributeError, TypeError) as exc:
                    # another Triton: launch through its JIT from now on
                    log.info(
                        "direct launch of the span copy unavailable (%s); using Triton's JIT launch", exc
                    )
                    self._compiled[key] = None
        with on_ordinal(index):
            launched = copy_kernel()[grid](
                Pointer(base), Pointer(table, torch.int64), Pointer(ids, torch.int64), count, **constants
            )
        self.jit_launches += 1
        if key not in self._compiled and hasattr(launched, "run") and hasattr(launched, "packed_metadata"):
            self._compiled[key] = (launched, DriverLaunch.of(launched))

    def __repr__(self) -> str:
        return (
            f"<Launcher {len(self._compiled)} compiled, {self.driver_launches} driver, "
            f"{self.direct_launches} direct, {self.jit_launches} JIT launches>"
        )


#: the compiled kernels of this process (Triton's JIT cache is per process too)
launcher = Launcher()
