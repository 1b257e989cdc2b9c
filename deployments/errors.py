"""Errors of the serving layer that a client should retry: HTTP 503 with `Retry-After`.

Through a deployment handle they are raised as these types (Ray re-raises a replica's exception
as a subclass of its type), so an RL loop can catch them and try again later.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from rollout.errors import RolloutError


def error_response(status: int, field: str, message: str, detail: Any, headers: dict | None = None) -> JSONResponse:
    """SGLang's `detail` (FastAPI's error body) beside this server's field-naming `error`."""
    content = {"detail": detail, "error": {"field": field, "message": message}}
    return JSONResponse(status_code=status, content=content, headers=headers)


class ServiceUnavailableError(RolloutError):
    """The request was not served now, but may be if sent again after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.retry_after_s)


class OverloadedError(ServiceUnavailableError):
    """Admitting the request would queue more samples than `max_queued_samples` allows."""


class StoppingError(ServiceUnavailableError):
    """The server is stopping (`RolloutIngress.stop_serving`): send the request again once it is back."""


class DeadlineExceededError(RolloutError):
    """The request's deadline (`rollout_timeout_s`, or the app's `request_timeout_s`) passed: HTTP 504."""


class WorkerLostError(ServiceUnavailableError):
    """The worker replicas sampling the request died, and so did every retry on another one."""
