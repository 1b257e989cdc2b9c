"""A request's life between the ingress and the worker replicas, written once: chunk, admit, send,
fetch with retries, cancel, deadline.

Plain asyncio over `Workers` (the worker deployment's handle in the application, a fake in the
tests), so it is tested without Serve, as `deployments/batching.py` is:
- chunk: a plan's samples are cut into chunks that give every worker replica a share, none larger
  than a worker's batch (`deployments/work.py`'s `cut_into_work`);
- cost: a request is costed in token-steps (`rollout.cost`, by the served model's `CostFacts`,
  asked of a worker replica once) and refused past `limits.max_request_cost` (`checked_cost`);
- admit: a request is refused while the cost of the requests in flight would pass the app's
  `max_queued_cost`, unless its client stays within its fair share of it (`Dispatcher._admit`),
  or while the server stops (`StoppingError`). A request counts from its admission until the
  workers have answered every part sent (sampled, failed or cancelled), whether or not anyone
  fetched it: over HTTP and through the handle alike (over HTTP, at once when all are fetched);
- send: each chunk's replica is chosen before the next chunk is sent, so that the router sees that
  replica's new load when it places the next one; each chunk carries the count of the other
  samples this ingress has in flight (`SamplingWork.companions_in_flight`), so that an idle worker
  does not wait for work that cannot come;
- fetch: a part whose worker replica died, or whose reference died with the ingress that owned it,
  is sampled again: sampling is seeded, so its samples are bit-identical. After
  `worker_retry_attempts` tries, `WorkerLostError` (`deployments/retries.py`);
- score: a request that asks for rewards has each part scored as soon as it is fetched
  (`deployments/scoring.py`);
- cancel: interrupted over HTTP (the client went away, the deadline passed, the server is
  stopping), or through the handle (`RolloutResult.cancel()`), the request's parts are cancelled:
  those still queued on the workers are dropped, and those being sampled leave their sampler call
  at its next step (`deployments/batching.py`);
- deadline: past `rollout_timeout_s` (or the app's `request_timeout_s`) nothing of the request
  is sampled any more, over HTTP and through the handle alike: a request still being sent fails
  with `DeadlineExceededError` (`within_deadline`), the workers refuse its work still queued so,
  and drop its samples from a call being sampled. Over HTTP the ingress also answers by then;
  through the handle, parts sampled in time are the trainer's whenever it fetches them
  (`timeout_s` bounds its wait).

`RolloutResult` is what the handle's `generate` returns. Its sync methods run the async ones on
this module's event-loop thread: one implementation, whichever way a trainer calls it.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol, TypeVar

import ray

from deployments.config import RolloutAppConfig
from deployments.ray_private import object_ref, object_store_bytes
from deployments.retries import asked_until_not_lost
from deployments.scoring import RequestScoring, RewardTimes, Scorers
from deployments.work import DeadlineExceededError, SamplingWork, ServiceUnavailableError, WorkerResult, cut_into_work
from rollout.cost import COST_UNIT, CostFacts, RequestCost, TransformerCost
from rollout.errors import RolloutError, ScorerError
from rollout.plan import RolloutPlan, checked_cost
from rollout.trajectory import RolloutBatch

T = TypeVar("T")

# What a lost worker replica (or a lost ingress, which owned the references) looks like to a caller.
LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
# The client key of requests through the handle without a client id of their own.
HANDLE_CLIENT = "handle"
# How often the ingress asks Ray whether a request's parts are answered, to stop counting its cost.
ANSWERED_POLL_S = 0.1


class OverloadedError(ServiceUnavailableError):
    """Admitting the request would pass `max_queued_cost`, and its client's fair share of it."""


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
        """Cancels the part: dropped if still queued, out of its sampler call at the next step if
        being sampled."""
        ...

    async def answered(self, parts: Sequence[Any]) -> None:
        """Returns once every part is answered (sampled, failed or cancelled), without fetching any."""
        ...

    async def cost_facts(self) -> CostFacts:
        """The served model's `CostFacts`, from a worker replica."""
        ...


