"""Fragments, region lookups, wire messages, lazy loading: no peers needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.errors import MissingExtraError, RegionError, WireFormatError
from kvferry.transports import as_fragments, coalesce, get_transport, page_fragments, wire
from kvferry.transports._memory import RegionTable
from kvferry.transports.wire import RegionInfo


def test_as_fragments_validates() -> None:
    assert as_fragments(np.array([[1, 2]], dtype=np.int64)).dtype == np.uint64
    for bad in ([[1, 2, 3]], [[1, -2]], [[1, 0]], [[2**64 - 1, 2]], np.zeros((2, 2), dtype=np.float32)):
        with pytest.raises(ValueError):
            as_fragments(np.asarray(bad))


def test_coalesce_merges_only_when_both_sides_are_contiguous() -> None:
    src = page_fragments(1000, 10, [0, 1, 2, 5, 6])
    dst = page_fragments(9000, 10, [3, 4, 9, 0, 1])
    s, d = coalesce(src, dst)
    assert s.tolist() == [[1000, 20], [1020, 10], [1050, 20]]
    assert d.tolist() == [[9030, 20], [9090, 10], [9000, 20]]


@given(st.lists(st.integers(1, 5), min_size=1, max_size=40), st.randoms(use_true_random=False))
def test_coalesce_moves_the_same_bytes(lengths: list[int], rnd: object) -> None:
    src_off = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    order = list(range(len(lengths)))
    rnd.shuffle(order)  # type: ignore[attr-defined]
    dst_off = np.empty_like(src_off)
    dst_off[order] = np.concatenate(([0], np.cumsum(np.array(lengths)[order])[:-1]))
    src = as_fragments(np.stack([src_off + 100, lengths], axis=1))
    dst = as_fragments(np.stack([dst_off + 5000, lengths], axis=1))

    def mapping(s: np.ndarray, d: np.ndarray) -> dict[int, int]:
        return {int(a) + i: int(b) + i for (a, n), (b, _) in zip(s, d, strict=True) for i in range(int(n))}

    cs, cd = coalesce(src, dst)
    assert mapping(cs, cd) == mapping(src, dst)
    assert len(cs) <= len(src)


def test_region_table_with_overlaps() -> None:
    table = RegionTable([RegionInfo(100, 50, "cpu"), RegionInfo(120, 10, "cpu"), RegionInfo(400, 10, "cpu")])
    assert table.locate(as_fragments([[100, 50], [125, 20], [400, 10]]), "x").tolist() == [0, 0, 2]
    for bad in ([[99, 2]], [[149, 2]], [[405, 6]], [[200, 1]]):
        with pytest.raises(RegionError):
            table.locate(as_fragments(bad), "x")
    with pytest.raises(RegionError):
        RegionTable([]).locate(as_fragments([[1, 1]]), "x")


@given(st.binary(max_size=64), st.binary(max_size=256), st.integers(0, 2**64 - 1))
def test_handshake_round_trip(compat: bytes, body: bytes, version: int) -> None:
    converter = wire.make_converter()
    message = wire.Handshake(version, compat, body)
    assert wire.decode(converter, wire.encode(converter, message), wire.Handshake) == message


def test_malformed_wire_is_refused() -> None:
    converter = wire.make_converter()
    for data in (
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",
        converter.dumps({"wire_version": -1, "compat_hash": b"", "body": b""}),
    ):
        with pytest.raises(WireFormatError):
            wire.decode(converter, data, wire.Handshake)
    extra = converter.dumps({"wire_version": 1, "compat_hash": b"", "body": b"", "surprise": 1})
    with pytest.raises(WireFormatError):
        wire.decode(converter, extra, wire.Handshake)
    with pytest.raises(WireFormatError):
        wire.decode(converter, converter.dumps({"address": 1, "length": 0, "device": "cpu"}), RegionInfo)


def test_importing_kvferry_imports_no_library() -> None:
    code = textwrap.dedent(
        """
        import sys, kvferry, kvferry.transports, kvferry.transports.base, kvferry.transports.wire
        from kvferry.transports import get_transport
        get_transport("local")
        loaded = [m for m in ("nixl", "nixl_cu13", "nixl_cu12", "ucxx") if m in sys.modules]
        assert not loaded, loaded
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_missing_library_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["nixl_cu13"] = None  # as if not installed
        sys.modules["ucxx"] = None
        from kvferry.errors import MissingExtraError
        from kvferry.transports import get_transport, available_transports
        for name, extra in (("nixl", "nixl"), ("ucx", "ucx")):
            try:
                get_transport(name)
            except MissingExtraError as exc:
                assert exc.extra == extra and f"kvferry[{extra}]" in str(exc), exc
            else:
                raise AssertionError(name)
        assert available_transports()["local"] is None
        assert type(get_transport("auto")()).__name__ == "LocalTransport"
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with pytest.raises(LookupError):
        get_transport("carrier-pigeon")
    assert issubclass(MissingExtraError, ImportError)


@pytest.mark.parametrize(
    "layout", ["both scattered", "source in order", "destination in order", "one fragment"]
)
@given(seed=st.integers(0, 2**16), unit=st.sampled_from([1, 2, 8, 64, 4096]), runs=st.integers(1, 12))
def test_device_copy_moves_exactly_the_fragments(layout: str, seed: int, unit: int, runs: int) -> None:
    """The batched copy of the CUDA paths (local on CUDA, nixl by CUDA IPC) cuts rows at the gcd granularity and
    picks a plain, an index_copy, an index_select or a staged copy; on CPU tensors it must move the same bytes."""
    import torch

    from kvferry.transports._memory import device_copy

    rng = np.random.default_rng(seed)
    if layout == "one fragment":
        runs = 1
    lengths = rng.integers(1, 4, runs) * unit
    if layout in ("source in order", "destination in order"):
        lengths[:] = unit * 2  # runs that touch each other, so the in-order side is one run of rows
    slots = int(lengths.max())
    size = slots * runs + unit
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    dst = torch.zeros(size, dtype=torch.uint8)
    order_s = np.arange(runs) if layout in ("source in order", "one fragment") else rng.permutation(runs)
    order_d = np.arange(runs) if layout == "destination in order" else rng.permutation(runs)
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    s_off = order_s * slots if layout != "source in order" else np.arange(runs) * unit * 2
    d_off = order_d * slots if layout != "destination in order" else np.arange(runs) * unit * 2
    src_f = np.stack([base_s + s_off, lengths], axis=1).astype(np.uint64)
    dst_f = np.stack([base_d + d_off, lengths], axis=1).astype(np.uint64)
    device_copy(src, base_s, src_f, dst, base_d, dst_f)
    expected = np.zeros(size, dtype=np.uint8)
    source = src.numpy()
    for (a, n), (b, _) in zip(src_f - [base_s, 0], dst_f - [base_d, 0], strict=True):
        expected[int(b) : int(b) + int(n)] = source[int(a) : int(a) + int(n)]
    assert np.array_equal(dst.numpy(), expected)


def test_granularity_and_row_indices() -> None:
    from kvferry.transports._memory import granularity, row_indices

    assert granularity(np.array([4096, 8192]), np.array([0, 12288]), np.array([4096])) == 4096
    assert granularity(np.array([64, 96])) == 32
    rows = row_indices(np.array([5, 0, 9], dtype=np.int64), np.array([2, 1, 3], dtype=np.int64))
    assert rows.tolist() == [5, 6, 0, 9, 10, 11]
