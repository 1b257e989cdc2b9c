"""Measurements on the serving device: the micro-batch sizes, and whether batch-invariant kernels hold.

With padding, batch invariance needs every model call to take the same number of rows, not a small
one. Larger calls cost less per sample until the device is saturated, and a lone sample pays for
the rows its call is padded to. `calibrate` times the rollout itself at each candidate size, and
the VAE's decode within it, on this device, in this dtype, at one image size, and picks for
the transformer and for the VAE, each on its own time, the smallest size within `tolerance` of the
fastest for the load to serve (a batch of `load` samples, the padding of its last call counted),
among the sizes whose calls give a sample the same bits at every position in them. A fixed size
cannot be cheap for every load: RL groups want few, large calls, a lone sample the least padding.
Under batch-invariant kernels nothing is padded, so it picks the transformer's size with the best
time per sample, and the VAE decodes an image a call.

`check_batch_invariance` tests, on the device, what the batch invariance promises: under
batch-invariant kernels, a sample's velocity and image alone equal its velocity and image in a call
of three; under padding, a sample's velocity and image in a whole micro-batch do not change when
it moves to another position in it. Bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.conditioning import Conditioning
from rollout.errors import ModelLoadError
from rollout.input_images import ImageInputLimits, InputImage, decode_input_image
from rollout.kernels import BatchInvariance
from rollout.micro_batching import parse_image_size
from rollout.models.base import RolloutPipeline
from rollout.options import SamplingOptions
from rollout.sampler import micro_batch_size, pad_conditioning, resolve_options, rows_per_sample, sample_tree
from rollout.tree import TreeRoot
from rollout.weights import weights_layout

DEFAULT_CANDIDATES = (1, 2, 4, 8, 16, 32)
# An RL group: Flow-GRPO and DanceGRPO sample 8 to 24 images a prompt, and a worker batches several.
DEFAULT_LOAD = 16
# Sizes this close to the fastest for the load are within the timing's noise on a shared machine;
# the smallest of them pads smaller loads least.
DEFAULT_TOLERANCE = 0.02
# What a worker replica may spend calibrating at start-up unless configured (`model.calibration_budget_s`):
# the tiny copies take 5-15 s on this project's CPU.
STARTUP_BUDGET_S = 300.0
# Guidance off for every family: SD3's and the embedded model's CFG weight, FLUX.1's and
# Qwen-Image's true CFG, Wan's and LTX-Video's CFG.
UNGUIDED = {"guidance_scale": 1.0, "true_cfg_scale": 1.0}
# A prompt every served model takes, the embedded digits model included.
CALIBRATION_PROMPT = "the digit 7"
CALIBRATION_STEPS = 2


def calibration_images(pipeline: RolloutPipeline, height: int, width: int) -> tuple[InputImage, ...]:
    """The input images a calibration prompt takes: none, or as many as a model that needs them
    (image-to-video) needs, each a fixed gradient of the output size."""
    count = pipeline.condition_images.least_per_prompt
    if not count:
        return ()
    rows = torch.linspace(0, 255, height).round().to(torch.uint8)[:, None].expand(height, width)
    pixels = torch.stack([rows, rows.flip(0), torch.full((height, width), 128, dtype=torch.uint8)])
    return (decode_input_image(pixels, "image_path", ImageInputLimits()),) * count


@dataclass(frozen=True)
class Calibration:
    """One image size's measurement.

    Attributes:
        denoising_seconds_per_sample: candidate size -> the best time of a rollout of
            `max(candidates)` samples with the transformer's and the VAE's calls of that size, less
            the time of its decode, per sample: encoding, transformer calls and steps.
        decode_seconds_per_sample: candidate size -> the best time of that rollout's decode, per
            sample.
        load: the samples of the batch the sizes were picked for.
        denoising_seconds_for_load, decode_seconds_for_load: candidate size -> the time of the
            rollout less its decode, and of the decode, for `load` samples in calls of that size:
            the time per computed sample times the samples computed, the padding of the last call
            included.
        chosen: the transformer's micro-batch size: with padding, the smallest candidate within the
            tolerance of the least time of the rollout less its decode for `load` samples, their
            padding to whole calls counted (`denoising_seconds_for_load`); under batch-invariant
            kernels, the best time per sample. Either way, a size of whole samples' rows only (an
            even one for a sample guided in one call).
        chosen_for_decode: the VAE's: the smallest candidate within the tolerance of the least
            decode time for `load` samples (with padding); None under batch-invariant kernels,
            which decode an image a call.
        checks: with padding, candidate size -> `check_batch_invariance` in calls of that size;
            a size at which the transformer (the VAE) gives a sample other bits at another position
            in the call is not chosen for it.
        rounds: the timed rounds the times are the best of; 0 when the deadline passed during
            the warm-ups, whose times were then the one round.
        skipped: candidate size -> why it was not measured: "out of memory" (it and every larger
            size), or "deadline" (not warmed before the deadline).
    """

    height: int
    width: int
    denoising_seconds_per_sample: dict[int, float]
    decode_seconds_per_sample: dict[int, float]
    load: int
    denoising_seconds_for_load: dict[int, float]
    decode_seconds_for_load: dict[int, float]
    chosen: int
    chosen_for_decode: int | None
    checks: dict[int, "InvarianceCheck"]
    rounds: int
    skipped: dict[int, str]

    @property
    def size_key(self) -> str:
        """The key of `model.micro_batch_sizes` and `model.decode_batch_sizes` in the app config."""
        return f"{self.height}x{self.width}"


def _probe(
    pipeline: RolloutPipeline, height: int, width: int, guidance: dict | None
) -> tuple[SamplingOptions, tuple[int, ...], Conditioning, torch.Tensor]:
    """What a probing model call takes: the options, the latent shape, one row of conditioning
    (`CALIBRATION_PROMPT`, on the CPU) and the first step's time input (on the device)."""
    options = resolve_options(
        pipeline, SamplingOptions(height=height, width=width, num_inference_steps=2, **(guidance or {}))
    )
    images = calibration_images(pipeline, height, width)
    (one_row,) = pipeline.encode_prompts([CALIBRATION_PROMPT], [""], options, [images]).buckets
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
    load: int = DEFAULT_LOAD,
    tolerance: float = DEFAULT_TOLERANCE,
    deadline: float | None = None,
) -> Calibration:
    """Times a rollout of `max(candidates)` samples (`CALIBRATION_STEPS` steps, then the decode)
    with the pipeline's transformer and VAE calls set to each candidate size in turn, under its
    batch invariance, and within it the decode of its latents. The
    transformer's sizes count rows (`MicroBatching`): a guided sample takes two where guidance
    runs its branches in one call, and then only even sizes are picked for it.

    A rollout, not one transformer call: each timing then spans every call the size makes, and
    includes what else grows with the number of calls (the sampler's work around each call).
    Timing one call per candidate, on this project's shared 2-core CPU, picked 2, 4, 8 or 16 for
    the same model from run to run; once it found calls of 2 SD3 samples (tiny copy, 128 px, CFG)
    2% cheaper per sample than calls of 4, where in a rollout of 16 samples the transformer took
    4.11 s in calls of 2 against 3.52 s in calls of 4.

    The transformer's size is picked on the rollout's time less its decode's, the VAE's on the
    decode's alone: a choice on the rollout's whole time weighs the decode as two steps' worth of
    denoising would, and picked 4 for tiny Qwen-Image, whose VAE is 5% cheaper in calls of 16 than of 4
    and whose transformer is 37% cheaper per sample in calls of 16 than of 4 (docs/throughput.md).

    The size is picked for a load: a size larger than the load pads its one call, so a lone sample
    is cheapest in the smallest calls and a group of 16 in calls of 16 (tiny SD3 at 128 px with
    CFG on this project's CPU: 3.6% less time per sample than calls of 8, where a 5% tolerance on
    the time per sample picked 8, and the rollout of 16 samples then took 1.06-1.08x the pipeline's
    one call; docs/throughput.md).

    With padding, a size is picked for the transformer (the VAE) only if its calls give a sample
    the same bits at every position in them (`check_batch_invariance`, at each candidate after its
    warm-up): padding keeps a sample's bits only at such sizes.

    The candidates take turns, one rollout each per round, after a warm-up each, so
    that a slow spell of a shared machine slows every candidate alike rather than the one timed
    during it. The pipeline's micro-batching is restored afterwards.

    Args:
        guidance: `guidance_scale` / `true_cfg_scale` of the requests to serve (CFG doubles the
            rows the transformer takes); None keeps the model's default.
        repeats: rounds of timed rollouts; each candidate's fastest counts.
        load: the samples of the batches to serve (a worker's batch: a request's, or several
            requests' of equal options).
        tolerance: how much more time for the load than the fastest size a smaller size may take
            and still be picked.
        deadline: a `time.monotonic()` time after which no size is warmed up (the smallest always
            is) and no round is timed; the sizes warmed by then are compared on the rounds timed by
            then, or on their warm-ups if none was. The calibration then ends within one rollout
            (and, with padding, one check) of it.

    A size whose rollout runs out of the device's memory is left out, and so is every larger one;
    a ValueError if the smallest does.
    """
    if not candidates or not all(map(_is_count, candidates)):
        raise ValueError(f"candidates must be integers >= 1, got {candidates!r}")
    for name, value in (("repeats", repeats), ("load", load)):
        if not _is_count(value):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    options = SamplingOptions(height=height, width=width, num_inference_steps=CALIBRATION_STEPS, **(guidance or {}))
    # For the transformer, only sizes of whole samples' rows: with guidance in one call, a size of 1
    # (or 5) makes calls of 2 (or 4) rows, and would be written down as what it is not.
    resolved = resolve_options(pipeline, options)
    per_sample = rows_per_sample(pipeline, resolved)
    if all(rows % per_sample for rows in candidates):
        raise ValueError(f"a guided sample takes {per_sample} rows of a {pipeline.name} call: add an even candidate")
    samples = max(candidates)
    images = calibration_images(pipeline, resolved.height, resolved.width)
    micro_batching = pipeline.micro_batching

    def seconds_of(rows: int) -> tuple[float, float]:
        """The rollout's time less its decode's, and its decode's, in calls of `rows`."""
        pipeline.micro_batching = dataclasses.replace(
            micro_batching, default=rows, by_size={}, decode_default=rows, decode_by_size={}
        )
        with _decode_timed(pipeline) as decode_seconds:
            started = time.perf_counter()
            sample_tree(pipeline, [TreeRoot(CALIBRATION_PROMPT, "", seed, images=images) for seed in range(samples)], options)
            synchronize(pipeline.device)
            rollout_seconds = time.perf_counter() - started
        return rollout_seconds - decode_seconds[0], decode_seconds[0]

    padding = micro_batching.invariance is BatchInvariance.PADDING
    checks, samples_per_call, warm_ups, skipped = {}, {}, {}, {}
    try:
        # A warm-up each, smallest first, and with padding the check that the size keeps a sample's
        # bits; the sizes not warmed by the deadline (once one of whole samples' rows is), or as
        # large as one that ran out of memory, are left out.
        for rows in sorted(set(candidates)):
            if any(warmed % per_sample == 0 for warmed in warm_ups) and _past(deadline):
                skipped[rows] = "deadline"
                continue
            try:
                warm_ups[rows] = seconds_of(rows)
                samples_per_call[rows] = micro_batch_size(pipeline, resolved)
                if padding:
                    checks[rows] = check_batch_invariance(pipeline, height, width, guidance)
            except torch.OutOfMemoryError:
                _release_cached_memory(pipeline.device)
                if not warm_ups:
                    raise ValueError(
                        f"calls of {rows} rows at {height}x{width} do not fit in {pipeline.device}'s memory"
                    ) from None
                skipped.update({larger: "out of memory" for larger in candidates if larger >= rows})
                break
        sizes = sorted(warm_ups)
        rounds = []
        while len(rounds) < repeats and not _past(deadline):
            rounds.append({rows: seconds_of(rows) for rows in sizes})
    finally:
        pipeline.micro_batching = micro_batching
    timed_rounds = len(rounds)
    rounds = rounds or [warm_ups]
    denoising_seconds_per_sample = {rows: min(times[rows][0] for times in rounds) / samples for rows in sizes}
    decode_seconds_per_sample = {rows: min(times[rows][1] for times in rounds) / samples for rows in sizes}

    def for_load(per_sample_seconds: float, per_call: int) -> float:
        """From the time per sample of `samples` samples in calls of `per_call`, that of `load`."""
        per_computed_sample = per_sample_seconds * samples / micro_batching.padded_rows(samples, per_call)
        return per_computed_sample * micro_batching.padded_rows(load, per_call)

    denoising = {
        rows: for_load(denoising_seconds_per_sample[rows], samples_per_call[rows]) for rows in sizes
    }
    decode = {rows: for_load(decode_seconds_per_sample[rows], rows) for rows in sizes}
    measured = {
        "height": height,
        "width": width,
        "denoising_seconds_per_sample": denoising_seconds_per_sample,
        "decode_seconds_per_sample": decode_seconds_per_sample,
        "load": load,
        "denoising_seconds_for_load": denoising,
        "decode_seconds_for_load": decode,
        "rounds": timed_rounds,
        "skipped": skipped,
    }
    whole = {rows: denoising[rows] for rows in sizes if rows % per_sample == 0}
    if not padding:
        # A call takes only the rows there are: a larger size costs a lone sample nothing.
        return Calibration(**measured, chosen=_smallest_near_best(whole, 0.0), chosen_for_decode=None, checks={})
    # Only sizes whose calls give a sample the same bits at every position in them.
    transformer_sizes = {rows: seconds for rows, seconds in whole.items() if checks[rows].velocity_difference == 0}
    vae_sizes = {rows: decode[rows] for rows in sizes if checks[rows].image_difference == 0}
    if not transformer_sizes or not vae_sizes:
        raise ValueError(
            f"in calls of every candidate size, the {'VAE' if transformer_sizes else 'transformer'} gives a sample "
            f"other bits at another position in the call on {pipeline.device} with {torch.get_num_threads()} torch "
            "threads: add 1 to the candidates"
        )
    return Calibration(
        **measured,
        chosen=_smallest_near_best(transformer_sizes, tolerance),
        chosen_for_decode=_smallest_near_best(vae_sizes, tolerance),
        checks=checks,
    )


