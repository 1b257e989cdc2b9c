"""Health: `GET /liveness` (the process answers) and `GET /health` (requests can be served: some
worker replica runs), on Serve's port and on the probe port (`deployments/probes.py`).

`/health` answers from the last read of the worker replicas' status, renewed in the background
once it is `HEALTH_TTL_S` old, so that an answer never waits for Serve's controller, however
loaded. A replica whose pipeline broke (its sampler calls fail, or give only NaN) fails Serve's
health check and stops counting; the answer says how many replicas are not running, by state,
while Serve replaces it.

The probe port's process (`deployments/probes.py`) answers `/liveness` itself and `/health` from
the answer published after each status read, while the event loop's heartbeat is younger than
`STALE_AFTER_S`; it asks `probe` for anything else.

Needs from the ingress: `config` and `worker_status` (`WorkerStatus`).
"""

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from fastapi.responses import JSONResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import ReplicaState

from deployments.auth import bearer_refusal
from deployments.http_errors import json_error
from deployments.probes import HEARTBEAT_S, ProbeServer
from deployments.routes import route
from rollout.errors import clip

logger = logging.getLogger("ray.serve")
HEALTH_TTL_S = 1.0
# The probe port's first /health waits this long for the first status read (later ones never wait).
FIRST_STATUS_WAIT_S = 5.0
LIVE = {"status": "ok"}
# The probe port's /health answers 503 once the ingress's event loop has not run for this long. Under
# a burst of 150 requests of 32 samples on 2 cores (benchmarks/probe_burst.py) the heartbeat, written
# every HEARTBEAT_S (1 s), was at most 1.0 s old when read: a loop 10 s behind is stuck, not busy.
STALE_AFTER_S = 10.0


class WorkerStatus:
    """How many worker replicas run, and how many are in each other state (starting, stopping), as
    last read from Serve (`running` is None until the first read).

    Read on the ingress's event loop; the probe thread asks through `renew_from_another_thread`,
    which wakes the loop only when the status is stale.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, workers: DeploymentHandle):
        # Read from the handle: the deployment that the ingress sends its work to.
        self._workers = (workers.app_name, workers.deployment_name)
        self.running: int | None = None
        self.not_running: dict[str, int] = {}
        self._loop = loop
        self._checked_at = -float("inf")
        self._read: asyncio.Task | None = None
        self._known = threading.Event()
        self.on_read: Callable[[], None] | None = None  # called on the loop after each read

    def stale(self) -> bool:
        return time.monotonic() - self._checked_at > HEALTH_TTL_S

    def renew_if_stale(self) -> None:
        if self.stale() and (self._read is None or self._read.done()):
            self._read = asyncio.create_task(self._read_running_workers())

    async def first_read(self) -> None:
        """Waits for a read, if none has completed yet."""
        self.renew_if_stale()
        if self.running is None:
            await asyncio.shield(self._read)

    def renew_soon(self) -> None:
        """From another thread: has the loop renew the status if it is stale, without waiting."""
        if self.stale():
            self._loop.call_soon_threadsafe(self.renew_if_stale)

    def renew_from_another_thread(self) -> None:
        self.renew_soon()
        self._known.wait(FIRST_STATUS_WAIT_S)

    async def _read_running_workers(self) -> None:
        try:
            status = await asyncio.to_thread(serve.status)
        except Exception:
            logger.exception("could not read the application's status")
            return
        app_name, deployment_name = self._workers
        workers = status.applications[app_name].deployments[deployment_name]
        self.running = workers.replica_states.get(ReplicaState.RUNNING, 0)
        self.not_running = {
            ReplicaState(state).value: count
            for state, count in workers.replica_states.items()
            if state != ReplicaState.RUNNING and count
        }
        self._checked_at = time.monotonic()
        self._known.set()
        if self.on_read is not None:
            self.on_read()


def health_answer(workers: WorkerStatus) -> JSONResponse:
    # Replicas in other states are named only when there are some (one being replaced, say).
    not_running = {"worker_replicas_not_running": workers.not_running} if workers.not_running else {}
    if workers.running is None:
        reason = "the worker replicas' status could not be read yet"
    elif workers.running == 0:
        reason = "no worker replica is running"
    else:
        return JSONResponse({"status": "ok", "worker_replicas_running": workers.running, **not_running})
    return JSONResponse(status_code=503, content={"status": "unhealthy", "reason": reason, **not_running})


class HealthRoutes:
    @route("GET", "/liveness")  # SGLang's name: the process answers
    async def liveness(self) -> dict:
        return LIVE

    @route("GET", "/health")
    async def health(self) -> Response:
        await self.worker_status.first_read()
        return health_answer(self.worker_status)

    def open_probe_port(self) -> ProbeServer:
        """The probe port's process, with `/liveness`, the token, and `/health` published after each
        status read; the event loop beats its heartbeat until the port is closed."""
        config = self.config
        reason = f"the ingress's event loop has not run for over {STALE_AFTER_S:.0f} s"
        stale = JSONResponse(status_code=503, content={"status": "unhealthy", "reason": reason})
        probes = ProbeServer(
            config.probe_host,
            config.probe_port,
            self.probe,
            constant={"/liveness": JSONResponse(LIVE)},
            token=None if config.auth_token is None else config.auth_token.get_secret_value(),
            stale_after_s=STALE_AFTER_S,
            stale=stale,
            read=self.worker_status.renew_soon,
        )
        self.worker_status.on_read = lambda: probes.publish({"/health": health_answer(self.worker_status)})
        self._heartbeat = asyncio.create_task(_beat(probes))
        return probes

    def probe(self, path: str, authorization: str | None) -> Response:
        """The probe port's answer to what its process does not answer itself, on a thread of the
        ingress: the same routes, token and status as Serve's port."""
        refusal = bearer_refusal(path, authorization, self.config.auth_token)
        if refusal is not None:  # before the 404, as on Serve's port: no route is shown without the token
            return refusal
        if path == "/liveness":
            return JSONResponse(LIVE)
        if path != "/health":
            return json_error(404, "path", f"the probe port answers /health and /liveness, not {clip(path)}", "Not Found")
        self.worker_status.renew_from_another_thread()
        return health_answer(self.worker_status)


async def _beat(probes: ProbeServer) -> None:
    while not probes.closed:
        probes.beat()
        await asyncio.sleep(HEARTBEAT_S)
