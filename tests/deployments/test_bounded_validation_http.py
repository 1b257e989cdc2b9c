"""Bounded, cheap validation over HTTP: body size limits (413), deep bodies, huge values and
values that make non-finite outputs, each answered with a small 4xx naming the field and the limit."""

import asyncio
import http.client
import json
import re
import time
from urllib.parse import urlparse

import msgpack
import pytest
import torch
from starlette.requests import Request

from deployments import bodies
from deployments.bodies import (
    BodyIncompleteError,
    BodyReader,
    BodyTimeoutError,
    BodyTooLargeError,
    TooManyBodiesError,
)
from deployments.config import RolloutAppConfig
from deployments.http_errors import error_response
from rollout.codec import MAX_NESTING_DEPTH, TensorEncoder, from_msgpack
from rollout.errors import NonFiniteOutputError

KiB = 2**10
DEFAULT_LIMIT = RolloutAppConfig().max_request_body_bytes
SMALL_ANSWER = 2_000  # bytes: an error answer never grows with the input


# The body reader, without a server ----------------------------------------------------------------


def request_with_body(
    chunks: list[bytes], content_length: int | None, received: list[bytes], client: str = "127.0.0.1", stalls: bool = False
) -> Request:
    """A request whose body arrives in `chunks`, after which its client stalls if `stalls`."""
    headers = [(b"content-type", b"application/json")]
    if content_length is not None:
        headers.append((b"content-length", str(content_length).encode()))
    messages = [{"type": "http.request", "body": chunk, "more_body": stalls or i < len(chunks) - 1} for i, chunk in enumerate(chunks)]

    async def receive():
        if len(received) == len(messages):
            await asyncio.Event().wait()  # stalls for good
        message = messages[len(received)]
        received.append(message["body"])
        return message

    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "client": (client, 50_000)}
    return Request(scope, receive)


def read(chunks: list[bytes], content_length: int | None, limit: int) -> tuple[object, list[bytes]]:
    received: list[bytes] = []
    try:
        body = request_with_body(chunks, content_length, received)
        return asyncio.run(BodyReader(RolloutAppConfig(max_request_body_bytes=limit)).read(body)), received
    except BodyTooLargeError as error:
        return error, received


def test_a_declared_length_over_the_limit_is_refused_before_any_of_the_body_is_read():
    error, received = read([b"[]"], content_length=10**12, limit=1_000)
    assert isinstance(error, BodyTooLargeError) and received == []
    assert error.field == "body" and "limit of 1000 bytes (max_request_body_bytes" in str(error)


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_limit():
    chunks = [b" " * 100] * 1_000  # 100 KB, no length declared
    error, received = read(chunks, content_length=None, limit=1_000)
    assert isinstance(error, BodyTooLargeError)
    assert len(received) == 11  # the chunk that passed 1,000 bytes was the last one read


def test_a_body_at_the_limit_is_read_and_parsed():
    body = json.dumps({"prompt": "7", "pad": " " * 900}).encode()
    value, _ = read([body[:500], body[500:]], content_length=None, limit=len(body))
    assert value["prompt"] == "7"


def test_a_client_that_stalls_mid_body_is_answered_408_once_its_time_is_up():
    config = RolloutAppConfig(body_timeout_s=0.05)
    stalled = request_with_body([b'{"prompt": '] * 2, content_length=None, received=[], stalls=True)
    with pytest.raises(BodyTimeoutError, match=r"within 0.05 s \(body_timeout_s"):
        asyncio.run(BodyReader(config).read(stalled))


def test_a_client_that_goes_away_mid_body_is_a_400_not_a_500():
    async def receive():
        return {"type": "http.disconnect"}

    request = Request({"type": "http", "method": "POST", "path": "/", "headers": [], "client": ("10.0.0.1", 1)}, receive)
    with pytest.raises(BodyIncompleteError, match="disconnected"):
        asyncio.run(BodyReader(RolloutAppConfig()).read(request))


