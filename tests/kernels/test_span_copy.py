"""The batched span copy: its piece table (numpy, everywhere) and its Triton kernel (CUDA only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry.kernels import span_copy
from kvferry.kernels.span_copy import buffers, tables
from kvferry.kernels.span_copy import launch as launching
from kvferry.kernels.span_copy.cuda import cuda_driver

cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not span_copy.available(torch.device("cuda")),
    reason="needs CUDA and Triton",
)


def _spans(
    rng: np.random.Generator, n: int, alignment: int, max_length: int, base: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Disjoint source spans in shuffled order and destination spans packed, at offsets from ``base``."""
    lengths = rng.integers(1, max_length + 1, n) // alignment * alignment + alignment
    slot = int(lengths.max()) + alignment
    src = base + rng.permutation(n).astype(np.int64) * slot
    dst = base + n * slot + np.cumsum(lengths) - lengths
    return src, dst, lengths, n * slot + int(lengths.sum())


def _apply(memory: np.ndarray, base: int, table: np.ndarray, word_base: int, word: int) -> None:
    """What the kernel does with the table, in numpy: word offsets relative to ``word_base``."""
    for s, d, n in table.tolist():
        a, b = word_base + s * word - base, word_base + d * word - base
        memory[b : b + n * word] = memory[a : a + n * word]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    alignment=st.sampled_from([1, 2, 4, 8, 16, 64]),
    max_length=st.sampled_from([7, 300, 5000]),
    piece=st.sampled_from([16, 64, 4096]),
    base_offset=st.sampled_from([0, 1, 8, 16, 256]),
)
def test_piece_table_moves_exactly_the_spans(
    seed: int, alignment: int, max_length: int, piece: int, base_offset: int
) -> None:
    rng = np.random.default_rng(seed)
    base = (1 << 40) + base_offset * alignment
    src, dst, lengths, size = _spans(rng, int(rng.integers(1, 40)), alignment, max_length, base)
    memory = rng.integers(0, 256, size, dtype=np.uint8)
    expected = memory.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        expected[d - base : d - base + n] = memory[s - base : s - base + n]
    table, word_base, word, align, total, longest = span_copy.piece_table(src, dst, lengths, piece)
    assert word_base % 256 == 0 and word_base <= base
    assert total == lengths.sum() and longest == table[:, 2].max() * word
    # the word divides every address and length; the alignment hint holds for every piece
    assert (table % align == 0).all()
    assert (table[:, 2] * word <= max(piece, word * align)).all()
    assert table[:, 2].sum() * word == lengths.sum()
    _apply(memory, base, table, word_base, word)
    assert np.array_equal(memory, expected)


def test_piece_table_word_and_alignment() -> None:
    def word_align(*values: int) -> tuple[int, int]:
        a = np.array(values, dtype=np.int64)
        pieces = span_copy.piece_table(a + (1 << 20), a + (1 << 21), np.full(len(a), 32))
        word, align = pieces.word, pieces.align
        return word, align

    assert word_align(0, 16, 32) == (8, 2)
    assert word_align(0, 8) == (8, 1)
    assert word_align(0, 4) == (4, 1)
    assert word_align(0, 6) == (2, 1)
    assert word_align(0, 3) == (1, 1)
    table, *_ = span_copy.piece_table(np.array([64]), np.array([128]), np.array([0]))
    assert table.shape == (0, 3)


def test_piece_table_takes_fragment_columns_as_they_come() -> None:
    """Fragments are uint64 (their columns are strided views): the table is the same as from int64 arrays."""
    rng = np.random.default_rng(5)
    src, dst, lengths, _ = _spans(rng, 300, 16, 70_000, 1 << 40)
    fragments = np.stack([src, lengths], axis=1).astype(np.uint64)
    into = np.stack([dst, lengths], axis=1).astype(np.uint64)
    for piece in (4096, span_copy.PIECE_BYTES):
        expected = span_copy.piece_table(src, dst, lengths, piece)
        got = span_copy.piece_table(fragments[:, 0], into[:, 0], fragments[:, 1], piece)
        assert np.array_equal(got[0], expected[0]) and got[0].dtype == np.int64
        assert got[1:] == expected[1:]


