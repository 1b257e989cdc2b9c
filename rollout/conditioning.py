"""A batch's conditioning: the transformer's per-sample inputs besides the latents and the time.

A pipeline's `encode_prompts` makes it, the sampler runs it through the model in buckets of rows of
equal shapes, and every sample's row of it goes back to the trainer as its `denoising_env`
(SGLang's layout), from which a replay stacks the batch again.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass(frozen=True, kw_only=True)
class Conditioning:
    """The transformer's per-sample inputs besides the latents and the time, each tensor `(B, ...)`.

    Laid out as SGLang's `denoising_env`, which is how a trainer gets them back to replay the
    model calls: `pos_cond_kwargs` and `neg_cond_kwargs` are keyword arguments of the
    transformer's forward for the positive and the negative (classifier-free guidance) branch,
    `image_kwargs` those of an image input, `guidance` a guidance-distilled model's guidance
    input. A part the model does not use is None (`neg_cond_kwargs` when it runs without a
    negative branch). Everything in here belongs to one sample per row; per-request data never
    goes in here.
    """

    image_kwargs: dict[str, torch.Tensor] | None = None
    pos_cond_kwargs: dict[str, torch.Tensor]
    neg_cond_kwargs: dict[str, torch.Tensor] | None = None
    guidance: torch.Tensor | None = None

    def __post_init__(self):
        sizes = {len(t) for t in self._tensors()}
        if len(sizes) > 1:
            raise ValueError(f"conditioning tensors disagree on the batch size: {sorted(sizes)}")

    def _tensors(self) -> list[torch.Tensor]:
        kwargs = (self.image_kwargs, self.pos_cond_kwargs, self.neg_cond_kwargs)
        guidance = [] if self.guidance is None else [self.guidance]
        return [t for part in kwargs if part for t in part.values()] + guidance

    def __len__(self) -> int:
        tensors = self._tensors()
        return tensors[0].shape[0] if tensors else 0

    def row_bytes(self) -> tuple[int, ...]:
        """The bytes of each tensor of one row (`row`'s map: every row's tensors have the same shapes)."""
        return tuple(t.nbytes // len(t) for t in self._tensors())

    def parts(self) -> dict[str, Any]:
        """The four parts by name, in SGLang's order."""
        return {part.name: getattr(self, part.name) for part in dataclasses.fields(self)}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Conditioning":
        """The same layout with `fn` applied to every tensor."""
        return Conditioning(**_map_tensors(self.parts(), fn))

    def rows(self, index: torch.Tensor | slice) -> "Conditioning":
        return self.map(lambda t: t[index])

    def row(self, i: int) -> dict[str, Any]:
        """Sample `i`'s `denoising_env`: the four parts, tensors without the batch dimension, copied."""
        return _map_tensors(self.parts(), lambda t: t[i].clone())

    @classmethod
    def stack(cls, envs: Sequence[dict[str, Any]]) -> "Conditioning":
        """Inverse of `row`: a batch from per-sample `denoising_env` maps."""

        def stacked(part: str):
            first = envs[0][part]
            if first is None:
                return None
            if isinstance(first, torch.Tensor):
                return torch.stack([env[part] for env in envs])
            return {name: torch.stack([env[part][name] for env in envs]) for name in first}

        return cls(**{part.name: stacked(part.name) for part in dataclasses.fields(cls)})


@dataclass(frozen=True)
class ConditioningBucket:
    """Rows of a batch whose conditioning tensors all have the same shapes.

    Attributes:
        rows: `(n,)` int64, the batch rows the bucket holds, ascending.
        conditioning: their conditioning, one row each in the order of `rows`; rows past `n` are
            padding (`rollout.sampler.pad_buckets` pads each bucket to `MicroBatching.padded_rows`).
    """

    rows: torch.Tensor
    conditioning: Conditioning