def test_bodies_being_received_are_bounded_per_client_and_in_all_and_freed_when_they_end():
    config = RolloutAppConfig(
        body_timeout_s=0.2, max_unfinished_bodies=4, max_unfinished_bodies_per_client=2, ingress_max_ongoing_requests=8
    )
    reader = BodyReader(config)

    def stalled(client: str) -> Request:
        return request_with_body([b"[1,"] * 2, content_length=None, received=[], client=client, stalls=True)

    async def refusal(client: str) -> str:
        with pytest.raises(TooManyBodiesError) as caught:
            await reader.read(stalled(client))
        return str(caught.value)

    async def scenario() -> tuple:
        receiving = [asyncio.create_task(reader.read(stalled(client))) for client in ("a", "a", "b")]
        await asyncio.sleep(0.05)
        per_client = await refusal("a")  # its 2 of 2; 3 of 4 in all
        receiving.append(asyncio.create_task(reader.read(stalled("c"))))
        await asyncio.sleep(0.05)
        in_all = await refusal("d")  # 4 of 4 in all
        outcomes = await asyncio.gather(*receiving, return_exceptions=True)
        # Their time is up: each is a 408, and their places are free again.
        complete = request_with_body([b"[1]"], content_length=None, received=[], client="a")
        return per_client, in_all, outcomes, await reader.read(complete)

    per_client, in_all, outcomes, value = asyncio.run(scenario())
    assert "2 bodies from this client address are being received (max_unfinished_bodies_per_client" in per_client
    assert "4 bodies are being received (max_unfinished_bodies in the app config)" in in_all
    assert [type(outcome) for outcome in outcomes] == [BodyTimeoutError] * 4
    assert value == [1] and not reader._receiving


def test_a_new_body_ends_the_slowest_one_once_that_has_taken_long(monkeypatch):
    monkeypatch.setattr(bodies, "SLOW_BODY_S", 0.05)
    config = RolloutAppConfig(max_unfinished_bodies=4, max_unfinished_bodies_per_client=2, ingress_max_ongoing_requests=8)
    reader = BodyReader(config)

    async def scenario() -> tuple:
        stalled = [
            asyncio.create_task(reader.read(request_with_body([b"[1,"], None, [], client="slow", stalls=True)))
            for _ in range(2)
        ]
        await asyncio.sleep(0.1)
        # The slow client's third body takes the place of its first, which is answered now.
        third = asyncio.create_task(reader.read(request_with_body([b"[1,"], None, [], client="slow", stalls=True)))
        first = await asyncio.gather(stalled[0], return_exceptions=True)
        # Every body is a slow one: a prompt client's body is let in, in place of the oldest.
        for _ in range(2):
            stalled.append(asyncio.create_task(reader.read(request_with_body([b"[1,"], None, [], client=f"c{_}", stalls=True))))
        await asyncio.sleep(0.1)
        prompt = await reader.read(request_with_body([b"[2]"], None, [], client="prompt"))
        second = await asyncio.gather(stalled[1], return_exceptions=True)
        for task in [third, *stalled[2:]]:
            task.cancel()
        return first[0], second[0], prompt

    first, second, prompt = asyncio.run(scenario())
    # Answered as a refusal to send again (503), not as the client's timeout (408): under a burst, a
    # body a second old may be waiting on the ingress, not on its client.
    assert isinstance(first, TooManyBodiesError) and first.retry_after_s == 1
    assert str(first) == (
        "body: 2 bodies from this client address are being received (max_unfinished_bodies_per_client in the app "
        "config), and this one, the slowest, was ended to make room for a newer one; send it again"
    )
    assert isinstance(second, TooManyBodiesError) and "4 bodies are being received" in str(second)
    assert prompt == [2]


