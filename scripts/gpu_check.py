"""GPU check of the real families: the rollout against the plain diffusers pipeline, at real size.

No real weights exist on the device machine (and nothing can be downloaded there), so each model
is built at its published size (`rollout.testing.published`), with random weights in bf16.
Tokenizers and the scheduler come from the tiny offline copies the tests build
(`rollout.testing.builders`): a tokenizer's vocabulary does not change the compute. The families
checked are the records of `rollout.testing.families` with a `gpu_check`, by model name.

For each image family, one group of 8 samples of one prompt at 512x512, 10 steps, guidance as
Flow-GRPO trains (the record's `trained`: SD3.5-Medium's CFG 4.5, FLUX.1-dev's embedded guidance 3.5):
- samples/s of the rollout (SDE transitions, every latent of the trajectory and the log-probs
  kept and moved to the CPU) and of `pipeline(...)` on the same model, batch and seeds;
- peak GPU memory of each, and the rollout's with 16 samples (it grows with the micro-batch,
  not with the samples);
- the largest |log-prob difference| between the rollout and its replay, in bf16;
- the largest |difference| of final latents between the rollout's ODE path (fp32 latents) and
  `pipeline(..., output_type="latent")` (latents re-cast to bf16 every step), and between the two
  with the same weights cast to fp32 (two samples);
- the micro-batch calibration (`rollout.calibration`: time per sample of a rollout and of its
  decode at each candidate size, and of a batch of 16, its padding counted), and
  with the transformer's and the VAE's sizes it picks for 16, samples/s of the rollout and of `pipeline(...)` at 1, 8, 16 and 64
  samples (two interleaved rounds each, the faster counts);
- whether batch-invariant kernels (`rollout/kernels.py`) keep a sample's bits on the GPU
  (`check_batch_invariance`), and where they do, the replay difference and the same samples/s
  with them instead of padding.

An editing family (FLUX.1-Kontext-dev, `--families flux_kontext`) runs the same with one input image
of the request's size a prompt, as its pipeline takes it; calibration and the kernels' check, which
sample text-to-image requests, are skipped for it.

And Wan2.1-T2V-1.3B (`--families wan`): two videos of 480x832, 33 frames, 10 steps, CFG 5, one a
transformer call, against `pipeline(...)` with the rollout's Euler scheduler; peak memory; the
bf16 replay difference.

    python scripts/gpu_check.py --families sd3 flux wan --budget-s 500 --out docs/gpu_check.json
    python scripts/gpu_check.py --tiny     # the same code on the tiny copies, on the CPU (tested)

`--speed` runs issue 49's speed check instead of the sections (`check_speed`: ms per step of each
exact way of sampling against the pipeline eager and compiled, at FLUX.1-dev 1024x1024 and
SD3.5-Medium 512x512):

    python scripts/gpu_check.py --speed --families flux sd3 --budget-s 540 --out docs/gpu_speed.json

`--weight-transfer-gib 4` first measures moving 4 GiB of weights on the device
(`scripts/weight_transfer.py`: release and resume through pinned memory, a colocated trainer's
CUDA IPC buckets, an NCCL broadcast where there are two GPUs), as the first finding.

A session is lent the device machine for 15 minutes in all, so `--budget-s` bounds the run: each
family gets a share of the time left, sections are timed against an estimate from the family's
own group rollout, and one that would overrun is skipped and named under `skipped` (in the order
they run: the group with its replay and ODE checks, the calibration, the kernels' bit check, the
batch sizes with padding, then with the kernels, the fp32 path). `--sections` runs some of them,
`--calibrated` takes the sizes an earlier run picked. A family that fails is recorded with its
error, the run goes on to the next, and the script exits 1.

On the device machine, which has torch, transformers and peft but not diffusers: carry diffusers
as a wheel (`docs/real_models.md` gives the commands).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollout.calibration import calibrate, check_batch_invariance, synchronize  # noqa: E402
from rollout.input_images import InputImage  # noqa: E402
from rollout.errors import ModelLoadError  # noqa: E402
from rollout.kernels import AttentionBackend, BatchInvariance  # noqa: E402
from rollout.micro_batching import MicroBatching  # noqa: E402
from rollout.options import SamplingOptions  # noqa: E402
from rollout.replay import replay_log_probs  # noqa: E402
from rollout.sampler import resolve_options, rows_per_sample, sample, sample_tree  # noqa: E402
from rollout.testing.families import TINY_FAMILIES, TinyFamily  # noqa: E402
from rollout.transitions import TransitionKind  # noqa: E402
from rollout.tree import TreeRoot  # noqa: E402
from weight_transfer import check_weight_transfer  # noqa: E402  (this script's folder)

GROUP = 8
BATCH_SIZES = (1, 8, 16, 64)
# Up to an RL group of 16 (in rows: a guided SD3.5 sample takes two, so 32 is added for it): a
# larger call only pads such a group, and each candidate costs a rollout of the largest.
MICRO_BATCH_CANDIDATES = (1, 2, 4, 8, 16)
PROMPT = "a photo of a corgi wearing a red scarf, sitting on a wooden bench in a park"
# Model name -> the record of the tiny copy its published model is built on (one per model).
CHECKED = {record.model: record for record in TINY_FAMILIES.values() if record.gpu_check}
# What a calibration rollout sample costs against one of the group's (2 steps instead of 10, the
# decode, calls of 1 sample among the candidates), and a sample under batch-invariant kernels
# against one under padding: guesses on the safe side, for the estimates only.
CALIBRATION_SAMPLE_COST = 0.5
KERNELS_SAMPLE_COST = 2.0
# Less than this left for a family: building its models and one group would not fit.
MIN_FAMILY_SECONDS = 60
SECTIONS = ("group", "calibration", "kernels", "batch-sizes", "fp32-path")
# Samples of the fp32 comparison: a call of two, as the pipeline makes it.
FP32_PATH_SAMPLES = 2
# `--speed`: issue 49's targets, model -> (size, steps, batch sizes): FLUX.1-dev's lone sample at
# <= 150 ms a step, SD3.5-Medium's group of 16 at >= 1.3x the eager pipeline, a lone sample at
# >= 0.9x; the tiny copies check the code on the CPU.
SPEED_RUNS = {"flux": (1024, 28, (1, 8)), "sd3": (512, 10, (1, 16))}
TINY_SPEED_RUN = (64, 3, (1, 2))
# What compiling a published transformer is allowed to take in the budget (a guess on the safe side).
COMPILE_SECONDS = 120


class Budget:
    """Wall time left for a part of the run; `None` seconds: no limit (the tiny copies)."""

    def __init__(self, seconds: float | None):
        self.deadline = None if seconds is None else time.perf_counter() + seconds

    def left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - time.perf_counter()

    def share(self, fraction: float) -> "Budget":
        return Budget(None if self.deadline is None else fraction * self.left())

    def allows(self, estimated_seconds: float) -> bool:
        return estimated_seconds <= self.left()


@contextlib.contextmanager
def building_on(device: str, dtype: torch.dtype):
    """Parameters are created on `device` in `dtype` directly: a 12B model built in fp32 on the
    CPU first would take minutes."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def replay_difference(family, batch) -> float:
    """The largest |log-prob difference| between a rollout's samples and their replay."""
    replayed = replay_log_probs(family, batch.schedule, batch.options, batch.samples)
    return (replayed.log_probs - torch.stack([s.log_probs for s in batch.samples])).abs().max().item()


