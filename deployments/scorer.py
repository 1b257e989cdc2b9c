"""A scorer's Serve deployment: one per configured scorer, with its own replicas and resources.

Each replica builds its scorer once (`rollout.scorers.registry`) and runs it off the event loop,
so health checks and new requests are answered while it scores. A per-sample scorer's replica
batches across requests the way the workers do (`deployments/batching.py`): whenever the scorer
is free it takes every part waiting, oldest first, up to `max_batch_size` samples, with no timer:
a lone part is scored at once, and parts that arrive while it is busy share the next call. A
sample's score does not depend on its companions (the scorers' own contract), so any grouping
gives the same bits. If a call of several parts fails, each part is scored alone, so that one
request's bad sample fails that request only. A group-aware scorer takes the same queue one group
a call: a replica never runs its scorer on two threads at once, whichever kind it is.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ray import serve

from rollout.errors import ScorerError
from rollout.scorers.base import ScoringSample, checked_scores
from rollout.scorers.registry import build_scorer

logger = logging.getLogger("ray.serve")


@dataclass
class _Waiting:
    samples: list[ScoringSample]
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


@serve.deployment
class ScorerReplica:
    """Args: `name`, as requests name it; `config`, its `ScorerConfig` as a plain dict. This module
    and its arguments import no model code: a replica of `ink` starts in what torch takes."""

    def __init__(self, name: str, config: dict[str, Any]):
        self.name = name
        self.scorer = build_scorer(config["kind"], config["options"])
        self.max_batch_size = config["max_batch_size"]
        self._waiting: deque[_Waiting] = deque()
        self._running: asyncio.Task | None = None

    async def group_aware(self) -> bool:
        return self.scorer.group_aware

    async def score(self, samples: list[ScoringSample]) -> list[float]:
        """One score per sample; `ScorerError` naming this scorer if it fails or answers wrongly."""
        waiting = _Waiting(samples)
        self._waiting.append(waiting)
        if self._running is None or self._running.done():
            self._running = asyncio.create_task(self._drain())
        return await waiting.result

    async def _drain(self) -> None:
        # A group-aware scorer's calls are its groups, never joined.
        limit = 0 if self.scorer.group_aware else self.max_batch_size
        while self._waiting:
            taken, count = [], 0
            while self._waiting and (not taken or count + len(self._waiting[0].samples) <= limit):
                taken.append(self._waiting.popleft())
                count += len(taken[-1].samples)
            try:
                scores = await asyncio.to_thread(self._scored, [s for w in taken for s in w.samples])
            except Exception as error:
                if len(taken) == 1:
                    _settle(taken[0], error=error)
                    continue
                for waiting in taken:  # whose samples failed it: each part alone
                    try:
                        _settle(waiting, await asyncio.to_thread(self._scored, waiting.samples))
                    except Exception as part_error:
                        _settle(waiting, error=part_error)
                continue
            start = 0
            for waiting in taken:
                _settle(waiting, scores[start : start + len(waiting.samples)])
                start += len(waiting.samples)

    def _scored(self, samples: list[ScoringSample]) -> list[float]:
        try:
            scores = self.scorer.score(samples)
        except Exception as error:
            logger.exception("scorer %r failed on %d samples", self.name, len(samples))
            # Named as the app config names it: an HTTP scorer, say, knows only its own name.
            reason = error.reason if isinstance(error, ScorerError) else f"{type(error).__name__}: {error}"
            raise ScorerError(self.name, reason) from None
        return checked_scores(self.name, scores, len(samples))


def _settle(waiting: _Waiting, scores: list[float] | None = None, error: Exception | None = None) -> None:
    if waiting.result.done():  # its caller went away
        return
    if error is not None:
        waiting.result.set_exception(error)
    else:
        waiting.result.set_result(scores)
