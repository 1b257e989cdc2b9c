"""The rollout API's wire types: the request, its limits, its plan, and the per-sample response rows.

The request and the rows are SGLang's diffusion rollout API (0.5.23,
`sglang/multimodal_gen/runtime/entrypoints/post_training/io_struct.py` and `rollout_api.py`), so
a trainer written for it works unchanged; this server's extensions are extra fields beside
SGLang's (README, "Coming from SGLang"). Plain pydantic, no Ray: the HTTP route and the
deployment-handle method both validate with `parse_request`, so a Python dict, a pydantic
object and a JSON body take the same path.

Two kinds of bad request, as in SGLang: a body that does not fit the schema (a wrong type, a
missing prompt, an unknown field) raises `RequestSchemaError` (HTTP 422); a well-typed value
this server cannot serve raises `InvalidRequestError` (HTTP 400).
"""

from __future__ import annotations

import difflib
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.errors import InvalidRequestError, NonFiniteOutputError, RequestSchemaError, clip, short_repr
from rollout.options import MAX_SEED, SamplingOptions
from rollout.trajectory import RolloutBatch, SampleTrajectory
from rollout.transitions import LogProbForm, TransitionKind

# "strict": unknown fields and mistyped values are refused (422). "sglang": SGLang's own
# pydantic behaviour, unknown fields dropped and values coerced where pydantic's lax mode can.
RequestValidation = Literal["strict", "sglang"]