@dataclass(frozen=True)
class ServeWorkers:
    """The worker deployment, through its handle; it travels with a `RolloutResult` to the trainer."""

    handle: Any  # DeploymentHandle

    async def send(self, work: SamplingWork) -> ray.ObjectRef:
        return await object_ref(self.handle.generate.remote(work))

    def cancel(self, part: ray.ObjectRef) -> None:
        ray.cancel(part)

    async def answered(self, parts: Sequence[ray.ObjectRef]) -> None:
        # ray.wait with timeout 0 does not block the event loop, and fetch_local=False leaves the
        # results where they are: the trainer fetches them on the handle's path.
        pending = list(parts)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=0, fetch_local=False)
            if pending:
                await asyncio.sleep(ANSWERED_POLL_S)

    async def cost_facts(self) -> CostFacts:
        return await self.handle.cost_facts.remote()


@dataclass(frozen=True)
class StageTimes:
    """Where one request's time went, in seconds: over HTTP in the `x-sgld-stages` header, through
    the handle from `FetchedRollout.stage_times`.

    Attributes:
        read: its body read and parsed (HTTP; 0 through the handle, whose request comes parsed).
        plan: validated, planned and costed at the ingress.
        fetch: from dispatch to every part fetched and scored, over HTTP; through the handle, the
            fetch call's own time (the trainer fetches whenever it likes). It holds the three below,
            and admission, transport and retries.
        queue: the longest any part waited on its worker replica before its sampler call began.
        sample: the longest sampler call of its parts (with whatever other work shared it).
        score: scoring after its last part was fetched: what sampling did not hide (`reward_wait_s`).
        encode: its response rows built and encoded (HTTP; 0 through the handle).
    """

    read: float
    plan: float
    fetch: float
    queue: float
    sample: float
    score: float
    encode: float

    def milliseconds(self) -> dict[str, float]:
        return {f"{stage}_ms": round(seconds * 1e3, 3) for stage, seconds in asdict(self).items()}


@dataclass(frozen=True)
class FetchedRollout:
    """A request's parts, fetched (and scored, when it asked for rewards).

    Attributes:
        parts: one `WorkerResult` per part, in request order.
        request_cost: what the request cost, in token-steps, as it was admitted (`rollout.cost`).
        reward_times: the request's scoring times; None when it asked for no rewards.
        plan_s: how long the ingress took to plan it.
        fetch_s: how long its fetch took (`StageTimes.fetch`).
    """

    parts: list[WorkerResult]
    request_cost: RequestCost
    reward_times: RewardTimes | None = None
    plan_s: float = 0.0
    fetch_s: float = 0.0

    def stage_times(
        self, read_s: float = 0.0, plan_s: float | None = None, fetch_s: float | None = None, encode_s: float = 0.0
    ) -> StageTimes:
        """`StageTimes`; over HTTP the ingress gives the stages only it sees, and its own plan and
        fetch times (None: those this result measured)."""
        return StageTimes(
            read=read_s,
            plan=self.plan_s if plan_s is None else plan_s,
            fetch=self.fetch_s if fetch_s is None else fetch_s,
            queue=max(part.queued_s for part in self.parts),
            sample=max(part.sampler_call_s for part in self.parts),
            score=0.0 if self.reward_times is None else self.reward_times.reward_wait_s,
            encode=encode_s,
        )

    def batch(self) -> RolloutBatch:
        """The parts' samples joined: one schedule, samples in request order."""
        return RolloutBatch.concat([part.batch for part in self.parts])

    def cost(self) -> TransformerCost:
        """The request's transformer rows and rows unbranched: the sums of its parts' (`rollout.cost`)."""
        return TransformerCost.total(part.cost for part in self.parts)


