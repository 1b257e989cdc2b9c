"""Wan image-to-video (`WanImageToVideoPipeline`): Wan2.1-I2V (one transformer, CLIP image
embeddings) and Wan2.2-I2V-A14B (two experts, no CLIP).

Everything of Wan text-to-video (`rollout.models.wan`: the private Euler schedule at the
checkpoint's `flow_shift`, UMT5 text, the experts by `boundary_ratio`, the guidance of each
expert), plus the prompt's input image, encoded once per prompt for the request's size and frame
count, as the pipeline's `prepare_latents` does:

- the image is stretched to the output `height` x `width` (`video_processor.preprocess`), put
  first in a pixel video of `num_frames` frames whose others are zeros, encoded by the VAE whole
  (its mode: no noise drawn) and normalised with the VAE's `latents_mean` and `latents_std`:
  `condition_latents`, `(1, C, F', H', W')`;
- the mask `condition_mask`, `(1, 4, F', H', W')`: ones on latent frame 0 (its 4 channels stand for
  the first latent frame's pixel frame repeated to the VAE's temporal factor), zeros elsewhere;
- the transformer's input is `cat([latents, mask, condition], dim=1)` (16 + 4 + 16 = 36
  channels; it returns 16), for both guidance branches and both experts;
- Wan2.1 (a transformer with `image_dim`) also takes the CLIP vision tower's penultimate hidden
  states of the image as given (`CLIPImageProcessor`, the pipeline's `encode_image`):
  `encoder_hidden_states_image`, which the transformer puts before the text in its
  cross-attention. Both branches get them, as in the pipeline.

The condition adds no transformer tokens (it is concatenated along channels), so
`most_tokens_per_image` is 0; the CLIP tokens are cross-attention context, like the text.
`last_image` (first-last-frame to video, FLF2V) is not served: a prompt takes exactly one image.

A directory of this pipeline with `expand_timesteps` (Wan2.2-TI2V-5B's weights saved as an
image-to-video pipeline) conditions as the TI2V model does in `rollout.models.wan`: the image is
latent frame 0, held at every step, not channels; here every prompt needs its image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rollout.conditioning import Conditioning
from rollout.errors import ModelLoadError
from rollout.models.base import ConditionImageRule
from rollout.models.wan import WanFamily, first_frame_condition
from rollout.options import SamplingOptions

if TYPE_CHECKING:
    from rollout.input_images import InputImage

# Wan's attention cuts the image tokens off the text as "all but the last 512" where its
# transformer has its own image projections (`added_kv_proj_dim`, Wan2.1-I2V): a text of another
# length would be cut wrongly.
_WAN_TEXT_TOKENS = 512


class WanImageToVideoFamily(WanFamily):
    name = "wan_i2v"
    diffusers_pipeline = "WanImageToVideoPipeline"
    condition_images = ConditionImageRule(
        most_per_prompt=1,
        least_per_prompt=1,  # image-to-video needs its first frame
        preprocessing="stretched to the output height and width (the pipeline's video_processor.preprocess) and "
        "encoded as the first frame of the video; Wan2.1 also passes the image as given to CLIP's image processor",
        # Concatenated to the latents along channels: no tokens of its own. Wan2.1's CLIP tokens
        # are cross-attention context beside the text, not transformer tokens.
        most_tokens_per_image=0,
    )

    def __init__(self, pipe: Any, **kwargs):
        super().__init__(pipe, **kwargs)
        if self.time_input_per_token:  # the image-to-video pipeline needs its image
            self.condition_images = first_frame_condition(self.frames_per_latent, least_per_prompt=1)
        if self.transformer.config.added_kv_proj_dim is not None and self.max_sequence_length != _WAN_TEXT_TOKENS:
            raise ModelLoadError(
                "model.max_sequence_length",
                f"must be {_WAN_TEXT_TOKENS} for this Wan image-to-video model (its attention takes the last "
                f"{_WAN_TEXT_TOKENS} context tokens as the text), got {self.max_sequence_length}",
            )
        self.clip_image_embeddings = self.transformer.config.image_dim is not None

    @property
    def latent_channels(self) -> int:
        # The VAE's: the transformer's input has the mask's and the condition's channels too.
        return self.vae.config.z_dim

    # Conditioning ------------------------------------------------------------------------------

    def encode_images(self, images: tuple[InputImage, ...], options: SamplingOptions) -> dict[str, torch.Tensor]:
        if not images or self.time_input_per_token:
            return super().encode_images(images, options)
        (image,) = images
        height, width, num_frames = options.height, options.width, options.num_frames
        _, latent_frames, latent_height, latent_width = self.latent_shape(height, width, num_frames)
        picture = image.to_pil()
        first = self.pipe.video_processor.preprocess(picture, height=height, width=width).to(self.device, torch.float32)
        video = torch.cat([first.unsqueeze(2), first.new_zeros(1, first.shape[1], num_frames - 1, height, width)], dim=2)
        latents = self.encode_video(video)
        mask = torch.zeros((1, self.frames_per_latent, latent_frames, latent_height, latent_width), device=latents.device)
        mask[:, :, 0] = 1  # the given first frame
        encoded = {"condition_mask": mask, "condition_latents": latents}
        if self.clip_image_embeddings:
            encoded["encoder_hidden_states_image"] = self.pipe.encode_image(picture, self.device).to(self.dtype)
        return encoded

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        if self.time_input_per_token:
            return super().conditioning_bytes(options)
        channels, *latent = self.latent_shape(options.height, options.width, options.num_frames)
        positions = latent[0] * latent[1] * latent[2]
        condition = (self.frames_per_latent * positions * 4, channels * positions * 4)  # fp32 mask and latents
        clip = ()
        if self.clip_image_embeddings:
            vision = self.pipe.image_encoder.config
            tokens = (vision.image_size // vision.patch_size) ** 2 + 1  # the patches and the class token
            clip = (tokens * vision.hidden_size * self.dtype.itemsize,)
        return (*super().conditioning_bytes(options), *condition, *clip)

    # Model calls -------------------------------------------------------------------------------

    def denoiser_inputs(
        self, x_t: torch.Tensor, conditioning: Conditioning
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.time_input_per_token:
            return super().denoiser_inputs(x_t, conditioning)
        image = conditioning.image_kwargs or {}
        if "condition_latents" not in image:
            raise ValueError(f"model {self.name!r} needs each sample's image condition (image_kwargs)")
        mask, latents = image["condition_mask"].to(x_t.dtype), image["condition_latents"].to(x_t.dtype)
        hidden_states = torch.cat([x_t, mask, latents], dim=1)
        embeddings = image.get("encoder_hidden_states_image")
        return hidden_states, ({} if embeddings is None else {"encoder_hidden_states_image": embeddings})
