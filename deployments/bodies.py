"""Reading a request body, and parsing it (JSON or msgpack), at no more cost than its bytes.

A body is bounded four ways before it is parsed: its size (checked against Content-Length
before anything is read, and against the bytes read while a chunked body streams in), the time
its client takes to send it, and how many bodies are being received at once, in all and from one
client address, and how many bytes they may hold in all. Serve's HTTP proxy (uvicorn) streams a body to the ingress as it arrives and has
no such bounds of its own: 270 clients that sent headers and 11 bytes, then stalled, held every
one of the ingress's request slots, and port 8000 stopped answering. Slow bodies make room for
prompt ones (`BodyReader`), and refusals close the connection. (Clients that stall before their
headers are done never reach the ingress; they hold a socket of the proxy each and delay no one:
`docs/reliability.md`.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from deployments.config import RolloutAppConfig
from deployments.work import ServiceUnavailableError
from rollout.codec import MSGPACK, from_json, from_msgpack, parse_json, parse_msgpack
from rollout.errors import FieldError



class BodyTooLargeError(FieldError):
    """A request body over its limit in the app config (HTTP 413); refused before the rest is read."""


class BodyTimeoutError(FieldError):
    """The client did not send its whole body in time (HTTP 408)."""


class BodyIncompleteError(FieldError):
    """The client went away before sending its whole body (HTTP 400, answered to no one)."""


class TooManyBodiesError(ServiceUnavailableError):
    """As many bodies as the app config allows are being received, in all or from this client (HTTP 503)."""


@dataclass(frozen=True)
class BodyKind:
    """The app config's fields that bound one kind of body, and how its tensors are read."""

    size_field: str
    timeout_field: str
    parsers: tuple[Callable[[bytes], Any], Callable[[bytes], Any]]  # (msgpack, JSON)


REQUEST_BODY = BodyKind("max_request_body_bytes", "body_timeout_s", (parse_msgpack, parse_json))
# Tensors decoded as the parser reaches each envelope, into the tensor's own buffer: no tree of
# their bytes is built first.
TENSOR_UPDATE_BODY = BodyKind("max_weight_update_body_bytes", "weight_update_body_timeout_s", (from_msgpack, from_json))


# A body still on its way after this long is slow: a trainer's arrive in milliseconds.
SLOW_BODY_S = 1.0


@dataclass
class _Receiving:
    """A body being received: who sends it, the most bytes it can hold, since when, and the deadline that ends it."""

    client: str
    size: int
    started: float
    deadline: asyncio.Timeout
    overtaken_by: str = ""  # the limit it was ended early under, to make room for a body that came after it


class BodyReader:
    """The ingress's body reader: one per ingress replica, which keeps the bodies it is receiving.

    When as many are being received as the app config allows (in all, or from the new body's
    client), or as many bytes (`max_unfinished_body_bytes`, each body counted at the most it can
    hold), the new body is let in if the oldest of those has been on its way `SLOW_BODY_S` or
    more: that one is answered `503` with Retry-After now instead of `408` at its deadline. So
    slow clients, however many and from however many addresses, hold at most the allowed number
    of the ingress's slots and never keep a prompt client out; only when every body being
    received is recent is the new one refused (`503`). The body ended early is answered as a
    refusal to send again, not as a client's timeout: under a burst from one trainer host, the
    body that waited a second may be waiting on this busy ingress, not on its client.
    """

    def __init__(self, config: RolloutAppConfig):
        self.config = config
        self._receiving: list[_Receiving] = []

    async def read(self, http_request: Request, kind: BodyKind = REQUEST_BODY) -> Any:
        """The body, parsed. Raises `BodyTooLargeError`, `BodyTimeoutError`, `TooManyBodiesError`,
        `BodyIncompleteError`, or `CodecError` if it does not parse."""
        limit = getattr(self.config, kind.size_field)
        too_large = f"larger than the limit of {limit} bytes ({kind.size_field} in the app config)"
        declared = http_request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLargeError("body", too_large)
        client = http_request.client.host if http_request.client else ""
        # The HTTP server holds a body to its Content-Length, and `_received` a chunked one to the limit.
        size = int(declared) if declared.isdigit() else limit
        self._make_room(client, size)
        timeout = getattr(self.config, kind.timeout_field)
        deadline = asyncio.timeout(timeout)
        receiving = _Receiving(client, size, asyncio.get_running_loop().time(), deadline)
        self._receiving.append(receiving)  # entered below before any await: no one can end it sooner
        try:
            async with deadline:
                body = await _received(http_request, limit, too_large)
        except TimeoutError:
            if receiving.overtaken_by:
                raise TooManyBodiesError(
                    f"body: {receiving.overtaken_by}, and this one, the slowest, was ended to make room for a "
                    "newer one; send it again"
                ) from None
            reason = f"not received within {timeout} s ({kind.timeout_field} in the app config)"
            raise BodyTimeoutError("body", reason) from None
        finally:
            if receiving in self._receiving:
                self._receiving.remove(receiving)
        parse_msgpack_body, parse_json_body = kind.parsers
        return (parse_msgpack_body if MSGPACK in http_request.headers.get("content-type", "") else parse_json_body)(
            body
        )

    def _make_room(self, client: str, size: int) -> None:
        """Room for a body of at most `size` bytes from `client`, made by ending slow bodies; raises
        `TooManyBodiesError` where none is slow enough."""
        config = self.config
        from_client = [body for body in self._receiving if body.client == client]
        if len(self._receiving) >= config.max_unfinished_bodies:
            self._end_the_slowest(
                self._receiving,
                f"{config.max_unfinished_bodies} bodies are being received (max_unfinished_bodies in the app config)",
            )
        elif len(from_client) >= config.max_unfinished_bodies_per_client:
            self._end_the_slowest(
                from_client,
                f"{config.max_unfinished_bodies_per_client} bodies from this client address are being received "
                "(max_unfinished_bodies_per_client in the app config)",
            )
        # Each pass ends a body or raises; the config lets any one body in alone.
        while (held := sum(body.size for body in self._receiving)) + size > config.max_unfinished_body_bytes:
            self._end_the_slowest(
                self._receiving,
                f"bodies of up to {held} bytes are being received and this one may hold {size}, over "
                f"max_unfinished_body_bytes ({config.max_unfinished_body_bytes}) in the app config",
            )

    def _end_the_slowest(self, bodies: list[_Receiving], limit: str) -> None:
        now = asyncio.get_running_loop().time()
        oldest = min(bodies, key=lambda body: body.started)
        if now - oldest.started < SLOW_BODY_S:
            raise TooManyBodiesError(f"body: {limit}, none of them for {SLOW_BODY_S} s yet; send it again later")
        oldest.overtaken_by = limit
        oldest.deadline.reschedule(now)  # its task raises TimeoutError at its next await
        self._receiving.remove(oldest)


async def _received(http_request: Request, limit: int, too_large: str) -> bytearray:
    body = bytearray()
    try:
        async for chunk in http_request.stream():
            body += chunk
            if len(body) > limit:
                raise BodyTooLargeError("body", too_large)
    except ClientDisconnect:
        raise BodyIncompleteError("body", "the client disconnected before sending all of it") from None
    return body