def synchronize(device: torch.device | str) -> None:
    """Waits for the device's queued work, so that a timer read next counts it (CUDA runs async)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def _decode_timed(pipeline: RolloutPipeline) -> Iterator[list[float]]:
    """Times the pipeline's decode calls while open: their seconds, summed, as the yielded list's
    one item. The decode is timed inside the rollout, not again on its own after it: the rollout
    less its decode is then one rollout's work, where the difference of two separate timings
    carried the noise of both, and tiny Qwen-Image's decode, 85% of its rollout, made that noise
    larger than the transformer's time (its picked size changed between two runs)."""
    decode = pipeline.decode
    own_decode = vars(pipeline).get("decode")  # one set on the object itself stays after
    seconds = [0.0]

    def timed_decode(latents: torch.Tensor) -> torch.Tensor:
        synchronize(pipeline.device)  # the denoising's queued work is not the decode's
        started = time.perf_counter()
        images = decode(latents)
        synchronize(pipeline.device)
        seconds[0] += time.perf_counter() - started
        return images

    pipeline.decode = timed_decode
    try:
        yield seconds
    finally:
        if own_decode is None:
            del pipeline.decode  # the class's method again
        else:
            pipeline.decode = own_decode


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _release_cached_memory(device: torch.device | str) -> None:
    """Hands the blocks a failed allocation left cached back, so that the sizes still to measure
    start from the memory a replica serves with."""
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def _is_count(value) -> bool:
    """An int >= 1 (a bool is an int to Python, not a count)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _smallest_near_best(seconds_by_size: dict[int, float], tolerance: float) -> int:
    best = min(seconds_by_size.values())
    return min(rows for rows, seconds in seconds_by_size.items() if seconds <= best * (1 + tolerance))


@dataclass(frozen=True)
class InvarianceCheck:
    """Samples' velocities and images computed in two calls that batch invariance says give each
    sample the same bits (`check_batch_invariance`), on one device.

    Attributes:
        velocity_difference: the largest absolute difference of a sample's velocity.
        image_difference: the largest absolute difference of a sample's decoded image.
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
    """Compares, bit for bit, what the pipeline's batch invariance promises at this image size.

    Under batch-invariant kernels: one sample's velocity alone and beside two others, each in one
    transformer call (no padding), and its image alone and beside the two others.

    Under padding: a micro-batch of samples against the same samples each one position on (the
    last first), in one transformer call of the micro-batch's rows and one VAE call of its images.
    Padding promises a sample the same bits in any call of the same size, which holds only where
    the kernels treat every row of a call alike. On this project's CPU (torch 2.13, 2 threads),
    calls of 3, 5 or 6 rows give a row other bits at another position in the call in some of the
    tiny families, in the transformer or the VAE; calls of 1, 2, 4, 8, 12 and 16 rows do not, and
    with one thread no size does (`python -m benchmarks.call_positions`).

    Args:
        guidance: `guidance_scale` / `true_cfg_scale` of the requests to serve (classifier-free
            guidance changes the calls); None keeps the model's default.
    """
    velocity_difference, x_t = _velocity_difference(pipeline, height, width, guidance)
    # The images in the VAE calls the pipeline makes: under padding, the micro-batch is one call.
    image_difference = _comparison(pipeline)(pipeline.decode, x_t[: _images_compared(pipeline, height, width)])
    return InvarianceCheck(str(pipeline.device), velocity_difference, image_difference)