@dataclass(frozen=True)
class RolloutResult:
    """A dispatched request: its parts, still on the workers (or in Ray's object store).

    The ingress never unpacks a worker's tensors on the handle's path: `batch()` fetches the parts
    straight from the workers into the caller's process and joins them into one `RolloutBatch`
    (one schedule, samples in request order, sample i of prompt i // num_outputs_per_prompt).
    A part lost with its worker replica or with the ingress is sampled again by whoever fetches it,
    unless the request's `deadline` has passed (the worker refuses it: `DeadlineExceededError`).
    Parts sampled in time are fetched whenever the caller asks: sampled work is never thrown away.
    `transformer_cost()` says what the request cost the transformer and what a tree saved;
    `request_cost`, what it was admitted as, in token-steps (`rollout.cost`).
    """

    request_id: str
    seed: int
    num_outputs_per_prompt: int
    works: tuple[SamplingWork, ...]
    parts: tuple[Any, ...]
    workers: Workers
    max_attempts: int
    request_cost: RequestCost
    scoring: RequestScoring | None = None
    plan_s: float = 0.0

    async def fetch_async(self, timeout_s: float | None = None) -> FetchedRollout:
        """Every part, in order, its samples scored when the request asked for rewards
        (`deployments/scoring.py`); `timeout_s` bounds the whole fetch (`FetchTimeoutError`).
        Fetching again after a failure re-uses the parts sampled: nothing is sampled twice."""
        started = time.perf_counter()
        if self.scoring is None:
            fetched = await self._fetched_unscored(timeout_s)
        else:
            scored = self.scoring.scored(self._fetches(), [len(work) for work in self.works])
            parts, reward_times = await self._in_time(scored, timeout_s)
            fetched = FetchedRollout(parts, self.request_cost, reward_times)
        return replace(fetched, plan_s=self.plan_s, fetch_s=time.perf_counter() - started)

    async def batch_async(self, timeout_s: float | None = None) -> RolloutBatch:
        return (await self.fetch_async(timeout_s)).batch()

    async def transformer_cost_async(self, timeout_s: float | None = None) -> TransformerCost:
        """What the request cost the transformer, and would have cost unbranched: its parts' sums
        (`rollout.cost`: each part charged its own rows, padded as if alone in its call). Fetches
        the parts without scoring them (after `batch()`, from this node's object store), within
        `timeout_s` as `fetch` does."""
        return (await self._fetched_unscored(timeout_s)).cost()

    def fetch(self, timeout_s: float | None = None) -> FetchedRollout:
        return run_on_dispatch_loop(self.fetch_async(timeout_s))

    def batch(self, timeout_s: float | None = None) -> RolloutBatch:
        return run_on_dispatch_loop(self.batch_async(timeout_s))

    def transformer_cost(self, timeout_s: float | None = None) -> TransformerCost:
        return run_on_dispatch_loop(self.transformer_cost_async(timeout_s))

    def cancel(self) -> None:
        """Stops the request's sampling: its parts still queued are dropped, and those being sampled
        leave their sampler calls at the next step. (Dropping a `RolloutResult` does not cancel:
        copies of it, one pickled to the trainer among them, share its parts.)"""
        for part in self.parts:
            self.workers.cancel(part)

    async def _fetched_unscored(self, timeout_s: float | None) -> FetchedRollout:
        return FetchedRollout(await self._in_time(_gathered(self._fetches()), timeout_s), self.request_cost)

    def _fetches(self) -> list[Awaitable[WorkerResult]]:
        """Each part's fetch, in request order."""
        return [self._fetched(part, work) for part, work in zip(self.parts, self.works)]

    async def _fetched(self, part: Any, work: SamplingWork) -> WorkerResult:
        async def attempt(number: int) -> WorkerResult:
            return await (part if number == 1 else await self.workers.send(work))

        return await asked_until_not_lost(
            attempt,
            LOST,
            self.max_attempts,
            f"request {self.request_id}",
            lambda attempts: WorkerLostError(
                f"the worker replicas sampling this request were lost {attempts} times; send it again"
            ),
        )

    async def _in_time(self, fetches: Awaitable[T], timeout_s: float | None) -> T:
        """`fetches`' result, or `FetchTimeoutError` if the parts take longer than `timeout_s` in all."""
        try:
            return await asyncio.wait_for(fetches, timeout_s)
        except asyncio.TimeoutError:
            raise FetchTimeoutError(
                f"the request's parts were not all sampled within {timeout_s} s; fetch again to wait for them"
            ) from None


async def _gathered(fetches: list[Awaitable[T]]) -> list[T]:
    # Awaited inside a coroutine, so that a cancelled gather's error is retrieved rather than
    # logged by the garbage collector as never retrieved (asyncio.wait_for leaves it so).
    return list(await asyncio.gather(*fetches))


