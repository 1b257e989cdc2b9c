"""`ProbeServer`, the ingress's own listener for /health and /liveness, without a cluster."""

import socket

import pytest
import requests
from starlette.responses import JSONResponse

from deployments.probes import ProbePortError, ProbeServer
from tests.ports import free_port


@pytest.fixture
def probes():
    """A probe server on a free loopback port, and what its answer function was asked."""
    asked = []

    def answer(path, authorization):
        asked.append((path, authorization))
        return JSONResponse({"path": path}, status_code=200 if path == "/health" else 404, headers={"X-Probe": "1"})

    port = free_port()
    server = ProbeServer("127.0.0.1", port, answer)
    yield f"http://127.0.0.1:{port}", asked
    server.close()


def test_gets_are_answered_by_the_answer_function(probes):
    url, asked = probes
    with requests.Session() as session:
        first = session.get(f"{url}/health?verbose=1", headers={"Authorization": "Bearer t"}, timeout=5)
        second = session.get(f"{url}/elsewhere", timeout=5)
    assert (first.status_code, first.json(), first.headers["X-Probe"]) == (200, {"path": "/health"}, "1")
    assert second.status_code == 404
    assert asked == [("/health", "Bearer t"), ("/elsewhere", None)]


def test_a_port_in_use_is_an_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ProbePortError, match=f"probe_port {port} on 127.0.0.1"):
            ProbeServer("127.0.0.1", port, lambda path, authorization: JSONResponse({}))


def test_a_closed_server_frees_its_port():
    port = free_port()
    ProbeServer("127.0.0.1", port, lambda path, authorization: JSONResponse({})).close()
    again = ProbeServer("127.0.0.1", port, lambda path, authorization: JSONResponse({"again": True}))
    try:
        assert requests.get(f"http://127.0.0.1:{port}/health", timeout=5).json() == {"again": True}
    finally:
        again.close()
