"""The small interface every model family implements for the sampler.

A pipeline turns prompts into conditioning, predicts the flow-matching velocity, and decodes
latents into images. It owns one `FlowMatchEulerDiscreteScheduler`, which the sampler only asks
for its schedule (`set_timesteps`); the transitions themselves live in `rollout.transitions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch
from diffusers import FlowMatchEulerDiscreteScheduler


@dataclass(frozen=True)
class Conditioning:
    """Per-sample conditioning tensors, each of shape `(batch_size, ...)`.

    Everything in here belongs to one sample per row; per-request data never goes in here.
    The keys are model-specific (e.g. ``prompt_embeds``, ``pooled_prompt_embeds`` and their
    negative twins) and are what a trainer needs to replay the model calls.
    """

    tensors: dict[str, torch.Tensor]

    def __post_init__(self):
        sizes = {name: t.shape[0] for name, t in self.tensors.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"conditioning tensors disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else 0

    def rows(self, index: torch.Tensor | slice) -> "Conditioning":
        return Conditioning({name: t[index] for name, t in self.tensors.items()})

    def row(self, i: int) -> dict[str, torch.Tensor]:
        """Sample `i`'s tensors, without the batch dimension, as independent copies."""
        return {name: t[i].clone() for name, t in self.tensors.items()}

    @classmethod
    def stack(cls, rows: Sequence[dict[str, torch.Tensor]]) -> "Conditioning":
        """Inverse of `row`: builds a batch from per-sample tensor maps."""
        names = rows[0].keys()
        return cls({name: torch.stack([r[name] for r in rows]) for name in names})


@runtime_checkable
class RolloutPipeline(Protocol):
    """What the sampler needs from a model. Shapes use B for the batch size."""

    name: str
    scheduler: FlowMatchEulerDiscreteScheduler
    default_guidance_scale: float
    default_height: int
    default_width: int
    # The sampler always calls `predict_velocity` with exactly this many rows (padding the last
    # call), so a sample's bits never depend on what it was batched with.
    micro_batch_size: int

    @property
    def device(self) -> torch.device: ...

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Shape of one sample's latents for an image of `height` x `width` pixels.

        Raises `InvalidRequestError` naming ``height``/``width`` when the model cannot produce it.
        """
        ...

    def check_prompts(self, prompts: Sequence[str], negative_prompts: Sequence[str]) -> None:
        """Raises `UnknownPromptError` naming ``prompt`` or ``negative_prompt`` for a prompt the
        model cannot condition on, without encoding anything (servers check before batching)."""
        ...

    def encode_prompts(self, prompts: Sequence[str], negative_prompts: Sequence[str]) -> Conditioning:
        """Encodes one prompt (and one negative prompt) per sample.

        Raises `UnknownPromptError` naming ``prompt`` or ``negative_prompt`` for a prompt the
        model cannot condition on.
        """
        ...

    def predict_velocity(
        self, x_t: torch.Tensor, timestep: torch.Tensor, conditioning: Conditioning, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity `v` such that `x_{t+dt} = x_t + dt * v` is the Euler (ODE) step.

        Args:
            x_t: latents of shape `(B, *latent_shape)`, fp32.
            timestep: the scheduler's timestep for every row, shape `(B,)`.
            conditioning: `B` rows.
            guidance_scale: classifier-free guidance scale; 1 means no guidance.

        Returns:
            fp32 tensor of the shape of `x_t`, guidance already applied.
        """
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images of shape `(B, C, H, W)`, fp32 in [0, 1], from latents of shape `(B, *latent_shape)`."""
        ...
