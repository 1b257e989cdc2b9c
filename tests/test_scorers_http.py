"""HttpScorer against a reward server started here, on 127.0.0.1: the wire format both ways, what
is retried and what is not, timeouts, and answers refused (malformed, pickled, oversize).

The server decodes requests with the codec, never with pickle, and scores each sample by the mean
of the values it decoded, so a score equal to the mean of the sample as sent shows the image
arrived intact: exactly for a tensor envelope, rounded to 8 bits for a PNG.
"""

from __future__ import annotations

import base64
import io
import math
import pickle
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from rollout.codec import from_json, from_msgpack, to_json, to_msgpack
from rollout.errors import ModelLoadError, ScorerError
from rollout.scorers.base import Scorer, ScoringSample
from rollout.scorers.http import JSON, MSGPACK, HttpScorer
from rollout.scorers.registry import build_scorer
from rollout.video import frames_as_uint8

# A server's sleep or hold is cut short when the test ends, so none outlives it by more than this.
SERVER_WAIT_S = 5.0


@dataclass
class Answer:
    """What the server answers to one request."""

    body: bytes
    content_type: str = JSON
    status: int = 200
    delay_s: float = 0.0  # before the status line: a slow server
    declared_length: int | None = None  # a Content-Length other than the body's
    send_length: bool = True  # False: no Content-Length, the body ends when the connection closes
    hold_open_s: float = 0.0  # after the body, before closing the connection
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Received:
    """One request as the server decoded it; an image is a tensor (an envelope), a uint8 array
    `(H, W, C)` or `(H, W)` (a PNG), or a list of those arrays (a video's frames)."""

    content_type: str
    prompts: list[str]
    metadata: list[dict]
    images: list[Any]
    condition_images: list[list[Any]]


def mean_scores(request: Received) -> list[float]:
    """Each image's mean value: a tensor's `mean()`, a PNG's over its 0..255 values (exact: an
    integer sum over a count)."""
    scores = []
    for image in request.images:
        if isinstance(image, torch.Tensor):
            scores.append(image.mean().item())
        else:
            frames = image if isinstance(image, list) else [image]
            scores.append(sum(int(frame.sum(dtype=np.int64)) for frame in frames) / sum(frame.size for frame in frames))
    return scores


def encoded(value: Any, content_type: str) -> bytes:
    return to_msgpack(value) if content_type == MSGPACK else to_json(value).encode()


def score_means(hit: int, request: Received) -> Answer:
    """The well-behaved server: mean scores, in the encoding of the request."""
    return Answer(encoded({"scores": mean_scores(request)}, request.content_type), request.content_type)


class RewardServer:
    """A threaded HTTP server on 127.0.0.1 whose answers come from `script(hit, request)`, `hit`
    counting requests from 1."""

    def __init__(self):
        self.script: Callable[[int, Received], Answer] = score_means
        self.hits = 0
        self.connections_closed = 0  # answers after which the server closed the connection, their hold_open_s over
        self.received: list[Received] = []
        self.errors: list[str] = []  # what the server found wrong in a request
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.reward_server = self
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/score"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def count(self, request: Received) -> int:
        with self._lock:
            self.hits += 1
            self.received.append(request)
            return self.hits

    def count_closed_connection(self) -> None:
        with self._lock:
            self.connections_closed += 1

    def close(self) -> None:
        self.stop.set()  # ends every sleep and hold of a handler still running
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=SERVER_WAIT_S)


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        server: RewardServer = self.server.reward_server
        body = self.rfile.read(int(self.headers["Content-Length"]))
        try:
            request = _decoded_request(body, self.headers["Content-Type"])
        except Exception as error:  # reported to the test, and to the scorer as a 500
            server.errors.append(repr(error))
            self.send_error(500, explain=repr(error)[:200])
            return
        answer = server.script(server.count(request), request)
        if server.stop.wait(min(answer.delay_s, SERVER_WAIT_S)):
            return
        try:
            self.send_response(answer.status)
            self.send_header("Content-Type", answer.content_type)
            for name, value in answer.headers.items():
                self.send_header(name, value)
            if answer.send_length:
                self.send_header("Content-Length", str(answer.declared_length or len(answer.body)))
            self.end_headers()
            self.wfile.write(answer.body)
            self.wfile.flush()
            if not server.stop.wait(min(answer.hold_open_s, SERVER_WAIT_S)):
                server.count_closed_connection()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the scorer stopped reading: what some tests check it does

    def log_message(self, *args):
        pass  # quiet: the tests assert what the server saw


