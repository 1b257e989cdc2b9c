"""Choosing the micro-batch by measurement.

Batch invariance needs every transformer call to take the same number of rows, not a small one.
Larger calls cost less per row until the device is saturated, and a lone sample pays for the rows
its call is padded to. `calibrate` times the model's call at each candidate size on this device,
in this dtype, at one image size, and picks the smallest size whose time per row is within
`tolerance` of the best: the throughput of the largest calls for the least padding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rollout.models.base import RolloutPipeline
from rollout.options import SamplingOptions
from rollout.sampler import pad_conditioning, resolve_options

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32)
# A prompt every served model takes, the embedded digits model included.
CALIBRATION_PROMPT = "the digit 7"


@dataclass(frozen=True)
class Calibration:
    """One image size's measurement.

    Attributes:
        seconds_per_row: candidate micro-batch size -> the best time of one full call, per row.
        chosen: the smallest candidate within the tolerance of the best time per row.
    """

    height: int
    width: int
    seconds_per_row: dict[int, float]
    chosen: int

    @property
    def size_key(self) -> str:
        """The key of `model.micro_batch_sizes` in the app config."""
        return f"{self.height}x{self.width}"


def calibrate(
    pipeline: RolloutPipeline,
    height: int,
    width: int,
    candidates: tuple[int, ...] = DEFAULT_CANDIDATES,
    guidance: dict | None = None,
    repeats: int = 3,
    tolerance: float = 0.05,
) -> Calibration:
    """Times `pipeline.predict_velocity` on `candidate` rows of random latents, for each candidate.

    Args:
        guidance: `guidance_scale` / `true_cfg_scale` of the requests to serve (CFG doubles the
            rows the transformer takes); None keeps the model's default.
        repeats: timed calls per candidate after one warm-up call; the fastest counts.
    """
    if not candidates or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in candidates):
        raise ValueError(f"candidates must be integers >= 1, got {candidates!r}")
    options = resolve_options(
        pipeline, SamplingOptions(height=height, width=width, num_inference_steps=2, **(guidance or {}))
    )
    latent_shape = pipeline.latent_shape(height, width)
    (one_row,) = pipeline.encode_prompts([CALIBRATION_PROMPT], [""], options).buckets
    timestep = pipeline.schedule(options.num_inference_steps, height, width).model_timesteps[0].to(pipeline.device)
    generator = torch.Generator().manual_seed(0)
    seconds_per_row = {}
    for rows in sorted(set(candidates)):
        conditioning = pad_conditioning(one_row.conditioning, rows).map(lambda t: t.to(pipeline.device))
        x_t = torch.randn((rows, *latent_shape), generator=generator).to(pipeline.device)
        times = []
        with torch.no_grad():
            for _ in range(repeats + 1):
                started = time.perf_counter()
                pipeline.predict_velocity(x_t, timestep.expand(rows), conditioning, options)
                if pipeline.device.type == "cuda":
                    torch.cuda.synchronize(pipeline.device)
                times.append(time.perf_counter() - started)
        seconds_per_row[rows] = min(times[1:]) / rows
    best = min(seconds_per_row.values())
    chosen = min(rows for rows, seconds in seconds_per_row.items() if seconds <= best * (1 + tolerance))
    return Calibration(height, width, seconds_per_row, chosen)
