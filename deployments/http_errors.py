"""How every error is answered over HTTP, in one table: its status and SGLang's body.

The error types live with their concerns (the request's in `rollout.errors`, the lifecycle's in
`deployments/dispatch.py`, the weights' and memory's beside them); this table says what each is
on the wire. A type is answered as its nearest listed ancestor, so a new error subclassing, say,
`InvalidRequestError` is a 400 without a new entry. Through the deployment handle the errors are
raised as themselves (Ray re-raises a replica's exception as a subclass of its type).

Bodies are SGLang's `detail` (FastAPI's error body) beside this server's field-naming `error`;
the weight routes answer SGLang's `{"success": false, "message": ...}` with the same status.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from fastapi.responses import JSONResponse

from deployments.bodies import (
    BodyIncompleteError,
    BodyTimeoutError,
    BodyTooLargeError,
    TooManyBodiesError,
)
from deployments.memory import MemoryReleasedError
from deployments.weights import WeightVersionError
from deployments.work import DeadlineExceededError, ServiceUnavailableError
from rollout.errors import (
    CodecError,
    InvalidRequestError,
    RequestSchemaError,
    RolloutError,
    ScorerError,
    WeightUpdateError,
)


@dataclass(frozen=True)
class ErrorAnswer:
    """What one error type is over HTTP.

    Attributes:
        status: the HTTP status.
        detail: SGLang's `detail` for the error.
        field: the field `error.field` names, when the error carries none.
    """

    status: int
    detail: Callable[[Exception], Any] = str
    field: str = ""


def _json_invalid(error: Exception) -> list[dict[str, Any]]:
    return [{"type": "json_invalid", "loc": ["body"], "msg": str(error)}]  # FastAPI's, for a body that does not parse


ERROR_ANSWERS: dict[type[Exception], ErrorAnswer] = {
    BodyTooLargeError: ErrorAnswer(413),
    BodyTimeoutError: ErrorAnswer(408),
    BodyIncompleteError: ErrorAnswer(400),
    TooManyBodiesError: ErrorAnswer(503, lambda error: f"Service unavailable: {error}", field="body"),
    CodecError: ErrorAnswer(422, _json_invalid, field="body"),
    RequestSchemaError: ErrorAnswer(422, lambda error: error.errors),
    InvalidRequestError: ErrorAnswer(400, lambda error: f"Invalid sampling params: {error}"),
    WeightVersionError: ErrorAnswer(409),
    WeightUpdateError: ErrorAnswer(400),  # refused at the ingress, before the coordinator (its refusals answer 400 too)
    MemoryReleasedError: ErrorAnswer(503, lambda _: "Server is sleeping. Call resume_memory_occupation first."),
    DeadlineExceededError: ErrorAnswer(504, field="rollout_timeout_s"),
    ServiceUnavailableError: ErrorAnswer(503, lambda error: f"Service unavailable: {error}"),
    ScorerError: ErrorAnswer(502, lambda error: f"Reward failed: {error}", field="rollout_reward_models"),
    RolloutError: ErrorAnswer(500, lambda error: f"Generation failed: {error}"),
}


def answer_for(error: Exception) -> ErrorAnswer | None:
    """The table's entry for `error`'s type or its nearest listed ancestor; None: not listed."""
    for kind in type(error).__mro__:
        if kind in ERROR_ANSWERS:
            return ERROR_ANSWERS[kind]
    return None


def status_of(error: BaseException) -> int:
    """The HTTP status `error` is answered with (500 for what the table does not list): the `code`
    of a request that failed through the handle, in the metrics."""
    known = library_error(error)
    answer = None if known is None else answer_for(known)
    return 500 if answer is None else answer.status


def library_error(error: BaseException) -> RolloutError | None:
    """The error behind an exception raised in a replica, if it is one of this project's (Ray
    wraps a replica's exception in its own types and chains the cause)."""
    while error is not None:
        if isinstance(error, RolloutError) and not isinstance(error, ray.exceptions.RayError):
            return error
        error = getattr(error, "cause", None) or error.__cause__
    return None


def json_error(status: int, field: str, message: str, detail: Any, headers: dict | None = None) -> JSONResponse:
    """SGLang's `detail` beside this server's `{"error": {"field", "message"}}`."""
    content = {"detail": detail, "error": {"field": field, "message": message}}
    return JSONResponse(status_code=status, content=content, headers=headers)


def error_response(error: RolloutError) -> JSONResponse:
    """`error` as the table answers it (a type it does not list is a 500)."""
    answer = answer_for(error) or ERROR_ANSWERS[RolloutError]
    return json_error(answer.status, getattr(error, "field", answer.field), str(error), answer.detail(error), _headers(error))


def weights_refusal(error: RolloutError) -> JSONResponse:
    """A weight route's refusal: the table's status, SGLang's weight-route body."""
    answer = answer_for(error) or ERROR_ANSWERS[RolloutError]
    return JSONResponse(status_code=answer.status, content={"success": False, "message": str(error)}, headers=_headers(error))


def internal_error_response(request_id: str) -> JSONResponse:
    """A failure this server did not expect: logged in full by the caller, answered without internals
    (actor ids, addresses, tracebacks)."""
    message = f"internal error while serving request {request_id}; the server log has the details"
    return json_error(500, "", message, f"Generation failed: {message}")


# Refused before its body was read: the connection is closed rather than read to the end.
_UNREAD_BODY = (BodyTooLargeError, BodyTimeoutError, BodyIncompleteError, TooManyBodiesError)


def _headers(error: Exception) -> dict[str, str] | None:
    headers = {}
    if isinstance(error, ServiceUnavailableError):
        headers["Retry-After"] = str(error.retry_after_s)
    if isinstance(error, _UNREAD_BODY):
        headers["Connection"] = "close"
    return headers or None
