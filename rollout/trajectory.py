"""What a rollout returns: per-sample trajectories beside the per-request data they share.

Per-sample data (latents, log-probs, seed, image) lives in `SampleTrajectory`; per-request data
(the schedule, the options) lives once in `RolloutBatch`. No code ever has to guess from a
tensor's shape which kind it holds. Each sample refers to its request's one `ScheduleSnapshot`
object; pickling keeps that sharing, so the schedule crosses a process boundary once and the
samples still refer to one object on the other side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot


@dataclass(frozen=True)
class StepDebug:
    """One sample's per-step internals, each stacked over the T steps, fp32.

    Attributes:
        model_outputs: `(T, ...)` velocity used at each step, after guidance.
        prev_sample_means: `(T, ...)` mean of the transition at each step.
        noise_std_devs: `(T,)` std of x_next around the mean (0 on deterministic steps).
        variance_noises: `(T, ...)` the standard-normal draws (zeros where a step drew none).
    """

    model_outputs: torch.Tensor
    prev_sample_means: torch.Tensor
    noise_std_devs: torch.Tensor
    variance_noises: torch.Tensor


@dataclass(frozen=True)
class SampleTrajectory:
    """Everything that belongs to one sample of a request.

    Attributes:
        prompt, negative_prompt: what the sample was conditioned on.
        seed: the seed of this sample's generator (the request's seed + the sample's index).
        image: `(C, H, W)` fp32 in [0, 1].
        final_latents: `(*latent_shape)` fp32, x_T.
        log_probs: `(T,)` fp32, log-prob of the transition taken at each step (0 on ODE steps).
        latents: `(K, *latent_shape)` fp32, the kept latents.
        latent_step_indices: `(K,)` int64, the absolute step of each kept latent (T is x_T).
        schedule: the request's schedule, the same object for every sample of the request.
        weight_version: the version of the weights that sampled it, as the server names them.
        debug: per-step internals, when asked for.
        denoising_env: this sample's conditioning, when asked for: `Conditioning.row`'s map in
            SGLang's layout (`image_kwargs`, `pos_cond_kwargs`, `neg_cond_kwargs`, `guidance`),
            tensors without the batch dimension.
    """

    schedule: ScheduleSnapshot
    prompt: str
    negative_prompt: str
    seed: int
    image: torch.Tensor
    final_latents: torch.Tensor
    log_probs: torch.Tensor
    latents: torch.Tensor
    latent_step_indices: torch.Tensor
    weight_version: str | None = None
    debug: StepDebug | None = None
    denoising_env: dict[str, Any] | None = None


@dataclass(frozen=True)
class RolloutBatch:
    """Samples that share one schedule and one set of options (with the model's defaults filled in)."""

    schedule: ScheduleSnapshot
    options: SamplingOptions
    samples: list[SampleTrajectory] = field(default_factory=list)

    def __post_init__(self):
        if any(s.schedule is not self.schedule for s in self.samples):
            raise ValueError("every sample of a batch must refer to the batch's schedule object")

    def subset(self, indices: Sequence[int]) -> "RolloutBatch":
        """The samples at `indices`, sharing this batch's schedule."""
        return RolloutBatch(self.schedule, self.options, [self.samples[i] for i in indices])

    @classmethod
    def concat(cls, parts: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Joins batches sampled with the same options and a bit-identical schedule.

        The result keeps the first part's schedule object and points every sample at it, so the
        joined batch still carries its schedule once.
        """
        first = parts[0]
        for part in parts[1:]:
            if part.options != first.options:
                raise ValueError(f"cannot join batches with different options: {first.options} != {part.options}")
            if not part.schedule.equals(first.schedule):
                raise ValueError("cannot join batches whose schedules differ")
        samples = [
            sample if sample.schedule is first.schedule else dataclasses.replace(sample, schedule=first.schedule)
            for part in parts
            for sample in part.samples
        ]
        return cls(first.schedule, first.options, samples)
