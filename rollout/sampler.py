"""The denoising loop: samples a batch and records each sample's exact trajectory.

Two properties hold by construction and are tested:
- Determinism: sample i draws everything from its own CPU generator seeded `seeds[i]`
  (its initial noise first, then one draw per stochastic step).
- Batch invariance: a sample's trajectory is bit-identical whether it is generated alone or in
  any batch, because the model always runs on micro-batches of exactly the pipeline's
  micro-batch size for the image size (padded), so every row sees the same kernels.

Memory: the conditioning stays on the CPU and goes to the device one micro-batch at a time,
and every latent and debug tensor kept leaves the device as it is produced, so device memory
grows with the micro-batch, not with the steps kept or the samples in the request.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from rollout.errors import InvalidRequestError
from rollout.models.base import Conditioning, RolloutPipeline, zero_padded
from rollout.options import SamplingOptions, check_seed
from rollout.trajectory import RolloutBatch, SampleTrajectory, StepDebug
from rollout.transitions import take_step


def resolve_options(pipeline: RolloutPipeline, options: SamplingOptions) -> SamplingOptions:
    """Fills in the model's defaults (size, guidance) so the options describe the run exactly."""
    return dataclasses.replace(
        options,
        height=pipeline.default_height if options.height is None else options.height,
        width=pipeline.default_width if options.width is None else options.width,
        guidance_scale=pipeline.default_guidance_scale if options.guidance_scale is None else options.guidance_scale,
    )


def micro_batch_size(pipeline: RolloutPipeline, options: SamplingOptions) -> int:
    """Samples per transformer call for a request with `options` (model defaults filled in)."""
    return pipeline.micro_batching.size_for(options.height, options.width)


def transformer_rows(pipeline: RolloutPipeline, options: SamplingOptions, batch_size: int) -> int:
    """Rows the transformer computes to sample `batch_size` samples with `options` (defaults filled
    in): every step's calls, each padded to the micro-batch. Against `batch_size` times the steps,
    the rest is padding. (Classifier-free guidance doubles each call's rows inside the model.)"""
    rows = micro_batch_size(pipeline, options)
    return options.num_inference_steps * -(-batch_size // rows) * rows


def pad_conditioning(conditioning: Conditioning, micro_batch_size: int) -> Conditioning:
    """Pads to a multiple of `micro_batch_size` rows by repeating the last row."""
    missing = -len(conditioning) % micro_batch_size
    if missing == 0:
        return conditioning
    filler = torch.full((missing,), len(conditioning) - 1, dtype=torch.long)
    return conditioning.map(lambda t: torch.cat([t, t[filler.to(t.device)]]))


def predict_velocity(
    pipeline: RolloutPipeline,
    x_t: torch.Tensor,
    timestep: torch.Tensor,
    padded_conditioning: Conditioning,
    options: SamplingOptions,
) -> torch.Tensor:
    """The pipeline's velocity for `(B, ...)` latents, computed on fixed-size micro-batches.

    Args:
        timestep: `()` the transformer's time input at this step (`model_timesteps[step]`),
            the same for every row.
        padded_conditioning: the batch's conditioning after `pad_conditioning`, on any device.
        options: the request's options, with the model's defaults filled in.
    """
    rows = micro_batch_size(pipeline, options)
    batch_size = x_t.shape[0]
    padded_size = len(padded_conditioning)
    if padded_size % rows:
        raise ValueError(f"conditioning of {padded_size} rows is not padded to micro-batches of {rows}")
    device = pipeline.device
    x_padded = zero_padded(x_t, rows)
    timesteps = timestep.to(device).expand(rows)
    velocities = [
        pipeline.predict_velocity(
            x_padded[start : start + rows],
            timesteps,
            padded_conditioning.rows(slice(start, start + rows)).map(lambda t: t.to(device)),
            options,
        )
        for start in range(0, padded_size, rows)
    ]
    return torch.cat(velocities)[:batch_size]


def _draw_noise(generators: Sequence[torch.Generator], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Drawn per sample on the CPU so a sample's noise does not depend on its batch or device.
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]).to(device)


