"""What an engine is configured with (:class:`EngineConfig`) and what it reports (:class:`EngineStatistics`, one
:class:`StepTiming` per step)."""

from __future__ import annotations

from typing import NamedTuple

import attrs
from attrs import frozen

from kvferry.engine.scheduler import SchedulerConfig

__all__ = ["EngineConfig", "EngineStatistics", "StepTiming"]


@frozen
class EngineConfig:
    """Scheduler limits plus how the loop runs model steps."""

    scheduler: SchedulerConfig = attrs.field(factory=SchedulerConfig)
    #: run model steps in a worker thread (the event loop keeps serving while torch computes)
    step_in_thread: bool = True
    #: with ``step_in_thread``: while a step's model runs, hand the last step's commits to the manager and grow
    #: the next step's decodes (the same tokens, less host time between steps; see ``Engine``)
    overlap: bool = False
    #: steps of plain decodes only (one token each, no speculation) are launched from the event loop instead of a
    #: worker thread, and their tokens polled while the device computes (for a device whose launches return
    #: before the work ends: CUDA; the loop keeps its own work going meanwhile, see ``overlap``). Other steps, and
    #: every step of a device that computes as it is called, gain nothing from it: they keep ``step_in_thread``;
    #: so does a step the runner says would not launch at once (a first graph capture: ``decode_path_ready``)
    launch_on_loop: bool = False
    #: how long such a step's tokens are polled between the loop's turns before the wait moves to a worker thread
    launch_spin_seconds: float = 0.005
    #: bytes of host memory for caches moved off the device (None: no bound); past it, the idle conversations
    #: on the host are dropped, least recently used first (their next turn recomputes them)
    host_memory: int | None = None


class EngineStatistics(NamedTuple):
    #: engine steps that ran the model
    num_steps: int
    #: tokens handed to callers
    num_generated: int
    #: draft tokens proposed / accepted, over every request
    num_drafted: int
    num_accepted: int
    #: requests now waiting / running / finished so far / cancelled so far / failed so far
    num_waiting: int
    num_running: int
    num_finished: int
    num_cancelled: int
    num_failed: int
    #: total seconds spent in the host side (schedule + sample/commit) and in model steps
    host_seconds: float
    model_seconds: float

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0


class StepTiming(NamedTuple):
    """Where one engine step's time went (host: schedule + apply; the model step in between)."""

    num_items: int
    num_tokens: int
    num_decodes: int
    #: scheduling, including the cache manager's create/resume/grow/suspend
    schedule_seconds: float
    #: drafter + target model (building their inputs, and the greedy argmax that waits for the results)
    model_seconds: float
    #: seeded sampling, draft acceptance, manager commits, request bookkeeping
    apply_seconds: float
    #: host work done on the event loop while the model step ran (``EngineConfig.overlap``): not in host_seconds
    overlapped_seconds: float = 0.0
    #: the loop's time from the previous step's end to this step's start (the streams taking their tokens unless
    #: overlapped, reaping cancels); 0.0 for the first step and after the loop idled
    between_seconds: float = 0.0

    @property
    def host_seconds(self) -> float:
        return self.schedule_seconds + self.apply_seconds
