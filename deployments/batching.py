"""A replica's queue of work: whenever the replica frees up, it takes everything that waits.

One queue type for the worker replicas (sampling work, `SamplingWork`) and the scorer replicas
(`deployments/scorer.py`): each time the replica is free, it takes all waiting work of one
work's group (equal options, for a sampler; one group, for a scorer), oldest first, up to its
limit; a single work larger than the limit is taken alone. The work it starts from is the oldest
of the client served least recently (`SamplingWork.client`: the address or handle that sent
it): clients take turns, so one that queues many calls' worth of work delays another's by a
call at a time, not by its whole backlog (first come, first served, a one-sample request waited
11.7 s behind a flood of 32-sample ones, docs/reliability.md). Work whose deadline passed while
it waited fails with `DeadlineExceededError`, unsampled. Only a sampler waits for companions, as
follows.

Serve's `@serve.batch` forms the next batch on a timer while the current one runs, so concurrent
one-sample requests (how SGLang clients send) were split over several small sampler calls, each
padded to the micro-batch. Here the sampler takes, each time it is free, all waiting work with
the same options up to the batch limit, oldest first. An idle sampler waits only while the work
it would take leaves rows of its last micro-batch empty: the transformer runs on fixed-size
micro-batches, so a call of 2 samples costs as much as one of 8, and concurrent requests that
arrive a few milliseconds apart should fill those rows. How long depends on what may still come.
Each work says how many other samples the ingress that sent it had in flight then
(`SamplingWork.companions_in_flight`):
- while a waiting work says there were more than wait here now, the sampler waits for them, at
  most `wait_s` (they may also be on another replica: the wait is then in vain, as it always was);
- when every work announced is here, no more can come from that ingress, except the rest of a
  burst of requests whose first one reached an idle ingress (the ingress could not know they
  follow). The sampler then waits only `lone_wait_s` after the last arrival: a lone request
  starts almost at once, and a burst's requests, which arrive milliseconds apart, still meet.
A work that says nothing (not sent by an ingress) is waited for as in the first case.

A call need not run to its end for nothing: it is given `abandoned`, which says, from the thread
that runs it, which of its works no one waits for any more (the request cancelled: over HTTP its
client went away, through the handle `RolloutResult.cancel()`; its deadline passed; the replica
stopping). A sampler asks it before every step and drops those works' samples there
(`rollout.sampler.sample_tree`), so a call whose every work is abandoned ends at the next step.

Any grouping is safe: the sampler is batch invariant (fixed-size micro-batches, per-sample
generators), so a sample's bits do not depend on which requests it was sampled with, and a
sample's score does not depend on its companions (the scorers' own contract). With
several ingress replicas, work from another one may arrive just after the sampler started
without waiting: that makes a smaller call, never other bits.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from deployments.work import DeadlineExceededError


class QueuedWork(Protocol):
    """What the queue needs of a work: its size in samples, its deadline (`time.time()`; None:
    none) and its client (None: one unnamed client). A sampler's waiting for companions also reads
    its `companions_in_flight`."""

    deadline: float | None
    client: str | None

    def __len__(self) -> int: ...


W = TypeVar("W", bound=QueuedWork)

# Which works of a running call (indices into it) no one waits for any more; safe to call from the
# thread that runs the call.
Abandoned = Callable[[], Collection[int]]


@dataclass
class _Waiting(Generic[W]):
    work: W
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class BatchingQueue(Generic[W]):
    """Runs `run_group` on groups of works with equal `group_of`, one group at a time.

    Args:
        run_group: runs a group of works in one call, told which are abandoned meanwhile (`Abandoned`);
            one result (or exception) per work.
        max_samples: most samples per group; 0: one work a call.
        group_of: what works must share to share a call; by default, nothing.
        micro_batch_size: for a sampler, samples per transformer call of a group
            (`rollout.sampler.micro_batch_size` of its options): an idle sampler waits for work
            to fill its micro-batches, as described above; None: never wait.
        wait_s: how long an idle sampler waits for work to fill its micro-batches while the
            ingress said more was in flight.
        lone_wait_s: how long after the last arrival it waits when the ingress said nothing else
            was in flight (the first requests of a burst).
    """

    def __init__(
        self,
        run_group: Callable[[list[W], Abandoned], Awaitable[list[Any]]],
        max_samples: int,
        group_of: Callable[[W], Hashable] = lambda work: None,
        micro_batch_size: Callable[[Any], int] | None = None,
        wait_s: float = 0.0,
        lone_wait_s: float = 0.0,
    ):
        self._run_group = run_group
        self._group_of = group_of
        self._micro_batch_size = micro_batch_size
        self.max_samples = max_samples
        self.wait_s = wait_s
        self.lone_wait_s = lone_wait_s
        self._last_arrival = 0.0
        self._waiting: list[_Waiting] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._turns = 0  # calls taken so far
        self._served_at: dict[str | None, int] = {}  # the turn each waiting client was last served at

    async def submit(self, work: W) -> Any:
        """The work's result, once a call has run it; raises what that call raised for it."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._serve())
        waiting = _Waiting(work)
        self._waiting.append(waiting)
        self._last_arrival = asyncio.get_running_loop().time()
        self._arrived.set()
        return await waiting.result

    def stop(self) -> None:
        """Stops taking work; the call running is told that every work of it is abandoned."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()

    def _abandoned_in(self, group: list[_Waiting]) -> Abandoned:
        def abandoned() -> set[int]:
            # Runs on the call's thread: a future's state is one attribute, read without the loop.
            if self._stopping:
                return set(range(len(group)))
            now = time.time()
            return {
                i
                for i, waiting in enumerate(group)
                if waiting.result.done() or (waiting.work.deadline is not None and waiting.work.deadline < now)
            }

        return abandoned

    def _fills_its_micro_batches(self) -> bool:
        """Whether the group the sampler would take now leaves no row of a micro-batch empty."""
        group = self._group_of(self._waiting[0].work)
        samples = sum(len(w.work) for w in self._waiting if self._group_of(w.work) == group)
        return samples >= self.max_samples or samples % self._micro_batch_size(group) == 0

    def _more_announced(self) -> bool:
        """Whether a waiting work's ingress had more samples in flight when it sent it than wait here
        now (a work that does not say counts as announcing more)."""
        waiting = [w.work for w in self._waiting]
        if any(work.companions_in_flight is None for work in waiting):
            return True
        return max(work.companions_in_flight + len(work) for work in waiting) > sum(len(work) for work in waiting)

    async def _wait_for_companions(self, loop: asyncio.AbstractEventLoop) -> None:
        started = loop.time()
        while self._waiting and not self._fills_its_micro_batches():
            deadline = started + self.wait_s
            if not self._more_announced():
                deadline = min(deadline, self._last_arrival + self.lone_wait_s)
            if loop.time() >= deadline:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                return

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        idle = True
        while True:
            if not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
                idle = True
            if idle and self._micro_batch_size is not None:  # give work sent together a moment to arrive together
                await self._wait_for_companions(loop)
            group = self._take_group()
            if not group:
                continue
            idle = False
            try:
                results = await self._run_group([w.work for w in group], self._abandoned_in(group))
            except Exception as error:  # the group's requests fail; the queue goes on
                results = [error] * len(group)
            for waiting, result in zip(group, results):
                if waiting.result.done():  # the request was cancelled meanwhile
                    continue
                if isinstance(result, BaseException):
                    waiting.result.set_exception(result)
                else:
                    waiting.result.set_result(result)

    def _take_group(self) -> list[_Waiting]:
        """The oldest waiting work and all later work of its group, up to `max_samples`."""
        now = time.time()
        for waiting in self._waiting:
            deadline = waiting.work.deadline
            if deadline is not None and deadline < now and not waiting.result.done():
                waiting.result.set_exception(DeadlineExceededError(f"the deadline passed {now - deadline:.1f} s before sampling"))
        self._waiting = [w for w in self._waiting if not w.result.done()]  # drop cancelled and expired work
        if not self._waiting:
            return []
        # The oldest work of the client served least recently (never: first), then its group's.
        first = min(self._waiting, key=lambda w: self._served_at.get(w.work.client, -1))
        self._served_at = {w.work.client: self._served_at.get(w.work.client, -1) for w in self._waiting}
        self._served_at[first.work.client] = self._turns
        self._turns += 1
        kind = self._group_of(first.work)
        group, rest, samples = [first], [], len(first.work)
        for waiting in self._waiting:
            if waiting is first:
                continue
            if self._group_of(waiting.work) == kind and samples + len(waiting.work) <= self.max_samples:
                group.append(waiting)
                samples += len(waiting.work)
            else:
                rest.append(waiting)
        self._waiting = rest
        return group
