"""Stable Diffusion 3 / 3.5 (`StableDiffusion3Pipeline`), Flow-GRPO's default family.

Text: CLIP-L and CLIP-G penultimate states beside T5's, T5 padded to `max_sequence_length`
(256) and attended to unmasked; pooled CLIP embeddings. Latents are not packed (the
transformer patchifies), the schedule is a static shift, the transformer takes `timesteps`
(0..1000) in fp32, and classifier-free guidance runs both branches in one call, negative first.
"""

from __future__ import annotations

from typing import Any

import torch

from rollout.models.base import Conditioning
from rollout.models.diffusers_family import DiffusersFamily
from rollout.options import SamplingOptions


class StableDiffusion3Family(DiffusersFamily):
    name = "sd3"
    diffusers_pipeline = "StableDiffusion3Pipeline"
    default_guidance_scale = 7.0  # the pipeline's; Flow-GRPO trains SD3.5-Medium at 4.5
    default_max_sequence_length = 256

    def set_timesteps_kwargs(self, num_steps: int, height: int, width: int) -> dict[str, Any]:
        if not self.scheduler.config.get("use_dynamic_shifting"):
            return {}
        return {"mu": self.dynamic_shift_kwargs(num_steps, height, width, max_shift=1.16)["mu"]}

    def encode_prompt(self, prompt: str) -> dict[str, torch.Tensor]:
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=prompt,
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            do_classifier_free_guidance=False,
            max_sequence_length=self.max_sequence_length,
        )
        return {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled}

    @staticmethod
    def cfg_scale(options: SamplingOptions) -> float:
        """Classifier-free guidance is SD3's only guidance, so SGLang's `true_cfg_scale`, when
        given, is its weight (as with the embedded model); otherwise `guidance_scale`."""
        return options.guidance_scale if options.true_cfg_scale is None else options.true_cfg_scale

    def uses_negative_branch(self, options: SamplingOptions) -> bool:
        return self.cfg_scale(options) > 1  # the pipeline's `do_classifier_free_guidance`

    def predict_velocity(
        self, x_t: torch.Tensor, timestep: torch.Tensor, conditioning: Conditioning, options: SamplingOptions
    ) -> torch.Tensor:
        positive = conditioning.pos_cond_kwargs
        if not self.uses_negative_branch(options):
            return self.run_transformer(x_t, timestep, **positive)
        if conditioning.neg_cond_kwargs is None:
            raise ValueError("classifier-free guidance needs the negative branch's conditioning (neg_cond_kwargs)")
        negative = conditioning.neg_cond_kwargs
        both = {name: torch.cat([negative[name], positive[name]]) for name in positive}
        v_uncond, v_cond = self.run_transformer(torch.cat([x_t, x_t]), torch.cat([timestep, timestep]), **both).chunk(2)
        return v_uncond + self.cfg_scale(options) * (v_cond - v_uncond)
