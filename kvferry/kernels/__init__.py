"""Memory copies, the one copy stack under pools and transports alike: blocks and fragments of byte arenas
(:mod:`~kvferry.kernels.copy`), rows by index (:mod:`~kvferry.kernels.rows`), rows packed into a host buffer and
back for offload (:mod:`~kvferry.kernels.host_copy`), and the batched Triton span copy on CUDA
(:mod:`~kvferry.kernels.span_copy`).

Kernels import nothing from the rest of kvferry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry._lazy import lazy_exports

if TYPE_CHECKING:
    from kvferry.kernels.copy import copy_blocks as copy_blocks
    from kvferry.kernels.copy import gather_blocks as gather_blocks
    from kvferry.kernels.copy import gather_fragments as gather_fragments
    from kvferry.kernels.copy import scatter_blocks as scatter_blocks
    from kvferry.kernels.copy import scatter_fragments as scatter_fragments
    from kvferry.kernels.copy import zero_blocks as zero_blocks
    from kvferry.kernels.host_copy import RowSection as RowSection
    from kvferry.kernels.host_copy import from_host as from_host
    from kvferry.kernels.host_copy import to_host as to_host
    from kvferry.kernels.rows import copy_by_rows as copy_by_rows
    from kvferry.kernels.rows import copy_rows as copy_rows
    from kvferry.kernels.rows import granularity as granularity
    from kvferry.kernels.rows import row_indices as row_indices

#: public name -> module that defines it
_LAZY: dict[str, str] = {
    "copy_blocks": "kvferry.kernels.copy",
    "gather_blocks": "kvferry.kernels.copy",
    "gather_fragments": "kvferry.kernels.copy",
    "scatter_blocks": "kvferry.kernels.copy",
    "scatter_fragments": "kvferry.kernels.copy",
    "zero_blocks": "kvferry.kernels.copy",
    "RowSection": "kvferry.kernels.host_copy",
    "from_host": "kvferry.kernels.host_copy",
    "to_host": "kvferry.kernels.host_copy",
    "copy_by_rows": "kvferry.kernels.rows",
    "copy_rows": "kvferry.kernels.rows",
    "granularity": "kvferry.kernels.rows",
    "row_indices": "kvferry.kernels.rows",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
