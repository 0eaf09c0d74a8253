"""What a ``nixl`` transport tells its peers beyond NIXL's own metadata, and how it maps what they export.

Its backend blob (:attr:`~kvferry.transports.messages.Hello.backend`, and the blob of each
:class:`~kvferry.transports.messages.RegionsUpdate`) is :data:`BLOB_MARK` followed by a msgpack map
(:class:`Blob`): the agent's NIXL metadata (whole in the hello, per new region in updates), the torch IPC handles
of its registered CUDA regions, and its host regions (what a ``process_vm_writev`` writer checks its destinations
against). A blob without the mark is the agent's metadata alone.

A peer of this host whose CUDA regions we can map (:class:`IpcPeer`, one per peer) is written by device copies
into our mapping of its memory instead of through NIXL: :meth:`IpcPeer.route` translates a write's destination
rows into that mapping.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np
import numpy.typing as npt
from attrs import define, field, frozen
from attrs.validators import max_len

from kvferry import wire
from kvferry.errors import WireFormatError
from kvferry.transports._indexed_copy import DeviceDestinations
from kvferry.transports._memory import RegionTable
from kvferry.transports.base import Fragments
from kvferry.transports.messages import RegionInfo
from kvferry.wire import U64, Capped

if TYPE_CHECKING:
    from kvferry.transports.writes import CheckedRows

__all__ = ["BLOB_MARK", "Blob", "IpcExport", "IpcPeer", "IpcRoute", "export_cuda", "pack_blob", "unpack_blob"]

log = logging.getLogger("kvferry.transports.nixl")

#: prefix of our backend blob (NIXL metadata + CUDA IPC exports), msgpack after it
BLOB_MARK = b"KVFN1"
_U64 = wire.UINT64_MAX
#: most items of each list of a blob (exports, partial metadata, new regions, host regions)
_MAX_BLOB_ITEMS = wire.MAX_ARRAY_ITEMS
#: most items of a torch IPC handle (``_share_cuda_()`` gives 8), and most bytes of each
_MAX_SHARE_ITEMS = 16
_MAX_SHARE_BYTES = 4096
#: most bytes of the blob's metadata (the blob travels in Hello.backend, at most 64 MiB)
_MAX_METADATA = 64 << 20


@define(eq=False)
class IpcExport:
    """A registered CUDA region of the peer as it exported it: its address there and a torch IPC handle."""

    address: int
    length: int
    offset: int
    share: tuple[Any, ...]


@define(eq=False)
class IpcPeer:
    """What we mapped of one peer's CUDA regions (by CUDA IPC); ``failed`` once a handle could not be opened."""

    exports: list[IpcExport] = field(factory=list)
    mapped: dict[tuple[int, int, bytes], tuple[Any, int, str]] = field(factory=dict)
    table: RegionTable = field(factory=lambda: RegionTable(()))
    local: np.ndarray[Any, Any] = field(factory=lambda: np.empty(0, dtype=np.uint64))
    starts: np.ndarray[Any, Any] = field(factory=lambda: np.empty(0, dtype=np.uint64))
    #: ``local - starts`` (mod 2**64): what turns the peer's address into ours, per mapped region
    shift: np.ndarray[Any, Any] = field(factory=lambda: np.empty(0, dtype=np.uint64))
    local_table: RegionTable = field(factory=lambda: RegionTable(()))
    failed: bool = False
    #: exports changed since the last mapping
    dirty: bool = True
    #: (the peer's regions, our mapping's table, which mapped region holds each of the peer's regions)
    _exported: tuple[RegionTable, RegionTable, npt.NDArray[np.int64]] | None = None
    #: (the peer's regions, our mapping's local table, where indexed writes find them): kept while both stay
    destinations: tuple[RegionTable, RegionTable, DeviceDestinations] | None = None

    def exported_of(self, regions: RegionTable) -> npt.NDArray[np.int64]:
        """For each range of ``regions`` (the peer's registered regions), the index in :attr:`table` of the
        mapped region that holds it, or -1; kept until the peer's regions or our mapping change."""
        known = self._exported
        if known is None or known[0] is not regions or known[1] is not self.table:
            # a range ending at 2**64 (allowed) as one ending at 2**64 - 1, as far as a fragment can reach
            ranges = np.array(
                [[r.address, min(r.length, _U64 - r.address)] for r in regions.regions], dtype=np.uint64
            ).reshape(-1, 2)
            known = self._exported = (regions, self.table, self.table.holding(ranges))
        return known[2]

    def map(self) -> bool:
        """Open (once) the IPC handles of every region the peer exports; False if one cannot be opened (the
        mapping is then :attr:`failed` for good: writes go through NIXL)."""
        if not self.dirty:
            return True
        import torch

        keys = set()
        for export in self.exports:
            key = (export.address, export.length, bytes(export.share[1]))
            keys.add(key)
            if key in self.mapped:
                continue
            try:
                storage = torch.UntypedStorage._new_shared_cuda(*export.share)
            except Exception as exc:  # any failure only disables the fast path
                log.info("cannot open the peer's CUDA IPC handle (%s); writing through NIXL", exc)
                self.failed = True
                return False
            self.mapped[key] = (
                storage,
                storage.data_ptr() + export.offset,
                f"cuda:{storage.device.index or 0}",
            )
        for key in set(self.mapped) - keys:
            del self.mapped[key]  # re-exported or gone: the mapping of a region the peer no longer offers
        keys_in_order = list(self.mapped)
        self.table = RegionTable([RegionInfo(k[0], k[1], self.mapped[k][2]) for k in keys_in_order])
        self.local = np.array([self.mapped[k][1] for k in keys_in_order], dtype=np.uint64)
        self.starts = np.array([k[0] for k in keys_in_order], dtype=np.uint64)
        self.shift = self.local - self.starts
        self.dirty = False
        self.local_table = RegionTable(
            [RegionInfo(self.mapped[k][1], k[1], self.mapped[k][2]) for k in keys_in_order]
        )
        return True

    @property
    def usable(self) -> bool:
        """The peer exports CUDA regions and none of its handles failed to open so far."""
        return not self.failed and bool(self.exports)

    def route(self, regions: RegionTable, rows: CheckedRows) -> IpcRoute | None:
        """``rows.dst`` (in the peer's ``regions``) translated into our mapping of the peer's CUDA regions, or
        None: the write goes through NIXL (a row in memory the peer did not export, or no mapping)."""
        if not self.usable or len(rows.src) == 0 or not self.map():
            return None
        exported = take(self.exported_of(regions), rows.dst_index)
        if int(exported.min()) < 0:  # a row in memory the peer did not export (host memory, say)
            return None
        translated = rows.dst.copy()
        translated[:, 0] += take(self.shift, exported)
        return IpcRoute(translated, self.local_table, rows.src_index, exported)

    def device_destinations(self, regions: RegionTable) -> DeviceDestinations | None:
        """Where the peer's ``regions`` lie in our mapping, for indexed writes (kept while neither changes), or
        None when it cannot be mapped."""
        if not self.usable or not self.map():
            return None
        known = self.destinations
        if known is None or known[0] is not regions or known[1] is not self.local_table:
            destinations = DeviceDestinations(self.exported_of(regions), self.shift, self.local_table)
            known = self.destinations = (regions, self.local_table, destinations)
        return known[2]


