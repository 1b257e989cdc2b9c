"""`/health` and `/liveness` on a port of their own, answered by a thread of the ingress replica.

Under a burst, Serve's HTTP proxy and the ingress's event loop each hold seconds of queued work
(10-16 ms of CPU per request each on 2 cores, docs/reliability.md), and a probe sent to Serve's
port waits in both queues: `/health`'s 99th percentile was 0.16-0.6 s. This listener skips them:
its thread only waits for the interpreter lock, which the event loop hands over every few
milliseconds, and it answers from the status the ingress already holds.
"""

from __future__ import annotations

from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread
from urllib.parse import urlsplit

from starlette.responses import Response

# `answer(path, authorization header)`: the response to a GET of `path`.
Answer = Callable[[str, "str | None"], Response]


class ProbePortError(RuntimeError):
    """The probe port could not be opened (most often: another process listens on it)."""


class _ProbeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a load balancer's or kubelet's prober uses
    timeout = 5.0  # a client that stalls holds its thread no longer than this

    def do_GET(self) -> None:
        response = self.server.answer(urlsplit(self.path).path, self.headers.get("Authorization"))
        self.send_response(response.status_code)
        for name, value in response.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(response.body)

    def log_message(self, format: str, *args) -> None:
        pass  # a probe every second would fill the replica's log


class ProbeServer:
    """Serves GET requests on `host:port` from a daemon thread until `close()`."""

    def __init__(self, host: str, port: int, answer: Answer):
        try:
            self._server = ThreadingHTTPServer((host, port), _ProbeHandler)
        except OSError as error:
            raise ProbePortError(f"probe_port {port} on {host} could not be opened: {error.strerror}") from None
        self._server.daemon_threads = True
        self._server.answer = answer
        Thread(target=self._server.serve_forever, name="probes", daemon=True).start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
