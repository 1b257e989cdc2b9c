"""LTX-Video (`LTXPipeline`): natively flow-matching text-to-video.

Unlike Wan, its own scheduler is `FlowMatchEulerDiscreteScheduler`, set as the pipeline sets it:
sigmas `linspace(1, 1/T, T)` and a dynamic shift `mu` that grows with the video's latent token
count (frames x rows x columns, so the schedule depends on `num_frames` too), stretched to its
`shift_terminal`. The schedule is therefore the pipeline's own, sampled or replayed.

Text: T5's last hidden state over `max_sequence_length` (128) tokens, the encoder unmasked and the
transformer's cross-attention masked, each prompt encoded alone. Latents are `(128, F', H/32,
W/32)` with `F' = (num_frames - 1) / 8 + 1`, packed into tokens only for the transformer, whose
time input is the scheduler's `timesteps`. The frame rate scales the rotary positions along time
(`rope_interpolation_scale`), so it is a model input: `denoising_env.image_kwargs.frame_rate`.
CFG runs both branches in one call on rows `[negative; positive]`, as the pipeline does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rollout.conditioning import Conditioning
from rollout.kernels import branches_in_one_call
from rollout.models.base import ImageSizeLimits, NegativeBranchRule, check_single_denoiser, latent_frame_count
from rollout.models.diffusers_family import DiffusersFamily
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot


class LTXVideoFamily(DiffusersFamily):
    name = "ltx"
    diffusers_pipeline = "LTXPipeline"
    default_guidance_scale = 3.0  # the pipeline's
    batches_guidance_branches = True
    negative_branch = NegativeBranchRule("guidance_scale")  # the pipeline's `do_classifier_free_guidance`
    default_max_sequence_length = 128
    default_micro_batch_size = 1  # a video a call, as for Wan
    default_num_frames = 161
    calibrated_at_start = False  # see DiffusersFamily
    default_frame_rate = 25  # the pipeline's `frame_rate`

    def __init__(self, pipe: Any, **kwargs):
        super().__init__(pipe, **kwargs)
        self.frames_per_latent = pipe.vae_temporal_compression_ratio

    @classmethod
    def spatial_scale_factor(cls, pipe: Any) -> int:
        return pipe.vae_spatial_compression_ratio

    @classmethod
    def default_size(cls, pipe: Any) -> tuple[int, int]:
        return 512, 704  # the pipeline's `__call__` defaults

    # Sizes and schedule ------------------------------------------------------------------------

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels

    @property
    def patch_size(self) -> int:
        return self.transformer.config.patch_size

    @property
    def image_size_limits(self) -> ImageSizeLimits:
        # Rotary positions are computed from the token grid of any size: only memory bounds it.
        return ImageSizeLimits(multiple=self.vae_scale_factor * self.patch_size)

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        self.image_size_limits.check(height, width, self.name)
        latent_frames = latent_frame_count(num_frames, self.frames_per_latent, self.name)
        return (self.latent_channels, latent_frames, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> ScheduleSnapshot:
        from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

        _, frames, rows, columns = self.latent_shape(height, width, num_frames)
        config = self.scheduler.config
        mu = calculate_shift(
            frames * rows * columns,  # the pipeline's `video_sequence_length`
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return ScheduleSnapshot.from_scheduler(
            self.scheduler,
            num_steps,
            sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
            mu=mu,
            model_timesteps=self.model_timesteps,
        )

    # Conditioning ------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        embeds, mask = self.pipe._get_t5_prompt_embeds(
            prompt=[prompt], max_sequence_length=self.max_sequence_length, device=self.device
        )
        return {"encoder_hidden_states": embeds.to(self.dtype), "encoder_attention_mask": mask}

    def image_kwargs(self, batch_size: int, options: SamplingOptions) -> dict[str, torch.Tensor]:
        frame_rate = self.default_frame_rate if options.fps is None else options.fps
        return {"frame_rate": torch.full((batch_size,), frame_rate, dtype=torch.int64)}

    # Model calls -------------------------------------------------------------------------------

    def predict_velocity(
        self,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning,
        options: SamplingOptions,
        expert: int = 0,
    ) -> torch.Tensor:
        check_single_denoiser(expert)
        _, _, frames, rows, columns = x_t.shape
        frame_rates = conditioning.image_kwargs["frame_rate"].unique().tolist()
        if len(frame_rates) != 1:
            raise ValueError(f"one model call takes one frame rate, got {frame_rates}")
        # The pipeline's tuple of Python floats, for the same rotary positions.
        rope_scale = (self.frames_per_latent / frame_rates[0], self.vae_scale_factor, self.vae_scale_factor)
        patch, patch_t = self.patch_size, self.transformer.config.patch_size_t
        tokens = self.pipe._pack_latents(x_t, patch, patch_t)
        positive = conditioning.pos_cond_kwargs
        grid = {"num_frames": frames, "height": rows, "width": columns, "rope_interpolation_scale": rope_scale}
        if not self.uses_negative_branch(options):
            velocity = self.run_transformer(tokens, timestep, **positive, **grid)
        else:
            if conditioning.neg_cond_kwargs is None:
                raise ValueError("classifier-free guidance needs the negative branch's conditioning (neg_cond_kwargs)")
            negative = conditioning.neg_cond_kwargs
            both = {name: torch.cat([negative[name], positive[name]]) for name in positive}
            with branches_in_one_call(2):
                unconditional, conditional = self.run_transformer(
                    torch.cat([tokens, tokens]), torch.cat([timestep, timestep]), **both, **grid
                ).chunk(2)
            velocity = unconditional + options.guidance_scale * (conditional - unconditional)
        return self.pipe._unpack_latents(velocity, frames, rows, columns, patch, patch_t)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Videos `(B, C, F, H, W)` in [0, 1], each decoded alone."""
        vae = self.vae
        # A VAE conditioned on a decode timestep gets the pipeline's default: 0, with no noise mixed in.
        timestep = torch.zeros(1, device=latents.device, dtype=self.dtype) if vae.config.timestep_conditioning else None

        def decode_one(latent: torch.Tensor) -> torch.Tensor:
            latent = self.pipe._denormalize_latents(latent, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
            return vae.decode(latent.to(self.dtype).to(vae.dtype), timestep, return_dict=False)[0]

        return self.decode_videos(latents, decode_one)
