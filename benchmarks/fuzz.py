"""Structure-aware fuzzing of every route: valid bodies mutated field by field, random tensor
envelopes, and damaged bytes, sent as JSON or msgpack. Every answer must be a 2xx or 4xx within
`REQUEST_TIMEOUT_S`: a 5xx or a hung request is a defect.

    .venv/bin/python -m benchmarks.fuzz --count 2000     # its own application on 127.0.0.1, with a token

With a token (`run_fuzz`'s `token`, sent with every case) the fuzz also sends
`/release_memory_occupation`, and resumes the replicas right after each release (`/resume_memory_
occupation`, counted apart): a released server answers `/rollout/generate` with 503 by design, the
answer an operator's release asks for, so the cases after a release must not meet it. Every
release is still fuzzed as the other routes are, and a resume that fails is a defect.

`tests/deployments/test_fuzz.py` runs the same bodies at a small count. `fuzz_cases` is
deterministic for a seed, so a failure is replayed by its seed and number.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import random
import secrets
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import msgpack
import requests
import torch

from rollout.codec import TENSOR_MARKER, encode_tensor, safetensors_bytes

REQUEST_TIMEOUT_S = 60.0

# One valid body per route that reads a body; the weight bodies are valid by the schema and
# refused by the model (no such checkpoint, no such weight), so no fuzzed body changes the weights.
VALID_BODIES = {
    "/rollout/generate": {
        "prompt": "7",
        "num_inference_steps": 2,
        "num_outputs_per_prompt": 1,
        "seed": 3,
        "rollout_debug_mode": False,
        "rollout_return_step_indices": [0, 2],
        "extra_sampling_params": {"rollout_noise_level": 0.5},
    },
    "/update_weights_from_disk": {"model_path": "/nonexistent/checkpoint", "weight_version": "fuzz"},
    "/update_weights_from_tensor": {"named_tensors": {"no.such.weight": torch.zeros(2, 2)}, "weight_version": "fuzz"},
    "/get_weights_checksum": {"module_names": ["transformer"]},
}
# Routes that read no body get one anyway, and a query string.
BODILESS_ROUTES = [
    ("POST", "/resume_memory_occupation"),
    ("GET", "/health"),
    ("GET", "/liveness"),
    ("GET", "/rollout/info"),
    ("GET", "/model_info"),
    ("GET", "/server_info"),
    ("GET", "/v1/models"),
]
# Sent only with a token, each followed by a resume (the module's docstring).
RELEASE_ROUTE = ("POST", "/release_memory_occupation")
RESUME_AFTER_RELEASE = "/resume_memory_occupation, after each release"


@dataclass(frozen=True)
class FuzzCase:
    number: int
    method: str
    path: str
    content_type: str
    body: bytes
    mutation: str


def _hostile_scalars(rng: random.Random) -> list:
    return [
        None,
        True,
        0,
        -1,
        2**63 - 1,
        -(2**63),
        1e308,
        -0.0,
        math.inf,
        math.nan,
        "",
        "7" * rng.choice([1, 1_000, 100_000]),
        "\u0000\ud7ff\U0010ffff",
        "../../etc/passwd",
        "/proc/self/environ",
    ]


def _random_tensor_bytes(rng: random.Random) -> bytes:
    """A one-tensor safetensors file, valid or damaged in its header or its data."""
    data = safetensors_bytes(
        torch.arange(rng.randint(0, 6), dtype=rng.choice([torch.float32, torch.bfloat16, torch.int64]))
    )
    header_length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_length])
    damage = rng.choice(["none", "dtype", "shape", "offsets", "length", "truncate", "digits", "metadata", "keys"])
    if damage == "dtype":
        header["t"]["dtype"] = rng.choice(["F8", "", "X" * 50, 5])
    elif damage == "shape":
        header["t"]["shape"] = rng.choice([[-1], [2**62, 2**62], "3", [1.5], [[1]], [1] * 1000])
    elif damage == "offsets":
        header["t"]["data_offsets"] = rng.choice([[0], [5, 0], [0, 2**70], "0,4", None])
    elif damage == "metadata":
        header["__metadata__"] = {"k": "v" * rng.choice([10, 70_000])}
    elif damage == "keys":
        header["u"] = header["t"]
    if damage == "length":
        return rng.randbytes(8) + data[8:]
    if damage == "truncate":
        return data[: rng.randint(0, len(data))]
    if damage == "digits":
        text = (
            data[8 : 8 + header_length].decode().replace('"shape":[', '"shape":[' + "9" * rng.choice([20, 5_000]) + ",")
        )
        encoded = text.encode()
        return len(encoded).to_bytes(8, "little") + encoded + data[8 + header_length :]
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data[8 + header_length :]


def random_envelope(rng: random.Random) -> dict:
    """A tensor envelope, valid or damaged anywhere: its data, its declared shape or dtype, its keys."""
    data = _random_tensor_bytes(rng)
    envelope = {TENSOR_MARKER: True, "data": data, "shape": [len(data)], "dtype": "torch.float32"}
    if rng.random() < 0.3:
        generator = torch.Generator().manual_seed(rng.randrange(2**31))
        envelope = encode_tensor(torch.randn(rng.randint(1, 4), 3, generator=generator))
    field = rng.choice(["shape", "dtype", "data", TENSOR_MARKER, "extra", None])
    if field is not None:
        envelope[field] = rng.choice([*_hostile_scalars(rng), [1] * rng.choice([1, 300]), {"a": 1}, b"\x00" * 9])
    return envelope


def _containers(rng: random.Random) -> list:
    width = rng.choice([10, 1_000, 50_000])
    return [[], {}, [{}] * width, [[]] * width, {str(i): {} for i in range(width)}, [1] * width, [[[["deep"]]]]]


def _mutated(rng: random.Random, body: dict) -> tuple[dict, str]:
    body = dict(body)
    action = rng.choice(["replace", "replace", "replace", "drop", "add", "nest", "envelope"])
    field = rng.choice(sorted(body))
    if action == "drop":
        body.pop(field)
    elif action == "add":
        field = rng.choice(["unknown_field", "serialized_named_tensors", "prompt", "x" * 200])
        body[field] = rng.choice(_hostile_scalars(rng))
    elif action == "nest":
        body[field] = rng.choice(_containers(rng))
    elif action == "envelope":
        body[field] = random_envelope(rng)
    else:
        body[field] = rng.choice(_hostile_scalars(rng))
    if isinstance(body.get("named_tensors"), dict) and rng.random() < 0.5:
        body["named_tensors"] = {"w": random_envelope(rng)}
    return body, f"{action} {field[:40]}"


def _encoded(value, binary: bool) -> bytes:
    def default(item):
        if isinstance(item, torch.Tensor):
            return encode_tensor(item, binary)
        if isinstance(item, bytes):  # JSON has no bytes: base64, as envelopes carry them
            return base64.b64encode(item).decode()
        raise TypeError(type(item).__name__)

    return (
        msgpack.packb(value, use_bin_type=True, default=default)
        if binary
        else json.dumps(value, default=default).encode()
    )


def _damaged(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    kind = rng.choice(["truncate", "flip", "prefix"])
    if kind == "truncate" and data:
        return data[: rng.randrange(len(data))], "truncated"
    if kind == "flip" and data:
        damaged = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        return bytes(damaged), "bytes flipped"
    return rng.choice([b"\xdd\xff\xff\xff\xff", b"\xc1", b"[" * 2000, b"\x92" * 3000]) + data, "prefixed"


def fuzz_cases(count: int, seed: int = 0, release: bool = False) -> Iterator[FuzzCase]:
    """`count` cases spread over every route (`/release_memory_occupation` too with `release`), the
    same ones for the same seed."""
    rng = random.Random(seed)
    routes = [("POST", path) for path in VALID_BODIES] + BODILESS_ROUTES + ([RELEASE_ROUTE] if release else [])
    for number in range(count):
        method, path = routes[number % len(routes)] if number < len(routes) else rng.choice(routes)
        binary = rng.random() < 0.5
        content_type = "application/msgpack" if binary else "application/json"
        valid = VALID_BODIES.get(path, {"prompt": "7"})
        if number < len(routes):  # every route once as it is
            body, mutation = valid, "none"
        elif rng.random() < 0.15:
            body, mutation = random_envelope(rng), "random envelope"
        else:
            body, mutation = _mutated(rng, valid)
        data = _encoded(body, binary)
        if rng.random() < 0.15:
            data, damage = _damaged(rng, data)
            mutation += f", {damage}"
        if method == "GET":
            path += rng.choice(["", "?x=1", "?" + "a=b&" * 500, "?%ff%fe"])
        yield FuzzCase(number, method, path, content_type, data, mutation)


@dataclass
class FuzzReport:
    statuses: Counter
    server_errors: list[tuple[FuzzCase, int, str]]
    hung: list[FuzzCase]
    slowest_s: float
    elapsed_s: float


def run_fuzz(base_url: str, count: int, seed: int = 0, token: str | None = None) -> FuzzReport:
    """Sends the cases one after another, with `token` as a bearer token where given (and then the
    releases too, each resumed at once); counts statuses by route, 5xx answers and hung requests."""
    statuses: Counter = Counter()
    server_errors, hung, slowest = [], [], 0.0
    auth = {} if token is None else {"Authorization": f"Bearer {token}"}
    start = time.perf_counter()
    with requests.Session() as session:
        for case in fuzz_cases(count, seed, release=token is not None):
            sent = time.perf_counter()
            try:
                response = session.request(
                    case.method,
                    base_url + case.path,
                    data=case.body,
                    headers={"Content-Type": case.content_type, **auth},
                    timeout=REQUEST_TIMEOUT_S,
                )
            except requests.Timeout:
                hung.append(case)
                continue
            slowest = max(slowest, time.perf_counter() - sent)
            statuses[(case.path.split("?")[0], response.status_code)] += 1
            if response.status_code >= 500:
                server_errors.append((case, response.status_code, response.text[:300]))
            if (case.method, case.path) == RELEASE_ROUTE:
                resumed = session.post(base_url + "/resume_memory_occupation", headers=auth, timeout=REQUEST_TIMEOUT_S)
                statuses[(RESUME_AFTER_RELEASE, resumed.status_code)] += 1
                if resumed.status_code != 200:
                    server_errors.append((case, resumed.status_code, f"the resume after it: {resumed.text[:300]}"))
    return FuzzReport(statuses, server_errors, hung, slowest, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=2_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=8126)
    parser.add_argument("--no-token", action="store_true", help="serve without a token: no releases are sent")
    args = parser.parse_args()

    import ray
    from ray import serve

    from deployments.app import build_app

    token = None if args.no_token else secrets.token_urlsafe(16)
    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    try:
        serve.run(build_app({"app_name": "fuzz", "auth_token": token}), name="fuzz", route_prefix="/")
        report = run_fuzz(f"http://127.0.0.1:{args.port}", args.count, args.seed, token)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(
        f"{args.count} bodies in {report.elapsed_s:.0f} s (seed {args.seed}); slowest answer {report.slowest_s:.2f} s"
    )
    print(f"5xx: {len(report.server_errors)}, hung: {len(report.hung)}")
    print("| route | status | answers |\n|---|---|---|")
    for (route, status), answers in sorted(report.statuses.items()):
        print(f"| {route} | {status} | {answers} |")
    for case, status, text in report.server_errors[:20]:
        print(f"case {case.number} ({case.path}, {case.mutation}): {status} {text}")


if __name__ == "__main__":
    main()
