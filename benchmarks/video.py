"""Video rollouts on a tiny Wan2.1 copy: what a response weighs, and what sampling holds in memory.

    .venv/bin/python -m benchmarks.video

1. Bytes per sample of the response rows as `/rollout/generate` sends them (msgpack), for the
   whole trajectory with debug tensors against a 2-step SDE window that keeps only its latents.
   Beside them, `SamplingOptions.kept_bytes_per_sample` (the tensors a worker returns, which the
   server's check against `limits.max_response_bytes` counts as JSON encodes them:
   `rollout.plan.most_response_bytes_per_row`), here and at Wan2.1's real size.
2. Peak resident memory above the loaded model while sampling 1 and 8 videos with the window, each
   call in a fresh process: the latents and the VAE's work are one micro-batch's, whatever the
   request, so the peak should not grow with the videos beyond what is kept.

3. The VAE decoding one video of 480 x 832 pixels, with and without the VAE's own tiling (on by
   default for video families, `model.vae_tiling`): peak resident memory, time, and how far the
   tiled frames are from the untiled ones.
4. A worker's result crossing Ray's object store at Wan2.1's real size: a batch of 480 x 832,
   81-frame videos (random values: transport does not read them) returned by a task and taken by
   `ray.get`, against the same tensors returned as torch tensors (which Ray pickles in band). Zero
   copy shows as a `ray.get` whose time and resident memory do not grow with the bytes.

`--strip PATH` also draws one sampled video's frames side by side (docs/video_frames.png).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import tempfile
import time
from pathlib import Path

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from benchmarks.throughput import PeakResidentMemory
from rollout.codec import to_msgpack
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.plan import RequestLimits, plan_rollout
from rollout.rows import response_rows
from rollout.sampler import sample
from rollout.schedule import ScheduleSnapshot, timesteps_as_they_are
from rollout.schema import RolloutRequest
from rollout.testing.builders import build_tiny_wan21
from rollout.trajectory import RolloutBatch, SampleTrajectory
from rollout.video import frames_as_uint8

HEIGHT, WIDTH, FRAMES, STEPS = 128, 192, 17, 10
TEXT_LENGTH = 32
WINDOW = {"rollout_sde_step_indices": [4, 5], "rollout_return_step_indices": [4, 5, 6], "rollout_debug_mode": False}
FULL = {"rollout_return_dit_trajectory": True, "rollout_debug_mode": True}
# Wan2.1-T2V at its published size: 480 x 832, 81 frames, 50 steps, latents [16, 21, 60, 104].
REAL = {"latent_shape": (16, 21, 60, 104), "height": 480, "width": 832, "num_frames": 81, "steps": 50}


def _request(outputs: int, fields: dict) -> RolloutRequest:
    return RolloutRequest(
        prompt="a cat sitting on a red chair", num_outputs_per_prompt=outputs, num_inference_steps=STEPS,
        height=HEIGHT, width=WIDTH, num_frames=FRAMES, seed=0, **fields,
    )  # fmt: skip


def _rollout(pipeline, request: RolloutRequest):
    plan = plan_rollout(request, RequestLimits())
    return plan, sample(pipeline, plan.prompts, plan.seeds, plan.options, negative_prompts=plan.negative_prompts)


def response_bytes(path: Path) -> dict[str, tuple[int, int]]:
    """(encoded row bytes, kept_bytes_per_sample) per sample, for the full trajectory and the window."""
    pipeline = load_pipeline(None, path, device="cpu", max_sequence_length=TEXT_LENGTH)
    latent_shape = pipeline.latent_shape(HEIGHT, WIDTH, FRAMES)
    figures = {}
    for name, fields in (("full trajectory, debug tensors", FULL), ("2-step window", WINDOW)):
        plan, batch = _rollout(pipeline, _request(2, fields))
        rows = response_rows(plan, batch, inference_time_s=0.0)
        figures[name] = (len(to_msgpack(rows)) // len(rows), batch.options.kept_bytes_per_sample(latent_shape))
    return figures


def peak_of(path: str, videos: int) -> int:
    """Peak resident memory (bytes) of one rollout of `videos` videos, in this fresh process."""
    pipeline = load_pipeline(None, path, device="cpu", max_sequence_length=TEXT_LENGTH)
    request = _request(videos, WINDOW)
    _rollout(pipeline, _request(1, WINDOW))  # warm-up: the first call's allocations are not the request's
    with PeakResidentMemory() as memory:
        _rollout(pipeline, request)
    return memory.peak_bytes


def decode_of(path: str, tiling: bool) -> tuple[int, float, torch.Tensor]:
    """(peak resident memory in bytes, seconds, frames) of decoding one 480 x 832, 17-frame video,
    in this fresh process."""
    pipeline = load_pipeline(None, path, device="cpu", vae_tiling=tiling)
    latents = torch.randn(1, *pipeline.latent_shape(REAL["height"], REAL["width"], FRAMES), generator=torch.Generator().manual_seed(0))
    pipeline.decode(latents[:, :, :1])  # warm-up
    with PeakResidentMemory() as memory:
        start = time.perf_counter()
        frames = pipeline.decode(latents)
        seconds = time.perf_counter() - start
    return memory.peak_bytes, seconds, frames


def wan_sized_batch(videos: int, kept_steps: tuple[int, ...]) -> RolloutBatch:
    """`videos` samples of Wan2.1's real size keeping the latents of `kept_steps`, each field's
    tensors consecutive rows of one buffer, as the sampler writes them."""
    steps, shape = REAL["steps"], REAL["latent_shape"]
    schedule = ScheduleSnapshot.from_scheduler(
        FlowMatchEulerDiscreteScheduler(shift=3.0), steps, model_timesteps=timesteps_as_they_are
    )
    options = SamplingOptions(
        num_inference_steps=steps, height=REAL["height"], width=REAL["width"], num_frames=REAL["num_frames"],
        return_step_indices=kept_steps,
    )  # fmt: skip
    images = torch.rand(videos, 3, REAL["num_frames"], REAL["height"], REAL["width"])
    latents = torch.randn(videos, len(kept_steps), *shape)
    final_latents = torch.randn(videos, *shape)
    log_probs = torch.randn(videos, steps)
    step_indices = torch.tensor(kept_steps).repeat(videos, 1)
    samples = [
        SampleTrajectory(
            schedule=schedule, prompt="a cat", negative_prompt="", seed=i, image=images[i], final_latents=final_latents[i],
            log_probs=log_probs[i], latents=latents[i], latent_step_indices=step_indices[i],
        )  # fmt: skip
        for i in range(videos)
    ]
    return RolloutBatch(schedule=schedule, options=options, model="wan", samples=samples)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def object_store_transport(cases: list[tuple[str, int, tuple[int, ...]]]) -> list[tuple[str, int, dict]]:
    """For each (name, videos, kept steps): the batch's bytes and, for the batch as the worker
    returns it and for its tensors as plain torch tensors, `ray.get`'s seconds and the resident
    memory it added, then the seconds to read every byte once."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=1)
    def produce(videos: int, kept_steps: tuple[int, ...], as_torch: bool):
        batch = wan_sized_batch(videos, kept_steps)
        return [s.tensors() for s in batch.samples] if as_torch else batch

    def tensors_of(value) -> list[torch.Tensor]:
        return [t for s in value.samples for t in s.tensors().values()] if isinstance(value, RolloutBatch) else [t for d in value for t in d.values()]

    figures = []
    try:
        for name, videos, kept_steps in cases:
            measured = {}
            for as_torch in (False, True):
                ref = produce.remote(videos, kept_steps, as_torch)
                ray.wait([ref], fetch_local=False)
                before = resident_bytes()
                start = time.perf_counter()
                value = ray.get(ref)
                get_s = time.perf_counter() - start
                added = resident_bytes() - before
                tensors = tensors_of(value)
                start = time.perf_counter()
                for tensor in tensors:
                    tensor.sum()
                read_s = time.perf_counter() - start
                measured["torch" if as_torch else "batch"] = (get_s, added, read_s)
                size = sum(t.nbytes for t in tensors)
                del value, tensors, ref
            figures.append((name, size, measured))
    finally:
        ray.shutdown()
    return figures


