"""The noise schedule of one request, exactly as the scheduler produced it.

Trainers must never re-derive sigmas (``timesteps / 1000`` drifts by ULPs in fp32 and visibly
in bf16, and that drift shows up as log-prob error). So the sampler takes the scheduler's own
tensors after `set_timesteps`, clones them, and hands this snapshot to every consumer. It is
per-request data shared by all samples of the request: it is never sliced per sample and never
filtered by step filters; consumers index it by absolute step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.errors import InvalidRequestError

# `set_timesteps` mutates the scheduler; replicas may sample from several threads.
_SET_TIMESTEPS_LOCK = threading.Lock()


@dataclass(frozen=True, eq=False)
class ScheduleSnapshot:
    """Schedule of a request with `T` denoising steps.

    Attributes:
        sigmas: `(T + 1,)` fp32, the scheduler's `sigmas` after shifting, ending in 0.
            Step `i` moves from `sigmas[i]` to `sigmas[i + 1]`.
        timesteps: `(T,)`, the scheduler's `timesteps`, the model's time input at each step.
    """

    sigmas: torch.Tensor
    timesteps: torch.Tensor

    def __post_init__(self):
        if self.sigmas.dtype != torch.float32:
            raise ValueError(f"sigmas must be float32, got {self.sigmas.dtype}")
        if self.sigmas.ndim != 1 or self.timesteps.ndim != 1 or self.sigmas.shape[0] != self.timesteps.shape[0] + 1:
            raise ValueError(
                f"expected sigmas of shape (T + 1,) and timesteps of shape (T,), "
                f"got {tuple(self.sigmas.shape)} and {tuple(self.timesteps.shape)}"
            )

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[0]

    @classmethod
    def from_scheduler(
        cls, scheduler: FlowMatchEulerDiscreteScheduler, num_steps: int, mu: float | None = None
    ) -> "ScheduleSnapshot":
        """Runs `scheduler.set_timesteps(num_steps)` and keeps private copies of its tensors.

        Args:
            mu: resolution-dependent shift, for schedulers configured with `use_dynamic_shifting`.
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise InvalidRequestError("num_inference_steps", f"must be an integer >= 1, got {num_steps!r}")
        with _SET_TIMESTEPS_LOCK:
            scheduler.set_timesteps(num_steps, device="cpu", mu=mu)
            sigmas = scheduler.sigmas.detach().clone()
            timesteps = scheduler.timesteps.detach().clone()
        return cls(sigmas=sigmas, timesteps=timesteps)

    def latent_timesteps(self, latent_step_indices: torch.Tensor) -> torch.Tensor:
        """The time label of each kept latent `x_k`, shape `(K,)`: `timesteps[k]`, and 0 for the final `x_T`.

        This is SGLang's `dit_trajectory.timesteps`, one entry per returned latent. It is derived
        from the schedule for the trajectory's consumers; the schedule itself is never filtered.
        """
        labels = torch.cat([self.timesteps, self.timesteps.new_zeros(1)])
        return labels[latent_step_indices]

    def equals(self, other: "ScheduleSnapshot") -> bool:
        """Bit-for-bit equality (dtypes included), the only equality that matters for replay."""
        return (
            self.sigmas.dtype == other.sigmas.dtype
            and self.timesteps.dtype == other.timesteps.dtype
            and torch.equal(self.sigmas, other.sigmas)
            and torch.equal(self.timesteps, other.timesteps)
        )
