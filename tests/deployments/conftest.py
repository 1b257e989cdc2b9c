"""One local Ray cluster and one Serve application for the whole session (a cold start costs
several seconds here)."""

import logging
import os

# Ray's switch for a cluster of one machine (named for the platforms where it is the default): the
# node's IP is 127.0.0.1, so Ray's servers listen on loopback. Ray reads it when it is imported, and
# pytest loads this file before any test module.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import ray  # noqa: E402
import requests  # noqa: E402
from ray import serve  # noqa: E402

from deployments.app import build_app  # noqa: E402
from deployments.local_ray import start_local_ray  # noqa: E402
from tests.deployments.apps import APP_NAME, TEST_CONFIG, deploy  # noqa: E402
from tests.ports import free_port  # noqa: E402


@pytest.fixture(scope="session")
def app_config() -> dict:
    return TEST_CONFIG


# Where Ray's metrics agent serves Prometheus's text format (`metrics_url`).
METRICS_EXPORT_PORT = free_port()


@pytest.fixture(scope="session")
def ray_cluster():
    context = start_local_ray(
        num_cpus=4,
        include_dashboard=True,
        dashboard_host="127.0.0.1",
        log_to_driver=False,
        _metrics_export_port=METRICS_EXPORT_PORT,
        # What replicas record reaches the agent within a second, not Ray's default ten.
        _system_config={"metrics_report_interval_ms": 1000},
    )
    yield context
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def metrics_url(ray_cluster) -> str:
    return f"http://127.0.0.1:{METRICS_EXPORT_PORT}/metrics"


@pytest.fixture(scope="session")
def serve_app(ray_cluster):
    """(handle, base_url) of the test application."""
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    handle = serve.run(build_app(TEST_CONFIG), name=APP_NAME, route_prefix="/")
    return handle, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="session")
def kernels_app(serve_app):
    """One worker replica serving the embedded model under batch-invariant kernels, attention pinned
    to SDPA's math kernel: what a test needs when requests must share its one sampler."""
    model = {"batch_invariance": "kernels", "attention_backend": "math"}
    app = deploy(serve_app, "kernels-test", num_worker_replicas=1, model=model)
    yield app
    serve.delete(app.name)


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


@pytest.fixture
def serve_log(caplog):
    """`caplog`, with the records of the logger the deployments log to (Serve's, which may not
    propagate to the root logger), from WARNING up."""
    serve_logger = logging.getLogger("ray.serve")
    serve_logger.addHandler(caplog.handler)
    with caplog.at_level(logging.WARNING, logger="ray.serve"):
        yield caplog
    serve_logger.removeHandler(caplog.handler)