def _comparison(pipeline: RolloutPipeline):
    """How `check_batch_invariance` compares a sample's outputs: alone and beside two others
    (kernels), or in a call against one position on (padding)."""
    if pipeline.micro_batching.invariance is BatchInvariance.KERNELS:
        return _alone_and_beside_difference
    return _moved_difference


def _images_compared(pipeline: RolloutPipeline, height: int, width: int) -> int:
    """The images of `check_batch_invariance`'s VAE calls."""
    if pipeline.micro_batching.invariance is BatchInvariance.KERNELS:
        return 3
    return pipeline.micro_batching.decode_size_for(height, width)


def _velocity_difference(
    pipeline: RolloutPipeline, height: int, width: int, guidance: dict | None
) -> tuple[float, torch.Tensor]:
    """`check_batch_invariance`'s transformer part, and the latents it drew: as many as its call
    or the VAE's takes, the VAE's call the first of them."""
    options, latent_shape, one_row, timestep = _probe(pipeline, height, width, guidance)
    micro_batching = pipeline.micro_batching
    rows = 3 if micro_batching.invariance is BatchInvariance.KERNELS else micro_batch_size(pipeline, options)
    conditioning = pad_conditioning(one_row, rows).map(lambda t: t.to(pipeline.device))
    drawn = max(rows, _images_compared(pipeline, height, width))
    x_t = torch.randn((drawn, *latent_shape), generator=torch.Generator().manual_seed(0)).to(pipeline.device)

    def velocity(x: torch.Tensor) -> torch.Tensor:
        return pipeline.predict_velocity(x, timestep.expand(len(x)), conditioning.rows(slice(0, len(x))), options)

    with torch.no_grad(), micro_batching.kernels():
        return _comparison(pipeline)(velocity, x_t[:rows]), x_t


