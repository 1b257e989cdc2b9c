"""A scorer that asks a user's own reward server over HTTP: one POST per `score` call.

The wire format, both ways JSON or msgpack:

    POST <url>   Content-Type: application/json (or application/msgpack)
    {"prompts": [str, ...], "metadata": [{...}, ...], "images": [image, ...],
     "condition_images": [[image, ...], ...]}

one entry per sample in each list, in order. With `image_format="png"` an image is the bytes of
a PNG (8-bit RGB, or grayscale for a one-channel image) and a video `(C, F, H, W)` is a list of
PNGs, one per frame; the [0, 1] floats are rounded to 0..255 as `rollout.video.frames_as_uint8`
rounds them. With `image_format="tensor"` an image or a video is this server's tensor envelope
(`rollout.codec.encode_tensor`: the sample's fp32 tensor, exact). `condition_images` are the
sample's prompt's input images (an editing or image-to-video model's; [] for a text prompt), as
the client sent them: PNGs of their 8-bit pixels, or `(3, H, W)` uint8 envelopes, both exact.
Bytes are raw in msgpack and base64 text in JSON (a PNG's, and an envelope's `data`, as the
codec writes it).

The server answers 200 with `{"scores": [float, ...]}`, one finite number per sample, as JSON or
msgpack by its Content-Type. Answers are parsed by the codec's parsers (`parse_json`,
`parse_msgpack`), never unpickled, and are read only up to `max_response_bytes`.

A failure a retry may fix (no connection, a timeout, a 5xx) is retried with a doubling backoff;
any other (a 4xx, a malformed answer) fails at once. Either way the caller gets `ScorerError`,
whose message never echoes the answer beyond a short excerpt, nor the URL (it may hold a token).
"""

from __future__ import annotations

import base64
import io
import math
import time
from collections.abc import Sequence
from typing import Any, ClassVar
from urllib.parse import urlsplit

import requests
import torch
from PIL import Image
from urllib3.exceptions import HTTPError as TransportError
from urllib3.exceptions import ProtocolError
from urllib3.exceptions import TimeoutError as TransportTimeout

from rollout.codec import parse_json, parse_msgpack, to_json, to_msgpack
from rollout.errors import CodecError, ModelLoadError, ScorerError, short_repr
from rollout.scorers.base import ScoringSample
from rollout.video import frames_as_uint8

JSON = "application/json"
MSGPACK = "application/msgpack"
# msgpack has no type every server agrees on; these are the names in use.
_MSGPACK_TYPES = {MSGPACK, "application/x-msgpack", "application/vnd.msgpack"}
ENCODINGS = {"json": JSON, "msgpack": MSGPACK}
IMAGE_FORMATS = ("png", "tensor")
# Past 10 retries a doubling backoff waits minutes (0.5 s doubled 10 times is 512 s).
MAX_RETRIES = 10
# Enough of an error answer to say what the server objected to.
_EXCERPT_BYTES = 200
_READ_BYTES = 64 * 2**10


