"""Requests as the engine sees them: one state enum, one transition table, one runtime object.

Every state change of a request goes through :meth:`Request.transition`, which looks the pair up in
:data:`TRANSITIONS`; a pair that is not there raises :class:`~kvferry.errors.InvalidTransition` and changes
nothing. The states, in the order a request normally takes them::

    WAITING ──admit──> PREFILLING ──prompt done──> DECODING ──stop──> FINISHED
       │                   │   ^                     │   ^
       │                   v   │ resume              v   │ resume
       │                  PREEMPTED <────────────────┘───┘
       │                                (suspended in the manager: pages kept or on the host, slot given back)
       └─ any live state ──> CANCELLED (the caller left) | FAILED (a model step or the cache raised)

Disaggregation adds TRANSFERRING: a context-side request whose prompt is done waits there while its cache is
pushed; a generation-side request waits there while the cache arrives, then decodes.

Its owner may hold a request aside: SUSPENDED (from WAITING, PREFILLING, DECODING or PREEMPTED; its cache is kept,
on the device or moved to the host, and it is not scheduled) until it is resumed: back to WAITING when it never held
a cache, else to PREEMPTED (queued for re-admission, which restores its cache).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence

import attrs
import torch
from attrs import define, frozen

from kvferry.errors import ConfigError, InvalidTransition

__all__ = [
    "TRANSITIONS",
    "Request",
    "RequestState",
    "SamplingParams",
    "check_transition",
]


class RequestState(enum.Enum):
    """Where a request is in its life. FINISHED, CANCELLED and FAILED are terminal."""

    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    TRANSFERRING = "transferring"
    #: held aside by its owner (Generation.suspend) until resumed
    SUSPENDED = "suspended"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL

    @property
    def holds_slot(self) -> bool:
        """True when the request's cache is resumed in the manager (it owns a live state slot)."""
        return self in (RequestState.PREFILLING, RequestState.DECODING)


_TERMINAL = frozenset({RequestState.FINISHED, RequestState.CANCELLED, RequestState.FAILED})
_ENDINGS = frozenset({RequestState.CANCELLED, RequestState.FAILED})

#: The one table of allowed transitions: ``TRANSITIONS[src]`` is the set of states ``src`` may move to.
TRANSITIONS: dict[RequestState, frozenset[RequestState]] = {
    RequestState.WAITING: frozenset(
        {RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.SUSPENDED}
    )
    | _ENDINGS,
    RequestState.PREFILLING: frozenset(
        {
            RequestState.DECODING,
            RequestState.PREEMPTED,
            RequestState.TRANSFERRING,
            # the first token sampled at the end of the prompt can already be the last one
            RequestState.FINISHED,
            RequestState.SUSPENDED,
        }
    )
    | _ENDINGS,
    RequestState.DECODING: frozenset({RequestState.PREEMPTED, RequestState.FINISHED, RequestState.SUSPENDED})
    | _ENDINGS,
    RequestState.PREEMPTED: frozenset(
        {RequestState.PREFILLING, RequestState.DECODING, RequestState.SUSPENDED}
    )
    | _ENDINGS,
    RequestState.SUSPENDED: frozenset({RequestState.WAITING, RequestState.PREEMPTED}) | _ENDINGS,
    RequestState.TRANSFERRING: frozenset({RequestState.DECODING, RequestState.FINISHED}) | _ENDINGS,
    RequestState.FINISHED: frozenset(),
    RequestState.CANCELLED: frozenset(),
    RequestState.FAILED: frozenset(),
}


def check_transition(src: RequestState, dst: RequestState) -> None:
    """Raise :class:`~kvferry.errors.InvalidTransition` unless ``src -> dst`` is in :data:`TRANSITIONS`."""
    if dst not in TRANSITIONS[src]:
        raise InvalidTransition(f"request state {src.name} -> {dst.name} is not allowed")


@frozen
class SamplingParams:
    """How the next token is chosen from the logits.

    ``seed is None`` means greedy (argmax). With a seed, the token at output position ``i`` is drawn with the
    Gumbel-max rule from a generator seeded by ``(seed, i)`` alone, so the draw never depends on batching,
    chunking or how many draft tokens were verified in the same step: a seeded run is as reproducible as a
    greedy one.
    """

    seed: int | None = None
    temperature: float = 1.0

    def __attrs_post_init__(self) -> None:
        if self.seed is not None and not 0 <= self.seed < 2**62:
            raise ConfigError(f"seed must be in [0, 2**62), got {self.seed}")
        if not self.temperature > 0.0:
            raise ConfigError(f"temperature must be positive, got {self.temperature}")

    @property
    def is_greedy(self) -> bool:
        return self.seed is None


