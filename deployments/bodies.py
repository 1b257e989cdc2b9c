"""Reading a request body under its size limit, and parsing it (JSON or msgpack), at no more cost
than its bytes: the limit is checked against Content-Length before anything is read, and against
the bytes read while a chunked body streams in."""

from __future__ import annotations

from typing import Any

from fastapi import Request

from deployments.config import RolloutAppConfig
from rollout.codec import parse_json, parse_msgpack
from rollout.errors import FieldError

MSGPACK = "application/msgpack"


class BodyTooLargeError(FieldError):
    """A request body over its limit in the app config (HTTP 413); refused before the rest is read."""


async def read_body(http_request: Request, config: RolloutAppConfig, limit_name: str = "max_request_body_bytes") -> Any:
    """The body, parsed; raises `BodyTooLargeError` as soon as it is known to be over the app
    config's `limit_name` bytes, or `CodecError` if it does not parse."""
    limit = getattr(config, limit_name)
    too_large = f"larger than the limit of {limit} bytes ({limit_name} in the app config)"
    declared = http_request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLargeError("body", too_large)
    body = bytearray()
    async for chunk in http_request.stream():
        body += chunk
        if len(body) > limit:
            raise BodyTooLargeError("body", too_large)
    return (parse_msgpack if MSGPACK in http_request.headers.get("content-type", "") else parse_json)(body)
