"""A trainer's client of a running rollout server, over HTTP: plain Python, no Ray.

    client = RolloutClient("http://127.0.0.1:8000", token=os.environ.get("ROLLOUT_AUTH_TOKEN"))
    batch = client.generate({"prompt": ["3", "7"], "num_outputs_per_prompt": 8})   # a RolloutBatch
    batch = await client.generate_async(request)                                   # in an event loop
    client.update_weights_from_tensor(adapter, "step-1", lora_rank=8, lora_alpha=8)

`generate` asks for the batch answer (`rollout.rows.batch_answer`), so it returns what the
deployment handle's `RolloutResult.batch()` returns, the same type and the same bits: one
`RolloutBatch` holding the request's schedule and options once, its samples (a tree's leaves,
with `tree()` for its nodes), their rewards and advantages. Nothing is re-derived from the rows.

Bodies go as msgpack (JSON with `encoding="json"`). A refusal the server says to retry (503 or
429 with `Retry-After`) is retried after the time it names, within the call's `timeout_s`; the
other refusals raise at once: `RequestRefusedError` (an `InvalidRequestError`: 400, 413, 422)
naming the field, `WeightUpdateError` from a weight route, `ServerError` for the rest.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
import torch

from rollout.codec import MSGPACK, from_json, from_msgpack, to_json, to_msgpack
from rollout.errors import MAX_REASON_CHARS, CodecError, InvalidRequestError, RolloutError, WeightUpdateError, clip
from rollout.rows import BATCH_JSON, BATCH_MSGPACK
from rollout.trajectory import RolloutBatch
from rollout.weight_sync import BUCKET_BYTES, SharedMemorySender, WeightSender

# Statuses a server answers with Retry-After when it is momentarily full: retried after that time.
RETRIED_STATUSES = (429, 503)
# Refusals of the request itself, each naming a field: raised as `RequestRefusedError`.
REFUSED_STATUSES = (400, 413, 422)


class ServerError(RolloutError):
    """The server answered an error this client raises as it came.

    Attributes:
        status: the HTTP status.
        field: the field the server's error names ("" where it names none).
        message: the server's message.
        retry_after_s: the wait the server asked for, where it asked for one.
    """

    def __init__(self, status: int, field: str, message: str, retry_after_s: float | None = None):
        self.status, self.field, self.retry_after_s = status, clip(field), retry_after_s
        self.message = clip(message, MAX_REASON_CHARS)
        RolloutError.__init__(self, f"HTTP {status}: {self.field + ': ' if self.field else ''}{self.message}")

    def __reduce__(self):
        return (type(self), (self.status, self.field, self.message, self.retry_after_s))


class RequestRefusedError(ServerError, InvalidRequestError):
    """The server refused the request (400, 413, 422), naming the field: what the handle raises as
    `InvalidRequestError`, so one `except InvalidRequestError` serves both."""

    def __init__(self, status: int, field: str, message: str, retry_after_s: float | None = None):
        ServerError.__init__(self, status, field, message, retry_after_s)
        self.reason = self.message


@dataclass(frozen=True)
class RolloutAnswer:
    """The server's answer to one generate request.

    Attributes:
        batch: the samples, with their request's schedule and options once (`RolloutBatch`).
        request_id, inference_time_s, peak_memory_mb, transformer_rows, transformer_rows_unbranched,
            request_cost, reward_time_s, reward_wait_s: the request's fields of every row
            (`rollout.rows.request_fields`), once.
        stages_ms: the server's time in each stage of the request (its `x-sgld-stages` header).
        attempts: the HTTP requests it took (more than 1 after refusals that were retried).
    """

    batch: RolloutBatch
    request_id: str
    inference_time_s: float
    peak_memory_mb: float | None = None
    transformer_rows: int | None = None
    transformer_rows_unbranched: int | None = None
    request_cost: int | None = None
    reward_time_s: float | None = None
    reward_wait_s: float | None = None
    stages_ms: dict[str, float] = field(default_factory=dict)
    attempts: int = 1


class RolloutClient:
    """A running server at `url` (`http://host:port`, with its route prefix if it has one).

    Args:
        token: the server's `auth_token`, sent as `Authorization: Bearer`; None for a server without.
        timeout_s: the most one call takes, its retries and their waits included.
        max_attempts: the most HTTP requests one call makes (a refusal with Retry-After is retried).
        encoding: "msgpack" (default) or "json", for bodies both ways.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 600.0,
        max_attempts: int = 5,
        encoding: str = "msgpack",
    ):
        if encoding not in ("msgpack", "json"):
            raise InvalidRequestError("encoding", f"must be 'msgpack' or 'json', got {encoding!r}")
        if max_attempts < 1:
            raise InvalidRequestError("max_attempts", f"must be >= 1, got {max_attempts!r}")
        self.url = url.rstrip("/")
        self.timeout_s, self.max_attempts, self.encoding = timeout_s, max_attempts, encoding
        self._headers = {} if token is None else {"Authorization": f"Bearer {token}"}

    # Sampling ----------------------------------------------------------------------------------

    def generate(self, request: Mapping[str, Any]) -> RolloutBatch:
        """Samples `request` (SGLang's fields and this server's, as `POST /rollout/generate` takes
        them); the batch, as the handle's `RolloutResult.batch()` gives it."""
        return self.generate_answer(request).batch

    async def generate_async(self, request: Mapping[str, Any]) -> RolloutBatch:
        """`generate`, awaited: the HTTP call runs on a thread, so an event loop (an RL loop's) keeps
        serving its other work and requests meanwhile."""
        return (await self.generate_answer_async(request)).batch

    def generate_answer(self, request: Mapping[str, Any]) -> RolloutAnswer:
        """`generate`, with the request's own fields and the server's stage times."""
        accept = BATCH_MSGPACK if self.encoding == "msgpack" else BATCH_JSON
        response, attempts = self._post("rollout/generate", dict(request), accept)
        decode = from_msgpack if self.encoding == "msgpack" else from_json
        answer = decode(response.content)
        if not isinstance(answer, dict):
            raise CodecError(f"a batch answer is a map, got {type(answer).__name__}: is {self.url} this server?")
        fields = {name: answer.get(name) for name in _REQUEST_FIELDS}
        stages = json.loads(response.headers.get("x-sgld-stages") or "{}")
        return RolloutAnswer(RolloutBatch.from_wire(answer.get("batch")), **fields, stages_ms=stages, attempts=attempts)

    async def generate_answer_async(self, request: Mapping[str, Any]) -> RolloutAnswer:
        return await asyncio.to_thread(self.generate_answer, request)

    def info(self) -> dict[str, Any]:
        """`GET /rollout/info`: the model, its defaults, the served weights, the sizes it serves."""
        return self._get("rollout/info")

    # Weights -----------------------------------------------------------------------------------

    def weight_route(self, route: str, body: dict) -> dict:
        """SGLang's weight route `route` (e.g. "update_weights_from_disk") with `body`; its answer
        (`success`, `message`, `weight_version`, ...), or `WeightUpdateError` with the server's
        reason. A `rollout.weight_sync.ServerCall`: the senders of that module take it."""
        try:
            response, _ = self._post(route, body, "application/json")
        except ServerError as refusal:
            raise WeightUpdateError(route, refusal.message) from None
        answer = response.json()
        if answer.get("success") is False:
            raise WeightUpdateError(route, str(answer.get("message")))
        return answer

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, target_modules: Sequence[str] | None = None
    ) -> dict:
        """Every replica serves the checkpoint at `model_path` (a path on the server's machines)."""
        body = {"model_path": model_path, "weight_version": weight_version, "target_modules": _listed(target_modules)}
        return self.weight_route("update_weights_from_disk", body)

    def update_weights_from_tensor(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        weight_version: str | None = None,
        *,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        target_modules: Sequence[str] | None = None,
    ) -> dict:
        """Every replica serves `named_tensors`, sent in the body as tensor envelopes: full weights
        of a module, or a PEFT LoRA adapter (`get_peft_model_state_dict`) with `lora_rank` and
        `lora_alpha`. For large weights, `weight_sender` or `shared_memory_sender` send them in buckets."""
        body = {
            "named_tensors": {name: tensor.detach().cpu().contiguous() for name, tensor in named_tensors.items()},
            "weight_version": weight_version,
            "lora_rank": lora_rank,
            "lora_alpha": lora_alpha,
            "target_modules": _listed(target_modules),
        }
        return self.weight_route("update_weights_from_tensor", body)

    def weight_sender(self, server_ranks: int, master_port: int, **options: Any) -> WeightSender:
        """SGLang's weight-update group with this server's replicas (`rollout.weight_sync.WeightSender`:
        `options` are its own), this trainer rank 0: `.update(named_tensors, weight_version)`, `.close()`."""
        return WeightSender(self.weight_route, server_ranks, master_port, **options)

    def shared_memory_sender(
        self, device: torch.device | str = "cpu", bucket_bytes: int = BUCKET_BYTES, deltas: bool = False
    ) -> SharedMemorySender:
        """For replicas on this trainer's machine: buckets shared in memory (`rollout.weight_sync.SharedMemorySender`)."""
        return SharedMemorySender(self.weight_route, device, bucket_bytes, deltas)

    def get_weights_checksum(self, module_names: Sequence[str] | None = None) -> dict:
        """Per module, the SHA-256 every replica serves ("inconsistent" where they differ), and per replica."""
        return self.weight_route("get_weights_checksum", {"module_names": _listed(module_names)})

    # HTTP --------------------------------------------------------------------------------------

    def _get(self, route: str) -> dict:
        response = requests.get(f"{self.url}/{route}", headers=self._headers, timeout=self.timeout_s)
        if response.status_code != 200:
            raise _error_of(response)
        return response.json()

    def _post(self, route: str, body: dict, accept: str) -> tuple[requests.Response, int]:
        """The answer to `body` posted to `route`, retrying refusals that name a time to retry
        after, within `timeout_s`; the other errors raised (`_error_of`)."""
        if self.encoding == "msgpack":
            data, content_type = to_msgpack(body), MSGPACK
        else:
            data, content_type = to_json(body).encode(), "application/json"
        headers = {**self._headers, "Content-Type": content_type, "Accept": accept}
        deadline = time.monotonic() + self.timeout_s
        for attempt in range(1, self.max_attempts + 1):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{route}: no answer within timeout_s={self.timeout_s} ({attempt - 1} attempts)")
            response = requests.post(f"{self.url}/{route}", data=data, headers=headers, timeout=left)
            if response.status_code == 200:
                return response, attempt
            error = _error_of(response)
            wait = error.retry_after_s
            if (
                response.status_code not in RETRIED_STATUSES
                or wait is None
                or attempt == self.max_attempts
                or time.monotonic() + wait >= deadline
            ):
                raise error
            time.sleep(wait)
        raise AssertionError("unreachable: the last attempt returns or raises")


# The batch answer's fields of the whole request (`rollout.rows.request_fields`), as `RolloutAnswer` names them.
_REQUEST_FIELDS = tuple(f.name for f in dataclasses.fields(RolloutAnswer) if f.name not in ("batch", "stages_ms", "attempts"))


def _listed(values: Sequence[str] | None) -> list[str] | None:
    return None if values is None else list(values)


def _retry_after_s(value: str | None) -> float | None:
    """A Retry-After header's wait in seconds: a number of seconds, or an HTTP date."""
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _error_of(response: requests.Response) -> ServerError:
    """The server's error answer as an exception: its field and message (this server's `error`,
    SGLang's `detail`, or a weight route's `message`)."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    body = body if isinstance(body, dict) else {}
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    message = error.get("message") or body.get("message") or body.get("detail") or response.reason or ""
    kind = RequestRefusedError if response.status_code in REFUSED_STATUSES else ServerError
    retry_after = _retry_after_s(response.headers.get("Retry-After"))
    return kind(response.status_code, str(error.get("field") or ""), str(message), retry_after)
