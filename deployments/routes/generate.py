"""Sampling: SGLang's `POST /rollout/generate`, and the handle's `generate` and `stop_serving`.

Needs from the ingress: `config` (`RolloutAppConfig`), `bodies` (`BodyReader`), `dispatcher` (`Dispatcher`) and
`metrics` (`IngressMetrics`).
"""

import asyncio
import dataclasses
import json
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from deployments.bodies import MSGPACK
from deployments.dispatch import HANDLE_CLIENT, RolloutResult, StageTimes
from deployments.http_errors import (
    error_response,
    internal_error_response,
    library_error,
    status_of,
)
from deployments.routes import route
from rollout.codec import to_json, to_msgpack
from rollout.errors import clip
from rollout.plan import RolloutPlan, plan_rollout
from rollout.rows import BATCH_JSON, BATCH_MSGPACK, batch_answer, response_rows
from rollout.schema import RolloutRequest, parse_request, unknown_fields
from rollout.trajectory import RolloutBatch

logger = logging.getLogger("ray.serve")


class GenerateRoutes:
    def _plan(self, request: RolloutRequest | dict[str, Any]) -> RolloutPlan:
        validation = self.config.request_validation
        ignored = unknown_fields(request) if validation == "sglang" and isinstance(request, dict) else []
        if ignored:
            logger.warning("ignoring unknown request fields %s", [clip(name) for name in ignored[:10]])
        return plan_rollout(
            parse_request(request, validation),
            self.config.limits,
            scorers=self.config.scorers.keys(),
            max_batch_size=self.config.max_batch_size,
            max_timeout_s=self.config.request_timeout_s,
            allowed_image_paths=self.config.allowed_image_paths,
        )

    async def _planned(self, request: RolloutRequest | dict[str, Any]) -> RolloutPlan:
        """`_plan`, on a thread where the request has input images or latents to resume from:
        decoding a large one takes a while, and the ingress's event loop serves every other
        request meanwhile."""
        decoded = ("image_path", "rollout_resume_latents")
        if isinstance(request, dict):
            inputs = [request.get(name) for name in decoded]
        else:
            inputs = [getattr(request, name, None) for name in decoded]
        if all(value is None for value in inputs):
            return self._plan(request)
        return await asyncio.to_thread(self._plan, request)

    async def generate(self, request: RolloutRequest | dict[str, Any], client_id: str | None = None) -> RolloutResult:
        """Handle API: validates and dispatches; raises `InvalidRequestError` naming a bad field (a
        request over `limits.max_request_cost` among them), `OverloadedError` past `max_queued_cost`
        and the client's fair share of it, and `DeadlineExceededError` if the request's deadline
        passes before it is sent (its fetch is held to the same deadline: `RolloutResult`).
        `client_id` names the caller for the fair shares; callers without one share one share."""
        plan = None
        try:
            started = time.perf_counter()
            plan = await self._planned(request)
            planned = time.perf_counter()
            client = HANDLE_CLIENT if client_id is None else f"{HANDLE_CLIENT} {clip(client_id)}"
            result = await self.dispatcher.dispatch(plan, self.dispatcher.deadline(plan), client)
        except Exception as error:
            self.metrics.answered("handle", status_of(error), 0 if plan is None else plan.num_samples)
            raise
        # Counted once dispatched: its fetch is the trainer's, whenever it comes.
        self.metrics.answered("handle", 200, plan.num_samples)
        return dataclasses.replace(result, plan_s=planned - started)

    async def stop_serving(self) -> None:
        """Handle API, called before the application is deleted (`make serve`'s Ctrl-C): from now
        on requests are refused with `StoppingError` (503), and HTTP requests in flight that are
        not done within half of `graceful_shutdown_timeout_s` are answered so too, rather than cut
        off when Serve kills the replica."""
        self.dispatcher.stop()

    @route("POST", "/rollout/generate")
    async def http_generate(self, http_request: Request) -> Response:
        start = time.perf_counter()
        plan = None
        try:
            body = await self.bodies.read(http_request)
            read = time.perf_counter()
            plan = await self._planned(body)
            planned = time.perf_counter()
            fetched = await self.dispatcher.sampled(plan, http_client(http_request))
            batch = fetched.batch()
            sampled = time.perf_counter()
        except Exception as error:
            known = library_error(error)
            if known is not None:
                answer = error_response(known)
            else:
                request_id = plan.request_id if plan is not None else "(not planned)"
                logger.exception("rollout request %s failed", request_id)
                answer = internal_error_response(request_id)
            samples = 0 if plan is None else plan.num_samples
            self.metrics.answered("http", answer.status_code, samples, time.perf_counter() - start)
            return answer
        peak_memory_mb = max((p.peak_memory_mb for p in fetched.parts if p.peak_memory_mb is not None), default=None)
        # The response's inference_time_s: the whole request's wall time here, from reading its body
        # to its parts fetched and scored (a part's sampler call is `WorkerResult.sampler_call_s`).
        inference_time_s = time.perf_counter() - start
        request = dict(
            inference_time_s=inference_time_s,
            peak_memory_mb=peak_memory_mb,
            reward_times=fetched.reward_times,
            cost=fetched.cost(),
            request_cost=fetched.request_cost,
        )
        body, media_type = _encoded_answer(plan, batch, http_request.headers.get("accept", ""), request)
        done = time.perf_counter()
        stages = fetched.stage_times(read - start, planned - read, sampled - planned, done - sampled)
        answer = Response(body, media_type=media_type, headers=timing_headers(stages, done - start))
        self.metrics.answered("http", 200, len(batch.samples), done - start)
        self.metrics.response_bytes.inc(len(answer.body))
        return answer


def _encoded_answer(plan: RolloutPlan, batch: RolloutBatch, accept: str, request: dict[str, Any]) -> tuple[bytes, str]:
    """The answer's body and media type, as `accept` asks: the batch answer
    (`rollout.rows.batch_answer`, `rollout.client`'s), or SGLang's rows, msgpack unless JSON is asked for."""
    if BATCH_MSGPACK in accept:
        return to_msgpack(batch_answer(plan, batch, **request)), BATCH_MSGPACK
    if BATCH_JSON in accept:
        return to_json(batch_answer(plan, batch, **request)), BATCH_JSON
    rows = response_rows(plan, batch, **request)
    if "application/json" in accept:
        return to_json(rows), "application/json"
    return to_msgpack(rows), MSGPACK


def timing_headers(stages: StageTimes, total_s: float) -> dict[str, str]:
    """A request's times as headers: `x-sgld-timing`, its whole time at the ingress in milliseconds;
    `x-sgld-stages`, each `StageTimes` stage in milliseconds as a JSON object; and the same stages
    in the W3C `Server-Timing` header, which browsers' and proxies' tools read."""
    milliseconds = stages.milliseconds()
    server_timing = ", ".join(f"{name.removesuffix('_ms')};dur={ms}" for name, ms in milliseconds.items())
    return {
        "x-sgld-timing": f"{total_s * 1e3:.3f}",
        "x-sgld-stages": json.dumps(milliseconds, separators=(",", ":")),
        "server-timing": server_timing,
    }


def http_client(http_request: Request) -> str:
    """The client key of an HTTP request for the fair shares of the queue: the address it connects
    from (behind a reverse proxy, the proxy's; X-Forwarded-For is the client's to write, so it is
    not trusted)."""
    address = http_request.client
    return f"http {address.host if address is not None else 'unknown'}"
