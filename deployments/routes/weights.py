"""Weights: SGLang's `/update_weights_from_disk`, `/update_weights_from_tensor` and
`/get_weights_checksum`, and the handle's methods of the same names.

Needs from the ingress: `bodies` (`BodyReader`) and `coordinator` (the `WeightCoordinator` handle).
"""

import logging

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from deployments.bodies import TENSOR_UPDATE_BODY
from deployments.http_errors import weights_refusal
from deployments.routes import route
from deployments.weights import (
    MAX_MESSAGE_CHARS,
    ChecksumWeights,
    DiskSource,
    ObjectStoreTensors,
    TensorSource,
    UpdateResult,
)
from rollout.errors import InvalidRequestError, RolloutError, WeightUpdateError, clip
from rollout.schema import (
    UpdateWeightsFromDiskRequest,
    WeightsChecksumRequest,
    parse_body,
    parse_tensor_update,
)
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

    async def get_weights_checksum(self, module_names: list[str] | None = None) -> dict[str, dict[str, str]]:
        """Handle API: per replica, the SHA-256 of each module's weights (`rollout.weights.weights_checksum`)."""
        _check_module_names(module_names)
        reports = await self.coordinator.broadcast_command.remote(ChecksumWeights(module_names))
        return {replica: report.result for replica, report in reports.items()}

    async def _update(self, source: DiskSource | TensorSource, weight_version: str | None) -> UpdateResult:
        # Every later row of every client carries the version: checked here, for HTTP and handle alike.
        if weight_version is not None and (problem := weight_version_problem(weight_version)):
            raise InvalidRequestError("weight_version", problem)
        result = await self.coordinator.update.remote(source, weight_version)
        logger.info("weight update: %s", clip(result.message, MAX_MESSAGE_CHARS))  # one short line, whatever answered
        return result

    @route("POST", "/update_weights_from_disk", operator=True)
    async def http_update_weights_from_disk(self, http_request: Request) -> Response:
        try:
            raw = await self.bodies.read(http_request)
            body = parse_body(UpdateWeightsFromDiskRequest, raw)
            result = await self._update(DiskSource(body.model_path, body.target_modules), body.weight_version)
        except RolloutError as error:
            return weights_refusal(error)
        return _weights_answer(result)

    @route("POST", "/update_weights_from_tensor", operator=True)
    async def http_update_weights_from_tensor(self, http_request: Request) -> Response:
        try:
            raw = await self.bodies.read(http_request, TENSOR_UPDATE_BODY)
            body = parse_tensor_update(raw)
            source = TensorSource(body.named_tensors, body.target_modules, body.lora_rank, body.lora_alpha)
            result = await self._update(source, body.weight_version)
        except RolloutError as error:
            return weights_refusal(error)
        return _weights_answer(result)

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


def _raise_unless_applied(result: UpdateResult) -> UpdateResult:
    if not result.success:
        raise WeightUpdateError("update", result.message)
    return result


def _weights_answer(result: UpdateResult) -> JSONResponse:
    """SGLang's answer to a weight update, with the version every replica now serves."""
    content = {"success": result.success, "message": result.message, "weight_version": result.weight_version}
    if result.failed_replicas:
        content["failed_replicas"] = result.failed_replicas
    return JSONResponse(status_code=200 if result.success else 400, content=content)
