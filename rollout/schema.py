"""The rollout API's wire types: the request and the weight routes' bodies, and how a body is parsed.

The request is SGLang's diffusion rollout API (0.5.23,
`sglang/multimodal_gen/runtime/entrypoints/post_training/io_struct.py`), so a trainer written for
it works unchanged; this server's extensions are extra fields beside SGLang's (docs/http_api.md, "Coming
from SGLang"). Plain pydantic, no Ray: the HTTP route and the deployment-handle method both parse
with `parse_request`, so a Python dict, a pydantic object and a JSON body take the same path.

Only types are checked here: a body that does not fit the schema (a wrong type, a missing prompt,
an unknown field) raises `RequestSchemaError` (HTTP 422, as in SGLang). Values are checked when
the request is planned (`rollout.plan`).
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any, Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollout.errors import InvalidRequestError, RequestSchemaError, clip, short_repr

T = TypeVar("T")
# A list whose validation stops at its first bad item: pydantic reports every bad item otherwise,
# which for a body's 100,000 took half a second and tens of MB.
Items = Annotated[list[T], Field(fail_fast=True)]

# "strict": unknown fields and mistyped values are refused (422). "sglang": SGLang's own
# pydantic behaviour, unknown fields dropped and values coerced where pydantic's lax mode can.
RequestValidation = Literal["strict", "sglang"]


class RolloutRequest(BaseModel):
    """`POST /rollout/generate` body, and the argument of the handle's `generate`.

    SGLang's fields in SGLang's order and with its defaults, then this server's extensions.
    Only types are checked here; values are checked by `rollout.plan.plan_rollout`.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    prompt: str | Items[str] = Field(description="One prompt, or (extension) a list of prompts served by one request.")
    negative_prompt: str | Items[str] | None = Field(
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
    num_frames: int | None = Field(
        None, description="Frames per sample of a video model (Wan: 4k + 1); image models take only 1. Default: the model's."
    )
    fps: int | None = Field(None, description="Frame rate of a video model's output, as in SGLang; image models ignore it.")
    rollout: bool = Field(True, description="False: evaluation, images only, from the deterministic ODE sampler.")
    rollout_video_dtype: str | None = Field(
        None,
        description="'uint8': a video model's generated_output rounded to 8 bits (4x fewer bytes), as SGLang; "
        "None: fp32 as sampled. Image models ignore it.",
    )
    rollout_sde_type: str = Field("sde", description="Transition of the stochastic steps: sde, cps, dance or ode.")
    rollout_noise_level: float = Field(0.7, description="eta, the noise level.")
    rollout_log_prob_no_const: bool = Field(
        False, description="Per-step log-probs as -(x_next - mean)^2, SGLang's constant-free form."
    )
    rollout_debug_mode: bool = Field(True, description="Return per-step velocities, means, stds and noises.")
    rollout_return_denoising_env: bool = Field(False, description="Return each sample's conditioning tensors.")
    rollout_return_dit_trajectory: bool = Field(False, description="Return latents, timesteps and sigmas.")
    rollout_sde_step_indices: Items[int] | None = Field(None, description="Stochastic steps; others run as ODE.")
    rollout_return_step_indices: Items[int] | None = Field(None, description="Latents to return; T is the final one.")
    image_path: Any = Field(
        None,
        description="Input images of image-conditioned models: one image or a list per prompt (a list of one entry "
        "per prompt when `prompt` is a list), each a data URI or base64 text of PNG/JPEG/WebP bytes, the bytes "
        "themselves (msgpack), a tensor envelope ([C, H, W] uint8), a file path under the server's "
        "allowed_image_paths (never a URL), or through the handle a PIL image or tensor (rollout/input_images.py).",
    )
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
    rollout_branch_steps: Items[int] | None = Field(
        None,
        description="(extension) Tree rollouts: the stochastic steps at which every node branches, strictly "
        "increasing (rollout/tree.py).",
    )
    rollout_branch_factors: Items[int] | None = Field(
        None,
        description="(extension) Children per node at each branch step, each >= 2; num_outputs_per_prompt is a "
        "multiple of their product (the roots per prompt).",
    )
    rollout_branch_noise_scales: Items[float] | None = Field(
        None,
        description="(extension) Per branch step, the factor on the noise each child draws there (BranchGRPO's "
        "tree_split_noise_scale). Default: 1 at each.",
    )
    rollout_resume_step: int | None = Field(
        None,
        description="(extension) Resume from returned nodes: start at this step from rollout_resume_latents, "
        "with the seed, branch fields and steps before it of the request that sampled them (rollout/tree.py).",
    )
    rollout_resume_latents: Items[Any] | None = Field(
        None,
        description="(extension) One latent a prompt, x_s at rollout_resume_step: a tensor envelope (a tensor "
        "through the handle), float32, of the model's latent shape for the request's size.",
    )
    rollout_resume_branch_paths: Items[Items[int]] | None = Field(
        None,
        description="(extension) One a prompt: the branch path of the node each latent of rollout_resume_latents "
        "belongs to, a child index for each branch step before rollout_resume_step. The prompt's samples are the "
        "leaves below it, root after root, with their own seeds (rollout/tree.py). Default: the root.",
    )
    rollout_branch_shape: str | None = Field(
        None,
        description="(extension) tree (default): every node branches at each branch step; comb (TempFlow-GRPO's): "
        "an ODE spine that grows, at each branch step, its factor's children, each one stochastic step from the "
        "spine and an ODE tail (rollout/tree.py).",
    )
    rollout_branch_log_prob_std: str | None = Field(
        None,
        description="(extension) The std in the log-prob of a scaled branch step: scaled (the std the noise was "
        "drawn with, default) or nominal (the step's own, BranchGRPO's: off-policy where the scale is not 1).",
    )
    guidance_scale_2: float | None = Field(
        None,
        description="(extension, as in miles' extra_sampling_params) The low-noise expert's guidance scale of a "
        "two-expert model (Wan2.2-A14B). Default: guidance_scale.",
    )
    rollout_timeout_s: float | None = Field(
        None,
        gt=0,
        description="(extension) Seconds the request may take; past them it fails (HTTP 504) and its work still "
        "queued is dropped. Default: the app's request_timeout_s.",
    )
    rollout_reward_models: Items[str] | None = Field(
        None,
        description="(extension) Scorers of the app config (`scorers`) that score every sample as its part is "
        "sampled; each row carries `rewards` {scorer: score}.",
    )
    rollout_advantages: str | None = Field(
        None,
        description="(extension) 'group': rows also carry `advantages` {scorer: advantage}, each reward against its "
        "prompt's group as Flow-GRPO computes it, (r - mean) / (std + 1e-4), population std (rollout/advantages.py).",
    )
    rollout_reward_on_error: str = Field(
        "fail",
        description="(extension) A scorer that fails or times out: 'fail' fails the request naming the scorer (HTTP "
        "502); 'null' leaves its rewards (and advantages) null.",
    )

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    @property
    def outputs_per_prompt(self) -> int:
        return 1 if self.num_outputs_per_prompt is None else self.num_outputs_per_prompt


# What `extra_sampling_params` may override: SGLang merges it into the sampling parameters, which
# here are the request's own fields. SGLang keeps the top-level `rollout` whatever it says.
_OVERRIDABLE_FIELDS = set(RolloutRequest.model_fields) - {"prompt", "extra_sampling_params"}


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
            raise _unknown_fields_error(unknown, RolloutRequest)
        data = _validated(RolloutRequest, data, strict=not lenient)
    return _merge_extra_sampling_params(data, lenient)


# A body with a million bad items is answered with the first few, each location clipped.
_MAX_REPORTED_PROBLEMS = 10


def _problem(kind: str, loc: list[Any], message: str) -> dict[str, Any]:
    """One entry of FastAPI's `detail`, without the value (FastAPI's would echo it)."""
    loc = [part if isinstance(part, int) else clip(str(part)) for part in loc]
    return {"type": kind, "loc": ["body", *loc], "msg": message}


def _unknown_fields_error(unknown: list[str], model: type[BaseModel]) -> RequestSchemaError:
    reason = f"unknown field{_did_you_mean(unknown[0], model)}"
    if model is RolloutRequest:
        reason += " (an app with request_validation: sglang ignores unknown fields, as SGLang does)"
    message = "Extra inputs are not permitted"  # pydantic's and FastAPI's words
    detail = [_problem("extra_forbidden", [name], message) for name in unknown[:_MAX_REPORTED_PROBLEMS]]
    return RequestSchemaError(unknown[0], reason, detail)


def _validated(model: type[Body], data: dict[str, Any], strict: bool, location: tuple[str, ...] = ()) -> Body:
    try:
        return model.model_validate(data, strict=strict)
    except ValidationError as e:
        raise _schema_error(e, location) from None


def _schema_error(error: ValidationError, location: tuple[str, ...]) -> RequestSchemaError:
    problems = error.errors(include_url=False)
    # The deepest error is the most specific one (a union reports one error per branch).
    first_problem = max(problems, key=lambda problem: len(problem["loc"]))
    # The bodies are flat: the location is a field name, then union branches (type names,
    # dropped), list indices (kept) and, in a map of tensors, its keys (dropped).
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
                f"this server does not support the sampling parameter {short_repr(key)}{_did_you_mean(str(key), RolloutRequest)}; "
                "it takes overrides of the request's own fields",
            )
        if key == "rollout" and value != request.rollout and not lenient:
            raise InvalidRequestError(
                "extra_sampling_params.rollout",
                "conflicts with the request's `rollout`; SGLang keeps the top-level value (request_validation: sglang)",
            )
    overrides = {key: value for key, value in extras.items() if key != "rollout"}
    merged = {**request.model_dump(exclude={"extra_sampling_params"}), **overrides}
    return _validated(RolloutRequest, merged, not lenient, ("extra_sampling_params",))