def _alone_and_beside_difference(compute, x: torch.Tensor) -> float:
    """How far `compute` of `x[0]` alone is from its row with `x[0]` at position 1 of `x`'s three."""
    probe_second = torch.tensor([1, 0, 2], device=x.device)
    return (compute(x[:1]) - compute(x[probe_second])[1:2]).abs().max().item()


def _moved_difference(compute, x: torch.Tensor) -> float:
    """How far each sample's row of `compute(x)` is from its row with every sample one position on."""
    moved = torch.roll(torch.arange(len(x), device=x.device), 1)
    return (compute(x)[moved] - compute(x[moved])).abs().max().item()


def require_batch_invariance(pipeline: RolloutPipeline, height: int, width: int) -> None:
    """Raises `ModelLoadError` unless `check_batch_invariance` holds at this image size with the
    model's default guidance: a server's refusal to serve samples whose bits would depend on their
    companions. It names ``model.batch_invariance`` (kernels), or the micro-batch field whose size
    breaks it (padding)."""
    check = check_batch_invariance(pipeline, height, width)
    micro_batching = pipeline.micro_batching
    if check.holds and micro_batching.invariance is BatchInvariance.PADDING:
        # With guidance in one call and an odd size, requests without guidance make calls of other
        # rows than guided ones (a size of 5: 4 rows, 2 samples, against 5): those calls too.
        default = resolve_options(pipeline, SamplingOptions(height=height, width=width))
        call_rows = rows_per_sample(pipeline, default) * micro_batch_size(pipeline, default)
        if call_rows != micro_batching.size_for(height, width):
            # Only the transformer's calls change: the VAE's images, already compared, do not
            # depend on guidance.
            velocity_difference, _ = _velocity_difference(pipeline, height, width, UNGUIDED)
            check = dataclasses.replace(check, velocity_difference=velocity_difference)
    if check.holds:
        return
    if micro_batching.invariance is BatchInvariance.KERNELS:
        raise ModelLoadError(
            "model.batch_invariance",
            f"'kernels' does not keep a sample's bits on {check.device} for this model: alone and beside two "
            f"others, its velocity differs by {check.velocity_difference:.3g} and its image by "
            f"{check.image_difference:.3g}; use 'padding'",
        )
    if check.velocity_difference != 0:
        field, by_size, rows, difference = (
            "micro_batch_size", micro_batching.by_size, micro_batching.size_for(height, width), check.velocity_difference
        )
    else:
        field, by_size, rows, difference = (
            "decode_batch_size", micro_batching.decode_by_size, micro_batching.decode_size_for(height, width),
            check.image_difference,
        )
    field = f"model.{field}s" if (height, width) in by_size else f"model.{field}"
    raise ModelLoadError(
        field,
        f"calls of {rows} at {height}x{width} give a sample other bits at another position in the call on "
        f"{check.device} with {torch.get_num_threads()} torch threads (they differ by {difference:.3g}), so padding "
        "cannot keep a sample's bits; use a size `python -m deployments calibrate` picks",
    )


