"""A request's life between the ingress and the worker replicas, written once: chunk, admit, send,
fetch with retries, cancel, deadline.

Plain asyncio over `Workers` (the worker deployment's handle in the application, a fake in the
tests), so it is tested without Serve, as `deployments/batching.py` is:
- chunk: a plan's samples are cut into chunks that give every worker replica a share, none larger
  than a worker's batch;
- admit: a request is refused while its samples would queue more than `max_queued_samples`
  (`OverloadedError`), or while the server stops (`StoppingError`);
- send: each chunk's replica is chosen before the next chunk is sent, so that the router sees that
  replica's new load when it places the next one; each chunk carries the count of the other
  samples this ingress has in flight (`SamplingWork.companions_in_flight`), so that an idle worker
  does not wait for work that cannot come;
- fetch: a part whose worker replica died, or whose reference died with the ingress that owned it,
  is sampled again: sampling is seeded, so its samples are bit-identical. After
  `worker_retry_attempts` tries, `WorkerLostError`;
- score: a request that asks for rewards has each part scored as soon as it is fetched
  (`deployments/scoring.py`);
- cancel: interrupted (the client went away, the deadline passed, the server is stopping), the
  parts still queued on the workers are cancelled;
- deadline: past `rollout_timeout_s` (or the app's `request_timeout_s`) the request fails with
  `DeadlineExceededError`, and the workers drop its work that is still queued.

`RolloutResult` is what the handle's `generate` returns. Its sync methods run the async ones on
this module's event-loop thread: one implementation, whichever way a trainer calls it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import ray

from deployments.config import RolloutAppConfig
from deployments.ray_private import object_ref
from deployments.scoring import RequestScoring, Scorers, UnscoredResults
from rollout.cost import TransformerCost
from rollout.errors import InvalidRequestError, RolloutError, ScorerError
from rollout.plan import DeadlineExceededError, RolloutPlan, SamplingWork
from rollout.trajectory import RolloutBatch
from rollout.tree import FACTORS_FIELD

if TYPE_CHECKING:  # the worker's module loads the model code, which the ingress does not run
    from deployments.worker import WorkerResult

logger = logging.getLogger("ray.serve")
T = TypeVar("T")

# What a lost worker replica (or a lost ingress, which owned the references) looks like to a caller.
LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


class ServiceUnavailableError(RolloutError):
    """The request was not served now, but may be if sent again after `retry_after_s` (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.retry_after_s)


class OverloadedError(ServiceUnavailableError):
    """Admitting the request would queue more samples than `max_queued_samples` allows."""


class StoppingError(ServiceUnavailableError):
    """The server is stopping (`stop_serving`): send the request again once it is back."""


class WorkerLostError(ServiceUnavailableError):
    """The worker replicas sampling the request died, and so did every retry on another one."""


class FetchTimeoutError(RolloutError, TimeoutError):
    """`RolloutResult.batch(timeout_s=...)` ran out of time; the parts are still being sampled, and
    fetching again waits for them."""


class Workers(Protocol):
    """Where a request's parts are sampled."""

    async def send(self, work: SamplingWork) -> Awaitable[WorkerResult]:
        """A reference to the work's result (awaiting it fetches the result), once a replica took it."""
        ...

    def cancel(self, part: Any) -> None:
        """Cancels the part if it is still queued (a part being sampled finishes)."""
        ...


@dataclass(frozen=True)
class ServeWorkers:
    """The worker deployment, through its handle; it travels with a `RolloutResult` to the trainer."""

    handle: Any  # DeploymentHandle

    async def send(self, work: SamplingWork) -> ray.ObjectRef:
        return await object_ref(self.handle.generate.remote(work))

    def cancel(self, part: ray.ObjectRef) -> None:
        ray.cancel(part)


