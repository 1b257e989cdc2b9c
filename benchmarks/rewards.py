"""Rewards in the rollout: scoring each part as it is sampled against scoring after the rollout.

Run by the suite (`python -m benchmarks`, section "Rewards in the rollout"). The scorer is
CPU-bound on purpose: `BusyInk` spins for a fixed time per sample (holding its core, as a model on
the CPU would) and then scores ink, so its cost is known and is about a third of the rollout's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ray import serve

from benchmarks.serving import Spread, take_turns
from deployments.scoring import scoring_samples
from rollout.scorers.base import ScoringSample

PROMPTS, OUTPUTS, STEPS = 8, 8, 20
SCORER_SHARE = 1 / 3  # the scorer's time over the rollout's


class BusyInk:
    """Ink, after `seconds_per_sample` of spinning on the CPU per sample."""

    group_aware = False

    def __init__(self, seconds_per_sample: float):
        self.seconds_per_sample = seconds_per_sample

    def score(self, samples: Sequence[ScoringSample]) -> list[float]:
        end = time.perf_counter() + self.seconds_per_sample * len(samples)
        while time.perf_counter() < end:
            pass
        return [sample.image.float().mean().item() for sample in samples]


def body(**fields) -> dict:
    return {
        "prompt": [str(d) for d in range(PROMPTS)], "num_outputs_per_prompt": OUTPUTS, "num_inference_steps": STEPS,
        "seed": 0, "rollout_debug_mode": False, **fields,
    }  # fmt: skip


def scorer_config(rollout_s: float) -> dict:
    """A `BusyInk` scorer deployment costing `SCORER_SHARE` of a rollout of `rollout_s`."""
    seconds = SCORER_SHARE * rollout_s / (PROMPTS * OUTPUTS)
    return {"kind": "benchmarks.rewards:BusyInk", "options": {"seconds_per_sample": seconds}, "num_cpus": 1}


def measure(handle, app_name: str, rounds: int) -> tuple[dict[str, list[float]], list[float]]:
    """Wall times of the rollout alone, with scoring overlapped, and with the same scorer after the
    whole rollout, taking turns; and the scorer's own time per overlapped request."""
    scorer = serve.get_deployment_handle("Scorer-busy", app_name=app_name)
    plain, scored = body(), body(rollout_reward_models=["busy"])
    reward_times: list[float] = []

    def overlapped() -> None:
        reward_times.append(handle.generate.remote(scored).result().fetch().reward_times.reward_time_s)

    def after() -> None:
        batch = handle.generate.remote(plain).result().batch()
        scorer.score.remote(scoring_samples(batch, 0, OUTPUTS)).result()

    times = take_turns(
        {"rollout alone": lambda: handle.generate.remote(plain).result().batch(), "scored as sampled": overlapped, "scored after": after},
        rounds,
    )
    return times, reward_times[1:]  # the warm-up's left out


def table(times: dict[str, list[float]], reward_times: list[float]) -> list[str]:
    alone = times["rollout alone"]
    rows = ["| path | seconds | / rollout alone, per round |", "|---|---|---|"]
    for name, series in times.items():
        ratio = "" if name == "rollout alone" else f"{Spread(tuple(t / a for t, a in zip(series, alone))):.3f}"
        rows.append(f"| {name} | {Spread(tuple(series)):.2f} | {ratio} |")
    rows += ["", f"The scorer's own time in a scored request: {Spread(tuple(reward_times)):.2f} s."]
    return rows
