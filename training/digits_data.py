"""The training data of the embedded digits models: scikit-learn's handwritten digits at 16x16.

scikit-learn ships 1797 grey-scale 8x8 digits (pixel values 0..16, roughly 180 per class). Both
the flow model (``train_digit_flow.py``) and the classifier (``train_digit_classifier.py``) train
on them after scaling to [0, 1] and a bilinear upsampling to 16x16, the size of
`rollout.models.digits.IMAGE_SIZE`. The classifier holds out a seeded, stratified split to
report an honest accuracy.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from rollout.models.digits import IMAGE_SIZE, NUM_DIGITS


def load_digit_images(size: int = IMAGE_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 scikit-learn digits.

    Returns `images`, float32 of shape `(N, 1, size, size)` with values in [0, 1] (the 8x8
    originals divided by 16 and upsampled bilinearly, ``align_corners=False``), and `labels`,
    int64 of shape `(N,)` with values 0..9.
    """
    from sklearn.datasets import load_digits  # a training-only dependency

    digits = load_digits()
    images = torch.from_numpy(digits.images.astype(np.float32) / 16.0).unsqueeze(1)  # (N, 1, 8, 8)
    if size != images.shape[-1]:
        images = F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False)
    labels = torch.from_numpy(digits.target.astype(np.int64))
    return images.clamp(0, 1).contiguous(), labels


def stratified_split(
    labels: torch.Tensor, held_out_fraction: float = 0.2, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded split of indices into train and held-out sets with the same class proportions.

    `labels` has shape `(N,)`. Returns two sorted int64 index tensors, `train` and `held_out`,
    that partition ``range(N)``; each class contributes ``round(held_out_fraction * count)``
    of its samples to `held_out`.
    """
    generator = torch.Generator().manual_seed(seed)
    train, held_out = [], []
    for digit in range(NUM_DIGITS):
        members = torch.nonzero(labels == digit).squeeze(1)
        members = members[torch.randperm(len(members), generator=generator)]
        n_held_out = round(held_out_fraction * len(members))
        held_out.append(members[:n_held_out])
        train.append(members[n_held_out:])
    return torch.cat(train).sort().values, torch.cat(held_out).sort().values


def load_digit_splits(
    held_out_fraction: float = 0.2, seed: int = 0, size: int = IMAGE_SIZE
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((train_images, train_labels), (held_out_images, held_out_labels))``.

    Images have shape `(n, 1, size, size)` in [0, 1], labels shape `(n,)`; with the defaults
    there are 1438 training and 359 held-out digits.
    """
    images, labels = load_digit_images(size)
    train, held_out = stratified_split(labels, held_out_fraction, seed)
    return (images[train], labels[train]), (images[held_out], labels[held_out])
