"""A stranger connects to the generation side's transport during a disaggregated run (nobody accepts it: the
generation side connected to its context peer, not to it) and writes random bytes into every pool the
generation side registered, again and again: every write is refused, nothing of it lands, and the tokens are
those of aggregated serving. The generation side grants each transfer's destinations to its context peer only,
for as long as the transfer may write.

With the grant checks off, the same sweep lands (55-150 writes of 64 pages per run) and 3 of the 4 cases
below decoded wrong tokens.

Over ``ucx`` the stranger also skips its own grant check (a hostile writer): the generation side's receiver
refuses it all the same. ``nixl``'s one-sided path has no receiver-side check (see the nixl module docstring):
there only the writer's own check runs, which is what a stranger running this code meets.

Where the engines authenticate each other (a shared secret), the stranger holds the secret too: the handshake
lets it in, and the grants still keep it out of the pools."""

from __future__ import annotations

import inspect
from typing import Any

import anyio
import numpy as np
import pytest
import torch

from kvferry.disagg.serve import disaggregated
from kvferry.errors import NotGranted, RegionError
from kvferry.transports import Transport, get_transport
from kvferry.transports.peers import ChannelPeer
from tests.support.disagg_reference import PROMPTS, SPEC_K, aggregated, run_disaggregated

pytestmark = pytest.mark.timeout(180)

#: bytes of one row of a stranger's write, and rows per write
PIECE = 4096
ROWS = 64


async def stranger_writes(
    stranger: Transport, address: str, stop: anyio.Event, tally: dict[str, int]
) -> None:
    """Connect to ``address`` and sweep random bytes over every region it registered (each write ``ROWS`` rows
    of ``PIECE`` bytes further on, round and round) until ``stop``; count the refusals (and anything else) in
    ``tally``. Without grants these writes land (they overwrite the transferred caches: wrong tokens)."""
    peer = await stranger.connect(address)
    src = torch.randint(0, 256, (PIECE,), dtype=torch.uint8)
    await stranger.register(src)
    assert isinstance(peer, ChannelPeer)  # every transport here speaks the channel protocol
    regions = peer.regions.regions  # what the hello told it
    assert regions, "the generation side registered its pools before anyone connected"
    at = [0] * len(regions)
    while not stop.is_set():
        for i, region in enumerate(regions):
            length = min(PIECE, region.length)
            offsets = (at[i] + length * np.arange(ROWS)) % max(1, region.length - length + 1)
            at[i] = int(offsets[-1]) + length
            dst = np.stack([region.address + offsets, np.full(ROWS, length)], axis=1).astype(np.uint64)
            src_rows = np.tile(np.array([[src.data_ptr(), length]], dtype=np.uint64), (ROWS, 1))
            try:
                await stranger.write(peer, src_rows, dst, b"x")
            except NotGranted:
                tally["refused"] += 1
            except RegionError:
                tally["region"] += 1
            else:
                tally["landed"] += 1
        await anyio.sleep(0.002)


@pytest.mark.parametrize(
    ("transport", "bypass"),
    [("local", False), ("nixl", False), ("ucx", False), ("ucx", True)],
    ids=["local", "nixl", "ucx", "ucx-writer-skips-its-check"],
)
@pytest.mark.anyio
async def test_a_stranger_writes_nothing_into_the_generation_pools(
    transport: str, bypass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        get_transport(transport)
    except Exception as exc:
        pytest.skip(str(exc))
    expected = await aggregated(PROMPTS)
    secret: dict[str, Any] = {}
    if "secret" in inspect.signature(disaggregated).parameters:  # engines that authenticate each other
        from kvferry.transports.handshake import new_secret  # type: ignore[import-not-found,unused-ignore]

        secret["secret"] = new_secret()  # the stranger's too: authenticated, never granted
    async with (
        disaggregated(transport=transport, spec_k=SPEC_K, separate_process=False, **secret) as (
            router,
            parts,
        ),
        get_transport(transport)(same_process="transport", **secret) as stranger,
    ):
        gen_transport = parts["transport"]
        if bypass:
            # the stranger writes whatever it likes: only the generation side's receiver stands in its way
            monkeypatch.setattr(stranger.writes, "_check_granted", lambda p, dst, bounds=None: None)  # type: ignore[attr-defined]
        before = gen_transport.statistics()
        tally = {"refused": 0, "region": 0, "landed": 0}
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(stranger_writes, stranger, gen_transport.address, stop, tally)
            with anyio.fail_after(10):
                while not tally["refused"]:  # noqa: ASYNC110 (the stranger is connected and writing)
                    await anyio.sleep(0.01)
            got, transfers = await run_disaggregated(router, parts)
            stop.set()
        assert got == expected
        assert all(t is not None and t.nbytes > 0 for t in transfers)
        assert tally["landed"] == 0 and tally["region"] == 0 and tally["refused"] > len(transfers), tally
        after = gen_transport.statistics()
        if bypass:  # refused by the generation side itself, every one of them
            assert after.incoming_refused - before.incoming_refused == tally["refused"]
        else:  # refused by the stranger's own check
            assert stranger.statistics().writes_refused == tally["refused"]
            assert after.incoming_refused == before.incoming_refused
        assert after.grants == 0  # every transfer's grant was revoked when it ended
        assert stranger.statistics().writes_completed == 0
