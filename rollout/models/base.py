"""The small interface every model family implements for the sampler (`RolloutPipeline`), and the
checks and guidance helpers the families share.

A pipeline turns prompts into conditioning, predicts the flow-matching velocity, and decodes
latents into images. It owns one `FlowMatchEulerDiscreteScheduler`, which the sampler only asks
for its schedule (`set_timesteps`); the transitions themselves live in `rollout.transitions`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, Sequence, runtime_checkable

import torch

from rollout.conditioning import BucketedConditioning, Conditioning
from rollout.errors import InvalidRequestError
from rollout.kernels import AttentionBackend, branches_in_one_call
from rollout.micro_batching import MicroBatching
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot

if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler

    from rollout.input_images import InputImage
    from rollout.transitions import HeldFrames


def cfg_scale(options: SamplingOptions) -> float:
    """The weight of a model whose only guidance is classifier-free guidance: SGLang's
    `true_cfg_scale` when given (diffusers' FLUX.1 and Qwen-Image read it as the CFG weight),
    else `guidance_scale`."""
    return options.guidance_scale if options.true_cfg_scale is None else options.true_cfg_scale


@dataclass(frozen=True)
class NegativeBranchRule:
    """When a family runs classifier-free guidance's negative branch, as its diffusers pipeline
    decides: while the options' `scale` (model defaults filled in) is above 1, or, with
    `also_below_one`, anything but 1. Data rather than a method of each family, so that the ingress,
    which loads no model, costs a request by the family's own rule (`rollout.cost.CostFacts`).

    Attributes:
        scale: the option that decides: 'guidance_scale', 'true_cfg_scale', or 'cfg_scale'
            (`cfg_scale`: `true_cfg_scale` when given, else `guidance_scale`); None: never (a
            model whose pipeline has no negative branch).
        also_below_one: a scale below 1 runs the branch too (the embedded model extrapolates
            away from the positive prompt).
    """

    scale: Literal["guidance_scale", "true_cfg_scale", "cfg_scale"] | None
    also_below_one: bool = False

    def runs(self, options: SamplingOptions) -> bool:
        if self.scale is None:  # a model without classifier-free guidance (FLUX.2's pipeline)
            return False
        value = cfg_scale(options) if self.scale == "cfg_scale" else getattr(options, self.scale)
        return value is not None and (value > 1 or (self.also_below_one and value < 1))


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


@dataclass(frozen=True)
class ConditionImageRule:
    """The input images (`image_path`) a model's prompt takes, and how it prepares them.

    Attributes:
        most_per_prompt: the most images one prompt takes; 0: a text-only model.
        least_per_prompt: the fewest (0: a prompt may come without an image).
        preprocessing: how an image is resized before it is encoded, in words (`/rollout/info`).
        most_tokens_per_image: the most transformer tokens one image adds to each of its samples'
            rows, whatever its size (what `rollout.cost` counts for it, before it is resized).
        min_side: the fewest pixels an image's height and width may have, as sent (0: any).
        max_aspect_ratio: the largest ratio of an image's longer side to its shorter, as sent
            (None: any). FLUX.2's pipeline refuses images outside these two (`check_image_input`).
        least_frames: the fewest frames a request whose prompts bring images makes (1: any). A
            model that holds the image as the first latent frame (Wan2.2-TI2V) would sample
            nothing in a video of one latent frame.
    """

    most_per_prompt: int = 0
    least_per_prompt: int = 0
    preprocessing: str | None = None
    most_tokens_per_image: int = 0
    min_side: int = 0
    max_aspect_ratio: float | None = None
    least_frames: int = 1

    def check(self, images: Sequence[Sequence[InputImage]], model: str, num_frames: int) -> None:
        """Raises `InvalidRequestError` naming ``image_path`` (and the prompt's index) unless every
        prompt's images (one sequence per prompt or sample) number what the model takes, or naming
        ``num_frames`` where images come with fewer frames than `least_frames`."""
        if any(images) and num_frames < self.least_frames:
            raise InvalidRequestError(
                "num_frames",
                f"must be at least {self.least_frames} for model {model!r} given an image (the image is the first "
                f"latent frame, held at every step: a shorter video samples nothing), got {num_frames}",
            )
        for i, prompt_images in enumerate(images):
            count = len(prompt_images)
            if self.most_per_prompt == 0 and count:
                raise InvalidRequestError("image_path", f"model {model!r} is text-to-image and takes no input image")
            if not self.least_per_prompt <= count <= self.most_per_prompt:
                raise InvalidRequestError(
                    f"image_path[{i}]",
                    f"model {model!r} takes {self.least_per_prompt} to {self.most_per_prompt} images per prompt, "
                    f"got {count}",
                )
            for image in prompt_images:
                self._check_size(image.height, image.width, i, model)

    def _check_size(self, height: int, width: int, prompt: int, model: str) -> None:
        if min(height, width) < self.min_side:
            raise InvalidRequestError(
                f"image_path[{prompt}]",
                f"model {model!r} takes images of at least {self.min_side} px a side, got {width}x{height}",
            )
        if self.max_aspect_ratio is not None and max(height, width) > self.max_aspect_ratio * min(height, width):
            raise InvalidRequestError(
                f"image_path[{prompt}]",
                f"model {model!r} takes images of aspect ratio at most {self.max_aspect_ratio:g}:1, "
                f"got {width}x{height}",
            )

    def describe(self) -> dict[str, Any]:
        return {
            "most_per_prompt": self.most_per_prompt,
            "least_per_prompt": self.least_per_prompt,
            "preprocessing": self.preprocessing,
            "most_tokens_per_image": self.most_tokens_per_image,
            "min_side": self.min_side,
            "max_aspect_ratio": self.max_aspect_ratio,
            "least_frames": self.least_frames,
        }


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
    # When the negative branch runs; `uses_negative_branch` answers by it.
    negative_branch: NegativeBranchRule
    # The pixels a side of one transformer token covers (the VAE's downsampling times the patch),
    # and the video frames a latent frame after the first stands for (1 for an image model): a
    # sample's tokens, which `rollout.cost.CostFacts` counts without the model.
    token_pixels: int
    frames_per_latent: int
    # The denoisers' `weight_modules` names, in the order `ScheduleSnapshot.model_experts` indexes
    # them: ("transformer",) for a model with one.
    experts: tuple[str, ...]
    # The input images a prompt takes (none for a text-to-image or text-to-video model).
    condition_images: ConditionImageRule
    # The attention kernel every denoiser call runs, in the rollout and in its replay alike.
    attention: AttentionBackend
    # Whether a worker replica measures its micro-batch sizes at start-up unless configured
    # (`rollout.calibration.calibrate_at_start`).
    calibrated_at_start: bool

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
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        options: SamplingOptions,
        images: Sequence[tuple[InputImage, ...]] | None = None,
    ) -> BucketedConditioning:
        """Encodes one prompt (and one negative prompt, and the prompt's input `images`: one tuple
        per sample, None for none) per sample, each distinct prompt and image set once and alone.

        `options` (with the model's defaults filled in) says whether the negative branch runs;
        when it does not, `neg_cond_kwargs` is None. Rows whose tensors differ in shape (a text
        padded to its own length bucket, condition images of another size) go to different
        buckets. Raises `UnknownPromptError` naming ``prompt`` or ``negative_prompt`` for a prompt
        the model cannot condition on, `InvalidRequestError` naming ``image_path`` for images it
        does not take (`condition_images`).
        """
        ...

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        """The bytes of each tensor of one sample's conditioning (its `denoising_env`) for requests
        with `options` (model defaults filled in), whatever its prompt: exact, or an upper bound
        where a prompt's length sets them. What the response-size estimate counts for
        `rollout_return_denoising_env` (`rollout.plan.checked_against_model`), made without
        encoding the request's prompts."""
        ...

    def held_frames(self, conditioning: BucketedConditioning) -> HeldFrames | None:
        """The latent frames each row of `conditioning` (as `encode_prompts` made it, or stacked from
        returned envs) holds at every step instead of sampling them: a video's first frame given
        as an image (`rollout.transitions.HeldFrames`); None for a model that holds none."""
        ...

    def uses_negative_branch(self, options: SamplingOptions) -> bool:
        """Whether requests with `options` (model defaults filled in) run classifier-free guidance's
        negative branch, as the family's diffusers pipeline decides: `negative_branch.runs(options)`."""
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
