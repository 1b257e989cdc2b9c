"""Wan2.1 and Wan2.2 text-to-video (`WanPipeline`), in its three layouts:

- Wan2.1-T2V: one transformer on 16 latent channels, VAE 4x in time and 8x in space;
- Wan2.2-TI2V-5B: one transformer on 48 channels with a time input per token
  (`expand_timesteps`), VAE 4x in time and 16x in space; a prompt may come with an image, which
  becomes the video's first frame (below);
- Wan2.2-T2V-A14B: two experts, `transformer` for the steps whose timestep is at least
  `boundary_ratio * 1000` (high noise) and `transformer_2` for the rest, each with its own
  guidance scale (`guidance_scale`, `guidance_scale_2`). The expert of each step is part of the
  schedule (`ScheduleSnapshot.model_experts`), so replay calls the same one.

Schedule: Wan ships a UniPC multistep scheduler, whose step mixes several past velocities and so
has no one-step Gaussian transition to attach an SDE log-prob to. As SGLang does for rollouts,
this family samples with a private `FlowMatchEulerDiscreteScheduler` whose `shift` is the
checkpoint's `flow_shift`; its ODE path is diffusers' own pipeline with
`pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=flow_shift)` swapped in
(`docs/real_models.md` compares it with the UniPC default).

Text: UMT5's last hidden state, cut to the prompt's tokens and zero-padded to
`max_sequence_length`, as the pipeline does; a prompt is encoded alone, so its conditioning never
depends on its batch. CFG runs the conditional and the unconditional branch as two calls, as the
pipeline does, and only when `guidance_scale` > 1. Latents are `(C, F', H', W')` with
`F' = (num_frames - 1) / 4 + 1`; each video is decoded alone, so the VAE's memory does not grow
with the request.

Wan2.2-TI2V-5B given an image (what diffusers' `WanImageToVideoPipeline` does with
`expand_timesteps`, on the same directory): the image is stretched to the output size
(`video_processor.preprocess`), encoded alone as a one-frame video (the VAE's mode, normalised by
`latents_mean` and `latents_std`) and held as latent frame 0 at every step
(`rollout.transitions.HeldFrames`): frame 0 of every model input, of every kept latent and of the
output is the image's, and its tokens take time input 0 (the pipeline's `first_frame_mask * t`).
The frame is not sampled, so a step's log-prob is the mean over the other frames. Prompts with
and without an image share a call's batch, in buckets of their own.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.conditioning import BucketedConditioning, Conditioning
from rollout.errors import InvalidRequestError
from rollout.models.base import ConditionImageRule, ImageSizeLimits, NegativeBranchRule, latent_frame_count
from rollout.models.diffusers_family import DiffusersFamily
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot
from rollout.transitions import HeldFrames

if TYPE_CHECKING:
    from rollout.input_images import InputImage


# The `image_kwargs` entry of a held first frame's latents `(1, C, 1, H', W')`.
_FIRST_FRAME = "first_frame_latents"


def first_frame_condition(frames_per_latent: int, least_per_prompt: int) -> ConditionImageRule:
    """Wan2.2-TI2V-5B's image: the first latent frame, held (the module docstring). It adds no
    tokens, and a video needs a latent frame after it."""
    return ConditionImageRule(
        most_per_prompt=1,
        least_per_prompt=least_per_prompt,
        preprocessing="stretched to the output height and width (the pipeline's video_processor.preprocess), "
        "encoded alone as latent frame 0, which every step holds",
        least_frames=frames_per_latent + 1,
    )


class WanFamily(DiffusersFamily):
    name = "wan"
    diffusers_pipeline = "WanPipeline"
    default_guidance_scale = 5.0  # the pipeline's
    # The pipeline's `do_classifier_free_guidance`: the first scale decides for both experts.
    negative_branch = NegativeBranchRule("guidance_scale")
    default_max_sequence_length = 512  # the pipeline's `__call__` default
    # One video is already a long sequence (480x832, 81 frames: 32,760 tokens): a call of one
    # sample costs a lone request nothing, and memory stays that of one video.
    default_micro_batch_size = 1
    default_num_frames = 81
    calibrated_at_start = False  # see DiffusersFamily

    def __init__(self, pipe: Any, **kwargs):
        super().__init__(pipe, **kwargs)
        # The checkpoint's UniPC scheduler is kept on the pipeline (and named by `/rollout/info`'s
        # model path); sampling uses Euler on the same shifted flow (see the module docstring).
        self.scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=pipe.scheduler.config.num_train_timesteps, shift=pipe.scheduler.config.flow_shift
        )
        self.frames_per_latent = pipe.vae_scale_factor_temporal
        boundary_ratio = pipe.config.boundary_ratio
        self.boundary_timestep = None if boundary_ratio is None else boundary_ratio * self.scheduler.config.num_train_timesteps
        self.time_input_per_token = bool(pipe.config.expand_timesteps)
        if self.time_input_per_token:  # a prompt may come with its first frame
            self.condition_images = first_frame_condition(self.frames_per_latent, least_per_prompt=0)

    @classmethod
    def spatial_scale_factor(cls, pipe: Any) -> int:
        return pipe.vae_scale_factor_spatial

    @classmethod
    def default_size(cls, pipe: Any) -> tuple[int, int]:
        return 480, 832  # the pipeline's `__call__` defaults

    # Sizes and schedule ------------------------------------------------------------------------

    @property
    def patch_size(self) -> int:
        return self.transformer.config.patch_size[1]

    @property
    def image_size_limits(self) -> ImageSizeLimits:
        multiple = self.vae_scale_factor * self.patch_size
        # Rotary positions are a table of `rope_max_seq_len` per axis (frames, rows, columns).
        positions = self.transformer.config.rope_max_seq_len
        return ImageSizeLimits(
            multiple=multiple,
            max_size=positions * multiple,
            bound_by=f"its transformer's {positions} rotary positions per axis of {multiple}-pixel tokens",
        )

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        self.image_size_limits.check(height, width, self.name)
        per_latent = self.frames_per_latent
        latent_frames = latent_frame_count(num_frames, per_latent, self.name)
        positions = self.transformer.config.rope_max_seq_len
        if latent_frames > positions:
            raise InvalidRequestError(
                "num_frames",
                f"must be at most {per_latent * (positions - 1) + 1} for model {self.name!r} (its transformer's "
                f"{positions} rotary positions along time), got {num_frames}",
            )
        return (self.latent_channels, latent_frames, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> ScheduleSnapshot:
        snapshot = super().schedule(num_steps, height, width, num_frames)
        if self.boundary_timestep is None:
            return snapshot
        # The pipeline's rule, `t >= boundary` for the high-noise `transformer`, on the scheduler's own timesteps.
        low_noise = (snapshot.timesteps < self.boundary_timestep).to(torch.int64)
        return dataclasses.replace(snapshot, model_experts=low_noise)

    # Conditioning ------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        # `WanPipeline`'s own text encoding, called on any Wan pipeline: its prompt cleaning skips
        # `ftfy` where it is not installed (the image-to-video pipeline's calls it unguarded).
        from diffusers.pipelines.wan.pipeline_wan import WanPipeline  # imports transformers: on first use

        embeds = WanPipeline._get_t5_prompt_embeds(
            self.pipe, prompt=[prompt], max_sequence_length=self.max_sequence_length, device=self.device
        )
        return {"encoder_hidden_states": embeds.to(self.dtype)}

    def encode_images(self, images: tuple[InputImage, ...], options: SamplingOptions) -> dict[str, torch.Tensor]:
        if not images or not self.time_input_per_token:
            return super().encode_images(images, options)
        (image,) = images
        pixels = self.pipe.video_processor.preprocess(image.to_pil(), height=options.height, width=options.width)
        return {_FIRST_FRAME: self.encode_video(pixels.to(self.device, torch.float32).unsqueeze(2))}

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """The VAE's latents of a pixel video `(1, 3, F, H, W)` in [-1, 1], fp32, as the
        image-to-video pipeline's `prepare_latents` makes its condition: the mode (no noise drawn),
        less `latents_mean`, times the reciprocal of `latents_std` (literally, for equal bits)."""
        vae = self.vae
        latents = vae.encode(video.to(vae.dtype)).latent_dist.mode().to(torch.float32)
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, torch.float32)
        inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(latents.device, torch.float32)
        return (latents - mean) * inverse_std

    def held_frames(self, conditioning: BucketedConditioning) -> HeldFrames | None:
        if not self.time_input_per_token:
            return None
        rows = torch.zeros(len(conditioning), dtype=torch.bool)
        values = None
        for bucket in conditioning.buckets:
            image = bucket.conditioning.image_kwargs or {}
            if _FIRST_FRAME not in image:  # a prompt without an image
                continue
            first_frames = image[_FIRST_FRAME][: len(bucket.rows)].float().cpu()
            if values is None:
                values = first_frames.new_zeros((len(conditioning), *first_frames.shape[1:]))
            values[bucket.rows] = first_frames
            rows[bucket.rows] = True
        return None if values is None else HeldFrames(rows, values)

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        text = super().conditioning_bytes(options)
        if not self.time_input_per_token:
            return text
        channels, _, height, width = self.latent_shape(options.height, options.width, options.num_frames)
        return (*text, channels * height * width * 4)  # a prompt's held first frame, fp32

    def guidance_scale_of(self, expert: int, options: SamplingOptions) -> float:
        if expert == 1 and options.guidance_scale_2 is not None:
            return options.guidance_scale_2
        return options.guidance_scale

    # Model calls -------------------------------------------------------------------------------

    def predict_velocity(
        self,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning,
        options: SamplingOptions,
        expert: int = 0,
    ) -> torch.Tensor:
        if self.time_input_per_token:
            # TI2V's time input per latent token, as the pipeline expands it: all equal for
            # text-to-video, 0 on a held first frame's tokens. A call's rows all hold or none does
            # (they share a conditioning bucket).
            _, frames, height, width = x_t.shape[1:]
            per_frame = (height // self.patch_size) * (width // self.patch_size)
            timestep = timestep.unsqueeze(1).expand(-1, frames * per_frame)
            if _FIRST_FRAME in (conditioning.image_kwargs or {}):
                timestep = torch.cat([torch.zeros_like(timestep[:, :per_frame]), timestep[:, per_frame:]], dim=1)
        hidden_states, image_inputs = self.denoiser_inputs(x_t, conditioning)
        velocity = self.run_transformer(hidden_states, timestep, expert, **conditioning.pos_cond_kwargs, **image_inputs)
        if not self.uses_negative_branch(options):
            return velocity
        if conditioning.neg_cond_kwargs is None:
            raise ValueError("classifier-free guidance needs the negative branch's conditioning (neg_cond_kwargs)")
        # The negative branch sees the same image condition, as the pipeline gives it.
        unconditional = self.run_transformer(
            hidden_states, timestep, expert, **conditioning.neg_cond_kwargs, **image_inputs
        )
        return unconditional + self.guidance_scale_of(expert, options) * (velocity - unconditional)

    def denoiser_inputs(
        self, x_t: torch.Tensor, conditioning: Conditioning
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The denoiser's `hidden_states` for latents `x_t`, and its image inputs for both guidance
        branches: the latents (a held first frame already in them) and none
        (`rollout.models.wan_i2v` concatenates its image along channels)."""
        return x_t, {}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Videos `(B, C, F, H, W)` in [0, 1], each decoded alone (the VAE's causal cache is per call)."""
        config = self.vae.config
        # The pipeline's arithmetic, literally (a division by the reciprocal std), for equal bits.
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents.device, self.vae.dtype)
        inverse_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(
            latents.device, self.vae.dtype
        )
        return self.decode_videos(
            latents, lambda latent: self.vae.decode(latent.to(self.vae.dtype) / inverse_std + mean, return_dict=False)[0]
        )
