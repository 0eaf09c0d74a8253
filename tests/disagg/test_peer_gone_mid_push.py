"""A generation peer that goes away while its context engine pushes a cache to it ends only that peer's service:
the push stops, the held cache is freed, and ``ContextWorker.serve`` returns instead of raising (in
``serve_context`` an exception there would stop the context engine for every other generation engine).

The peer is made to go away exactly while a write is posted: the context side's transport closes the
connection and fails the write, as it does when the peer's process dies under an in-flight write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from kvferry.errors import PeerDisconnected, TransferError
from kvferry.transports import Peer, Transport
from tests.support.disagg_pair import counts, pair, until
from tests.support.disagg_reference import PROMPTS, SPEC_K

pytestmark = pytest.mark.timeout(120)


class GoneMidWrite:
    """The context side's transport: the first write (of any kind) closes the connection to the peer and fails
    as a write to a peer that went away does."""

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self.cut = False

    async def _cut(self, peer: Peer) -> PeerDisconnected:
        self.cut = True
        await peer.aclose()
        return PeerDisconnected("the generation peer went away during the write")

    async def write(self, peer: Peer, *args: Any, **kwargs: Any) -> None:
        if self.cut:
            return await self._inner.write(peer, *args, **kwargs)
        raise await self._cut(peer)

    async def write_many(self, peer: Peer, writes: Sequence[Any], **kwargs: Any) -> list[Exception | None]:
        if self.cut:
            return await self._inner.write_many(peer, writes, **kwargs)
        return [await self._cut(peer)] * len(writes)

    async def write_indexed(self, peer: Peer, writes: Sequence[Any], **kwargs: Any) -> list[Exception | None]:
        if self.cut:
            return await self._inner.write_indexed(peer, writes, **kwargs)
        return [await self._cut(peer)] * len(writes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.anyio
async def test_a_peer_gone_during_a_push_ends_its_service_quietly() -> None:
    wrapped: list[GoneMidWrite] = []

    def wrap(transport: Transport) -> Any:
        wrapped.append(GoneMidWrite(transport))
        return wrapped[-1]

    async with pair(wrap_ctx=wrap) as p:
        ctx_before = counts(p.ctx)
        with pytest.raises(TransferError):
            await p.router.generate(PROMPTS[0], max_tokens=8, spec_k=SPEC_K).collect()
        assert wrapped[0].cut
        # the serve task ended without raising (else the pair's task group would), and freed the cache
        await until(lambda: p.context.statistics()["held"] == 0, 10, p.context.statistics)
        await p.ctx.engine.wait_idle()
        await until(lambda: counts(p.ctx) == ctx_before, 5, lambda: (counts(p.ctx), ctx_before))
        await anyio.sleep(0.1)  # a serve task that raised would fail the pair's task group by now
