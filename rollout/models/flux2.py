"""FLUX.2 (`Flux2Pipeline`): text-to-image, and generation from reference images.

Text: Mistral3's hidden states of layers 10, 20 and 30, stacked per token (3 x its width), the
prompt in the pipeline's chat format with its system message, padded to `max_sequence_length`
(512) and attended to unmasked; text ids `(0, 0, 0, l)`. Latents: the VAE's latents patchified
2x2 into channels (4 x the VAE's) and normalised with the VAE's BatchNorm running statistics;
the noise is drawn in that layout, `(4C, H/16, W/16)` a sample, which is `latent_shape` here, so a
sample's generator draws what `prepare_latents` draws for a batch of one. A token is one latent
pixel of that layout, with ids `(0, row, column, 0)`. The schedule: sigmas `linspace(1, 1/T, T)`
shifted with `mu = compute_empirical_mu(noise tokens, T)` (it depends on the step count too). The
time input is the timestep in the model dtype over 1000; guidance is embedded (`guidance_scale`,
default 4.0). The pipeline has no classifier-free guidance and takes no negative prompt: neither
does this family (a negative prompt is not read; a served `true_cfg_scale` other than 1 is refused,
`rollout.plan.checked_against_model`).

Reference images (`image_path`, up to `MOST_REFERENCES` a prompt, every one a reference of each of
the prompt's samples): refused as the pipeline's `check_image_input` refuses them (a side under
64 px, an aspect beyond 8:1), but as a 400 naming ``image_path[i]`` (`ConditionImageRule`); an
image over 1024x1024 px is downscaled (Lanczos) to that area, its sides floored to 16 and the
rest centre-cropped; the VAE's mode (no noise drawn), patchified and normalised as the noise, is
packed into tokens after the noise tokens with ids `(10 + 10k, row, column, 0)` for image k. The
transformer's outputs for them are dropped and the schedule shifts with the noise tokens alone.

Where this differs on purpose: the output size is the request's (default 1024x1024, the
pipeline's default without images); with images and no size the pipeline makes the first image's
processed size: a client asks for that size explicitly. The optional caption upsampling
(`caption_upsample_temperature`: Mistral3 rewriting the prompt by sampling) is not served. The
pipeline bounds neither the number of reference images nor their tokens; `MOST_REFERENCES` here
bounds each prompt's (each adds up to 4096 tokens to every one of its samples' rows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

from rollout.conditioning import Conditioning
from rollout.models.base import ConditionImageRule, NegativeBranchRule
from rollout.models.diffusers_family import PackedLatentFamily
from rollout.options import SamplingOptions

if TYPE_CHECKING:
    from rollout.input_images import InputImage

# The area the pipeline downscales a larger reference image to, and the most tokens one makes.
REFERENCE_AREA = 1024 * 1024
MOST_REFERENCES = 4


class Flux2Family(PackedLatentFamily):
    name = "flux2"
    diffusers_pipeline = "Flux2Pipeline"
    default_guidance_scale = 4.0  # the pipeline's; read only by guidance-distilled (dev) weights
    default_max_sequence_length = 512
    negative_branch = NegativeBranchRule(None)  # the pipeline has no classifier-free guidance
    condition_images = ConditionImageRule(
        most_per_prompt=MOST_REFERENCES,
        preprocessing="downscaled (Lanczos) to 1024x1024 px of area if larger, sides floored to multiples of 16 "
        "and centre-cropped (the pipeline's); at least 64 px a side and at most 8:1 as sent",
        most_tokens_per_image=REFERENCE_AREA // 16**2,
        min_side=64,
        max_aspect_ratio=8,
    )

    @classmethod
    def spatial_scale_factor(cls, pipe: Any) -> int:
        # A latent pixel of the patchified layout covers the VAE's factor times the 2x2 patch.
        return pipe.vae_scale_factor * 2

    @property
    def patch_size(self) -> int:
        return 1  # the 2x2 patch is in the latents' channels already

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels  # 4 x the VAE's

    def set_timesteps_kwargs(self, num_steps: int, height: int, width: int) -> dict[str, Any]:
        config = self.scheduler.config
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        mu = compute_empirical_mu(image_seq_len=self.image_sequence_length(height, width), num_steps=num_steps)
        return {"sigmas": sigmas, "mu": mu}

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        return self.pipe._pack_latents(latents)

    def unpack(self, tokens: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
        # The pipeline scatters tokens by their ids (`_unpack_latents_with_ids`): for the noise's
        # row-major ids that is this reshape.
        return tokens.permute(0, 2, 1).reshape(tokens.shape[0], tokens.shape[2], latent_height, latent_width)

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        prompt_embeds, text_ids = self.pipe.encode_prompt(
            prompt=prompt, device=self.device, max_sequence_length=self.max_sequence_length
        )
        # Text ids are the same for every sample; kept per sample so that a sample's
        # `denoising_env` holds every input of its transformer calls.
        return {"encoder_hidden_states": prompt_embeds, "txt_ids": text_ids}

    def image_kwargs(self, batch_size: int, options: SamplingOptions) -> dict[str, torch.Tensor]:
        _, latent_height, latent_width = self.latent_shape(options.height, options.width)
        grid = torch.empty((batch_size, 0, latent_height, latent_width), device="meta")
        return {"img_ids": self.pipe._prepare_latent_ids(grid).clone()}  # (B, h * w, 4) int64

    def reference_pixels(self, image: InputImage) -> torch.Tensor:
        """`image` as the pipeline prepares a reference: `(1, 3, h, w)` in [-1, 1], h and w multiples of 16."""
        processor = self.pipe.image_processor
        pil = image.to_pil()
        width, height = pil.size
        if width * height > REFERENCE_AREA:
            pil = processor._resize_to_target_area(pil, REFERENCE_AREA)
            width, height = pil.size
        multiple = self.token_pixels
        width, height = width // multiple * multiple, height // multiple * multiple
        return processor.preprocess(pil, height=height, width=width, resize_mode="crop")

    def encode_images(self, images: tuple[InputImage, ...], options: SamplingOptions) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        vae = self.vae
        # Each image's VAE mode (no noise drawn), patchified and normalised: `(1, 4C, h, w)`.
        latents = [
            self.pipe._encode_vae_image(self.reference_pixels(image).to(self.device, vae.dtype), generator=None)
            for image in images
        ]
        ids = self.pipe._prepare_image_ids(latents)  # (1, sum of h * w, 4) int64: image k at 10 + 10k
        tokens = torch.cat([self.pipe._pack_latents(latent) for latent in latents], dim=1)
        return {"condition_latents": tokens, "condition_ids": ids}

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        # A prompt's images at their most: their packed latents in the model's dtype, their int64 ids.
        tokens = self.condition_images.most_per_prompt * self.condition_images.most_tokens_per_image
        latents, ids = tokens * self.latent_channels * self.dtype.itemsize, tokens * 4 * 8
        return (*super().conditioning_bytes(options), latents, ids)

    def condition_tokens(self, conditioning: Conditioning) -> torch.Tensor | None:
        return (conditioning.image_kwargs or {}).get("condition_latents")

    def transformer_inputs(self, conditioning: Conditioning):
        # The transformer takes 2-D ids shared by the rows; rows of one bucket hold the same ones
        # (their condition ids are part of the bucket's key).
        image_ids = conditioning.image_kwargs["img_ids"][0]
        condition_ids = conditioning.image_kwargs.get("condition_ids")
        if condition_ids is not None:
            image_ids = torch.cat([image_ids, condition_ids[0].to(image_ids.device)])
        guidance = conditioning.guidance

        def inputs(branch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {
                "encoder_hidden_states": branch["encoder_hidden_states"],
                "txt_ids": branch["txt_ids"][0],
                "img_ids": image_ids,
                "guidance": guidance,
            }

        return inputs

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        # The normalisation undone, then the patch moved back out of the channels.
        bn, eps = self.vae.bn, self.vae.config.batch_norm_eps
        mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(latents.device, latents.dtype)
        latents = self.pipe._unpatchify_latents(latents * std + mean)
        return self.vae.decode(latents, return_dict=False)[0]
