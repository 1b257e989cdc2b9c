"""Safe local defaults: the bearer token on every HTTP route except liveness (the check alone,
then in a deployed application), and Ray's listeners on loopback."""

import asyncio
import ipaddress

import psutil
import pytest
from pydantic import SecretStr, ValidationError
from ray import serve
from starlette.responses import PlainTextResponse

from deployments.auth import BearerTokenMiddleware
from deployments.config import AUTH_TOKEN_ENV, RolloutAppConfig
from deployments.ingress import CONCERNS
from deployments.ingress import app as ingress_app
from deployments.routes import operator_paths
from tests.deployments.apps import deploy

UNIT_TOKEN = "s3cret-tök"


def _answer(
    path: str,
    authorization: bytes | None = None,
    root_path: str = "",
    token: str | None = UNIT_TOKEN,
    client: tuple[str, int] | None = ("127.0.0.1", 50000),
    operators_anywhere: bool = False,
):
    """(status, headers) of a GET from `client` through the middleware in front of an app that answers 200."""
    headers = [] if authorization is None else [(b"authorization", authorization)]
    scope = {"type": "http", "method": "GET", "path": path, "root_path": root_path, "headers": headers, "client": client}
    messages = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(message):
        messages.append(message)

    middleware = BearerTokenMiddleware(
        PlainTextResponse("ok"), lambda: token and SecretStr(token), operator_paths(CONCERNS), lambda: operators_anywhere
    )
    asyncio.run(middleware(scope, receive, send))
    return messages[0]["status"], dict(messages[0]["headers"])


@pytest.mark.parametrize(
    "authorization, status",
    [
        (None, 401),
        (b"Bearer wrong", 401),
        (b"Bearer " + UNIT_TOKEN.encode()[:-1], 401),  # a prefix of the token
        (b"Basic " + UNIT_TOKEN.encode(), 401),
        (b"Bearer", 401),
        (b"Bearer " + UNIT_TOKEN.encode(), 200),  # non-ASCII, as UTF-8 bytes
        (b"bearer " + UNIT_TOKEN.encode(), 200),  # the scheme is case-insensitive (RFC 7235)
    ],
)
def test_a_protected_route_needs_the_bearer_token(authorization, status):
    answer, headers = _answer("/health", authorization)
    assert answer == status
    if status == 401:
        assert headers[b"www-authenticate"].startswith(b"Bearer")


def test_liveness_is_open_under_a_route_prefix_and_nothing_else_is():
    assert _answer("/liveness")[0] == 200
    assert _answer("/app/liveness", root_path="/app")[0] == 200
    assert _answer("/app/health", root_path="/app")[0] == 401
    assert _answer("/liveness/x")[0] == 401


def test_without_a_token_every_route_is_open_to_this_machine():
    assert _answer("/rollout/generate", token=None)[0] == 200
    assert _answer("/rollout/generate", token=None, client=("10.0.0.7", 50000))[0] == 200


OPERATOR_ROUTES = [
    "/update_weights_from_disk",
    "/update_weights_from_tensor",
    "/get_weights_checksum",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/destroy_weights_update_group",
    "/update_weights_from_shared_memory",
    "/release_memory_occupation",
    "/resume_memory_occupation",
]


@pytest.mark.parametrize("path", OPERATOR_ROUTES)
def test_without_a_token_operator_routes_answer_only_this_machine(path):
    """Issue 46: with the default config (no token), anyone who reached the port could put every
    replica to sleep or swap its weights."""
    for client in [("10.0.0.7", 50000), ("192.168.1.2", 1), ("::ffff:10.0.0.7", 2), ("2001:db8::1", 3), ("example.org", 4)]:
        status, _ = _answer(path, token=None, client=client)
        assert status == 403, client
    for client in [("127.0.0.1", 50000), ("127.0.0.3", 1), ("::1", 2), ("::ffff:127.0.0.1", 3), None]:
        assert _answer(path, token=None, client=client)[0] == 200, client
    assert _answer(path, token=None, client=("10.0.0.7", 50000), operators_anywhere=True)[0] == 200
    # With a token, the token decides, wherever the client is.
    assert _answer(path, client=("10.0.0.7", 50000))[0] == 401
    assert _answer(path, b"Bearer " + UNIT_TOKEN.encode(), client=("10.0.0.7", 50000))[0] == 200


def test_the_operator_routes_are_the_ones_that_change_or_read_the_served_weights_and_memory():
    assert operator_paths(CONCERNS) == frozenset(OPERATOR_ROUTES)


def test_the_token_comes_from_the_config_else_the_environment(monkeypatch):
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    assert RolloutAppConfig().auth_token is None
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    assert RolloutAppConfig().auth_token.get_secret_value() == "from-env"
    assert RolloutAppConfig(auth_token="from-config").auth_token.get_secret_value() == "from-config"
    with pytest.raises(ValidationError, match="auth_token"):
        RolloutAppConfig(auth_token="")


