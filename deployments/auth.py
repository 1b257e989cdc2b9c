"""Optional bearer-token authentication of the ingress's HTTP routes.

With a token (`auth_token` in the app config, else `ROLLOUT_AUTH_TOKEN` in the environment of the
process that builds the application, `deployments/config.py`), every HTTP route except `/liveness`
answers 401 unless the request carries `Authorization: Bearer <token>`. The deployment handle is not HTTP: Python callers
inside the cluster need no token (reaching the cluster at all is their credential).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import SecretStr
from ray import serve
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from deployments.http_errors import json_error

# Probes (a load balancer's, Kubernetes') carry no secret, and liveness tells nothing but "up".
# /health, the readiness report, says more about the server, so it needs the token.
OPEN_PATHS = frozenset({"/liveness"})


def _unauthorized(message: str, challenge: str) -> JSONResponse:
    return json_error(401, "authorization", message, message, {"WWW-Authenticate": challenge})


class BearerTokenMiddleware:
    """Pure ASGI rather than Starlette's BaseHTTPMiddleware, so request and response bodies stream
    through untouched."""

    def __init__(self, app: ASGIApp, token: Callable[[], SecretStr | None]):
        self.app = app
        self.token = token

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Lifespan events carry no request; the app declares no websocket routes.
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        await (refusal or self.app)(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        # Behind a route prefix, Serve puts the prefix in both root_path and path.
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return bearer_refusal(path, Headers(scope=scope).get("authorization"), self.token())


def bearer_refusal(path: str, authorization: str | None, token: SecretStr | None) -> JSONResponse | None:
    """The 401 for a request to `path` with this `Authorization` header; None when it may pass."""
    if token is None or path in OPEN_PATHS:
        return None
    scheme, credentials = get_authorization_scheme_param(authorization)
    if scheme.lower() != "bearer" or not credentials:
        return _unauthorized("this server requires the header 'Authorization: Bearer <token>'", "Bearer")
    # Headers arrive as latin-1; comparing bytes also accepts a non-ASCII token sent as UTF-8.
    if not hmac.compare_digest(credentials.encode("latin-1"), token.get_secret_value().encode()):
        return _unauthorized("the bearer token is not this server's", 'Bearer error="invalid_token"')
    return None


def _ingress_token() -> SecretStr | None:
    # The middleware is installed when deployments.ingress is imported, before any config exists;
    # the replica's ingress instance holds the config the application was built with.
    return serve.get_replica_context().servable_object.config.auth_token


def require_bearer_token(app: FastAPI, token: Callable[[], SecretStr | None] = _ingress_token) -> None:
    """Installs the check on `app`; `token` is asked on every request (None: no token required)."""
    app.add_middleware(BearerTokenMiddleware, token=token)
