"""A small CNN that recognises 16x16 digits: the embedded model's reward model and quality judge.

Trained here by ``training/train_digit_classifier.py`` on the same scikit-learn digits as the
flow model; its weights ship with the package.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

DEFAULT_CLASSIFIER_WEIGHTS = Path(__file__).parent / "weights" / "digit-classifier.safetensors"


class DigitClassifier(nn.Module):
    """Logits over the ten digits for images of shape `(B, 1, 16, 16)` in [0, 1]."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),  # 8x8
            nn.ReLU(),
            nn.Conv2d(32, 64, 3, stride=2, padding=1),  # 4x4
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.head = nn.Linear(64, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))

    @classmethod
    def from_pretrained(cls, path: str | Path = DEFAULT_CLASSIFIER_WEIGHTS) -> "DigitClassifier":
        model = cls()
        weights = {k: v.float() for k, v in load_file(path).items()}
        model.load_state_dict(weights)
        return model.eval().requires_grad_(False)

    def save_pretrained(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v.half().contiguous() for k, v in self.state_dict().items()}, path)

    @torch.no_grad()
    def reward(self, images: torch.Tensor, digits: torch.Tensor) -> torch.Tensor:
        """Probability the classifier gives each image's prompted digit, shape `(B,)`."""
        probs = self(images.float()).softmax(-1)
        return probs.gather(1, digits.view(-1, 1)).squeeze(1)

    @torch.no_grad()
    def predict(self, images: torch.Tensor) -> torch.Tensor:
        return self(images.float()).argmax(-1)
