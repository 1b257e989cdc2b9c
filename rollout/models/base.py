"""The small interface every model family implements for the sampler.

A pipeline turns prompts into conditioning, predicts the flow-matching velocity, and decodes
latents into images. It owns one `FlowMatchEulerDiscreteScheduler`, which the sampler only asks
for its schedule (`set_timesteps`); the transitions themselves live in `rollout.transitions`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch

from rollout.errors import InvalidRequestError
from rollout.kernels import BatchInvariance, branches_in_one_call, kernels_for
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler


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


def _env_shapes(env: dict[str, Any]) -> tuple:
    """A `denoising_env`'s tensor shapes by part and name: rows of equal shapes share a bucket."""

    def shape_of(value):
        if value is None or isinstance(value, torch.Tensor):
            return None if value is None else tuple(value.shape)
        return tuple((name, tuple(t.shape)) for name, t in value.items())

    return tuple((part, shape_of(value)) for part, value in env.items())


def _map_tensors(parts: dict[str, Any], fn: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, Any]:
    def over(value):
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return fn(value)
        return {name: fn(t) for name, t in value.items()}

    return {name: over(value) for name, value in parts.items()}


def cfg_scale(options: SamplingOptions) -> float:
    """The weight of a model whose only guidance is classifier-free guidance: SGLang's
    `true_cfg_scale` when given (diffusers' FLUX.1 and Qwen-Image read it as the CFG weight),
    else `guidance_scale`."""
    return options.guidance_scale if options.true_cfg_scale is None else options.true_cfg_scale


def batched_cfg_velocity(
    run: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
    x_t: torch.Tensor,
    timestep: torch.Tensor,
    conditioning: Conditioning,
    scale: float,
) -> torch.Tensor:
    """Classifier-free guidance with both branches in one model call on rows [negative; positive],
    as diffusers' SD3 pipeline runs it; `run(x, timestep, kwargs)` is the model's fp32 output."""
    if conditioning.neg_cond_kwargs is None:
        raise ValueError("classifier-free guidance needs the negative branch's conditioning (neg_cond_kwargs)")
    negative, positive = conditioning.neg_cond_kwargs, conditioning.pos_cond_kwargs
    both = {name: torch.cat([negative[name], positive[name]]) for name in positive}
    with branches_in_one_call(2):
        v_uncond, v_cond = run(torch.cat([x_t, x_t]), torch.cat([timestep, timestep]), both).chunk(2)
    return v_uncond + scale * (v_cond - v_uncond)


def check_image_frames(num_frames: int, model: str) -> None:
    """Raises `InvalidRequestError` naming ``num_frames`` unless it is 1: what an image model makes."""
    if num_frames != 1:
        raise InvalidRequestError("num_frames", f"model {model!r} generates images: must be 1, got {num_frames}")


def latent_frame_count(num_frames: int, frames_per_latent: int, model: str) -> int:
    """Latent frames of a causal video VAE that makes `frames_per_latent` frames of each latent frame
    after the first; raises `InvalidRequestError` naming ``num_frames`` unless it is that times k, plus 1."""
    if (num_frames - 1) % frames_per_latent:
        raise InvalidRequestError(
            "num_frames",
            f"must be {frames_per_latent}k + 1 for model {model!r} (its VAE makes {frames_per_latent} frames of "
            f"each latent frame after the first), got {num_frames}",
        )
    return (num_frames - 1) // frames_per_latent + 1


def check_single_denoiser(expert: int) -> None:
    """A model with one denoiser runs every step with it: expert 0."""
    if expert != 0:
        raise ValueError(f"the model has one denoiser (expert 0), not expert {expert}")


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


@dataclass(frozen=True)
class ImageSizeLimits:
    """The heights and widths a model can make, as the model itself bounds them.

    Attributes:
        multiple: every height and width is a multiple of it (the VAE's downsampling times the
            transformer's patch).
        max_size: the largest height and width, in pixels; None where nothing in the model bounds
            them (rotary position embeddings computed for any size).
        bound_by: what in the model sets `max_size`, in words, for the error that names it.
    """

    multiple: int
    max_size: int | None = None
    bound_by: str | None = None

    def check(self, height: int, width: int, model: str) -> None:
        """Raises `InvalidRequestError` naming ``height`` or ``width`` and the limit it breaks."""
        for dimension, value in (("height", height), ("width", width)):
            if value % self.multiple:
                raise InvalidRequestError(
                    dimension, f"must be a multiple of {self.multiple} for model {model!r}, got {value}"
                )
            if self.max_size is not None and value > self.max_size:
                raise InvalidRequestError(
                    dimension, f"must be at most {self.max_size} for model {model!r} ({self.bound_by}), got {value}"
                )

    def describe(self) -> dict[str, Any]:
        return {"multiple_of": self.multiple, "max_size": self.max_size, "max_size_bound_by": self.bound_by}


