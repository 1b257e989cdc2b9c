"""`rollout.client.RolloutClient`'s retries, timeouts and errors, against a scripted HTTP server on
127.0.0.1 (no Ray): a refusal with Retry-After is retried after the time it names, within the
call's timeout and its attempts; every other refusal raises at once, typed and naming the field."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout.client import RequestRefusedError, RolloutClient, ServerError
from rollout.codec import MSGPACK, from_msgpack, to_msgpack
from rollout.errors import CodecError, InvalidRequestError, WeightUpdateError
from rollout.options import SamplingOptions
from rollout.rows import BATCH_MSGPACK
from rollout.sampler import sample
from rollout.testing.batches import assert_same_batch


class ScriptedServer:
    """Answers each POST with the next of `answers` (status, headers, body bytes), and records what came."""

    def __init__(self, answers):
        self.answers, self.received = list(answers), []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                server.received.append((self.path, dict(self.headers), body, time.monotonic()))
                status, headers, answer = server.answers.pop(0)
                self.send_response(status)
                for name, value in {**headers, "Content-Length": str(len(answer))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def close(self):
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def scripted():
    servers = []

    def start(*answers):
        servers.append(ScriptedServer(answers))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def refusal(status, field, message, **headers):
    return status, {"Content-Type": "application/json", **headers}, json.dumps({"error": {"field": field, "message": message}}).encode()


def full(wait="0.2"):
    return refusal(503, "", "Service unavailable: queue full", **{"Retry-After": wait})


@pytest.fixture(scope="module")
def answer(random_pipeline):
    batch = sample(random_pipeline, ["4", "4"], [7, 8], SamplingOptions(num_inference_steps=3, debug=True))
    body = {"request_id": "r-1", "inference_time_s": 0.5, "batch": batch.to_wire()}
    return batch, (200, {"Content-Type": BATCH_MSGPACK, "x-sgld-stages": '{"read_ms":1.5}'}, to_msgpack(body))


def test_a_full_server_is_retried_after_the_time_it_names(scripted, answer):
    batch, ok = answer
    server = scripted(full("0.2"), full("0.3"), ok)
    got = RolloutClient(server.url, token="secret").generate_answer({"prompt": ["4"]})
    assert_same_batch(batch, got.batch)
    assert (got.attempts, got.request_id, got.stages_ms) == (3, "r-1", {"read_ms": 1.5})
    times = [received[3] for received in server.received]
    assert times[1] - times[0] >= 0.2 and times[2] - times[1] >= 0.3
    path, headers, body, _ = server.received[0]
    assert path == "/rollout/generate" and headers["Authorization"] == "Bearer secret"
    assert headers["Content-Type"] == MSGPACK and headers["Accept"] == BATCH_MSGPACK
    assert from_msgpack(body) == {"prompt": ["4"]}


def test_a_wait_past_the_timeout_or_the_last_attempt_raises_the_refusal_at_once(scripted):
    server = scripted(full("30"))
    started = time.monotonic()
    with pytest.raises(ServerError, match="queue full") as raised:
        RolloutClient(server.url, timeout_s=5).generate({"prompt": ["4"]})
    assert time.monotonic() - started < 2 and raised.value.retry_after_s == 30 and raised.value.status == 503
    server = scripted(full("0"), full("0"))
    with pytest.raises(ServerError):
        RolloutClient(server.url, max_attempts=2).generate({"prompt": ["4"]})
    assert len(server.received) == 2


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_refused_request_raises_at_once_naming_the_field(scripted, status):
    server = scripted(refusal(status, "num_inference_steps", "must be <= 50, got 51", **{"Retry-After": "0"}))
    with pytest.raises(RequestRefusedError, match="num_inference_steps: must be <= 50") as raised:
        RolloutClient(server.url).generate({"prompt": ["4"]})
    assert isinstance(raised.value, InvalidRequestError) and raised.value.field == "num_inference_steps"
    assert len(server.received) == 1


def test_a_503_without_retry_after_and_a_500_are_not_retried(scripted):
    server = scripted(refusal(503, "", "Server is sleeping"), refusal(500, "", "internal error"))
    for message in ("Server is sleeping", "internal error"):
        with pytest.raises(ServerError, match=message):
            RolloutClient(server.url).generate({"prompt": ["4"]})
    assert len(server.received) == 2


def test_a_refused_weight_update_is_a_weight_update_error_with_the_servers_reason(scripted):
    server = scripted((400, {"Content-Type": "application/json"}, b'{"success": false, "message": "no weight named x"}'))
    with pytest.raises(WeightUpdateError, match="update_weights_from_disk: no weight named x"):
        RolloutClient(server.url).update_weights_from_disk("/models/step-3")
    assert from_msgpack(server.received[0][2])["model_path"] == "/models/step-3"


def test_an_answer_that_is_not_a_batch_is_a_codec_error(scripted):
    rows = to_msgpack([{"prompt": "4"}])  # SGLang's rows, from a server that ignored the Accept header
    server = scripted((200, {"Content-Type": MSGPACK}, rows), (200, {"Content-Type": MSGPACK}, to_msgpack({"batch": []})))
    with pytest.raises(CodecError, match="a batch answer is a map, got list"):
        RolloutClient(server.url).generate({"prompt": ["4"]})
    with pytest.raises(CodecError, match="not a rollout batch of format"):
        RolloutClient(server.url).generate({"prompt": ["4"]})