# difflib's cutoff (a ratio of 0.6) cannot be met by a name this long, and difflib indexes every
# character of the name it is given: seconds for a megabyte key.
_LONGEST_CLOSE_NAME = 3 * max(map(len, RolloutRequest.model_fields))


def _did_you_mean(name: str, model: type[BaseModel]) -> str:
    if len(name) > _LONGEST_CLOSE_NAME:
        return ""
    close = difflib.get_close_matches(name, model.model_fields, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


class UpdateWeightsFromDiskRequest(BaseModel):
    """`POST /update_weights_from_disk`: SGLang's body, and the version to serve (extension)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(description="A pipeline checkpoint, a PEFT adapter directory, or a safetensors file.")
    flush_cache: bool = Field(True, description="SGLang's; nothing here caches weight-derived values.")
    target_modules: Items[str] | None = Field(None, description="Modules to update; None: all (a whole checkpoint).")
    weight_version: str | None = Field(None, description="(extension) Name of the new weights.")


class UpdateWeightsFromTensorRequest(BaseModel):
    """`POST /update_weights_from_tensor`: named tensors in this server's tensor envelope.

    SGLang sends `serialized_named_tensors`, pickles, which a server must never unpickle; this
    endpoint takes `named_tensors` instead, decoded with safetensors only.
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    named_tensors: dict[str, torch.Tensor] = Field(description="Weight name -> tensor envelope.")
    target_modules: Items[str] | None = Field(None, description="The one module the tensors are for. Default: transformer.")
    lora_rank: int | None = Field(None, description="With LoRA tensors: the adapter's rank.")
    lora_alpha: float | None = Field(None, description="With LoRA tensors: the adapter's alpha.")
    weight_version: str | None = Field(None, description="(extension) Name of the new weights.")


class WeightsChecksumRequest(BaseModel):
    """`POST /get_weights_checksum`: SGLang's body."""

    model_config = ConfigDict(extra="forbid")

    module_names: Items[str] | None = Field(None, description="Modules to checksum; None: all.")


# The largest bucket a distributed weight update packs by default: vLLM's and verl's size.
BUCKET_BYTES = 512 * 2**20


class InitWeightsUpdateGroupRequest(BaseModel):
    """`POST /init_weights_update_group`: SGLang's body. Every worker replica joins the trainer's
    group, replica i as rank `rank_offset + i` (`rollout.weight_sync`)."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = Field(max_length=253, description="The trainer's (rank 0's) address: one the app allows.")
    master_port: int = Field(ge=1, le=65535, description="The port of the trainer's store.")
    rank_offset: int = Field(ge=1, le=65535, description="The first rank of this server's replicas (the trainer is 0).")
    world_size: int = Field(ge=2, le=65536, description="Ranks in the group, the trainer's and every replica's.")
    group_name: str = Field("rollout", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="gloo on CPUs, nccl on GPUs.")
    timeout_s: float | None = Field(
        None, gt=0, description="(extension) Seconds a collective may wait for a peer; at most, and by default, "
        "the app's weight_update_timeout_s.",
    )


class PackedUpdateRequest(BaseModel):
    """What an update packed in buckets (`rollout.weight_sync`) says of its tensors: SGLang's names,
    dtypes and shapes, the LoRA fields as on the tensor route, and the bucket size the trainer packs
    with; their bytes come another way (a group's broadcast, or memory the trainer shares)."""

    model_config = ConfigDict(extra="forbid")

    names: Items[Annotated[str, Field(max_length=512)]] = Field(max_length=200_000)
    dtypes: Items[str] = Field(max_length=200_000, description="torch dtype names, as 'bfloat16'.")
    shapes: Items[Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=8)]] = Field(max_length=200_000)
    weight_version: str | None = Field(None, description="Name of the new weights.")
    target_modules: Items[str] | None = Field(None, description="The one module the tensors are for. Default: transformer.")
    lora_rank: int | None = Field(None, description="With LoRA tensors: the adapter's rank.")
    lora_alpha: float | None = Field(None, description="With LoRA tensors: the adapter's alpha.")
    bucket_bytes: int = Field(BUCKET_BYTES, ge=2**16, le=2**34, description="(extension) Bytes a bucket holds at most.")
    checksum: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="(extension) The trainer's weights_checksum of the module "
        "after the update: a replica that serves another fails the update, undone everywhere.",
    )
    delta_from: str | None = Field(
        None, description="(extension) A delta: the version every replica serves, which the changed elements "
        "(`changed`, one count per tensor) are changes to.",
    )
    changed: Items[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=200_000)


