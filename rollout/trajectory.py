"""What a rollout returns: per-sample trajectories beside the per-request data they share.

Per-sample data (latents, log-probs, seed, image) lives in `SampleTrajectory`; per-request data
(the schedule, the options) lives once in `RolloutBatch`. No code ever has to guess from a
tensor's shape which kind it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        debug: per-step internals, when asked for.
        denoising_env: this sample's conditioning tensors (no batch dimension), when asked for.
    """

    prompt: str
    negative_prompt: str
    seed: int
    image: torch.Tensor
    final_latents: torch.Tensor
    log_probs: torch.Tensor
    latents: torch.Tensor
    latent_step_indices: torch.Tensor
    debug: StepDebug | None = None
    denoising_env: dict[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class RolloutBatch:
    """Samples that share one schedule and one set of options (with the model's defaults filled in)."""

    schedule: ScheduleSnapshot
    options: SamplingOptions
    samples: list[SampleTrajectory] = field(default_factory=list)
