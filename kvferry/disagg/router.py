"""The router: one ``generate()`` stream over a context engine (prefill) and a generation engine (decode).

The caller sees exactly the stream of aggregated serving: the first token (sampled by the context engine at the
end of the prompt), then the generation engine's tokens. Between the two, the request's cache moves.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable

import anyio
import attrs
from attrs import define

from kvferry.disagg.protocol import ContextRequest, PeerInfo
from kvferry.disagg.roles import GenerationWorker
from kvferry.disagg.roles.generation import ContextLink
from kvferry.disagg.session import TransferStatistics
from kvferry.engine.engine import Generation
from kvferry.errors import RequestTooLarge, TransferError

__all__ = ["RoutedGeneration", "Router"]


@define(eq=False)
class RoutedGeneration:
    """One routed request: iterate it once for its tokens; afterwards read its draft history and transfer."""

    router: Router
    key: str
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int | None
    temperature: float
    spec_k: int
    stop_ids: tuple[int, ...]
    tokens: list[int] = attrs.field(factory=list)
    generation: Generation | None = None
    transfer: TransferStatistics | None = None
    #: ``time.perf_counter()`` when the generation engine admitted it (None: not yet, or never: not held)
    admitted_at: float | None = None

    def __aiter__(self) -> AsyncIterator[int]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[int]:
        link = self.router.pick()
        link.in_flight += 1
        try:
            async for token in self._routed(link):
                yield token
        finally:
            link.in_flight -= 1

    async def _routed(self, link: ContextLink) -> AsyncIterator[int]:
        worker = self.router.worker
        handoff = await worker.prefill_remote(
            ContextRequest(
                self.key,
                self.prompt,
                self.max_tokens,
                self.seed,
                self.temperature,
                self.spec_k,
                self.stop_ids,
            ),
            link,
        )
        self.tokens.append(handoff.first_token)
        yield handoff.first_token
        if not handoff.held:
            return
        engine = worker.engine
        generation = engine.generate(
            self.prompt,
            max_tokens=self.max_tokens,
            stop_ids=self.stop_ids,
            seed=self.seed,
            temperature=self.temperature,
            spec_k=self.spec_k,
        )
        self.generation = generation
        request = generation.request
        rid = request.request_id
        try:
            worker.cache.expect_transfer(rid)
            # a batch row, pages and a slot, in arrival order: the context side holds the cache until then
            await engine.admit_transfer(generation)
            self.admitted_at = request.admitted_at
            worker.install_drafter_state(rid, self.prompt, handoff, self.spec_k)
            self.transfer = await worker.receive(rid, self.prompt, self.key, link)
        except BaseException:
            generation.cancel()  # the engine frees what the receiver left (nothing, once it owned the pages)
            worker.cache.forget_transfer(rid)  # never admitted: nothing else drops its mark
            worker.built.runner.release(rid)
            with anyio.CancelScope(shield=True):
                await worker.release_remote(self.key, link)
            raise
        engine.transfer_landed(generation, handoff.first_token)
        # the request's output list is the truth: its first token is the context side's
        output = request.output_ids
        async for _ in generation:
            while len(self.tokens) < len(output):
                self.tokens.append(output[len(self.tokens)])
                yield self.tokens[-1]

    async def collect(self) -> list[int]:
        return [t async for t in self]

    @property
    def draft_history(self) -> list[tuple[int, ...]]:
        return [] if self.generation is None else list(self.generation.request.draft_history)


@define(eq=False)
class Router:
    """Routes ``generate()`` calls: context peer first, then the local generation worker."""

    worker: GenerationWorker
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, init=False)

    def pick(self) -> ContextLink:
        """The context peer for the next request: of those still connected, the one with the fewest requests in
        flight (the first of them on a tie).

        :raises ~kvferry.errors.TransferError: no context peer is connected.
        """
        live = [link for link in self.worker.links if not link.gone]
        if not live:
            if self.worker.links:
                raise TransferError("every context engine went away: nobody can prefill the request")
            raise TransferError("not connected to a context engine")
        return min(live, key=lambda link: link.in_flight)

    def check_fits(self, num_prompt: int) -> None:
        """Raise :class:`~kvferry.errors.RequestTooLarge` when no connected context engine's pages (from its
        handshake) can hold a prompt of ``num_prompt`` tokens (all of them are judged alike: the smallest)."""
        for link in self.worker.links:
            self._check_context(link.remote, num_prompt)

    @staticmethod
    def _check_context(remote: PeerInfo, num_prompt: int) -> None:
        table = remote.page_tables[0]
        pages = table.pool_group("attention").num_slots - 1  # page 0 is reserved
        per_block = table.layer_group("attention").tokens_per_block
        needed = -(-num_prompt // per_block)
        if needed > pages:
            raise RequestTooLarge(
                f"a prompt of {num_prompt} tokens needs {needed} pages of {per_block} tokens; the context "
                f"engine has {pages}: shorten the prompt to {pages * per_block} tokens or less, or start the "
                f"context engine with --num-pages {needed + 1} or more"
            )

    def generate(
        self,
        prompt_ids: Iterable[int],
        *,
        max_tokens: int,
        stop_ids: Iterable[int] = (),
        seed: int | None = None,
        temperature: float = 1.0,
        spec_k: int = 0,
    ) -> RoutedGeneration:
        """A stream of tokens, as :meth:`kvferry.engine.engine.Engine.generate` gives in aggregated serving.

        Leaving the ``async for`` early cancels the request: a held context cache is released, a transfer in
        progress is cancelled (its pages stay quarantined until every writer has reported).

        Iterating raises :class:`~kvferry.errors.PrefillTimeout` when the context side does not answer the
        prefill within the worker's ``prefill_timeout`` (it is told to drop the request), and
        :class:`~kvferry.errors.TransferError` (or a subclass) when the prefill or the transfer fails.
        """
        return RoutedGeneration(
            self,
            f"r{next(self._ids)}",
            tuple(int(t) for t in prompt_ids),
            max_tokens,
            seed,
            temperature,
            spec_k,
            tuple(int(t) for t in stop_ids),
        )
