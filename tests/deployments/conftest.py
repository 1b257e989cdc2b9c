"""One local Ray cluster and one Serve application for the whole session (a cold start costs
several seconds here)."""

import os
import socket

# Ray's switch for a cluster of one machine (named for the platforms where it is the default): the
# node's IP is 127.0.0.1, so Ray's servers listen on loopback. Ray reads it when it is imported, and
# pytest loads this file before any test module.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
import requests  # noqa: E402
from ray import serve  # noqa: E402

from deployments.app import build_app  # noqa: E402

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
    "limits": {
        "max_prompts_per_request": 8,
        "max_outputs_per_prompt": 8,
        "max_samples_per_request": 32,
        "max_inference_steps": 50,
    },
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def app_config() -> dict:
    return TEST_CONFIG


@pytest.fixture(scope="session")
def ray_cluster():
    context = ray.init(num_cpus=4, include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=False)
    yield context
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(ray_cluster):
    """(handle, base_url) of the test application."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build_app(TEST_CONFIG), name=APP_NAME, route_prefix="/")
    return handle, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def handle(serve_app):
    return serve_app[0]


@pytest.fixture(scope="session")
def base_url(serve_app):
    return serve_app[1]


@pytest.fixture
def http():
    with requests.Session() as session:
        yield session