# At a replica's start ----------------------------------------------------------------------------


def default_cache_directory() -> Path:
    """Where calibrations are kept between starts unless told: `$XDG_CACHE_HOME` (else `~/.cache`)
    `/diffusion-rollout/calibration`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "diffusion-rollout" / "calibration"


def device_description(device: torch.device | str) -> str:
    """The device as far as its kernels' speed goes: a GPU's name, compute capability and memory,
    and CUDA's version; a CPU's model, vector instructions and the calling thread's torch threads."""
    device = torch.device(device)
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        return (
            f"{properties.name}, compute {properties.major}.{properties.minor}, "
            f"{properties.total_memory // 2**20} MiB, CUDA {torch.version.cuda}"
        )
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.partition(":")[2].strip()
                break
    return f"{model}, {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} torch threads"


def startup_candidates(pipeline: RolloutPipeline, height: int, width: int, load: int = DEFAULT_LOAD) -> tuple[int, ...]:
    """The sizes a replica tries at start-up: `DEFAULT_CANDIDATES` up to the rows of `load` samples
    of the model's default request (two rows a guided sample where guidance runs in one call)."""
    options = resolve_options(pipeline, SamplingOptions(height=height, width=width))
    most = load * rows_per_sample(pipeline, options)
    return tuple(rows for rows in DEFAULT_CANDIDATES if rows <= most)