def test_long_spans_are_cut_toward_the_target_number_of_pieces() -> None:
    """A few long spans among many short ones are cut finer (down to MIN_PIECE_BYTES) so that no program is
    left copying alone; a copy that has enough pieces keeps its spans whole up to PIECE_BYTES."""
    mib = 1 << 20

    def pieces(lengths: list[int], piece_bytes: int = span_copy.PIECE_BYTES) -> tuple[int, int]:
        n = np.asarray(lengths, dtype=np.int64)
        src = (1 << 40) + np.cumsum(n) - n
        table, _, word, _, total, longest = span_copy.piece_table(src, src + (1 << 41), n, piece_bytes)
        assert table[:, 2].sum() * word == n.sum() == total
        assert int(table[:, 2].max()) * word == longest
        return len(table), longest

    # a disaggregated writer's mix (mismatched TP): 2 MiB runs among 32 KiB pages
    mix = [2 << 10] * 48 + [16 << 10] * 24 + [32 << 10] * 2048 + [64 << 10] * 256 + [2 * mib] * 24
    assert pieces(mix) == (2568, span_copy.MIN_PIECE_BYTES)
    assert pieces([mib] * 1024) == (1024, mib)  # 1 GiB in 1 MiB fragments: one piece each
    assert pieces([16 * mib] * 64) == (1024, mib)  # cut to about TARGET_PIECES
    assert pieces([64 * mib] * 64) == (1024, span_copy.PIECE_BYTES)  # never longer than PIECE_BYTES
    assert pieces([4096] * 10) == (10, 4096)
    assert pieces([mib] * 4, piece_bytes=64 << 10) == (64, 64 << 10)  # a smaller piece_bytes is kept


@cuda
@pytest.mark.gpu
def test_copy_spans_reads_a_held_table_from_pinned_memory() -> None:
    """With ``keep``, the kernel reads its table from pinned host memory, which the caller holds until the
    copy ran; the bytes are the same as with an uploaded table."""
    rng = np.random.default_rng(11)
    lengths = rng.integers(1, 40_000, 500) // 16 * 16 + 16
    src = torch.randint(0, 256, (int(lengths.sum()),), dtype=torch.uint8, device="cuda")
    src_offsets = np.cumsum(lengths) - lengths
    order = rng.permutation(len(lengths))
    dst_offsets = np.empty_like(src_offsets)
    dst_offsets[order] = np.cumsum(lengths[order]) - lengths[order]
    results = []
    keep: list[Any] | None
    for keep in (None, []):
        dst = torch.zeros_like(src)
        pieces = span_copy.copy_spans(
            src.device,
            src.data_ptr() + src_offsets,
            dst.data_ptr() + dst_offsets,
            lengths,
            keep=keep,
            grid=False,
        )
        assert pieces is not None and pieces >= len(lengths)
        torch.cuda.synchronize()
        results.append(dst)
        if keep is not None:
            assert len(keep) == 1 and keep[0].shape == (pieces, 3)
            assert torch.from_numpy(keep[0]).is_pinned()
    expected = torch.empty_like(src)
    for s, d, n in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True):
        expected[d : d + n] = src[s : s + n]
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)


