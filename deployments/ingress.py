"""`RolloutIngress`: validates requests, fans them out over the workers, assembles responses.

Two front doors share one path: HTTP (`POST /rollout/generate`, msgpack or JSON) and the
deployment handle (`generate`, for RL loops inside the cluster).
"""

# No `from __future__ import annotations` here: FastAPI must see the route parameters' real
# types, and `serve.ingress` rebuilds the routes where string annotations no longer resolve.
import asyncio
import logging
import math
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ReplicaState

from deployments import discovery
from deployments.auth import bearer_refusal, require_bearer_token
from deployments.config import RolloutAppConfig
from deployments.errors import (
    DeadlineExceededError,
    OverloadedError,
    ServiceUnavailableError,
    StoppingError,
    WorkerLostError,
    error_response,
)
from deployments.load import outstanding_samples
from deployments.probes import ProbeServer
from deployments.worker import WorkerResult
from deployments.weights import (
    DiskSource,
    MemoryReleasedError,
    ObjectStoreTensors,
    TensorSource,
    UpdateResult,
    WeightVersionError,
)
from rollout.api import (
    RolloutPlan,
    RolloutRequest,
    SamplingWork,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromTensorRequest,
    WeightsChecksumRequest,
    parse_request,
    plan_rollout,
    response_rows,
    unknown_fields,
)
from rollout.codec import CodecError, decode_tree, parse_json, parse_msgpack, to_json, to_msgpack
from rollout.errors import FieldError, InvalidRequestError, RequestSchemaError, RolloutError, clip
from rollout.weights import WeightUpdateError
from rollout.trajectory import RolloutBatch

logger = logging.getLogger("ray.serve")
MSGPACK = "application/msgpack"
HEALTH_TTL_S = 1.0
# The probe port's first /health waits this long for the first status read (later ones never wait).
FIRST_STATUS_WAIT_S = 5.0
LIVE = {"status": "ok"}
T = TypeVar("T")

app = FastAPI(title="diffusion rollout server")
require_bearer_token(app)


# What a lost worker replica (or a lost ingress, which owned the references) looks like to a caller.
_LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


@dataclass(frozen=True)
class RolloutResult:
    """What the handle's `generate` returns: the request's parts, still in the object store.

    The ingress never unpacks a worker's tensors on this path; `batch()` fetches the parts
    straight from the workers and joins them into one `RolloutBatch` (one schedule, samples in
    request order, sample i of prompt i // num_outputs_per_prompt).

    A part whose worker replica died, or whose reference died with the ingress replica that
    owned it, is sampled again through `worker` by whoever fetches it: sampling is seeded, so the
    samples are bit-identical. After `max_attempts` tries, `WorkerLostError` (retryable).
    """

    request_id: str
    seed: int
    num_outputs_per_prompt: int
    parts: list[ray.ObjectRef]
    works: list[SamplingWork]
    worker: DeploymentHandle
    max_attempts: int

    def worker_results(self, timeout_s: float | None = None) -> list[WorkerResult]:
        return [self._fetched(ref, work, timeout_s) for ref, work in zip(self.parts, self.works)]

    async def worker_results_async(self) -> list[WorkerResult]:
        return list(await asyncio.gather(*(self._fetched_async(ref, work) for ref, work in zip(self.parts, self.works))))

    def batch(self, timeout_s: float | None = None) -> RolloutBatch:
        return _joined_batch(self.worker_results(timeout_s))

    async def batch_async(self) -> RolloutBatch:
        return _joined_batch(await self.worker_results_async())

    def _fetched(self, ref: ray.ObjectRef, work: SamplingWork, timeout_s: float | None) -> WorkerResult:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return ray.get(ref, timeout=timeout_s)
            except _LOST as error:
                self._give_up_after(attempt, error)
            ref = self.worker.generate.remote(work)._to_object_ref_sync(_timeout_s=timeout_s)

    async def _fetched_async(self, ref: ray.ObjectRef, work: SamplingWork) -> WorkerResult:
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await ref
            except _LOST as error:
                self._give_up_after(attempt, error)
            ref = await self.worker.generate.remote(work)._to_object_ref()

    def _give_up_after(self, attempt: int, error: Exception) -> None:
        logger.warning("request %s: a part was lost (%s), attempt %d of %d", self.request_id, type(error).__name__, attempt, self.max_attempts)
        if attempt == self.max_attempts:
            raise WorkerLostError(
                f"the worker replicas sampling this request were lost {attempt} times; send it again"
            ) from None


