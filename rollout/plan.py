"""A request's plan: its values checked against the server's limits, fanned out into samples.

This module is the one home of the checks of a request's values (the schema, `rollout.schema`,
checks only their types): `plan_rollout` makes every check the served model has no say in, and
derives the per-sample data once: sample i is prompt i // num_outputs_per_prompt, with that
prompt's negative prompt and the seed `seed + i` (its leaf's, where it resumes a node below a
branch step: `RolloutPlan`); `checked_against_model` makes the rest, where
the model is (a worker replica), and fills in the model's defaults. Everything here raises
`InvalidRequestError` naming the field (HTTP 400).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout.codec import decode_tensor, most_encoded_tensor_bytes, most_encoded_text_bytes
from rollout.cost import COST_UNIT, CostFacts, RequestCost
from rollout.errors import CodecError, InvalidRequestError, short_repr
from rollout.input_images import ImageInputLimits, InputImage, input_images_per_prompt
from rollout.options import MAX_SEED, SamplingOptions, check_seed
from rollout.sampler import resolve_options
from rollout.schema import RolloutRequest
from rollout.transitions import LogProbForm, TransitionKind
from rollout.tree import (
    FACTORS_FIELD,
    LOG_PROB_STD_FIELD,
    NOISE_SCALES_FIELD,
    RESUME_LATENTS_FIELD,
    RESUME_PATHS_FIELD,
    SHAPE_FIELD,
    STEPS_FIELD,
    Branching,
    BranchLogProbStd,
    BranchShape,
    RootedSamples,
    check_resume_latent,
)
from rollout.weights import weight_version_problem

if TYPE_CHECKING:
    from rollout.models.base import RolloutPipeline


# SGLang's `rollout_video_dtype` values: None ships the frames as sampled (fp32).
VIDEO_DTYPES = (None, "uint8")


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
    max_num_frames: int = Field(257, ge=1, description="Largest `num_frames` of a video model.")
    # LTX-Video puts the frame rate in an int64 tensor: 2**63 raised inside the sampler call.
    max_fps: int = Field(240, ge=1, description="Largest `fps` of a video model (its output's frame rate).")
    max_prompt_bytes: int = Field(
        16_384, ge=1, description="Largest prompt or negative prompt, in UTF-8 bytes (text encoders read at most "
        "a few hundred tokens of it)."
    )
    # A 480x832, 81-frame Wan video keeps 8.4 MB per latent: its whole 50-step trajectory with the
    # debug tensors is 1.7 GB a sample. The ingress holds a response whole before it sends it.
    max_input_image_bytes: int = Field(
        32 * 2**20, ge=1, description="Largest input image (`image_path`), in encoded bytes (a file, or base64's bytes)."
    )
    max_input_image_pixels: int = Field(
        4096 * 4096,
        ge=1,
        description="Most pixels (height x width) of one input image, read from its header before it is decoded.",
    )
    max_input_images_per_prompt: int = Field(4, ge=1, description="Most input images one prompt is conditioned on.")
    max_response_bytes: int = Field(
        4 * 2**30,
        ge=1,
        description="Largest response of a request, as JSON encodes it (latents kept, debug tensors, outputs, "
        "conditioning, prompts), computed from its fields and the model before it is sampled.",
    )

    # In token-steps (`rollout.cost`): 64 guided samples at 1024x1024 and 50 steps cost 26.5M on the
    # image families, 32 guided 81-frame Wan videos at 480x832 and 50 steps 109M; 341 samples at
    # 1024x1024 and 100 steps, 141M unguided (docs/http_api.md#what-a-request-costs has the table).
    max_request_cost: int = Field(
        128_000_000,
        ge=1,
        description=f"Most work one request may ask for, in {COST_UNIT} (rollout/cost.py: samples x the rows "
        "guidance runs x latent tokens x steps, and the decode), computed from its fields and the served "
        "model before anything is sampled.",
    )

    @model_validator(mode="after")
    def _default_steps_within_the_limit(self) -> "RequestLimits":
        # Otherwise every request without num_inference_steps would be refused.
        if self.default_inference_steps > self.max_inference_steps:
            raise ValueError(
                f"default_inference_steps: must be at most max_inference_steps ({self.max_inference_steps}), "
                f"got {self.default_inference_steps}"
            )
        return self


@dataclass(frozen=True)
class RewardPlan:
    """What a request asks of the scorers.

    Attributes:
        scorers: the app's scorers to score every sample with, in the request's order.
        group_advantages: also normalise each scorer's rewards within each prompt's group.
        nulls_on_error: a failing scorer leaves nulls rather than failing the request.
    """

    scorers: tuple[str, ...]
    group_advantages: bool = False
    nulls_on_error: bool = False


@dataclass(frozen=True)
class RolloutPlan(RootedSamples):
    """A validated request, fanned out into samples.

    Attributes:
        request_id: names the request in its rows and the server's log.
        request: the parsed request (what the rows echo back).
        seed: the request's base seed, drawn here when the request gave none.
        options: the request's sampling options.
        prompts, negative_prompts, seeds: one per sample, prompt-major: sample i is prompt
            i // num_outputs_per_prompt. Its seed is its leaf's: the request's r-th root (request
            order) has the seed `seed + r * leaves_per_root`, and its leaf at path c the root's
            plus `Branching.offset(c)`; so sample i's is `seed + i` unless nodes are resumed.
        branching: the tree each root grows into: a prompt's samples are its roots' leaves, root
            after root (`rollout.tree`); no branch steps: every sample is a root.
        rewards: the scorers to score its samples with; None: no rewards.
        images: each sample's prompt's input images (`image_path`), one tuple per sample, the same
            tuple for every sample of a prompt; () for a request without images.
        resume_latents: in a resumed request, each sample's prompt's latent at the resume step
            (`rollout_resume_latents`), the same tensor for every sample of a prompt; () otherwise.
        resume_nodes: in a request that resumes nodes below a branch step, each sample's prompt's
            node (`rollout_resume_branch_paths`): the sample is a leaf below it; () otherwise.
    """

    request_id: str
    request: RolloutRequest
    seed: int
    options: SamplingOptions
    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    branching: Branching = Branching()
    rewards: RewardPlan | None = None
    images: tuple[tuple[InputImage, ...], ...] = ()
    resume_latents: tuple[torch.Tensor, ...] = ()
    resume_nodes: tuple[tuple[int, ...], ...] = ()

    @property
    def num_outputs_per_prompt(self) -> int:
        return self.request.outputs_per_prompt

    @property
    def num_samples(self) -> int:
        return len(self.seeds)



def plan_rollout(
    request: RolloutRequest,
    limits: RequestLimits,
    request_id: str | None = None,
    scorers: Collection[str] = (),
    max_batch_size: int | None = None,
    max_timeout_s: float | None = None,
    allowed_image_paths: Sequence[str] = (),
) -> RolloutPlan:
    """Checks a request's values against the limits, the sampling rules, the app's `scorers`, its
    workers' `max_batch_size` (the most samples of one sampler call) and its `max_timeout_s` (the
    app's `request_timeout_s`: what `rollout_timeout_s` may ask for at most); None: no such bound.
    Decodes its input images (`image_path`), reading files only under `allowed_image_paths`.
    Raises `InvalidRequestError`."""
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
    _check_prompt_sizes(prompts, request.negative_prompt, limits)
    _check_timeout(request.rollout_timeout_s, max_timeout_s)
    _check_input_fields(request)
    if request.weight_version is not None and (problem := weight_version_problem(request.weight_version)):
        raise InvalidRequestError("weight_version", problem)
    negative_prompts = _negative_prompt_per_prompt(request, len(prompts))
    seed = secrets.randbelow(2**31) if request.seed is None else check_seed(request.seed)
    options = _sampling_options(request, steps)
    branching = _branching(request, options, max_batch_size)
    resume_nodes = _resume_nodes(request, branching, len(prompts), limits)
    roots = _leaves_of_roots(branching, resume_nodes or [()] * len(prompts), per_prompt)
    if seed + len(roots) * branching.leaves_per_root - 1 > MAX_SEED:
        raise InvalidRequestError(
            "seed", f"seed + {len(roots)} roots x {branching.leaves_per_root} leaves - 1 must be <= {MAX_SEED}"
        )
    image_limits = ImageInputLimits(
        limits.max_input_image_bytes,
        limits.max_input_image_pixels,
        limits.max_input_images_per_prompt,
        tuple(allowed_image_paths),
    )
    prompt_images = input_images_per_prompt(request.image_path, len(prompts), isinstance(request.prompt, list), image_limits)
    return RolloutPlan(
        request_id=request_id or secrets.token_hex(8),
        request=request,
        seed=seed,
        options=options,
        prompts=tuple(p for p in prompts for _ in range(per_prompt)),
        negative_prompts=tuple(n for n in negative_prompts for _ in range(per_prompt)),
        seeds=tuple(
            seed + index * branching.leaves_per_root + branching.offset(leaf)
            for index, leaves in enumerate(roots)
            for leaf in leaves
        ),
        branching=branching,
        rewards=_rewards(request, scorers),
        images=tuple(images for images in prompt_images for _ in range(per_prompt)),
        resume_latents=tuple(latent for latent in _resume_latents(request, len(prompts)) for _ in range(per_prompt)),
        resume_nodes=tuple(node for node in resume_nodes for _ in range(per_prompt)),
    )


def _resume_latents(request: RolloutRequest, num_prompts: int) -> list[torch.Tensor]:
    """The request's latents to resume from, one a prompt, decoded (never unpickled: a tensor
    envelope, or a tensor through the handle); their shape and values are the model's to check
    (`rollout.tree.check_resume_latent`, on the worker). [] for a request that starts from noise."""
    latents, step = request.rollout_resume_latents, request.rollout_resume_step
    if (latents is None) != (step is None):
        given, missing = ("rollout_resume_step", "rollout_resume_latents") if latents is None else ("rollout_resume_latents", "rollout_resume_step")
        raise InvalidRequestError(missing, f"needed with {given}: a resumed request starts at a step from a latent a prompt")
    if latents is None:
        return []
    if len(latents) != num_prompts:
        raise InvalidRequestError(RESUME_LATENTS_FIELD, f"needs one latent a prompt: {len(latents)} for {num_prompts} prompts")
    decoded = []
    for k, latent in enumerate(latents):
        if isinstance(latent, dict):
            try:
                latent = decode_tensor(latent)
            except CodecError as error:
                raise InvalidRequestError(f"{RESUME_LATENTS_FIELD}[{k}]", str(error)) from None
        if not isinstance(latent, torch.Tensor):
            raise InvalidRequestError(
                f"{RESUME_LATENTS_FIELD}[{k}]", f"must be a tensor envelope or a tensor, got {type(latent).__name__}"
            )
        decoded.append(latent)
    return decoded


def checked_cost(plan: RolloutPlan, facts: CostFacts, limits: RequestLimits) -> RequestCost:
    """The plan's cost in token-steps, by the served model's `facts`; `InvalidRequestError` naming
    the fields that drive it if it is over `limits.max_request_cost`. The ingress calls it right
    after `plan_rollout`, once it has the facts from a worker replica. Input images the model does
    not take, and heights or widths it cannot make, are refused here too, before anything is sent
    or counted in flight (`InvalidRequestError` naming ``image_path``, ``height`` or ``width``)."""
    options = resolve_options(facts, plan.options)  # type: ignore[arg-type]  # the facts carry the defaults
    facts.condition_images.check(_per_prompt(plan.images, plan.num_outputs_per_prompt), facts.model, options.num_frames)
    cost = facts.request_cost(plan.roots(), plan.options)
    if cost.token_steps > limits.max_request_cost:
        frames = ", num_frames" if facts.default_num_frames > 1 else ""
        raise InvalidRequestError(
            f"num_outputs_per_prompt, height, width{frames}, num_inference_steps",
            f"this request costs {cost.token_steps:,} {COST_UNIT}, over limits.max_request_cost "
            f"({limits.max_request_cost:,}): ask for fewer samples, a smaller size{' or fewer frames' if frames else ''}, "
            "or fewer steps",
        )
    facts.image_size_limits.check(options.height, options.width, facts.model)
    return cost


def checked_against_model(
    model: RolloutPipeline,
    options: SamplingOptions,
    prompts: Sequence[str],
    negative_prompts: Sequence[str],
    samples_in_response: int,
    limits: RequestLimits,
    images: Sequence[tuple[InputImage, ...]] = (),
    resume_latents: Sequence[torch.Tensor] = (),
) -> SamplingOptions:
    """The checks of a request's values that need the served model, which the ingress does not
    load: the worker makes them once, when a request's work arrives, before it is batched with
    other requests' (one bad request must not fail the others of its sampler call). Returns
    `options` with the model's defaults filled in, the one place they are (`resolve_options`).

    Raises `InvalidRequestError` naming the field: a prompt the model cannot condition on, input
    `images` (one tuple per sample) it does not take (`RolloutPipeline.condition_images`), a
    `true_cfg_scale` for a model without classifier-free guidance (FLUX.2's), a size
    or frame count it cannot make (`RolloutPipeline.latent_shape`), a step count its scheduler
    cannot make, or a response of more than `limits.max_response_bytes` over the
    `samples_in_response` samples of the whole request (`most_response_bytes_per_row`), or latents
    to resume from (one per sample) that the model cannot take (`check_resume_latent`)."""
    model.check_prompts(prompts, negative_prompts)
    num_frames = model.default_num_frames if options.num_frames is None else options.num_frames
    model.condition_images.check(images, model.name, num_frames)
    if model.negative_branch.scale is None and options.true_cfg_scale not in (None, 1.0):
        raise InvalidRequestError(
            "true_cfg_scale",
            f"model {model.name!r} runs no classifier-free guidance (its pipeline has none): leave it out, or "
            "set guidance_scale, its embedded guidance",
        )
    options = resolve_options(model, options)
    model.schedule(options.num_inference_steps, options.height, options.width, options.num_frames)
    latent_shape = model.latent_shape(options.height, options.width, options.num_frames)
    for latent in {id(latent): latent for latent in resume_latents}.values():  # one a prompt
        check_resume_latent(latent, latent_shape)
    per_row = most_response_bytes_per_row(model, options, latent_shape, prompts)
    total = sum(per_row.values()) * samples_in_response
    if total > limits.max_response_bytes:
        parts = ", ".join(f"{size / 2**20:.1f} MiB of {what}" for what, size in per_row.items())
        raise InvalidRequestError(
            "rollout_return_step_indices",
            f"the response would be {total / 2**20:.0f} MiB, encoded as JSON ({parts}, a sample), "
            f"past limits.max_response_bytes ({limits.max_response_bytes / 2**20:.0f} MiB): keep fewer latents "
            "(rollout_return_step_indices, rollout_sde_step_indices), set rollout_debug_mode: false or "
            "rollout_return_denoising_env: false, or ask for fewer samples",
        )
    return options


# A row's keys and its values besides its tensors and its prompt: numbers, the request id, a
# `weight_version` (at most 128 characters), and the rewards and advantages of the scorers it names:
# about 700 bytes as JSON with two scorers; 8 KiB leaves room for dozens. Plus, per step, an entry
# of `branch_path` and of `branch_seeds` (a branched sample has at most one branch step a step).
_ROW_FIELD_BYTES = 8192
_ROW_BYTES_PER_STEP = 48


def most_response_bytes_per_row(
    model: RolloutPipeline, options: SamplingOptions, latent_shape: tuple[int, ...], prompts: Sequence[str]
) -> dict[str, int]:
    """The most bytes one row of the response takes (`rollout.rows`), by what takes them: the
    tensors (`SamplingOptions.kept_tensor_bytes`), the conditioning of
    `rollout_return_denoising_env` (`RolloutPipeline.conditioning_bytes`), the prompt each row
    echoes, and the rest of its fields. Every tensor is counted as JSON encodes it (base64 and its
    envelope, `rollout.codec.most_encoded_tensor_bytes`), whichever format the client asks for:
    the worker that checks does not know it (an HTTP client's `Accept` header), and a msgpack
    response is at most 3/4 of it. The prompt is counted as the longest of `prompts`: a request's
    parts are each checked with their own prompts, so the part with the longest makes the largest
    estimate, and a request one part refuses is refused."""
    tensors = options.kept_tensor_bytes(latent_shape)
    conditioning = model.conditioning_bytes(options) if options.return_denoising_env else ()
    return {
        "tensors": sum(most_encoded_tensor_bytes(size) for size in tensors),
        "denoising_env": sum(most_encoded_tensor_bytes(size) for size in conditioning),
        "prompt": max((most_encoded_text_bytes(p) for p in prompts), default=0),
        "other fields": _ROW_FIELD_BYTES + _ROW_BYTES_PER_STEP * options.num_inference_steps,
    }


def _per_prompt(per_sample: Sequence[tuple[InputImage, ...]], per_prompt: int) -> Sequence[tuple[InputImage, ...]]:
    """Each prompt's images, from one tuple per sample (prompt-major, `per_prompt` samples a prompt)."""
    return per_sample[::per_prompt]


def _rewards(request: RolloutRequest, scorers: Collection[str]) -> RewardPlan | None:
    """The request's reward fields, checked against the scorers the app configured."""
    if request.rollout_advantages not in (None, "group"):
        raise InvalidRequestError("rollout_advantages", f"must be 'group' or null, got {short_repr(request.rollout_advantages)}")
    if request.rollout_reward_on_error not in ("fail", "null"):
        raise InvalidRequestError(
            "rollout_reward_on_error", f"must be 'fail' or 'null', got {short_repr(request.rollout_reward_on_error)}"
        )
    names = request.rollout_reward_models
    if not names:
        if request.rollout_advantages is not None:
            raise InvalidRequestError("rollout_advantages", "needs rollout_reward_models: the rewards to normalise")
        return None
    unknown = [name for name in names if name not in scorers]
    if unknown:
        configured = sorted(scorers) or "none"
        raise InvalidRequestError(
            "rollout_reward_models", f"{short_repr(unknown[0])} is not a scorer of this server (configured: {configured})"
        )
    if len(set(names)) != len(names):
        raise InvalidRequestError("rollout_reward_models", "names a scorer twice")
    return RewardPlan(tuple(names), request.rollout_advantages == "group", request.rollout_reward_on_error == "null")


def _branching(request: RolloutRequest, options: SamplingOptions, max_batch_size: int | None) -> Branching:
    """The request's tree, checked against its options, its outputs per prompt and the workers'
    batch (a root's leaves are sampled in one call)."""
    steps, factors = request.rollout_branch_steps, request.rollout_branch_factors
    scales, log_prob_std = request.rollout_branch_noise_scales, request.rollout_branch_log_prob_std
    shape = request.rollout_branch_shape
    if steps is None and factors is None:
        for field, value in ((NOISE_SCALES_FIELD, scales), (LOG_PROB_STD_FIELD, log_prob_std), (SHAPE_FIELD, shape)):
            if value is not None:
                raise InvalidRequestError(field, f"needs {STEPS_FIELD}: it is about how roots branch there")
        return Branching()
    if steps is None or factors is None:
        given, missing = (STEPS_FIELD, FACTORS_FIELD) if factors is None else (FACTORS_FIELD, STEPS_FIELD)
        raise InvalidRequestError(missing, f"needed with {given}: one factor per branch step")
    if not request.rollout:
        raise InvalidRequestError(STEPS_FIELD, "branches need a rollout's stochastic steps; this request has rollout: false")
    branching = Branching(
        tuple(steps), tuple(factors), tuple(scales or ()), log_prob_std or BranchLogProbStd.SCALED, shape or BranchShape.TREE
    )
    branching.check(options)
    if max_batch_size is not None and branching.leaves_per_root > max_batch_size:
        raise InvalidRequestError(
            FACTORS_FIELD,
            f"the leaves of a root, {branching.leaves_rule}, are sampled together: they must be at most the "
            f"server's max_batch_size ({max_batch_size})",
        )
    return branching


def _resume_nodes(
    request: RolloutRequest, branching: Branching, num_prompts: int, limits: RequestLimits
) -> list[tuple[int, ...]]:
    """Per prompt, the path of the node its roots resume (`rollout_resume_branch_paths`): its
    roots grow the leaves below it. [] where the request names none: its roots grow every leaf."""
    paths = request.rollout_resume_branch_paths
    if paths is None:
        return []
    if request.rollout_resume_step is None:
        raise InvalidRequestError(RESUME_PATHS_FIELD, "needs rollout_resume_step: the nodes are those at that step")
    if len(paths) != num_prompts:
        raise InvalidRequestError(RESUME_PATHS_FIELD, f"needs one path a prompt: {len(paths)} for {num_prompts} prompts")
    if branching.leaves_per_root > limits.max_outputs_per_prompt:  # before the root's leaves are listed
        raise InvalidRequestError(
            FACTORS_FIELD,
            f"a root's leaves, {branching.leaves_rule}, must be at most max_outputs_per_prompt "
            f"({limits.max_outputs_per_prompt}): no request sampled the node to resume",
        )
    return [
        branching.check_node_at(path, request.rollout_resume_step, f"{RESUME_PATHS_FIELD}[{k}]")
        for k, path in enumerate(paths)
    ]


def _leaves_of_roots(branching: Branching, nodes: Sequence[tuple[int, ...]], per_prompt: int) -> list[tuple[tuple[int, ...], ...]]:
    """The leaves each root of the request grows, root after root: a prompt's samples are roots
    that each grow the leaves below its node (`nodes`, one a prompt; (): every leaf)."""
    roots = []
    for k, node in enumerate(nodes):
        if not node and per_prompt % branching.leaves_per_root:  # before the root's leaves are listed
            raise InvalidRequestError(
                "num_outputs_per_prompt", f"must be a multiple of {branching.leaves_rule}, got {per_prompt}"
            )
        leaves = branching.leaves_below(node)
        if per_prompt % len(leaves):
            raise InvalidRequestError(
                "num_outputs_per_prompt",
                f"must be a multiple of the {len(leaves)} leaves below the node {RESUME_PATHS_FIELD}[{k}] names, got {per_prompt}",
            )
        roots += [leaves] * (per_prompt // len(leaves))
    return roots


def _negative_prompt_per_prompt(request: RolloutRequest, num_prompts: int) -> list[str]:
    if request.negative_prompt is None:
        return [""] * num_prompts
    if isinstance(request.negative_prompt, str):
        return [request.negative_prompt] * num_prompts
    if len(request.negative_prompt) != num_prompts:
        raise InvalidRequestError(
            "negative_prompt", f"needs one entry per prompt: {len(request.negative_prompt)} for {num_prompts} prompts"
        )
    return list(request.negative_prompt)


def _sampling_options(request: RolloutRequest, steps: int) -> SamplingOptions:
    """The request's sampling fields as `SamplingOptions`, which check the sampling rules."""
    common = dict(
        num_inference_steps=steps,
        height=request.height,
        width=request.width,
        num_frames=request.num_frames,
        fps=request.fps,
        guidance_scale=request.guidance_scale,
        true_cfg_scale=request.true_cfg_scale,
        guidance_scale_2=request.guidance_scale_2,
        resume_step=request.rollout_resume_step,
    )
    if not request.rollout:  # evaluation: the deterministic sampler, images only
        return SamplingOptions(**common, sde_type=TransitionKind.ODE, return_step_indices=())
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
    return options


# Request field -> the `RequestLimits` field that bounds it.
_UPPER_LIMITS = {
    "guidance_scale": "max_guidance_scale",
    "true_cfg_scale": "max_guidance_scale",
    "guidance_scale_2": "max_guidance_scale",
    "num_frames": "max_num_frames",
    "fps": "max_fps",
    "rollout_noise_level": "max_noise_level",
    "height": "max_image_size",
    "width": "max_image_size",
}


def _check_prompt_sizes(prompts: Sequence[str], negative_prompt: str | Sequence[str] | None, limits: RequestLimits) -> None:
    negatives = [negative_prompt] if isinstance(negative_prompt, str) else list(negative_prompt or ())
    for field, texts in (("prompt", prompts), ("negative_prompt", negatives)):
        for text in texts:
            # A character is at most 4 UTF-8 bytes: most texts pass without being encoded.
            if 4 * len(text) > limits.max_prompt_bytes and len(text.encode()) > limits.max_prompt_bytes:
                raise InvalidRequestError(
                    field, f"at most {limits.max_prompt_bytes} UTF-8 bytes (limits.max_prompt_bytes), got {len(text.encode())}"
                )


def _check_timeout(timeout_s: float | None, max_timeout_s: float | None) -> None:
    if timeout_s is None:
        return
    if not math.isfinite(timeout_s):
        raise InvalidRequestError("rollout_timeout_s", f"must be a finite number of seconds, got {timeout_s!r}")
    if max_timeout_s is not None and timeout_s > max_timeout_s:
        raise InvalidRequestError(
            "rollout_timeout_s", f"must be at most the server's request_timeout_s ({max_timeout_s:g}), got {timeout_s:g}"
        )


def _check_value_limits(request: RolloutRequest, limits: RequestLimits, steps: int) -> None:
    for field, limit_name in _UPPER_LIMITS.items():
        value, limit = getattr(request, field), getattr(limits, limit_name)
        if value is not None and value > limit:
            raise InvalidRequestError(field, f"must be at most {limit} (limits.{limit_name}), got {short_repr(value)}")
    # Each step can be named once, so a longer list is refused by its length alone, before anything
    # walks its entries (150,000 zeros took 13 s in SamplingOptions' duplicate check).
    step_lists = (
        ("rollout_sde_step_indices", steps, steps - 1),
        ("rollout_return_step_indices", steps + 1, steps),
        (STEPS_FIELD, steps, steps - 1),
        (FACTORS_FIELD, steps, steps - 1),  # one per branch step
    )
    for field, most, largest in step_lists:
        indices = getattr(request, field)
        if indices is not None and len(indices) > most:
            raise InvalidRequestError(
                field,
                f"at most {most} entries (steps 0 .. {largest}, each once, of num_inference_steps {steps}), "
                f"got {len(indices)}",
            )


def _check_input_fields(request: RolloutRequest) -> None:
    """SGLang's video output field. (A frame count is checked by the model,
    `RolloutPipeline.latent_shape`; a frame rate by `SamplingOptions`; input images where they are
    decoded, `rollout.input_images`, and counted against the model's `ConditionImageRule`.)"""
    if request.rollout_video_dtype not in VIDEO_DTYPES:
        raise InvalidRequestError(
            "rollout_video_dtype", f"must be one of {list(VIDEO_DTYPES)}, got {short_repr(request.rollout_video_dtype)}"
        )
