from __future__ import annotations

import copy
import sys
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry import wire
from kvferry.errors import PeerIncompatible, WireFormatError
from kvferry.pools import pagetable
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.pagetable import PageTable, check_compatible, compat_hash
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, preset, preset_names

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def page_tables(draw: st.DrawFn) -> PageTable:
    name = draw(st.sampled_from(preset_names()))
    model = preset(name)
    if draw(st.booleans()):
        model = model.without_drafter()
    dtype = draw(st.sampled_from([None, "float32", "bfloat16", "float16", "float64"]))
    if dtype is not None:
        model = model.with_dtype(dtype)
    # tiny-kimi's 4 KDA heads split over at most 4 ranks
    tp = draw(st.sampled_from([1, 2, 4] if name == "tiny-kimi" else [1, 2, 4, 8]))
    rank = draw(st.integers(0, tp - 1))
    layout = CacheLayout.build(
        model.shard(tp, rank),
        num_pages=draw(st.integers(1, 64)),
        num_slots=draw(st.integers(1, 16)),
        num_draft_pages=draw(st.integers(1, 64)) if model.drafter is not None else 0,
        max_replay_tokens=draw(st.integers(0, 4)),
    )
    bases: dict[str, int] = {}
    address = draw(st.integers(0, 1 << 40))
    pools = [p for _g, p in layout.pools()]
    for pool in draw(st.permutations(pools)):
        bases[pool.name] = address
        address += pool.nbytes + draw(st.integers(0, 4096))
    return PageTable.from_layout(layout, bases)


def _exercise(table: PageTable) -> None:
    """What a consumer does with a decoded table: none of it may raise (no IndexError later)."""
    for group in table.pool_groups:
        layer_group = table.layer_group(group.name)
        for pool in group.pools:
            for entry in pool.entries:
                for slot in (0, pool.num_slots - 1):
                    address = pool.address(slot, entry)
                    assert pool.base <= address and address + entry.nbytes <= pool.base + pool.nbytes
                assert entry.nbytes == layer_group.role_bytes(entry.role)
        for layer_id in layer_group.layer_ids:
            for role in layer_group.roles:
                table.locate(layer_id, role)


def _decode_checked(data: bytes, original: PageTable) -> PageTable | None:
    try:
        table = PageTable.decode(data)
    except WireFormatError:
        return None
    _exercise(table)
    return table


def _paths(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*path, i))
    return out


