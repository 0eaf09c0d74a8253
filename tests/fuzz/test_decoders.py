"""Fuzz targets: every decoder of a peer's bytes lets out only the error it documents.

One target per decoder: :func:`kvferry.wire.decode` for each control-channel class, the page table
(:meth:`PageTable.decode`), the disaggregation handshake and control messages (``decode_hello``,
``decode_control``), the fragments of a write request (``fragments_from_bytes``) and nixl's backend blob
(``unpack_blob``). Each gets arbitrary bytes, arbitrary msgpack (maps keyed by the class's field names among
others, ints from -2**63 to 2**64 - 1, floats, text, bytes, nested lists and maps), valid messages with parts
replaced, removed or added (nested messages mutated inside their envelope), and valid messages with bytes
flipped or cut. The only exception that may escape is the decoder's own (WireFormatError; PeerIncompatible too
for the handshake): never OverflowError, MemoryError, TypeError, KeyError and the like.

Each target runs twice: a smoke run of a few examples in every suite, and a long run in the slow suite
(``pytest -m slow``). Crashes found are fixed in the decoder and kept as ``@example`` regressions.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvferry import wire
from kvferry.disagg import protocol
from kvferry.errors import PeerIncompatible, WireFormatError
from kvferry.pools.layout import CacheLayout
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import preset
from kvferry.transports import _nixl_exports as nixl_blob
from kvferry.transports import messages
from kvferry.transports._memory import RegionTable
from kvferry.transports.messages import fragments_bytes, fragments_from_bytes

SMOKE_EXAMPLES = 50
SLOW_EXAMPLES = 2000
_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False)


# --- values, mutations ---------------------------------------------------------------------------------------

_BOUNDARY_INTS = [0, 1, -1, 2**31, 2**32, 2**53 + 1, 2**60, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 1 << 30]

_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.sampled_from(_BOUNDARY_INTS),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=24),
)


def values(keys: Sequence[str]) -> st.SearchStrategy[Any]:
    """Any msgpack value; maps are keyed mostly by ``keys`` (field names), so they look like messages."""
    key = st.one_of(st.sampled_from(sorted(keys)), st.text(max_size=6)) if keys else st.text(max_size=6)
    return st.recursive(
        _LEAVES,
        lambda children: st.one_of(
            st.lists(children, max_size=5), st.dictionaries(key, children, max_size=6)
        ),
        max_leaves=16,
    )


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*path, i))
    return out


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        value = value[key]
    return value


@st.composite
def mutated(draw: st.DrawFn, raw: Any, keys: Sequence[str]) -> Any:
    """``raw`` (a decoded msgpack value) with up to three parts replaced, removed, added or repeated."""
    value = copy.deepcopy(raw)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(_paths(value)))
        target = _at(value, path)
        action = draw(st.sampled_from(["replace", "remove", "add", "repeat"]))
        if action == "replace" or (not path and not isinstance(target, dict | list)):
            replacement = draw(values(keys))
            if not path:
                value = replacement
            else:
                _at(value, path[:-1])[path[-1]] = replacement
        elif action == "remove" and path:
            parent = _at(value, path[:-1])
            del parent[path[-1]]
        elif action == "add" and isinstance(target, dict):
            target[draw(st.one_of(st.sampled_from(sorted(keys) or ["x"]), st.text(max_size=6)))] = draw(
                values(keys)
            )
        elif action == "add" and isinstance(target, list):
            target.insert(draw(st.integers(0, len(target))), draw(values(keys)))
        elif action == "repeat" and isinstance(target, list) and target:
            target.extend(copy.deepcopy(target) * draw(st.integers(1, 3)))
    return value


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with bytes flipped, cut or appended."""
    buffer = bytearray(data)
    for _ in range(draw(st.integers(0, 4))):
        if buffer:
            buffer[draw(st.integers(0, len(buffer) - 1))] = draw(st.integers(0, 255))
    if draw(st.booleans()) and buffer:
        del buffer[draw(st.integers(0, len(buffer) - 1)) :]
    return bytes(buffer) + draw(st.binary(max_size=4))


def payloads(
    samples: Sequence[Any], keys: Sequence[str], wrap: Callable[[Any], bytes] = pack
) -> st.SearchStrategy[bytes]:
    """Bytes for a decoder of messages like ``samples`` (decoded msgpack values; ``wrap`` packs one, inside
    its envelope where the decoder reads one)."""
    raws = st.sampled_from(list(samples))
    return st.one_of(
        st.binary(max_size=512),
        values(keys).map(wrap),
        raws.flatmap(lambda raw: mutated(raw, keys)).map(wrap),
        raws.map(wrap).flatmap(damaged),
    )


