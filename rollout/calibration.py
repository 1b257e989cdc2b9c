"""Measurements on the serving device: the micro-batch size, and whether batch-invariant kernels hold.

With padding, batch invariance needs every model call to take the same number of rows, not a small
one. Larger calls cost less per sample until the device is saturated, and a lone sample pays for
the rows its call is padded to. `calibrate` times the rollout itself at each candidate size, on this
device, in this dtype, at one image size, and picks the smallest size whose time per sample is
within `tolerance` of the best: the throughput of the largest calls for the least padding. Under
batch-invariant kernels nothing is padded, so it picks the size with the best time per sample.

`check_batch_invariance` tests, on the device, what batch-invariant kernels promise: a sample's
velocity and image alone equal its velocity and image in a call of three, bit for bit.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from rollout.errors import ModelLoadError
from rollout.kernels import BatchInvariance
from rollout.models.base import Conditioning, RolloutPipeline
from rollout.options import SamplingOptions
from rollout.sampler import pad_conditioning, resolve_options, sample

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32)
# A prompt every served model takes, the embedded digits model included.
CALIBRATION_PROMPT = "the digit 7"
CALIBRATION_STEPS = 2


@dataclass(frozen=True)
class Calibration:
    """One image size's measurement.

    Attributes:
        seconds_per_sample: candidate micro-batch size -> the best time of a rollout of
            `max(candidates)` samples at that size, per sample.
        chosen: the smallest candidate within the tolerance of the best time per sample (with
            padding), or the best (under batch-invariant kernels).
    """

    height: int
    width: int
    seconds_per_sample: dict[int, float]
    chosen: int

    @property
    def size_key(self) -> str:
        """The key of `model.micro_batch_sizes` in the app config."""
        return f"{self.height}x{self.width}"


def _probe(
    pipeline: RolloutPipeline, height: int, width: int, guidance: dict | None
) -> tuple[SamplingOptions, tuple[int, ...], Conditioning, torch.Tensor]:
    """What a probing model call takes: the options, the latent shape, one row of conditioning
    (`CALIBRATION_PROMPT`, on the CPU) and the first step's time input (on the device)."""
    options = resolve_options(
        pipeline, SamplingOptions(height=height, width=width, num_inference_steps=2, **(guidance or {}))
    )
    (one_row,) = pipeline.encode_prompts([CALIBRATION_PROMPT], [""], options).buckets
    schedule = pipeline.schedule(options.num_inference_steps, height, width, options.num_frames)
    timestep = schedule.model_timesteps[0].to(pipeline.device)
    return options, pipeline.latent_shape(height, width, options.num_frames), one_row.conditioning, timestep