def _decoded_request(body: bytes, content_type: str) -> Received:
    """The request body as the codec decodes it (envelopes into tensors), its PNGs into arrays;
    raises if it is not the wire format."""
    assert content_type in (JSON, MSGPACK), content_type
    decoded = from_msgpack(body) if content_type == MSGPACK else from_json(body)
    assert set(decoded) == {"prompts", "metadata", "images", "condition_images"}, sorted(decoded)
    count = len(decoded["prompts"])
    assert all(len(decoded[key]) == count for key in ("metadata", "images", "condition_images"))
    assert all(isinstance(prompt, str) for prompt in decoded["prompts"])
    assert all(isinstance(metadata, dict) for metadata in decoded["metadata"])
    images = [_decoded_image(image, content_type) for image in decoded["images"]]
    conditions = [[_decoded_image(image, content_type) for image in row] for row in decoded["condition_images"]]
    return Received(content_type, decoded["prompts"], decoded["metadata"], images, conditions)


def _decoded_image(image: Any, content_type: str) -> Any:
    if isinstance(image, torch.Tensor):
        return image
    if isinstance(image, list):
        return [_decoded_image(frame, content_type) for frame in image]
    # Bytes are raw in msgpack, base64 text in JSON.
    assert isinstance(image, bytes if content_type == MSGPACK else str), type(image)
    png = image if isinstance(image, bytes) else base64.b64decode(image, validate=True)
    with Image.open(io.BytesIO(png)) as decoded:
        assert decoded.format == "PNG", decoded.format
        return np.asarray(decoded)


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")  # a proxy in the environment never sees these requests
    monkeypatch.setenv("no_proxy", "127.0.0.1")
    reward_server = RewardServer()
    yield reward_server
    reward_server.close()
    assert not reward_server.errors


def samples() -> list[ScoringSample]:
    """An RGB image, a grayscale one and a 4-frame RGB video, with values at 0, 1 and a rounding
    boundary of 8 bits among them."""
    generator = torch.Generator().manual_seed(0)
    rgb = torch.rand(3, 8, 6, generator=generator)
    gray = torch.rand(1, 8, 6, generator=generator)
    video = torch.rand(3, 4, 8, 6, generator=generator)  # (C, F, H, W)
    rgb[0, 0, :3] = torch.tensor([0.0, 1.0, 0.5 / 255])
    return [
        ScoringSample(rgb, "a red cube", {"seed": 7, "prompt_index": 0, "sample_index": 0, "branch_path": (0, 1)}),
        ScoringSample(gray, "the digit 3", {"seed": 8, "prompt_index": 1, "sample_index": 0, "branch_path": ()}),
        ScoringSample(video, "a cat walking", {"seed": 9, "prompt_index": 2, "sample_index": 1, "branch_path": ()}),
    ]


def png_mean(image: torch.Tensor) -> float:
    """The mean of `image` rounded to 0..255, computed apart from the scorer's code."""
    rounded = (image * 255).round().to(torch.int64)
    return rounded.sum().item() / rounded.numel()


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("image_format", ["png", "tensor"])
def test_scores_are_the_means_of_the_images_the_server_decoded(server, encoding, image_format):
    batch = samples()
    scores = HttpScorer(server.url, encoding=encoding, image_format=image_format).score(batch)

    (request,) = server.received
    assert request.content_type == {"json": JSON, "msgpack": MSGPACK}[encoding]
    assert request.prompts == [sample.prompt for sample in batch]
    assert request.metadata == [{**sample.metadata, "branch_path": list(sample.metadata["branch_path"])} for sample in batch]
    if image_format == "tensor":
        for sample, image in zip(batch, request.images):
            assert image.dtype == torch.float32 and torch.equal(image, sample.image)
        assert scores == [sample.image.mean().item() for sample in batch]
    else:
        assert scores == [png_mean(sample.image) for sample in batch]


def test_video_travels_as_one_png_per_frame_and_grayscale_as_one_channel(server):
    rgb, gray, video = (sample.image for sample in samples())
    HttpScorer(server.url, encoding="msgpack").score(samples())

    (request,) = server.received
    sent_rgb, sent_gray, frames = request.images
    assert np.array_equal(sent_rgb, frames_as_uint8(rgb.unsqueeze(1))[:, 0].permute(1, 2, 0).numpy())  # (H, W, 3)
    assert sent_gray.shape == (8, 6) and np.array_equal(sent_gray, (gray[0] * 255).round().to(torch.uint8).numpy())
    assert len(frames) == 4
    for index, frame in enumerate(frames):
        assert np.array_equal(frame, frames_as_uint8(video)[:, index].permute(1, 2, 0).numpy())