def _launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, int, int], dict[str, object]]]:
    """The grid and the constants of each of the launcher's launches from now on."""
    launches: list[tuple[tuple[int, int, int], dict[str, object]]] = []
    launch = launching.Launcher.launch

    def recorded(
        self: launching.Launcher,
        device: object,
        grid: tuple[int, int, int],
        table: int,
        count: int,
        base: int,
        constants: dict[str, object],
        **kwargs: object,
    ) -> None:
        launches.append((grid, constants))
        launch(self, device, grid, table, count, base, constants, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(launching.Launcher, "launch", recorded)
    return launches


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize("length", [4096, 300_000, 1 << 20])
@pytest.mark.parametrize("held", [False, True])
def test_copy_spans_grid_or_loop_form_matches_slices(
    alignment: int, length: int, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spans of one length that cut into equal pieces (4 KiB, 1 MiB: four of 256 KiB), with a few short ones,
    launch the grid form, one program per block; spans of 300000 bytes cut into a 256 KiB piece and a 37 KB
    rest, too unlike for the grid, launch the loop form, one program per piece. The bytes are the slices',
    whether the table was uploaded or held (``keep``: the pinned table, and for the grid its device copy)."""
    grid_expected = length != 300_000
    rng = np.random.default_rng(length + alignment)
    length = length // alignment * alignment + (3 if alignment == 1 else 0)  # odd lengths: masked tails
    lengths = np.full(96, length, dtype=np.int64)
    lengths[rng.choice(96, 3, replace=False)] = alignment * 5
    src = torch.randint(0, 256, (int(lengths.sum()),), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(int(lengths.sum()) + 64, dtype=torch.uint8, device="cuda")
    src_offsets = np.cumsum(lengths) - lengths
    order = rng.permutation(len(lengths))
    dst_offsets = np.empty_like(src_offsets)
    dst_offsets[order] = np.cumsum(lengths[order]) - lengths[order]
    launches = _launches(monkeypatch)
    keep: list[object] | None = [] if held else None
    pieces = span_copy.copy_spans(
        src.device, src.data_ptr() + src_offsets, dst.data_ptr() + dst_offsets, lengths, keep=keep
    )
    torch.cuda.synchronize()
    grids = [grid for grid, _ in launches]
    # the grid: blocks of the longest piece by pieces; the loop: a program per piece
    longest = span_copy.piece_table(src_offsets, dst_offsets, lengths).longest
    assert pieces is not None and len(grids) == 1
    if grid_expected:
        assert grids[0] == (-(-longest // span_copy.GRID_BLOCK_BYTES), pieces, 1)
    else:
        assert grids[0] == (pieces, 1, 1)
    if keep is not None:
        assert len(keep) == (2 if grid_expected else 1)
        assert torch.from_numpy(keep[0]).is_pinned()
        if grid_expected:
            assert keep[1].device.type == "cuda"  # type: ignore[attr-defined]
    expected = torch.zeros_like(dst)
    for s, d, n in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True):
        expected[d : d + n] = src[s : s + n]
    assert torch.equal(dst, expected)


def _words(n: int) -> np.ndarray:
    return np.empty(n, dtype=np.int64)


def _rows(lengths: list[int] | np.ndarray, dtype: type = np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """Paired fragment rows of ``lengths``: sources packed from 1 TiB, destinations packed in reverse order
    from 2 TiB."""
    lengths = np.asarray(lengths, dtype=np.int64)
    src = (1 << 40) + np.cumsum(lengths) - lengths
    reverse = lengths[::-1]
    dst = ((2 << 40) + np.cumsum(reverse) - reverse)[::-1]
    return (np.stack([src, lengths], axis=1).astype(dtype), np.stack([dst, lengths], axis=1).astype(dtype))


def _table(lengths: list[int] | np.ndarray, dtype: type = np.uint64) -> span_copy.FragmentTable | None:
    src, dst = _rows(lengths, dtype)
    return span_copy.fragment_table(
        src, dst, longest=int(src[:, 1].max()), total=int(src[:, 1].sum()), allocate=_words
    )


def _blocks(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int]]:
    """Every (source, destination) block of GRID_BLOCK_BYTES of the paired rows, sorted."""
    block = span_copy.GRID_BLOCK_BYTES
    return sorted(
        (int(s) + start, int(d) + start)
        for (s, n), (d, _) in zip(src.tolist(), dst.tolist(), strict=True)
        for start in range(0, n, block)
    )


def _moves(table: span_copy.FragmentTable) -> list[tuple[int, int]]:
    """Every block the kernel's programs copy, as :func:`_blocks` lists them: a row's programs copy its blocks
    ``p, p + x, ...`` (``rounds`` of them)."""
    words = table.words.view(np.uint64)
    src, dst = words[: 2 * table.rows].reshape(-1, 2), words[2 * table.rows :].reshape(-1, 2)
    assert (
        src[:, 1] <= table.rounds * table.grid[0] * span_copy.GRID_BLOCK_BYTES
    ).all()  # rows' ends reached
    return _blocks(src, dst)


def _expected_moves(lengths: list[int], dtype: type = np.uint64) -> list[tuple[int, int]]:
    """The blocks of the given rows."""
    return _blocks(*_rows(lengths, dtype))


def test_fragment_table_gives_each_row_the_mean_rows_blocks() -> None:
    """As many programs per row as the mean row has blocks (rounded up), the rows folded past the driver's
    bound; the table is the source rows then the destination rows, as given."""
    block = span_copy.GRID_BLOCK_BYTES
    mib = 1 << 20
    table = _table([mib] * 1024)
    assert table is not None and (table.grid, table.rows, table.rounds) == ((mib // block, 1024, 1), 1024, 1)
    src, dst = _rows([mib] * 1024)
    assert np.array_equal(table.words.view(np.uint64), np.concatenate([src.reshape(-1), dst.reshape(-1)]))
    # one row of two merged among 1 MiB rows: a block more per row, the merged row in two rounds
    lengths = [mib] * 1022 + [2 * mib]
    table = _table(lengths, np.int64)
    assert table is not None and (table.grid, table.rounds) == ((mib // block + 1, 1023, 1), 2)
    assert _moves(table) == _expected_moves(lengths, np.int64)
    table = _table([block] * 100_000, np.int64)
    assert table is not None and table.grid == (1, 50_000, 2) and table.rounds == 1
    table = _table([16, 32, 48])
    assert table is not None and table.grid == (1, 3, 1)


def test_fragment_table_takes_rounds_or_leaves_rows_too_unlike() -> None:
    """Short rows pull the mean down: rows of the common length take a second round, longer ones more (a power
    of two of them), up to FRAGMENT_ROUNDS; past that, and for rows not in 16-byte words, no table (the piece
    table's work)."""
    mib = 1 << 20
    lengths = [mib] * 60 + [16] * 4
    table = _table(lengths)
    assert table is not None and table.rounds == 2
    assert _moves(table) == _expected_moves(lengths)
    lengths = [3 * mib] * 8 + [16] * 16
    table = _table(lengths)  # three rounds: the kernel's four
    assert table is not None and table.rounds == 4
    assert _moves(table) == _expected_moves(lengths)
    rounds = span_copy.FRAGMENT_ROUNDS
    assert _table([mib] * 8 + [16] * 8 * rounds) is None  # one more round than the kernel makes
    assert _table([40 * mib] + [512] * 60) is None  # one long row among short ones
    assert _table([mib, mib + 8]) is None  # a length not in 16-byte words
    src, dst = _rows([mib, mib])
    dst[1, 0] += 8  # an address not in 16-byte words
    assert span_copy.fragment_table(src, dst, longest=mib, total=2 * mib, allocate=_words) is None
    empty = np.zeros((0, 2), dtype=np.uint64)
    assert span_copy.fragment_table(empty, empty, longest=0, total=0, allocate=_words) is None


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 1000), min_size=1, max_size=60),
    scale=st.sampled_from([16, 256, 4096]),
)
def test_fragment_table_copies_exactly_the_rows(lengths: list[int], scale: int) -> None:
    """Whatever the rows' lengths (in 16-byte words), the table the kernel runs over copies each block of
    every given row once, within the rounds its programs make."""
    block = span_copy.GRID_BLOCK_BYTES
    lengths = [n * scale // 16 * 16 for n in lengths]
    table = _table(lengths)
    if table is None:  # too unlike: more rounds of the mean row's programs than the kernel makes
        reach = max(1, -(-sum(lengths) // (len(lengths) * block))) * block
        assert max(lengths) > span_copy.FRAGMENT_ROUNDS * reach
        return
    assert _moves(table) == _expected_moves(lengths)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("alignment", [1, 2, 8, 16])
@pytest.mark.parametrize("length", [4096, 1 << 20])
@pytest.mark.parametrize("rows", ["alike", "merged", "unlike"])
def test_copy_fragments_reads_the_rows_or_falls_back(
    alignment: int, length: int, rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fragment rows of lengths near each other launch the kernel straight over the rows when every address
    and length is a multiple of 16 (destinations below the sources and rows of no bytes included), also with
    two rows of twice the length (two rounds of their programs); rows with a smaller alignment, or too unlike
    (one row 40 times the others), go through the piece table. Either way the bytes are the slices'."""
    rng = np.random.default_rng(length + alignment + len(rows))
    n = 64
    lengths = np.full(n, length // alignment * alignment + (3 if alignment == 1 else 0), dtype=np.int64)
    if rows == "merged":
        lengths[:2] *= 2
    elif rows == "unlike":
        lengths[0] *= 40
    lengths[[n - 1, n - 3]] = alignment * 5
    lengths[n - 2] = 0
    total = int(lengths.sum())
    memory = torch.randint(0, 256, (2 * total + 4096,), dtype=torch.uint8, device="cuda")
    # the destination first, below every source
    dst_offsets = np.empty(n, dtype=np.int64)
    order = rng.permutation(n)
    dst_offsets[order] = np.cumsum(lengths[order]) - lengths[order]
    src_offsets = total + 4096 + np.cumsum(lengths) - lengths
    base = memory.data_ptr()
    src = np.stack([base + src_offsets, lengths], axis=1).astype(np.uint64)
    dst = np.stack([base + dst_offsets, lengths], axis=1).astype(np.uint64)
    before = memory.clone()
    recorded = _launches(monkeypatch)
    keep: list[object] = []
    assert span_copy.copy_fragments(memory.device, src, dst, keep=keep) is not None
    torch.cuda.synchronize()
    launches = [(grid, bool(constants["FRAGMENTS"]), constants["ROUNDS"]) for grid, constants in recorded]
    assert len(launches) == 1
    grid, fragments, rounds = launches[0]
    table = span_copy.fragment_table(
        src, dst, longest=int(lengths.max()), total=int(lengths.sum()), allocate=_words
    )
    assert fragments is (table is not None)
    if alignment == 16 and length > span_copy.GRID_BLOCK_BYTES:  # each path taken where it is meant to be
        assert fragments is (rows != "unlike")
    if table is not None:
        assert (grid, rounds) == (table.grid, table.rounds)
        assert torch.from_numpy(keep[0]).is_pinned()
        assert keep[1].device.type == "cuda"  # type: ignore[attr-defined]
    expected = before.clone()
    for s, d, k in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True):
        expected[d : d + k] = before[s : s + k]
    assert torch.equal(memory, expected)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("alignment", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("max_length", [7, 4096, 300_000])
def test_copy_spans_matches_slices(alignment: int, max_length: int) -> None:
    rng = np.random.default_rng(alignment * 1000 + max_length)
    n = 200
    lengths = rng.integers(1, max_length + 1, n) // alignment * alignment + alignment
    slot = int(lengths.max()) + alignment
    src = torch.randint(0, 256, (n * slot,), dtype=torch.uint8, device="cuda")
    # the destination in another allocation: one launch spans both
    dst = torch.zeros(int(lengths.sum()) + 64, dtype=torch.uint8, device="cuda")
    src_offsets = rng.permutation(n).astype(np.int64) * slot
    dst_offsets = np.cumsum(lengths) - lengths
    pieces = span_copy.copy_spans(
        src.device, src.data_ptr() + src_offsets, dst.data_ptr() + dst_offsets, lengths
    )
    assert pieces is not None and pieces >= n
    torch.cuda.synchronize()
    expected = torch.zeros_like(dst)
    for s, d, length in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True):
        expected[d : d + length] = src[s : s + length]
    assert torch.equal(dst, expected)


@cuda
@pytest.mark.gpu
def test_repeated_launches_skip_the_jit_and_copy_the_same() -> None:
    """Later launches of a configuration go straight to the driver (where libcuda reports the kernel's
    parameters) or to the compiled kernel, not through the JIT; their bytes are as right."""
    launcher = launching.launcher
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    lengths = np.full(64, 4096, dtype=np.int64)
    src_addr = src.data_ptr() + np.arange(64, dtype=np.int64)[::-1] * 4096
    before = launcher.driver_launches + launcher.direct_launches
    driver = launcher.driver_launches
    for _ in range(3):
        dst = torch.zeros(64 * 4096, dtype=torch.uint8, device="cuda")
        dst_addr = dst.data_ptr() + np.arange(64, dtype=np.int64) * 4096
        assert span_copy.copy_spans(src.device, src_addr, dst_addr, lengths) == 64
        torch.cuda.synchronize()
        assert torch.equal(dst.view(64, 4096), src[: 64 * 4096].view(64, 4096).flip(0))
    assert launcher.driver_launches + launcher.direct_launches >= before + 2
    if cuda_driver() is not None:  # libcuda with cuFuncGetParamInfo (CUDA 12.4 and later)
        assert launcher.driver_launches >= driver + 2


def test_device_tables_are_kept_per_stream_and_thread_and_grow(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grid form's device buffer: one per (device, stream, thread), handed out again while big enough,
    replaced by one of the next power of two when a table outgrows it; another stream or thread gets its own
    (two threads sharing one could queue both uploads before either kernel)."""
    import threading

    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))  # host memory here
    kept = buffers.DeviceTables()
    first = kept.take(0, 7, 100)
    assert first.numel() == 1024 and kept.take(0, 7, 1024) is first
    grown = kept.take(0, 7, 3000)
    assert grown.numel() == 4096 and kept.take(0, 7, 10) is grown and kept.allocated == 2
    assert kept.take(0, 8, 10) is not grown and kept.take(1, 7, 10) is not grown
    other: list[object] = []
    thread = threading.Thread(target=lambda: other.append(kept.take(0, 7, 10)))
    thread.start()
    thread.join()
    assert other[0] is not grown and kept.allocated == 5
    assert repr(kept) == "<DeviceTables 4 buffers, 5 allocated>"  # the outgrown one replaced


def test_pinned_tables_are_reused_only_once_every_view_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A table's block goes back for reuse when the table and every view of it are gone (the caller's ``keep``
    holds it until the copy ran), never while one lives; rows round up to a power of two (64 at least)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    kept = buffers.PinnedTables()
    first = kept.take(100)
    assert first.shape == (100, 3) and first.dtype == np.int64
    view = first.view(np.uint64)[:10]
    address = first.ctypes.data
    del first
    second = kept.take(100)  # the first block is still in use (the view lives): a new one
    assert second.ctypes.data != address and kept.allocated == 2
    del view
    third = kept.take(128)  # same capacity (128 rows): the first block again
    assert third.ctypes.data == address and kept.allocated == 2
    assert kept.take(10).shape == (10, 3) and kept.allocated == 3  # 64 rows: another size
    assert "allocated=3" in repr(kept)


@pytest.mark.parametrize("long_spans", [1, 3, 20])
def test_few_long_spans_are_cut_as_many_are(long_spans: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A few spans longer than a piece (a state run among pages) are cut one by one; the pieces are the ones
    cutting every long span at once gives (in another row order)."""
    rng = np.random.default_rng(long_spans)
    n = 300
    lengths = (rng.integers(1, 4000, n) * 16).astype(np.int64)
    lengths[rng.choice(n, long_spans, replace=False)] = (
        rng.integers(1 << 20, 100 << 20, long_spans) // 16 * 16
    )
    src = (1 << 40) + np.cumsum(lengths) - lengths
    dst = (1 << 41) + rng.permutation(n).astype(np.int64) * (101 << 20)
    cuts = []
    for few in (tables.FEW_LONG_SPANS, 0):
        monkeypatch.setattr(tables, "FEW_LONG_SPANS", few)
        table, *rest = span_copy.piece_table(src, dst, lengths)
        cuts.append((table[np.lexsort(table.T[::-1])], rest))
    (one_by_one, rest_a), (at_once, rest_b) = cuts
    assert rest_a == rest_b and np.array_equal(one_by_one, at_once)
    assert one_by_one[:, 2].sum() * rest_a[1] == lengths.sum() and len(one_by_one) > n


def test_grid_of_launches_one_program_per_block_when_pieces_are_alike() -> None:
    """The grid form is chosen when few of its programs would have nothing to copy: pieces of one length (1 GiB
    in 1 MiB fragments: 256 blocks of 4 KiB by 1024 pieces), a few short ones among them; not for pieces of
    very different lengths (a disaggregated writer's mismatched-TP mix cut at 256 KiB). Past the driver's
    65535 in the second dimension the pieces fold into the third, covering every piece."""
    mib, block = 1 << 20, span_copy.GRID_BLOCK_BYTES
    assert span_copy.grid_of(1024, mib, 1024 * mib, block) == (256, 1024, 1)
    assert span_copy.grid_of(1030, mib, 1024 * mib + 6 * 8192, block) == (256, 1030, 1)
    mix = [2 << 10] * 48 + [16 << 10] * 24 + [32 << 10] * 2048 + [64 << 10] * 256 + [2 * mib] * 24
    n = np.asarray(mix, dtype=np.int64)
    src = (1 << 40) + np.cumsum(n) - n
    table = span_copy.piece_table(src, src + (1 << 41), n)
    assert span_copy.grid_of(len(table.table), table.longest, table.total, block) is None
    assert span_copy.grid_of(0, 0, 0, block) is None
    for pieces in (65535, 65536, 200_001):
        x, y, z = span_copy.grid_of(pieces, block, pieces * block, block) or (0, 0, 0)
        assert x == 1 and y <= 65535 and y * z >= pieces > y * (z - 1)


@cuda
@pytest.mark.gpu
def test_grid_tables_share_a_stream_buffer_in_stream_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Back-to-back grid copies on one stream, not waited for in between, upload their tables into the same
    kept device buffer: each kernel still reads its own table (the next upload runs after it), so every copy
    lands where its spans say; a table too large for the buffer grows it."""
    rng = np.random.default_rng(3)
    span, rows_in = 4096, 512
    src = torch.randint(0, 256, (rows_in * span,), dtype=torch.uint8, device="cuda")
    offsets = np.arange(rows_in, dtype=np.int64) * span
    lengths = np.full(rows_in, span, dtype=np.int64)
    outputs, orders = [], []
    keep: list[object] = []
    launches = _launches(monkeypatch)
    for count in (16, 400, 16, 400, 32):  # 400 rows (1200 words) outgrow the first buffer (1024)
        order = rng.permutation(rows_in)[:count]
        dst = torch.zeros(count * span, dtype=torch.uint8, device="cuda")
        pieces = span_copy.copy_spans(
            src.device,
            src.data_ptr() + offsets[order],
            dst.data_ptr() + offsets[:count],
            lengths[:count],
            keep=keep,
        )
        assert pieces == count
        outputs.append(dst)
        orders.append(order)
    buffers = {id(k) for k in keep if isinstance(k, torch.Tensor) and k.device.type == "cuda"}
    assert len(buffers) <= 2  # the stream's one buffer (and the one it grew into, if it did)
    grids = [grid for grid, _ in launches]
    assert grids == [(1, n, 1) for n in (16, 400, 16, 400, 32)]  # every one the grid form
    torch.cuda.synchronize()
    rows = src.view(rows_in, span)
    for dst, order in zip(outputs, orders, strict=True):
        assert torch.equal(dst.view(-1, span), rows[torch.from_numpy(order).cuda()])


def test_indexed_rows_of_mixed_lengths_are_cut_shorter_for_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    """A template of rows too unlike for the grid at the default cut (a mismatched-TP writer's mix) is cut into
    shorter pieces, as long as they make it alike enough: 32 KiB here, eight blocks each; the pieces still cover
    every row exactly (the bytes are checked by the property test above, with random rows). Without the recut
    the table keeps the default cut and the loop form."""
    mib = 1 << 20
    mix = [2 << 10] * 48 + [16 << 10] * 24 + [32 << 10] * 2048 + [64 << 10] * 256 + [2 * mib] * 24
    length = np.asarray(mix, dtype=np.int64)
    address = (1 << 40) + np.cumsum(length) - length
    zeros = np.zeros(len(length), dtype=np.int64)

    def table() -> span_copy.IndexedTable:
        return span_copy.indexed_table(
            torch.device("cpu"), zeros, address, zeros, zeros, address + (1 << 41), zeros, length, ids=1
        )

    cut = table()
    host = cut.table.numpy()
    assert cut.grid == (8, cut.pieces, 1) and host[:, 6].max() * cut.word == 32 << 10
    assert host[:, 6].sum() * cut.word == length.sum()
    monkeypatch.setattr(tables, "GRID_RECUT", False)
    whole = table()
    assert whole.grid is None and whole.pieces < cut.pieces


def _indexed_case(
    rng: np.random.Generator, base: int, alignment: int, slots: int, uniform: bool = False
) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
    """Rows of an indexed copy over two pools of ``slots`` slots (source, destination), some longer than a piece,
    the ids of one write, and the bytes both pools span from ``base``. ``uniform``: rows of one length (a
    multiple of the piece size plus a little), which the grid form copies."""
    n = int(rng.integers(1, 12))
    lengths = (rng.integers(1, 3 << 20, n) // alignment + 1) * alignment
    if uniform:
        n = 8
        lengths = np.full(n, 4 * span_copy.MIN_PIECE_BYTES + alignment * 7)
    stride = int(lengths.sum()) + alignment * int(rng.integers(0, 4))
    offsets = np.cumsum(lengths) - lengths
    src_pool, dst_pool = base, base + slots * stride
    rows = {
        "src_slot": rng.integers(0, 3, n),
        "src_address": src_pool + offsets,
        "src_stride": np.full(n, stride),
        "dst_slot": 3 + rng.integers(0, 3, n),
        "dst_address": dst_pool + offsets,
        "dst_stride": np.full(n, stride),
        "length": lengths,
    }
    # a row's destination may not overlap another's: destination slots are distinct per write
    ids = np.concatenate((rng.integers(0, slots, 3), rng.permutation(slots)[:3]))
    return rows, ids, 2 * slots * stride


def _indexed_table(device: torch.device, rows: dict[str, np.ndarray], ids: int) -> span_copy.IndexedTable:
    """The indexed table of :func:`_indexed_case`'s rows."""
    return span_copy.indexed_table(
        device,
        src_slot=rows["src_slot"],
        src_address=rows["src_address"],
        src_stride=rows["src_stride"],
        dst_slot=rows["dst_slot"],
        dst_address=rows["dst_address"],
        dst_stride=rows["dst_stride"],
        length=rows["length"],
        ids=ids,
    )


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), alignment=st.sampled_from([1, 4, 16]))
def test_indexed_table_moves_exactly_the_rows(seed: int, alignment: int) -> None:
    """The table of an indexed copy, applied as the kernel applies it (numpy, any ids), moves exactly each
    row's bytes from where its ids put it to where they put it; long rows are cut into pieces."""
    rng = np.random.default_rng(seed)
    base = 1 << 40
    rows, ids, size = _indexed_case(rng, base, alignment, slots=4)
    table = _indexed_table(torch.device("cpu"), rows, ids=len(ids))
    host = table.table.numpy()
    assert table.nbytes == int(rows["length"].sum()) and table.ids == len(ids)
    assert len(host) >= len(rows["length"]) and host[:, 6].max() * table.word <= span_copy.PIECE_BYTES
    memory = rng.integers(0, 256, size, dtype=np.uint8)
    expected = memory.copy()
    for i in range(len(rows["length"])):
        s = rows["src_address"][i] + ids[rows["src_slot"][i]] * rows["src_stride"][i] - base
        d = rows["dst_address"][i] + ids[rows["dst_slot"][i]] * rows["dst_stride"][i] - base
        n = rows["length"][i]
        expected[d : d + n] = memory[s : s + n]
    w = table.word
    for slot_s, off_s, stride_s, slot_d, off_d, stride_d, words in host.tolist():
        a = table.base + (off_s + ids[slot_s] * stride_s) * w - base
        b = table.base + (off_d + ids[slot_d] * stride_d) * w - base
        memory[b : b + words * w] = memory[a : a + words * w]
    assert np.array_equal(memory, expected)


@cuda
@pytest.mark.parametrize("alignment", [1, 16])
@pytest.mark.parametrize("uniform", [False, True])
def test_copy_indexed_matches_the_rows(
    alignment: int, uniform: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel works out each piece's addresses from the ids it reads from pinned memory; rows of one
    length launch the grid form when the ids are in device memory."""
    rng = np.random.default_rng(alignment)
    memory = torch.randint(0, 256, (512 << 20,), dtype=torch.uint8, device="cuda")
    base = memory.data_ptr()
    rows, ids, size = _indexed_case(rng, base, alignment, slots=4, uniform=uniform)
    assert size <= memory.numel()
    expected = memory.clone()
    for i in range(len(rows["length"])):
        s = int(rows["src_address"][i] + ids[rows["src_slot"][i]] * rows["src_stride"][i] - base)
        d = int(rows["dst_address"][i] + ids[rows["dst_slot"][i]] * rows["dst_stride"][i] - base)
        n = int(rows["length"][i])
        expected[d : d + n] = memory[s : s + n]
    table = _indexed_table(torch.device("cuda"), rows, ids=len(ids))
    original = memory.clone()
    pinned = span_copy.pinned_ids(len(ids))
    pinned[...] = ids
    on_device = torch.empty(len(ids), dtype=torch.int64, device="cuda")
    keep: list[object] = []
    assert table.grid is not None or not uniform
    launches = _launches(monkeypatch)
    # the JIT's launch reading a pinned copy; then the driver's, from the pinned vector, and from its copy on the
    # device (poisoned first: the kernel must read the copy made on the stream)
    for kwargs in ({}, {"pinned": True}, {"pinned": True, "device_ids": on_device.fill_(-1)}):
        memory.copy_(original)
        assert span_copy.copy_indexed(table, pinned if kwargs else ids, keep=keep, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(memory, expected), kwargs
    assert torch.equal(on_device.cpu(), torch.from_numpy(ids))
    # one program per piece while the ids were in host memory; the grid with them on the device
    grids = [grid for grid, _ in launches]
    assert grids[:2] == [(table.pieces, 1, 1)] * 2
    assert grids[2] == (table.grid or (table.pieces, 1, 1))


def test_launch_makes_the_device_current_unless_the_caller_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch without a stream looks up the device's current stream and makes the device current around the
    driver call; one given the stream (the caller made the device current) does neither. No CUDA needed: the
    compiled kernel is a stand-in that records the driver call."""
    entered: list[int] = []
    streams: list[int] = []

    class Current:
        def __init__(self, ordinal: int) -> None:
            self.ordinal = ordinal

        def __enter__(self) -> None:
            entered.append(self.ordinal)

        def __exit__(self, *exc: object) -> None:
            return None

    def driver(grid: object, stream: int, *args: object) -> bool:
        streams.append(stream)
        return True

    monkeypatch.setattr(launching, "on_ordinal", Current)
    monkeypatch.setattr(launching, "current_stream", lambda ordinal: 100 + ordinal)
    launcher = launching.Launcher()
    constants = {"WORD": 8, "num_warps": 4}
    device = torch.device("cuda", 1)
    launcher._compiled[launcher.key(1, constants)] = (object(), driver)  # type: ignore[assignment]
    launcher.launch(device, (1, 1, 1), 0, 1, 0, constants)
    assert (entered, streams) == ([1], [101])
    launcher.launch(device, (1, 1, 1), 0, 1, 0, constants, stream=7)
    assert (entered, streams) == ([1], [101, 7])
    assert launcher.driver_launches == 2