class _RetryableFailure(Exception):
    """An attempt that failed in a way a later attempt may not: `cause` says how."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


class HttpScorer:
    """Scores samples by POSTing them to a reward server (the wire format is the module's docstring).

    Per-sample (`group_aware = False`): the server must score each sample on its own, whatever
    samples come with it, since the deployment may batch samples from several requests.

    One `requests.Session` per scorer keeps its connections open between calls. A deployment
    that calls `score` from several threads at once shares it: requests does not promise that a
    Session is thread-safe (psf/requests#2766), but what the calls share here is urllib3's
    connection pool, which is, and the cookie jar, which locks; the session's settings are made
    once, here, and never changed.

    Args:
        url: the server's scoring endpoint, `http://` or `https://`.
        name: the scorer's name in errors, as requests name it.
        encoding: `"json"` or `"msgpack"`, the request body's; the answer may be either.
        image_format: `"png"` (8 bits per channel, what most reward models read) or `"tensor"`
            (the fp32 sample, exactly).
        timeout_s: the longest wait to connect, and for each read of the answer, per attempt.
        retries: attempts after the first on a connection error, a timeout or a 5xx.
        backoff_s: the wait before the first retry; each next one waits twice as long.
        max_response_bytes: a longer answer is refused; no more than this is read of it.

    Raises:
        ModelLoadError: an argument is out of range; its `field` names it.
    """

    group_aware: ClassVar[bool] = False

    def __init__(
        self,
        url: str,
        name: str = "http",
        encoding: str = "json",
        image_format: str = "png",
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        max_response_bytes: int = 1 << 20,
    ):
        if not _is_http_url(url):
            raise ModelLoadError("url", f"must be an http:// or https:// URL with a host, got {short_repr(url)}")
        if not isinstance(name, str) or not name:
            raise ModelLoadError("name", f"must be a non-empty string, got {short_repr(name)}")
        if encoding not in ENCODINGS:
            raise ModelLoadError("encoding", f"must be one of {sorted(ENCODINGS)}, got {short_repr(encoding)}")
        if image_format not in IMAGE_FORMATS:
            raise ModelLoadError("image_format", f"must be one of {list(IMAGE_FORMATS)}, got {short_repr(image_format)}")
        if not _is_number(timeout_s) or not 0 < timeout_s < math.inf:
            raise ModelLoadError("timeout_s", f"must be a positive number of seconds, got {short_repr(timeout_s)}")
        if not _is_int(retries) or not 0 <= retries <= MAX_RETRIES:
            raise ModelLoadError("retries", f"must be an integer from 0 to {MAX_RETRIES}, got {short_repr(retries)}")
        if not _is_number(backoff_s) or not 0 <= backoff_s < math.inf:
            raise ModelLoadError("backoff_s", f"must be a non-negative number of seconds, got {short_repr(backoff_s)}")
        if not _is_int(max_response_bytes) or max_response_bytes < 1:
            raise ModelLoadError("max_response_bytes", f"must be a positive integer, got {short_repr(max_response_bytes)}")
        self.url = url
        self.name = name
        self.encoding = encoding
        self.image_format = image_format
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.max_response_bytes = max_response_bytes
        self._session = requests.Session()
        accepted = [ENCODINGS[encoding], *(t for t in ENCODINGS.values() if t != ENCODINGS[encoding])]
        self._session.headers.update({"Content-Type": ENCODINGS[encoding], "Accept": ", ".join(accepted)})

    def score(self, samples: Sequence[ScoringSample]) -> list[float]:
        """One score per sample, in order, from the server's answer.

        Raises:
            ScorerError: the server could not be reached in `retries + 1` attempts, refused the
                samples, or answered something other than one finite score per sample.
        """
        if not samples:
            return []
        body = self._request_body(samples)
        attempts = self.retries + 1
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                answer = self._post(body)
            except _RetryableFailure as failure:
                last_cause = failure.cause
                continue
            return self._scores(answer, len(samples))
        raise ScorerError(self.name, f"no answer after {attempts} attempts: {last_cause}")

    def _request_body(self, samples: Sequence[ScoringSample]) -> bytes:
        payload = {
            "prompts": [sample.prompt for sample in samples],
            "metadata": [dict(sample.metadata) for sample in samples],
            "images": [self._image(sample.image) for sample in samples],
            "condition_images": [[self._condition_image(c) for c in sample.condition_images] for sample in samples],
        }
        if self.encoding == "msgpack":
            return to_msgpack(payload)
        return to_json(payload).encode()

    def _image(self, image: torch.Tensor) -> Any:
        """An image or a video as the body carries it; a tensor is left for the codec to envelope."""
        if self.image_format == "tensor":
            return image
        if image.ndim not in (3, 4) or image.shape[0] not in (1, 3):
            raise ScorerError(
                self.name,
                f"PNG needs an image (C, H, W) or a video (C, F, H, W) with 1 or 3 channels, got {tuple(image.shape)}: "
                "use image_format='tensor' for others",
            )
        pngs = [self._bytes(png) for png in _pngs(image if image.ndim == 4 else image.unsqueeze(1))]
        return pngs if image.ndim == 4 else pngs[0]

    def _condition_image(self, image: torch.Tensor) -> Any:
        """An input image, `(3, H, W)` uint8, as the body carries it: its pixels, exactly."""
        if self.image_format == "tensor":
            return image
        (png,) = _uint8_pngs(image.unsqueeze(1))
        return self._bytes(png)

    def _bytes(self, data: bytes) -> bytes | str:
        return base64.b64encode(data).decode("ascii") if self.encoding == "json" else data

    def _post(self, body: bytes) -> Any:
        """One attempt: the parsed answer. Raises `_RetryableFailure` for what another attempt may
        fix, `ScorerError` for what it will not."""
        try:
            with self._session.post(
                self.url,
                data=body,
                timeout=(self.timeout_s, self.timeout_s),
                stream=True,  # read no more of the answer than `max_response_bytes`
                allow_redirects=False,  # the body goes where the operator configured, or nowhere
            ) as response:
                status = f"HTTP {response.status_code} {response.reason or ''}".rstrip()
                if response.status_code >= 500:
                    raise _RetryableFailure(f"answered {status}: {self._excerpt(response)}")
                if response.status_code != 200:
                    redirect = " (redirects are not followed: configure the final URL)" if response.is_redirect else ""
                    raise ScorerError(self.name, f"answered {status}{redirect}: {self._excerpt(response)}")
                content = self._content(response)
                content_type = response.headers.get("Content-Type", "").partition(";")[0].strip().lower()
        except requests.Timeout as error:
            raise _RetryableFailure(f"{type(error).__name__} (no answer within {self.timeout_s:g} s)") from None
        except TransportTimeout:  # while reading the answer's body
            raise _RetryableFailure(f"read timed out (no more of the answer within {self.timeout_s:g} s)") from None
        except (requests.ConnectionError, ProtocolError) as error:
            raise _RetryableFailure(_described(error)) from None
        except (requests.RequestException, TransportError) as error:
            raise ScorerError(self.name, f"request failed: {_described(error)}") from None
        return self._parsed(content, content_type)

    def _content(self, response: requests.Response) -> bytes:
        """The answer's body; one over `max_response_bytes` is refused having read at most one
        byte more, whatever its Content-Length says."""
        limit = self.max_response_bytes
        declared = response.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ScorerError(self.name, f"answer of {declared} bytes is over max_response_bytes={limit}")
        content = bytearray()
        while len(content) <= limit:
            # Decoded bytes (a gzipped answer is counted as it unpacks), never more than asked.
            chunk = response.raw.read(min(_READ_BYTES, limit + 1 - len(content)), decode_content=True)
            if not chunk:
                return bytes(content)
            content += chunk
        raise ScorerError(self.name, f"answer is over max_response_bytes={limit}")

    def _excerpt(self, response: requests.Response) -> str:
        """The start of an error answer, for the message."""
        text = response.raw.read(_EXCERPT_BYTES, decode_content=True).decode("utf-8", "replace")
        return short_repr(text) if text else "(no body)"

    def _parsed(self, content: bytes, content_type: str) -> Any:
        if content_type in _MSGPACK_TYPES:
            parse = parse_msgpack
        elif content_type == JSON:
            parse = parse_json
        else:
            raise ScorerError(self.name, f"answered Content-Type {short_repr(content_type)}: expected {JSON} or {MSGPACK}")
        try:
            return parse(content)
        except CodecError as error:
            raise ScorerError(self.name, f"answer does not parse: {error}") from None

    def _scores(self, answer: Any, count: int) -> list[float]:
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise ScorerError(self.name, f'answer must be {{"scores": [float, ...]}}, got {short_repr(answer)}')
        if len(scores) != count:
            raise ScorerError(self.name, f"answered {len(scores)} scores for {count} samples")
        for i, score in enumerate(scores):
            if not _is_number(score) or not math.isfinite(score):
                raise ScorerError(self.name, f"score {i} is {short_repr(score)}: each must be a finite number")
        return [float(score) for score in scores]


def _pngs(frames: torch.Tensor) -> list[bytes]:
    """`(C, F, H, W)` frames in [0, 1], C 1 or 3, as one PNG per frame (grayscale or RGB, 8 bits)."""
    channels = frames.shape[0]
    # frames_as_uint8 takes 3 channels; its rounding is per value, so one channel is rounded as
    # a 3-channel view of itself and kept once.
    return _uint8_pngs(frames_as_uint8(frames.expand(3, *frames.shape[1:]))[:channels])


def _uint8_pngs(frames: torch.Tensor) -> list[bytes]:
    """`(C, F, H, W)` uint8 frames, C 1 or 3, as one PNG per frame."""
    channels = frames.shape[0]
    pixels = frames.permute(1, 2, 3, 0).contiguous().cpu().numpy()  # (F, H, W, C), as PIL reads them
    pngs = []
    for frame in pixels:
        buffer = io.BytesIO()
        # Lossless at any level; the fastest, since a scorer's PNGs are read once, nearby.
        Image.fromarray(frame[..., 0] if channels == 1 else frame).save(buffer, format="PNG", compress_level=1)
        pngs.append(buffer.getvalue())
    return pngs


def _described(error: BaseException) -> str:
    """`error`'s type and its first cause's message (e.g. "Connection refused"): requests'
    own message names the URL, which may hold a token."""
    root = error
    for _ in range(16):  # requests wraps urllib3's error, which wraps the socket's
        inner = root.__cause__ or root.__context__
        if inner is None:
            break
        root = inner
    detail = root.strerror if isinstance(root, OSError) and root.strerror else type(root).__name__
    return f"{type(error).__name__} ({detail})"


def _is_http_url(url: Any) -> bool:
    if not isinstance(url, str):
        return False
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port is None or parts.port > 0)
    except ValueError:  # a bad IPv6 host or port
        return False


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