def field_names(*classes: type) -> list[str]:
    """The field names of ``classes`` and of the attrs classes their fields hold (recursively)."""
    names: set[str] = set()
    todo = list(classes)
    seen: set[type] = set()
    while todo:
        cls = todo.pop()
        if cls in seen or not attrs.has(cls):
            continue
        seen.add(cls)
        for f in attrs.fields(cls):
            names.add(f.name)
            todo += [t for t in _types_in(f.type) if isinstance(t, type)]
    return sorted(names)


def _types_in(annotation: Any) -> list[Any]:
    args = getattr(annotation, "__args__", None)
    return [annotation, *(t for a in args for t in _types_in(a))] if args else [annotation]


def fuzz_target(
    decode: Callable[[bytes], Any],
    strategy: st.SearchStrategy[bytes],
    regressions: Sequence[bytes] = (),
    allowed: tuple[type[BaseException], ...] = (WireFormatError,),
    *,
    slow: bool,
) -> Callable[[], None]:
    """A test that feeds ``strategy``'s bytes (and ``regressions`` first) to ``decode``: it may return or raise
    one of ``allowed``, nothing else."""

    def check(payload: bytes) -> None:
        with contextlib.suppress(*allowed):
            decode(payload)

    test = given(strategy)(check)
    for payload in regressions:
        test = example(payload)(test)
    test = settings(
        max_examples=SLOW_EXAMPLES if slow else SMOKE_EXAMPLES,
        deadline=None,
        suppress_health_check=_HEALTH,
        database=None,
    )(test)
    return pytest.mark.slow(test) if slow else test


# --- transports: the control channel's classes -----------------------------------------------------------

REGION = messages.RegionInfo(1 << 20, 4096, "cpu")
TOP_REGION = messages.RegionInfo(2**64 - 4096, 4096, "cuda:0")  # ends at 2**64 exactly: valid
HELLO = messages.Hello(
    transport="ucx",
    instance_id="instance",
    address="ucx://127.0.0.1:1",
    hostname="host",
    pid=10,
    pid_namespace=20,
    max_message_bytes=16 << 20,
    tag_prefix=3,
    regions=(REGION, TOP_REGION),
    backend=b"backend",
    pid_proof_address=1 << 30,
)
ROWS = fragments_bytes(np.array([[1 << 20, 64], [(1 << 20) + 128, 64]], dtype=np.uint64))
TRANSPORT_SAMPLES: dict[type, list[Any]] = {
    messages.Greeting: [messages.Greeting(wire.TRANSPORT_PROTOCOL_VERSION, bytes(range(32)), True)],
    messages.Challenge: [
        messages.Challenge(wire.TRANSPORT_PROTOCOL_VERSION, bytes(32), bytes(32)),
        messages.Challenge(3, bytes(32), b""),
    ],
    messages.Credentials: [messages.Credentials(bytes(32), b"hash"), messages.Credentials(b"", b"")],
    messages.Welcome: [messages.Welcome(b"hash")],
    messages.Hello: [HELLO, attrs.evolve(HELLO, regions=())],
    messages.RegionsUpdate: [
        messages.RegionsUpdate((REGION, TOP_REGION), b"blob"),
        messages.RegionsUpdate((), b""),
    ],
    messages.WriteRequest: [
        messages.WriteRequest(7, ROWS, 256 << 10, 4 << 20, b"n", ROWS),
        messages.WriteRequest(8, ROWS, 1, 1, None),
    ],
    messages.WriteReply: [
        messages.WriteReply(7, messages.WriteStatus.READY, "", 5),
        messages.WriteReply(7, messages.WriteStatus.FAILED, "why"),
    ],
    messages.WriteAbort: [messages.WriteAbort(7)],
    messages.Refusal: [messages.Refusal("no")],
}

