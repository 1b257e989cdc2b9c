"""Scorers a user would write, loaded by the app by import path (`tests.deployments.scorer_plugins:...`)."""

import time


class FailingScorer:
    """Raises on every call: a reward model that is down, its message naming a path on the server."""

    group_aware = False
    message = "the reward model at /srv/models/reward.bin is down"

    def score(self, samples):
        raise RuntimeError(self.message)


class SlowInk:
    """Ink, after `delay_s` a sample: scoring that lasts long enough for the fault test to kill it."""

    group_aware = False

    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s

    def score(self, samples):
        time.sleep(self.delay_s * len(samples))
        return [sample.image.float().mean().item() for sample in samples]
