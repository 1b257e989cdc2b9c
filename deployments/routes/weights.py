"""Weights: SGLang's `/update_weights_from_disk`, `/update_weights_from_tensor`,
`/get_weights_checksum`, and its weight-update group (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/destroy_weights_update_group`), `/update_weights_from_shared_memory`
for a trainer on the replicas' machine (extension), and the handle's methods of the same names.

Needs from the ingress: `bodies` (`BodyReader`) and `coordinator` (the `WeightCoordinator` handle).
"""

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deployments.bodies import TENSOR_UPDATE_BODY
from deployments.http_errors import weights_refusal
from deployments.routes import route
from deployments.weights import (
    MAX_MESSAGE_CHARS,
    ChecksumWeights,
    DiskSource,
    GroupSource,
    ObjectStoreTensors,
    PackedSource,
    SharedMemorySource,
    TensorSource,
    UpdateResult,
    WeightGroupAddress,
)
from rollout.errors import InvalidRequestError, RolloutError, WeightUpdateError, clip
from rollout.schema import (
    BUCKET_BYTES,
    DestroyWeightsUpdateGroupRequest,
    InitWeightsUpdateGroupRequest,
    PackedUpdateRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromSharedMemoryRequest,
    WeightsChecksumRequest,
    parse_body,
    parse_tensor_update,
)
from rollout.weight_sync import SharedBucket, iter_specs
from rollout.weights import weight_version_problem

logger = logging.getLogger("ray.serve")
# A pipeline has a few modules; a checksum request naming more is not a real one, and its answer
# (every name, for every replica) would be larger than it.
MAX_CHECKSUM_MODULE_NAMES = 100


class WeightRoutes:
    async def update_weights_from_disk(
        self,
        model_path: str,
        weight_version: str | None = None,
        target_modules: list[str] | None = None,
    ) -> UpdateResult:
        """Handle API: serves a local checkpoint on every replica; raises `WeightUpdateError` naming the cause."""
        return _raise_unless_applied(await self._update(DiskSource(model_path, target_modules), weight_version))

    async def update_weights_from_tensor(
        self,
        tensors: ObjectStoreTensors,
        weight_version: str | None = None,
        target_modules: list[str] | None = None,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
    ) -> UpdateResult:
        """Handle API: serves tensors a trainer put in the object store once (full weights, or a
        LoRA adapter with `lora_rank` and `lora_alpha`); raises `WeightUpdateError` naming the cause."""
        if not isinstance(tensors, ObjectStoreTensors):
            raise WeightUpdateError("tensors", "pass ObjectStoreTensors(ray.put(named_tensors))")
        source = TensorSource(tensors, target_modules, lora_rank, lora_alpha)
        return _raise_unless_applied(await self._update(source, weight_version))

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "rollout",
        backend: str = "gloo",
        timeout_s: float | None = None,
    ) -> UpdateResult:
        """Handle API: every worker replica joins the trainer's weight-update group (`rollout.weight_sync`);
        raises `WeightUpdateError` naming the cause."""
        body = parse_body(InitWeightsUpdateGroupRequest, dict(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend, timeout_s=timeout_s,
        ))  # fmt: skip
        return _raise_unless_applied(await self._init_group(body))

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "rollout",
        weight_version: str | None = None,
        target_modules: list[str] | None = None,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        checksum: str | None = None,
        delta_from: str | None = None,
        changed: list[int] | None = None,
    ) -> UpdateResult:
        """Handle API: every replica receives the tensors the trainer broadcasts over the group and
        serves them, all or none; raises `WeightUpdateError` naming the cause."""
        fields = dict(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, weight_version=weight_version,
            target_modules=target_modules, lora_rank=lora_rank, lora_alpha=lora_alpha, bucket_bytes=bucket_bytes,
            checksum=checksum, delta_from=delta_from, changed=changed,
        )  # fmt: skip
        return _raise_unless_applied(await self._packed_update(UpdateWeightsFromDistributedRequest, fields))

    async def update_weights_from_shared_memory(self, buckets: list[dict], **fields: Any) -> UpdateResult:
        """Handle API: every replica copies out the buckets a trainer on its machine shares
        (`rollout.weight_sync.SharedMemorySender`) and serves them, all or none; `fields` are
        `update_weights_from_distributed`'s but `group_name`. Raises `WeightUpdateError` naming the cause."""
        fields = {**fields, "buckets": buckets}
        return _raise_unless_applied(await self._packed_update(UpdateWeightsFromSharedMemoryRequest, fields))

    async def _packed_update(self, request: type[PackedUpdateRequest], fields: Any) -> UpdateResult:
        """An update packed in buckets, its fields (a handle's arguments, an HTTP body) checked as `request`."""
        body = parse_body(request, fields)
        return await self._update(_packed_source(body), body.weight_version)

    async def destroy_weights_update_group(self, group_name: str = "rollout") -> UpdateResult:
        """Handle API: every replica leaves the group."""
        body = parse_body(DestroyWeightsUpdateGroupRequest, {"group_name": group_name})
        return _raise_unless_applied(await self.coordinator.destroy_weight_group.remote(body.group_name))

    async def _init_group(self, body: InitWeightsUpdateGroupRequest) -> UpdateResult:
        address = WeightGroupAddress(
            body.master_address,
            body.master_port,
            body.rank_offset,
            body.world_size,
            body.group_name,
            body.backend,
            body.timeout_s,
        )
        result = await self.coordinator.init_weight_group.remote(address)
        logger.info("weight-update group: %s", clip(result.message, MAX_MESSAGE_CHARS))
        return result

    async def get_weights_checksum(self, module_names: list[str] | None = None) -> dict[str, dict[str, str]]:
        """Handle API: per replica, the SHA-256 of each module's weights (`rollout.weights.weights_checksum`)."""
        _check_module_names(module_names)
        reports = await self.coordinator.broadcast_command.remote(ChecksumWeights(module_names))
        return {replica: report.result for replica, report in reports.items()}

    async def _update(self, source: DiskSource | TensorSource | PackedSource, weight_version: str | None) -> UpdateResult:
        # Every later row of every client carries the version: checked here, for HTTP and handle alike.
        if weight_version is not None and (problem := weight_version_problem(weight_version)):
            raise InvalidRequestError("weight_version", problem)
        result = await self.coordinator.update.remote(source, weight_version)
        logger.info("weight update: %s", clip(result.message, MAX_MESSAGE_CHARS))  # one short line, whatever answered
        return result

    @route("POST", "/update_weights_from_disk", operator=True)
    async def http_update_weights_from_disk(self, http_request: Request) -> Response:
        async def update() -> UpdateResult:
            body = parse_body(UpdateWeightsFromDiskRequest, await self.bodies.read(http_request))
            return await self._update(DiskSource(body.model_path, body.target_modules), body.weight_version)

        return await _answered(update)

    @route("POST", "/update_weights_from_tensor", operator=True)
    async def http_update_weights_from_tensor(self, http_request: Request) -> Response:
        async def update() -> UpdateResult:
            body = parse_tensor_update(await self.bodies.read(http_request, TENSOR_UPDATE_BODY))
            source = TensorSource(body.named_tensors, body.target_modules, body.lora_rank, body.lora_alpha)
            return await self._update(source, body.weight_version)

        return await _answered(update)

    @route("POST", "/init_weights_update_group", operator=True)
    async def http_init_weights_update_group(self, http_request: Request) -> Response:
        async def init() -> UpdateResult:
            return await self._init_group(parse_body(InitWeightsUpdateGroupRequest, await self.bodies.read(http_request)))

        return await _answered(init)

    @route("POST", "/update_weights_from_distributed", operator=True)
    async def http_update_weights_from_distributed(self, http_request: Request) -> Response:
        async def update() -> UpdateResult:
            return await self._packed_update(UpdateWeightsFromDistributedRequest, await self.bodies.read(http_request))

        return await _answered(update)

    @route("POST", "/update_weights_from_shared_memory", operator=True)
    async def http_update_weights_from_shared_memory(self, http_request: Request) -> Response:
        async def update() -> UpdateResult:
            return await self._packed_update(UpdateWeightsFromSharedMemoryRequest, await self.bodies.read(http_request))

        return await _answered(update)

    @route("POST", "/destroy_weights_update_group", operator=True)
    async def http_destroy_weights_update_group(self, http_request: Request) -> Response:
        async def destroy() -> UpdateResult:
            body = parse_body(DestroyWeightsUpdateGroupRequest, (await self.bodies.read(http_request)) or {})
            return await self.coordinator.destroy_weight_group.remote(body.group_name)

        return await _answered(destroy)

    @route("POST", "/get_weights_checksum", operator=True)
    async def http_get_weights_checksum(self, http_request: Request) -> Response:
        try:
            raw = await self.bodies.read(http_request)
            body = parse_body(WeightsChecksumRequest, raw or {})
            per_replica = await self.get_weights_checksum(body.module_names)
        except RolloutError as error:
            return weights_refusal(error)
        # SGLang's answer is {module: checksum}; replicas that disagree are reported as such.
        agreed = {}
        for name in sorted({name for checksums in per_replica.values() for name in checksums}):
            values = {checksums.get(name) for checksums in per_replica.values()}
            agreed[name] = values.pop() if len(values) == 1 else "inconsistent"
        return JSONResponse({**agreed, "replicas": per_replica})


