"""Qwen-Image (`QwenImagePipeline`).

Text: Qwen2.5-VL's last hidden states after a chat template whose 34-token system prefix is
dropped. The pipeline pads a batch to its longest prompt and drops the mask when nothing is
padded, which makes a prompt's conditioning depend on its batch; here every prompt is encoded
alone and padded, with an explicit mask, to the multiple of `text_length_bucket` tokens above its
own length (at most `max_sequence_length`), so the sampler runs prompts of one bucket together.
Latents are packed like FLUX.1's, the schedule shifts with the image's token count and stretches
to `shift_terminal`, and true CFG (`true_cfg_scale` > 1) rescales the guided velocity to the norm
of the conditional one.
"""

from __future__ import annotations

import dataclasses

import torch

from rollout.conditioning import Conditioning
from rollout.models.base import ImageSizeLimits
from rollout.models.diffusers_family import PackedLatentFamily
from rollout.options import SamplingOptions


class QwenImageFamily(PackedLatentFamily):
    name = "qwenimage"
    diffusers_pipeline = "QwenImagePipeline"
    default_guidance_scale = 1.0  # read only by guidance-distilled weights; Qwen-Image's are not
    default_max_sequence_length = 512  # the pipeline's limit; a shorter one is faster

    def text_length_bucket(self, options: SamplingOptions) -> int:
        """Text lengths are padded up to a multiple of this: a prompt's padding depends on its own
        token count (and the request's image size) only, and a short prompt does not pay for
        `max_sequence_length` tokens.

        32 tokens from 256 image tokens up (256x256 pixels), where they cost at most an eighth of
        the sequence (1024 px: under 1%). Smaller images take the power of two nearest below an
        eighth of their tokens, at least 8, so that the padding stays near that share: buckets of
        32 made tiny 128 px copies 8-20% slower than the pipeline at 16 samples of one prompt.
        Finer buckets cost calls when prompts of different lengths come in groups smaller than a
        call (docs/throughput.md)."""
        eighth = self.image_sequence_length(options.height, options.width) // 8
        bucket = 8
        while bucket < 32 and 2 * bucket <= eighth:
            bucket *= 2
        return bucket

    def padded_text_length(self, length: int, options: SamplingOptions) -> int:
        """The length a prompt of `length` tokens (at most `max_sequence_length`) is padded to."""
        bucket = self.text_length_bucket(options)
        return min(self.max_sequence_length, -(-length // bucket) * bucket)

    def text_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        """A prompt is padded to its own length bucket, at most `max_sequence_length` tokens: the
        bytes per token of a one-word prompt's hidden states and mask, times `max_sequence_length`,
        bound every prompt's."""
        return tuple(t.nbytes // t.shape[1] * self.max_sequence_length for t in self.one_word_text(options).values())

    @property
    def image_size_limits(self) -> ImageSizeLimits:
        limits = super().image_size_limits
        # The transformer's rotary positions are a fixed table. Token rows and columns are numbered
        # around 0, and the text's positions start after the image's largest (half its rows or
        # columns): rows // 2 + the padded text length must fit, or the text's embedding is cut short.
        positions = len(self.transformer.pos_embed.pos_freqs)
        most_token_rows = 2 * (positions - self.max_sequence_length) + 1
        return dataclasses.replace(
            limits,
            max_size=most_token_rows * limits.multiple,
            bound_by=(
                f"its transformer's {positions} rotary positions less max_sequence_length "
                f"{self.max_sequence_length} leave {most_token_rows} token rows of {limits.multiple} pixels"
            ),
        )

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipe.encode_prompt(
            prompt=[prompt], device=self.device, max_sequence_length=self.max_sequence_length
        )
        return self.padded_text(embeds, mask, options)

    def padded_text(
        self, embeds: torch.Tensor, mask: torch.Tensor | None, options: SamplingOptions
    ) -> dict[str, torch.Tensor]:
        """One prompt's hidden states `(1, L, D)` and mask (None: all valid), as `encode_prompt`
        returns them: padded with zeros, and the mask with zeros, to `padded_text_length(L)`."""
        length = embeds.shape[1]
        padding = self.padded_text_length(length, options) - length
        valid = torch.ones((1, length), dtype=torch.long, device=embeds.device) if mask is None else mask
        return {
            "encoder_hidden_states": torch.cat([embeds, embeds.new_zeros(1, padding, embeds.shape[2])], dim=1),
            "encoder_hidden_states_mask": torch.cat([valid, valid.new_zeros(1, padding)], dim=1),
        }

    def image_kwargs(self, batch_size: int, options: SamplingOptions) -> dict[str, torch.Tensor]:
        _, latent_height, latent_width = self.latent_shape(options.height, options.width)
        shape = torch.tensor([[1, latent_height // 2, latent_width // 2]], dtype=torch.long)
        return {"img_shapes": shape.expand(batch_size, 3).clone()}  # (frames, rows, columns) of tokens

    def transformer_inputs(self, conditioning: Conditioning):
        img_shapes = [[tuple(row.tolist())] for row in conditioning.image_kwargs["img_shapes"]]
        guidance = conditioning.guidance

        def inputs(branch: dict[str, torch.Tensor]) -> dict:
            return {
                "encoder_hidden_states": branch["encoder_hidden_states"],
                "encoder_hidden_states_mask": branch["encoder_hidden_states_mask"],
                "img_shapes": img_shapes,
                "guidance": guidance,
            }

        return inputs

    def combine_guidance(self, positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
        combined = super().combine_guidance(positive, negative, scale)
        # Per token, over the packed channels, as the pipeline rescales.
        return combined * (torch.norm(positive, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        config = self.vae.config
        # The pipeline's arithmetic, literally (a division by the reciprocal std), for equal bits.
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, latents.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(
            latents.device, latents.dtype
        )
        video_latents = latents.unsqueeze(2) / inverse_std + mean  # (B, C, frames=1, h, w): a video VAE
        if self.vae.use_tiling:
            return self.vae.decode(video_latents, return_dict=False)[0][:, :, 0]
        return self.decode_frame(video_latents)

    def decode_frame(self, video_latents: torch.Tensor) -> torch.Tensor:
        """`vae.decode(video_latents)`'s single frame, in [-1, 1], with the same operations and
        bits, but without the VAE's causal cache.

        The VAE decodes a video a frame at a time and, for the frames to come, keeps a copy of every
        causal convolution's input until the decode ends: for an image, which has no frame to come,
        that copy is all of the decoder's activations held at once (at 256 px, 45 MB an image on
        the tiny copy). Without the cache, each causal convolution pads the frame with zeros, as it
        does with an empty cache on a video's first frame, and its input is freed when used."""
        frames = self.vae.decoder(self.vae.post_quant_conv(video_latents))
        return frames.clamp(min=-1.0, max=1.0)[:, :, 0]
