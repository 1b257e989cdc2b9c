"""Builds the Serve application: `serve run --name rollout deployments.app:build_app` serves the
embedded model as the application "rollout" (without --name, Serve names it "default").

    make serve                                                                 # the same, Ray on loopback (README)
    serve run --name rollout deployments.app:build_app                         # 127.0.0.1:8000
    serve run --name rollout deployments.app:build_app num_worker_replicas=1   # key=value args
    serve run --name rollout deployments.app:build_app model.path=/models/x    # a diffusers directory (dotted keys)
    serve run deployments/serve_config.yaml                                    # from a config file
"""

from __future__ import annotations

from typing import Any

import click
import ray
import torch
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from ray.serve.schema import LoggingConfig

from deployments.config import AppConfigError, RolloutAppConfig
from deployments.ingress import RolloutIngress
from deployments.routing import FewestSamplesRouter
from deployments.scorer import ScorerReplica
from deployments.weights import WeightCoordinator
from deployments.worker import RolloutWorker
from rollout.errors import ModelLoadError
from rollout.models.registry import check_model_directory

# Serve checks a stopping replica for requests in flight every 2 s by default, and stops the three
# deployments one after the other, so each took at least 2 s of a Ctrl-C's wait.
SHUTDOWN_CHECK_PERIOD_S = 0.2
DRAIN = {"graceful_shutdown_wait_loop_s": SHUTDOWN_CHECK_PERIOD_S}
# The coordinator's requests in flight at shutdown are the workers' 10 s long polls, which nobody
# waits for once the application stops; Serve's default drain kept `serve run` up 10 s longer.
COORDINATOR_SHUTDOWN_TIMEOUT_S = 0.2
# A worker's (and a scorer's) calls all come from the ingress or a trainer, which log each request
# (HTTP or handle) once already: Serve's access log of their side repeated every request's line.
NO_ACCESS_LOG = LoggingConfig(enable_access_log=False)


def _worker_gpus(config: RolloutAppConfig) -> float:
    if config.worker_num_gpus is not None:
        return config.worker_num_gpus
    if ray.is_initialized():
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    return 1.0 if torch.cuda.is_available() else 0.0


class BuildAppError(AppConfigError, click.ClickException):
    """An `AppConfigError` that `serve run module:builder` prints as one line ("Error: field: reason")
    and exits 1 on, where it prints any other exception from a builder as a traceback."""

    def __init__(self, error: AppConfigError):
        super().__init__(error.field, error.reason)
        click.ClickException.__init__(self, str(error))  # sets what click prints, and how


def checked_app_config(args: dict[str, Any] | RolloutAppConfig | None) -> RolloutAppConfig:
    """`args` as `RolloutAppConfig`, and its model directory checked unless `check_path_at_build` is
    off (`check_model_directory`: milliseconds, no weights read). The directory check is here, not
    in the config's validators, because it imports the model families, which the ingress (a reader
    of the config) never does. Raises `AppConfigError` naming the field."""
    config = RolloutAppConfig.parse(args)
    if config.model.path is not None and config.model.check_path_at_build:
        try:
            check_model_directory(config.model.name, config.model.path)
        except ModelLoadError as error:
            raise AppConfigError(error.field, error.reason) from None
    return config


def build_app(args: dict[str, Any] | RolloutAppConfig | None = None) -> Application:
    """The ingress bound to `num_worker_replicas` workers; `args` is validated as `RolloutAppConfig`
    (an `AppConfigError` naming the field if it breaks a rule). Dotted keys set nested fields, so
    `serve run deployments.app:build_app model.path=/models/x` serves a diffusers directory."""
    try:
        config = checked_app_config(args)
    except AppConfigError as error:
        raise BuildAppError(error) from None
    coordinator = WeightCoordinator.options(
        graceful_shutdown_timeout_s=COORDINATOR_SHUTDOWN_TIMEOUT_S, **DRAIN
    ).bind(
        config.weight_version,
        config.allowed_weight_paths,
        config.weight_update_timeout_s,
        config.allowed_weight_sync_addresses,
    )
    worker = RolloutWorker.options(
        num_replicas=config.num_worker_replicas,
        max_ongoing_requests=config.max_ongoing_requests_per_worker(),
        max_replicas_per_node=config.worker_max_replicas_per_node,
        request_router_config=RequestRouterConfig(request_router_class=FewestSamplesRouter),
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        health_check_period_s=config.worker_health_check_period_s,
        logging_config=NO_ACCESS_LOG,
        # Serve starts a replica whose constructor raised again, up to min(this, 3 per replica) times
        # in all before it marks the application DEPLOY_FAILED (ray/serve/_private/deployment_state.py):
        # one try per replica, as a model that cannot load fails every replica alike, after loading.
        max_constructor_retry_count=config.num_worker_replicas,
        **DRAIN,
        ray_actor_options={"num_cpus": config.worker_num_cpus, "num_gpus": _worker_gpus(config)},
    ).bind(config, coordinator)
    return ingress_app(config, worker, coordinator)


def ingress_app(
    config: RolloutAppConfig, worker: Application | DeploymentHandle, coordinator: Application | DeploymentHandle
) -> Application:
    """The ingress and the scorers `config` names, in front of `worker` and `coordinator`: the bound
    deployments of the same application, or handles to another's (the tests' `deploy_ingress`)."""
    scorers = {
        name: ScorerReplica.options(
            name=f"Scorer-{name}",
            num_replicas=scorer.num_replicas,
            # Parts of many requests wait on one replica and are scored together (deployments/scorer.py).
            max_ongoing_requests=config.ingress_max_ongoing_requests,
            graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
            logging_config=NO_ACCESS_LOG,
            **DRAIN,
            ray_actor_options={"num_cpus": scorer.num_cpus, "num_gpus": scorer.num_gpus},
        ).bind(name, scorer.model_dump())
        for name, scorer in config.scorers.items()
    }
    return RolloutIngress.options(
        max_ongoing_requests=config.ingress_max_ongoing_requests,
        graceful_shutdown_timeout_s=config.graceful_shutdown_timeout_s,
        **DRAIN,
        ray_actor_options={"num_cpus": config.ingress_num_cpus},
    ).bind(worker, coordinator, config, scorers)
