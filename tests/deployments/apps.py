"""The test applications' configuration, and deploying an application of its own beside the
session's (`conftest.py` deploys the session's one)."""

from types import SimpleNamespace

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
    probe_port = free_port()
    config = {**TEST_CONFIG, **config, "app_name": name, "probe_port": probe_port}
    # As `make serve` deploys: one that fails to start names each deployment's exception.
    handle = run_app(RolloutAppConfig.parse(config), route_prefix=f"/{name}")
    return SimpleNamespace(handle=handle, name=name, url=f"{serve_app[1]}/{name}", probe_url=f"http://127.0.0.1:{probe_port}")
