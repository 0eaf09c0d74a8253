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

from kvferry.disagg.protocol import ContextRequest
from kvferry.disagg.roles import GenerationWorker
from kvferry.disagg.session import TransferStatistics
from kvferry.engine.engine import Generation

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

    def __aiter__(self) -> AsyncIterator[int]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[int]:
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
            )
        )
        self.tokens.append(handoff.first_token)
        yield handoff.first_token
        if not handoff.held:
            return
        generation = worker.engine.generate(
            self.prompt,
            max_tokens=self.max_tokens,
            stop_ids=self.stop_ids,
            seed=self.seed,
            temperature=self.temperature,
            spec_k=self.spec_k,
        )
        self.generation = generation
        rid = generation.request.request_id
        try:
            worker.install_drafter_state(rid, self.prompt, handoff, self.spec_k)
            self.transfer = await worker.receive(rid, self.prompt, self.key)
        except BaseException:
            worker.built.runner.release(rid)
            with anyio.CancelScope(shield=True):
                await worker.release_remote(self.key)
            raise
        generation.request.append_tokens([handoff.first_token])
        # the request's output list is the truth (the engine's stream may or may not repeat the first token)
        output = generation.request.output_ids
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
