"""`RolloutIngress`: validates requests, fans them out over the workers, assembles responses.

Two front doors share one path: HTTP (`POST /rollout/generate`, msgpack or JSON) and the
deployment handle (`generate`, for RL loops inside the cluster).
"""

# No `from __future__ import annotations` here: FastAPI must see the route parameters' real
# types, and `serve.ingress` rebuilds the routes where string annotations no longer resolve.
import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import discovery
from deployments.config import RolloutAppConfig
from deployments.worker import WorkerResult
from rollout.api import RolloutPlan, RolloutRequest, parse_request, plan_rollout, response_rows, unknown_fields
from rollout.codec import CodecError, parse_json, parse_msgpack, to_json, to_msgpack
from rollout.errors import InvalidRequestError, RequestSchemaError, RolloutError
from rollout.trajectory import RolloutBatch

logger = logging.getLogger("ray.serve")
MSGPACK = "application/msgpack"

app = FastAPI(title="diffusion rollout server")


@dataclass(frozen=True)
class RolloutResult:
    """What the handle's `generate` returns: the request's parts, still in the object store.

    The ingress never unpacks a worker's tensors on this path; `batch()` fetches the parts
    straight from the workers and joins them into one `RolloutBatch` (one schedule, samples in
    request order, sample i of prompt i // num_outputs_per_prompt).
    """

    request_id: str
    seed: int
    num_outputs_per_prompt: int
    weight_version: str
    parts: list[ray.ObjectRef]

    def worker_results(self, timeout_s: float | None = None) -> list[WorkerResult]:
        return ray.get(self.parts, timeout=timeout_s)

    async def worker_results_async(self) -> list[WorkerResult]:
        return list(await asyncio.gather(*self.parts))

    def batch(self, timeout_s: float | None = None) -> RolloutBatch:
        return _joined_batch(self.worker_results(timeout_s))

    async def batch_async(self) -> RolloutBatch:
        return _joined_batch(await self.worker_results_async())


def _joined_batch(parts: list[WorkerResult]) -> RolloutBatch:
    return RolloutBatch.concat([part.batch for part in parts])


def _error_response(status: int, field: str, message: str, detail: Any) -> JSONResponse:
    """SGLang's `detail` (FastAPI's error body) beside this server's field-naming `error`."""
    content = {"detail": detail, "error": {"field": field, "message": message}}
    return JSONResponse(status_code=status, content=content)


def _request_error_response(error: InvalidRequestError) -> JSONResponse:
    """422 for a body that does not fit the schema, 400 for a value the server cannot serve: SGLang's statuses."""
    if isinstance(error, RequestSchemaError):
        return _error_response(422, error.field, str(error), error.errors)
    return _error_response(400, error.field, str(error), f"Invalid sampling params: {error}")


def _as_rollout_error(error: BaseException) -> RolloutError | None:
    """The library error behind an exception raised in a worker replica, if there is one."""
    while error is not None:
        if isinstance(error, RolloutError) and not isinstance(error, ray.exceptions.RayError):
            return error
        error = getattr(error, "cause", None) or error.__cause__
    return None


@serve.deployment
@serve.ingress(app)
class RolloutIngress:
    def __init__(self, worker: DeploymentHandle, config: RolloutAppConfig):
        self.worker = worker
        self.config = config
        self._worker_info: dict | None = None
        self._started = int(time.time())

    def _plan(self, request: RolloutRequest | dict[str, Any]) -> RolloutPlan:
        validation = self.config.request_validation
        ignored = unknown_fields(request) if validation == "sglang" and isinstance(request, dict) else []
        if ignored:
            logger.warning("ignoring unknown request fields %s", ignored[:10])
        return plan_rollout(parse_request(request, validation), self.config.limits)

    async def _dispatch(self, plan: RolloutPlan) -> list[ray.ObjectRef]:
        """Sends the plan's work to the workers; references to their results, in sample order."""
        # Chunks small enough that every replica gets a share, and no larger than a worker batch.
        per_replica = math.ceil(plan.num_samples / self.config.num_worker_replicas)
        chunk_size = max(1, min(self.config.max_batch_size, per_replica))
        refs = []
        for work in plan.work(chunk_size):
            # Waiting for each chunk's replica assignment lets the router see that replica's
            # new load before it places the next chunk, which spreads a request's chunks.
            refs.append(await self.worker.generate.remote(work)._to_object_ref())
        return refs

    async def _result(self, plan: RolloutPlan) -> RolloutResult:
        parts = await self._dispatch(plan)
        return RolloutResult(plan.request_id, plan.seed, plan.num_outputs_per_prompt, self.config.weight_version, parts)

    async def generate(self, request: RolloutRequest | dict[str, Any]) -> RolloutResult:
        """Handle API: validates and fans out; raises `InvalidRequestError` naming a bad field."""
        return await self._result(self._plan(request))

    async def info(self) -> dict:
        if self._worker_info is None:
            self._worker_info = await self.worker.info.remote()
        return {**self._worker_info, "limits": self.config.limits.model_dump(), "max_batch_size": self.config.max_batch_size}

    @app.get("/health")
    @app.get("/liveness")  # SGLang's name
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/rollout/info")
    async def http_info(self) -> dict:
        return await self.info()

    # SGLang's discovery endpoints, which trainers and SGLang's model gateway call.
    @app.get("/model_info")
    async def model_info(self) -> dict:
        return discovery.model_info(await self.info())

    @app.get("/server_info")
    async def server_info(self) -> dict:
        return discovery.server_info(await self.info(), self.config)

    @app.get("/v1/models")
    async def models(self) -> dict:
        return discovery.model_list(await self.info(), self.config, self._started)

    @app.post("/rollout/generate")
    async def http_generate(self, http_request: Request) -> Response:
        start = time.perf_counter()
        body = await http_request.body()
        try:
            data = (parse_msgpack if MSGPACK in http_request.headers.get("content-type", "") else parse_json)(body)
            plan = self._plan(data)
            result = await self._result(plan)
            parts = await result.worker_results_async()
            batch = _joined_batch(parts)
        except CodecError as error:
            # FastAPI answers a body that does not parse with 422, and so does SGLang.
            detail = [{"type": "json_invalid", "loc": ["body"], "msg": str(error)}]
            return _error_response(422, "body", str(error), detail)
        except Exception as error:
            rollout_error = _as_rollout_error(error)
            if isinstance(rollout_error, InvalidRequestError):
                return _request_error_response(rollout_error)
            logger.exception("rollout request failed")
            message = f"{type(error).__name__}: {error}"
            return _error_response(500, "", message, f"Generation failed: {message}")
        peak_memory_mb = max((p.peak_memory_mb for p in parts if p.peak_memory_mb is not None), default=None)
        rows = response_rows(plan, batch, self.config.weight_version, time.perf_counter() - start, peak_memory_mb)
        if "application/json" in http_request.headers.get("accept", ""):
            return Response(to_json(rows), media_type="application/json")
        return Response(to_msgpack(rows), media_type=MSGPACK)
