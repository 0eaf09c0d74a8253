"""What the span copy asks of CUDA directly: libcuda through ctypes (a kernel's parameters, its launch, an
upload from pinned memory), the current stream and device, and the device's multiprocessors.

The driver's own calls cost a few microseconds of host time each, where torch's and Triton's wrappers build
objects and bind arguments in Python first; everything that has no driver here falls back to torch.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

__all__ = [
    "cuda_driver",
    "current_stream",
    "multiprocessors",
    "on_device",
    "on_ordinal",
    "ordinal",
    "param_sizes",
    "upload_async",
]


@functools.cache
def cuda_driver() -> Any:
    """libcuda through ctypes, with the signatures used here; None where it does not load."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
        launch = driver.cuLaunchKernel
        info = driver.cuFuncGetParamInfo
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    launch.argtypes = [
        ctypes.c_void_p,
        *(ctypes.c_uint,) * 7,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
    ]
    info.restype = ctypes.c_int
    info.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    upload = getattr(driver, "cuMemcpyHtoDAsync_v2", None)
    if upload is not None:
        upload.restype = ctypes.c_int
        upload.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return driver


def upload_async(device_address: int, host_address: int, nbytes: int, stream: int) -> bool:
    """Queue a copy of ``nbytes`` from pinned host memory to device memory on ``stream`` (the driver's call);
    False when it could not be queued."""
    driver = cuda_driver()
    upload = None if driver is None else getattr(driver, "cuMemcpyHtoDAsync_v2", None)
    return upload is not None and int(upload(device_address, host_address, nbytes, stream)) == 0


def param_sizes(driver: Any, function: int) -> list[int] | None:
    """The byte size of each parameter of a loaded kernel, as the driver reports them."""
    import ctypes

    sizes: list[int] = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    for index in range(16):
        if driver.cuFuncGetParamInfo(function, index, ctypes.byref(offset), ctypes.byref(size)) != 0:
            return sizes if sizes else None
        sizes.append(int(size.value))
    return None


def current_stream(index: int) -> int:
    """The handle of device ``index``'s current stream (torch's raw query where it has one: no Stream object
    is made)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(index))
    return int(torch.cuda.current_stream(index).cuda_stream)


def on_ordinal(index: int) -> Any:
    """``torch.cuda.device(index)``, or nothing to do when it is current already (the common case)."""
    import torch

    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


def ordinal(device: Any) -> int:
    """The ordinal of a torch CUDA device: its index, or the current device's."""
    import torch

    return int(device.index) if device.index is not None else int(torch.cuda.current_device())


def on_device(device: Any) -> Any:
    """:func:`on_ordinal` of a torch CUDA device (its index, or the current device)."""
    return on_ordinal(ordinal(device))


def multiprocessors(device: Any) -> int:
    """The multiprocessors of a torch CUDA device."""
    return _multiprocessors_of(ordinal(device))


@functools.cache
def _multiprocessors_of(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).multi_processor_count)
