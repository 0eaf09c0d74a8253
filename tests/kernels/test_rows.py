"""Copies by rows (:mod:`kvferry.kernels.rows`): the granularity, the row indices, and the copy itself, which the
pools' fragment copies and the transports' device copies without Triton share."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.kernels import rows
from kvferry.kernels.rows import copy_by_rows, granularity, row_indices
from kvferry.transports._memory import device_copy


@settings(max_examples=60, deadline=None)
@given(arrays=st.lists(st.lists(st.integers(0, 1 << 40), max_size=6), max_size=4))
def test_granularity_and_row_indices(arrays: list[list[int]]) -> None:
    values = [v for a in arrays for v in a]
    expected = 1
    if values:
        expected = 0
        for v in values:
            expected = np.gcd(expected, v)
        expected = max(int(expected), 1)
    assert granularity(*[np.array(a, dtype=np.int64) for a in arrays]) == expected
    starts = np.array([v % 1000 for v in values], dtype=np.int64)
    counts = np.array([v % 5 for v in values], dtype=np.int64)
    assert row_indices(starts, counts).tolist() == [
        s + i for s, c in zip(starts.tolist(), counts.tolist(), strict=True) for i in range(c)
    ]


def test_granularity_and_row_indices_examples() -> None:
    assert granularity(np.array([4096, 8192]), np.array([0, 12288]), np.array([4096])) == 4096
    assert granularity(np.array([64, 96])) == 32
    assert granularity() == 1 and granularity(np.zeros(3, dtype=np.int64)) == 1
    indices = row_indices(np.array([5, 0, 9], dtype=np.int64), np.array([2, 1, 3], dtype=np.int64))
    assert indices.tolist() == [5, 6, 0, 9, 10, 11]


@pytest.mark.parametrize(
    "layout", ["both scattered", "source in order", "destination in order", "one fragment"]
)
@given(
    seed=st.integers(0, 2**16),
    unit=st.sampled_from([1, 2, 8, 64, 4096]),
    runs=st.integers(1, 12),
    staged=st.booleans(),
)
def test_copy_by_rows_moves_exactly_the_ranges(
    layout: str, seed: int, unit: int, runs: int, staged: bool
) -> None:
    """The rows are cut at the gcd granularity and copied by a plain, an index_copy, an index_select or a staged
    copy (in chunks of the temporary's bound, when ``staged`` makes it one row); the bytes are the slices', and
    the transports' device copy (ranges by address) moves the same."""
    rng = np.random.default_rng(seed)
    if layout == "one fragment":
        runs = 1
    lengths = rng.integers(1, 4, runs) * unit
    if layout in ("source in order", "destination in order"):
        lengths[:] = unit * 2  # runs that touch each other, so the in-order side is one run of rows
    slots = int(lengths.max())
    size = slots * runs + unit
    src = torch.from_numpy(rng.integers(0, 256, size, dtype=np.uint8))
    order_s = np.arange(runs) if layout in ("source in order", "one fragment") else rng.permutation(runs)
    order_d = np.arange(runs) if layout == "destination in order" else rng.permutation(runs)
    s_off = order_s * slots if layout != "source in order" else np.arange(runs) * unit * 2
    d_off = order_d * slots if layout != "destination in order" else np.arange(runs) * unit * 2
    s_off, d_off, lengths = (a.astype(np.int64) for a in (s_off, d_off, lengths))
    expected = np.zeros(size, dtype=np.uint8)
    source = src.numpy()
    for a, b, n in zip(s_off.tolist(), d_off.tolist(), lengths.tolist(), strict=True):
        expected[b : b + n] = source[a : a + n]
    dst = torch.zeros(size, dtype=torch.uint8)
    with mock.patch.object(rows, "GATHER_CHUNK_BYTES", 1 if staged else rows.GATHER_CHUNK_BYTES):
        copy_by_rows(src, s_off, dst, d_off, lengths)
    assert np.array_equal(dst.numpy(), expected)
    dst = torch.zeros(size, dtype=torch.uint8)
    base_s, base_d = src.data_ptr(), dst.data_ptr()
    src_f = np.stack([base_s + s_off, lengths], axis=1).astype(np.uint64)
    dst_f = np.stack([base_d + d_off, lengths], axis=1).astype(np.uint64)
    device_copy(src, base_s, src_f, dst, base_d, dst_f)
    assert np.array_equal(dst.numpy(), expected)