@runtime_checkable
class RolloutPipeline(Protocol):
    """What the sampler needs from a model. Shapes use B for the batch size."""

    name: str
    scheduler: FlowMatchEulerDiscreteScheduler
    default_guidance_scale: float
    default_height: int
    default_width: int
    default_num_frames: int  # 1 for an image model
    micro_batching: MicroBatching
    # Whether classifier-free guidance runs its negative and positive branches in one transformer
    # call, on rows [negative; positive], as SD3's pipeline does (not FLUX.1's, Qwen-Image's or
    # Wan's, which make a call per branch): such a call holds two rows per sample.
    batches_guidance_branches: bool
    # The denoisers' `weight_modules` names, in the order `ScheduleSnapshot.model_experts` indexes
    # them: ("transformer",) for a model with one.
    experts: tuple[str, ...]

    @property
    def device(self) -> torch.device: ...

    @property
    def weight_modules(self) -> dict[str, torch.nn.Module]:
        """The modules that hold weights, by the names of their checkpoint entries on disk
        (``transformer``, ...): what weight updates, LoRA adapters and checksums address."""
        ...

    @property
    def image_size_limits(self) -> ImageSizeLimits:
        """The sizes the model can make, derived from the model itself (what `latent_shape` checks)."""
        ...

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """Shape of one sample's latents for an image (or `num_frames` frames) of `height` x `width`
        pixels: `(C, H', W')` for an image model, `(C, F', H', W')` for a video model.

        Raises `InvalidRequestError` naming ``height``/``width`` when the model cannot produce it
        (outside `image_size_limits`), or ``num_frames`` for a frame count it cannot make (any
        but 1 on an image model).
        """
        ...

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> ScheduleSnapshot:
        """The schedule of a request of this size (and frame count), from a private copy of the scheduler
        (`ScheduleSnapshot.from_scheduler`, called as the family's diffusers pipeline calls
        `set_timesteps`), with the family's transformer time input."""
        ...

    def check_prompts(self, prompts: Sequence[str], negative_prompts: Sequence[str]) -> None:
        """Raises `UnknownPromptError` naming ``prompt`` or ``negative_prompt`` for a prompt the
        model cannot condition on, without encoding anything (servers check before batching)."""
        ...

    def encode_prompts(
        self, prompts: Sequence[str], negative_prompts: Sequence[str], options: SamplingOptions
    ) -> BucketedConditioning:
        """Encodes one prompt (and one negative prompt) per sample, each alone.

        `options` (with the model's defaults filled in) says whether the negative branch runs;
        when it does not, `neg_cond_kwargs` is None. Rows whose tensors differ in shape (a text
        padded to its own length bucket) go to different buckets. Raises `UnknownPromptError`
        naming ``prompt`` or ``negative_prompt`` for a prompt the model cannot condition on.
        """
        ...

    def uses_negative_branch(self, options: SamplingOptions) -> bool:
        """Whether requests with `options` (model defaults filled in) run classifier-free guidance's
        negative branch, as the family's diffusers pipeline decides."""
        ...

    def predict_velocity(
        self,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning,
        options: SamplingOptions,
        expert: int = 0,
    ) -> torch.Tensor:
        """Velocity `v` such that `x_{t+dt} = x_t + dt * v` is the Euler (ODE) step.

        Args:
            x_t: latents of shape `(B, *latent_shape)`, fp32.
            timestep: the transformer's time input for every row, shape `(B,)`: the
                schedule's `model_timesteps` at this step.
            conditioning: `B` rows of one bucket of what `encode_prompts` made for the same
                `options`.
            options: the request's options with the model's defaults filled in; the model reads
                its guidance from them (`guidance_scale`, `true_cfg_scale`, `guidance_scale_2`).
            expert: which of `experts` runs (`ScheduleSnapshot.expert_at(step)`).

        Returns:
            fp32 tensor of the shape of `x_t`, guidance already applied.
        """
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images of shape `(B, C, H, W)` (videos: `(B, C, F, H, W)`, SGLang's layout), fp32 in
        [0, 1], from latents of shape `(B, *latent_shape)`.

        Each image must not depend on the others in the batch: decode in the calls of
        `micro_batching.decode_calls` (a video alone)."""
        ...