def _get(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    obj = copy.deepcopy(obj)
    if not path:
        return value
    _get(obj, path[:-1])[path[-1]] = value
    return obj


def _raw(table: PageTable) -> Any:
    return msgpack.unpackb(table.encode(), raw=False)


@SETTINGS
@given(page_tables())
def test_round_trip(table: PageTable) -> None:
    data = table.encode()
    decoded = PageTable.decode(data)
    assert decoded == table
    assert decoded.encode() == data
    _exercise(decoded)


def test_arena_page_table_uses_data_ptrs() -> None:
    layout = CacheLayout.build(preset("tiny").shard(2, 1), num_pages=4, num_slots=2, num_draft_pages=3)
    arena = CacheArena(layout, "cpu")
    table = arena.page_table()
    for group in table.pool_groups:
        for pool in group.pools:
            assert pool.base == arena.pool_tensor(pool.name).data_ptr()
            assert pool.nbytes == arena.pool_tensor(pool.name).numel()
    assert (table.tp_size, table.rank, table.num_layers, table.num_draft_layers) == (2, 1, 7, 1)
    assert table.wire_version == wire.WIRE_VERSION
    assert table.layer_group("draft").layer_ids == (DRAFT_LAYER_SHIFT,)
    assert PageTable.decode(table.encode()) == table


def test_compat_hash_ignores_tp_block_size_name_and_drafter_but_not_shape_or_dtype() -> None:
    tiny = preset("tiny")
    assert compat_hash(tiny) == compat_hash(attrs.evolve(tiny, tokens_per_block=16, name="other"))
    assert tiny.drafter is not None
    other_draft_block = attrs.evolve(tiny, drafter=attrs.evolve(tiny.drafter, tokens_per_block=32))
    assert compat_hash(tiny) == compat_hash(other_draft_block)
    assert compat_hash(tiny) != compat_hash(tiny.with_dtype("bfloat16"))
    # a peer without a drafter still pairs: draft groups are matched (or skipped) when peers are mapped
    assert compat_hash(tiny) == compat_hash(tiny.without_drafter())
    assert compat_hash(tiny) != compat_hash(preset("nemotron-h-8b"))
    a = PageTable.from_layout(
        CacheLayout.build(tiny.shard(1, 0), num_pages=2, num_slots=1, num_draft_pages=1),
        {"attention": 0, "draft": 1 << 20, "mamba2.conv": 2 << 20, "mamba2.ssm": 3 << 20},
    )
    b = attrs.evolve(a, tp_size=4, rank=3)
    check_compatible(a, b)
    with pytest.raises(PeerIncompatible):
        check_compatible(a, attrs.evolve(a, compat_hash="0" * 32))
    with pytest.raises(PeerIncompatible):
        check_compatible(a, attrs.evolve(a, wire_version=wire.WIRE_VERSION + 1))


# --- corruptions -----------------------------------------------------------------------------------------


@SETTINGS
@given(page_tables(), st.data())
def test_truncation_always_fails(table: PageTable, data: st.DataObject) -> None:
    encoded = table.encode()
    cut = data.draw(st.integers(0, len(encoded) - 1))
    with pytest.raises(WireFormatError):
        PageTable.decode(encoded[:cut])
    with pytest.raises(WireFormatError):
        PageTable.decode(encoded + b"\x00")


@SETTINGS
@given(
    page_tables(), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1, max_size=4)
)
def test_byte_flips_fail_or_decode_valid(table: PageTable, flips: list[tuple[int, int]]) -> None:
    encoded = bytearray(table.encode())
    for position, value in flips:
        encoded[position % len(encoded)] = value
    _decode_checked(bytes(encoded), table)


@SETTINGS
@given(page_tables(), st.data(), st.text(min_size=1, max_size=8))
def test_inserted_keys_fail(table: PageTable, data: st.DataObject, key: str) -> None:
    raw = _raw(table)
    maps = [p for p in _paths(raw) if isinstance(_get(raw, p), dict)]
    path = data.draw(st.sampled_from(maps))
    target = _get(raw, path)
    if key in target:
        key = key + "_extra"
    corrupted = _replace(raw, (*path, key), 0) if path else {**raw, key: 0}
    with pytest.raises(WireFormatError):
        PageTable.decode(msgpack.packb(corrupted))


@SETTINGS
@given(page_tables(), st.data())
def test_removed_keys_fail(table: PageTable, data: st.DataObject) -> None:
    raw = _raw(table)
    keys = [p for p in _paths(raw) if p and isinstance(_get(raw, p[:-1]), dict)]
    path = data.draw(st.sampled_from(keys))
    corrupted = copy.deepcopy(raw)
    # fields with defaults may be omitted; everything else must be refused
    del _get(corrupted, path[:-1])[path[-1]]
    _decode_checked(msgpack.packb(corrupted), table)


_OTHER_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.integers(-(1 << 63), (1 << 64) - 1),
    st.sampled_from([-1, 0, 1, 2, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1, DRAFT_LAYER_SHIFT]),
    st.lists(st.integers(0, 8), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_tables(), st.data(), _OTHER_VALUES)
def test_changed_values_fail_or_decode_valid(table: PageTable, data: st.DataObject, value: Any) -> None:
    raw = _raw(table)
    path = data.draw(st.sampled_from([p for p in _paths(raw) if p]))
    corrupted = _replace(raw, path, value)
    decoded = _decode_checked(msgpack.packb(corrupted), table)
    if isinstance(value, bool) and decoded is not None:
        # a bool is never accepted where an int belongs
        assert type(_get(_raw(decoded), path)) is bool


