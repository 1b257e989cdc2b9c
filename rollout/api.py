"""The rollout API's wire types: the request, its limits, its plan, and the per-sample response rows.

Field names follow SGLang's diffusion rollout API so trainers written for it work unchanged.
Plain pydantic, no Ray: the HTTP route and the deployment-handle method both validate with
`parse_request`, so a Python dict, a pydantic object and a JSON body take the same path.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.errors import InvalidRequestError
from rollout.options import MAX_SEED, SamplingOptions
from rollout.trajectory import RolloutBatch
from rollout.transitions import TransitionKind


class RolloutRequest(BaseModel):
    """`POST /rollout/generate` body, and the argument of the handle's `generate`."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str | list[str] = Field(description="One prompt, or a list of prompts served by one request.")
    negative_prompt: str | list[str] | None = Field(
        None, description="One negative prompt for all prompts, or one per prompt. Default: empty."
    )
    seed: int | None = Field(
        None, ge=0, le=MAX_SEED, description="Base seed; sample i (prompt-major) uses seed + i. Default: random."
    )
    num_outputs_per_prompt: int = Field(1, ge=1, description="Samples per prompt.")
    num_inference_steps: int | None = Field(None, ge=1, description="T, the number of denoising steps.")
    width: int | None = Field(None, ge=1, description="Image width in pixels. Default: the model's.")
    height: int | None = Field(None, ge=1, description="Image height in pixels. Default: the model's.")
    guidance_scale: float | None = Field(None, allow_inf_nan=False, description="Classifier-free guidance scale.")
    rollout: bool = Field(True, description="False: evaluation, images only, from the deterministic ODE sampler.")
    rollout_sde_type: Literal["sde", "cps", "ode"] = Field("sde", description="Transition of the stochastic steps.")
    rollout_noise_level: float = Field(0.7, ge=0, allow_inf_nan=False, description="eta, the noise level.")
    rollout_log_prob_no_const: bool = Field(False, description="Drop the model-independent log-density terms.")
    rollout_debug_mode: bool = Field(False, description="Return per-step velocities, means, stds and noises.")
    rollout_return_denoising_env: bool = Field(False, description="Return each sample's conditioning tensors.")
    rollout_return_dit_trajectory: bool = Field(False, description="Return latents, timesteps and sigmas.")
    rollout_sde_step_indices: list[int] | None = Field(None, description="Stochastic steps; others run as ODE.")
    rollout_return_step_indices: list[int] | None = Field(None, description="Latents to return; T is the final one.")

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class RequestLimits(BaseModel):
    """What one request may ask for."""

    model_config = ConfigDict(extra="forbid")

    max_prompts_per_request: int = Field(64, ge=1, description="Most prompts in one request.")
    max_outputs_per_prompt: int = Field(64, ge=1, description="Largest `num_outputs_per_prompt`.")
    max_samples_per_request: int = Field(512, ge=1, description="Most samples (prompts x outputs) in one request.")
    max_inference_steps: int = Field(100, ge=1, description="Largest `num_inference_steps`.")
    default_inference_steps: int = Field(20, ge=1, description="`num_inference_steps` when a request gives none.")


def parse_request(data: RolloutRequest | dict[str, Any]) -> RolloutRequest:
    """Validates a request, raising `InvalidRequestError` that names the first bad field."""
    if isinstance(data, RolloutRequest):
        return data
    if not isinstance(data, dict):
        raise InvalidRequestError("body", f"must be a JSON object, got {type(data).__name__}")
    try:
        return RolloutRequest.model_validate(data)
    except ValidationError as e:
        # The deepest error is the most specific one (a union reports one error per branch).
        error = max(e.errors(include_url=False), key=lambda error: len(error["loc"]))
        # The request is flat: the location is a field name (known or not), then union branches
        # (type names, dropped) and list indices (kept).
        first, *rest = error["loc"] or ("body",)
        field = ".".join([str(first)] + [str(part) for part in rest if isinstance(part, int)])
        value = "" if error["type"] == "missing" else f", got {error['input']!r}"
        raise InvalidRequestError(field, f"{error['msg']}{value}") from None