def _token_ids(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _token_set(value: Iterable[int]) -> frozenset[int]:
    return frozenset(int(v) for v in value)


@define(eq=False, on_setattr=attrs.setters.NO_OP)  # plain setattr: the engine updates these every step
class Request:
    """The engine's runtime record of one generation request.

    ``num_computed`` counts the tokens of :attr:`all_ids` whose cache (KV pages, recurrent state) is written
    and committed in the manager; the tokens after it are what the next step must feed. ``reused_tokens`` is
    how many prompt tokens came from the prefix cache instead of being computed.
    """

    request_id: int
    prompt_ids: tuple[int, ...] = attrs.field(converter=_token_ids)
    max_tokens: int
    stop_ids: frozenset[int] = attrs.field(factory=frozenset, converter=_token_set)
    sampling: SamplingParams = attrs.field(factory=SamplingParams)
    spec_k: int = 0
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = attrs.field(factory=list)
    num_computed: int = 0
    #: tokens the manager's block table covers (what the scheduler last grew it to)
    capacity: int = 0
    reused_tokens: int = 0
    #: the drafter's proposals of every verify step, in order (the oracle compares them across runs)
    draft_history: list[tuple[int, ...]] = attrs.field(factory=list)
    num_drafted: int = 0
    num_accepted: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    error: BaseException | None = None
    #: ``time.perf_counter()`` when the scheduler first admitted it (a batch row, pages and a slot reserved)
    admitted_at: float | None = None
    #: its prompt is prefilled elsewhere: admission reserves its pages and it waits in TRANSFERRING for its cache
    awaits_transfer: bool = False
    #: its cache already exists in the manager (SUSPENDED, ``num_computed`` tokens committed; a conversation's
    #: next turn): admission resumes it instead of creating it
    resumes_cache: bool = False
    #: when it finishes or is cancelled, its cache is suspended and kept instead of closed (a conversation's turn)
    keep_cache: bool = False
    #: called (synchronously, once) when it reached a terminal state, with whether its cache was kept
    on_end: Callable[[Request, bool], None] | None = attrs.field(default=None, repr=False)
    generator: torch.Generator | None = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.prompt_ids:
            raise ConfigError("a request needs at least one prompt token")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.spec_k < 0:
            raise ConfigError(f"spec_k must be >= 0, got {self.spec_k}")
        if self.sampling.seed is not None and self.generator is None:
            self.generator = torch.Generator(device="cpu")

    # --- state ----------------------------------------------------------------------------------------

    def transition(self, dst: RequestState) -> None:
        """Move to ``dst``; raise :class:`~kvferry.errors.InvalidTransition` (changing nothing) if not allowed."""
        check_transition(self.state, dst)
        self.state = dst

    # --- tokens ---------------------------------------------------------------------------------------

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def all_ids(self) -> tuple[int, ...]:
        return self.prompt_ids + tuple(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.num_prompt

    @property
    def remaining_prompt(self) -> int:
        return max(0, self.num_prompt - self.num_computed)

    @property
    def remaining_tokens(self) -> int:
        """How many more tokens it may emit before max_tokens."""
        return self.max_tokens - len(self.output_ids)

    def effective_spec_k(self) -> int:
        """Drafts worth proposing this step: never more than the tokens still allowed after the bonus token."""
        return max(0, min(self.spec_k, self.remaining_tokens - 1))

    def append_tokens(self, tokens: Sequence[int]) -> list[int]:
        """Append sampled tokens up to the stop conditions; return the ones kept (a stop id is kept).

        Sets ``finish_reason`` when a stop condition is met; the caller moves the state.
        """
        output = self.output_ids
        kept: list[int] = []
        for token in tokens:
            if self.finish_reason is not None:
                break
            token = int(token)
            output.append(token)
            kept.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif len(output) >= self.max_tokens:
                self.finish_reason = "length"
        return kept

    def record_draft(self, proposals: Sequence[int], num_accepted: int) -> None:
        self.draft_history.append(tuple(int(p) for p in proposals))
        self.num_drafted += len(proposals)
        self.num_accepted += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    def __repr__(self) -> str:
        return (
            f"<Request {self.request_id} {self.state.name} prompt={self.num_prompt} "
            f"out={len(self.output_ids)}/{self.max_tokens} computed={self.num_computed} "
            f"reused={self.reused_tokens} k={self.spec_k} accepted={self.num_accepted}/{self.num_drafted}>"
        )
