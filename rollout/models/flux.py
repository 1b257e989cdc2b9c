"""FLUX.1 (`FluxPipeline`): dev with its embedded (distilled) guidance, schnell without.

Text: T5 padded to `max_sequence_length` (512) and attended to unmasked, CLIP's pooled output,
zero text ids. Latents are packed into 2x2 tokens with (0, row, column) image ids, the schedule
shifts with the image's token count, and the transformer's time input is the timestep rounded
to the model dtype over 1000. True CFG (`true_cfg_scale` > 1, SGLang's and diffusers' field) is
a second transformer call on the negative prompt.
"""

from __future__ import annotations

import torch

from rollout.conditioning import Conditioning
from rollout.models.diffusers_family import PackedLatentFamily
from rollout.options import SamplingOptions


class FluxFamily(PackedLatentFamily):
    name = "flux"
    diffusers_pipeline = "FluxPipeline"
    default_guidance_scale = 3.5  # the pipeline's; read only by guidance-distilled (dev) weights
    default_max_sequence_length = 512

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        prompt_embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompt, prompt_2=None, device=self.device, max_sequence_length=self.max_sequence_length
        )
        # Text ids are the same for every sample; they are kept per sample so that a sample's
        # `denoising_env` holds every input of its transformer calls.
        return {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled, "txt_ids": text_ids[None]}

    def image_kwargs(self, batch_size: int, options: SamplingOptions) -> dict[str, torch.Tensor]:
        _, latent_height, latent_width = self.latent_shape(options.height, options.width)
        ids = self.pipe._prepare_latent_image_ids(batch_size, latent_height // 2, latent_width // 2, "cpu", self.dtype)
        return {"img_ids": ids.expand(batch_size, *ids.shape).clone()}

    def transformer_inputs(self, conditioning: Conditioning):
        # The transformer takes 2-D ids shared by the rows; every row holds the same ones.
        image_ids = conditioning.image_kwargs["img_ids"][0]
        guidance = conditioning.guidance

        def inputs(branch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                "encoder_hidden_states": branch["encoder_hidden_states"],
                "pooled_projections": branch["pooled_projections"],
                "txt_ids": branch["txt_ids"][0],
                "img_ids": image_ids,
                "guidance": guidance,
            }

        return inputs