async def within_deadline(work: Awaitable[T], deadline: float) -> T:
    """`work`'s result, or `DeadlineExceededError` (`work` cancelled) if `deadline` passes first:
    how both paths hold a request to its `rollout_timeout_s`, whether it is being sent or fetched."""
    try:
        return await asyncio.wait_for(work, max(0.0, deadline - time.time()))
    except asyncio.TimeoutError:
        raise DeadlineExceededError("the request's deadline passed (rollout_timeout_s or request_timeout_s)") from None


class UnscoredResults:
    """HTTP requests sampled whose scoring failed, kept `keep_s` seconds so that the same request
    sent again is scored from the samples it already has rather than sampled again (through the
    handle, `RolloutResult.batch()` again does the same). Only a request with a seed can be the
    same request again; `rollout_reward_on_error` and `rollout_timeout_s` may differ on the retry.

    Their samples stay in the object store while kept, so at most `max_kept` requests are kept,
    and `max_bytes` of their parts in all, the oldest dropped first. A request's bytes are what
    `part_bytes` says its parts hold now (`object_store_bytes`), asked again at each `keep`: a part
    still being sampled counts at the bytes per sample of its request's parts already there (none
    there: nothing yet, and admission bounds the work in flight meanwhile). A request larger alone
    than `max_bytes` is not kept."""

    def __init__(
        self,
        keep_s: float,
        max_bytes: int,
        max_kept: int = 16,
        part_bytes: Callable[[Sequence[Any]], list[int | None]] = object_store_bytes,
    ):
        self.keep_s = keep_s
        self.max_bytes = max_bytes
        self.max_kept = max_kept
        self._part_bytes = part_bytes
        self._kept: OrderedDict[str, tuple[float, RolloutResult]] = OrderedDict()

    @staticmethod
    def _key(plan: RolloutPlan) -> str | None:
        if plan.rewards is None or plan.request.seed is None:
            return None
        return plan.request.model_dump_json(exclude={"rollout_reward_on_error", "rollout_timeout_s"})

    def keep(self, plan: RolloutPlan, result: RolloutResult) -> bool:
        """Keeps `result` for `plan`'s request sent again; False where it cannot be sent again, or
        is larger than `max_bytes` alone."""
        key = self._key(plan)
        if key is None or self.keep_s <= 0:
            return False
        self._kept[key] = (time.monotonic() + self.keep_s, result)
        self._kept.move_to_end(key)
        sizes = self._bytes([kept for _, kept in self._kept.values()])
        if sizes[-1] > self.max_bytes:
            del self._kept[key]
            return False
        while len(self._kept) > self.max_kept or sum(sizes) > self.max_bytes:
            self._kept.popitem(last=False)
            sizes.pop(0)
        return True

    def _bytes(self, results: list[RolloutResult]) -> list[int]:
        """Each result's bytes in the object store, its parts not there yet counted at its bytes per sample."""
        known = self._part_bytes([part for result in results for part in result.parts])
        sizes, start = [], 0
        for result in results:
            parts = list(zip(known[start : start + len(result.parts)], result.works))
            start += len(result.parts)
            there = [(size, len(work)) for size, work in parts if size is not None]
            held = sum(size for size, _ in there)
            per_sample = held / max(1, sum(samples for _, samples in there))
            sizes.append(held + round(per_sample * sum(len(work) for size, work in parts if size is None)))
        return sizes

    def take(self, plan: RolloutPlan) -> RolloutResult | None:
        """The kept result of `plan`'s request, to be scored as `plan` asks; None if none is kept."""
        now = time.monotonic()
        for key in [key for key, (expiry, _) in self._kept.items() if expiry < now]:
            del self._kept[key]
        key = self._key(plan)
        if key not in self._kept:
            return None
        _, result = self._kept.pop(key)
        return replace(result, scoring=replace(result.scoring, plan=plan.rewards))


