"""Pairwise preference within a group, from any per-sample scorer: a group-aware scorer.

Pref-GRPO turns absolute scores, which a policy learns to inflate, into win rates: each sample's
reward is the share of the other samples of its group (its prompt's samples in one request) that
it beats, a tie counting a half. Built on any per-sample scorer, so it shows the group-aware
protocol; a pairwise reward model proper would compare the two images itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rollout.scorers.base import ScoringSample


class PairwisePreference:
    """Win rates within a group under the `scorer` kind's scores (`rollout.scorers.registry`).

    Args:
        scorer: the per-sample scorer's kind (a built-in name or an import path).
        options: its keyword options.
    """

    group_aware = True

    def __init__(self, scorer: str, options: dict[str, Any] | None = None):
        from rollout.scorers.registry import build_scorer  # the registry names this class

        self.scorer = build_scorer(scorer, options)
        if self.scorer.group_aware:
            raise ValueError(f"pairwise preference needs a per-sample scorer, and {scorer!r} is group-aware")

    def score(self, samples: Sequence[ScoringSample]) -> list[float]:
        return win_rates(self.scorer.score(samples))


def win_rates(scores: Sequence[float]) -> list[float]:
    """For each score, the share of the others it beats (ties count 1/2); 0.5 for a group of one."""
    if len(scores) == 1:
        return [0.5]
    return [
        sum(1.0 if mine > theirs else 0.5 if mine == theirs else 0.0 for j, theirs in enumerate(scores) if j != i)
        / (len(scores) - 1)
        for i, mine in enumerate(scores)
    ]
