"""The TP shard maths and whole-peer maps: which ranks overlap, who writes a duplicated head, and which rank
pairs exchange bytes (:mod:`kvferry.disagg.mapping.ranks`, :mod:`kvferry.disagg.mapping.peer_map`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvferry.disagg.mapping import (
    PeerMap,
    elected,
    overlapping_ranks,
)
from kvferry.errors import ConfigError
from kvferry.pools.spec import split_heads
from tests.support.disagg_mapping import (
    TP_PAIRS,
    arenas,
    duplicated,
    tiny,
)

# --- rank overlap ------------------------------------------------------------------------------------------


def test_overlapping_ranks_for_every_tp_pair() -> None:
    expected = {
        (1, 1): {0: [0]},
        (1, 2): {0: [0, 1]},
        (2, 1): {0: [0], 1: [0]},
        (2, 4): {0: [0, 1], 1: [2, 3]},
        (4, 2): {0: [0], 1: [0], 2: [1], 3: [1]},
        (1, 4): {0: [0, 1, 2, 3]},
        (4, 1): {0: [0], 1: [0], 2: [0], 3: [0]},
    }
    for (src_tp, dst_tp), targets in expected.items():
        for s, ds in targets.items():
            assert list(overlapping_ranks(src_tp, s, dst_tp)) == ds
        for d in range(dst_tp):
            writers = [s for s, ds in targets.items() if d in ds]
            assert list(overlapping_ranks(dst_tp, d, src_tp)) == writers
    with pytest.raises(ConfigError):
        overlapping_ranks(2, 2, 1)


@pytest.mark.parametrize("model", [tiny, duplicated], ids=["tiny", "duplicated"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_peer_map_tables(model: Any, src_tp: int, dst_tp: int) -> None:
    spec = model()
    src, dst = arenas(spec, src_tp, num_pages=4), arenas(spec, dst_tp, num_pages=4)
    peer = PeerMap.build([a.page_table() for a in src], [a.page_table() for a in dst])
    table_ = peer.overlap_table()
    for s in range(src_tp):
        for d in range(dst_tp):
            assert table_[s, d] == (d in peer.targets(s)) == (s in peer.expected_writers(d))
            # every byte-exchanging pair overlaps
            if peer.writes(s, d):
                assert table_[s, d]
    # equal TP sizes pair rank r with rank r only, even with duplicated heads
    if src_tp == dst_tp:
        assert [[peer.writes(s, d) for d in range(dst_tp)] for s in range(src_tp)] == np.eye(
            src_tp, dtype=bool
        ).tolist()
    # Mamba x heads are never duplicated: every overlapping pair exchanges bytes
    for s in range(src_tp):
        for d in peer.targets(s):
            assert peer.writes(s, d)
    assert peer.skipped == ()


def test_elected_writer_is_unique_per_head() -> None:
    for total in (1, 2, 4):
        for src_tp in (1, 2, 4):
            for dst_tp in (1, 2, 4):
                for d in range(dst_tp):
                    dh = split_heads(total, dst_tp, d)
                    for head in range(dh.first, dh.first + dh.count):
                        writers = [
                            s
                            for s in range(src_tp)
                            if (sh := split_heads(total, src_tp, s)).first <= head < sh.first + sh.count
                            and elected(sh, s, dh, d)
                        ]
                        assert len(writers) == 1
                        assert writers[0] in overlapping_ranks(dst_tp, d, src_tp)


def test_duplicated_fan_in_has_empty_writers() -> None:
    # attention-only view of the duplicated model: kv head 0 on all four sender ranks, one receiver rank
    spec = duplicated()
    src, dst = arenas(spec, 4, num_pages=4), arenas(spec, 1, num_pages=4)
    peer = PeerMap.build([a.page_table() for a in src], [a.page_table() for a in dst])
    assert peer.expected_writers(0) == (0, 1, 2, 3)
    attention = {
        s: next(g for g in peer.pair(s, 0).groups if g.src_group == "attention").num_pieces for s in range(4)
    }
    # 2 layers x K/V x 1 head, only from replica 0
    assert attention == {0: 4, 1: 0, 2: 0, 3: 0}
