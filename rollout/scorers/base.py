"""What a scorer is: one float per sample from its image (or video) and its prompt.

A scorer is any object with a `score` method and a `group_aware` flag (`Scorer`). A per-sample
scorer (`group_aware = False`) is given any samples, from one request or from several batched
together, so a sample's score must not depend on the samples beside it: scorers that run a model
do it in fixed-size calls (`in_fixed_batches`), the batch invariance the sampler keeps with its
micro-batches. A group-aware scorer (`group_aware = True`, as Pref-GRPO's pairwise win rates) is
given one whole group per call: the samples of one prompt of one request, in order.

Scorers are built from a name and keyword options (`rollout.scorers.registry`), by the Serve
deployment that hosts each one, or directly in a trainer's process: the same object either way.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from rollout.errors import ScorerError
from rollout.kernels import zero_padded


@dataclass(frozen=True)
class ScoringSample:
    """One sample as a scorer sees it.

    Attributes:
        image: `(C, H, W)`, or `(C, F, H, W)` for a video, fp32 in [0, 1]: the sample's
            `generated_output` as sampled.
        prompt: the prompt it was conditioned on.
        metadata: plain values about it (`seed`, `prompt_index`, `sample_index`, `branch_path`).
        condition_images: its prompt's input images (an editing model's), each `(3, H, W)` uint8
            as the client sent them; () for a text prompt.
    """

    image: torch.Tensor
    prompt: str
    metadata: Mapping[str, Any] = field(default_factory=dict)
    condition_images: tuple[torch.Tensor, ...] = ()

    def __reduce__(self):
        # As numpy arrays, the images cross Ray's object store out of band: a scorer replica maps a
        # video's frames rather than unpickling a copy (torch tensors pickle their bytes in band).
        return _scoring_sample, (
            _array(self.image),
            self.prompt,
            dict(self.metadata),
            tuple(_array(image) for image in self.condition_images),
        )


def _array(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().contiguous().numpy()


def _scoring_sample(
    image: np.ndarray, prompt: str, metadata: dict[str, Any], condition_images: tuple[np.ndarray, ...] = ()
) -> ScoringSample:
    with warnings.catch_warnings():
        # Ray hands numpy buffers out of the object store read-only; torch cannot mark a tensor so.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        conditions = tuple(torch.from_numpy(array) for array in condition_images)
        return ScoringSample(torch.from_numpy(image), prompt, metadata, conditions)


@runtime_checkable
class Scorer(Protocol):
    group_aware: ClassVar[bool]

    def score(self, samples: Sequence[ScoringSample]) -> list[float]:
        """One finite score per sample, in order (a group-aware scorer: one group's samples)."""
        ...


def in_fixed_batches(rows: torch.Tensor, batch_size: int, call: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`call` over `rows` in calls of exactly `batch_size` rows, the last one padded with zero rows
    whose results are dropped: a row's result is then the same whatever rows come with it."""
    results = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        results.append(call(zero_padded(chunk, batch_size))[: len(chunk)])
    return torch.cat(results)


def checked_scores(scorer: str, scores: Any, expected: int) -> list[float]:
    """`scores` as floats, if they are `expected` finite numbers; else `ScorerError`."""
    if not isinstance(scores, (list, tuple)) or len(scores) != expected:
        count = len(scores) if isinstance(scores, (list, tuple)) else type(scores).__name__
        raise ScorerError(scorer, f"answered {count} scores for {expected} samples")
    for score in scores:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ScorerError(scorer, f"answered a score that is not a finite number: {score!r:.40}")
    return [float(score) for score in scores]
