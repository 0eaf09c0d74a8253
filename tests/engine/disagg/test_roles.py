"""Engine roles end to end on the reference model: disaggregated tokens == aggregated, the handshake refuses an
incompatible peer, poisoned receiver pages change nothing, and accounting returns to the initial counts."""

from __future__ import annotations

import anyio
import attrs
import pytest

from kvferry import wire
from kvferry.engine.disagg.link import exchange_hello
from kvferry.engine.disagg.protocol import PeerRole, decode_hello, encode_hello
from kvferry.engine.disagg.serve import _options, disaggregated
from kvferry.engine.runner import build_engine
from kvferry.errors import PeerIncompatible, WireFormatError
from kvferry.pools.pagetable import PageTable
from kvferry.transports import get_transport

pytestmark = pytest.mark.timeout(120)

PROMPTS = [[5, 9, 14, 200, 3, 3, 77, 1, 2, 8, 40], [250, 1, 7]]
MAX_TOKENS = 5


async def aggregated(prompts: list[list[int]]) -> list[list[int]]:
    built = build_engine("tiny", _options(1, 0, 0, "float64"))
    async with built.engine:
        return [await built.engine.generate(p, max_tokens=MAX_TOKENS).collect() for p in prompts]


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (2, 1), (1, 2)])
@pytest.mark.asyncio
async def test_disaggregated_tokens_equal_aggregated(ctx_tp: int, gen_tp: int) -> None:
    expected = await aggregated(PROMPTS)
    async with disaggregated(transport="local", ctx_tp=ctx_tp, gen_tp=gen_tp, separate_process=False) as (
        router,
        parts,
    ):
        gen, ctx = parts["gen"], parts["ctx"]
        gen_free = gen.cache.statistics()
        ctx_free = ctx.cache.statistics()
        # poison every free page and slot of the receiver: a correct transfer overwrites what it uses
        for arena in gen.arenas:
            arena.fill_garbage(
                "attention", list(range(1, arena.layout.pool_group("attention").num_slots)), seed=4
            )
            arena.fill_garbage("mamba2", list(range(1, arena.layout.pool_group("mamba2").num_slots)), seed=5)
        got = [None, None]

        async def one(i: int) -> None:
            got[i] = await router.generate(PROMPTS[i], max_tokens=MAX_TOKENS).collect()  # type: ignore[call-overload]

        async with anyio.create_task_group() as tg:
            for i in range(len(PROMPTS)):
                tg.start_soon(one, i)
        assert got == expected
        await gen.engine.wait_idle()
        with anyio.fail_after(5):
            while parts["context"].statistics()["held"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        for before, now in ((gen_free, gen.cache.statistics()), (ctx_free, ctx.cache.statistics())):
            # snapshot slots are prefix cache (evictable), not held by anyone
            assert (now.pages_free, now.slots_free + now.slots_snapshot, now.quarantines) == (
                before.pages_free,
                before.slots_free + before.slots_snapshot,
                0,
            )
            assert now.requests_active + now.requests_suspended == 0
        assert len(parts["worker"].transfers()) == len(PROMPTS)


def test_handshake_compares_hash_first() -> None:
    built = build_engine("tiny", _options(2, 0, 0, "float64"))
    tables = tuple(a.page_table() for a in built.arenas)
    from kvferry.engine.disagg.protocol import Hello, PeerInfo

    info = PeerInfo(PeerRole.CONTEXT, "i", "local", "local://x:1", 2, tables)
    data = encode_hello(info)
    assert decode_hello(data, wire_version=wire.WIRE_VERSION, compat_hash=tables[0].compat_hash) == info
    with pytest.raises(PeerIncompatible):
        decode_hello(data, wire_version=wire.WIRE_VERSION, compat_hash="0" * 32)
    with pytest.raises(PeerIncompatible):
        decode_hello(data, wire_version=wire.WIRE_VERSION + 1, compat_hash=tables[0].compat_hash)
    # a mismatching envelope is refused before its (here: garbage) body is looked at
    garbage = wire.encode(Hello(wire.WIRE_VERSION, "f" * 32, b"\xc1not msgpack"))
    with pytest.raises(PeerIncompatible):
        decode_hello(garbage, wire_version=wire.WIRE_VERSION, compat_hash=tables[0].compat_hash)
    with pytest.raises(WireFormatError):
        decode_hello(
            wire.encode(Hello(wire.WIRE_VERSION, tables[0].compat_hash, b"\xc1")),
            wire_version=wire.WIRE_VERSION,
            compat_hash=tables[0].compat_hash,
        )
    lying = attrs.evolve(info, tp_size=3)
    with pytest.raises(WireFormatError):
        decode_hello(encode_hello(lying), wire_version=wire.WIRE_VERSION, compat_hash=tables[0].compat_hash)


@pytest.mark.asyncio
async def test_incompatible_peer_is_refused_and_others_keep_working() -> None:
    ours = build_engine("tiny", _options(1, 0, 0, "float64"))
    other = build_engine("tiny", _options(1, 0, 0, "float32"))  # another dtype: another compatibility hash
    same = build_engine("tiny", _options(1, 0, 0, "float64"))

    def info(built: object, transport: object, role: PeerRole) -> object:
        from kvferry.engine.disagg.protocol import PeerInfo

        tables = tuple(a.page_table() for a in built.arenas)  # type: ignore[attr-defined]
        return PeerInfo(role, "x", "local", transport.address, 1, tables)  # type: ignore[attr-defined]

    factory = get_transport("local")
    async with factory() as t_ours, factory() as t_other, factory() as t_same:
        bad_peer = await t_ours.connect(t_other.address)
        bad_back = await t_other.accept()
        good_peer = await t_ours.connect(t_same.address)
        good_back = await t_same.accept()
        results: dict[str, object] = {}

        async def side(name: str, transport: object, peer: object, local: object) -> None:
            try:
                results[name] = await exchange_hello(transport, peer, local)  # type: ignore[arg-type]
            except PeerIncompatible as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(side, "ours-bad", t_ours, bad_peer, info(ours, t_ours, PeerRole.GENERATION))
            tg.start_soon(side, "other", t_other, bad_back, info(other, t_other, PeerRole.CONTEXT))
            tg.start_soon(side, "ours-good", t_ours, good_peer, info(ours, t_ours, PeerRole.GENERATION))
            tg.start_soon(side, "same", t_same, good_back, info(same, t_same, PeerRole.CONTEXT))
        assert isinstance(results["ours-bad"], PeerIncompatible)
        assert isinstance(results["other"], PeerIncompatible)
        assert not isinstance(results["ours-good"], Exception)
        assert not isinstance(results["same"], Exception)
        await bad_peer.aclose()
        await t_ours.send_message(good_peer, b"still here")
        assert await t_same.receive_message(good_back) == b"still here"


_ = PageTable