@dataclass(frozen=True)
class SamplingWork:
    """One sampler call's worth of one request's samples: what a worker replica receives."""

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    options: SamplingOptions

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
    def num_samples(self) -> int:
        return len(self.request.prompts()) * self.request.num_outputs_per_prompt

    def work(self, chunk_size: int) -> list[SamplingWork]:
        """The request's samples in order, cut into pieces of at most `chunk_size`."""
        per_prompt = self.request.num_outputs_per_prompt
        prompts = [p for p in self.request.prompts() for _ in range(per_prompt)]
        negatives = [n for n in _negative_prompts(self.request) for _ in range(per_prompt)]
        seeds = [self.seed + i for i in range(self.num_samples)]
        return [
            SamplingWork(
                tuple(prompts[start : start + chunk_size]),
                tuple(negatives[start : start + chunk_size]),
                tuple(seeds[start : start + chunk_size]),
                self.options,
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
    """Checks a request against the limits and the sampling rules; raises `InvalidRequestError`."""
    prompts = request.prompts()
    if not prompts:
        raise InvalidRequestError("prompt", "needs at least one prompt")
    if len(prompts) > limits.max_prompts_per_request:
        raise InvalidRequestError("prompt", f"at most {limits.max_prompts_per_request} prompts, got {len(prompts)}")
    if request.num_outputs_per_prompt > limits.max_outputs_per_prompt:
        raise InvalidRequestError(
            "num_outputs_per_prompt", f"at most {limits.max_outputs_per_prompt}, got {request.num_outputs_per_prompt}"
        )
    num_samples = len(prompts) * request.num_outputs_per_prompt
    if num_samples > limits.max_samples_per_request:
        raise InvalidRequestError(
            "num_outputs_per_prompt",
            f"prompts x num_outputs_per_prompt = {num_samples} is over the limit of {limits.max_samples_per_request}",
        )
    steps = limits.default_inference_steps if request.num_inference_steps is None else request.num_inference_steps
    if steps > limits.max_inference_steps:
        raise InvalidRequestError("num_inference_steps", f"at most {limits.max_inference_steps}, got {steps}")
    _negative_prompts(request)
    seed = secrets.randbelow(2**31) if request.seed is None else request.seed
    if seed + num_samples - 1 > MAX_SEED:
        raise InvalidRequestError("seed", f"seed + number of samples - 1 must be <= {MAX_SEED}")
    common = dict(
        num_inference_steps=steps, height=request.height, width=request.width, guidance_scale=request.guidance_scale
    )
    if request.rollout:
        options = SamplingOptions(
            **common,
            sde_type=TransitionKind(request.rollout_sde_type),
            noise_level=request.rollout_noise_level,
            log_prob_without_constants=request.rollout_log_prob_no_const,
            sde_step_indices=request.rollout_sde_step_indices,
            return_step_indices=request.rollout_return_step_indices,
            debug=request.rollout_debug_mode,
            return_denoising_env=request.rollout_return_denoising_env,
        )
    else:  # evaluation: the deterministic sampler, keeping only the final latent
        options = SamplingOptions(**common, sde_type=TransitionKind.ODE, return_step_indices=[steps])
    return RolloutPlan(request_id or secrets.token_hex(8), request, seed, options)


def response_rows(
    plan: RolloutPlan, batch: RolloutBatch, weight_version: str, inference_time_s: float
) -> list[dict[str, Any]]:
    """One map per sample, in request order, with tensors left for the codec to encode.

    The schedule tensors in `dit_trajectory` are the batch's one schedule object in every row,
    so a `TensorEncoder` encodes them once per response.
    """
    request = plan.request
    per_prompt = request.num_outputs_per_prompt
    rows = []
    for i, sample in enumerate(batch.samples):
        row: dict[str, Any] = {
            "request_id": plan.request_id,
            "prompt": sample.prompt,
            "prompt_index": i // per_prompt,
            "seed": sample.seed,
            "generated_output": sample.image,
        }
        if request.rollout:
            row["rollout_log_probs"] = sample.log_probs
            if sample.debug is not None:
                row["rollout_debug_tensors"] = {
                    "rollout_model_outputs": sample.debug.model_outputs,
                    "rollout_prev_sample_means": sample.debug.prev_sample_means,
                    "rollout_noise_std_devs": sample.debug.noise_std_devs,
                    "rollout_variance_noises": sample.debug.variance_noises,
                }
            if sample.denoising_env is not None:
                row["denoising_env"] = sample.denoising_env
            if request.rollout_return_dit_trajectory:
                row["dit_trajectory"] = {
                    "latents": sample.latents,
                    "timesteps": sample.schedule.timesteps,
                    "sigmas": sample.schedule.sigmas,
                    "latent_step_indices": sample.latent_step_indices,
                }
        row["weight_version"] = weight_version
        row["inference_time_s"] = inference_time_s
        rows.append(row)
    return rows