def calibration_key(pipeline: RolloutPipeline, height: int, width: int, load: int, candidates: tuple[int, ...]) -> dict:
    """Everything a start-up calibration at this size depends on, as JSON: the model's architecture
    and dtypes (its weights' layout, not their values, which updates change and speed does not
    follow), the device, torch, the batch invariance and attention kernel, the size, the model's
    default guidance (which sets a sample's rows), the load and the candidates."""
    options = resolve_options(pipeline, SamplingOptions(height=height, width=width))
    layout = sorted(
        (module, name, list(tensor.shape), str(tensor.dtype))
        for module, tensors in weights_layout(pipeline.weight_modules).items()
        for name, tensor in tensors.items()
    )
    return {
        "model": pipeline.name,
        "architecture": hashlib.sha256(json.dumps(layout).encode()).hexdigest(),
        "device": device_description(pipeline.device),
        "torch": torch.__version__,
        "batch_invariance": pipeline.micro_batching.invariance.value,
        "attention_backend": pipeline.attention.value,
        "size": f"{height}x{width}",
        "guidance": {"guidance_scale": options.guidance_scale, "true_cfg_scale": options.true_cfg_scale},
        "load": load,
        "candidates": list(candidates),
    }


def calibration_keys(pipeline: RolloutPipeline, sizes: list[tuple[int, int]], load: int = DEFAULT_LOAD) -> list[dict]:
    """`calibration_key` of each size with its `startup_candidates`. The device's description counts
    the calling thread's torch threads: call it on the thread that samples."""
    return [calibration_key(pipeline, h, w, load, startup_candidates(pipeline, h, w, load)) for h, w in sizes]


def digest_of(keys: list[dict]) -> str:
    """One short name for calibration keys: what a cache file, and the replicas' agreement on sizes,
    are named by."""
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:32]


