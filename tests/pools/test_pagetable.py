from __future__ import annotations

import copy
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry import wire
from kvferry.errors import PeerIncompatible, WireFormatError
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.pagetable import PageTable, check_compatible, compat_hash
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, preset, preset_names

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def page_tables(draw: st.DrawFn) -> PageTable:
    model = preset(draw(st.sampled_from(preset_names())))
    if draw(st.booleans()):
        model = model.without_drafter()
    dtype = draw(st.sampled_from([None, "float32", "bfloat16", "float16", "float64"]))
    if dtype is not None:
        model = model.with_dtype(dtype)
    tp = draw(st.sampled_from([1, 2, 4, 8]))
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
    return msgpack.packb(raw)


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
