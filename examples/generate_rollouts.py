"""Generates SDE rollouts with the embedded digits model, checks them, and saves an image grid.

    python examples/generate_rollouts.py --output outputs/demo

For each digit it samples `--samples-per-digit` trajectories, scores the images with the
embedded classifier (the reward model), replays the log-probs as a trainer would and checks
that the on-policy PPO ratio is exactly 1.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from PIL import Image

from rollout.models.digit_classifier import DigitClassifier
from rollout.models.digits import DigitFlowPipeline, digit_prompt
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.sampler import sample


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("outputs/demo"))
    parser.add_argument("--samples-per-digit", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    pipeline = DigitFlowPipeline.from_pretrained()
    classifier = DigitClassifier.from_pretrained()
    digits = [d for d in range(10) for _ in range(args.samples_per_digit)]
    prompts = [digit_prompt(d) for d in digits]
    seeds = [args.seed + i for i in range(len(prompts))]
    options = SamplingOptions(num_inference_steps=args.steps, noise_level=args.noise_level)

    start = time.perf_counter()
    batch = sample(pipeline, prompts, seeds, options)
    elapsed = time.perf_counter() - start

    images = torch.stack([s.image for s in batch.samples])
    rewards = classifier.reward(images, torch.tensor(digits))
    correct = (classifier.predict(images) == torch.tensor(digits)).float().mean().item()
    rollout_log_probs = torch.stack([s.log_probs for s in batch.samples])
    replayed = replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples)
    ratio = torch.exp(replayed.log_probs - rollout_log_probs[:, replayed.step_indices])

    args.output.mkdir(parents=True, exist_ok=True)
    grid_path = args.output / "samples.png"
    save_grid(images, columns=args.samples_per_digit, path=grid_path)
    print(f"model: {pipeline.name}, sampler: {options.sde_type.value} (eta {options.noise_level}), {args.steps} steps")
    print(f"samples: {len(prompts)} in {elapsed:.2f} s ({len(prompts) / elapsed:.1f} samples/s)")
    print(f"sigmas[0..3]: {batch.schedule.sigmas[:4].tolist()} ... sigmas[-1]: {batch.schedule.sigmas[-1].item()}")
    print(f"mean log-prob per step: {rollout_log_probs.mean().item():.4f}")
    print(f"reward (classifier probability of the prompted digit): mean {rewards.mean().item():.3f}")
    print(f"classified as the prompted digit: {correct:.1%}")
    print(f"replayed PPO ratio on-policy: min {ratio.min().item()}, max {ratio.max().item()}")
    print(f"image grid: {grid_path} (one row per digit)")
    if not torch.equal(ratio, torch.ones_like(ratio)):
        raise SystemExit("on-policy replay did not reproduce the rollout's log-probs exactly")


if __name__ == "__main__":
    main()
