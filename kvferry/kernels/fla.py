"""flash-linear-attention (``fla``, the optional ``fla-core`` package): whether its Triton kernels can run here,
and its op modules, imported only when asked for (``import kvferry`` never imports it).

kvferry calls two of its op families on CUDA: ``fla.ops.kda`` (KimiLinear's delta attention,
:mod:`~kvferry.kernels.kda`) and ``fla.ops.simple_gla`` (gated linear attention with one decay per head, which
is Mamba2's chunked scan, :mod:`~kvferry.kernels.ssd`). Elsewhere, and for float64, kvferry's own torch
arithmetic runs.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

__all__ = ["fla_ops", "fla_runs"]


@functools.cache
def _imports(ops: str) -> bool:
    try:
        importlib.import_module(f"fla.ops.{ops}")
    except ImportError:
        return False
    return True


def fla_runs(ops: str, device: torch.device) -> bool:
    """Whether ``fla.ops.<ops>`` can run on ``device``: a CUDA device where the module imports."""
    return device.type == "cuda" and _imports(ops)


def fla_ops(ops: str) -> ModuleType:
    """The module ``fla.ops.<ops>`` (the caller checked :func:`fla_runs`)."""
    return importlib.import_module(f"fla.ops.{ops}")
