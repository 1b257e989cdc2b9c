"""Scorers a user would write, loaded by the app by import path (`tests.deployments.scorer_plugins:...`)."""

import os
import time


class FailingScorer:
    """Raises on every call: a reward model that is down."""

    group_aware = False

    def score(self, samples):
        raise RuntimeError("the reward model is down")


class SlowInk:
    """Ink, `delay_s` a sample, and the pid of the replica that scored: what the fault test kills."""

    group_aware = False

    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s

    def score(self, samples):
        time.sleep(self.delay_s * len(samples))
        return [sample.image.float().mean().item() for sample in samples]

    def pid(self):
        return os.getpid()
