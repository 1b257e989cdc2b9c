"""Micro-batching: how many rows the transformer and the VAE take per call, per image size, and
what keeps a sample's bits independent of the others in its call (`rollout.kernels`).

Apart from the models: the app's configuration (`deployments/config.py`, which the ingress imports
without any model library) parses and checks it, and every pipeline serves with one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from rollout.errors import InvalidRequestError
from rollout.kernels import BatchInvariance, kernels_for


def parse_image_size(text: str) -> tuple[int, int] | None:
    """`(height, width)` of a size written `"<height>x<width>"`, as `"1024x1024"`; None if it is not one."""
    height, _, width = text.partition("x")
    return (int(height), int(width)) if height.isdigit() and width.isdigit() else None


def _by_image_size(field_name: str, by_size: Mapping[str, int] | None) -> dict[tuple[int, int], int]:
    sizes = {}
    for key, rows in (by_size or {}).items():
        size = parse_image_size(key)
        if size is None:
            raise InvalidRequestError(field_name, f"keys look like '512x512', got {key!r}")
        sizes[size] = rows
    return sizes


def _calls(rows: int, size: int) -> list[slice]:
    """`rows` in calls of at most `size`, as slices."""
    return [slice(start, min(start + size, rows)) for start in range(0, rows, size)]


def _keyed(by_size: Mapping[tuple[int, int], int]) -> dict[str, int]:
    return {f"{height}x{width}": rows for (height, width), rows in by_size.items()}


@dataclass(frozen=True)
class MicroBatching:
    """How many rows the transformer and images the VAE take per call, per image size, and what
    makes a sample's bits independent of the others in its call (`rollout.kernels`).

    With `BatchInvariance.PADDING` (the default) every call takes exactly the micro-batch's rows:
    the last call is padded, so a lone sample costs a whole micro-batch. With
    `BatchInvariance.KERNELS` a call takes the rows there are, at most the micro-batch, and runs
    under `BatchInvariantKernels`. Either way, larger images need smaller calls to fit in
    memory, hence the sizes per resolution.

    The transformer's sizes count rows: a sample is one row of a call, or two where the family runs
    classifier-free guidance's branches in one call (`RolloutPipeline.batches_guidance_branches`)
    and the request turns guidance on, so such calls take half the samples
    (`rollout.sampler.micro_batch_size`, at least one): a call's cost and memory go with its rows,
    and a request without guidance fills the rows a guided one does.

    The VAE's calls have sizes of their own: an image's bits depend only on the size of the call
    that decodes it, and the two models are cheapest at different sizes (tiny Qwen-Image, 128 px,
    on this project's CPU: the transformer 37% cheaper per sample in calls of 16 than of 4, the VAE
    5%; docs/throughput.md).

    Attributes:
        default: rows per transformer call for any size not in `by_size`.
        by_size: `(height, width)` -> rows per transformer call.
        invariance: padding, or batch-invariant kernels.
        decode_default: images per VAE call for any size not in `decode_by_size`; None: the
            transformer's size for the image size.
        decode_by_size: `(height, width)` -> images per VAE call.
    """

    default: int
    by_size: Mapping[tuple[int, int], int] = field(default_factory=dict)
    invariance: BatchInvariance = BatchInvariance.PADDING
    decode_default: int | None = None
    decode_by_size: Mapping[tuple[int, int], int] = field(default_factory=dict)

    def __post_init__(self):
        decode_default = {} if self.decode_default is None else {"default": self.decode_default}
        for name, sizes in (
            ("micro_batch_size", {"default": self.default, **_keyed(self.by_size)}),
            ("decode_batch_size", {**decode_default, **_keyed(self.decode_by_size)}),
        ):
            for size, rows in sizes.items():
                if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
                    raise InvalidRequestError(name, f"{size}: must be an integer >= 1, got {rows!r}")
        try:
            object.__setattr__(self, "invariance", BatchInvariance(self.invariance))
        except ValueError:
            choices = [member.value for member in BatchInvariance]
            raise InvalidRequestError("batch_invariance", f"must be one of {choices}, got {self.invariance!r}") from None

    @classmethod
    def parse(
        cls,
        default: int,
        by_size: Mapping[str, int] | None = None,
        invariance: BatchInvariance | str = BatchInvariance.PADDING,
        decode_default: int | None = None,
        decode_by_size: Mapping[str, int] | None = None,
    ) -> "MicroBatching":
        """From configuration: `by_size` and `decode_by_size` keyed by ``"<height>x<width>"``, e.g.
        ``{"1024x1024": 2}``."""
        return cls(
            default,
            _by_image_size("micro_batch_sizes", by_size),
            invariance,
            decode_default,
            _by_image_size("decode_batch_sizes", decode_by_size),
        )

    def with_calibrated(self, micro_batch_sizes: Mapping[str, int], decode_batch_sizes: Mapping[str, int]) -> "MicroBatching":
        """These sizes, measured on the device (`rollout.calibration.calibrate_at_start`), where
        the configuration gives none: a size configured for an image size, or a `decode_default`
        for every size, is kept."""
        decode = {} if self.decode_default is not None else _by_image_size("decode_batch_sizes", decode_batch_sizes)
        return dataclasses.replace(
            self,
            by_size={**_by_image_size("micro_batch_sizes", micro_batch_sizes), **self.by_size},
            decode_by_size={**decode, **self.decode_by_size},
        )

    def describe(self) -> dict:
        """As JSON, for `/rollout/info`: `MicroBatching.parse(**described)` is this again, for a
        trainer to replay with the sizes the replicas sample with."""
        return {
            "default": self.default,
            "by_size": _keyed(self.by_size),
            "invariance": self.invariance.value,
            "decode_default": self.decode_default,
            "decode_by_size": _keyed(self.decode_by_size),
        }

    def size_for(self, height: int, width: int) -> int:
        return self.by_size.get((height, width), self.default)

    def decode_size_for(self, height: int, width: int) -> int:
        if (height, width) in self.decode_by_size:
            return self.decode_by_size[height, width]
        return self.size_for(height, width) if self.decode_default is None else self.decode_default

    def calls(self, rows: int, samples_per_call: int) -> list[slice]:
        """The transformer calls that compute `rows` samples, at most `samples_per_call` a call
        (`rollout.sampler.micro_batch_size`), as slices of their rows padded to `padded_rows`
        (padding makes every call a whole micro-batch)."""
        return _calls(self.padded_rows(rows, samples_per_call), samples_per_call)

    def decode_calls(self, rows: int, height: int, width: int) -> list[slice]:
        """The VAE's calls for `rows` images: whole calls of `decode_size_for` with padding; one image
        a call under batch-invariant kernels, whose shape is an image's own with no kernels' help
        (measured here, 16 such calls decode faster than one call of 16 under the kernels: 72
        against 102 ms, SD3)."""
        if self.invariance is BatchInvariance.KERNELS:
            return _calls(rows, 1)
        size = self.decode_size_for(height, width)
        return _calls(rows + -rows % size, size)

    def padded_rows(self, rows: int, samples_per_call: int) -> int:
        """Rows computed for `rows` samples in calls of `samples_per_call`: whole calls with padding,
        `rows` under batch-invariant kernels."""
        if self.invariance is BatchInvariance.KERNELS:
            return rows
        return rows + -rows % samples_per_call

    def kernels(self) -> contextlib.AbstractContextManager:
        """The context every model call runs in (`rollout.kernels.kernels_for`)."""
        return kernels_for(self.invariance)
