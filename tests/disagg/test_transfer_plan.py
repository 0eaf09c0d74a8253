"""Planning a transfer (:mod:`kvferry.disagg.transfer`): the sender's side mapped ahead of its receive request,
and receive-request ids checked once off the wire."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from kvferry.disagg.mapping import PeerMap
from kvferry.disagg.protocol import (
    ReceiveRequest,
    decode_control,
    encode_control,
)
from kvferry.disagg.transfer import (
    _dst_cache,
    plan_transfer,
    prepare_source,
)
from kvferry.errors import (
    ConfigError,
    WireFormatError,
)
from kvferry.wire import PackedInts
from tests.support.disagg_harness import make_side, tiny_spec
from tests.support.disagg_session import (
    PROMPT,
)

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (1, 2), (2, 1), (4, 2)])
@pytest.mark.parametrize("drafter", [True, False])
def test_a_prepared_source_plans_the_same(ctx_tp: int, gen_tp: int, drafter: bool) -> None:
    """The sender's side mapped ahead (prepare_source) gives the plan planning from the block table gives; the
    whole-prompt request uses what was prepared (nothing more is worked out; also for a receiver without a
    drafter, whose writes read the same ids), and a request for less (a reused prefix on the receiver) works
    its own ids out."""
    ctx, gen = make_side(tiny_spec(), ctx_tp), make_side(tiny_spec(drafter=drafter), gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=11)
    gen.create("g", PROMPT)
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    tables = [a.page_table() for a in gen.arenas]
    whole = gen.receive_request(1, "r", "g", len(PROMPT))
    for request in (whole, attrs.evolve(whole, token_start=9)):
        source = prepare_source(peer_map, range(ctx_tp), ctx.blocks("c"), ctx.slot("c"), len(PROMPT))
        prepared = len(source._source)
        # per writing pair its unit addresses, and the ids of the indexed writes (shared where they agree)
        assert prepared > sum(peer_map.pair(s, d).writes for s in range(ctx_tp) for d in peer_map.targets(s))
        got = plan_transfer(peer_map, range(ctx_tp), source, None, request, tables)
        # the whole prompt: planned from what was prepared (a peer without a drafter reads the same ids: its
        # layout has no draft groups whatever the range says of them)
        expect_hit = request is whole
        assert (len(source._source) == prepared) is expect_hit
        expected = plan_transfer(peer_map, range(ctx_tp), ctx.blocks("c"), ctx.slot("c"), request, tables)
        assert got.keys() == expected.keys()
        for w, chunks in expected.items():
            assert len(got[w]) == len(chunks)
            for a, b in zip(got[w], chunks, strict=True):
                assert all(map(np.array_equal, a.fragments(), b.fragments()))


def test_ids_off_the_wire_are_checked_once() -> None:
    """A receive request's ids are checked when it is decoded (unique, positive) and against the receiver's
    pools (check_request); the mapping takes them as they are, with the plan of the same request built in
    process (whose ids the mapping checks itself: repeated ones are refused there)."""
    ctx, gen = make_side(tiny_spec(), 1), make_side(tiny_spec(), 2)
    ctx.fake_prefill("c", PROMPT, seed=11)
    gen.create("g", PROMPT)
    peer_map = PeerMap.build([a.page_table() for a in ctx.arenas], [a.page_table() for a in gen.arenas])
    tables = [a.page_table() for a in gen.arenas]
    request = gen.receive_request(1, "r", "g", len(PROMPT))
    decoded = decode_control(encode_control(request))
    assert isinstance(decoded, ReceiveRequest) and all(
        type(b.block_ids) is PackedInts for b in decoded.blocks
    )
    assert set(_dst_cache(decoded, tables[0])._trusted) == {b.group for b in request.blocks}
    assert not _dst_cache(request, tables[0])._trusted
    plans = [
        plan_transfer(peer_map, range(1), ctx.blocks("c"), ctx.slot("c"), r, tables)
        for r in (request, decoded)
    ]
    assert plans[0].keys() == plans[1].keys()
    for w, chunks in plans[0].items():
        for a, b in zip(chunks, plans[1][w], strict=True):
            assert all(len(f) for f in a.fragments())
            assert all(map(np.array_equal, a.fragments(), b.fragments()))
    ids = request.blocks[0].block_ids
    repeated = attrs.evolve(
        request, blocks=(attrs.evolve(request.blocks[0], block_ids=(ids[1], *ids[1:])), *request.blocks[1:])
    )
    with pytest.raises(ConfigError, match="repeat"):
        plan_transfer(peer_map, range(1), ctx.blocks("c"), ctx.slot("c"), repeated, tables)
    with pytest.raises(WireFormatError, match="repeat"):
        decode_control(encode_control(repeated))