def test_bodies_being_received_are_bounded_in_bytes_counted_at_their_length_or_their_limit(monkeypatch):
    monkeypatch.setattr(bodies, "SLOW_BODY_S", 0.1)
    config = RolloutAppConfig(max_request_body_bytes=1_000, max_weight_update_body_bytes=1_000, max_unfinished_body_bytes=2_000)
    reader = BodyReader(config)

    def stalled(content_length: int | None, client: str) -> asyncio.Task:
        return asyncio.create_task(reader.read(request_with_body([b"[1,"], content_length, [], client=client, stalls=True)))

    async def scenario() -> tuple:
        held = [stalled(None, "a"), stalled(400, "b")]  # counted at the limit (1,000) and at their length
        await asyncio.sleep(0.01)
        with pytest.raises(TooManyBodiesError) as refused:  # 1,400 + 900 > 2,000, none slow yet
            await reader.read(request_with_body([b"[2]"], 900, [], client="c"))
        small = await reader.read(request_with_body([b"[3]"], 3, [], client="c"))  # 1,403 <= 2,000
        await asyncio.sleep(0.15)
        # Every body held is slow now: the oldest (a's, 1,000 bytes) is ended to make room.
        held.append(stalled(900, "c"))
        oldest = await asyncio.gather(held[0], return_exceptions=True)
        sizes = sorted(body.size for body in reader._receiving)
        for task in held[1:]:
            task.cancel()
        return str(refused.value), small, oldest[0], sizes

    refused, small, oldest, sizes = asyncio.run(scenario())
    assert refused == (
        "body: bodies of up to 1400 bytes are being received and this one may hold 900, over max_unfinished_body_bytes "
        "(2000) in the app config, none of them for 0.1 s yet; send it again later"
    )
    assert small == [3]
    assert isinstance(oldest, TooManyBodiesError) and "max_unfinished_body_bytes (2000)" in str(oldest)
    assert sizes == [400, 900]


def test_a_body_byte_bound_below_the_largest_body_is_refused_when_configured():
    from deployments.config import AppConfigError

    with pytest.raises(AppConfigError, match=r"max_unfinished_body_bytes: must be at least the largest body allowed \(1073741824"):
        RolloutAppConfig.parse({"max_unfinished_body_bytes": 2**29})


def test_refusals_before_the_body_is_read_close_the_connection():
    for error in (BodyTooLargeError("body", "x"), BodyTimeoutError("body", "x"), TooManyBodiesError("body: x")):
        response = error_response(error)
        assert response.headers["connection"] == "close" and json.loads(response.body)["error"]["field"] == "body"
        assert response.status_code == {BodyTooLargeError: 413, BodyTimeoutError: 408, TooManyBodiesError: 503}[type(error)]


def test_a_body_slot_limit_at_or_above_the_ingress_slots_is_refused_when_configured():
    from deployments.config import AppConfigError

    with pytest.raises(AppConfigError, match="max_unfinished_bodies: must be below ingress_max_ongoing_requests"):
        RolloutAppConfig.parse({"max_unfinished_bodies": 256})


def test_a_non_finite_output_is_a_500_whose_body_names_no_internals():
    message = "sampling produced NaN or infinite values in log_probs (1 of 2 samples)"
    response = error_response(NonFiniteOutputError(message))
    assert response.status_code == 500
    assert json.loads(response.body) == {"detail": f"Generation failed: {message}", "error": {"field": "", "message": message}}


# Against the test application ---------------------------------------------------------------------


def post_declaring(base_url: str, path: str, content_length: int) -> tuple[int, dict]:
    """A POST that declares `content_length` and sends none of it: only an answer given before
    reading the body can come back."""
    url = urlparse(base_url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(content_length))
        connection.endheaders()
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def stalled_connections(base_url: str, path: str, count: int, client: str) -> list[http.client.HTTPConnection]:
    """`count` POSTs from the address `client` (on loopback, any 127.x.y.z) that send their headers
    and 11 bytes of a 1,000-byte body, then stall."""
    url = urlparse(base_url)
    connections = []
    for _ in range(count):
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=60, source_address=(client, 0))
        connection.putrequest("POST", path)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", "1000")
        connection.endheaders(b'{"prompt": ')
        connections.append(connection)
    return connections