@SETTINGS
@given(page_tables(), st.data())
def test_overlapping_pools_fail(table: PageTable, data: st.DataObject) -> None:
    pools = [p for g in table.pool_groups for p in g.pools]
    if len(pools) < 2:
        return
    a, b = data.draw(st.permutations(pools))[:2]
    shift = data.draw(st.integers(0, b.nbytes - 1))
    raw = _raw(table)
    for g, group in enumerate(raw["pool_groups"]):
        for p, pool in enumerate(group["pools"]):
            if pool["name"] == a.name:
                raw["pool_groups"][g]["pools"][p]["base"] = b.base + shift
    with pytest.raises(WireFormatError, match="overlap"):
        PageTable.decode(msgpack.packb(raw))


# --- targeted ----------------------------------------------------------------------------------------------


def _tiny_table() -> PageTable:
    layout = CacheLayout.build(preset("tiny").shard(1, 0), num_pages=4, num_slots=2, num_draft_pages=3)
    return PageTable.from_layout(
        layout, {"attention": 0, "draft": 1 << 20, "mamba2.conv": 2 << 20, "mamba2.ssm": 3 << 20}
    )


def _mutate(mutator: Any) -> bytes:
    raw = _raw(_tiny_table())
    mutator(raw)
    packed: bytes = msgpack.packb(raw)
    return packed


def _packed(*ids: int) -> bytes:
    """Layer ids as the wire carries a tuple of ints: little-endian int64 values."""
    return b"".join(i.to_bytes(8, "little", signed=True) for i in ids)


def _conv_pool(raw: Any) -> Any:
    return raw["pool_groups"][2]["pools"][0]


@pytest.mark.parametrize(
    ("mutator", "match"),
    [
        (lambda r: r.__setitem__("tp_size", True), "int"),
        (lambda r: r.__setitem__("rank", 1), "rank"),
        (lambda r: r.__setitem__("num_layers", -3), "num_layers"),
        (lambda r: r.__setitem__("num_layers", 4), "layer id 5"),
        (lambda r: _conv_pool(r).__setitem__("slot_stride", 100), "slot_stride"),
        (lambda r: _conv_pool(r).__setitem__("slot_bytes", 4000), "past slot_bytes"),
        (lambda r: _conv_pool(r).__setitem__("num_slots", 3), "slots"),
        (lambda r: _conv_pool(r)["entries"][1].__setitem__("offset", 100), "overlap"),
        (lambda r: _conv_pool(r)["entries"][1].__setitem__("nbytes", 8), "shape needs"),
        (lambda r: _conv_pool(r)["entries"][1].__setitem__("layer_id", 0), "twice"),
        (lambda r: _conv_pool(r)["entries"][1].__setitem__("layer_id", 1), "not a buffer"),
        (lambda r: _conv_pool(r)["entries"].pop(), "need"),
        (lambda r: _conv_pool(r).__setitem__("base", -1), "base"),
        (lambda r: _conv_pool(r).__setitem__("base", (1 << 63) - 10), "end"),
        (lambda r: r["layer_groups"][0].__setitem__("layer_ids", _packed(1, 1)), "twice"),
        (lambda r: r["layer_groups"][0].__setitem__("layer_ids", _packed(1, 2)), "twice"),
        (lambda r: r["layer_groups"][1].__setitem__("layer_ids", _packed(DRAFT_LAYER_SHIFT + 1)), "outside"),
        (lambda r: r["layer_groups"][0].__setitem__("tokens_per_block", 0), "tokens_per_block"),
        (lambda r: r["layer_groups"][0].__setitem__("kind", "state"), "roles"),
        (lambda r: r["layer_groups"][0].__setitem__("dtypes", ["float32", "int4"]), "dtype"),
        (lambda r: r["layer_groups"][0]["heads"].__setitem__("first", 3), "first"),
        (lambda r: r["layer_groups"][2].__setitem__("conv_sections", []), "sections"),
        (lambda r: r["layer_groups"][2].__setitem__("layer_kind", "mlp"), "kind"),
        (lambda r: r["layer_groups"][2].__setitem__("name", "other"), "one to one"),
        (lambda r: r["pool_groups"].append(r["pool_groups"][0]), "duplicate"),
        (lambda r: r.__setitem__("pool_groups", []), "0 pool groups"),
        (lambda r: r.__setitem__("extra", 1), "extra"),
        (lambda r: r.__setitem__("model", 5), "str"),
        (lambda r: r.__setitem__("layer_groups", "abc"), "layer_groups"),
        (lambda r: r["layer_groups"][0].__setitem__("heads", [4, 4, 0, 1]), "heads"),
    ],
)
def test_targeted_corruptions(mutator: Any, match: str) -> None:
    with pytest.raises(WireFormatError, match=match):
        PageTable.decode(_mutate(mutator))