class BodyTooLargeError(FieldError):
    """A request body over its limit in the app config (HTTP 413); refused before the rest is read."""


async def _json_body(http_request: Request, config: RolloutAppConfig, limit_name: str = "max_request_body_bytes") -> Any:
    """The body, parsed; raises `BodyTooLargeError` as soon as it is known to be over `config.<limit_name>`."""
    limit = getattr(config, limit_name)
    too_large = f"larger than the limit of {limit} bytes ({limit_name} in the app config)"
    declared = http_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError("body", too_large)
    # Read chunk by chunk, since a chunked body declares no length.
    body = bytearray()
    async for chunk in http_request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLargeError("body", too_large)
    return (parse_msgpack if MSGPACK in http_request.headers.get("content-type", "") else parse_json)(body)


def _weights_refusal(error: Exception) -> JSONResponse:
    if isinstance(error, ValidationError):
        problem = error.errors(include_url=False)[0]
        message = f"{clip('.'.join(map(str, problem['loc']))) or 'body'}: {problem['msg']}"
    else:
        message = str(error)
    status = 413 if isinstance(error, BodyTooLargeError) else 400
    return JSONResponse(status_code=status, content={"success": False, "message": message})


def _cancel(refs: list[ray.ObjectRef]) -> None:
    """Cancels the parts still queued on the workers (a part being sampled finishes)."""
    for ref in refs:
        ray.cancel(ref)


def _joined_batch(parts: list[WorkerResult]) -> RolloutBatch:
    return RolloutBatch.concat([part.batch for part in parts])


def _rollout_error_response(error: RolloutError) -> JSONResponse:
    """422 for a body that does not fit the schema, 400 for a value the server cannot serve (SGLang's
    statuses); 413 for a body over the size limit; 409 for a request that requires other weights;
    503 while the memory is released."""
    if isinstance(error, BodyTooLargeError):
        return error_response(413, error.field, str(error), str(error))
    if isinstance(error, RequestSchemaError):
        return error_response(422, error.field, str(error), error.errors)
    if isinstance(error, InvalidRequestError):
        return error_response(400, error.field, str(error), f"Invalid sampling params: {error}")
    if isinstance(error, WeightVersionError):
        return error_response(409, error.field, str(error), str(error))
    if isinstance(error, MemoryReleasedError):
        return error_response(503, "", str(error), "Server is sleeping. Call resume_memory_occupation first.")
    if isinstance(error, DeadlineExceededError):
        return error_response(504, "rollout_timeout_s", str(error), str(error))
    if isinstance(error, ServiceUnavailableError):
        retry_after = {"Retry-After": str(error.retry_after_s)}
        return error_response(503, "", str(error), f"Service unavailable: {error}", retry_after)
    return error_response(500, "", str(error), f"Generation failed: {error}")


def _health_answer(running_workers: int | None) -> JSONResponse:
    if running_workers is None:
        reason = "the worker replicas' status could not be read yet"
    elif running_workers == 0:
        reason = "no worker replica is running"
    else:
        return JSONResponse({"status": "ok", "worker_replicas_running": running_workers})
    return JSONResponse(status_code=503, content={"status": "unhealthy", "reason": reason})


