"""`/health` and `/liveness` on a port of their own, answered by a small process of the ingress
replica's (`deployments/probe_process.py`), which dies with it.

Why a process: a thread of the ingress (this port's first form) answers only while it holds
the replica process's interpreter lock, so whatever holds that lock delays every probe: the
event loop parsing and encoding, or one C call that never returns to the bytecode loop. Held
for 1.1 s (as tests/deployments/test_probes.py holds it), it delayed the thread's answers by
1.1 s; this process's answers take milliseconds meanwhile. Under issue 46's burst (150 client processes
sending requests of 32 samples at once, 2 cores; `python -m benchmarks.probe_burst --processes`)
the thread's part of a poll (its latency less the poller's own wait for a core) reached 1.7 s in
one of two runs, the process's 0.14 s at most in two. The ingress's process used 9-37% of one
core meanwhile: its lock is held in stretches, not saturated. What no process of the server
shortens is the prober's own wait for a core: there, polls of up to 4.1 s with the thread and
3.4 s with the process were all but 15 ms the polling process waiting for one of the 2 cores.

The process answers what it can without asking the ingress: `/liveness` (a constant), and
`/health` from the answer the ingress publishes into shared memory after each status read.
Anything else (a path it does not know, a request whose token it cannot accept itself) it asks
the ingress for, over a channel, so every other answer is the ingress's own, as before.

`/health` depends on the ingress's heartbeat: the ingress's event loop writes the time every
`HEARTBEAT_S`; once that is older than `stale_after_s`, `/health` answers `stale` (503): an
ingress whose loop has not run for that long answers no request, so it should take no more.
`/liveness` does not: a liveness probe that fails gets the container restarted, which under a
burst would throw away the work in flight and add a cold start to the overload. The process
answers `/liveness` while the replica's process lives; a replica that hangs is Serve's to replace
(its health check), and the probe process ends with it. A probe process that ended alone
(killed) fails the ingress's health check in turn (`RolloutIngress.check_health`).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

from starlette.responses import Response

from deployments.probe_process import HEADER, SHARED_BYTES

logger = logging.getLogger("ray.serve")
# `answer(path, authorization header)`: the response to a GET of `path`.
Answer = Callable[[str, "str | None"], Response]
HEARTBEAT_S = 1.0
CHILD = Path(__file__).with_name("probe_process.py")
EXIT_WAIT_S = 10.0


class ProbePortError(RuntimeError):
    """The probe port could not be opened (most often: another process listens on it)."""


def _wire(response: Response) -> list:
    return [response.status_code, [list(header) for header in response.headers.items()], response.body.decode("latin-1")]


class ProbeServer:
    """Serves GETs on `host:port` from a process of its own until `close()` (or this process ends).

    `answer` answers what the process cannot: it is called on a thread of this process. `constant`
    answers by path never change and need no token; `publish` sets what a path answers to a
    request with `token` (any request, without one) until published again; once `beat()` has not
    been called for `stale_after_s`, published paths answer `stale`. `read`, when given, is called
    (on a thread of this process) at most every 0.5 s while published answers are read.
    """

    def __init__(
        self,
        host: str,
        port: int,
        answer: Answer,
        *,
        constant: dict[str, Response] | None = None,
        token: str | None = None,
        stale_after_s: float | None = None,
        stale: Response | None = None,
        read: Callable[[], None] | None = None,
    ):
        try:
            listening = socket.create_server((host, port), backlog=64)
        except OSError as error:
            raise ProbePortError(f"probe_port {port} on {host} could not be opened: {error.strerror}") from None
        self._answer, self._read = answer, read
        self._lock = threading.Lock()
        self._closed = False
        self._sequence = 0
        shared_file = tempfile.TemporaryFile()
        shared_file.truncate(SHARED_BYTES)
        self._shared = mmap.mmap(shared_file.fileno(), SHARED_BYTES)
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(CHILD), str(listening.fileno()), str(theirs.fileno()),
                 str(shared_file.fileno()), str(os.getpid())],
                pass_fds=(listening.fileno(), theirs.fileno(), shared_file.fileno()),
                stdin=subprocess.DEVNULL,
            )
        finally:  # the process holds them now: the port closes when it ends
            listening.close()
            theirs.close()
            shared_file.close()
        self._socket = ours
        self._channel = Connection(os.dup(ours.fileno()))
        self._channel.send({
            "constant": {path: _wire(response) for path, response in (constant or {}).items()},
            "token": token,
            "stale_after_s": stale_after_s,
            "stale": None if stale is None else _wire(stale),
        })
        self.beat()
        threading.Thread(target=self._serve_asks, name="probes", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def running(self) -> bool:
        """Whether the process answers (it ends only with `close()`, or if killed)."""
        return self._process.poll() is None

    def _write(self, beat: float | None = None, published: dict | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            _, old_beat, length = HEADER.unpack_from(self._shared, 0)
            self._sequence += 1  # odd: being written
            HEADER.pack_into(self._shared, 0, self._sequence, old_beat, length)
            if published is not None:
                payload = json.dumps(published).encode()
                if HEADER.size + len(payload) > SHARED_BYTES:
                    raise ValueError(f"published answers of {len(payload)} bytes do not fit")
                self._shared[HEADER.size : HEADER.size + len(payload)] = payload
                length = len(payload)
            self._sequence += 1
            HEADER.pack_into(self._shared, 0, self._sequence, old_beat if beat is None else beat, length)

    def publish(self, answers: dict[str, Response]) -> None:
        """What each path answers from now on (paths left out are asked of `answer` again)."""
        self._write(published={path: _wire(response) for path, response in answers.items()})

    def beat(self) -> None:
        self._write(beat=time.monotonic())

    def _serve_asks(self) -> None:
        sending = threading.Lock()

        def reply(number: int, path: str, authorization: str | None) -> None:
            try:
                response = _wire(self._answer(path, authorization))
            except Exception:  # the process closes that connection, as the thread server did
                logger.exception("answering %s on the probe port failed", path)
                response = None
            with sending:
                self._channel.send(("answer", number, response))

        while True:
            try:
                message = self._channel.recv()
            except (EOFError, OSError):
                return
            if message[0] == "ask":  # each on a thread of its own, as the first /health waits for a status
                threading.Thread(target=reply, args=message[1:], daemon=True).start()
            elif self._read is not None:
                self._read()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._socket.shutdown(socket.SHUT_RDWR)  # the process sees the channel close, and ends
        self._socket.close()
        try:
            self._process.wait(EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._channel.close()
        self._shared.close()
