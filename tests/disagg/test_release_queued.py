"""A request cancelled on the generation side releases the cache its context engine holds for it even when the
ReleaseContext waits to go out longer than ``control_timeout``.

On a busy event loop (the engine steps run on it) control messages to one peer queue behind each other: each
send under the peer's send lock takes a turn of the loop, and a turn runs the engines' steps. A release given
up after ``control_timeout`` leaves the context side holding the prefilled cache until its ``hold_timeout``
(minutes). Here the generation transport delays every ReleaseContext past ``control_timeout``, as that queue
would.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from kvferry.disagg.protocol import ReleaseContext, decode_control
from kvferry.engine.request import RequestState
from kvferry.errors import WireFormatError
from kvferry.transports import Peer, Transport
from tests.support.disagg_pair import counts, options, pair, until
from tests.support.disagg_reference import PROMPTS, SPEC_K

pytestmark = pytest.mark.timeout(120)

CONTROL_TIMEOUT = 0.2
#: how long each ReleaseContext waits to go out (a queue of sends on a busy loop)
QUEUED = 1.0


class QueuedReleases:
    """The generation side's transport; every ReleaseContext waits ``QUEUED`` seconds before it is sent."""

    def __init__(self, inner: Transport) -> None:
        self._inner = inner
        self.releases = 0

    async def send_message(self, peer: Peer, data: bytes) -> None:
        if _is_release(data):
            await anyio.sleep(QUEUED)
            self.releases += 1
        await self._inner.send_message(peer, data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@pytest.mark.anyio
async def test_a_release_queued_past_the_control_timeout_still_frees_the_held_cache() -> None:
    queued: list[QueuedReleases] = []

    def wrap(transport: Transport) -> Any:
        queued.append(QueuedReleases(transport))
        return queued[-1]

    async with pair(
        gen_options=options(max_running=1),
        worker={"control_timeout": CONTROL_TIMEOUT},
        wrap_gen=wrap,
    ) as p:
        gen_before, ctx_before = counts(p.gen), counts(p.ctx)
        # the only batch row decodes a long request; the next one is prefilled, held, and waits for the row
        busy = p.router.generate(PROMPTS[0], max_tokens=40, spec_k=SPEC_K)
        waiting = p.router.generate(PROMPTS[1], max_tokens=8, spec_k=SPEC_K)
        client = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            tg.start_soon(busy.collect)
            tg.start_soon(_drain_in, client, waiting)
            await until(
                lambda: (
                    waiting.generation is not None
                    and waiting.generation.request.state is RequestState.WAITING
                    and p.context.statistics()["held"] == 1
                ),
                30,
                p.context.statistics,
            )
            client.cancel()  # the client of the waiting request goes away
        # the release went out late, and the context side let the cache go
        await until(lambda: p.context.statistics()["held"] == 0, 10, p.context.statistics)
        assert queued[0].releases == 1
        await p.gen.engine.wait_idle()
        await until(lambda: counts(p.ctx) == ctx_before, 5, lambda: (counts(p.ctx), ctx_before))
        await until(lambda: counts(p.gen) == gen_before, 5, lambda: (counts(p.gen), gen_before))


def _is_release(data: bytes) -> bool:
    try:
        return isinstance(decode_control(data), ReleaseContext)
    except WireFormatError:  # the handshake
        return False


async def _drain_in(scope: anyio.CancelScope, routed: Any) -> None:
    with scope:
        async for _ in routed:
            pass