# crashes reported or found, per class: what each decoded to before it was refused
_OVERFLOWING_REGION = {"address": 2**64 - 1, "length": 2, "device": "cpu"}
TRANSPORT_REGRESSIONS: dict[type, list[bytes]] = {
    # bytes(2**60): MemoryError (a lax converter turned the int into bytes)
    messages.Greeting: [
        pack({"wire_version": 3, "nonce": 2**60, "authenticated": True}),
        pack({"wire_version": 1.5, "nonce": "text", "authenticated": [1, 2]}),
    ],
    messages.Credentials: [pack({"proof": 2**60, "compat_hash": b""})],
    # address + length > 2**64: OverflowError in RegionTable, later
    messages.Hello: [pack({**unpack(wire.encode(HELLO)), "regions": [_OVERFLOWING_REGION]})],
    messages.RegionsUpdate: [
        pack({"regions": [_OVERFLOWING_REGION], "backend": b""}),
        pack({"regions": [[1, 2, "cpu"]], "backend": b""}),
    ],
    messages.WriteRequest: [
        pack({"write_id": 1, "dst": 2**62, "zero_copy_bytes": 1, "pack_bytes": 1, "notify": None}),
    ],
    messages.WriteReply: [pack({"write_id": 1, "status": ["ready"]})],
    messages.WriteAbort: [pack({"write_id": True})],
    messages.Refusal: [pack({"reason": b"bytes"})],
}


def _transport_target(cls: type, *, slow: bool) -> Callable[[], None]:
    samples = [unpack(wire.encode(m)) for m in TRANSPORT_SAMPLES[cls]]

    def decode(data: bytes) -> None:
        message: object = wire.decode(data, cls)
        wire.encode(message)  # what decodes encodes again
        if isinstance(message, messages.Hello | messages.RegionsUpdate):
            RegionTable(message.regions)  # what the channel does with them at once

    return fuzz_target(
        decode,
        payloads(samples, field_names(cls)),
        TRANSPORT_REGRESSIONS.get(cls, ()),
        slow=slow,
    )


test_greeting = _transport_target(messages.Greeting, slow=False)
test_greeting_long = _transport_target(messages.Greeting, slow=True)
test_challenge = _transport_target(messages.Challenge, slow=False)
test_challenge_long = _transport_target(messages.Challenge, slow=True)
test_credentials = _transport_target(messages.Credentials, slow=False)
test_credentials_long = _transport_target(messages.Credentials, slow=True)
test_welcome = _transport_target(messages.Welcome, slow=False)
test_welcome_long = _transport_target(messages.Welcome, slow=True)
test_hello = _transport_target(messages.Hello, slow=False)
test_hello_long = _transport_target(messages.Hello, slow=True)
test_regions_update = _transport_target(messages.RegionsUpdate, slow=False)
test_regions_update_long = _transport_target(messages.RegionsUpdate, slow=True)
test_write_request = _transport_target(messages.WriteRequest, slow=False)
test_write_request_long = _transport_target(messages.WriteRequest, slow=True)
test_write_reply = _transport_target(messages.WriteReply, slow=False)
test_write_reply_long = _transport_target(messages.WriteReply, slow=True)
test_write_abort = _transport_target(messages.WriteAbort, slow=False)
test_write_abort_long = _transport_target(messages.WriteAbort, slow=True)
test_refusal = _transport_target(messages.Refusal, slow=False)
test_refusal_long = _transport_target(messages.Refusal, slow=True)


# --- fragments of a write request --------------------------------------------------------------------------

_U64 = st.one_of(st.integers(0, 2**64 - 1), st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**64 - 2]))
FRAGMENT_PAYLOADS = st.one_of(
    st.binary(max_size=256),
    st.lists(st.tuples(_U64, _U64), max_size=16).map(
        lambda rows: fragments_bytes(np.array(rows, dtype=np.uint64).reshape(-1, 2))
    ),
    st.just(ROWS).flatmap(damaged),
)
FRAGMENT_REGRESSIONS = [
    fragments_bytes(np.array([[2**64 - 1, 2]], dtype=np.uint64)),  # wraps around
    fragments_bytes(np.array([[4096, 0]], dtype=np.uint64)),  # empty
    b"\x00" * 15,
]


def _fragments(data: bytes) -> None:
    rows = fragments_from_bytes(data)
    assert rows.dtype == np.uint64 and rows.ndim == 2 and rows.shape[1] == 2
    assert bool((rows[:, 1] > 0).all()) and bool((rows[:, 0] <= ~rows[:, 1]).all())


test_fragments = fuzz_target(_fragments, FRAGMENT_PAYLOADS, FRAGMENT_REGRESSIONS, slow=False)
test_fragments_long = fuzz_target(_fragments, FRAGMENT_PAYLOADS, FRAGMENT_REGRESSIONS, slow=True)


