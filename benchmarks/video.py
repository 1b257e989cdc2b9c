"""Video rollouts on a tiny Wan2.1 copy: what a response weighs, and what sampling holds in memory.

    .venv/bin/python -m benchmarks.video

1. Bytes per sample of the response rows as `/rollout/generate` sends them (msgpack), for the
   whole trajectory with debug tensors against a 2-step SDE window that keeps only its latents.
   Beside them, `SamplingOptions.kept_bytes_per_sample` (the figure the server checks against
   `limits.max_response_bytes` before sampling), here and at Wan2.1's real size.
2. Peak resident memory above the loaded model while sampling 1 and 8 videos with the window, each
   call in a fresh process: the latents and the VAE's work are one micro-batch's, whatever the
   request, so the peak should not grow with the videos beyond what is kept.

`--strip PATH` also draws one sampled video's frames side by side (docs/video_frames.png).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import tempfile
from pathlib import Path

from benchmarks.throughput import PeakResidentMemory
from rollout.codec import to_msgpack
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.plan import RequestLimits, plan_rollout
from rollout.rows import response_rows
from rollout.sampler import sample
from rollout.schema import RolloutRequest
from rollout.tiny_families import build_tiny_wan21
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
        peaks = {}
        for videos in args.videos:
            with spawn.Pool(1) as pool:
                peaks[videos] = pool.apply(peak_of, (str(path), videos))
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


if __name__ == "__main__":
    main()