@dataclass(frozen=True)
class RolloutResult:
    """A dispatched request: its parts, still on the workers (or in Ray's object store).

    The ingress never unpacks a worker's tensors on the handle's path: `batch()` fetches the parts
    straight from the workers into the caller's process and joins them into one `RolloutBatch`
    (one schedule, samples in request order, sample i of prompt i // num_outputs_per_prompt).
    A part lost with its worker replica or with the ingress is sampled again by whoever fetches it.
    `transformer_cost()` says what the request cost the transformer and what a tree saved.
    """

    request_id: str
    seed: int
    num_outputs_per_prompt: int
    works: tuple[SamplingWork, ...]
    parts: tuple[Any, ...]
    workers: Workers
    max_attempts: int
    scoring: RequestScoring | None = None

    async def worker_results_async(self, timeout_s: float | None = None) -> list[WorkerResult]:
        """Every part's `WorkerResult`, in order, its samples scored when the request asked for
        rewards (`deployments/scoring.py`); `timeout_s` bounds the whole fetch (`FetchTimeoutError`).
        Fetching again after a failure re-uses the parts sampled: nothing is sampled twice."""
        fetches = [self._fetched(part, work) for part, work in zip(self.parts, self.works)]
        if self.scoring is None:
            fetches = asyncio.gather(*fetches)
        else:
            fetches = self.scoring.scored(fetches, [len(work) for work in self.works])
        return list(await _within(fetches, timeout_s))

    async def batch_async(self, timeout_s: float | None = None) -> RolloutBatch:
        return joined_batch(await self.worker_results_async(timeout_s))

    async def transformer_cost_async(self, timeout_s: float | None = None) -> TransformerCost:
        """What the request cost the transformer, and would have cost unbranched: its parts' sums
        (`rollout.cost`: each part charged its own rows, padded as if alone in its call). Fetches
        the parts without scoring them (after `batch()`, from this node's object store), within
        `timeout_s` as `worker_results` does."""
        fetches = asyncio.gather(*(self._fetched(part, work) for part, work in zip(self.parts, self.works)))
        return request_cost(await _within(fetches, timeout_s))

    def worker_results(self, timeout_s: float | None = None) -> list[WorkerResult]:
        return run_on_dispatch_loop(self.worker_results_async(timeout_s))

    def batch(self, timeout_s: float | None = None) -> RolloutBatch:
        return run_on_dispatch_loop(self.batch_async(timeout_s))

    def transformer_cost(self, timeout_s: float | None = None) -> TransformerCost:
        return run_on_dispatch_loop(self.transformer_cost_async(timeout_s))

    def cancel(self) -> None:
        for part in self.parts:
            self.workers.cancel(part)

    async def _fetched(self, part: Any, work: SamplingWork) -> WorkerResult:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await part
            except LOST as error:
                logger.warning(
                    "request %s: a part was lost (%s), attempt %d of %d",
                    self.request_id, type(error).__name__, attempt, self.max_attempts,
                )  # fmt: skip
                if attempt == self.max_attempts:
                    raise WorkerLostError(
                        f"the worker replicas sampling this request were lost {attempt} times; send it again"
                    ) from None
            part = await self.workers.send(work)
        raise AssertionError("unreachable: the last attempt returns or raises")


async def _within(fetches: Awaitable[T], timeout_s: float | None) -> T:
    """`fetches`' result, or `FetchTimeoutError` if the parts take longer than `timeout_s` in all."""
    try:
        return await asyncio.wait_for(fetches, timeout_s)
    except asyncio.TimeoutError:
        raise FetchTimeoutError(
            f"the request's parts were not all sampled within {timeout_s} s; fetch again to wait for them"
        ) from None


def joined_batch(parts: list[WorkerResult]) -> RolloutBatch:
    return RolloutBatch.concat([part.batch for part in parts])


def request_cost(parts: list[WorkerResult]) -> TransformerCost:
    """A request's transformer rows and rows unbranched: the sums of its parts' (`rollout.cost`)."""
    return TransformerCost.total(part.cost for part in parts)


def chunk_size(num_samples: int, num_worker_replicas: int, max_batch_size: int) -> int:
    """Chunks small enough that every replica gets a share, and no larger than a worker batch."""
    return max(1, min(max_batch_size, math.ceil(num_samples / num_worker_replicas)))


