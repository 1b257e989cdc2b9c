"""The noise schedule of one request, exactly as the scheduler produced it.

Trainers must never re-derive sigmas (``timesteps / 1000`` drifts by ULPs in fp32 and visibly
in bf16, and that drift shows up as log-prob error). So the sampler takes the scheduler's own
tensors after `set_timesteps`, clones them, and hands this snapshot to every consumer. It is
per-request data shared by all samples of the request: it is never sliced per sample and never
filtered by step filters; consumers index it by absolute step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from rollout.errors import InvalidRequestError, short_repr

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler


def timesteps_as_they_are(timesteps: torch.Tensor) -> torch.Tensor:
    """The time input of a transformer that takes the scheduler's `timesteps` unchanged (SD3, the
    embedded model): the `model_timesteps` mapping of `ScheduleSnapshot.from_scheduler`."""
    return timesteps


@dataclass(frozen=True, eq=False)
class ScheduleSnapshot:
    """Schedule of a request with `T` denoising steps.

    Attributes:
        sigmas: `(T + 1,)` fp32, the scheduler's `sigmas` after shifting, ending in 0.
            Step `i` moves from `sigmas[i]` to `sigmas[i + 1]`.
        timesteps: `(T,)`, the scheduler's `timesteps` (sigmas * 1000).
        model_timesteps: `(T,)` fp32, the time input the transformer was given at each step,
            computed from `timesteps` the way the model family does (SD3 takes `timesteps`
            as they are; FLUX.1 and Qwen-Image round them to the model dtype and divide by
            1000). Replay feeds these, so the transformer sees what it saw in the rollout.
            Always given, never defaulted: for FLUX.1 it is `timesteps / 1000`, and a snapshot
            rebuilt with `timesteps` in its place replays with a time input 1000x too large.
        model_experts: `(T,)` int64 for a model with several denoisers (Wan2.2-A14B's high- and
            low-noise experts): at each step, the index into the pipeline's `experts` of the one
            that ran, so replay calls the same one. None for a model with one denoiser.
    """

    sigmas: torch.Tensor
    timesteps: torch.Tensor
    model_timesteps: torch.Tensor
    model_experts: torch.Tensor | None = None

    def __post_init__(self):
        if self.sigmas.dtype != torch.float32:
            raise ValueError(f"sigmas must be float32, got {self.sigmas.dtype}")
        if self.sigmas.ndim != 1 or self.timesteps.ndim != 1 or self.sigmas.shape[0] != self.timesteps.shape[0] + 1:
            raise ValueError(
                f"expected sigmas of shape (T + 1,) and timesteps of shape (T,), "
                f"got {tuple(self.sigmas.shape)} and {tuple(self.timesteps.shape)}"
            )
        if self.model_timesteps.shape != self.timesteps.shape or self.model_timesteps.dtype != torch.float32:
            raise ValueError(
                f"model_timesteps must be float32 of the shape of timesteps {tuple(self.timesteps.shape)}, "
                f"got {self.model_timesteps.dtype} {tuple(self.model_timesteps.shape)}"
            )
        experts = self.model_experts
        if experts is not None and (experts.shape != self.timesteps.shape or experts.dtype != torch.int64):
            raise ValueError(
                f"model_experts must be int64 of the shape of timesteps {tuple(self.timesteps.shape)}, "
                f"got {experts.dtype} {tuple(experts.shape)}"
            )

    @property
    def num_steps(self) -> int:
        return self.timesteps.shape[0]

    @classmethod
    def from_scheduler(
        cls,
        scheduler: FlowMatchEulerDiscreteScheduler,
        num_steps: int,
        *,
        sigmas: np.ndarray | None = None,
        mu: float | None = None,
        model_timesteps: Callable[[torch.Tensor], torch.Tensor],
    ) -> "ScheduleSnapshot":
        """Runs `set_timesteps` on a private copy of `scheduler` and keeps its tensors.

        The copy gives every request its own scheduler state: `set_timesteps` mutates it, and
        concurrent requests of different sizes (different `mu`) must not see each other's.

        Args:
            sigmas, mu: passed to `set_timesteps`, as the model family's diffusers pipeline
                passes them (`mu` is the resolution-dependent shift of dynamic shifting).
            model_timesteps: maps the scheduler's `timesteps` to the transformer's time input, as
                the model family computes it (`timesteps_as_they_are` where it takes them unchanged).
        """
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise InvalidRequestError("num_inference_steps", f"must be an integer >= 1, got {num_steps!r}")
        own_scheduler = type(scheduler).from_config(scheduler.config)
        if sigmas is None:
            own_scheduler.set_timesteps(num_steps, device="cpu", mu=mu)
        else:
            own_scheduler.set_timesteps(device="cpu", sigmas=sigmas, mu=mu)
        if not torch.isfinite(own_scheduler.sigmas).all():
            # Qwen-Image's scheduler at 1 step: shift_terminal stretches the schedule by 0 / 0.
            raise InvalidRequestError(
                "num_inference_steps",
                f"{type(scheduler).__name__} with this model's config makes no finite schedule of {num_steps} "
                f"steps (sigmas {short_repr(own_scheduler.sigmas.tolist())}); ask for more steps",
            )
        timesteps = own_scheduler.timesteps.detach().clone()
        return cls(
            sigmas=own_scheduler.sigmas.detach().clone(),
            timesteps=timesteps,
            model_timesteps=model_timesteps(timesteps).float().clone(),  # its own tensor, even where it equals timesteps
        )

    def expert_at(self, step: int) -> int:
        """The denoiser that runs step `step` (`model_experts`; 0, the only one, where there are none)."""
        return 0 if self.model_experts is None else int(self.model_experts[step])

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
            and torch.equal(self.model_timesteps, other.model_timesteps)
            and (self.model_experts is None) == (other.model_experts is None)
            and (self.model_experts is None or torch.equal(self.model_experts, other.model_experts))
        )