@torch.no_grad()
def sample(
    pipeline: RolloutPipeline,
    prompts: Sequence[str],
    seeds: Sequence[int],
    options: SamplingOptions,
    negative_prompts: Sequence[str] | None = None,
    weight_version: str | None = None,
) -> RolloutBatch:
    """Generates one sample per prompt and records its trajectory.

    Args:
        prompts: one prompt per sample (repeat a prompt to get several samples of it).
        seeds: one seed per sample.
        negative_prompts: one per sample; defaults to the empty prompt.
        weight_version: the name of the pipeline's current weights, recorded in every sample.

    Returns:
        A `RolloutBatch` holding the schedule once and one `SampleTrajectory` per prompt.
    """
    if len(prompts) == 0:
        raise InvalidRequestError("prompt", "needs at least one prompt")
    if len(seeds) != len(prompts):
        raise InvalidRequestError("seed", f"needs one seed per sample: {len(seeds)} seeds for {len(prompts)} prompts")
    seeds = [check_seed(seed) for seed in seeds]
    negative_prompts = [""] * len(prompts) if negative_prompts is None else list(negative_prompts)
    if len(negative_prompts) != len(prompts):
        raise InvalidRequestError(
            "negative_prompt", f"needs one per sample: {len(negative_prompts)} for {len(prompts)} prompts"
        )
    options = resolve_options(pipeline, options)
    latent_shape = pipeline.latent_shape(options.height, options.width)
    device = pipeline.device

    conditioning = pipeline.encode_prompts(prompts, negative_prompts, options).map(lambda t: t.cpu())
    padded_conditioning = pad_conditioning(conditioning, micro_batch_size(pipeline, options))
    schedule = pipeline.schedule(options.num_inference_steps, options.height, options.width)
    sigmas = schedule.sigmas.to(device)
    generators = [torch.Generator(device="cpu").manual_seed(seed) for seed in seeds]

    kept_steps = set(options.kept_latent_steps())
    x_t = _draw_noise(generators, latent_shape, device)
    kept_latents = [x_t.cpu()] if 0 in kept_steps else []
    log_probs, velocities, means, noise_stds, noises = [], [], [], [], []
    for step in range(schedule.num_steps):
        v = predict_velocity(pipeline, x_t, schedule.model_timesteps[step], padded_conditioning, options)
        kind = options.transition_at(step)
        noise = _draw_noise(generators, latent_shape, device) if kind.draws_noise else None
        transition = take_step(
            kind,
            x_t,
            v,
            sigmas[step],
            sigmas[step + 1],
            eta=options.noise_level,
            sigma_after_one=sigmas[1],
            noise=noise,
            log_prob_form=options.log_prob_form,
        )
        x_t = transition.x_next
        if step + 1 in kept_steps:
            kept_latents.append(x_t.cpu())
        log_probs.append(transition.log_prob.cpu())
        if options.debug:
            velocities.append(v.cpu())
            means.append(transition.mean.cpu())
            noise_stds.append(transition.noise_std.cpu())
            noises.append(torch.zeros(x_t.shape) if noise is None else noise.cpu())

    images = pipeline.decode(x_t).cpu()
    final_latents = x_t.cpu()
    log_probs = torch.stack(log_probs, dim=1)  # (B, T)
    # (B, K, ...); K is 0 when a request keeps no latent at all
    latents = torch.stack(kept_latents, dim=1) if kept_latents else torch.zeros((len(prompts), 0, *latent_shape))
    latent_step_indices = torch.tensor(sorted(kept_steps), dtype=torch.int64)
    if options.debug:
        velocities, means, noises = (torch.stack(t, dim=1) for t in (velocities, means, noises))
        noise_stds = torch.stack(noise_stds)  # (T,), shared by the batch's rows

    # Every per-sample tensor is cloned out of the batch: a view would drag the whole batch's
    # storage along wherever the sample is serialized.
    samples = [
        SampleTrajectory(
            schedule=schedule,
            prompt=prompts[i],
            negative_prompt=negative_prompts[i],
            seed=seeds[i],
            image=images[i].clone(),
            final_latents=final_latents[i].clone(),
            log_probs=log_probs[i].clone(),
            latents=latents[i].clone(),
            latent_step_indices=latent_step_indices.clone(),
            weight_version=weight_version,
            debug=StepDebug(velocities[i].clone(), means[i].clone(), noise_stds.clone(), noises[i].clone())
            if options.debug
            else None,
            denoising_env=conditioning.row(i) if options.return_denoising_env else None,
        )
        for i in range(len(prompts))
    ]
    return RolloutBatch(schedule=schedule, options=options, model=pipeline.name, samples=samples)