class Dispatcher:
    """One ingress replica's side of every request: what it admits, sends, fetches and cancels.

    Args:
        workers: where the parts are sampled.
        config: the app's limits (chunking, queue, retries, deadlines, shutdown grace).
        queued_on_workers: the samples sent to the workers and not yet answered (the router's count).
        scorers: where the samples of requests that ask for rewards are scored.
    """

    def __init__(
        self,
        workers: Workers,
        config: RolloutAppConfig,
        queued_on_workers: Callable[[], int],
        scorers: Scorers | None = None,
    ):
        self.workers = workers
        self.scorers = scorers
        self.unscored = UnscoredResults(config.keep_unscored_s)
        self.config = config
        self._queued_on_workers = queued_on_workers
        self._routing_samples = 0  # admitted, not yet placed on a worker replica
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """From now on requests are refused with `StoppingError`, and those in flight that do not
        finish within half of `graceful_shutdown_timeout_s` are answered so too."""
        self._stopping.set()

    def deadline(self, plan: RolloutPlan) -> float:
        return time.time() + (plan.request.rollout_timeout_s or self.config.request_timeout_s)

    async def dispatch(self, plan: RolloutPlan, deadline: float) -> RolloutResult:
        """Admits the plan's samples and sends its chunks; interrupted, it cancels what it sent."""
        per_root = plan.branching.leaves_per_root
        if per_root > self.config.max_batch_size:  # a root's leaves are sampled in one worker call
            raise InvalidRequestError(
                FACTORS_FIELD,
                f"their product ({per_root}, the leaves of a root, sampled together) must be at most the "
                f"server's max_batch_size ({self.config.max_batch_size})",
            )
        size = chunk_size(plan.num_samples, self.config.num_worker_replicas, self.config.max_batch_size)
        works = plan.work(size, deadline=deadline)
        self._admit(plan.num_samples)
        stamped: list[SamplingWork] = []
        parts: list[Any] = []
        try:
            for work in works:
                # What may still reach the worker along with it: an idle worker waits only for that.
                companions = self._queued_on_workers() + self._routing_samples - len(work)
                stamped.append(replace(work, companions_in_flight=companions))
                parts.append(await self.workers.send(stamped[-1]))
                self._routing_samples -= len(work)  # the router counts them from here on
        except BaseException:
            for part in parts:
                self.workers.cancel(part)
            raise
        finally:
            self._routing_samples -= sum(len(work) for work in works[len(parts) :])
        return RolloutResult(
            plan.request_id,
            plan.seed,
            plan.num_outputs_per_prompt,
            tuple(stamped),
            tuple(parts),
            self.workers,
            self.config.worker_retry_attempts,
            None if plan.rewards is None else RequestScoring(plan.rewards, plan.num_outputs_per_prompt, self.scorers, self.config.scorers),
        )

    async def sampled(self, plan: RolloutPlan) -> list[WorkerResult]:
        """The plan's parts, sampled and fetched here (the HTTP path), within the plan's deadline and
        the server's shutdown grace; interrupted, the work still queued is cancelled. Parts whose
        scoring failed are kept for the same request sent again (`UnscoredResults`)."""
        deadline = self.deadline(plan)

        async def dispatched_and_fetched() -> list[WorkerResult]:
            result = self.unscored.take(plan) or await self.dispatch(plan, deadline)
            try:
                return await result.worker_results_async()
            except ScorerError as error:
                if not self.unscored.keep(plan, result):
                    raise
                raise ScorerError(
                    error.scorer,
                    f"{error.reason}; the samples are kept {self.unscored.keep_s:g} s: the same request sent again "
                    "is scored from them, not sampled again",
                ) from None
            except BaseException:
                result.cancel()
                raise

        return await self._in_time(dispatched_and_fetched(), deadline)

    def _admit(self, samples: int) -> None:
        """Counts `samples` as queued, or refuses them if the queue would pass its limit (a request
        larger than the limit is still admitted to an empty queue)."""
        if self._stopping.is_set():
            raise StoppingError("the server is stopping; send it again once it is back")
        queued = self._queued_on_workers() + self._routing_samples
        limit = self.config.queued_samples_limit()
        if queued and queued + samples > limit:
            raise OverloadedError(
                f"{queued} samples are queued and this request adds {samples}, over the limit of {limit} "
                "(max_queued_samples in the app config); send it again shortly"
            )
        self._routing_samples += samples

    async def _in_time(self, work: Coroutine[Any, Any, T], deadline: float) -> T:
        """`work`'s result, unless its deadline passes first (`DeadlineExceededError`) or the server
        stops and it does not finish within half the shutdown grace (`StoppingError`, so that the
        answer comes before Serve kills this replica). Either way, or when the client goes away
        (Serve then cancels this coroutine), `work` is cancelled."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopping}, timeout=max(0.0, deadline - time.time()), return_when=asyncio.FIRST_COMPLETED)
            if stopping.done() and not task.done():
                grace = min(self.config.graceful_shutdown_timeout_s / 2, max(0.0, deadline - time.time()))
                await asyncio.wait({task}, timeout=grace)
            if task.done():
                return task.result()
            if stopping.done():
                raise StoppingError("the server stopped before this request was sampled; send it again once it is back")
            raise DeadlineExceededError("the request's deadline passed (rollout_timeout_s or request_timeout_s)")
        finally:
            task.cancel()
            stopping.cancel()


_dispatch_loop: tuple[int, asyncio.AbstractEventLoop] | None = None  # (the process that runs it, the loop)
_dispatch_loop_started = threading.Lock()


def run_on_dispatch_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """Runs `coroutine` on this module's event-loop thread (started on first use in each process,
    since a forked child has the loop but not its thread) and waits for its result: how the sync
    API runs the async code, from a plain thread or from inside another event loop alike."""
    global _dispatch_loop
    with _dispatch_loop_started:
        if _dispatch_loop is None or _dispatch_loop[0] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="rollout-dispatch", daemon=True).start()
            _dispatch_loop = (os.getpid(), loop)
    future = asyncio.run_coroutine_threadsafe(coroutine, _dispatch_loop[1])
    try:
        return future.result()
    except BaseException:  # a KeyboardInterrupt while waiting, say: stop the work it waited for
        future.cancel()
        raise
