"""Fragments (``kvferry.transports.base``): building, checking, merging and pairing the rows of a write."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvferry.transports import as_fragments, coalesce, page_fragments
from kvferry.transports.base import MERGE_SHARE, check_pairing, write_rows


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


@given(
    st.lists(st.tuples(st.integers(1, 5), st.booleans(), st.booleans()), min_size=1, max_size=200),
    st.sampled_from([np.uint64, np.int64]),
)
def test_write_rows_is_as_fragments_pairing_and_coalesce(
    rows: list[tuple[int, bool, bool]], dtype: type
) -> None:
    """The fused preparation of a write returns what the three functions return one after the other, above and
    below the row count where it switches to checking row by row; it merges only where enough rows join."""
    lengths = np.array([n for n, _, _ in rows], dtype=np.int64)
    # a gap before a row on either side (or both) decides whether it merges with the one before
    s_gap = np.array([g for _, g, _ in rows], dtype=np.int64)
    d_gap = np.array([g for _, _, g in rows], dtype=np.int64)
    src: np.ndarray = np.stack([1000 + np.cumsum(lengths + s_gap) - lengths, lengths], axis=1).astype(dtype)
    dst: np.ndarray = np.stack([90000 + np.cumsum(lengths + 3 * d_gap) - lengths, lengths], axis=1).astype(
        dtype
    )
    got = write_rows(src, dst)
    want_s, want_d = as_fragments(src), as_fragments(dst)
    check_pairing(want_s, want_d)
    assert got.src.tolist() == want_s.tolist() and got.dst.tolist() == want_d.tolist()
    merged_s, merged_d = coalesce(want_s, want_d)
    # merged where at least one row in MERGE_SHARE joins the row before
    if len(want_s) - len(merged_s) >= max(1, len(want_s) // MERGE_SHARE):
        assert got.merged_src is not None and got.merged_dst is not None
        assert got.merged_src.tolist() == merged_s.tolist() and got.merged_dst.tolist() == merged_d.tolist()
    else:
        assert got.merged_src is None and got.merged_dst is None
    unmerged = write_rows(src, dst, merge=False)
    assert unmerged.merged_src is None and unmerged.src.tolist() == want_s.tolist()
    # the bounds of many rows, merged or not: every row as given and merged lies inside them, the lowest
    # address exactly
    if got.bounds is not None:
        sides = [(got.src, got.bounds[:2]), (got.dst, got.bounds[2:])]
        if got.merged_src is not None and got.merged_dst is not None:
            sides += [(got.merged_src, got.bounds[:2]), (got.merged_dst, got.bounds[2:])]
        for rows_, (low, high) in sides:
            assert low == int(rows_[:, 0].min()) and high >= int((rows_[:, 0] + rows_[:, 1]).max())
    else:
        assert len(rows) < 64


@pytest.mark.parametrize("joined", [0, 1, 127, 128, 1023])
def test_write_rows_merges_only_when_enough_rows_join(joined: int) -> None:
    """A write of 1024 pages, the first ``joined`` of them landing after the page before: merged from one join
    in MERGE_SHARE on (fewer save less than the merge costs), the rows as given otherwise."""
    n = 1024
    order = np.random.default_rng(joined).permutation(np.arange(joined + 1, n) * 2)  # no two neighbours
    dst_pages = np.concatenate([np.arange(joined + 1) + 2 * n, order])
    src, dst = page_fragments(1 << 30, 4096, np.arange(n)), page_fragments(1 << 40, 4096, dst_pages)
    rows = write_rows(src, dst)
    assert rows.src is src or np.array_equal(rows.src, src)
    if joined >= n // MERGE_SHARE:
        assert rows.merged_src is not None and rows.merged_dst is not None
        assert len(rows.merged_src) == n - joined
        merged_s, merged_d = coalesce(src, dst)
        assert np.array_equal(rows.merged_src, merged_s) and np.array_equal(rows.merged_dst, merged_d)
    else:
        assert rows.merged_src is None and rows.merged_dst is None
    assert len(coalesce(src, dst)[0]) == n - joined  # coalesce itself merges whatever joins


@pytest.mark.parametrize("rows", [3, 200])
def test_write_rows_refuses_what_as_fragments_refuses(rows: int) -> None:
    """Every refusal holds on both of its paths (few rows: row by row; many: on the merged rows)."""
    src = page_fragments(1 << 20, 64, np.arange(rows))
    dst = page_fragments(1 << 30, 64, np.arange(rows))

    def refused(s: np.ndarray, d: np.ndarray, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            write_rows(s, d)

    refused(src[:, :1], dst[:, :1], "shape")
    refused(src, dst[:-1], "differ in shape")
    other = dst.copy()
    other[-1, 1] = 32
    refused(src, other, "differ in length")
    zero_s, zero_d = src.copy(), dst.copy()
    zero_s[1, 1] = zero_d[1, 1] = 0
    refused(zero_s, zero_d, "zero-length")
    # the last row wraps around the address space on one side; with many rows it merges into a run first
    wrap_s = src.copy()
    wrap_s[:, 0] += np.uint64(2**64 - (1 << 20) - 64 * (rows - 1))
    refused(wrap_s, dst, "wraps")
    wrap_d = dst.copy()
    wrap_d[:, 0] += np.uint64(2**64 - (1 << 30) - 64 * (rows - 1))
    refused(src, wrap_d, "wraps")
    refused(np.array([[1, -2]] * rows), np.array([[1, 2]] * rows), "negative")
    refused(src.astype(np.float64), dst, "integer")
    huge = np.array([[2**62 * (1 + i % 3), 2**62] for i in range(rows)], dtype=np.uint64)  # 3 * 2**62 + 2**62
    refused(huge, huge, "wraps")  # lengths this large are checked row by row
    # the highest address plus the longest length would wrap, but no row does: checked row by row, accepted
    near = np.array([[(i * 2) << 40, 1 << 30] for i in range(rows)], dtype=np.uint64)
    near[-1] = [2**64 - 8192, 4096]
    assert write_rows(near, near).merged_src is None
