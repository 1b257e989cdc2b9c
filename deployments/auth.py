"""Who may call the ingress's HTTP routes: an optional bearer token, and operator routes kept to
this machine without one.

With a token (`auth_token` in the app config, else `ROLLOUT_AUTH_TOKEN` in the environment of the
process that builds the application, `deployments/config.py`), every HTTP route except `/liveness`
answers 401 unless the request carries `Authorization: Bearer <token>`. Without one, the operator
routes (those declared `operator=True`: the weight, checksum and memory routes, which change or
read what every replica serves) answer 403 to clients that are not on loopback, unless the app
config sets `allow_unauthenticated`. The deployment handle is not HTTP: Python callers inside the
cluster need no token (reaching the cluster at all is their credential).
"""

from __future__ import annotations

import hmac
import ipaddress
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
    through untouched. `token` and `operators_anywhere` (the config's `allow_unauthenticated`) are
    asked on every request."""

    def __init__(
        self,
        app: ASGIApp,
        token: Callable[[], SecretStr | None],
        operator_paths: frozenset[str] = frozenset(),
        operators_anywhere: Callable[[], bool] = lambda: False,
    ):
        self.app = app
        self.token = token
        self.operator_paths = operator_paths
        self.operators_anywhere = operators_anywhere

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # Lifespan events carry no request; the app declares no websocket routes.
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        await (refusal or self.app)(scope, receive, send)

    def _refusal(self, scope: Scope) -> JSONResponse | None:
        # Behind a route prefix, Serve puts the prefix in both root_path and path.
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        token = self.token()
        if token is None and path in self.operator_paths and not self.operators_anywhere():
            return _refusal_unless_local(scope.get("client"))
        return bearer_refusal(path, Headers(scope=scope).get("authorization"), token)


def _refusal_unless_local(client: tuple[str, int] | None) -> JSONResponse | None:
    """The 403 for a client that is not on this machine (a Unix socket or a test client gives no address)."""
    if client is None or is_loopback(client[0]):
        return None
    message = (
        "this route changes or reads what every replica serves: without an auth_token it answers only "
        "clients on the server's machine (set auth_token, or allow_unauthenticated: true)"
    )
    return json_error(403, "authorization", message, message)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, or a name) is this machine's loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


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


def _ingress_config():
    # The middleware is installed when deployments.ingress is imported, before any config exists;
    # the replica's ingress instance holds the config the application was built with.
    return serve.get_replica_context().servable_object.config


def require_bearer_token(app: FastAPI, operator_paths: frozenset[str]) -> None:
    """Installs the checks on `app`, with the ingress's config (its token, `allow_unauthenticated`)."""
    app.add_middleware(
        BearerTokenMiddleware,
        token=lambda: _ingress_config().auth_token,
        operator_paths=operator_paths,
        operators_anywhere=lambda: _ingress_config().allow_unauthenticated,
    )
