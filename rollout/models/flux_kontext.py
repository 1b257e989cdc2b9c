"""FLUX.1-Kontext (`FluxKontextPipeline`): FLUX.1-dev that edits an input image.

Everything of FLUX.1 (`rollout.models.flux`), plus the prompt's input image: resized as the
pipeline resizes it, encoded by the VAE (its mode, no noise drawn), packed into 2x2 tokens and
put after the noise tokens, with the position ids (1, row, column) where the noise tokens have
(0, row, column). The transformer's outputs for the image's tokens are dropped. The schedule
shifts with the noise tokens alone, as the pipeline's does (`image_seq_len` is the latents'
length before the image's are appended).

The pipeline also rescales the requested output size to `max_area` (1024x1024) at the requested
aspect ratio; here the request's height and width are the output size, which is the pipeline's
with `max_area=height * width`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

from rollout.conditioning import Conditioning
from rollout.models.base import ConditionImageRule
from rollout.models.flux import FluxFamily
from rollout.options import SamplingOptions

if TYPE_CHECKING:
    from rollout.input_images import InputImage


class FluxKontextFamily(FluxFamily):
    name = "flux_kontext"
    diffusers_pipeline = "FluxKontextPipeline"
    condition_images = ConditionImageRule(
        most_per_prompt=1,
        preprocessing="resized to the FLUX.1-Kontext training resolution (about 1 megapixel) nearest its aspect "
        "ratio, then to multiples of 16 pixels (the pipeline's auto-resize)",
        most_tokens_per_image=max((w // 16) * (h // 16) for w, h in PREFERRED_KONTEXT_RESOLUTIONS),
    )

    def condition_size(self, image: InputImage) -> tuple[int, int]:
        """`(height, width)` the pipeline resizes `image` to: the preferred Kontext resolution of the
        nearest aspect ratio (the first such in the pipeline's list; the ratio of the image's sides
        floored to multiples of 16, as its image processor reads them), floored to multiples of
        the token size."""
        image_height, image_width = self.pipe.image_processor.get_default_height_width(image.to_pil())
        aspect_ratio = image_width / image_height
        _, width, height = min((abs(aspect_ratio - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        multiple = self.token_pixels
        return height // multiple * multiple, width // multiple * multiple

    def encode_images(self, images: tuple[InputImage, ...], options: SamplingOptions) -> dict[str, torch.Tensor]:
        if not images:
            return {}
        (image,) = images
        processor = self.pipe.image_processor
        height, width = self.condition_size(image)
        pixels = processor.preprocess(processor.resize(image.to_pil(), height, width), height, width)
        vae = self.vae
        # The VAE's mode (`sample_mode="argmax"`): the condition draws no noise.
        latents = vae.encode(pixels.to(self.device, self.dtype)).latent_dist.mode()
        latents = (latents - vae.config.shift_factor) * vae.config.scaling_factor
        _, channels, latent_height, latent_width = latents.shape
        tokens = self.pipe._pack_latents(latents, 1, channels, latent_height, latent_width)
        ids = self.pipe._prepare_latent_image_ids(1, latent_height // 2, latent_width // 2, "cpu", self.dtype)
        ids[..., 0] = 1  # the condition's ids: the noise tokens' with the first axis set to 1
        return {"condition_latents": tokens, "condition_ids": ids[None]}

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        # A prompt's image at its most tokens: its packed latents and their ids, in the model's dtype.
        tokens, size = self.condition_images.most_tokens_per_image, self.dtype.itemsize
        return (*super().conditioning_bytes(options), tokens * 4 * self.latent_channels * size, tokens * 3 * size)

    def condition_tokens(self, conditioning: Conditioning) -> torch.Tensor | None:
        return (conditioning.image_kwargs or {}).get("condition_latents")

    def transformer_inputs(self, conditioning: Conditioning):
        inputs = super().transformer_inputs(conditioning)
        condition_ids = conditioning.image_kwargs.get("condition_ids")
        if condition_ids is None:
            return inputs
        # Rows of one bucket have conditions of one size, so one set of ids serves them all.
        image_ids = torch.cat([conditioning.image_kwargs["img_ids"][0], condition_ids[0]])

        def with_condition(branch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return {**inputs(branch), "img_ids": image_ids}

        return with_condition