class RolloutRequest(BaseModel):
    """`POST /rollout/generate` body, and the argument of the handle's `generate`.

    SGLang's fields in SGLang's order and with its defaults, then this server's extensions.
    Only types are checked here; values are checked by `plan_rollout`.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str | list[str] = Field(description="One prompt, or (extension) a list of prompts served by one request.")
    negative_prompt: str | list[str] | None = Field(
        None, description="One negative prompt for all prompts, or one per prompt. Default: the model's."
    )
    seed: int | None = Field(
        None, description="Base seed; sample i (prompt-major) uses seed + i. Default: random, returned as `seed`."
    )
    generator_device: str = Field(
        "cuda", description="Accepted as in SGLang; noise always comes from per-sample CPU generators here."
    )
    width: int | None = Field(None, description="Image width in pixels. Default: the model's.")
    height: int | None = Field(None, description="Image height in pixels. Default: the model's.")
    num_inference_steps: int | None = Field(None, description="T, the number of denoising steps.")
    num_outputs_per_prompt: int | None = Field(None, description="Samples per prompt. Default: 1.")
    guidance_scale: float | None = Field(None, description="The model's guidance scale. Default: the model's.")
    true_cfg_scale: float | None = Field(None, description="Classifier-free guidance weight, where the model has one.")
    num_frames: int | None = Field(None, description="Frames per sample: image models take only 1.")
    fps: int | None = Field(None, description="Frame rate of video models; image models ignore it.")
    rollout: bool = Field(True, description="False: evaluation, images only, from the deterministic ODE sampler.")
    rollout_sde_type: str = Field("sde", description="Transition of the stochastic steps: sde, cps or ode.")
    rollout_noise_level: float = Field(0.7, description="eta, the noise level.")
    rollout_log_prob_no_const: bool = Field(
        False, description="Per-step log-probs as -(x_next - mean)^2, SGLang's constant-free form."
    )
    rollout_debug_mode: bool = Field(True, description="Return per-step velocities, means, stds and noises.")
    rollout_return_denoising_env: bool = Field(False, description="Return each sample's conditioning tensors.")
    rollout_return_dit_trajectory: bool = Field(False, description="Return latents, timesteps and sigmas.")
    rollout_sde_step_indices: list[int] | None = Field(None, description="Stochastic steps; others run as ODE.")
    rollout_return_step_indices: list[int] | None = Field(None, description="Latents to return; T is the final one.")
    image_path: list[str] | None = Field(None, description="Input images of image-to-image models.")
    suppress_logs: bool = Field(False, description="Report no `peak_memory_mb`, as SGLang (this server logs no requests).")
    extra_sampling_params: dict[str, Any] | None = Field(
        None, description="Overrides of the fields above, merged as SGLang merges them."
    )
    rollout_log_prob_form: str | None = Field(
        None,
        description="(extension) gaussian, gaussian_no_const or squared_error; "
        "default: squared_error with rollout_log_prob_no_const, else gaussian.",
    )
    weight_version: str | None = Field(
        None, description="(extension) The weights the request requires; a replica serving others refuses it."
    )
    rollout_timeout_s: float | None = Field(
        None,
        gt=0,
        description="(extension) Seconds the request may take; past them it fails (HTTP 504) and its work still "
        "queued is dropped. Default: the app's request_timeout_s.",
    )

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def outputs_per_prompt(self) -> int:
        return 1 if self.num_outputs_per_prompt is None else self.num_outputs_per_prompt


# What `extra_sampling_params` may override: SGLang merges it into the sampling parameters, which
# here are the request's own fields. SGLang keeps the top-level `rollout` whatever it says.
_OVERRIDABLE_FIELDS = set(RolloutRequest.model_fields) - {"prompt", "extra_sampling_params"}


class RequestLimits(BaseModel):
    """What one request may ask for."""

    model_config = ConfigDict(extra="forbid")

    max_prompts_per_request: int = Field(64, ge=1, description="Most prompts in one request.")
    max_outputs_per_prompt: int = Field(64, ge=1, description="Largest `num_outputs_per_prompt`.")
    max_samples_per_request: int = Field(512, ge=1, description="Most samples (prompts x outputs) in one request.")
    max_inference_steps: int = Field(100, ge=1, description="Largest `num_inference_steps`.")
    default_inference_steps: int = Field(20, ge=1, description="`num_inference_steps` when a request gives none.")
    # Finite but huge values make NaN and inf images and log-probs (guidance_scale 1e30 does on
    # the embedded model; rollout_noise_level 30 does, and 5 already grows the latents to 3e4).
    max_guidance_scale: float = Field(
        100.0, gt=0, description="Largest `guidance_scale` and `true_cfg_scale` (common values are 1 to 15)."
    )
    max_noise_level: float = Field(
        2.0, gt=0, description="Largest `rollout_noise_level` (Flow-GRPO uses 0.7; cps takes at most 1 anyway)."
    )
    max_image_size: int = Field(4096, ge=1, description="Largest `height` and `width`, in pixels.")


def unknown_fields(data: dict[Any, Any]) -> list[str]:
    """The keys of a request body that are not request fields."""
    return [str(key) for key in data if key not in RolloutRequest.model_fields]


def parse_request(data: RolloutRequest | dict[str, Any], validation: RequestValidation = "strict") -> RolloutRequest:
    """Validates a request's types and merges its `extra_sampling_params`.

    Raises `RequestSchemaError` naming the first field that does not fit the schema, or
    `InvalidRequestError` for an `extra_sampling_params` key this server cannot honour.
    """
    lenient = validation == "sglang"
    if not isinstance(data, RolloutRequest):
        if not isinstance(data, dict):
            raise RequestSchemaError("body", f"must be a JSON object, got {type(data).__name__}")
        unknown = unknown_fields(data)
        if unknown and lenient:
            data = {key: value for key, value in data.items() if key in RolloutRequest.model_fields}
        elif unknown:
            raise _unknown_fields_error(unknown)
        data = _validate(data, lenient)
    return _merge_extra_sampling_params(data, lenient)


# A body with a million bad items is answered with the first few, each location clipped.
_MAX_REPORTED_PROBLEMS = 10


def _problem(kind: str, loc: list[Any], message: str) -> dict[str, Any]:
    """One entry of FastAPI's `detail`, without the value (FastAPI's would echo it)."""
    loc = [part if isinstance(part, int) else clip(str(part)) for part in loc]
    return {"type": kind, "loc": ["body", *loc], "msg": message}


def _unknown_fields_error(unknown: list[str]) -> RequestSchemaError:
    reason = (
        f"unknown field{_did_you_mean(unknown[0])} "
        "(an app with request_validation: sglang ignores unknown fields, as SGLang does)"
    )
    message = "Extra inputs are not permitted"  # pydantic's and FastAPI's words
    detail = [_problem("extra_forbidden", [name], message) for name in unknown[:_MAX_REPORTED_PROBLEMS]]
    return RequestSchemaError(unknown[0], reason, detail)


def _validate(data: dict[str, Any], lenient: bool, location: tuple[str, ...] = ()) -> RolloutRequest:
    try:
        return RolloutRequest.model_validate(data, strict=not lenient)
    except ValidationError as e:
        raise _schema_error(e, location) from None


def _schema_error(error: ValidationError, location: tuple[str, ...]) -> RequestSchemaError:
    problems = error.errors(include_url=False)
    # The deepest error is the most specific one (a union reports one error per branch).
    first_problem = max(problems, key=lambda problem: len(problem["loc"]))
    # The request is flat: the location is a field name, then union branches (type names,
    # dropped) and list indices (kept).
    name, *rest = first_problem["loc"] or ("body",)
    field = ".".join([*location, str(name)] + [str(part) for part in rest if isinstance(part, int)])
    value = "" if first_problem["type"] == "missing" else f", got {short_repr(first_problem['input'])}"
    detail = [
        _problem(problem["type"], [*location, *problem["loc"]], problem["msg"])
        for problem in problems[:_MAX_REPORTED_PROBLEMS]
    ]
    return RequestSchemaError(field, f"{first_problem['msg']}{value}", detail)


def _merge_extra_sampling_params(request: RolloutRequest, lenient: bool) -> RolloutRequest:
    """The request with its `extra_sampling_params` merged into its fields, as SGLang merges them.

    A key that is not a request field would be one of SGLang's other sampling parameters
    (custom `sigmas`, say), which this server does not implement: refused rather than ignored.
    """
    extras = request.extra_sampling_params
    if not extras:
        return request
    for key, value in extras.items():
        if key not in _OVERRIDABLE_FIELDS:
            raise InvalidRequestError(
                f"extra_sampling_params.{key}",
                f"this server does not support the sampling parameter {short_repr(key)}{_did_you_mean(str(key))}; "
                "it takes overrides of the request's own fields",
            )
        if key == "rollout" and value != request.rollout and not lenient:
            raise InvalidRequestError(
                "extra_sampling_params.rollout",
                "conflicts with the request's `rollout`; SGLang keeps the top-level value (request_validation: sglang)",
            )
    overrides = {key: value for key, value in extras.items() if key != "rollout"}
    merged = {**request.model_dump(exclude={"extra_sampling_params"}), **overrides}
    return _validate(merged, lenient, ("extra_sampling_params",))


# difflib's cutoff (a ratio of 0.6) cannot be met by a name this long, and difflib indexes every
# character of the name it is given: seconds for a megabyte key.
_LONGEST_CLOSE_NAME = 3 * max(map(len, RolloutRequest.model_fields))


def _did_you_mean(name: str) -> str:
    if len(name) > _LONGEST_CLOSE_NAME:
        return ""
    close = difflib.get_close_matches(name, RolloutRequest.model_fields, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


@dataclass(frozen=True)
class SamplingWork:
    """One sampler call's worth of one request's samples: what a worker replica receives."""

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    options: SamplingOptions
    weight_version: str | None = None  # the weights the request requires; None: whichever are served
    deadline: float | None = None  # time.time() past which the work is not worth sampling

    def __len__(self) -> int:
        return len(self.seeds)


@dataclass(frozen=True)
class RolloutPlan:
    """A validated request, fanned out into samples: sample i is prompt i // N, seed `seed + i`."""

    request_id: str
    request: RolloutRequest
    seed: int
    options: SamplingOptions

    @property
    def num_outputs_per_prompt(self) -> int:
        return self.request.outputs_per_prompt

    @property
    def num_samples(self) -> int:
        return len(self.request.prompts()) * self.num_outputs_per_prompt

    def work(self, chunk_size: int, deadline: float | None = None) -> list[SamplingWork]:
        """The request's samples in order, cut into pieces of at most `chunk_size`."""
        per_prompt = self.num_outputs_per_prompt
        prompts = [p for p in self.request.prompts() for _ in range(per_prompt)]
        negatives = [n for n in _negative_prompts(self.request) for _ in range(per_prompt)]
        seeds = [self.seed + i for i in range(self.num_samples)]
        return [
            SamplingWork(
                tuple(prompts[start : start + chunk_size]),
                tuple(negatives[start : start + chunk_size]),
                tuple(seeds[start : start + chunk_size]),
                self.options,
                self.request.weight_version,
                deadline,
            )
            for start in range(0, self.num_samples, chunk_size)
        ]


