"""Paged attention against dense per-query attention over the unpaged sequence."""

from __future__ import annotations

import math

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.model.attention import Rope, attention_step, page_coordinates, paged_attention, write_kv


def _dense_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int], scale: float
) -> torch.Tensor:
    # q [nq, hq, d]; keys/values [seq, hkv, d]; one query at a time, one head at a time.
    nq, hq, d = q.shape
    hkv = keys.shape[1]
    out = torch.zeros(nq, hq, d, dtype=q.dtype)
    for i, pos in enumerate(positions):
        for h in range(hq):
            kvh = h // (hq // hkv)
            scores = [float(q[i, h] @ keys[j, kvh]) * scale for j in range(pos + 1)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for j, w in enumerate(weights):
                out[i, h] += (w / total) * values[j, kvh]
    return out


def _poisoned_cache(pages: int, hkv: int, tpb: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.full((pages, hkv, tpb, d), float("nan"), dtype=torch.float64)
    v = torch.full((pages, hkv, tpb, d), float("inf"), dtype=torch.float64)
    return k, v


@pytest.mark.parametrize(("hq", "hkv"), [(8, 4), (4, 4), (4, 1)])
@pytest.mark.parametrize(("start", "new"), [(0, 7), (5, 1), (9, 3), (12, 4)])
def test_paged_attention_matches_dense(hq: int, hkv: int, start: int, new: int) -> None:
    torch.manual_seed(start * 31 + new + hq)
    tpb, d, pages = 4, 8, 16
    total = start + new
    keys = torch.randn(total, hkv, d, dtype=torch.float64)
    values = torch.randn(total, hkv, d, dtype=torch.float64)
    q = torch.randn(new, hq, d, dtype=torch.float64)
    k_cache, v_cache = _poisoned_cache(pages, hkv, tpb, d)
    nblocks = -(-total // tpb)
    table = torch.randperm(pages)[: nblocks + 1]  # one spare (unused, garbage) block in the table
    # the earlier tokens are already cached
    positions_old = torch.arange(start)
    pid, off = page_coordinates(table[None], positions_old[None], tpb)
    write_kv(k_cache, v_cache, keys[:start], values[:start], pid[0], off[0])
    positions = torch.arange(start, total)[None]
    out = attention_step(
        q[None], keys[None, start:], values[None, start:], k_cache, v_cache, table[None], positions, 0.3
    )
    ref = _dense_reference(q, keys, values, list(range(start, total)), 0.3)
    torch.testing.assert_close(out[0], ref, rtol=0, atol=1e-12)
    # the new tokens landed in their pages
    for j in range(start, total):
        page = int(table[j // tpb])
        assert torch.equal(k_cache[page, :, j % tpb], keys[j])
        assert torch.equal(v_cache[page, :, j % tpb], values[j])


def test_batch_rows_are_independent_and_padding_outputs_zero() -> None:
    torch.manual_seed(1)
    tpb, d, hq, hkv, pages = 4, 8, 4, 2, 12
    k_cache, v_cache = _poisoned_cache(pages, hkv, tpb, d)
    lengths = [3, 9]
    tables = torch.tensor([[5, 0, 0], [2, 7, 11]])
    seqs = []
    for b, n in enumerate(lengths):
        keys = torch.randn(n, hkv, d, dtype=torch.float64)
        values = torch.randn(n, hkv, d, dtype=torch.float64)
        pid, off = page_coordinates(tables[b : b + 1], torch.arange(n)[None], tpb)
        write_kv(k_cache, v_cache, keys, values, pid[0], off[0])
        seqs.append((keys, values))
    q = torch.randn(2, 2, hq, d, dtype=torch.float64)
    positions = torch.tensor([[2, -1], [7, 8]])
    out = paged_attention(q, k_cache, v_cache, tables, positions, 0.5)
    ref0 = _dense_reference(q[0, :1], *seqs[0], [2], 0.5)
    ref1 = _dense_reference(q[1], *seqs[1], [7, 8], 0.5)
    torch.testing.assert_close(out[0, :1], ref0, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1], ref1, rtol=0, atol=1e-12)
    assert torch.equal(out[0, 1], torch.zeros(hq, d, dtype=torch.float64))


def test_rope_rotates_pairs_and_keeps_dot_products_relative() -> None:
    rope = Rope(rotary_dim=4, theta=100.0)
    x = torch.randn(3, 2, 6, dtype=torch.float64)
    pos = torch.tensor([0, 1, 5])
    y = rope.apply(x, pos)
    assert torch.equal(y[0], x[0])  # position 0: identity
    assert torch.equal(y[..., 4:], x[..., 4:])  # channels past rotary_dim untouched
    # rotation by angle pos * inv_freq on pair (i, i + half), checked elementwise for one pair
    inv = 1.0 / 100.0 ** (0 / 4)
    c, s = math.cos(5 * inv), math.sin(5 * inv)
    assert float(y[2, 0, 0]) == pytest.approx(float(x[2, 0, 0]) * c - float(x[2, 0, 2]) * s, abs=1e-14)
    assert float(y[2, 0, 2]) == pytest.approx(float(x[2, 0, 2]) * c + float(x[2, 0, 0]) * s, abs=1e-14)
    # q.k after rope depends only on the position difference
    q, k = torch.randn(1, 1, 6, dtype=torch.float64), torch.randn(1, 1, 6, dtype=torch.float64)
    a = float((rope.apply(q, torch.tensor([7])) * rope.apply(k, torch.tensor([3]))).sum())
    b = float((rope.apply(q, torch.tensor([4])) * rope.apply(k, torch.tensor([0]))).sum())
    assert a == pytest.approx(b, abs=1e-12)
    with pytest.raises(ConfigError):
        Rope(rotary_dim=3).apply(x, pos)


def test_gqa_head_count_mismatch_is_a_typed_error() -> None:
    k_cache = torch.zeros(2, 3, 4, 8)
    with pytest.raises(ConfigError):
        paged_attention(
            torch.zeros(1, 1, 4, 8),
            k_cache,
            k_cache,
            torch.zeros(1, 1, dtype=torch.long),
            torch.zeros(1, 1, dtype=torch.long),
            1.0,
        )