def test_non_msgpack_inputs() -> None:
    for data in (b"", b"\xc1", b"\x91" * 200_000 + b"\xc0", b"\xdd\xff\xff\xff\xff", "text"):
        with pytest.raises(WireFormatError):
            PageTable.decode(data)  # type: ignore[arg-type]
    with pytest.raises(WireFormatError):
        PageTable.decode(msgpack.packb([1, 2, 3]))
    with pytest.raises(WireFormatError):
        PageTable.decode(msgpack.packb(None))


# --- large tables: linear validation, caps -----------------------------------------------------------------


def _big_table(num_layers: int, *, layer_runs: bool = True) -> PageTable:
    """A valid page table of ``num_layers`` layers (the tiny model's pattern repeated). ``layer_runs``: every
    pool gets a run per layer (``layer_stride != 0``, slot-major), where the formula's ``layer`` index counts,
    as a peer may lay its pools out."""
    tiny = preset("tiny")
    model = attrs.evolve(tiny, layer_kinds=(tiny.layer_kinds * (num_layers // 7 + 1))[:num_layers])
    layout = CacheLayout.build(model.shard(1, 0), num_pages=4, num_slots=2, num_draft_pages=3)
    groups = []
    for group in layout.pool_groups:
        pools = []
        for pool in group.pools:
            if layer_runs:
                first: dict[int, int] = {}
                for e in pool.entries:
                    first.setdefault(e.layer_id, e.offset)
                entries = tuple(attrs.evolve(e, offset=e.offset - first[e.layer_id]) for e in pool.entries)
                run = max(e.offset + e.nbytes for e in entries)
                pool = attrs.evolve(
                    pool, entries=entries, slot_bytes=run, layer_stride=run, slot_stride=run * len(first)
                )
            pools.append(pool)
        groups.append(attrs.evolve(group, pools=tuple(pools)))
    layout = attrs.evolve(layout, pool_groups=tuple(groups))
    bases: dict[str, int] = {}
    address = 1 << 30
    for _g, pool in layout.pools():
        bases[pool.name] = address
        address += pool.nbytes + 4096
    return PageTable.from_layout(layout, bases)


class _CountedId(int):
    """A layer id that counts the equality tests made on it: a scan of a tuple of layer ids (``in``, ``index``)
    costs one per item passed, a set or dict lookup at most one."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        _CountedId.comparisons += 1
        return int(self) == other

    def __ne__(self, other: object) -> bool:
        _CountedId.comparisons += 1
        return int(self) != other

    __hash__ = int.__hash__


def _with_counted_ids(table: PageTable) -> PageTable:
    """``table`` with every layer id a :class:`_CountedId`, a distinct object per occurrence (so that no lookup
    ends on identity alone)."""
    counted = _CountedId
    layer_groups = tuple(
        attrs.evolve(g, layer_ids=tuple(counted(i) for i in g.layer_ids)) for g in table.layer_groups
    )
    pool_groups = tuple(
        attrs.evolve(
            g,
            pools=tuple(
                attrs.evolve(
                    p, entries=tuple(attrs.evolve(e, layer_id=counted(e.layer_id)) for e in p.entries)
                )
                for p in g.pools
            ),
        )
        for g in table.pool_groups
    )
    return attrs.evolve(table, layer_groups=layer_groups, pool_groups=pool_groups)


def _validation_work(table: PageTable) -> tuple[int, int]:
    """The work of ``table.validate()`` in counts, not seconds: Python bytecodes executed (every loop written in
    Python, generators included) and equality tests on layer ids (scans inside C, such as ``in`` on a tuple)."""
    counted = _with_counted_ids(table)
    opcodes = 0

    def trace(frame: Any, event: str, _arg: Any) -> Any:
        nonlocal opcodes
        frame.f_trace_opcodes = True
        if event == "opcode":
            opcodes += 1
        return trace

    previous = sys.gettrace()
    _CountedId.comparisons = 0
    sys.settrace(trace)
    try:
        counted.validate()
    finally:
        sys.settrace(previous)
    return opcodes, _CountedId.comparisons


@pytest.mark.parametrize("layer_runs", [True, False])
def test_validation_work_grows_linearly_with_layers(layer_runs: bool) -> None:
    small = _validation_work(_big_table(1000, layer_runs=layer_runs))
    large = _validation_work(_big_table(2000, layer_runs=layer_runs))
    # twice the layers: about twice the work (a quadratic validation did 4x: 7-8 s for 4,000 layers)
    assert large[0] <= 2.3 * small[0], (small, large)
    assert large[1] <= 2.3 * small[1], (small, large)


@pytest.mark.parametrize("num_layers", [4000, 8000])
def test_large_tables_validate(num_layers: int) -> None:
    table = _big_table(num_layers)
    assert PageTable.decode(table.encode()) == table
    # a problem in the very last entry of the largest pool is still found
    raw = _raw(table)
    pool = max((p for g in raw["pool_groups"] for p in g["pools"]), key=lambda p: len(p["entries"]))
    pool["entries"][-1]["layer_id"] = pool["entries"][0]["layer_id"]
    with pytest.raises(WireFormatError, match="held twice"):
        PageTable.decode(msgpack.packb(raw))
    raw = _raw(table)
    raw["layer_groups"][0]["layer_ids"] = raw["layer_groups"][0]["layer_ids"][:-8]
    with pytest.raises(WireFormatError, match="not a buffer"):
        PageTable.decode(msgpack.packb(raw))


def test_caps_on_layers_groups_pools_and_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    table = _tiny_table()
    table.validate()
    with pytest.raises(WireFormatError, match="num_layers"):
        attrs.evolve(table, num_layers=pagetable.MAX_LAYERS + 1).validate()
    with pytest.raises(WireFormatError, match="num_draft_layers"):
        attrs.evolve(table, num_draft_layers=pagetable.MAX_LAYERS + 1).validate()
    many = attrs.evolve(table, pool_groups=table.pool_groups * (pagetable.MAX_GROUPS + 1))
    with pytest.raises(WireFormatError, match="pool groups"):
        many.validate()
    many = attrs.evolve(table, layer_groups=table.layer_groups * (pagetable.MAX_GROUPS + 1))
    with pytest.raises(WireFormatError, match="layer groups"):
        many.validate()
    pools = [p for g in table.pool_groups for p in g.pools]
    entries = sum(len(p.entries) for p in pools)
    monkeypatch.setattr(pagetable, "MAX_POOLS", len(pools) - 1)
    with pytest.raises(WireFormatError, match=rf"{len(pools)} pools \(at most {len(pools) - 1}\)"):
        table.validate()
    monkeypatch.setattr(pagetable, "MAX_POOLS", len(pools))
    monkeypatch.setattr(pagetable, "MAX_ENTRIES", entries - 1)
    with pytest.raises(WireFormatError, match=rf"{entries} entries \(at most {entries - 1}\)"):
        table.validate()
    monkeypatch.setattr(pagetable, "MAX_ENTRIES", entries)
    table.validate()
    monkeypatch.setattr(pagetable, "MAX_LAYERS", 3)
    with pytest.raises(WireFormatError, match="num_layers"):
        table.validate()