def _negative_prompts(request: RolloutRequest) -> list[str]:
    prompts = request.prompts()
    if request.negative_prompt is None:
        return [""] * len(prompts)
    if isinstance(request.negative_prompt, str):
        return [request.negative_prompt] * len(prompts)
    if len(request.negative_prompt) != len(prompts):
        raise InvalidRequestError(
            "negative_prompt", f"needs one entry per prompt: {len(request.negative_prompt)} for {len(prompts)} prompts"
        )
    return list(request.negative_prompt)


def plan_rollout(request: RolloutRequest, limits: RequestLimits, request_id: str | None = None) -> RolloutPlan:
    """Checks a request's values against the limits and the sampling rules; raises `InvalidRequestError`."""
    prompts = request.prompts()
    if not prompts:
        raise InvalidRequestError("prompt", "needs at least one prompt")
    if len(prompts) > limits.max_prompts_per_request:
        raise InvalidRequestError("prompt", f"at most {limits.max_prompts_per_request} prompts, got {len(prompts)}")
    per_prompt = request.outputs_per_prompt
    if not 1 <= per_prompt <= limits.max_outputs_per_prompt:
        raise InvalidRequestError(
            "num_outputs_per_prompt", f"must be in [1, {limits.max_outputs_per_prompt}], got {per_prompt}"
        )
    num_samples = len(prompts) * per_prompt
    if num_samples > limits.max_samples_per_request:
        raise InvalidRequestError(
            "num_outputs_per_prompt",
            f"prompts x num_outputs_per_prompt = {num_samples} is over the limit of {limits.max_samples_per_request}",
        )
    steps = limits.default_inference_steps if request.num_inference_steps is None else request.num_inference_steps
    if steps > limits.max_inference_steps:
        raise InvalidRequestError("num_inference_steps", f"at most {limits.max_inference_steps}, got {steps}")
    _check_value_limits(request, limits, steps)
    _check_image_model_fields(request)
    _negative_prompts(request)
    if request.seed is not None and request.seed < 0:
        raise InvalidRequestError("seed", f"must be an integer >= 0, got {request.seed}")
    seed = secrets.randbelow(2**31) if request.seed is None else request.seed
    if seed + num_samples - 1 > MAX_SEED:
        raise InvalidRequestError("seed", f"seed + number of samples - 1 must be <= {MAX_SEED}")
    common = dict(
        num_inference_steps=steps,
        height=request.height,
        width=request.width,
        guidance_scale=request.guidance_scale,
        true_cfg_scale=request.true_cfg_scale,
    )
    if not request.rollout:  # evaluation: the deterministic sampler, images only
        options = SamplingOptions(**common, sde_type=TransitionKind.ODE, return_step_indices=())
        return RolloutPlan(request_id or secrets.token_hex(8), request, seed, options)
    # Latents travel only when asked for (the trajectory, or chosen steps of it): a worker's result
    # carries what the response uses.
    asked_for_latents = request.rollout_return_dit_trajectory or request.rollout_return_step_indices is not None
    squared_error = request.rollout_log_prob_no_const
    form = LogProbForm.SQUARED_ERROR if squared_error else LogProbForm.GAUSSIAN
    options = SamplingOptions(
        **common,
        sde_type=request.rollout_sde_type,
        noise_level=request.rollout_noise_level,
        log_prob_form=form if request.rollout_log_prob_form is None else request.rollout_log_prob_form,
        sde_step_indices=request.rollout_sde_step_indices,
        return_step_indices=request.rollout_return_step_indices if asked_for_latents else (),
        debug=request.rollout_debug_mode,
        return_denoising_env=request.rollout_return_denoising_env,
    )
    if squared_error and options.log_prob_form is not LogProbForm.SQUARED_ERROR:
        raise InvalidRequestError(
            "rollout_log_prob_form",
            f"{options.log_prob_form.value!r} conflicts with rollout_log_prob_no_const: true "
            "(which means 'squared_error')",
        )
    return RolloutPlan(request_id or secrets.token_hex(8), request, seed, options)


