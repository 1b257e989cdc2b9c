"""The embedded model's scorers: the digit classifier's belief in the prompted digit, and ink.

`digits` is the probability the packaged classifier (`rollout.models.digit_classifier`) gives
the digit a sample's prompt names: how recognisable the sample is, the guard the GRPO example
watches against reward hacking. `ink` is the mean pixel value (1 is ink), the example's reward:
the classifier already scores 99% on the prompted digit, which leaves no headroom to learn.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.scorers.base import ScoringSample, in_fixed_batches


class DigitProbability:
    """The classifier's probability of each sample's prompted digit, from `(1, 16, 16)` images."""

    group_aware = False

    def __init__(self, weights: str | None = None, micro_batch_size: int = 64):
        # Imported here: the prompt parser's module brings diffusers, seconds of a scorer replica's
        # start that `ink`, in this module too, does without.
        from rollout.models.digit_classifier import DEFAULT_CLASSIFIER_WEIGHTS, DigitClassifier
        from rollout.models.digits import parse_digit_prompt

        self.classifier = DigitClassifier.from_pretrained(weights or DEFAULT_CLASSIFIER_WEIGHTS)
        self.parse_digit_prompt = parse_digit_prompt
        self.micro_batch_size = micro_batch_size

    def score(self, samples: Sequence[ScoringSample]) -> list[float]:
        if not samples:
            return []
        for sample in samples:
            if tuple(sample.image.shape) != (1, 16, 16):
                raise ValueError(f"scores (1, 16, 16) images of the embedded model, got {tuple(sample.image.shape)}")
        images = torch.stack([sample.image.float() for sample in samples])
        digits = torch.tensor([self.parse_digit_prompt(sample.prompt) for sample in samples])
        with torch.no_grad():
            probabilities = in_fixed_batches(images, self.micro_batch_size, lambda rows: self.classifier(rows).softmax(-1))
        return probabilities.gather(1, digits.view(-1, 1)).squeeze(1).tolist()


class Ink:
    """Each sample's mean pixel value in [0, 1] (1 is ink), image or video, computed alone."""

    group_aware = False

    def score(self, samples: Sequence[ScoringSample]) -> list[float]:
        return [sample.image.float().mean().item() for sample in samples]