@dataclass(frozen=True)
class BucketedConditioning:
    """A batch's conditioning, split into buckets of rows of equal shapes.

    Families that pad every prompt to one fixed length have one bucket. Qwen-Image pads a prompt to
    a length bucket set by its own token count, so rows of one batch can differ in text length;
    the sampler runs each bucket in micro-batches of its own, and a row's bits depend on its own
    prompt's bucket, never on its companions'.
    """

    buckets: tuple[ConditioningBucket, ...]

    @classmethod
    def single(cls, conditioning: Conditioning) -> "BucketedConditioning":
        """All rows in one bucket, in order."""
        return cls((ConditioningBucket(torch.arange(len(conditioning)), conditioning),))

    @classmethod
    def grouped(
        cls, keys: Sequence[Any], conditioning_of: Callable[[list[int]], Conditioning]
    ) -> "BucketedConditioning":
        """One bucket per distinct key (in the order keys first appear), `conditioning_of(rows)` its rows'."""
        rows_by_key: dict[Any, list[int]] = {}
        for row, key in enumerate(keys):
            rows_by_key.setdefault(key, []).append(row)
        return cls(
            tuple(
                ConditioningBucket(torch.tensor(rows, dtype=torch.int64), conditioning_of(rows))
                for rows in rows_by_key.values()
            )
        )

    @classmethod
    def stack(cls, envs: Sequence[dict[str, Any]]) -> "BucketedConditioning":
        """Inverse of `row`: a batch from per-sample `denoising_env` maps, bucketed by their shapes."""
        return cls.grouped([_env_shapes(env) for env in envs], lambda rows: Conditioning.stack([envs[i] for i in rows]))

    def __len__(self) -> int:
        return sum(len(bucket.rows) for bucket in self.buckets)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "BucketedConditioning":
        return BucketedConditioning(tuple(ConditioningBucket(b.rows, b.conditioning.map(fn)) for b in self.buckets))

    def select(self, index: Sequence[int]) -> "BucketedConditioning":
        """A batch whose row j is this batch's row `index[j]` (rows may repeat): a tree's live nodes
        take their root's conditioning. Buckets keep their order; empty ones are left out."""
        position = {}  # this batch's row -> (bucket, position in the bucket)
        for b, bucket in enumerate(self.buckets):
            for p, row in enumerate(bucket.rows.tolist()):
                position[row] = (b, p)
        rows: list[list[int]] = [[] for _ in self.buckets]
        positions: list[list[int]] = [[] for _ in self.buckets]
        for j, row in enumerate(index):
            b, p = position[row]
            rows[b].append(j)
            positions[b].append(p)
        return BucketedConditioning(
            tuple(
                ConditioningBucket(torch.tensor(rows[b], dtype=torch.int64), bucket.conditioning.rows(torch.tensor(positions[b])))
                for b, bucket in enumerate(self.buckets)
                if rows[b]
            )
        )

    def row(self, i: int) -> dict[str, Any]:
        """Batch row `i`'s `denoising_env` (`Conditioning.row`)."""
        for bucket in self.buckets:
            (position,) = (bucket.rows == i).nonzero(as_tuple=True)
            if len(position):
                return bucket.conditioning.row(int(position[0]))
        raise IndexError(f"row {i} of a batch of {len(self)}")


def image_input_key(name: str, tensor: torch.Tensor) -> tuple:
    """What buckets rows by one of their image inputs: its shape and, for position ids (a name
    ending in `_ids`), their values too. A transformer call takes one set of ids for all its rows
    (FLUX's), so rows whose condition images have equally many tokens on different grids (a
    landscape and a portrait) must not share one."""
    if not name.endswith("_ids"):
        return tuple(tensor.shape)
    values = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return (tuple(tensor.shape), hashlib.sha256(values).hexdigest())


def _env_shapes(env: dict[str, Any]) -> tuple:
    """A `denoising_env`'s tensor shapes by part and name (and its image inputs' ids by value,
    `image_input_key`): rows of equal keys share a bucket."""

    def shape_of(value, part):
        if value is None or isinstance(value, torch.Tensor):
            return None if value is None else tuple(value.shape)
        if part == "image_kwargs":
            return tuple((name, image_input_key(name, t)) for name, t in value.items())
        return tuple((name, tuple(t.shape)) for name, t in value.items())

    return tuple((part, shape_of(value, part)) for part, value in env.items())


def _map_tensors(parts: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    def over(value):
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return fn(value)
        return {name: fn(t) for name, t in value.items()}

    return {name: over(value) for name, value in parts.items()}
