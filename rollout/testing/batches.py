"""Comparing two rollout batches field by field, bit for bit: what crosses a boundary (HTTP, the
object store, a dataset) must come back as it left."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rollout.schedule import ScheduleSnapshot
from rollout.trajectory import RolloutBatch

# A sample's fields that are not tensors, compared with ==.
PLAIN_FIELDS = ("prompt", "negative_prompt", "seed", "weight_version", "branching", "branch_path", "rewards", "advantages")


def assert_same_tensor(a: torch.Tensor, b: torch.Tensor, where: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype} {tuple(a.shape)} != {b.dtype} {tuple(b.shape)}"
    assert torch.equal(a, b), f"{where}: values differ"


def assert_same_values(a: Any, b: Any, where: str) -> None:
    """Nested maps and sequences of tensors and plain values, equal bit for bit (a tuple and a list
    of the same items are the same: a wire has lists only)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: a tensor against {type(b).__name__}"
        assert_same_tensor(a, b, where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_same_values(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: lengths differ"
        for k, (x, y) in enumerate(zip(a, b)):
            assert_same_values(x, y, f"{where}[{k}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_batch(a: RolloutBatch, b: RolloutBatch) -> None:
    """Same model, options, schedule and samples, every tensor's dtype, shape and bits, every
    sample referring to its batch's one schedule."""
    assert (a.model, a.options) == (b.model, b.options)
    for field in dataclasses.fields(ScheduleSnapshot):
        assert_same_values(getattr(a.schedule, field.name), getattr(b.schedule, field.name), f"schedule.{field.name}")
    assert len(a.samples) == len(b.samples)
    for i, (x, y) in enumerate(zip(a.samples, b.samples)):
        assert y.schedule is b.schedule
        for name in PLAIN_FIELDS:
            assert getattr(x, name) == getattr(y, name), f"samples[{i}].{name}: {getattr(x, name)!r} != {getattr(y, name)!r}"
        assert x.tensors().keys() == y.tensors().keys(), f"samples[{i}]: tensor fields differ"
        for name, tensor in x.tensors().items():
            assert_same_tensor(tensor, y.tensors()[name], f"samples[{i}].{name}")
        assert_same_values(x.denoising_env, y.denoising_env, f"samples[{i}].denoising_env")
        assert_same_values(
            [im.pixels for im in x.condition_images], [im.pixels for im in y.condition_images], f"samples[{i}].condition_images"
        )
