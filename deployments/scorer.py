"""A scorer's Serve deployment: one per configured scorer, with its own replicas and resources.

Each replica builds its scorer once (`rollout.scorers.registry`) and runs it off the event loop,
so health checks and new requests are answered while it scores. A per-sample scorer's replica
batches across requests in the workers' queue (`deployments/batching.py`): whenever the scorer
is free it takes every part waiting, oldest first, up to `max_batch_size` samples, with no timer:
a lone part is scored at once, and parts that arrive while it is busy share the next call. A
sample's score does not depend on its companions (the scorers' own contract), so any grouping
gives the same bits. If a call of several parts fails, each part is scored alone, so that one
request's bad sample fails that request only. A scorer's exception is logged here under a short
id, and its request told only its type and the id: its text may name paths, PIDs or devices. A
group-aware scorer takes the same queue one group a call: a replica never runs its scorer on two
threads at once, whichever kind it is.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from ray import serve

from deployments.batching import BatchingQueue
from rollout.errors import ScorerError, logged_failure
from rollout.scorers.base import ScoringSample, checked_scores
from rollout.scorers.registry import build_scorer

logger = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class ScoringWork:
    """One call's samples, as the queue holds them: scoring has timeouts, no deadline, and its
    parts come from the ingress, one client."""

    samples: list[ScoringSample]
    deadline: None = None
    client: None = None

    def __len__(self) -> int:
        return len(self.samples)


@serve.deployment
class ScorerReplica:
    """Args: `name`, as requests name it; `config`, its `ScorerConfig` as a plain dict. This module
    and its arguments import no model code: a replica of `ink` starts in what torch takes."""

    def __init__(self, name: str, config: dict[str, Any]):
        self.name = name
        self.scorer = build_scorer(config["kind"], config["options"])
        # A group-aware scorer's calls are its groups, never joined.
        # A scorer's call cannot stop midway: what is abandoned while it scores is scored anyway.
        self._queue = BatchingQueue(
            lambda works, abandoned: self._score_group(works), 0 if self.scorer.group_aware else config["max_batch_size"]
        )

    def __del__(self):
        if hasattr(self, "_queue"):  # Serve calls this after an __init__ that raised too
            self._queue.stop()

    async def group_aware(self) -> bool:
        return self.scorer.group_aware

    async def score(self, samples: list[ScoringSample]) -> list[float]:
        """One score per sample; `ScorerError` naming this scorer if it fails or answers wrongly."""
        return await self._queue.submit(ScoringWork(samples))

    async def _score_group(self, works: list[ScoringWork]) -> list[list[float] | Exception]:
        """The works' scores, in one call off the event loop; if a call of several works fails,
        each work is scored alone, so that one request's bad sample fails that request only."""
        try:
            scores = await asyncio.to_thread(self._scored, [sample for work in works for sample in work.samples])
        except Exception as error:
            if len(works) == 1:
                return [error]
            return [await self._scored_alone(work) for work in works]
        results, start = [], 0
        for work in works:
            results.append(scores[start : start + len(work)])
            start += len(work)
        return results

    async def _scored_alone(self, work: ScoringWork) -> list[float] | Exception:
        try:
            return await asyncio.to_thread(self._scored, work.samples)
        except Exception as error:
            return error

    def _scored(self, samples: list[ScoringSample]) -> list[float]:
        try:
            scores = self.scorer.score(samples)
        except ScorerError as error:  # a scorer's own short message
            logger.exception("scorer %r failed on %d samples", self.name, len(samples))
            # Named as the app config names it: an HTTP scorer, say, knows only its own name.
            raise ScorerError(self.name, error.reason) from None
        except Exception as error:  # its text may hold paths, PIDs, CUDA messages: the log has it
            reason = logged_failure(error, logger, f"scorer {self.name!r} on {len(samples)} samples")
            raise ScorerError(self.name, reason) from None
        return checked_scores(self.name, scores, len(samples))
