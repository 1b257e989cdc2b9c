"""Trains `DigitClassifier`, the embedded model's reward model and quality judge.

Run from the repository root::

    python -m training.train_digit_classifier            # writes the packaged weights

It trains on the 80% training split of the 16x16 scikit-learn digits (`training.digits_data`,
stratified, seed 0) with random shifts of up to one pixel, on the CPU in well under a minute,
and prints the accuracy on the 20% held-out split at the end.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rollout.models.digit_classifier import DEFAULT_CLASSIFIER_WEIGHTS, DigitClassifier
from training.digits_data import load_digit_splits


def random_shift(images: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Shifts each image of `(B, C, H, W)` by up to `max_shift` pixels per axis, filling with 0."""
    if max_shift == 0:
        return images
    b, _, h, w = images.shape
    padded = F.pad(images, (max_shift,) * 4)
    dy = torch.randint(0, 2 * max_shift + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * max_shift + 1, (b,), generator=generator)
    rows = (dy.view(b, 1) + torch.arange(h)).view(b, 1, h, 1).expand(b, images.shape[1], h, w + 2 * max_shift)
    shifted = padded.gather(2, rows)
    cols = (dx.view(b, 1) + torch.arange(w)).view(b, 1, 1, w).expand(b, images.shape[1], h, w)
    return shifted.gather(3, cols)


@torch.no_grad()
def accuracy(model: DigitClassifier, images: torch.Tensor, labels: torch.Tensor) -> float:
    model.eval()
    return (model(images).argmax(-1) == labels).float().mean().item()


def train(epochs: int, seed: int, batch_size: int = 64, lr: float = 3e-3, max_shift: int = 1) -> tuple[DigitClassifier, float]:
    """Returns the trained classifier (in eval mode) and its held-out accuracy."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    (train_images, train_labels), (held_out_images, held_out_labels) = load_digit_splits()
    model = DigitClassifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = -(-len(train_images) // batch_size)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=epochs * steps_per_epoch)
    for epoch in range(epochs):
        model.train()
        order = torch.randperm(len(train_images), generator=generator)
        total_loss = 0.0
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
            images = random_shift(train_images[batch], max_shift, generator)
            loss = F.cross_entropy(model(images), train_labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            total_loss += loss.item() * len(batch)
        if (epoch + 1) % 5 == 0 or epoch + 1 == epochs:
            print(
                f"epoch {epoch + 1:3d}  loss {total_loss / len(order):.4f}  "
                f"held-out accuracy {accuracy(model, held_out_images, held_out_labels):.4f}",
                flush=True,
            )
    return model.eval(), accuracy(model, held_out_images, held_out_labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_CLASSIFIER_WEIGHTS, help="safetensors file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--epochs", type=int, default=60)
    args = parser.parse_args()

    start = time.perf_counter()
    model, held_out_accuracy = train(args.epochs, args.seed)
    model.save_pretrained(args.output)
    # The shipped weights are fp16: report the accuracy of what was written.
    (_, _), (held_out_images, held_out_labels) = load_digit_splits()
    saved_accuracy = accuracy(DigitClassifier.from_pretrained(args.output), held_out_images, held_out_labels)
    print(f"saved {args.output} ({args.output.stat().st_size} bytes) in {time.perf_counter() - start:.1f} s")
    print(f"held-out accuracy: {saved_accuracy:.4f} (fp32 before saving: {held_out_accuracy:.4f})")


if __name__ == "__main__":
    main()
