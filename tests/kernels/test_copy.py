from __future__ import annotations

import itertools
from collections.abc import Callable
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvferry.errors import ConfigError
from kvferry.kernels import copy as copy_module
from kvferry.kernels.copy import (
    block_view,
    copy_blocks,
    gather_blocks,
    gather_fragments,
    scatter_blocks,
    scatter_fragments,
    zero_blocks,
)

DEVICES = [
    "cpu",
    pytest.param("cuda:0", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")),
]
SETTINGS = settings(max_examples=60, deadline=None)


def _arena(nbytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).to(device)


# slow, obviously correct references: one byte at a time, on Python lists


def _ref_copy(
    data: list[int], offset: int, stride: int, size: int, src: list[int], dst: list[int]
) -> list[int]:
    out = list(data)
    for s, d in zip(src, dst, strict=True):
        for i in range(size):
            out[offset + d * stride + i] = data[offset + s * stride + i]
    return out


def _ref_gather(data: list[int], fragments: list[tuple[int, int]]) -> list[int]:
    out: list[int] = []
    for start, length in fragments:
        out += [data[start + i] for i in range(length)]
    return out


def _ref_scatter(data: list[int], fragments: list[tuple[int, int]], staging: list[int]) -> list[int]:
    out = list(data)
    k = 0
    for start, length in fragments:
        for i in range(length):
            out[start + i] = staging[k]
            k += 1
    return out


@st.composite
def blocks_case(draw: st.DrawFn) -> tuple[int, int, int, int, list[int], list[int]]:
    count = draw(st.integers(1, 12))
    size = draw(st.integers(0, 24))
    stride = size + draw(st.integers(0, 8))
    offset = draw(st.integers(0, 16))
    dst = draw(st.lists(st.integers(0, count - 1), unique=True, max_size=count))
    src = draw(st.lists(st.integers(0, count - 1), min_size=len(dst), max_size=len(dst)))
    return count, size, stride, offset, src, dst


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(case=blocks_case(), seed=st.integers(0, 1000))
def test_copy_blocks_matches_reference(
    device: str, case: tuple[int, int, int, int, list[int], list[int]], seed: int
) -> None:
    count, size, stride, offset, src, dst = case
    nbytes = offset + count * stride + 5
    arena = _arena(nbytes, seed, device)
    expected = _ref_copy(arena.tolist(), offset, stride, size, src, dst)
    view = block_view(arena, count=count, stride=stride, block_bytes=size, offset=offset)
    copy_blocks(view, src, dst)
    assert arena.tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(case=blocks_case(), seed=st.integers(0, 1000))
def test_gather_scatter_zero_blocks(
    device: str, case: tuple[int, int, int, int, list[int], list[int]], seed: int
) -> None:
    count, size, stride, offset, src, dst = case
    arena = _arena(offset + count * stride, seed, device)
    data = arena.tolist()
    view = block_view(arena, count=count, stride=stride, block_bytes=size, offset=offset)
    gathered = gather_blocks(view, src)
    assert gathered.tolist() == [data[offset + s * stride : offset + s * stride + size] for s in src]
    out = torch.empty((len(src), size), dtype=torch.uint8, device=device)
    assert gather_blocks(view, torch.tensor(src, dtype=torch.int32), out=out).data_ptr() == out.data_ptr()
    assert out.tolist() == gathered.tolist()
    payload = _arena(len(dst) * size, seed + 1).reshape(len(dst), size)
    scatter_blocks(view, np.array(dst), payload)  # from host memory
    expected = list(data)
    for row, d in enumerate(dst):
        expected[offset + d * stride : offset + d * stride + size] = payload[row].tolist()
    assert arena.tolist() == expected
    zero_blocks(view, dst)
    for d in dst:
        expected[offset + d * stride : offset + d * stride + size] = [0] * size
    assert arena.tolist() == expected


@st.composite
def fragments_case(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    nbytes = draw(st.integers(1, 200))
    # disjoint fragments in random order: cut [0, nbytes) at sorted points, keep some pieces
    cuts = sorted(draw(st.lists(st.integers(0, nbytes), max_size=12)))
    edges = [0, *cuts, nbytes]
    pieces = [(a, b - a) for a, b in itertools.pairwise(edges)]
    kept = draw(st.lists(st.sampled_from(pieces), unique=True, max_size=len(pieces))) if pieces else []
    return nbytes, kept


@pytest.mark.parametrize("device", DEVICES)
@SETTINGS
@given(case=fragments_case(), seed=st.integers(0, 1000), as_numpy=st.booleans())
def test_fragments_round_trip(
    device: str, case: tuple[int, list[tuple[int, int]]], seed: int, as_numpy: bool
) -> None:
    nbytes, fragments = case
    arena = _arena(nbytes, seed, device)
    table = (
        np.array(fragments, dtype=np.int64).reshape(-1, 2)
        if as_numpy
        else torch.tensor(fragments).reshape(-1, 2)
    )
    staging = gather_fragments(arena, table)
    assert staging.tolist() == _ref_gather(arena.tolist(), fragments)
    buffer = torch.full((len(staging) + 3,), 7, dtype=torch.uint8, device=device)
    assert gather_fragments(arena, table, buffer).tolist() == staging.tolist()
    new = _arena(len(staging), seed + 1)
    expected = _ref_scatter(arena.tolist(), fragments, new.tolist())
    scatter_fragments(arena, table, new)
    assert arena.tolist() == expected


@st.composite
def rows_case(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]]]:
    """Disjoint fragments, in random order, cut at multiples of a unit from a shifted base: g = gcd(unit, shift)
    takes every value from 1 (odd shifts) to 64, so each row width (uint8 .. int64) is exercised."""
    unit = draw(st.sampled_from([1, 2, 3, 4, 8, 12, 16, 64]))
    shift = draw(st.sampled_from([0, 0, 1, 2, 4, 8, 24]))
    units = draw(st.integers(1, 40))
    nbytes = shift + units * unit + draw(st.integers(0, 9))
    cuts = sorted(draw(st.lists(st.integers(0, units), max_size=16)))
    pieces = [(shift + a * unit, (b - a) * unit) for a, b in itertools.pairwise([0, *cuts, units])]
    order = draw(st.permutations(pieces))
    return nbytes, order[: draw(st.integers(0, len(order)))]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=200, deadline=None)
