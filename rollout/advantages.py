"""Group-normalised advantages, as Flow-GRPO computes them.

Each reward is compared with the rewards of its own group, the samples of one prompt in one
request: `(r - mean) / (std + 1e-4)`, with the population standard deviation (numpy's default,
`ddof=0`) in float64, as `flow_grpo/stat_tracking.py`'s `PerPromptStatTracker` does per batch. The
epsilon keeps a group whose samples scored alike at advantages of 0 rather than a division by 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

EPSILON = 1e-4


def group_advantages(rewards: Sequence[float], group_size: int) -> list[float]:
    """Advantages of `rewards` ordered group after group, `group_size` each."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    groups = np.asarray(rewards, dtype=np.float64).reshape(-1, group_size)
    mean = groups.mean(axis=1, keepdims=True)
    std = groups.std(axis=1, keepdims=True)
    return ((groups - mean) / (std + EPSILON)).reshape(-1).tolist()
