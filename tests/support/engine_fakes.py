"""Fakes of the cache manager and the model runner for engine tests that do not need the real model."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import define, field, frozen

from kvferry.engine.engine import DraftItem, ForwardItem
from kvferry.engine.request import RequestState
from kvferry.engine.scheduler import ItemKind, Scheduler, StepPlan
from kvferry.errors import PoolExhausted


@frozen
class FakeResumed:
    reused_tokens: int
    num_committed_tokens: int
    first: bool


@define(eq=False)
class FakeCache:
    """Counts pages and slots like the manager; suspend offloads pages (frees them), resume brings them back."""

    num_pages: int
    num_slots: int
    tokens_per_block: int = 4
    snapshot_interval: int | None = None
    free_pages: int = 0
    free_slots: int = 0
    pages: dict[int, int] = field(factory=dict)
    live: set[int] = field(factory=set)
    offloaded: dict[int, int] = field(factory=dict)
    log: list[tuple[str, int]] = field(factory=list)
    committed: dict[int, int] = field(factory=dict)

    def __attrs_post_init__(self) -> None:
        self.free_pages, self.free_slots = self.num_pages, self.num_slots

    def create(self, request_id: int, prompt_token_ids: Sequence[int]) -> None:
        assert request_id not in self.pages and request_id not in self.offloaded
        self.pages[request_id] = 0
        self.committed[request_id] = 0
        self.log.append(("create", request_id))

    def resume(self, request_id: int) -> FakeResumed:
        first = ("resume", request_id) not in self.log
        need = self.offloaded.get(request_id, 0)
        if self.free_slots < 1 or self.free_pages < need:
            raise PoolExhausted("fake")
        self.free_slots -= 1
        self.free_pages -= need
        self.pages[request_id] = self.offloaded.pop(request_id, self.pages.get(request_id, 0))
        self.live.add(request_id)
        self.log.append(("resume", request_id))
        return FakeResumed(0, self.committed[request_id], first)

    def grow(self, request_id: int, num_tokens: int) -> None:
        assert request_id in self.live
        need = -(-num_tokens // self.tokens_per_block) - self.pages[request_id]
        if need > self.free_pages:
            raise PoolExhausted("fake")
        if need > 0:
            self.free_pages -= need
            self.pages[request_id] += need

    def commit(self, request_id: int, token_ids: Sequence[int], *, num_pending_replay: int = 0) -> None:
        assert request_id in self.live
        total = self.committed[request_id] + len(token_ids)
        assert total <= self.pages[request_id] * self.tokens_per_block
        assert 0 <= num_pending_replay <= len(token_ids)
        self.committed[request_id] = total

    def suspend(self, request_id: int) -> None:
        assert request_id in self.live
        self.live.discard(request_id)
        self.free_slots += 1
        self.free_pages += self.pages[request_id]
        self.offloaded[request_id] = self.pages.pop(request_id)
        self.log.append(("suspend", request_id))

    def close(self, request_id: int) -> None:
        if request_id in self.live:
            self.live.discard(request_id)
            self.free_slots += 1
        self.free_pages += self.pages.pop(request_id, 0)
        self.offloaded.pop(request_id, None)
        self.committed.pop(request_id, None)
        self.log.append(("close", request_id))

    def next_snapshot_boundary(self, request_id: int) -> int | None:
        position = self.committed[request_id]
        if self.snapshot_interval is None:
            return None
        return (position // self.snapshot_interval + 1) * self.snapshot_interval


_MOD = (1 << 61) - 1


def prefix_key(tokens: Sequence[int]) -> int:
    key = 0
    for token in tokens:
        key = (key * 1000003 + token + 1) % _MOD
    return key


@define(eq=False)
class FakeRunner:
    """A 'model' whose logits are a pseudo-random function of the whole token prefix.

    It keeps each request's fed tokens (its 'cache') and checks that every step continues exactly where the
    committed tokens end. The drafter agrees with the target's greedy choice about 3 times in 4.
    """

    vocab_size: int = 64
    history: dict[int, list[int]] = field(factory=dict)
    accepted: dict[int, list[int]] = field(factory=dict)
    fail_on_token: int | None = None

    def logits(self, tokens: Sequence[int]) -> torch.Tensor:
        generator = torch.Generator().manual_seed(prefix_key(tokens))
        return torch.randn(self.vocab_size, generator=generator, dtype=torch.float64)

    def greedy(self, prompt: Sequence[int], n: int) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(torch.argmax(self.logits(tokens))))
        return tokens[len(prompt) :]

    def _draft(self, tokens: Sequence[int]) -> int:
        order = torch.argsort(self.logits(tokens), descending=True)
        return int(order[0] if prefix_key(tokens) % 4 else order[1])

    def propose(self, items: Sequence[DraftItem]) -> list[tuple[int, ...]]:
        out = []
        for item in items:
            tokens = [*self.history[item.request_id][: item.start], item.pending_token]
            drafts = []
            for _ in range(item.k):
                drafts.append(self._draft(tokens))
                tokens.append(drafts[-1])
            out.append(tuple(drafts))
        return out

    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        out: list[torch.Tensor] = []
        for item in items:
            if self.fail_on_token is not None and self.fail_on_token in item.token_ids:
                raise RuntimeError("model step failed")
            history = self.history.setdefault(item.request_id, [])
            assert len(history) >= item.start, "a step skipped tokens"
            del history[item.start :]
            history.extend(item.token_ids)
            end = len(history)
            out.extend(self.logits(history[: p + 1]) for p in range(end - item.num_logits, end))
        return torch.stack(out) if out else torch.empty(0, self.vocab_size, dtype=torch.float64)

    def record_accepted(self, request_id: int, num_accepted: int) -> None:
        self.accepted.setdefault(request_id, []).append(num_accepted)

    def release(self, request_id: int) -> None:
        self.history.pop(request_id, None)


def run_step(
    scheduler: Scheduler, plan: StepPlan, next_token: int = 9, *, distinct_decodes: bool = False
) -> None:
    """What the engine does after a step: sample for items that want logits, commit, finish.

    A prefill that wants logits samples ``next_token``; a decode samples ``next_token``, or
    ``next_token + item.start`` with ``distinct_decodes``.
    """
    for item in plan.items:
        request = item.request
        if item.kind is ItemKind.PREFILL:
            end = item.start + len(item.token_ids)
            if item.wants_logits:
                request.append_tokens([next_token])
        else:
            end = item.start + 1  # drafts all rejected: only the pending token is committed
            request.append_tokens([next_token + item.start if distinct_decodes else next_token])
        scheduler.commit(request, end)
        if request.finish_reason is not None:
            scheduler.finish(request, RequestState.FINISHED)