def test_clients_stalled_mid_body_are_bounded_and_the_port_keeps_answering(http, base_url, app_config):
    config = RolloutAppConfig.parse(app_config)
    extra = 6
    count = config.max_unfinished_bodies_per_client + extra
    connections = stalled_connections(base_url, "/rollout/generate", count, client="127.0.0.2")
    try:  # other clients are served meanwhile
        assert http.get(f"{base_url}/liveness", timeout=30).json() == {"status": "ok"}
        assert http.post(f"{base_url}/rollout/generate", json={"prompt": "7", "num_inference_steps": 2}).status_code == 200
        answers = []
        for connection in connections:
            response = connection.getresponse()
            answers.append((response.status, response.getheader("connection"), json.loads(response.read())["error"]))
    finally:
        for connection in connections:
            connection.close()
    # Beyond the limit, refused at once (or, on a machine so slow that connecting took a second, let
    # in in place of the oldest, which is answered then); the others once body_timeout_s is up.
    assert {status for status, _, _ in answers} <= {408, 503} and len(answers) == count
    held_to_the_end = [error for status, _, error in answers if "within 3.0 s" in error["message"]]
    assert len(held_to_the_end) == config.max_unfinished_bodies_per_client
    assert {closing for _, closing, _ in answers} == {"close"}
    assert {error["field"] for _, _, error in answers} == {"body"}
    assert http.get(f"{base_url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    "path,content_length,limit_name",
    [
        ("/rollout/generate", 10**12, "max_request_body_bytes"),
        ("/update_weights_from_disk", DEFAULT_LIMIT + 1, "max_request_body_bytes"),
        ("/get_weights_checksum", 10**12, "max_request_body_bytes"),
        ("/update_weights_from_tensor", 2**40, "max_weight_update_body_bytes"),
    ],
)
def test_a_body_declared_over_the_limit_is_a_413_naming_the_limit(base_url, path, content_length, limit_name):
    status, body = post_declaring(base_url, path, content_length)
    assert status == 413
    limit = getattr(RolloutAppConfig(), limit_name)
    message = body["error"]["message"] if path == "/rollout/generate" else body["message"]
    assert f"limit of {limit} bytes ({limit_name}" in message