class Dispatcher:
    """One ingress replica's side of every request: what it admits, sends, fetches and cancels.

    Args:
        workers: where the parts are sampled.
        config: the app's limits (request cost, queue, chunking, retries, deadlines, shutdown grace).
        queued_on_workers: the samples sent to the workers and not yet answered (the router's count).
        scorers: where the samples of requests that ask for rewards are scored.
        report_cost_in_flight: told the cost in flight, all clients', each time it changes (a gauge).
    """

    def __init__(
        self,
        workers: Workers,
        config: RolloutAppConfig,
        queued_on_workers: Callable[[], int],
        scorers: Scorers | None = None,
        report_cost_in_flight: Callable[[float], None] = lambda cost: None,
    ):
        self.workers = workers
        self.scorers = scorers
        self.unscored = UnscoredResults(config.keep_unscored_s, config.max_unscored_bytes)
        self.config = config
        self._queued_on_workers = queued_on_workers
        self._routing_samples = 0  # admitted, not yet placed on a worker replica
        # Token-steps of the requests admitted whose parts are not all answered, by client.
        self.cost_in_flight: Counter[str] = Counter()
        self._report_cost_in_flight = report_cost_in_flight
        self._releases: set[asyncio.Task] = set()  # each waits for a request's parts, then releases its cost
        self._cost_facts: CostFacts | None = None
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """From now on requests are refused with `StoppingError`, and those in flight that do not
        finish within half of `graceful_shutdown_timeout_s` are answered so too."""
        self._stopping.set()

    def deadline(self, plan: RolloutPlan) -> float:
        return time.time() + (plan.request.rollout_timeout_s or self.config.request_timeout_s)

    async def cost_facts(self) -> CostFacts:
        """The served model's `CostFacts`, asked of a worker replica on first use and kept: they
        change only with the model, and a new model is a new application."""
        if self._cost_facts is None:
            self._cost_facts = await self.workers.cost_facts()
        return self._cost_facts

    async def dispatch(self, plan: RolloutPlan, deadline: float, client: str = HANDLE_CLIENT) -> RolloutResult:
        """Costs the plan (`InvalidRequestError` past `limits.max_request_cost`), admits it for
        `client` and sends its chunks before `deadline` (`DeadlineExceededError`); interrupted, it
        cancels what it sent. Its cost counts until the workers have answered every part."""
        result, _ = await self._dispatched(plan, deadline, client)
        return result

    async def _dispatched(self, plan: RolloutPlan, deadline: float, client: str) -> tuple[RolloutResult, Callable[[], None]]:
        """`dispatch`'s result, and the release of its cost for a caller who knows before the
        workers' answers are seen that every part is answered: it fetched them all."""
        facts = await self.cost_facts()
        cost = checked_cost(plan, facts, self.config.limits)
        works = cut_into_work(plan, self.config.num_worker_replicas, self.config.max_batch_size, deadline)
        budget = self.config.queued_cost_limit(facts)
        parts, release = await within_deadline(self._admitted_and_sent(works, cost, client, budget), deadline)
        result = RolloutResult(
            plan.request_id,
            plan.seed,
            plan.num_outputs_per_prompt,
            tuple(work for work, _ in parts),
            tuple(part for _, part in parts),
            self.workers,
            self.config.worker_retry_attempts,
            cost,
            None if plan.rewards is None else RequestScoring(plan.rewards, plan.num_outputs_per_prompt, self.scorers, self.config.scorers),
        )
        return result, release

    async def _admitted_and_sent(
        self, works: list[SamplingWork], cost: RequestCost, client: str, budget: int
    ) -> tuple[list[tuple[SamplingWork, Any]], Callable[[], None]]:
        """Each work, admitted and stamped with its companions, and its part on a worker replica;
        and the release of its cost. Admission and the first stamp run in one step of the event
        loop: what another request admits meanwhile is counted as in flight only for the chunks
        sent after it. The request's cost counts until every part sent is answered, however this
        ends."""
        self._admit(cost.token_steps, client, budget)
        self._routing_samples += sum(len(work) for work in works)
        stamped: list[SamplingWork] = []
        parts: list[Any] = []
        try:
            for work in works:
                # What may still reach the worker along with it: an idle worker waits only for that.
                companions = self._queued_on_workers() + self._routing_samples - len(work)
                stamped.append(replace(work, companions_in_flight=companions, client=client))
                parts.append(await self.workers.send(stamped[-1]))
                self._routing_samples -= len(work)  # the router counts them from here on
        except BaseException:
            for part in parts:
                self.workers.cancel(part)
            raise
        finally:
            self._routing_samples -= sum(len(work) for work in works[len(parts) :])
            release = self._release_when_answered(parts, client, cost.token_steps)
        return list(zip(stamped, parts)), release

    def _release_when_answered(self, parts: list[Any], client: str, token_steps: int) -> Callable[[], None]:
        """Stops counting `token_steps` against `client` once the workers have answered every part
        (polled: `ANSWERED_POLL_S`), or when the returned release is called, whichever comes first;
        the second is a no-op."""
        released = False

        def release() -> None:
            nonlocal released
            if released:
                return
            released = True
            self.cost_in_flight[client] -= token_steps
            if self.cost_in_flight[client] <= 0:
                del self.cost_in_flight[client]
            self._report_cost_in_flight(sum(self.cost_in_flight.values()))
            if parts and asyncio.current_task() is not watcher:  # its polling is no longer needed
                watcher.cancel()

        async def released_when_answered() -> None:
            try:
                await self.workers.answered(parts)
            finally:  # also when the event loop closes with the parts unanswered: nothing outlives it
                release()

        if not parts:
            release()
            return release
        watcher = asyncio.ensure_future(released_when_answered())
        self._releases.add(watcher)
        watcher.add_done_callback(self._releases.discard)
        return release

    async def sampled(self, plan: RolloutPlan, client: str) -> FetchedRollout:
        """The plan's parts, sampled for `client` and fetched here (the HTTP path), within the plan's
        deadline and the server's shutdown grace; interrupted, the work still queued is cancelled.
        Parts whose scoring failed are kept for the same request sent again (`UnscoredResults`)."""
        deadline = self.deadline(plan)

        async def dispatched_and_fetched() -> FetchedRollout:
            kept = self.unscored.take(plan)  # sampled before: admitted then, and answered
            result, release = (kept, lambda: None) if kept else await self._dispatched(plan, deadline, client)
            try:
                fetched = await within_deadline(result.fetch_async(), deadline)
                release()  # every part fetched: the next request of this client sees its cost gone
                return fetched
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

        return await self._unless_stopped(dispatched_and_fetched())

    def _admit(self, cost: int, client: str, budget: int) -> None:
        """Counts `cost` against `client`, or refuses it (`OverloadedError`, naming the limit).

        Admitted while everything in flight plus `cost` fits `budget` (so a lone client may use all
        of it, and a request larger than the budget is still admitted to an empty queue), or while
        the client's own cost in flight plus `cost` fits its fair share, budget / n with n the
        clients with work in flight, itself counted: one client's backlog cannot refuse a newcomer.
        Admissions by share stop at twice the budget: that is the most ever in flight, but for one
        request larger than the budget alone."""
        if self._stopping.is_set():
            raise StoppingError("the server is stopping; send it again once it is back")
        in_flight = sum(self.cost_in_flight.values())
        if in_flight and in_flight + cost > budget:
            clients = len(self.cost_in_flight.keys() | {client})
            share, own = budget // clients, self.cost_in_flight[client]
            queue = (
                f"this ingress has {in_flight:,} {COST_UNIT} in flight and this request costs {cost:,}, "
                f"over max_queued_cost ({budget:,})"
            )
            if own + cost > share:
                raise OverloadedError(
                    f"{queue}, and over this client's fair share of it ({share:,}: 1/{clients}, with {clients} "
                    f"clients' work in flight), of which it has {own:,} in flight; send it again shortly"
                )
            if in_flight + cost > 2 * budget:
                raise OverloadedError(
                    f"{queue}, and over twice it ({2 * budget:,}), the most admitted within clients' fair "
                    "shares; send it again shortly"
                )
        self.cost_in_flight[client] += cost
        self._report_cost_in_flight(in_flight + cost)

    async def _unless_stopped(self, work: Coroutine[Any, Any, T]) -> T:
        """`work`'s result, unless the server stops and it does not finish within half the shutdown
        grace (`StoppingError`, so that the answer comes before Serve kills this replica). Either
        way, or when the client goes away (Serve then cancels this coroutine), `work` is cancelled."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task}, timeout=self.config.graceful_shutdown_timeout_s / 2)
            if task.done():
                return task.result()
            raise StoppingError("the server stopped before this request was sampled; send it again once it is back")
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