@pytest.mark.parametrize("encoding", ["json", "msgpack"])
@pytest.mark.parametrize("image_format", ["png", "tensor"])
def test_an_edits_input_images_reach_the_server_as_sent(server, encoding, image_format):
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, 256, (3, 5, 7), generator=generator, dtype=torch.uint8) for _ in range(2)]
    edit = ScoringSample(torch.rand(3, 8, 6, generator=generator), "make it red", {"seed": 1}, tuple(inputs))
    text = ScoringSample(torch.rand(3, 8, 6, generator=generator), "a cat", {"seed": 2})
    HttpScorer(server.url, encoding=encoding, image_format=image_format).score([edit, text])

    (request,) = server.received
    sent, none = request.condition_images
    assert none == [] and len(sent) == 2
    for image, pixels in zip(sent, inputs):
        if image_format == "tensor":
            assert image.dtype == torch.uint8 and torch.equal(image, pixels)
        else:
            assert np.array_equal(image, pixels.permute(1, 2, 0).numpy())  # the PNG's (H, W, 3), exact


def test_no_samples_no_request(server):
    assert HttpScorer(server.url).score([]) == []
    assert server.hits == 0


# Set when a payload is unpickled: the scorer must never do it.
UNPICKLED: list[str] = []


def _run_on_unpickle() -> str:
    UNPICKLED.append("code ran")
    return "trap"


class _Trap:
    def __reduce__(self):
        return (_run_on_unpickle, ())


@pytest.mark.parametrize("content_type", [JSON, MSGPACK, "application/octet-stream", "application/python-pickle"])
def test_a_pickled_answer_is_refused_and_never_unpickled(server, content_type):
    payload = pickle.dumps({"scores": [1.0, 2.0, 3.0], "trap": _Trap()})
    pickle.loads(payload)
    assert UNPICKLED == ["code ran"]  # the trap is live
    UNPICKLED.clear()
    server.script = lambda hit, request: Answer(payload, content_type)

    with pytest.raises(ScorerError, match="does not parse|Content-Type"):
        HttpScorer(server.url).score(samples())
    assert UNPICKLED == []
    assert server.hits == 1  # a bad answer is not retried


@pytest.mark.parametrize(
    "answer, problem",
    [
        ({"scores": [1.0, 2.0]}, "2 scores for 3 samples"),
        ({"scores": [0.5] * 1000}, "1000 scores for 3 samples"),
        ({"scores": [1.0, math.nan, 2.0]}, "score 1 is nan"),
        ({"scores": [1.0, 2.0, -math.inf]}, "score 2 is -inf"),
        ({"scores": [1.0, "2.0", 3.0]}, "score 1 is '2.0'"),
        ({"scores": [True, 1, 2]}, "score 0 is True"),
        ({"scores": "x" * 100_000}, "answer must be"),
        ({"rewards": [1.0, 2.0, 3.0]}, "answer must be"),
        ([1.0, 2.0, 3.0], "answer must be"),
    ],
)
@pytest.mark.parametrize("content_type", [JSON, MSGPACK])
def test_an_answer_other_than_one_finite_score_per_sample_is_refused(server, answer, problem, content_type):
    server.script = lambda hit, request: Answer(encoded(answer, content_type), content_type)
    with pytest.raises(ScorerError, match=problem) as raised:
        HttpScorer(server.url, name="my-reward").score(samples())
    assert str(raised.value).startswith("scorer 'my-reward': ")
    assert len(str(raised.value)) < 300  # never the whole answer
    assert server.hits == 1


def test_a_slow_server_times_out_on_each_attempt(server, monkeypatch):
    # The server would answer, SERVER_WAIT_S late: only the scorer's timeout ends an attempt sooner.
    server.script = lambda hit, request: Answer(b'{"scores": [1, 2, 3]}', delay_s=SERVER_WAIT_S)
    backoffs = []
    monkeypatch.setattr("rollout.scorers.http.time", SimpleNamespace(sleep=backoffs.append))
    scorer = HttpScorer(server.url, timeout_s=0.3, retries=2, backoff_s=0.05)

    with pytest.raises(ScorerError, match=r"no answer after 3 attempts: ReadTimeout \(no answer within 0.3 s\)"):
        scorer.score(samples())
    assert server.hits == 3
    assert backoffs == [0.05, 0.1]  # doubling, between attempts only


def test_a_503_is_retried_until_the_server_answers(server):
    server.script = lambda hit, request: Answer(b"warming up", "text/plain", status=503) if hit <= 2 else score_means(hit, request)
    scores = HttpScorer(server.url, retries=2, backoff_s=0.01).score(samples())
    assert scores == [png_mean(sample.image) for sample in samples()]
    assert server.hits == 3


