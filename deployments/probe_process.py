"""The probe port's own process: `deployments/probes.py` starts it, as a script, with the standard
library only (it starts in tens of milliseconds and holds a few MB).

It serves GETs on a listening socket its parent opened, from three things the parent hands it:

- `constant`: answers that never change and need no token (`/liveness`);
- a shared memory block the parent rewrites: answers it publishes by path (`/health`, from the
  last status read) and a heartbeat (the time its event loop last ran, `time.monotonic()`, which
  is the same clock in every process of the machine);
- a channel (a socket) to the parent, through which it asks for any other answer (a path it did not
  publish, a request whose token it cannot accept itself) and says that a published answer was read,
  so that the parent renews it when stale.

A published answer is given only to a request carrying the token (or to any, without a token), and
only while the heartbeat is younger than `stale_after_s`: beyond, `stale` is given instead. Anything
else goes to the parent, whose answer is the ingress's own (`HealthRoutes.probe`).

The process ends when the channel closes (its parent closed it, or died: the kernel closes a dead
process's sockets) and, should something else hold the parent's end, when its parent changes.
"""

from __future__ import annotations

import hmac
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

# The shared block: a sequence number (odd while the parent writes), the heartbeat, the length of
# the JSON of the published answers, then that JSON.
HEADER = struct.Struct("<Qdi")
SHARED_BYTES = 1 << 16
RENEW_EVERY_S = 0.5  # says "read" to the parent at most this often
PARENT_CHECK_S = 1.0

# An answer: [status, [[name, value], ...], body as latin-1 text].
Answer = list


def read_shared(shared: mmap.mmap) -> tuple[float, dict[str, Answer]]:
    """(heartbeat, published answers by path), read whole: a read that overlaps a write is read again."""
    while True:
        sequence, beat, length = HEADER.unpack_from(shared, 0)
        payload = shared[HEADER.size : HEADER.size + length]
        if sequence % 2 == 0 and HEADER.unpack_from(shared, 0)[0] == sequence:
            return beat, json.loads(payload) if length else {}
        time.sleep(0.0005)


def carries_token(authorization: str | None, token: bytes | None) -> bool:
    """Whether `bearer_refusal` (deployments/auth.py) lets this header through: the same test. Where
    it would refuse, the parent answers, so the refusal is the ingress's own."""
    if token is None:
        return True
    scheme, _, credentials = (authorization or "").partition(" ")
    credentials = credentials.strip()
    try:
        return scheme.lower() == "bearer" and bool(credentials) and hmac.compare_digest(credentials.encode("latin-1"), token)
    except UnicodeEncodeError:
        return False


class Parent:
    """The channel to the parent: asks for answers (one thread per asking request waits for its
    own), and says when a published answer was read."""

    def __init__(self, channel: Connection):
        self._channel = channel
        self._sending = threading.Lock()
        self._waiting: dict[int, list] = {}
        self._next = 0
        self._renewed_at = -float("inf")

    def _send(self, message: tuple) -> None:
        with self._sending:
            self._channel.send(message)

    def ask(self, path: str, authorization: str | None) -> Answer | None:
        done, box = threading.Event(), []
        with self._sending:
            self._next += 1
            number = self._next
            self._waiting[number] = [done, box]
        self._send(("ask", number, path, authorization))
        done.wait()
        return box[0]

    def read(self) -> None:
        now = time.monotonic()
        if now - self._renewed_at > RENEW_EVERY_S:
            self._renewed_at = now
            self._send(("read",))

    def receive_until_closed(self) -> None:
        while True:
            try:
                _, number, answer = self._channel.recv()
            except (EOFError, OSError):
                os._exit(0)
            done, box = self._waiting.pop(number)
            box.append(answer)
            done.set()


def _exit_with(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    os._exit(0)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a load balancer's or kubelet's prober uses
    timeout = 5.0  # a client that stalls holds its thread no longer than this

    def do_GET(self) -> None:
        server = self.server
        path, authorization = urlsplit(self.path).path, self.headers.get("Authorization")
        answer = server.constant.get(path)
        if answer is None and carries_token(authorization, server.token):
            beat, published = read_shared(server.shared)
            answer = published.get(path)
            if answer is not None:
                server.parent.read()
                if server.stale_after_s is not None and time.monotonic() - beat > server.stale_after_s:
                    answer = server.stale
        if answer is None:
            answer = server.parent.ask(path, authorization)
        if answer is None:  # the ingress failed to answer (its log says why)
            self.close_connection = True
            return
        status, headers, body = answer
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body.encode("latin-1"))

    def log_message(self, format: str, *args) -> None:
        pass  # a probe every second would fill the replica's log


def main(listening: int, channel: int, shared: int, parent_pid: int) -> None:
    connection = Connection(channel)
    setup = connection.recv()
    server = ThreadingHTTPServer(("", 0), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = socket.socket(fileno=listening)
    server.daemon_threads = True
    server.constant = setup["constant"]
    server.token = None if setup["token"] is None else setup["token"].encode()
    server.stale_after_s, server.stale = setup["stale_after_s"], setup["stale"]
    server.shared = mmap.mmap(shared, SHARED_BYTES)
    server.parent = Parent(connection)
    threading.Thread(target=server.parent.receive_until_closed, daemon=True).start()
    threading.Thread(target=_exit_with, args=(parent_pid,), daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
