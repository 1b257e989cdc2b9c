"""A request's rewards, written once for both paths: each part is scored as soon as it is fetched.

Plain asyncio over `Scorers` (the scorer deployments' handles in the application, a fake in the
tests), as `deployments/dispatch.py` is over the workers. Whoever fetches a request's parts scores
them: the ingress on the HTTP path, the trainer's process on the handle's (`RolloutResult`), so a
trainer's images go from the workers' object store to the scorers without passing the ingress.
- A per-sample scorer is sent each part's samples the moment that part is fetched, so scoring
  overlaps the sampling of the parts still on the workers.
- A group-aware scorer is sent each prompt's group (`num_outputs_per_prompt` samples) once every
  part holding a sample of it is fetched.
- A scorer replica that dies is asked again, up to the scorer's `retry_attempts`: the samples are
  kept here, never sampled again. A scorer that raises, answers wrongly or takes longer than its
  `timeout_s` fails the request with a `ScorerError` naming it (an exception by its type and an
  id under which the log has its text), or, with `rollout_reward_on_error: "null"`, leaves its
  rewards null. The failed request's samples are still there to score again: through the handle
  in its `RolloutResult`, over HTTP in `dispatch.UnscoredResults` for the same request sent again.
- With `rollout_advantages: "group"`, each scorer's rewards are normalised within each group once
  all are in (`rollout.advantages`); a group with a null reward gets null advantages.
- The request's reward times (`RewardTimes`) are the request's, given once beside its parts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import ray

from deployments.retries import asked_until_not_lost
from deployments.work import WorkerResult
from rollout.advantages import group_advantages
from rollout.errors import ScorerError, logged_failure
from rollout.plan import RewardPlan
from rollout.scorers.base import ScoringSample, checked_scores
from rollout.trajectory import RolloutBatch

if TYPE_CHECKING:
    from deployments.config import ScorerConfig

# A scorer call whose replica died (samples travel by value, so no object can be lost with it).
REPLICA_LOST = ray.exceptions.RayActorError

logger = logging.getLogger("ray.serve")


class Scorers(Protocol):
    """Where samples are scored, by scorer name."""

    async def group_aware(self, scorer: str) -> bool:
        """Whether the scorer takes one whole group a call (`rollout.scorers.base`)."""
        ...

    async def score(self, scorer: str, samples: list[ScoringSample]) -> list[float]: ...


@dataclass
class ServeScorers:
    """The scorer deployments, through their handles; they travel with a `RolloutResult`. Whether
    a scorer is group-aware is its class's to say, and the class may need what only its replicas
    have (a GPU, a user's package): it is asked once."""

    handles: dict[str, Any]  # name -> DeploymentHandle
    _group_aware: dict[str, bool] = field(default_factory=dict)

    async def group_aware(self, scorer: str) -> bool:
        if scorer not in self._group_aware:
            self._group_aware[scorer] = await self.handles[scorer].group_aware.remote()
        return self._group_aware[scorer]

    async def score(self, scorer: str, samples: list[ScoringSample]) -> list[float]:
        return await self.handles[scorer].score.remote(samples)


def scoring_samples(batch: RolloutBatch, first_index: int, group_size: int) -> list[ScoringSample]:
    """A batch's samples as scorers see them; `first_index` is its first sample's index in the request."""
    return [
        ScoringSample(
            image=sample.image,
            prompt=sample.prompt,
            metadata={
                "sample_index": index,
                "prompt_index": index // group_size,
                "seed": sample.seed,
                "branch_path": list(sample.branch_path),
            },
            condition_images=tuple(image.pixels for image in sample.condition_images),
        )
        for index, sample in enumerate(batch.samples, start=first_index)
    ]


class RewardTimes(NamedTuple):
    """How long one request's scoring took (a pair, as `rollout.rows.response_rows` takes it).

    Attributes:
        reward_time_s: the wall time during which any of its scoring calls ran.
        reward_wait_s: of that, what came after its last part was fetched: the reward time not
            hidden behind sampling.
    """

    reward_time_s: float
    reward_wait_s: float


@dataclass(frozen=True)
class RequestScoring:
    """What scoring one request takes: what it asks for and where the scorers are.

    Attributes:
        plan: the request's scorers and options.
        group_size: samples per prompt (a group).
        scorers: where they run.
        settings: each scorer's timeout and retries, from the app config.
    """

    plan: RewardPlan
    group_size: int
    scorers: Scorers
    settings: dict[str, ScorerConfig]

    async def scored(
        self, fetches: Sequence[Awaitable[WorkerResult]], sizes: Sequence[int]
    ) -> tuple[list[WorkerResult], RewardTimes]:
        """The parts (`fetches`, of `sizes` samples each, in request order) with their samples'
        rewards and advantages set, each part scored as soon as it is fetched, and the request's
        reward times."""
        fetched = [asyncio.ensure_future(fetch) for fetch in fetches]
        fetched_at: list[float] = []
        for fetch in fetched:
            fetch.add_done_callback(lambda _: fetched_at.append(time.perf_counter()))
        calls: list[tuple[float, float]] = []  # (start, end) of every scoring call
        starts = [0, *itertools.accumulate(sizes)][:-1]
        total = sum(sizes)
        rewards: dict[str, list[float | None]] = {name: [None] * total for name in self.plan.scorers}

        async def score_part(name: str, part: int) -> None:
            result = await fetched[part]
            samples = scoring_samples(result.batch, starts[part], self.group_size)
            rewards[name][starts[part] : starts[part] + sizes[part]] = await self._scores(name, samples, calls)

        async def score_group(name: str, first: int) -> None:
            last = first + self.group_size
            parts = [i for i in range(len(sizes)) if starts[i] < last and starts[i] + sizes[i] > first]
            samples = [
                sample
                for i in parts
                for sample in scoring_samples((await fetched[i]).batch, starts[i], self.group_size)
                if first <= sample.metadata["sample_index"] < last
            ]
            rewards[name][first:last] = await self._scores(name, samples, calls)

        tasks = [asyncio.ensure_future(self._group_aware(name)) for name in self.plan.scorers]
        await _all_or_cancel([*tasks], also=fetched)
        group_aware = dict(zip(self.plan.scorers, (task.result() for task in tasks)))
        tasks = []
        for name in self.plan.scorers:
            if group_aware[name]:
                tasks += [score_group(name, first) for first in range(0, total, self.group_size)]
            else:
                tasks += [score_part(name, part) for part in range(len(sizes))]
        await _all_or_cancel([*fetched, *(asyncio.ensure_future(task) for task in tasks)])
        sampled = max(fetched_at)
        after_sampling = [(max(start, sampled), end) for start, end in calls if end > sampled]
        times = RewardTimes(_covered(calls), _covered(after_sampling))
        advantages = self._advantages(rewards) if self.plan.group_advantages else None
        results = []
        for part, start in enumerate(starts):
            result = fetched[part].result()
            samples = [
                dataclasses.replace(
                    sample,
                    rewards={name: rewards[name][index] for name in self.plan.scorers},
                    advantages=None if advantages is None else {name: advantages[name][index] for name in self.plan.scorers},
                )
                for index, sample in enumerate(result.batch.samples, start=start)
            ]
            batch = RolloutBatch(result.batch.schedule, result.batch.options, result.batch.model, samples)
            results.append(dataclasses.replace(result, batch=batch))
        return results, times

    async def _group_aware(self, name: str) -> bool:
        try:
            return await asyncio.wait_for(self.scorers.group_aware(name), self.settings[name].timeout_s)
        except (REPLICA_LOST, asyncio.TimeoutError) as error:
            raise ScorerError(name, f"its deployment did not answer ({type(error).__name__})") from None
        except Exception as error:
            raise ScorerError(name, logged_failure(error, logger, f"asking scorer {name!r} its kind")) from None

    async def _scores(self, name: str, samples: list[ScoringSample], calls: list) -> list[float | None]:
        """The scorer's scores of `samples`, asked again while its replica dies; on failure, a
        `ScorerError`, or nulls when the request said so. Each call's (start, end) goes to `calls`."""
        settings = self.settings[name]

        async def attempt(_: int) -> list[float]:
            try:
                scores = await asyncio.wait_for(self.scorers.score(name, samples), settings.timeout_s)
            except asyncio.TimeoutError:
                raise ScorerError(name, f"did not answer {len(samples)} samples within its timeout_s ({settings.timeout_s} s)") from None
            except (ScorerError, REPLICA_LOST):  # a scorer's own message; a lost replica is asked again
                raise
            except Exception as error:  # whatever else Ray or Serve raised: its text stays in the log
                reason = logged_failure(error, logger, f"scorer {name!r} on {len(samples)} samples")
                raise ScorerError(name, reason) from None
            return checked_scores(name, scores, len(samples))

        start = time.perf_counter()
        try:
            return await asked_until_not_lost(
                attempt,
                REPLICA_LOST,
                settings.retry_attempts,
                f"scorer {name!r}",
                lambda attempts: ScorerError(name, f"its replicas were lost {attempts} times"),
            )
        except ScorerError:
            if self.plan.nulls_on_error:
                return [None] * len(samples)
            raise
        finally:
            calls.append((start, time.perf_counter()))

    def _advantages(self, rewards: dict[str, list[float | None]]) -> dict[str, list[float | None]]:
        advantages = {}
        for name, values in rewards.items():
            advantages[name] = []
            for first in range(0, len(values), self.group_size):
                group = values[first : first + self.group_size]
                advantages[name] += [None] * len(group) if None in group else group_advantages(group, len(group))
        return advantages


def _covered(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of `(start, end)` intervals."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


async def _all_or_cancel(tasks: list[asyncio.Future], also: Sequence[asyncio.Future] = ()) -> None:
    """Waits for every task; the first to fail cancels the others (and `also`) and its error is raised."""
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in [*tasks, *also]:
            task.cancel()
        raise