# Request field -> the `RequestLimits` field that bounds it.
_UPPER_LIMITS = {
    "guidance_scale": "max_guidance_scale",
    "true_cfg_scale": "max_guidance_scale",
    "rollout_noise_level": "max_noise_level",
    "height": "max_image_size",
    "width": "max_image_size",
}


def _check_value_limits(request: RolloutRequest, limits: RequestLimits, steps: int) -> None:
    for field, limit_name in _UPPER_LIMITS.items():
        value, limit = getattr(request, field), getattr(limits, limit_name)
        if value is not None and value > limit:
            raise InvalidRequestError(field, f"must be at most {limit} (limits.{limit_name}), got {short_repr(value)}")
    # Each step can be named once, so a longer list is refused by its length alone, before anything
    # walks its entries (150,000 zeros took 13 s in SamplingOptions' duplicate check).
    step_lists = (("rollout_sde_step_indices", steps, steps - 1), ("rollout_return_step_indices", steps + 1, steps))
    for field, most, largest in step_lists:
        indices = getattr(request, field)
        if indices is not None and len(indices) > most:
            raise InvalidRequestError(
                field,
                f"at most {most} entries (steps 0 .. {largest}, each once, of num_inference_steps {steps}), "
                f"got {len(indices)}",
            )


def _check_image_model_fields(request: RolloutRequest) -> None:
    """SGLang's video and image-input fields, which every model served here (text-to-image) refuses."""
    if request.num_frames is not None and request.num_frames != 1:
        raise InvalidRequestError(
            "num_frames", f"the served model generates images: must be 1, got {request.num_frames}"
        )
    if request.fps is not None and request.fps < 1:
        raise InvalidRequestError("fps", f"must be a positive integer, got {request.fps}")
    if request.image_path:
        raise InvalidRequestError("image_path", "the served model is text-to-image and takes no input image")