def frame_strip(path: Path, output: Path) -> None:
    """One video's frames, left to right, as a PNG."""
    from PIL import Image

    pipeline = load_pipeline(None, path, device="cpu", max_sequence_length=TEXT_LENGTH)
    _, batch = _rollout(pipeline, _request(1, {"rollout": False}))
    frames = frames_as_uint8(batch.samples[0].image)  # [3, F, H, W]
    strip = frames.permute(2, 1, 3, 0).reshape(HEIGHT, FRAMES * WIDTH, 3)  # the frames side by side
    Image.fromarray(strip.numpy()).save(output)
    print(f"wrote {output}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--videos", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--strip", type=Path, help="also draw one video's frames into this PNG")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        path = build_tiny_wan21(Path(scratch) / "wan21")
        if args.strip:
            frame_strip(path, args.strip)
        sizes = response_bytes(path)
        spawn = multiprocessing.get_context("spawn")
        peaks, decodes = {}, {}
        for videos in args.videos:
            with spawn.Pool(1) as pool:
                peaks[videos] = pool.apply(peak_of, (str(path), videos))
        for tiling in (False, True):
            with spawn.Pool(1) as pool:
                decodes[tiling] = pool.apply(decode_of, (str(path), tiling))
    window_steps = (20, 21, 22)
    transport = object_store_transport([
        ("1 video, 2-step window", 1, window_steps),
        ("4 videos, 2-step window", 4, window_steps),
        ("1 video, whole trajectory", 1, tuple(range(REAL["steps"] + 1))),
    ])  # fmt: skip
    print(f"Tiny Wan2.1, {HEIGHT} x {WIDTH}, {FRAMES} frames, {STEPS} steps, SDE, 2 samples a request:")
    print()
    print("| what is returned | response bytes per sample (msgpack) | kept_bytes_per_sample |")
    print("|---|---|---|")
    for name, (encoded, counted) in sizes.items():
        print(f"| {name} | {encoded / 2**20:.2f} MiB | {counted / 2**20:.2f} MiB |")
    real = SamplingOptions(
        num_inference_steps=REAL["steps"], height=REAL["height"], width=REAL["width"], num_frames=REAL["num_frames"],
        debug=True,
    )  # fmt: skip
    window = SamplingOptions(
        num_inference_steps=REAL["steps"], height=REAL["height"], width=REAL["width"], num_frames=REAL["num_frames"],
        sde_step_indices=(20, 21), return_step_indices=(20, 21, 22),
    )  # fmt: skip
    print()
    print(
        f"Wan2.1 at 480 x 832, 81 frames, 50 steps (latent {math.prod(REAL['latent_shape']) * 4 / 2**20:.1f} MiB), "
        f"kept_bytes_per_sample: whole trajectory with debug tensors "
        f"{real.kept_bytes_per_sample(REAL['latent_shape']) / 2**30:.2f} GiB, 2-step window "
        f"{window.kept_bytes_per_sample(REAL['latent_shape']) / 2**20:.0f} MiB."
    )
    print()
    print("| videos in the request (2-step window) | peak resident memory above the loaded model |")
    print("|---|---|")
    for videos, peak in peaks.items():
        print(f"| {videos} | {peak / 2**20:.0f} MiB |")
    print()
    difference = (decodes[True][2] - decodes[False][2]).abs().max().item()
    print(f"Decoding one 480 x 832, {FRAMES}-frame video with the tiny VAE (tiled frames differ from untiled by at most {difference:.3g}):")
    print()
    print("| VAE | peak resident memory | seconds |")
    print("|---|---|---|")
    for tiling, (peak, seconds, _) in decodes.items():
        print(f"| {'tiled' if tiling else 'untiled'} | {peak / 2**20:.0f} MiB | {seconds:.2f} |")
    print()
    print("A task's result at Wan2.1's real size through Ray's object store (`ray.get`, then reading every byte once):")
    print()
    print("| result | bytes | returned as | `ray.get` seconds | resident memory `ray.get` added | seconds to read it all |")
    print("|---|---|---|---|---|---|")
    for name, size, measured in transport:
        for form, label in (("batch", "`RolloutBatch` (stacked numpy, out of band)"), ("torch", "the same tensors as torch tensors")):
            get_s, added, read_s = measured[form]
            print(f"| {name} | {size / 2**20:.0f} MiB | {label} | {get_s:.3f} | {added / 2**20:.0f} MiB | {read_s:.2f} |")


if __name__ == "__main__":
    main()