def test_a_chunked_body_over_the_limit_is_a_413(http, base_url):
    def chunks():  # no Content-Length: requests sends it chunked
        yield b'{"prompt": "7", "pad": "'
        for _ in range(2 * DEFAULT_LIMIT // (64 * KiB)):
            yield b" " * 64 * KiB
        yield b'"}'

    response = http.post(f"{base_url}/rollout/generate", data=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"] == {"field": "body", "message": response.json()["detail"]}


def test_a_weight_update_body_over_the_request_limit_is_read_under_its_own(http, base_url):
    big = torch.zeros(DEFAULT_LIMIT // 4 + KiB)  # float32: over the request limit
    # A wrong lora_rank is refused after the body is read and before any weight changes: a body
    # that does not fit the schema, 422 on every route, with SGLang's weight-route answer.
    body = msgpack.packb(TensorEncoder().encode({"named_tensors": {"w": big}, "lora_rank": "eight"}))
    assert len(body) > DEFAULT_LIMIT
    response = http.post(
        f"{base_url}/update_weights_from_tensor", data=body, headers={"Content-Type": "application/msgpack"}
    )
    assert response.status_code == 422 and response.json()["success"] is False, response.text
    assert response.json()["message"].startswith("lora_rank: ")


@pytest.mark.parametrize("content_type", ["application/json", "application/msgpack"])
def test_deep_bodies_are_a_422_and_never_a_500(http, base_url, content_type):
    for depth in (MAX_NESTING_DEPTH + 1, 900, 100_000):
        if content_type == "application/json":
            raw = b'{"prompt": "7", "extra_sampling_params": {"seed": ' + b"[" * depth + b"]" * depth + b"}}"
        else:
            raw = msgpack.packb({"prompt": "7", "extra_sampling_params": {"seed": 0}})[:-1] + b"\x91" * depth + b"\x00"
        response = http.post(f"{base_url}/rollout/generate", data=raw, headers={"Content-Type": content_type})
        assert response.status_code == 422, (depth, response.text)
        # JSON 100,000 deep is also more lists than its 200 KB may hold, counted before it is parsed.
        refusal = f"deeper than {MAX_NESTING_DEPTH} levels|more than [0-9]+ maps and lists"
        assert re.search(refusal, response.json()["error"]["message"])
    # The weight routes parse the same way (and then walk the value recursively), with the same status.
    raw = b"[" * 900 + b"]" * 900
    response = http.post(f"{base_url}/update_weights_from_tensor", data=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 422 and "deeper than" in response.json()["message"]


@pytest.mark.parametrize(
    "body,field",
    [
        ({"prompt": "x" * 1_000_000}, "prompt"),  # refused by the model, in a worker replica
        ({"prompt": "7", "notes": "x" * (DEFAULT_LIMIT - KiB)}, "notes"),  # just under the body limit
        ({"prompt": "7", "k" * (DEFAULT_LIMIT - KiB): 1}, "kkkkkkkkkkkkkkkkkkkkkkkkkkkkkk"),
        ({"prompt": ["x" * 1_000_000, 2, 3, 4]}, "prompt"),
    ],
    ids=["1MB-prompt", "huge-unknown-field", "huge-unknown-key", "mistyped-list"],
)
def test_huge_values_get_a_small_answer(http, base_url, body, field):
    response = http.post(f"{base_url}/rollout/generate", data=json.dumps(body), headers={"Content-Type": "application/json"})
    assert response.status_code in (400, 422), response.text[:500]
    assert len(response.content) < SMALL_ANSWER
    assert response.json()["error"]["field"].startswith(field)


def test_a_50_MB_unknown_field_is_a_small_413(base_url):
    # Declared, as any client declares a body it has in memory; none of it is read.
    status, body = post_declaring(base_url, "/rollout/generate", 50 * 10**6)
    assert status == 413 and len(json.dumps(body)) < SMALL_ANSWER


@pytest.mark.parametrize(
    "field,value,limit_name",
    [
        ("guidance_scale", 1e308, "max_guidance_scale"),
        ("true_cfg_scale", 1e308, "max_guidance_scale"),
        ("rollout_noise_level", 1e6, "max_noise_level"),
        ("width", 10**9, "max_image_size"),
    ],
)
def test_values_that_would_make_non_finite_outputs_are_a_400_naming_the_limit(http, base_url, field, value, limit_name):
    response = http.post(f"{base_url}/rollout/generate", json={"prompt": "7", "num_inference_steps": 2, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == field and f"(limits.{limit_name})" in error["message"]



def test_a_request_over_its_cost_limit_is_a_quick_400_and_every_answer_carries_its_cost(http, base_url):
    # 32 samples at 1024x1024 and 50 steps: within every other limit of the test app, and costed by
    # the embedded model's facts (2 px a token, guided by default) at 847M token-steps.
    size = {"height": 1024, "width": 1024}
    body = {"prompt": [str(d) for d in range(4)], "num_outputs_per_prompt": 8, **size, "num_inference_steps": 50}
    http.post(f"{base_url}/rollout/generate", json=body)  # the first asks a worker for the cost facts
    started = time.perf_counter()
    response = http.post(f"{base_url}/rollout/generate", json=body)
    elapsed = time.perf_counter() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == "num_outputs_per_prompt, height, width, num_inference_steps"
    assert "this request costs 847,249,408 token-steps, over limits.max_request_cost (128,000,000)" in error["message"]
    assert elapsed < 0.5, elapsed  # planned and costed at the ingress: nothing reaches a worker
    info = http.get(f"{base_url}/rollout/info").json()
    assert info["limits"]["max_request_cost"] == 128_000_000 and info["cost_facts"]["token_pixels"] == 2
    assert info["max_queued_cost"] == 4 * 2 * 16 * (64 * 2 * 20 + 64)  # 4 batches of 16 on each of 2 workers
    rows = from_msgpack(http.post(f"{base_url}/rollout/generate", json={"prompt": "7", "num_inference_steps": 2}).content)
    assert [row["request_cost"] for row in rows] == [64 * 2 * 2 + 64]

def test_a_long_step_list_is_refused_and_health_stays_responsive(http, base_url):
    # Refused by its length (benchmarks.reliability times it: 12.8 s once, with the ingress's event
    # loop blocked throughout); the server goes on answering.
    body = {"prompt": "7", "num_inference_steps": 20, "rollout_return_step_indices": [0] * 5_000}
    response = http.post(f"{base_url}/rollout/generate", json=body)
    assert response.status_code == 400 and "at most 21 entries" in response.json()["error"]["message"]
    # 150,000 items in 300 KB are more than a body of that size may decode into: refused as it is parsed.
    body["rollout_return_step_indices"] = [0] * 150_000
    response = http.post(f"{base_url}/rollout/generate", json=body)
    assert response.status_code == 422 and "items in them, the most its size allows" in response.json()["error"]["message"]
    assert http.get(f"{base_url}/health").status_code == 200
