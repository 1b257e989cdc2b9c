"""`RolloutIngress`: the application's front door, routes only, one mixin per concern
(`deployments/routes/`). HTTP (SGLang's API, msgpack or JSON) and the deployment handle (for RL
loops inside the cluster) share each concern's code; a request's life after it is planned is
`deployments/dispatch.py`'s.
"""

import asyncio
import logging
import time

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments import ray_private
from deployments.auth import require_bearer_token
from deployments.bodies import BodyReader
from deployments.config import RolloutAppConfig
from deployments.dispatch import Dispatcher, ServeWorkers
from deployments.load import outstanding_samples
from deployments.metrics import IngressMetrics
from deployments.scoring import ServeScorers
from deployments.routes import discovery, generate, health, memory, mount, operator_paths, weights

logger = logging.getLogger("ray.serve")

CONCERNS = [
    generate.GenerateRoutes,
    weights.WeightRoutes,
    memory.MemoryRoutes,
    discovery.DiscoveryRoutes,
    health.HealthRoutes,
]
app = FastAPI(title="diffusion rollout server")
mount(app, CONCERNS)
require_bearer_token(app, operator_paths(CONCERNS))


@serve.deployment
@serve.ingress(app)
class RolloutIngress(*CONCERNS):
    async def __init__(
        self,
        worker: DeploymentHandle,
        coordinator: DeploymentHandle,
        config: RolloutAppConfig,
        scorers: dict[str, DeploymentHandle] | None = None,
    ):
        self.worker = worker
        self.coordinator = coordinator
        self.config = config
        self.bodies = BodyReader(config)
        self.started = int(time.time())
        self.metrics = IngressMetrics(config.model.label())
        self.dispatcher = Dispatcher(
            ServeWorkers(worker), config, outstanding_samples, ServeScorers(scorers or {}), self.metrics.cost_in_flight.set
        )
        self.worker_status = health.WorkerStatus(asyncio.get_running_loop(), worker)
        self._probes = None if config.probe_port is None else self.open_probe_port()
        # `serve run config.yaml` says nothing after "Submitted deploy config successfully.": this is
        # the line in its terminal that says what is served (Serve prints replicas' logs there).
        self._announced = asyncio.create_task(self._announce())

    async def _announce(self) -> None:
        config = self.config
        try:
            url = await asyncio.to_thread(ray_private.application_url, config.app_name)
        except Exception:  # the line is a courtesy: a controller that cannot answer now must not fail the replica
            logger.exception("reading the application's URL from Serve's controller failed")
            url = None
        probes = f"probes on {config.probe_url}" if config.probe_url else "no probe port"
        logger.info(
            "rollout app %r up on %s: model %s, %d worker replica(s); %s (/health answers 200 once a worker runs)",
            config.app_name, url or "no HTTP route", config.model.described(), config.num_worker_replicas, probes,
        )

    def check_health(self) -> None:
        """Serve's periodic check: a probe port whose process ended (killed) has the replica replaced."""
        if self._probes is not None and not self._probes.running:
            raise RuntimeError("the probe port's process ended")

    def __del__(self):
        if self._probes is not None:
            self._probes.close()