@frozen
class IpcRoute:
    """A write that goes by CUDA IPC: the destination rows in our mapping of the peer's regions, that mapping's
    table (in the order of the peer's), and the regions each source and destination row lies in."""

    dst: Fragments
    table: RegionTable
    src_index: npt.NDArray[np.int64]
    dst_index: npt.NDArray[np.int64]


def take(values: npt.NDArray[Any], index: npt.NDArray[np.int64]) -> npt.NDArray[Any]:
    """``values[index]``, kept a broadcast when ``index`` is one (rows in one range, as
    :meth:`RegionTable.locate` answers them): one lookup instead of one per row."""
    if index.strides == (0,) and len(index):
        return np.broadcast_to(values[int(index[0])], len(index))
    return values[index]


def pack_blob(
    metadata: bytes,
    exports: Sequence[IpcExport],
    partial: Sequence[bytes] = (),
    new: Sequence[RegionInfo] = (),
    host: Sequence[RegionInfo] = (),
) -> bytes:
    """``metadata``: the agent's whole metadata (hello); ``partial``: metadata of the ``new`` regions only
    (updates); ``host``: every host region registered now (what process_vm_writev writers check against)."""
    rows = [[e.address, e.length, e.offset, list(e.share)] for e in exports]
    body = {
        "nixl": metadata,
        "ipc": rows,
        "partial": list(partial),
        "new": [[r.address, r.length, r.device] for r in new],
        "host": [[r.address, r.length] for r in host],
    }
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return BLOB_MARK + packed