# --- the page table ------------------------------------------------------------------------------------------


def _table(name: str, tp: int, rank: int) -> PageTable:
    layout = CacheLayout.build(preset(name).shard(tp, rank), num_pages=4, num_slots=2, num_draft_pages=3)
    bases, address = {}, 1 << 30
    for _g, pool in layout.pools():
        bases[pool.name] = address
        address += pool.nbytes + 4096
    return PageTable.from_layout(layout, bases)


TABLE = _table("tiny", 1, 0)
TABLE_KEYS = field_names(PageTable)
TABLE_REGRESSIONS = [
    pack({**unpack(TABLE.encode()), "num_layers": 2**64 - 1}),
    pack({**unpack(TABLE.encode()), "pool_groups": [[]] * 100}),
]


def _page_table(data: bytes) -> None:
    PageTable.decode(data).encode()


PAGE_TABLE_PAYLOADS = payloads([unpack(TABLE.encode()), unpack(_table("tiny", 2, 1).encode())], TABLE_KEYS)
test_page_table = fuzz_target(_page_table, PAGE_TABLE_PAYLOADS, TABLE_REGRESSIONS, slow=False)
test_page_table_long = fuzz_target(_page_table, PAGE_TABLE_PAYLOADS, TABLE_REGRESSIONS, slow=True)


# --- disaggregation: handshake and control messages --------------------------------------------------------

PEER_INFO = protocol.PeerInfo(protocol.PeerRole.CONTEXT, "ctx", "ucx", "ucx://127.0.0.1:1", 1, (TABLE,))
HELLO_KEYS = field_names(protocol.Hello, protocol.PeerInfo)


def _in_envelope(info: Any) -> bytes:
    """A PeerInfo (raw) inside a Hello envelope that matches ours: the decoder reaches the body."""
    return wire.encode(protocol.Hello(TABLE.wire_version, TABLE.compat_hash, pack(info)))


def _disagg_hello(data: bytes) -> None:
    protocol.decode_hello(data, wire_version=TABLE.wire_version, compat_hash=TABLE.compat_hash)


DISAGG_HELLO_PAYLOADS = st.one_of(
    payloads([unpack(protocol.encode_hello(PEER_INFO))], HELLO_KEYS),
    payloads([unpack(wire.encode(PEER_INFO))], HELLO_KEYS, wrap=_in_envelope),
)
DISAGG_HELLO_REGRESSIONS = [
    _in_envelope({**unpack(wire.encode(PEER_INFO)), "tp_size": 2**63}),
    _in_envelope({**unpack(wire.encode(PEER_INFO)), "page_tables": []}),
]
test_disagg_hello = fuzz_target(
    _disagg_hello,
    DISAGG_HELLO_PAYLOADS,
    DISAGG_HELLO_REGRESSIONS,
    (WireFormatError, PeerIncompatible),
    slow=False,
)
test_disagg_hello_long = fuzz_target(
    _disagg_hello,
    DISAGG_HELLO_PAYLOADS,
    DISAGG_HELLO_REGRESSIONS,
    (WireFormatError, PeerIncompatible),
    slow=True,
)

_RESULT = protocol.ChunkResult(1, 0, 0, 2, protocol.ChunkStatus.OK, 8, 1)
CONTROL_SAMPLES: list[protocol.ControlBody] = [
    protocol.ContextRequest("k", (1, 2, 3), 4, 5, 0.7, 2, (9,)),
    protocol.ContextDone("k", 3, True, 8, b"state"),
    protocol.ReleaseContext("k"),
    protocol.ReceiveRequest(
        1,
        "k",
        0,
        8,
        (protocol.BlockIds("attention", (1, 2)),),
        1,
        (protocol.StagingArea(0, 4096, 1024),),
    ),
    _RESULT,
    protocol.ChunkResults((_RESULT, attrs.evolve(_RESULT, writer=1, chunk=1))),
    protocol.CancelTransfer(1, "r"),
    protocol.CancelAck(1, "r"),
    protocol.TablesUpdate(2, PEER_INFO),
]
CONTROL_KEYS = field_names(protocol.Control, *(type(m) for m in CONTROL_SAMPLES))
_KIND_OF = {type(m): unpack(protocol.encode_control(m))["kind"] for m in CONTROL_SAMPLES}


