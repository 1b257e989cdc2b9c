"""The denoising loop: samples a batch and records each sample's exact trajectory.

Two properties hold by construction and are tested:
- Determinism: sample i draws everything from its own CPU generator seeded `seeds[i]`
  (its initial noise first, then one draw per stochastic step).
- Batch invariance: a sample's trajectory is bit-identical whether it is generated alone or in
  any batch. The model runs on micro-batches, each of rows of one conditioning bucket (rows whose
  text is padded to the same length), and either every micro-batch is padded to exactly the
  pipeline's micro-batch size for the image size, so every row sees the same kernels, or the
  calls take the rows there are and run under batch-invariant kernels (`rollout.kernels`).

Memory: the conditioning stays on the CPU and goes to the device one micro-batch at a time,
and every latent and debug tensor kept leaves the device as it is produced, into one host
buffer per kept tensor allocated once per call; the samples are views of those buffers. Device
memory grows with the micro-batch, host memory with what is kept, once.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from rollout.errors import InvalidRequestError
from rollout.models.base import (
    BucketedConditioning,
    Conditioning,
    ConditioningBucket,
    RolloutPipeline,
    zero_padded,
)
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
    """Samples per model call for a request with `options` (model defaults filled in)."""
    return pipeline.micro_batching.size_for(options.height, options.width)


def pad_conditioning(conditioning: Conditioning, rows: int) -> Conditioning:
    """Pads to `rows` rows by repeating the last row."""
    missing = rows - len(conditioning)
    if missing == 0:
        return conditioning
    filler = torch.full((missing,), len(conditioning) - 1, dtype=torch.long)
    return conditioning.map(lambda t: torch.cat([t, t[filler.to(t.device)]]))


def pad_buckets(pipeline: RolloutPipeline, conditioning: BucketedConditioning, options: SamplingOptions) -> BucketedConditioning:
    """Each bucket padded to the rows its model calls compute (`MicroBatching.padded_rows`)."""
    padded_rows = functools.partial(pipeline.micro_batching.padded_rows, height=options.height, width=options.width)
    return BucketedConditioning(
        tuple(
            ConditioningBucket(b.rows, pad_conditioning(b.conditioning, padded_rows(len(b.rows))))
            for b in conditioning.buckets
        )
    )


def predict_velocity(
    pipeline: RolloutPipeline,
    x_t: torch.Tensor,
    timestep: torch.Tensor,
    padded_conditioning: BucketedConditioning,
    options: SamplingOptions,
) -> torch.Tensor:
    """The pipeline's velocity for `(B, ...)` latents, computed in the pipeline's micro-batches
    (`MicroBatching.calls`), each of rows of one conditioning bucket.

    Args:
        timestep: `()` the transformer's time input at this step (`model_timesteps[step]`),
            the same for every row.
        padded_conditioning: the batch's conditioning after `pad_buckets`, on any device.
        options: the request's options, with the model's defaults filled in.
    """
    micro_batching, device = pipeline.micro_batching, pipeline.device
    timestep = timestep.to(device)
    velocity = torch.empty_like(x_t)
    with micro_batching.kernels():
        for bucket in padded_conditioning.buckets:
            calls = micro_batching.calls(len(bucket.rows), options.height, options.width)
            padded_size = len(bucket.conditioning)
            if padded_size != calls[-1].stop:
                raise ValueError(f"conditioning of {padded_size} rows is not padded to its calls' {calls[-1].stop}")
            batch_rows = bucket.rows.to(x_t.device)
            x_padded = zero_padded(x_t[batch_rows], padded_size)
            velocities = [
                pipeline.predict_velocity(
                    x_padded[call],
                    timestep.expand(call.stop - call.start),
                    bucket.conditioning.rows(call).map(lambda t: t.to(device)),
                    options,
                )
                for call in calls
            ]
            velocity[batch_rows] = torch.cat(velocities)[: len(batch_rows)]
    return velocity


def _draw_noise(generators: Sequence[torch.Generator], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Drawn per sample on the CPU so a sample's noise does not depend on its batch or device.
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]).to(device)


def _host_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Pinned when the model runs on CUDA, so the copies out of the device do not block a step.
    return torch.empty(shape, dtype=torch.float32, pin_memory=device.type == "cuda")


@dataclass(frozen=True)
class SamplerCall:
    """What one `sample_call` made, and what it cost.

    Attributes:
        batch: the samples, as `sample` returns them.
        transformer_rows: rows the transformer computed: every step's calls, each padded to the
            micro-batch within its conditioning bucket. Against the samples times the steps, the
            rest is padding. (Classifier-free guidance doubles each call's rows inside the model.)
    """

    batch: RolloutBatch
    transformer_rows: int


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
    return sample_call(pipeline, prompts, seeds, options, negative_prompts, weight_version).batch


@torch.no_grad()
def sample_call(
    pipeline: RolloutPipeline,
    prompts: Sequence[str],
    seeds: Sequence[int],
    options: SamplingOptions,
    negative_prompts: Sequence[str] | None = None,
    weight_version: str | None = None,
) -> SamplerCall:
    """`sample`, with the transformer rows it computed (arguments as for `sample`)."""
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
    batch_size, num_steps = len(prompts), options.num_inference_steps

    conditioning = pipeline.encode_prompts(prompts, negative_prompts, options).map(lambda t: t.cpu())
    padded_conditioning = pad_buckets(pipeline, conditioning, options)
    schedule = pipeline.schedule(num_steps, options.height, options.width)
    sigmas = schedule.sigmas.to(device)
    generators = [torch.Generator(device="cpu").manual_seed(seed) for seed in seeds]

    # Everything kept is written once, in place, into one buffer per tensor; samples are views of
    # them (a sample pickled alone is compacted, a batch is pickled as these buffers).
    kept_steps = options.kept_latent_steps()
    slot_of_step = {step: k for k, step in enumerate(kept_steps)}
    latents = _host_buffer((batch_size, len(kept_steps), *latent_shape), device)
    log_probs = _host_buffer((batch_size, num_steps), device)
    if options.debug:
        velocities, means, noises = (_host_buffer((batch_size, num_steps, *latent_shape), device) for _ in range(3))
        noise_stds = _host_buffer((num_steps,), device)  # shared by the batch's rows

    x_t = _draw_noise(generators, latent_shape, device)
    if 0 in slot_of_step:
        latents[:, slot_of_step[0]].copy_(x_t, non_blocking=True)
    for step in range(num_steps):
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
        if step + 1 in slot_of_step:
            latents[:, slot_of_step[step + 1]].copy_(x_t, non_blocking=True)
        log_probs[:, step].copy_(transition.log_prob, non_blocking=True)
        if options.debug:
            velocities[:, step].copy_(v, non_blocking=True)
            means[:, step].copy_(transition.mean, non_blocking=True)
            noise_stds[step].copy_(transition.noise_std, non_blocking=True)
            if noise is None:
                noises[:, step].zero_()
            else:
                noises[:, step].copy_(noise, non_blocking=True)

    images = pipeline.decode(x_t).cpu()
    final_latents = x_t.cpu()
    if device.type == "cuda":  # the non-blocking copies above have landed only once the stream is done
        torch.cuda.current_stream(device).synchronize()
    latent_step_indices = torch.tensor(kept_steps, dtype=torch.int64)
    samples = [
        SampleTrajectory(
            schedule=schedule,
            prompt=prompts[i],
            negative_prompt=negative_prompts[i],
            seed=seeds[i],
            image=images[i],
            final_latents=final_latents[i],
            log_probs=log_probs[i],
            latents=latents[i],
            latent_step_indices=latent_step_indices,
            weight_version=weight_version,
            debug=StepDebug(velocities[i], means[i], noise_stds, noises[i]) if options.debug else None,
            denoising_env=conditioning.row(i) if options.return_denoising_env else None,
        )
        for i in range(batch_size)
    ]
    batch = RolloutBatch(schedule=schedule, options=options, model=pipeline.name, samples=samples)
    rows_per_step = sum(len(bucket.conditioning) for bucket in padded_conditioning.buckets)
    return SamplerCall(batch, transformer_rows=rows_per_step * num_steps)