def response_rows(
    plan: RolloutPlan,
    batch: RolloutBatch,
    inference_time_s: float,
    peak_memory_mb: float | None = None,
) -> list[dict[str, Any]]:
    """One map per sample, in request order, with tensors left for the codec to encode.

    Every row has all of SGLang's keys (None where unset), then this server's extensions
    (`prompt_index`, `sample_seed`, `weight_version`). The per-request tensors in
    `dit_trajectory` are one object each, shared by every row, so a `TensorEncoder` encodes
    them once per response.
    """
    request = plan.request
    kept_steps = torch.tensor(batch.options.kept_latent_steps(), dtype=torch.int64)
    trajectory_labels = {
        "timesteps": batch.schedule.latent_timesteps(kept_steps),  # one per returned latent, SGLang's runtime
        "sigmas": batch.schedule.sigmas,  # [T + 1], never filtered
        "scheduler_timesteps": batch.schedule.timesteps,  # [T], the scheduler's own
        "model_timesteps": batch.schedule.model_timesteps,  # [T], the transformer's time input
        "latent_step_indices": kept_steps,
    }
    return_trajectory = request.rollout and request.rollout_return_dit_trajectory
    return [
        {
            "request_id": plan.request_id,
            "prompt": sample.prompt,
            "seed": plan.seed,
            "generated_output": sample.image,
            "rollout_log_probs": sample.log_probs if request.rollout else None,
            "rollout_debug_tensors": _debug_tensors(sample),
            "denoising_env": sample.denoising_env,
            "dit_trajectory": {"latents": sample.latents, **trajectory_labels} if return_trajectory else None,
            "inference_time_s": inference_time_s,
            "peak_memory_mb": None if request.suppress_logs else peak_memory_mb,
            "prompt_index": i // plan.num_outputs_per_prompt,
            "sample_seed": sample.seed,
            "weight_version": sample.weight_version,
        }
        for i, sample in enumerate(batch.samples)
    ]


