"""Per-request sampling options, validated once at the library boundary."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rollout.errors import InvalidRequestError, short_repr
from rollout.transitions import LogProbForm, TransitionKind

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingOptions:
    """How to run the denoising loop; shared by every sample of a request.

    Attributes:
        num_inference_steps: T, the number of denoising steps.
        height, width: image (or frame) size in pixels; None takes the model's default.
        num_frames: frames per sample, 1 for an image; None takes the model's default.
        fps: the frame rate of a video; a model whose transformer reads it (LTX-Video's rotary
            time scale) takes its own default for None; the others ignore it.
        guidance_scale: the model's guidance scale (classifier-free guidance, or the distilled
            guidance of a guidance-distilled model); None takes the model's default.
        true_cfg_scale: the classifier-free guidance weight of models that separate it from a
            distilled guidance (SGLang's and diffusers' field); each model says how it uses it.
        guidance_scale_2: the low-noise expert's guidance scale of a two-expert model (Wan2.2's
            `guidance_scale_2`); None takes `guidance_scale`.
        sde_type: the transition used on SDE steps.
        noise_level: eta, the noise level of the SDE/CPS transitions.
        log_prob_form: what the per-step log-probs hold (`LogProbForm`).
        sde_step_indices: the steps that are stochastic; the others are ODE steps and draw no noise.
            None means every step.
        return_step_indices: which latents x_0 .. x_T to keep (x_T, the final latent, is step T).
            None means all T + 1.
        debug: also return per-step velocities, means, noise stds and noise draws.
        return_denoising_env: also return each sample's conditioning tensors.
        resume_step: where a request resumed from returned nodes starts (each root's latent there is
            its `rollout.tree.TreeRoot.resume_latents`): it takes the transitions from it on, and
            its log-probs and debug tensors of the steps before are 0; its generators are advanced
            by the draws those steps make under these options. None: it starts from noise.
    """

    num_inference_steps: int = 20
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    fps: int | None = None
    guidance_scale: float | None = None
    true_cfg_scale: float | None = None
    guidance_scale_2: float | None = None
    sde_type: TransitionKind = TransitionKind.SDE
    noise_level: float = 0.7
    log_prob_form: LogProbForm = LogProbForm.GAUSSIAN
    sde_step_indices: tuple[int, ...] | None = None
    return_step_indices: tuple[int, ...] | None = None
    debug: bool = False
    return_denoising_env: bool = False
    resume_step: int | None = None

    def __post_init__(self):
        steps = self.num_inference_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise InvalidRequestError("num_inference_steps", f"must be an integer >= 1, got {steps!r}")
        sizes = (("height", self.height), ("width", self.width), ("num_frames", self.num_frames), ("fps", self.fps))
        for field, value in sizes:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(field, f"must be a positive integer, got {short_repr(value)}")
        object.__setattr__(self, "sde_type", _as_enum(TransitionKind, self.sde_type, "rollout_sde_type"))
        object.__setattr__(self, "log_prob_form", _as_enum(LogProbForm, self.log_prob_form, "rollout_log_prob_form"))
        eta = _check_finite_non_negative("rollout_noise_level", self.noise_level)
        if self.sde_type is TransitionKind.CPS and eta > 1:
            raise InvalidRequestError(
                "rollout_noise_level", f"must be <= 1 for cps (std = sigma_next * sin(eta * pi / 2)), got {eta!r}"
            )
        for field in ("guidance_scale", "true_cfg_scale", "guidance_scale_2"):
            if getattr(self, field) is not None:
                _check_finite_non_negative(field, getattr(self, field))
        object.__setattr__(
            self, "sde_step_indices", _check_step_indices("rollout_sde_step_indices", self.sde_step_indices, steps - 1)
        )
        object.__setattr__(
            self, "return_step_indices", _check_step_indices("rollout_return_step_indices", self.return_step_indices, steps)
        )
        resume = self.resume_step
        if resume is not None:
            if isinstance(resume, bool) or not isinstance(resume, int) or not 0 <= resume < steps:
                raise InvalidRequestError("rollout_resume_step", f"must be a step in [0, {steps - 1}], got {short_repr(resume)}")
            before = [step for step in self.return_step_indices or () if step < resume]
            if before:
                raise InvalidRequestError(
                    "rollout_return_step_indices",
                    f"steps {before} are before rollout_resume_step {resume}: a resumed request has no latents before it",
                )

    def to_plain(self) -> dict[str, Any]:
        """The options in JSON's and msgpack's types (enums by value, tuples as lists), field by
        field: what a dataset's index and the batch answer hold; `SamplingOptions(**plain)` reads
        them back, checked as any options are."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def for_encoding(self) -> "SamplingOptions":
        """What a prompt's or an input image's encoding may read of these options: the output's size,
        frames and frame rate (a text padded to a bucket of the image's tokens, text ids laid out
        for the latent grid, LTX-Video's rotary time scale, an image resized to the output), the
        rest at their defaults. Encoders are given only this, so it keys their cache
        (`rollout.encoding_cache`)."""
        return SamplingOptions(height=self.height, width=self.width, num_frames=self.num_frames, fps=self.fps)

    def transition_at(self, step: int) -> TransitionKind:
        """The transition of absolute step `step`: SDE steps outside the window run as ODE."""
        if self.sde_step_indices is not None and step not in self.sde_step_indices:
            return TransitionKind.ODE
        return self.sde_type

    def kept_latent_steps(self) -> tuple[int, ...]:
        """Absolute steps whose latents are returned, ascending; T is the final latent."""
        if self.return_step_indices is None:
            return tuple(range(self.resume_step or 0, self.num_inference_steps + 1))
        return self.return_step_indices

    def kept_tensor_bytes(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Bytes of each tensor one sample returns besides its conditioning (`rollout.rows`): its
        output, counted as fp32 RGB frames of the options' size (what a worker returns and the
        ingress holds, even where `rollout_video_dtype: "uint8"` rounds the frames of the HTTP rows
        to a quarter of it), its log-probs, its kept latents with the schedule's labels of
        `dit_trajectory` (counted as int64, the widest), and the debug tensors when asked (a
        velocity, a mean and a noise per step, and the noise stds). From the options (model
        defaults filled in) and the latent shape alone, so a request too large to return is
        refused before it is sampled."""
        latent, steps, kept = math.prod(latent_shape), self.num_inference_steps, len(self.kept_latent_steps())
        tensors = [4 * 3 * self.num_frames * self.height * self.width, 4 * steps]
        if kept:  # timesteps and latent_step_indices [K]; sigmas [T + 1]; the others [T]
            tensors += [4 * kept * latent, *(8 * n for n in (kept, kept, steps + 1, steps, steps, steps))]
        if self.debug:
            tensors += [4 * steps * latent] * 3 + [4 * steps]
        return tuple(tensors)

    def kept_bytes_per_sample(self, latent_shape: tuple[int, ...]) -> int:
        """The total of `kept_tensor_bytes`: the tensors one sample returns, as the worker holds them."""
        return sum(self.kept_tensor_bytes(latent_shape))


def _plain(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def _check_finite_non_negative(field: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise InvalidRequestError(field, f"must be a finite number >= 0, got {short_repr(value)}")
    return value


def _as_enum(enum_type, value, field: str):
    try:
        return enum_type(value)
    except ValueError:
        choices = [member.value for member in enum_type]
        raise InvalidRequestError(field, f"must be one of {choices}, got {short_repr(value)}") from None


def _check_step_indices(field: str, indices, largest: int) -> tuple[int, ...] | None:
    """Validates a step filter and returns it sorted."""
    if indices is None:
        return None
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise InvalidRequestError(field, f"must be a list of integers, got {short_repr(indices)}")
    indices = list(indices)
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int):
            raise InvalidRequestError(field, f"must contain integers, got {index!r}")
        if not 0 <= index <= largest:
            raise InvalidRequestError(field, f"index {index} is out of range [0, {largest}]")
    if len(set(indices)) != len(indices):
        duplicates = sorted(i for i, n in Counter(indices).items() if n > 1)
        raise InvalidRequestError(field, f"contains duplicated indices {duplicates}")
    return tuple(sorted(indices))


def check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise InvalidRequestError("seed", f"must be an integer in [0, {MAX_SEED}], got {seed!r}")
    return seed