def test_5xx_after_the_last_attempt_says_what_the_server_said(server):
    server.script = lambda hit, request: Answer(b"model not loaded", "text/plain", status=503)
    with pytest.raises(ScorerError, match="no answer after 2 attempts: answered HTTP 503 Service Unavailable: 'model not loaded'"):
        HttpScorer(server.url, retries=1, backoff_s=0.01).score(samples())
    assert server.hits == 2


@pytest.mark.parametrize(
    "status, problem",
    [(400, "answered HTTP 400 Bad Request: 'unknown prompt'"), (307, "redirects are not followed")],
)
def test_a_4xx_or_a_redirect_is_not_retried(server, status, problem):
    headers = {"Location": "http://127.0.0.1:1/elsewhere"} if status == 307 else {}
    server.script = lambda hit, request: Answer(b"unknown prompt", "text/plain", status=status, headers=headers)
    with pytest.raises(ScorerError, match=problem):
        HttpScorer(server.url, retries=3, backoff_s=0.01).score(samples())
    assert server.hits == 1


def test_a_closed_port_is_retried_and_named_without_the_url(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    with socket.socket() as bound:  # bound, never listening: connecting is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/score?token=secret"
        with pytest.raises(ScorerError, match=r"after 2 attempts: ConnectionError \(Connection refused\)") as raised:
            HttpScorer(url, retries=1, backoff_s=0.01).score(samples())
    assert "secret" not in str(raised.value)


@pytest.mark.parametrize(
    "answer",
    [
        Answer(b"{" + b" " * 100, declared_length=10**9, hold_open_s=SERVER_WAIT_S),  # says so in Content-Length
        Answer(b"{" + b" " * 4096, send_length=False, hold_open_s=SERVER_WAIT_S),  # streams on with no length
    ],
    ids=["declared", "streamed"],
)
def test_an_oversize_answer_is_refused_without_reading_it_all(server, answer):
    server.script = lambda hit, request: answer
    with pytest.raises(ScorerError, match="over max_response_bytes=1024"):
        HttpScorer(server.url, timeout_s=SERVER_WAIT_S, max_response_bytes=1024).score(samples())
    # Reading to the end waits for the server to close the connection, which it holds open after the body.
    assert server.connections_closed == 0, "the scorer read the answer until the server closed the connection"
    assert server.hits == 1


@pytest.mark.parametrize("extra_bytes, accepted", [(0, True), (1, False)])
def test_an_answer_of_exactly_max_response_bytes_is_read(server, extra_bytes, accepted):
    limit = 1024
    scores = [png_mean(sample.image) for sample in samples()]
    body = to_json({"scores": scores}).encode()
    body += b" " * (limit + extra_bytes - len(body))  # JSON allows trailing whitespace
    server.script = lambda hit, request: Answer(body)
    scorer = HttpScorer(server.url, max_response_bytes=limit)
    if accepted:
        assert scorer.score(samples()) == scores
    else:
        with pytest.raises(ScorerError, match="over max_response_bytes"):
            scorer.score(samples())


@pytest.mark.parametrize(
    "options, field",
    [
        ({"url": "ftp://example.com/score"}, "url"),
        ({"url": "http:///score"}, "url"),
        ({"url": "http://[::1/score"}, "url"),
        ({"url": 7}, "url"),
        ({"name": ""}, "name"),
        ({"encoding": "pickle"}, "encoding"),
        ({"image_format": "jpeg"}, "image_format"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": math.inf}, "timeout_s"),
        ({"retries": -1}, "retries"),
        ({"retries": 1.5}, "retries"),
        ({"retries": 11}, "retries"),
        ({"backoff_s": -0.1}, "backoff_s"),
        ({"max_response_bytes": 0}, "max_response_bytes"),
    ],
)
def test_bad_options_are_refused_by_name(options, field):
    with pytest.raises(ModelLoadError) as raised:
        HttpScorer(**{"url": "http://127.0.0.1:1/score", **options})
    assert raised.value.field == field


def test_built_by_name_from_the_registry():
    scorer = build_scorer("http", {"url": "https://rewards.internal/score", "name": "aesthetic", "encoding": "msgpack"})
    assert isinstance(scorer, HttpScorer) and isinstance(scorer, Scorer)
    assert scorer.group_aware is False and scorer.name == "aesthetic"


def test_png_refuses_a_channel_count_it_cannot_write(server):
    rgba = ScoringSample(torch.rand(4, 8, 8), "a sticker")
    with pytest.raises(ScorerError, match="1 or 3 channels, got \\(4, 8, 8\\)"):
        HttpScorer(server.url).score([rgba])
    assert HttpScorer(server.url, image_format="tensor").score([rgba]) == [rgba.image.mean().item()]