def _fail(attribute: Any, message: str) -> ValueError:
    return ValueError(f"{attribute.name}: {message}")


def _check_range(attribute: Any, address: int, length: int) -> None:
    if not (0 <= address <= _U64 and 1 <= length <= _U64 and address + length <= 1 << 64):
        raise _fail(attribute, f"range [{address:#x}, +{length:#x}) is not inside the address space")


def _valid_exports(
    _instance: Any, attribute: Any, rows: tuple[tuple[int, int, int, tuple[Any, ...]], ...]
) -> None:
    for address, length, offset, share in rows:
        _check_range(attribute, address, length)
        if not 0 <= offset <= _U64:
            raise _fail(attribute, f"offset {offset}")
        # torch's handle: (device, handle bytes, size, offset, ref counter bytes, its offset, event bytes, sync)
        if not 2 <= len(share) <= _MAX_SHARE_ITEMS or type(share[1]) is not bytes:
            raise _fail(attribute, "not a torch IPC handle")
        for item in share:
            kind = type(item)
            if kind is int:
                if not 0 <= item <= _U64:
                    raise _fail(attribute, f"IPC handle holds {item}")
            elif kind is bytes:
                if len(item) > _MAX_SHARE_BYTES:
                    raise _fail(attribute, f"IPC handle holds {len(item)} bytes")
            elif kind is not bool and item is not None:
                raise _fail(attribute, f"IPC handle holds a {kind.__name__}")


def _valid_regions(_instance: Any, attribute: Any, rows: tuple[tuple[Any, ...], ...]) -> None:
    for row in rows:
        _check_range(attribute, row[0], row[1])
        if len(row) > 2 and len(row[2]) > 32:
            raise _fail(attribute, "device name too long")


@frozen
class Blob:
    """The msgpack map after :data:`BLOB_MARK` (what :func:`pack_blob` writes), decoded strictly by
    :mod:`kvferry.wire`: every field of its exact type, every int in ``[0, 2**64)``, every range inside the
    address space, every list at most :data:`_MAX_BLOB_ITEMS` long (refused on its length alone)."""

    nixl: bytes = field(validator=max_len(_MAX_METADATA))
    #: ``[address, length, offset, share]``: a CUDA region exported by torch IPC
    ipc: Capped[tuple[U64, U64, U64, Capped[Any]]] = field(
        validator=[max_len(_MAX_BLOB_ITEMS), _valid_exports]
    )
    partial: Capped[bytes] = field(default=(), validator=max_len(_MAX_BLOB_ITEMS))
    #: ``[address, length, device]``
    new: Capped[tuple[U64, U64, str]] = field(
        default=(), validator=[max_len(_MAX_BLOB_ITEMS), _valid_regions]
    )
    #: ``[address, length]``: host memory
    host: Capped[tuple[U64, U64]] = field(default=(), validator=[max_len(_MAX_BLOB_ITEMS), _valid_regions])


def unpack_blob(
    blob: bytes,
) -> tuple[bytes, list[IpcExport], list[bytes], list[RegionInfo], list[RegionInfo]]:
    """What :func:`pack_blob` packed (a blob without our mark is the agent's metadata alone).

    :raises ~kvferry.errors.WireFormatError: on anything else: no other exception escapes.
    """
    if not blob.startswith(BLOB_MARK):
        return blob, [], [], [], []
    try:
        body = wire.decode(blob[len(BLOB_MARK) :], Blob)
    except WireFormatError as exc:
        raise WireFormatError(f"malformed NIXL backend blob: {exc}") from None
    exports = [IpcExport(a, n, o, share) for a, n, o, share in body.ipc]
    new = [RegionInfo(a, n, d) for a, n, d in body.new]
    host = [RegionInfo(a, n, "cpu") for a, n in body.host]
    return body.nixl, exports, list(body.partial), new, host


def export_cuda(tensor: Any) -> IpcExport | None:
    """A torch IPC handle of ``tensor``'s storage (None if torch cannot share it)."""
    try:
        storage = tensor.untyped_storage()
        share = storage._share_cuda_()
    except Exception as exc:  # any failure only disables the fast path
        log.debug("cannot export %s by CUDA IPC: %s", tensor.device, exc)
        return None
    return IpcExport(
        tensor.data_ptr(),
        tensor.numel() * tensor.element_size(),
        tensor.data_ptr() - storage.data_ptr(),
        tuple(share),
    )