def _check_module_names(module_names: list[str] | None) -> None:
    if module_names is not None and len(module_names) > MAX_CHECKSUM_MODULE_NAMES:
        limit = MAX_CHECKSUM_MODULE_NAMES
        raise InvalidRequestError(
            "module_names", f"at most {limit} names (a pipeline has few), got {len(module_names)}"
        )


def _packed_source(body: PackedUpdateRequest) -> PackedSource:
    fields = dict(
        specs=tuple(iter_specs(body.names, body.dtypes, body.shapes)),
        bucket_bytes=body.bucket_bytes,
        target_modules=body.target_modules,
        lora_rank=body.lora_rank,
        lora_alpha=body.lora_alpha,
        checksum=body.checksum,
        delta_from=body.delta_from,
        changed=None if body.changed is None else tuple(body.changed),
    )
    if isinstance(body, UpdateWeightsFromDistributedRequest):
        return GroupSource(group_name=body.group_name, **fields)
    buckets = tuple(SharedBucket.of_request(bucket, f"buckets[{k}]") for k, bucket in enumerate(body.buckets))
    return SharedMemorySource(buckets=buckets, **fields)


def _raise_unless_applied(result: UpdateResult) -> UpdateResult:
    if not result.success:
        raise WeightUpdateError("update", result.message)
    return result


async def _answered(change: Callable[[], Awaitable[UpdateResult]]) -> Response:
    """SGLang's answer to a route that changes the served weights, or its refusal (4xx)."""
    try:
        return _weights_answer(await change())
    except RolloutError as error:
        return weights_refusal(error)


def _weights_answer(result: UpdateResult) -> JSONResponse:
    """SGLang's answer to a weight update, with the version every replica now serves."""
    content = {"success": result.success, "message": result.message, "weight_version": result.weight_version}
    if result.failed_replicas:
        content["failed_replicas"] = result.failed_replicas
    if result.checksums:
        content["checksums"] = result.checksums
    return JSONResponse(status_code=200 if result.success else 400, content=content)