def test_the_config_never_shows_the_token():
    config = RolloutAppConfig(auth_token=UNIT_TOKEN)
    for shown in (repr(config), str(config), config.model_dump_json(), str(config.model_dump())):
        assert UNIT_TOKEN not in shown


# In a deployed application ------------------------------------------------------------------

AUTH_APP = "auth-test"
TOKEN = "auth-test-token-7f3c9a"
WRONG_TOKEN = "auth-test-wrong-41d2e8"
# Every route the ingress declares, FastAPI's documentation pages, and a path that does not exist
# (a client without the token must not learn which do).
DOCS = [ingress_app.openapi_url, ingress_app.docs_url, ingress_app.swagger_ui_oauth2_redirect_url, ingress_app.redoc_url]
ROUTES = sorted(
    [(method.upper(), path) for path, methods in ingress_app.openapi()["paths"].items() for method in methods]
    + [("GET", path) for path in [*DOCS, "/no-such-route"]]
)
PROTECTED = [(method, path) for method, path in ROUTES if path != "/liveness"]


@pytest.fixture(scope="module")
def auth_app(serve_app):
    """An application that requires TOKEN, beside the session's (which requires none)."""
    app = deploy(serve_app, AUTH_APP, auth_token=TOKEN, num_worker_replicas=1)
    yield app
    serve.delete(app.name)


@pytest.fixture(scope="module")
def auth_url(auth_app):
    return auth_app.url


def _send(http, auth_url, method, path, token=None):
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    response = http.request(method, auth_url + path, headers=headers, json={} if method == "POST" else None, timeout=60)
    shown = response.text + str(response.headers)
    assert TOKEN not in shown and WRONG_TOKEN not in shown
    return response


@pytest.mark.parametrize("method, path", PROTECTED, ids=[f"{m} {p}" for m, p in PROTECTED])
def test_every_route_but_liveness_needs_the_token(http, auth_url, method, path):
    for token, challenge in ((None, "Bearer"), (WRONG_TOKEN, 'Bearer error="invalid_token"')):
        refused = _send(http, auth_url, method, path, token)
        assert refused.status_code == 401, (token, refused.text)
        assert refused.headers["WWW-Authenticate"] == challenge
        assert refused.json()["error"]["field"] == "authorization"
        assert refused.json()["detail"] == refused.json()["error"]["message"]
    assert _send(http, auth_url, method, path, TOKEN).status_code != 401


def test_liveness_and_the_handle_need_no_token(http, auth_url, base_url):
    assert _send(http, auth_url, "GET", "/liveness").json() == {"status": "ok"}
    assert serve.get_app_handle(AUTH_APP).info.remote().result()["weight_version"] == "test-v1"
    # The session's application has no token: its routes stay open.
    assert http.get(f"{base_url}/health", timeout=10).status_code == 200


def test_the_probe_port_asks_for_the_same_token(http, auth_app):
    auth_url, probe_url = auth_app.url, auth_app.probe_url
    for path in ("/health", "/no-such-route"):
        for token, challenge in ((None, "Bearer"), (WRONG_TOKEN, 'Bearer error="invalid_token"')):
            refused = _send(http, probe_url, "GET", path, token)
            assert refused.status_code == 401 and refused.headers["WWW-Authenticate"] == challenge
    assert _send(http, probe_url, "GET", "/liveness").json() == {"status": "ok"}
    health = _send(http, probe_url, "GET", "/health", TOKEN)
    assert health.status_code == 200 and health.json() == _send(http, auth_url, "GET", "/health", TOKEN).json()
    missing = _send(http, probe_url, "GET", "/rollout/generate", TOKEN)
    assert missing.status_code == 404 and "/health and /liveness" in missing.json()["error"]["message"]


def _is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


def test_ray_listens_on_loopback_only(serve_app):
    """Every server of the test cluster (the driver and every process it started) listens on
    loopback, except one per Serve replica: Serve binds its inter-deployment gRPC server to [::]
    whatever the node's IP (ray/serve/_private/replica.py)."""
    cluster = {process.pid: process for process in [psutil.Process(), *psutil.Process().children(recursive=True)]}
    listening = [
        connection
        for connection in psutil.net_connections("tcp")
        if connection.status == psutil.CONN_LISTEN and connection.pid in cluster
    ]
    names = {connection.pid: cluster[connection.pid].cmdline()[0] for connection in listening}
    replicas = [pid for pid, name in names.items() if name.startswith("ray::ServeReplica")]
    exposed = [(connection.laddr, names[connection.pid]) for connection in listening if not _is_loopback(connection.laddr.ip)]
    assert replicas and len(listening) > len(exposed)
    assert all(name.startswith("ray::ServeReplica") for _, name in exposed), exposed
    assert len(exposed) <= len(replicas), exposed