@st.composite
def _control_bodies(draw: st.DrawFn) -> bytes:
    """A body mutated inside a Control of its kind (or of another): the decoder reaches the body."""
    message = draw(st.sampled_from(CONTROL_SAMPLES))
    body = draw(mutated(unpack(wire.encode(message)), CONTROL_KEYS))
    kind = draw(st.one_of(st.just(_KIND_OF[type(message)]), st.sampled_from(sorted(_KIND_OF.values()))))
    return pack({"kind": kind, "body": pack(body)})


def _control(data: bytes) -> None:
    protocol.encode_control(protocol.decode_control(data))


CONTROL_PAYLOADS = st.one_of(
    payloads([unpack(protocol.encode_control(m)) for m in CONTROL_SAMPLES], CONTROL_KEYS), _control_bodies()
)
CONTROL_REGRESSIONS = [
    pack({"kind": "chunk_results", "body": pack({"results": []})}),
    pack({"kind": "receive_request", "body": 2**60}),
]
test_control = fuzz_target(_control, CONTROL_PAYLOADS, CONTROL_REGRESSIONS, slow=False)
test_control_long = fuzz_target(_control, CONTROL_PAYLOADS, CONTROL_REGRESSIONS, slow=True)


# --- nixl's backend blob -------------------------------------------------------------------------------------

_BLOB_MARK = b"KVFN1"
_SHARE = (0, b"h" * 64, 1 << 20, 0, b"r" * 32, 8, b"e" * 64, True)
BLOB_KEYS = ["host", "ipc", "new", "nixl", "partial"]
BLOB_REGRESSIONS = [
    _BLOB_MARK + pack({"nixl": 2**60, "ipc": []}),  # reported: bytes(2**60), MemoryError
    _BLOB_MARK + pack({"nixl": b"", "ipc": [[1, 2, 3, [0, 2**62]]]}),  # share[1] read as bytes
    _BLOB_MARK + pack({"nixl": b"", "ipc": [], "host": [[2**64 - 1, 2]]}),  # ends past 2**64
    _BLOB_MARK + pack({"nixl": b"", "ipc": [], "new": [[4096, 1, "cpu" * 20]]}),  # device name too long
]


def _blob_samples() -> list[Any]:
    export = nixl_blob.IpcExport(1 << 30, 1 << 20, 0, _SHARE)
    blobs = [
        nixl_blob.pack_blob(b"meta", [export], host=[REGION]),
        nixl_blob.pack_blob(b"", [export], [b"partial"], [REGION, TOP_REGION], [REGION]),
    ]
    return [unpack(b[len(_BLOB_MARK) :]) for b in blobs]


def _blob(data: bytes) -> None:
    metadata, exports, partial, new, host = nixl_blob.unpack_blob(data)
    assert type(metadata) is bytes and all(type(p) is bytes for p in partial)
    for export in exports:
        assert export.address >= 0 and export.address + export.length <= 2**64
        assert type(export.share[1]) is bytes
    assert all(isinstance(r, messages.RegionInfo) for r in [*new, *host])


def _blob_target(*, slow: bool) -> Callable[[], None]:
    return fuzz_target(
        _blob,
        payloads(_blob_samples(), BLOB_KEYS, wrap=lambda raw: _BLOB_MARK + pack(raw)),
        BLOB_REGRESSIONS,
        slow=slow,
    )


test_nixl_blob = _blob_target(slow=False)
test_nixl_blob_long = _blob_target(slow=True)


def test_nixl_blob_round_trip() -> None:
    """The blob's format is what pack_blob writes; decoded strictly, it gives back what was packed."""
    export = nixl_blob.IpcExport(1 << 30, 1 << 20, 64, _SHARE)
    blob = nixl_blob.pack_blob(b"meta", [export], [b"p"], [REGION, TOP_REGION], [REGION])
    metadata, exports, partial, new, host = nixl_blob.unpack_blob(blob)
    assert (metadata, partial, new, host) == (b"meta", [b"p"], [REGION, TOP_REGION], [REGION])
    assert [(e.address, e.length, e.offset, e.share) for e in exports] == [(1 << 30, 1 << 20, 64, _SHARE)]
    assert nixl_blob.unpack_blob(b"raw agent metadata")[0] == b"raw agent metadata"
    for bad in BLOB_REGRESSIONS:
        with pytest.raises(WireFormatError, match="NIXL backend blob"):
            nixl_blob.unpack_blob(bad)
