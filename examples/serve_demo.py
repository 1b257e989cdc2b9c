"""The main job: serve the embedded model, request rollouts over HTTP, save an image grid.

    python examples/serve_demo.py --output outputs/demo

Starts a local Ray cluster and the rollout application on 127.0.0.1, sends one real
`POST /rollout/generate` request (ten prompts, `--samples-per-digit` samples each, SDE
trajectories), checks that every row carries the same full schedule, scores the images with the
embedded classifier (the reward model), saves them as a PNG grid, prints a summary and shuts
everything down.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path

import ray
import torch
from PIL import Image
from ray import serve

from deployments.app import build_app
from rollout.codec import from_msgpack
from rollout.models.digit_classifier import DigitClassifier
from rollout.models.digits import digit_prompt


def save_grid(images: torch.Tensor, columns: int, path: Path, scale: int = 4, gap: int = 2) -> None:
    """Writes `(N, 1, H, W)` images in [0, 1] as one PNG, `columns` per row, on a grey background."""
    n, _, h, w = images.shape
    rows = -(-n // columns)
    grid = torch.full((rows * (h + gap) + gap, columns * (w + gap) + gap), 0.5)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        top, left = gap + r * (h + gap), gap + c * (w + gap)
        grid[top : top + h, left : left + w] = image[0]
    pixels = (grid * 255).round().to(torch.uint8).numpy()
    height, width = pixels.shape
    Image.fromarray(pixels).resize((width * scale, height * scale), Image.NEAREST).save(path)


def post_rollout(url: str, body: dict) -> list[dict]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", "Accept": "application/msgpack"}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return from_msgpack(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("outputs/demo"))
    parser.add_argument("--samples-per-digit", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    # serve.shutdown() waits on the controller's `graceful_shutdown` until the controller kills
    # itself, by design (ray/serve/_private/controller.py). Calls to the controller are retried
    # forever (max_task_retries=-1), so Ray reports each one cut short to the driver as "(raylet)
    # Task ServeController.graceful_shutdown failed. There are infinite retries remaining...",
    # log_to_driver=False or not. This switch of Ray's (read by every process the cluster starts)
    # drops only such notices of calls that will be retried; a call that fails for good still raises.
    os.environ.setdefault("RAY_enable_output_error_log_if_still_retry", "0")
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        started = time.perf_counter()
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        serve.run(build_app(), name="rollout", route_prefix="/")
        print(f"serving the embedded model on http://127.0.0.1:{args.port} (started in {time.perf_counter() - started:.1f} s)")

        body = {
            "prompt": [digit_prompt(d) for d in range(10)],
            "num_outputs_per_prompt": args.samples_per_digit,
            "num_inference_steps": args.steps,
            "seed": 0,
            "rollout_sde_type": "sde",
            "rollout_debug_mode": False,  # on by default, as in SGLang; the demo reads no debug tensors
            "rollout_return_dit_trajectory": True,
        }
        sent = time.perf_counter()
        rows = post_rollout(f"http://127.0.0.1:{args.port}/rollout/generate", body)
        elapsed = time.perf_counter() - sent
    finally:
        serve.shutdown()
        ray.shutdown()

    sigmas = rows[0]["dit_trajectory"]["sigmas"]
    if not all(torch.equal(row["dit_trajectory"]["sigmas"], sigmas) for row in rows):
        raise SystemExit("rows disagree on the schedule")
    images = torch.stack([row["generated_output"] for row in rows])
    digits = torch.tensor([row["prompt_index"] for row in rows])  # prompt i asks for digit i
    log_probs = torch.stack([row["rollout_log_probs"] for row in rows])
    classifier = DigitClassifier.from_pretrained()
    rewards = classifier.reward(images, digits)
    correct = (classifier.predict(images) == digits).float().mean().item()

    args.output.mkdir(parents=True, exist_ok=True)
    grid_path = args.output / "samples.png"
    save_grid(images, columns=args.samples_per_digit, path=grid_path)
    print(f"POST /rollout/generate: {len(rows)} samples in {elapsed:.2f} s ({len(rows) / elapsed:.1f} samples/s over HTTP)")
    print(f"schedule: {len(sigmas)} sigmas, the same in every row: {sigmas[:3].tolist()} ... {sigmas[-2:].tolist()}")
    print(f"log-probs: {tuple(log_probs.shape)}, mean {log_probs.mean().item():.4f} per step")
    print(f"reward (classifier probability of the prompted digit): mean {rewards.mean().item():.3f}")
    print(f"classified as the prompted digit: {correct:.1%}")
    print(f"image grid: {grid_path} (one row per digit)")


if __name__ == "__main__":
    main()