def _debug_tensors(sample: SampleTrajectory) -> dict[str, torch.Tensor] | None:
    if sample.debug is None:
        return None
    return {
        "rollout_variance_noises": sample.debug.variance_noises,
        "rollout_prev_sample_means": sample.debug.prev_sample_means,
        "rollout_noise_std_devs": sample.debug.noise_std_devs.unsqueeze(-1),  # [T, 1], as SGLang's
        "rollout_model_outputs": sample.debug.model_outputs,
    }


def check_finite(batch: RolloutBatch) -> RolloutBatch:
    """`batch`, if every floating-point tensor of its samples is finite.

    Raises `NonFiniteOutputError` naming the tensors that are not: NaN log-probs returned as a
    success would poison a training step, and nothing downstream would say why.
    """
    bad: dict[str, int] = {}
    for sample in batch.samples:
        for name, tensor in sample.tensors().items():
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                bad[name] = bad.get(name, 0) + 1
    if bad:
        where = ", ".join(f"{name} ({count} of {len(batch.samples)} samples)" for name, count in bad.items())
        raise NonFiniteOutputError(
            f"sampling produced NaN or infinite values in {where}; "
            "lower guidance_scale, true_cfg_scale or rollout_noise_level, or check the served weights"
        )
    return batch


class UpdateWeightsFromDiskRequest(BaseModel):
    """`POST /update_weights_from_disk`: SGLang's body, and the version to serve (extension)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="A pipeline checkpoint, a PEFT adapter directory, or a safetensors file.")
    flush_cache: bool = Field(True, description="SGLang's; nothing here caches weight-derived values.")
    target_modules: list[str] | None = Field(None, description="Modules to update; None: all (a whole checkpoint).")
    weight_version: str | None = Field(None, description="(extension) Name of the new weights.")


class UpdateWeightsFromTensorRequest(BaseModel):
    """`POST /update_weights_from_tensor`: named tensors in this server's tensor envelope.

    SGLang sends `serialized_named_tensors`, pickles, which a server must never unpickle; this
    endpoint takes `named_tensors` instead, decoded with safetensors only.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    named_tensors: dict[str, torch.Tensor] = Field(description="Weight name -> tensor envelope.")
    target_modules: list[str] | None = Field(None, description="The one module the tensors are for. Default: transformer.")
    lora_rank: int | None = Field(None, description="With LoRA tensors: the adapter's rank.")
    lora_alpha: float | None = Field(None, description="With LoRA tensors: the adapter's alpha.")
    weight_version: str | None = Field(None, description="(extension) Name of the new weights.")


class WeightsChecksumRequest(BaseModel):
    """`POST /get_weights_checksum`: SGLang's body."""

    model_config = ConfigDict(extra="forbid")

    module_names: list[str] | None = Field(None, description="Modules to checksum; None: all.")