class CalibrationCache:
    """Start-up calibrations kept on disk, a JSON file per `calibration_key`, so that a replica that
    starts again on the same machine and model measures nothing. One calibration runs at a time on
    a machine (`one_at_a_time`): two at once would each time the other's work too. An unreadable
    or foreign file reads as absent; a directory that cannot be written keeps nothing."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)

    def _file(self, key: dict) -> Path:
        return self.directory / f"{digest_of([key])}.json"

    def read(self, key: dict) -> tuple[int, int | None] | None:
        """The transformer's and the VAE's sizes kept for `key`, or None."""
        try:
            record = json.loads(self._file(key).read_text())
            chosen, chosen_for_decode = record["chosen"], record["chosen_for_decode"]
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if record.get("key") != key or not _is_count(chosen) or not (chosen_for_decode is None or _is_count(chosen_for_decode)):
            return None
        return chosen, chosen_for_decode

    def write(self, key: dict, calibration: Calibration) -> None:
        record = {
            "key": key,
            "chosen": calibration.chosen,
            "chosen_for_decode": calibration.chosen_for_decode,
            "denoising_seconds_for_load": calibration.denoising_seconds_for_load,
            "decode_seconds_for_load": calibration.decode_seconds_for_load,
            "rounds": calibration.rounds,
            "skipped": calibration.skipped,
        }
        with contextlib.suppress(OSError):  # a read-only cache directory keeps nothing
            self.directory.mkdir(parents=True, exist_ok=True)
            written = self._file(key).with_suffix(f".{os.getpid()}.tmp")
            written.write_text(json.dumps(record, indent=1))
            written.replace(self._file(key))  # whole, for a replica reading it meanwhile

    @contextlib.contextmanager
    def one_at_a_time(self, deadline: float) -> Iterator[bool]:
        """Holds the machine's calibration lock while open, waiting for it until `deadline`; yields
        whether it is held (False: the wait ran out, or there is no lock file to hold)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            lock = open(self.directory / "calibrating.lock", "a")
        except OSError:
            yield False
            return
        with lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if _past(deadline):
                        yield False
                        return
                    time.sleep(0.2)
            try:
                yield True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


@dataclass(frozen=True)
class StartupCalibration:
    """The sizes a replica measured or read at start-up, in the app config's form.

    Attributes:
        micro_batch_sizes: `"<height>x<width>"` -> the transformer's rows per call.
        decode_batch_sizes: `"<height>x<width>"` -> images per VAE call (none under batch-invariant
            kernels, which decode an image a call).
        notes: a line per image size: where its sizes came from, or why it has none.
        measured: the calibrations run (not those read from the cache).
    """

    micro_batch_sizes: dict[str, int]
    decode_batch_sizes: dict[str, int]
    notes: list[str]
    measured: list[Calibration]


def calibrate_at_start(pipeline: RolloutPipeline, keys: list[dict], budget_s: float, cache: CalibrationCache) -> StartupCalibration:
    """The micro-batch sizes for each of `keys` (`calibration_keys`: an image size, with the load
    and candidates to measure it for) on this device: read from `cache`, else measured by
    `calibrate` (the model's default guidance) and kept there. All of it, waiting for another
    calibration on the machine included, within `budget_s` seconds (a size reached after that
    keeps the model's default), give or take one rollout at one size."""
    deadline = time.monotonic() + budget_s
    chosen, chosen_for_decode, notes, measured = {}, {}, [], []
    with cache.one_at_a_time(deadline):
        for key in keys:
            size = key["size"]
            kept = cache.read(key)
            if kept is None and _past(deadline):
                notes.append(f"{size}: not calibrated: the {budget_s:g} s budget ran out")
                continue
            if kept is None:
                started = time.monotonic()
                height, width = parse_image_size(size)
                calibration = calibrate(pipeline, height, width, tuple(key["candidates"]), load=key["load"], deadline=deadline)
                cache.write(key, calibration)
                measured.append(calibration)
                kept = calibration.chosen, calibration.chosen_for_decode
                skipped = f", skipped {calibration.skipped}" if calibration.skipped else ""
                notes.append(
                    f"{size}: measured in {time.monotonic() - started:.1f} s ({calibration.rounds} rounds{skipped})"
                )
            else:
                notes.append(f"{size}: read from {cache.directory}")
            chosen[size], decode = kept
            if decode is not None:
                chosen_for_decode[size] = decode
    return StartupCalibration(chosen, chosen_for_decode, notes, measured)