@given(
    case=rows_case(),
    seed=st.integers(0, 1000),
    arena_shift=st.sampled_from([0, 0, 0, 1, 2, 4, 8]),
    staging_shift=st.sampled_from([0, 0, 0, 1, 2, 4, 8]),
    slice_rows=st.sampled_from([1, 3, 5, 1 << 30, 1 << 30]),
    slice_bytes=st.sampled_from([16, 64, 1 << 30, 1 << 30]),
    chunk_rows=st.sampled_from([1, 7, 1 << 22]),
)
# int64 rows, indexed from scattered arena rows into one staging run
@example((704, [(128, 64), (0, 64), (320, 128)]), 3, 0, 0, 1 << 30, 1 << 30, 1)
# one fragment sliced, the others indexed: neither side's rows form one run
@example((400, [(0, 8), (200, 100), (16, 8), (40, 8)]), 4, 0, 0, 1 << 30, 64, 1 << 22)
def test_fragments_rows_match_byte_reference(
    device: str,
    case: tuple[int, list[tuple[int, int]]],
    seed: int,
    arena_shift: int,
    staging_shift: int,
    slice_rows: int,
    slice_bytes: int,
    chunk_rows: int,
) -> None:
    """Row copies (every width, sliced or indexed, in chunks) give the per-byte reference's bytes, also from
    arenas and staging buffers that start at odd addresses, and write nothing outside the fragments/staging."""
    nbytes, fragments = case
    arena = _arena(nbytes + arena_shift, seed, device)[arena_shift:]
    data = arena.tolist()
    total = sum(length for _, length in fragments)
    thresholds = mock.patch.multiple(
        copy_module,
        SLICE_ROWS_HOST=slice_rows,
        SLICE_ROWS_DEVICE=slice_rows,
        SLICE_BYTES=slice_bytes,
        CHUNK_ROWS=chunk_rows,
    )
    with thresholds:
        buffer = torch.full((staging_shift + total + 3,), 7, dtype=torch.uint8, device=device)
        staged = gather_fragments(arena, fragments, buffer[staging_shift:])
        assert staged.tolist() == _ref_gather(data, fragments)
        assert buffer[:staging_shift].tolist() == [7] * staging_shift
        assert buffer[staging_shift + total :].tolist() == [7, 7, 7]
        new = _arena(staging_shift + total + 1, seed + 1, device)
        scatter_fragments(arena, fragments, new[staging_shift:])
    assert arena.tolist() == _ref_scatter(data, fragments, new[staging_shift:].tolist())