class UpdateWeightsFromDistributedRequest(PackedUpdateRequest):
    """`POST /update_weights_from_distributed`: SGLang's body; the buckets are broadcast by rank 0
    of the weight-update group `group_name`."""

    group_name: str = Field("rollout", min_length=1, max_length=128)


# The names a trainer gives the shared-memory segments of its buckets (`rollout.weight_sync`): a
# replica opens no other segment.
SHARED_MEMORY_NAME = r"^rollout_ws_[A-Za-z0-9_]{1,64}$"
_IPC_BYTES = Annotated[str, Field(max_length=1024, pattern=r"^([0-9a-f]{2})*$")]


class CudaIpcBucket(BaseModel):
    """A bucket in the trainer's GPU memory: the fields of `torch.UntypedStorage._share_cuda_` for
    its storage (the byte strings as hex), which a replica on the same GPU maps."""

    model_config = ConfigDict(extra="forbid")

    handle: _IPC_BYTES
    storage_bytes: int = Field(ge=0)
    storage_offset: int = Field(ge=0)
    ref_counter_handle: _IPC_BYTES
    ref_counter_offset: int = Field(ge=0)
    event_handle: _IPC_BYTES
    event_sync_required: bool


class SharedBucketRequest(BaseModel):
    """One bucket a trainer shares with the replicas on its machine: a POSIX shared-memory segment
    (`shm_name`, for a bucket in host memory) or a CUDA IPC handle (`cuda_ipc`); exactly one."""

    model_config = ConfigDict(extra="forbid")

    shm_name: str | None = Field(None, pattern=SHARED_MEMORY_NAME)
    cuda_ipc: CudaIpcBucket | None = None