def measured(device: str, fn):
    """(result, seconds, peak GPU MiB or None) of one call of `fn`."""
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return result, seconds, peak


def loaded(record: TinyFamily, tiny_dir: Path, tiny: bool, device: str):
    """The family in bf16 on `device`: the tiny copy itself, or its published model built on the
    tiny copy's tokenizers and scheduler."""
    dtype = torch.bfloat16
    tiny_family = record.family.from_pretrained(tiny_dir, torch_dtype=dtype, device=device)
    if tiny:
        return tiny_family
    started = time.perf_counter()
    with building_on(device, dtype):
        pipe = record.gpu_check.build(tiny_family.pipe)
    pipe.set_progress_bar_config(disable=True)
    print(f"{record.model}: built in {time.perf_counter() - started:.0f} s", flush=True)
    return record.family(pipe)


def input_image(size: int) -> InputImage:
    """An input image of `size` x `size` pixels, random but the same in every run."""
    return InputImage(torch.randint(0, 256, (3, size, size), generator=torch.Generator().manual_seed(0), dtype=torch.uint8))


def check_family(
    name: str, tiny_dir: Path, tiny: bool, device: str, size: int, steps: int, candidates: tuple, batch_sizes: tuple,
    budget: Budget, sections: tuple[str, ...] = SECTIONS, calibrated: dict | None = None,
) -> dict:
    """The family's findings from the `sections` asked for; without the calibration, the batch
    sizes run in calls of the sizes `calibrated` (an earlier run's findings for the family) chose,
    or of the group."""
    record = CHECKED[name]
    guidance = dict(record.trained)
    family = loaded(record, tiny_dir, tiny, device)
    parameters = sum(p.numel() for p in family.transformer.parameters())

    options = SamplingOptions(num_inference_steps=steps, height=size, width=size, **guidance)
    # The group in one transformer call and one VAE call, as the pipeline makes them (two rows a
    # guided sample where guidance runs in one call). The VAE's size left to its default, the
    # transformer's rows, SD3.5's group of 8 decoded in a call of 16 images on the H200: 4 GB more
    # peak memory than the pipeline's (docs/real_models.md).
    rows = rows_per_sample(family, resolve_options(family, options))
    family.micro_batching = MicroBatching(GROUP * rows, decode_default=GROUP)
    # Up to a group of 16 samples in one call, in rows.
    candidates = tuple(sorted({*candidates, max(candidates) * rows}))

    # An editing model's input image: the prompt's, shared by its group; the pipeline takes it
    # for every sample, as the record's `pipeline_arguments` say.
    images = (input_image(size),) if record.condition_images else ()
    image_arguments = record.pipeline_arguments(images[0].to_pil(), size, size) if images else {}

    def rollout_of(samples: int, sampling_options: SamplingOptions):
        roots = [TreeRoot(PROMPT, "", seed, images=images) for seed in range(samples)]
        return sample_tree(family, roots, sampling_options).batch

    def rollout(samples: int = GROUP):
        return rollout_of(samples, options)

    def plain_pipeline(output_type: str = "pt", samples: int = GROUP):
        with torch.no_grad():
            return family.pipe(
                prompt=[PROMPT] * samples, height=size, width=size, num_inference_steps=steps,
                generator=[torch.Generator("cpu").manual_seed(s) for s in range(samples)], output_type=output_type,
                **image_arguments, **guidance,
            ).images  # fmt: skip

    ode_options = SamplingOptions(num_inference_steps=steps, height=size, width=size, sde_type=TransitionKind.ODE, **guidance)

    def ode_distance(samples: int) -> tuple[float, float]:
        """Max |difference| of final latents between the rollout's ODE path and the pipeline's
        `output_type="latent"`, and the latents' max |value|."""
        ode = rollout_of(samples, ode_options).samples
        pipeline_latents = plain_pipeline("latent", samples).float().cpu()
        if pipeline_latents.ndim == 3:  # packed tokens
            pipeline_latents = family.unpack(pipeline_latents, size // 8, size // 8)
        difference = (torch.stack([s.final_latents for s in ode]) - pipeline_latents).abs().max().item()
        return difference, pipeline_latents.abs().max().item()

    # Warm-up (kernels, allocator, cuDNN autotuning), and the estimate each later section is
    # weighed by against the budget: what one sample costs the slower path.
    warm_up = {"rollout": measured(device, rollout)[1], "pipeline": measured(device, plain_pipeline)[1]}
    seconds_per_sample = max(warm_up.values()) / GROUP
    skipped, findings = [], {}
    if "group" in sections:
        runs = {"rollout": [], "pipeline": []}
        for _ in range(2):  # interleaved, so that drift hits both alike
            batch, seconds, rollout_peak = measured(device, rollout)
            runs["rollout"].append(seconds)
            _, seconds, pipeline_peak = measured(device, plain_pipeline)
            runs["pipeline"].append(seconds)
        _, _, rollout_peak_16 = measured(device, lambda: rollout(2 * GROUP))
        rates = {which: GROUP / min(seconds) for which, seconds in runs.items()}
        ode_difference, latent_abs_max = ode_distance(GROUP)
        findings = {
            "rollout_samples_per_s": rates["rollout"],
            "pipeline_samples_per_s": rates["pipeline"],
            "rollout_over_pipeline": rates["rollout"] / rates["pipeline"],
            "rollout_seconds": runs["rollout"],
            "pipeline_seconds": runs["pipeline"],
            "rollout_peak_memory_mb": rollout_peak,
            "rollout_peak_memory_mb_16_samples": rollout_peak_16,
            "pipeline_peak_memory_mb": pipeline_peak,
            "replay_max_abs_dlogp": replay_difference(family, batch),
            "log_probs_finite": all(bool(torch.isfinite(s.log_probs).all()) for s in batch.samples),
            "ode_vs_pipeline_max_abs_latent_diff": ode_difference,
            "latent_abs_max": latent_abs_max,
        }
        seconds_per_sample = max(min(seconds) for seconds in runs.values()) / GROUP

    def throughput_by_batch_size(cost: float = 1.0) -> dict:
        """Two interleaved rounds at each batch size, the faster counts (the process is warm from
        the group's runs, so the first round is the warm-up at a new size)."""
        throughput = {}
        for samples in batch_sizes:
            if not budget.allows(4 * samples * seconds_per_sample * cost):
                skipped.append(f"batch size {samples} and larger" + (" (kernels)" if cost != 1.0 else ""))
                break
            seconds = {"rollout": [], "pipeline": []}
            for _ in range(2):
                seconds["rollout"].append(measured(device, lambda n=samples: rollout(n))[1])
                seconds["pipeline"].append(measured(device, lambda n=samples: plain_pipeline("pt", n))[1])
            rates = {name: samples / min(times) for name, times in seconds.items()}
            throughput[samples] = {
                "rollout_samples_per_s": rates["rollout"],
                "pipeline_samples_per_s": rates["pipeline"],
                "rollout_over_pipeline": rates["rollout"] / rates["pipeline"],
            }
            print(f"{name}: {family.micro_batching.invariance.value}, batch size {samples}: {throughput[samples]}", flush=True)
        return throughput

    calibration_samples = 2 * len(candidates) * max(candidates)  # a warm-up and one round each
    calibration = None
    if images:
        # Both calibrate and check text-to-image requests, whose shapes an edit's are not.
        sections = tuple(section for section in sections if section not in ("calibration", "kernels"))
        skipped.append("calibration and batch-invariant kernels (they sample text-to-image requests)")
    if "calibration" not in sections:
        if calibrated:
            family.micro_batching = MicroBatching(calibrated["micro_batch_chosen"], decode_default=calibrated["decode_batch_chosen"])
    elif budget.allows(calibration_samples * seconds_per_sample * CALIBRATION_SAMPLE_COST):
        calibration = calibrate(family, size, size, candidates, guidance, repeats=1)
        family.micro_batching = MicroBatching(calibration.chosen, decode_default=calibration.chosen_for_decode)
        print(f"{name}: calibration picked {calibration.chosen} rows, {calibration.chosen_for_decode} images", flush=True)
    else:
        skipped.append("calibration (the batch sizes run in calls of the group)")
    padding = family.micro_batching
    # Batch-invariant kernels (rollout/kernels.py): do they keep a sample's bits on this device, and
    # what do they cost against padding? Checked before the batch sizes (a correctness finding is
    # worth more than the largest batch), measured after them, and only where they hold.
    kernels_mode = MicroBatching(padding.default, invariance=BatchInvariance.KERNELS)
    kernels = {}
    if "kernels" in sections:
        if budget.allows(3 * GROUP * seconds_per_sample * KERNELS_SAMPLE_COST):
            family.micro_batching = kernels_mode
            invariance = check_batch_invariance(family, size, size, guidance)
            kernels = {"velocity_difference": invariance.velocity_difference, "image_difference": invariance.image_difference}
            if invariance.holds:
                kernels["replay_max_abs_dlogp"] = replay_difference(family, rollout())
            print(f"{name}: batch-invariant kernels: {kernels}", flush=True)
            family.micro_batching = padding
        else:
            skipped.append("batch-invariant kernels")
    throughput = throughput_by_batch_size() if "batch-sizes" in sections else {}
    if "replay_max_abs_dlogp" in kernels and "batch-sizes" in sections:
        family.micro_batching = kernels_mode
        kernels["throughput_by_batch_size"] = throughput_by_batch_size(KERNELS_SAMPLE_COST)
    if "fp32-path" in sections:
        # The same weights in fp32, where the ODE path and `pipeline(...)` compute the same thing
        # (bit for bit on the tiny copies on the CPU): what separates them in bf16 is the
        # pipeline's bf16 latents, not another path. Last: the cast doubles the weights' memory.
        if budget.allows(2 * FP32_PATH_SAMPLES * seconds_per_sample * 4):
            family = record.family(family.pipe.to(torch.float32))
            family.micro_batching = MicroBatching(FP32_PATH_SAMPLES * rows_per_sample(family, resolve_options(family, options)))
            findings["fp32_ode_vs_pipeline_max_abs_latent_diff"], findings["fp32_latent_abs_max"] = ode_distance(FP32_PATH_SAMPLES)
            print(f"{name}: fp32 ODE path against the pipeline: {findings['fp32_ode_vs_pipeline_max_abs_latent_diff']}", flush=True)
        else:
            skipped.append("the fp32 path")
    return {
        "family": name,
        "transformer_parameters": parameters,
        "dtype": "bfloat16",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "size": size,
        "steps": steps,
        "group": GROUP,
        "guidance": guidance,
        **findings,
        **(
            {
                "micro_batch_denoising_seconds_per_sample": calibration.denoising_seconds_per_sample,
                "micro_batch_decode_seconds_per_sample": calibration.decode_seconds_per_sample,
                "micro_batch_load": calibration.load,
                "micro_batch_denoising_seconds_for_load": calibration.denoising_seconds_for_load,
                "micro_batch_decode_seconds_for_load": calibration.decode_seconds_for_load,
                "micro_batch_chosen": calibration.chosen,
                "decode_batch_chosen": calibration.chosen_for_decode,
            }
            if calibration
            else {}
        ),
        "throughput_by_batch_size": throughput,
        "batch_invariant_kernels": kernels,
        "skipped": skipped,
    }


def check_video_family(name: str, tiny_dir: Path, tiny: bool, device: str) -> dict:
    """Wan2.1-T2V-1.3B at 480x832, 33 frames, 10 steps (the tiny copy: 32x48, 5 frames, 2 steps),
    CFG 5: a group of two videos, one a transformer call, rollout against `pipeline(...)` with its
    scheduler swapped for the rollout's Euler one; peak memory; the bf16 replay difference."""
    record = CHECKED[name]
    guidance = dict(record.trained)
    family = loaded(record, tiny_dir, tiny, device)
    height, width, frames, steps = (32, 48, 5, 2) if tiny else (480, 832, 33, 10)
    family.micro_batching = MicroBatching(1)
    videos = 2
    options = SamplingOptions(num_inference_steps=steps, height=height, width=width, num_frames=frames, **guidance)
    # The pipeline samples with the rollout's Euler scheduler (its own copy: set_timesteps mutates it).
    family.pipe.scheduler = type(family.scheduler).from_config(family.scheduler.config)

    def rollout():
        return sample(family, [PROMPT] * videos, list(range(videos)), options)

    def plain_pipeline():
        with torch.no_grad():
            return family.pipe(
                prompt=[PROMPT] * videos, height=height, width=width, num_frames=frames, num_inference_steps=steps,
                generator=[torch.Generator("cpu").manual_seed(s) for s in range(videos)], output_type="pt", **guidance,
            ).frames  # fmt: skip

    rollout()  # warm-up
    plain_pipeline()
    runs = {"rollout": [], "pipeline": []}
    for _ in range(2):
        batch, seconds, rollout_peak = measured(device, rollout)
        runs["rollout"].append(seconds)
        _, seconds, pipeline_peak = measured(device, plain_pipeline)
        runs["pipeline"].append(seconds)
    rates = {which: videos / min(seconds) for which, seconds in runs.items()}
    return {
        "family": name,
        "transformer_parameters": sum(p.numel() for p in family.transformer.parameters()),
        "dtype": "bfloat16",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "size": [height, width],
        "num_frames": frames,
        "steps": steps,
        "videos": videos,
        "guidance": guidance,
        "rollout_videos_per_s": rates["rollout"],
        "pipeline_videos_per_s": rates["pipeline"],
        "rollout_over_pipeline": rates["rollout"] / rates["pipeline"],
        "rollout_seconds": runs["rollout"],
        "pipeline_seconds": runs["pipeline"],
        "rollout_peak_memory_mb": rollout_peak,
        "pipeline_peak_memory_mb": pipeline_peak,
        "replay_max_abs_dlogp": replay_difference(family, batch),
        "log_probs_finite": all(bool(torch.isfinite(s.log_probs).all()) for s in batch.samples),
    }


def check_speed(name: str, tiny_dir: Path, tiny: bool, device: str, budget: Budget) -> dict:
    """Issue 49's measurement: ms per denoising step of the rollout (SDE, every latent and log-prob
    kept) in each way it can keep a sample's bits, against `pipeline(...)` eager and with its
    transformer under `torch.compile`, at `SPEED_RUNS`' size, steps and batch sizes, and each way's
    replay difference (a way is exact only where it is 0). The ways: padding in a call of the whole
    batch (as the pipeline calls it), the batch-invariant kernels, and padding with each pinned
    attention kernel this device has."""
    record = CHECKED[name]
    guidance = dict(record.trained)
    family = loaded(record, tiny_dir, tiny, device)
    size, steps, batch_sizes = TINY_SPEED_RUN if tiny else SPEED_RUNS[name]
    options = SamplingOptions(num_inference_steps=steps, height=size, width=size, **guidance)
    rows = rows_per_sample(family, resolve_options(family, options))
    ways = {"padding": (BatchInvariance.PADDING, AttentionBackend.DEFAULT), "kernels": (BatchInvariance.KERNELS, AttentionBackend.DEFAULT)}
    unavailable = {}
    for attention in (AttentionBackend.FLASH, AttentionBackend.EFFICIENT, AttentionBackend.CUDNN):
        try:
            ways[f"padding, {attention.value} attention"] = (BatchInvariance.PADDING, AttentionBackend.checked(attention.value, device, torch.bfloat16))
        except ModelLoadError as error:
            unavailable[attention.value] = error.reason

    def rollout(samples: int):
        return sample_tree(family, [TreeRoot(PROMPT, "", seed) for seed in range(samples)], options).batch

    def pipeline(samples: int):
        with torch.no_grad():
            return family.pipe(
                prompt=[PROMPT] * samples, height=size, width=size, num_inference_steps=steps,
                generator=[torch.Generator("cpu").manual_seed(s) for s in range(samples)], output_type="pt", **guidance,
            ).images  # fmt: skip

    def ms_per_step(fn, samples: int) -> tuple[object, float]:
        fn(samples)  # warm-up: kernels, allocator, autotuning at this shape
        result, seconds, _ = measured(device, lambda: fn(samples))
        return result, 1e3 * seconds / steps

    by_batch_size, skipped = {}, []
    for samples in batch_sizes:
        _, eager_ms = ms_per_step(pipeline, samples)
        found = {"pipeline_eager_ms_per_step": eager_ms}
        estimate_s = 2 * steps * eager_ms / 1e3  # a warm-up and a timed call of one path
        for way, (invariance, attention) in ways.items():
            if not budget.allows(2 * estimate_s):
                skipped.append(f"batch size {samples}: {way}")
                continue
            family.micro_batching, family.attention = MicroBatching(samples * rows, invariance=invariance), attention
            batch, rollout_ms = ms_per_step(rollout, samples)
            found[way] = {
                "ms_per_step": rollout_ms,
                "speed_over_pipeline_eager": eager_ms / rollout_ms,
                "replay_max_abs_dlogp": replay_difference(family, batch),
            }
            print(f"{name} B={samples} {way}: {found[way]}", flush=True)
        family.micro_batching, family.attention = MicroBatching(samples * rows), AttentionBackend.DEFAULT
        if device != "cuda":
            skipped.append(f"batch size {samples}: the compiled pipeline (CUDA only here; benchmarks.compiled measures inductor on the CPU)")
        elif budget.allows(COMPILE_SECONDS + estimate_s):
            eager_transformer = family.pipe.transformer
            family.pipe.transformer = torch.compile(eager_transformer)
            try:
                compiling = time.perf_counter()
                pipeline(samples)
                found["pipeline_compile_seconds"] = time.perf_counter() - compiling
                _, found["pipeline_compiled_ms_per_step"] = ms_per_step(pipeline, samples)
            finally:
                family.pipe.transformer = eager_transformer
            for way in ways:
                if way in found:
                    found[way]["speed_over_pipeline_compiled"] = found["pipeline_compiled_ms_per_step"] / found[way]["ms_per_step"]
        else:
            skipped.append(f"batch size {samples}: the compiled pipeline")
        by_batch_size[samples] = found
    return {
        "family": name,
        "section": "speed",
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "size": size,
        "steps": steps,
        "guidance": guidance,
        "attention_unavailable": unavailable,
        "by_batch_size": by_batch_size,
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    image_models = [name for name, record in CHECKED.items() if not record.video]
    parser.add_argument("--families", nargs="+", choices=sorted(CHECKED), default=image_models)
    parser.add_argument("--tiny", action="store_true", help="tiny copies on the CPU: checks the script itself")
    parser.add_argument("--out", type=Path, help="write the findings here as JSON")
    parser.add_argument("--budget-s", type=float, help="wall seconds for the whole run; none: no limit")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS, help="what to run for an image family")
    parser.add_argument("--batch-sizes", nargs="+", type=int, help=f"default: {BATCH_SIZES}")
    parser.add_argument(
        "--calibrated", type=Path, help="an earlier run's findings: without the calibration section, its sizes are used"
    )
    parser.add_argument("--weight-transfer-gib", type=float, default=0, help="first, weight transfer with this many GiB")
    parser.add_argument("--speed", action="store_true", help="issue 49's speed check (check_speed) instead of the sections")
    args = parser.parse_args()

    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    size, steps = (64, 3) if args.tiny else (512, 10)
    # The tiny copies check the script, not the speed: fewer sizes.
    candidates, batch_sizes = ((1, 2), (1, 8)) if args.tiny else (MICRO_BATCH_CANDIDATES, BATCH_SIZES)
    batch_sizes = tuple(args.batch_sizes or batch_sizes)
    calibrated = {found["family"]: found for found in json.loads(args.calibrated.read_text())} if args.calibrated else {}
    findings = []
    budget = Budget(args.budget_s)
    if args.weight_transfer_gib:
        findings.append(check_weight_transfer(int(args.weight_transfer_gib * 2**30) // 2 * 2, device))
        print(json.dumps(findings[-1]), flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for position, name in enumerate(args.families):
            record = CHECKED[name]
            weights_left = sum(CHECKED[later].gpu_check.budget_weight for later in args.families[position:])
            share = budget.share(record.gpu_check.budget_weight / weights_left)
            started = time.perf_counter()
            try:
                if not share.allows(MIN_FAMILY_SECONDS):
                    findings.append({"family": name, "skipped": ["all: out of time"]})
                elif args.speed:
                    findings.append(check_speed(name, record.build(Path(scratch) / name), args.tiny, device, share))
                elif record.video:
                    findings.append(check_video_family(name, record.build(Path(scratch) / name), args.tiny, device))
                else:
                    tiny_dir = record.build(Path(scratch) / name)
                    findings.append(
                        check_family(
                            name, tiny_dir, args.tiny, device, size, steps, candidates, batch_sizes, share,
                            tuple(args.sections), calibrated.get(name),
                        )  # fmt: skip
                    )
            except Exception:  # the next family's figures are worth the rest of the lease
                findings.append({"family": name, "error": traceback.format_exc(limit=-8)})
            findings[-1]["seconds"] = time.perf_counter() - started
            print(json.dumps(findings[-1]), flush=True)
            if args.out:  # after each family, so a run cut short keeps what it measured
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(findings, indent=2) + "\n")
            if device == "cuda":
                torch.cuda.empty_cache()
    if any("error" in found for found in findings):
        sys.exit(1)


if __name__ == "__main__":
    main()