def test_bad_inputs_change_nothing() -> None:
    arena = _arena(64, 0)
    before = arena.clone()
    view = block_view(arena, count=4, stride=16, block_bytes=8)
    calls: list[Callable[[], object]] = [
        lambda: block_view(arena, count=5, stride=16, block_bytes=8),
        lambda: block_view(arena, count=2, stride=4, block_bytes=8),
        lambda: block_view(arena.view(torch.int32), count=1, stride=4, block_bytes=4),
        lambda: copy_blocks(view, [0, 1], [2, 4]),
        lambda: copy_blocks(view, [0, 1], [2, 2]),
        lambda: copy_blocks(view, [0], [2, 3]),
        lambda: copy_blocks(view, [-1], [2]),
        lambda: zero_blocks(view, torch.tensor([1.0])),
        lambda: zero_blocks(view, ["a"]),  # type: ignore[list-item]
        lambda: zero_blocks(view, [0.5]),  # type: ignore[list-item]
        lambda: zero_blocks(view, [True]),
        lambda: scatter_blocks(view, [0], torch.zeros(1, 9, dtype=torch.uint8)),
        lambda: scatter_blocks(view, [0, 0], torch.zeros(2, 8, dtype=torch.uint8)),
        lambda: gather_blocks(view, [0], out=torch.empty(2, 8, dtype=torch.uint8)),
        lambda: gather_fragments(arena, [(60, 5)]),
        lambda: gather_fragments(arena, [(-1, 2)]),
        lambda: gather_fragments(arena, [(0, 1, 2)]),  # type: ignore[list-item]
        lambda: gather_fragments(arena, [(0.5, 1)]),  # type: ignore[list-item]
        lambda: gather_fragments(arena, [(0, 8)], torch.empty(4, dtype=torch.uint8)),
        lambda: scatter_fragments(arena, [(0, 8), (4, 8)], torch.zeros(16, dtype=torch.uint8)),
        lambda: scatter_fragments(arena, [(0, 8)], torch.zeros(4, dtype=torch.uint8)),
    ]
    for call in calls:
        with pytest.raises(ConfigError):
            call()
        assert torch.equal(arena, before)


def test_empty_inputs() -> None:
    arena = _arena(32, 1)
    before = arena.clone()
    view = block_view(arena, count=2, stride=16, block_bytes=16)
    copy_blocks(view, [], [])
    zero_blocks(view, [])
    assert gather_blocks(view, []).shape == (0, 16)
    assert gather_fragments(arena, []).numel() == 0
    scatter_fragments(arena, np.zeros((0, 2), dtype=np.int64), torch.empty(0, dtype=torch.uint8))
    scatter_fragments(
        arena, [(3, 0), (3, 0)], torch.empty(0, dtype=torch.uint8)
    )  # empty fragments never overlap
    assert torch.equal(arena, before)
