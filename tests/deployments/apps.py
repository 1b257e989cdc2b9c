"""The test applications' configuration, and deploying an application of its own beside the
session's (`conftest.py` deploys the session's one)."""

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from ray import serve

from deployments.app import ingress_app
from deployments.cli import run_app
from deployments.config import RolloutAppConfig
from tests.ports import free_port

APP_NAME = "rollout-test"
TEST_CONFIG = {
    "app_name": APP_NAME,
    "weight_version": "test-v1",
    "auth_token": None,  # whatever ROLLOUT_AUTH_TOKEN the shell has
    "num_worker_replicas": 2,
    "worker_num_cpus": 0.5,
    "worker_torch_threads": 1,
    "max_batch_size": 16,
    # Long enough that concurrent requests reliably meet in one batch on a loaded machine.
    "batch_wait_timeout_s": 0.2,
    "body_timeout_s": 3.0,  # clients that stall mid-body are answered within a test's patience
    "scorers": {},  # the embedded model's scorers are tests/deployments/test_rewards_app.py's
    "limits": {
        "max_prompts_per_request": 8,
        "max_outputs_per_prompt": 8,
        "max_samples_per_request": 32,
        "max_inference_steps": 50,
    },
}


def deploy(serve_app, name: str, **config) -> SimpleNamespace:
    """An application of its own beside the session's, with its probe port (`deployments/probes.py`)."""
    config = _app_config(name, config)
    # As `make serve` deploys: one that fails to start names each deployment's exception.
    handle = run_app(config, route_prefix=f"/{name}")
    return _deployed(serve_app, handle, config)


def deploy_ingress(serve_app, name: str, **config) -> SimpleNamespace:
    """An application of an ingress configured with `config` (and the scorers it names), in front of
    the session application's workers and weight coordinator: for what the ingress and scorers
    alone decide (admission, validation, rewards), without the worker and coordinator replicas of
    an application of its own (processes that import torch, and a worker diffusers: 15 s of CPU here)."""
    config = _app_config(name, config)
    worker, coordinator = (serve.get_deployment_handle(deployment, APP_NAME) for deployment in ("RolloutWorker", "WeightCoordinator"))
    handle = serve.run(ingress_app(config, worker, coordinator), name=name, route_prefix=f"/{name}")
    return _deployed(serve_app, handle, config)


def _app_config(name: str, config: dict) -> RolloutAppConfig:
    return RolloutAppConfig.parse({**TEST_CONFIG, **config, "app_name": name, "probe_port": free_port()})


def _deployed(serve_app, handle, config: RolloutAppConfig) -> SimpleNamespace:
    url = f"{serve_app[1]}/{config.app_name}"
    return SimpleNamespace(handle=handle, name=config.app_name, url=url, probe_url=config.probe_url)


def delete_side_by_side(names) -> None:
    """Deletes applications concurrently: each delete waits for its replicas to shut down
    gracefully, which deletes in turn would wait for one application after another."""
    names = list(names)
    with ThreadPoolExecutor(len(names)) as pool:
        list(pool.map(serve.delete, names))