def _internal_error_response(request_id: str) -> JSONResponse:
    """A failure this server did not expect: logged in full, answered without internals (actor ids,
    addresses, tracebacks)."""
    message = f"internal error while serving request {request_id}; the server log has the details"
    return error_response(500, "", message, f"Generation failed: {message}")


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
    async def __init__(self, worker: DeploymentHandle, coordinator: DeploymentHandle, config: RolloutAppConfig):
        self.worker = worker
        self.coordinator = coordinator
        self.config = config
        self._worker_info: dict | None = None
        self._started = int(time.time())
        self._routing_samples = 0  # admitted, not yet placed on a worker replica
        self._workers_checked_at = -math.inf
        self._running: int | None = None
        self._status_read: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._status_known = threading.Event()
        self._probes = None if config.probe_port is None else ProbeServer(config.probe_host, config.probe_port, self._probe)

    def __del__(self):
        if self._probes is not None:
            self._probes.close()

    def _plan(self, request: RolloutRequest | dict[str, Any]) -> RolloutPlan:
        validation = self.config.request_validation
        ignored = unknown_fields(request) if validation == "sglang" and isinstance(request, dict) else []
        if ignored:
            logger.warning("ignoring unknown request fields %s", [clip(name) for name in ignored[:10]])
        return plan_rollout(parse_request(request, validation), self.config.limits)

    def _admit(self, samples: int) -> None:
        """Counts `samples` as queued, or refuses them if the queue would pass its limit (a request
        larger than the limit is still admitted to an empty queue)."""
        if self._stopping.is_set():
            raise StoppingError("the server is stopping; send it again once it is back")
        queued = outstanding_samples() + self._routing_samples
        limit = self.config.queued_samples_limit()
        if queued and queued + samples > limit:
            raise OverloadedError(
                f"{queued} samples are queued and this request adds {samples}, over the limit of {limit} "
                "(max_queued_samples in the app config); send it again shortly"
            )
        self._routing_samples += samples

    def _deadline(self, plan: RolloutPlan) -> float:
        return time.time() + (plan.request.rollout_timeout_s or self.config.request_timeout_s)

    async def _result(self, plan: RolloutPlan, deadline: float) -> RolloutResult:
        """Sends the plan's work to the workers; references to their results, in sample order.
        Interrupted (a client gone, a deadline passed), it cancels the work it already sent."""
        # Chunks small enough that every replica gets a share, and no larger than a worker batch.
        per_replica = math.ceil(plan.num_samples / self.config.num_worker_replicas)
        chunk_size = max(1, min(self.config.max_batch_size, per_replica))
        works = list(plan.work(chunk_size, deadline=deadline))
        self._admit(plan.num_samples)
        refs = []
        try:
            for work in works:
                # Waiting for each chunk's replica assignment lets the router see that replica's
                # new load before it places the next chunk, which spreads a request's chunks.
                refs.append(await self.worker.generate.remote(work)._to_object_ref())
                self._routing_samples -= len(work)  # the router counts them from here on
        except BaseException:
            _cancel(refs)
            raise
        finally:
            self._routing_samples -= sum(len(work) for work in works[len(refs):])
        attempts = self.config.worker_retry_attempts
        return RolloutResult(plan.request_id, plan.seed, plan.num_outputs_per_prompt, refs, works, self.worker, attempts)

    async def _served(self, plan: RolloutPlan, deadline: float) -> list[WorkerResult]:
        """The plan's parts, sampled and fetched by the ingress (the HTTP path); interrupted, the
        work still queued on the workers is cancelled."""
        result = await self._result(plan, deadline)
        try:
            return await result.worker_results_async()
        except BaseException:
            _cancel(result.parts)
            raise

    async def _in_time(self, work: Awaitable[T], deadline: float) -> T:
        """`work`'s result, unless its deadline passes first (`DeadlineExceededError`) or the server
        stops and it does not finish within half the shutdown grace (`StoppingError`, so that
        the answer comes before Serve kills this replica). Either way, or when the client goes away
        (Serve then cancels this coroutine), `work` is cancelled."""
        task = asyncio.ensure_future(work)
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopping}, timeout=max(0.0, deadline - time.time()), return_when=asyncio.FIRST_COMPLETED)
            if stopping.done() and not task.done():
                grace = min(self.config.graceful_shutdown_timeout_s / 2, max(0.0, deadline - time.time()))
                await asyncio.wait({task}, timeout=grace)
            if task.done():
                return task.result()
            if stopping.done():
                raise StoppingError("the server stopped before this request was sampled; send it again once it is back")
            raise DeadlineExceededError("the request's deadline passed (rollout_timeout_s or request_timeout_s)")
        finally:
            task.cancel()
            stopping.cancel()

    async def generate(self, request: RolloutRequest | dict[str, Any]) -> RolloutResult:
        """Handle API: validates and fans out; raises `InvalidRequestError` naming a bad field."""
        plan = self._plan(request)
        return await self._result(plan, self._deadline(plan))

    async def stop_serving(self) -> None:
        """Handle API, called before the application is deleted (`make serve`'s Ctrl-C): from now
        on requests are refused with `StoppingError` (503), and HTTP requests in flight that are
        not done within half of `graceful_shutdown_timeout_s` are answered so too, rather than cut
        off when Serve kills the replica."""
        self._stopping.set()

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
        reports = await self.coordinator.run_on_all.remote("checksum", module_names)
        return {replica: report.result for replica, report in reports.items()}

    async def _update(self, source, weight_version: str | None) -> UpdateResult:
        result = await self.coordinator.update.remote(source, weight_version)
        logger.info("weight update: %s", result.message)
        return result

    async def info(self) -> dict:
        if self._worker_info is None:
            self._worker_info = await self.worker.info.remote()
        weights = await self.coordinator.state.remote()
        return {
            **self._worker_info,
            "weight_version": weights["weight_version"],
            "replica_weight_versions": weights["replicas"],
            "limits": self.config.limits.model_dump(),
            "max_batch_size": self.config.max_batch_size,
        }

    @app.get("/liveness")  # SGLang's name: the process answers
    async def liveness(self) -> dict:
        return LIVE

    @app.get("/health")
    async def health(self) -> Response:
        """Whether requests can be served: some worker replica runs (a replica whose pipeline
        broke fails Serve's health check and stops counting). Answered from the last status read,
        which is renewed in the background when it is over `HEALTH_TTL_S` old, so that the answer
        never waits for Serve's controller, however loaded."""
        self._renew_status_if_stale()
        if self._running is None:  # nothing read yet
            await asyncio.shield(self._status_read)
        return _health_answer(self._running)

    def _probe(self, path: str, authorization: str | None) -> Response:
        """The probe port's answer (`deployments/probes.py`), on the probe thread: the same
        routes, token and status as Serve's port."""
        refusal = bearer_refusal(path, authorization, self.config.auth_token)
        if refusal is not None:  # before the 404, as on Serve's port: no route is shown without the token
            return refusal
        if path not in ("/health", "/liveness"):
            return error_response(404, "path", f"the probe port answers /health and /liveness, not {clip(path)}", "Not Found")
        if path == "/liveness":
            return JSONResponse(LIVE)
        if self._status_stale():  # the event loop is woken only when there is a read to start
            self._loop.call_soon_threadsafe(self._renew_status_if_stale)
        self._status_known.wait(FIRST_STATUS_WAIT_S)
        return _health_answer(self._running)

    def _status_stale(self) -> bool:
        return time.monotonic() - self._workers_checked_at > HEALTH_TTL_S

    def _renew_status_if_stale(self) -> None:
        if self._status_stale() and (self._status_read is None or self._status_read.done()):
            self._status_read = asyncio.create_task(self._read_running_workers())

    async def _read_running_workers(self) -> None:
        try:
            status = await asyncio.to_thread(serve.status)
        except Exception:
            logger.exception("could not read the application's status")
            return
        workers = status.applications[serve.get_replica_context().app_name].deployments["RolloutWorker"]
        self._running = workers.replica_states.get(ReplicaState.RUNNING, 0)
        self._workers_checked_at = time.monotonic()
        self._status_known.set()

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

    # SGLang's weight endpoints ---------------------------------------------------------------

    @app.post("/update_weights_from_disk")
    async def http_update_weights_from_disk(self, http_request: Request) -> Response:
        try:
            body = UpdateWeightsFromDiskRequest.model_validate(await _json_body(http_request, self.config))
        except (CodecError, ValidationError, BodyTooLargeError) as error:
            return _weights_refusal(error)
        source = DiskSource(body.model_path, body.target_modules)
        return _weights_answer(await self._update(source, body.weight_version))

    @app.post("/update_weights_from_tensor")
    async def http_update_weights_from_tensor(self, http_request: Request) -> Response:
        try:
            raw = await _json_body(http_request, self.config, "max_weight_update_body_bytes")
            if isinstance(raw, dict) and "serialized_named_tensors" in raw:
                raise CodecError(
                    "serialized_named_tensors are pickles, which this server never unpickles; "
                    "send named_tensors as tensor envelopes (rollout.codec)"
                )
            body = UpdateWeightsFromTensorRequest.model_validate(decode_tree(raw))
        except (CodecError, ValidationError, BodyTooLargeError) as error:
            return _weights_refusal(error)
        source = TensorSource(body.named_tensors, body.target_modules, body.lora_rank, body.lora_alpha)
        return _weights_answer(await self._update(source, body.weight_version))

    @app.post("/get_weights_checksum")
    async def http_get_weights_checksum(self, http_request: Request) -> Response:
        try:
            body = WeightsChecksumRequest.model_validate(await _json_body(http_request, self.config) or {})
        except (CodecError, ValidationError, BodyTooLargeError) as error:
            return _weights_refusal(error)
        per_replica = await self.get_weights_checksum(body.module_names)
        # SGLang's answer is {module: checksum}; replicas that disagree are reported as such.
        agreed = {}
        for name in sorted({name for checksums in per_replica.values() for name in checksums}):
            values = {checksums.get(name) for checksums in per_replica.values()}
            agreed[name] = values.pop() if len(values) == 1 else "inconsistent"
        return JSONResponse({**agreed, "replicas": per_replica})

    @app.post("/release_memory_occupation")
    async def http_release_memory_occupation(self) -> Response:
        return await self._memory_occupation("release")

    @app.post("/resume_memory_occupation")
    async def http_resume_memory_occupation(self) -> Response:
        return await self._memory_occupation("resume")

    async def _memory_occupation(self, kind: str) -> Response:
        reports = await self.coordinator.run_on_all.remote(kind)
        success = all(report.ok for report in reports.values())
        messages = sorted({report.message for report in reports.values()})
        return JSONResponse(
            status_code=200 if success else 400, content={"success": success, "message": "; ".join(messages)}
        )

    @app.post("/rollout/generate")
    async def http_generate(self, http_request: Request) -> Response:
        start = time.perf_counter()
        plan = None
        try:
            plan = self._plan(await _json_body(http_request, self.config))
            deadline = self._deadline(plan)
            parts = await self._in_time(self._served(plan, deadline), deadline)
            batch = _joined_batch(parts)
        except CodecError as error:
            # FastAPI answers a body that does not parse with 422, and so does SGLang.
            detail = [{"type": "json_invalid", "loc": ["body"], "msg": str(error)}]
            return error_response(422, "body", str(error), detail)
        except Exception as error:
            rollout_error = _as_rollout_error(error)
            if rollout_error is not None:
                return _rollout_error_response(rollout_error)
            request_id = plan.request_id if plan is not None else "(not planned)"
            logger.exception("rollout request %s failed", request_id)
            return _internal_error_response(request_id)
        peak_memory_mb = max((p.peak_memory_mb for p in parts if p.peak_memory_mb is not None), default=None)
        rows = response_rows(plan, batch, time.perf_counter() - start, peak_memory_mb)
        if "application/json" in http_request.headers.get("accept", ""):
            return Response(to_json(rows), media_type="application/json")
        return Response(to_msgpack(rows), media_type=MSGPACK)
