"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`), Flow-GRPO's default family.

Text: CLIP-L and CLIP-G penultimate states beside T5's, T5 padded to `max_sequence_length`
(256) and attended to unmasked; pooled CLIP embeddings. Latents are not packed (the
transformer patchifies), the schedule is a static shift, the transformer takes `timesteps`
(0..1000) in fp32, and classifier-free guidance runs both branches in one call, negative first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rollout.conditioning import Conditioning
from rollout.models.base import (
    ImageSizeLimits,
    NegativeBranchRule,
    batched_cfg_velocity,
    cfg_scale,
    check_single_denoiser,
)
from rollout.models.diffusers_family import DiffusersFamily
from rollout.options import SamplingOptions


class StableDiffusion3Family(DiffusersFamily):
    name = "sd3"
    diffusers_pipeline = "StableDiffusion3Pipeline"
    default_guidance_scale = 7.0  # the pipeline's; Flow-GRPO trains SD3.5-Medium at 4.5
    batches_guidance_branches = True
    # The pipeline's `do_classifier_free_guidance`. CFG is SD3's only guidance, so SGLang's
    # `true_cfg_scale`, when given, is its weight (as with the embedded model).
    negative_branch = NegativeBranchRule("cfg_scale")
    default_max_sequence_length = 256
    default_micro_batch_size = 8  # rows: 4 samples with guidance, which the pipeline's defaults turn on

    @property
    def patch_size(self) -> int:
        return self.transformer.config.patch_size

    @property
    def image_size_limits(self) -> ImageSizeLimits:
        limits = super().image_size_limits
        grid = self.transformer.config.pos_embed_max_size
        if grid is None:  # the patch embedding then computes its positions for the size it gets
            return limits
        # Its positions are a `grid` x `grid` table of patches, cropped to the image's patches.
        return dataclasses.replace(
            limits,
            max_size=grid * self.patch_size * self.vae_scale_factor,
            bound_by=(
                f"its transformer's pos_embed_max_size {grid} x patch {self.patch_size} "
                f"x VAE factor {self.vae_scale_factor}"
            ),
        )

    def set_timesteps_kwargs(self, num_steps: int, height: int, width: int) -> dict[str, Any]:
        if not self.scheduler.config.get("use_dynamic_shifting"):
            return {}
        return {"mu": self.dynamic_shift_kwargs(num_steps, height, width, max_shift=1.16)["mu"]}

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled}

    def predict_velocity(
        self,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning,
        options: SamplingOptions,
        expert: int = 0,
    ) -> torch.Tensor:
        check_single_denoiser(expert)
        if not self.uses_negative_branch(options):
            return self.run_transformer(x_t, timestep, **conditioning.pos_cond_kwargs)
        return batched_cfg_velocity(
            lambda x, t, kwargs: self.run_transformer(x, t, **kwargs), x_t, timestep, conditioning, cfg_scale(options)
        )