class UpdateWeightsFromSharedMemoryRequest(PackedUpdateRequest):
    """`POST /update_weights_from_shared_memory` (extension): a trainer on the replicas' machine
    packs the update's buckets into memory it shares (`rollout.weight_sync.SharedMemorySender`);
    every replica copies them out. No group, no collective."""

    buckets: Items[SharedBucketRequest] = Field(max_length=65_536, description="Each bucket's memory, in order.")


class DestroyWeightsUpdateGroupRequest(BaseModel):
    """`POST /destroy_weights_update_group`: SGLang's body."""

    model_config = ConfigDict(extra="forbid")

    group_name: str = Field("rollout", min_length=1, max_length=128)


Body = TypeVar("Body", bound=BaseModel)


def parse_body(model: type[Body], data: Any) -> Body:
    """A weight route's body, validated as SGLang's FastAPI validates it (pydantic's lax mode, no
    unknown fields); raises `RequestSchemaError` naming the first field that does not fit."""
    if not isinstance(data, dict):
        raise RequestSchemaError("body", f"must be a JSON object, got {type(data).__name__}")
    unknown = [str(key) for key in data if key not in model.model_fields]
    if unknown:
        raise _unknown_fields_error(unknown, model)
    return _validated(model, data, strict=False)


def parse_tensor_update(data: Any) -> UpdateWeightsFromTensorRequest:
    """`/update_weights_from_tensor`'s body, parsed with its tensor envelopes decoded
    (`rollout.codec.from_msgpack` or `from_json`; never unpickled)."""
    if isinstance(data, dict) and "serialized_named_tensors" in data:
        raise InvalidRequestError(
            "serialized_named_tensors",
            "are pickles, which this server never unpickles; send named_tensors as tensor envelopes (rollout.codec)",
        )
    return parse_body(UpdateWeightsFromTensorRequest, data)
