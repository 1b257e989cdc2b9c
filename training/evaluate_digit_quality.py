"""Measures the embedded model's quality: how often its digits are classified as the prompt.

    python -m training.evaluate_digit_quality --samples-per-digit 20 --steps 20

Samples with the project's own sampler (deterministic ODE by default, the model's default
guidance) and judges each image with the embedded classifier, whose own accuracy on the
held-out digits it reports first.
"""

from __future__ import annotations

import argparse

import torch

from rollout.models.digit_classifier import DigitClassifier
from rollout.models.digits import NUM_DIGITS, DigitFlowPipeline, digit_prompt
from rollout.options import SamplingOptions
from rollout.sampler import sample
from training.digits_data import load_digit_splits
from training.train_digit_classifier import accuracy as classifier_accuracy


def prompted_accuracy(
    pipeline: DigitFlowPipeline,
    classifier: DigitClassifier,
    samples_per_digit: int,
    options: SamplingOptions,
    seed: int = 0,
) -> tuple[float, torch.Tensor]:
    """Fraction of samples classified as their prompted digit, and the per-digit fractions `(10,)`."""
    digits = torch.arange(NUM_DIGITS).repeat_interleave(samples_per_digit)
    prompts = [digit_prompt(int(d)) for d in digits]
    batch = sample(pipeline, prompts, [seed + i for i in range(len(prompts))], options)
    predicted = classifier.predict(torch.stack([s.image for s in batch.samples]))
    correct = (predicted == digits).float()
    return correct.mean().item(), correct.view(NUM_DIGITS, samples_per_digit).mean(dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples-per-digit", type=int, default=20)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sde-type", default="ode", choices=["ode", "sde", "cps"])
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the model's")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    classifier = DigitClassifier.from_pretrained()
    _, (held_out_images, held_out_labels) = load_digit_splits()
    held_out = classifier_accuracy(classifier, held_out_images, held_out_labels)
    print(f"classifier: {held_out:.2%} of {len(held_out_labels)} held-out digits")

    pipeline = DigitFlowPipeline.from_pretrained()
    options = SamplingOptions(num_inference_steps=args.steps, sde_type=args.sde_type, guidance_scale=args.guidance_scale)
    accuracy, per_digit = prompted_accuracy(pipeline, classifier, args.samples_per_digit, options, args.seed)
    guidance = pipeline.default_guidance_scale if args.guidance_scale is None else args.guidance_scale
    print(
        f"{args.sde_type}, {args.steps} steps, guidance {guidance}: {accuracy:.1%} of "
        f"{NUM_DIGITS * args.samples_per_digit} samples classified as the prompted digit"
    )
    print("per digit: " + ", ".join(f"{d}: {a:.0%}" for d, a in enumerate(per_digit.tolist())))


if __name__ == "__main__":
    main()