def calibrate(
    pipeline: RolloutPipeline,
    height: int,
    width: int,
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
    guidance: dict | None = None,
    repeats: int = 5,
    tolerance: float = 0.05,
) -> Calibration:
    """Times a rollout of `max(candidates)` samples (`CALIBRATION_STEPS` steps, then the decode)
    with the pipeline's micro-batch size set to each candidate in turn, under its batch invariance.

    A rollout, not one transformer call: each timing then spans every call the size makes, and
    includes what else grows with the number of calls (the sampler's work around each call, the
    VAE's calls). Timing one call per candidate, on this project's shared 2-core CPU, picked 2, 4,
    8 or 16 for the same model from run to run; once it found calls of 2 SD3 samples (tiny copy,
    128 px, CFG) 2% cheaper per sample than calls of 4, where in a rollout of 16 samples the
    transformer took 4.11 s in calls of 2 against 3.52 s in calls of 4.

    The candidates take turns, one rollout each per round, after a warm-up each, so that a slow
    spell of a shared machine slows every candidate alike rather than the one timed during it.
    The pipeline's micro-batching is restored afterwards.

    Args:
        guidance: `guidance_scale` / `true_cfg_scale` of the requests to serve (CFG doubles the
            rows the transformer takes); None keeps the model's default.
        repeats: rounds of timed rollouts; each candidate's fastest counts.
    """
    if not candidates or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in candidates):
        raise ValueError(f"candidates must be integers >= 1, got {candidates!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    options = SamplingOptions(height=height, width=width, num_inference_steps=CALIBRATION_STEPS, **(guidance or {}))
    samples = max(candidates)
    micro_batching = pipeline.micro_batching

    def seconds_of(rows: int) -> float:
        pipeline.micro_batching = dataclasses.replace(micro_batching, default=rows, by_size={})
        started = time.perf_counter()
        sample(pipeline, [CALIBRATION_PROMPT] * samples, list(range(samples)), options)
        if pipeline.device.type == "cuda":
            torch.cuda.synchronize(pipeline.device)
        return time.perf_counter() - started

    sizes = sorted(set(candidates))
    try:
        for rows in sizes:  # a warm-up rollout each
            seconds_of(rows)
        rounds = [{rows: seconds_of(rows) for rows in sizes} for _ in range(repeats)]
    finally:
        pipeline.micro_batching = micro_batching
    seconds_per_sample = {rows: min(times[rows] for times in rounds) / samples for rows in sizes}
    best = min(seconds_per_sample.values())
    if micro_batching.invariance is BatchInvariance.KERNELS:
        tolerance = 0.0  # a call takes only the rows there are: a larger size costs a lone sample nothing
    chosen = min(rows for rows, seconds in seconds_per_sample.items() if seconds <= best * (1 + tolerance))
    return Calibration(height, width, seconds_per_sample, chosen)


@dataclass(frozen=True)
class InvarianceCheck:
    """A sample alone against the same sample at position 1 of a call of three, on one device.

    Attributes:
        velocity_difference: the largest absolute difference of its velocity.
        image_difference: the largest absolute difference of its decoded image.
    """

    device: str
    velocity_difference: float
    image_difference: float

    @property
    def holds(self) -> bool:
        return self.velocity_difference == 0 and self.image_difference == 0


def check_batch_invariance(
    pipeline: RolloutPipeline, height: int, width: int, guidance: dict | None = None
) -> InvarianceCheck:
    """Computes one sample's velocity alone and beside two others, under the pipeline's kernels,
    each in one transformer call (`MicroBatching.kernels`, no padding), and its image alone and
    beside the two others, in the pipeline's own VAE calls, and compares the bits.

    Batch-invariant kernels promise equality; padding promises it only for calls of the micro-batch's
    size, so with `BatchInvariance.PADDING` a difference shows what padding is for.

    Args:
        guidance: `guidance_scale` / `true_cfg_scale` of the requests to serve (classifier-free
            guidance changes the calls); None keeps the model's default.
    """
    options, latent_shape, one_row, timestep = _probe(pipeline, height, width, guidance)
    three_rows = pad_conditioning(one_row, 3).map(lambda t: t.to(pipeline.device))
    x_t = torch.randn((3, *latent_shape), generator=torch.Generator().manual_seed(0)).to(pipeline.device)
    probe_last = torch.tensor([1, 0, 2], device=pipeline.device)  # the probe, x_t[0], at position 1
    with torch.no_grad(), pipeline.micro_batching.kernels():
        alone = pipeline.predict_velocity(x_t[:1], timestep.expand(1), three_rows.rows(slice(0, 1)), options)
        beside = pipeline.predict_velocity(x_t[probe_last], timestep.expand(3), three_rows, options)[1:2]
    image_alone = pipeline.decode(x_t[:1])  # in the VAE calls the pipeline makes
    image_beside = pipeline.decode(x_t[probe_last])[1:2]
    return InvarianceCheck(
        device=str(pipeline.device),
        velocity_difference=(alone - beside).abs().max().item(),
        image_difference=(image_alone - image_beside).abs().max().item(),
    )


def require_batch_invariance(pipeline: RolloutPipeline, height: int, width: int) -> None:
    """Raises `ModelLoadError` naming ``model.batch_invariance`` unless `check_batch_invariance` holds
    at this size with the model's default guidance: a server's refusal to serve with kernels that do
    not keep a sample's bits on its device."""
    check = check_batch_invariance(pipeline, height, width)
    if not check.holds:
        raise ModelLoadError(
            "model.batch_invariance",
            f"'kernels' does not keep a sample's bits on {check.device} for this model: alone and beside two "
            f"others, its velocity differs by {check.velocity_difference:.3g} and its image by "
            f"{check.image_difference:.3g}; use 'padding'",
        )
