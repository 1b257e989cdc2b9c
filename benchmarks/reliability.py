"""Reliability figures of the default application on this machine, written to docs/reliability.md.

    .venv/bin/python -m benchmarks.reliability      # about 5 minutes on 2 cores

Probes what issue 10 probed, against `build_app()` with its defaults (2 worker replicas):
bad inputs by kind and how each was answered; a burst of 200 requests of 32 samples (served vs
shed, p99 latency of the admitted ones and of `/health` meanwhile); a worker replica killed with
SIGKILL during 60 s of load (requests lost, hung, and samples that differ from an undisturbed
run); the ingress's memory before and after 500 requests and after the largest bad inputs.
The tests (tests/deployments/test_faults.py, test_bounded_validation_http.py) assert the same
behaviours on smaller loads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import msgpack
import ray
import requests
from ray import serve

from deployments.app import build_app
from rollout.codec import from_msgpack

APP = "reliability"
LIGHT = {"num_inference_steps": 20, "rollout_debug_mode": False}


def _actor_pids(deployment: str) -> list[int]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    replicas = [ray.get_actor(n, namespace="serve") for n in names if f"::{APP}#{deployment}#" in n]
    return ray.get([replica.__ray_call__.remote(lambda self: os.getpid()) for replica in replicas])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bad_inputs() -> dict[str, tuple[bytes, dict]]:
    """Kind -> (body, headers)."""
    as_json = {"Content-Type": "application/json"}
    nested = b"[" * 100_000 + b"]" * 100_000
    deep_msgpack = b"\x91" * 100_000 + b"\xc0"
    return {
        "malformed JSON": (b'{"prompt": "3",', as_json),
        "JSON nested 100,000 deep": (nested, as_json),
        "msgpack nested 100,000 deep": (deep_msgpack, {"Content-Type": "application/msgpack"}),
        "50 MB value in an unknown field": (json.dumps({"prompt": "3", "junk": "x" * 50_000_000}).encode(), as_json),
        "1 MB prompt": (json.dumps({"prompt": "7" * 1_000_000}).encode(), as_json),
        "150,000 zeros in rollout_return_step_indices": (
            json.dumps({"prompt": "3", "rollout_return_step_indices": [0] * 150_000}).encode(), as_json),
        "guidance_scale 1e308": (json.dumps({"prompt": "3", "guidance_scale": 1e308}).encode(), as_json),
        "rollout_noise_level 1e6": (json.dumps({"prompt": "3", "rollout_noise_level": 1e6}).encode(), as_json),
        "unknown field": (json.dumps({"prompt": "3", "rollout_sde_typ": "sde"}).encode(), as_json),
        "mistyped value": (json.dumps({"prompt": "3", "num_inference_steps": "many"}).encode(), as_json),
        "too many samples": (json.dumps({"prompt": "3", "num_outputs_per_prompt": 10_000}).encode(), as_json),
        "negative seed": (json.dumps({"prompt": "3", "seed": -1}).encode(), as_json),
        "unknown prompt": (json.dumps({"prompt": "a cat"}).encode(), as_json),
        "msgpack body of a string": (msgpack.packb("3"), {"Content-Type": "application/msgpack"}),
        "deadline of 1 ms": (json.dumps({"prompt": "3", "rollout_timeout_s": 0.001}).encode(), as_json),
    }


class Probe:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/{APP}"
        self.lines: list[str] = []

    def add(self, title: str, *lines: str) -> None:
        self.lines += ["", f"## {title}", "", *lines]
        print(f"\n## {title}\n" + "\n".join(lines), flush=True)

    def generate(self, session: requests.Session, body: dict) -> requests.Response:
        return session.post(f"{self.url}/rollout/generate", json=body, timeout=600)

    def bad(self, ingress_pid: int) -> float:
        rows = ["| input | answered | seconds | response bytes |", "|---|---|---|---|"]
        with requests.Session() as session:
            for kind, (body, headers) in bad_inputs().items():
                start = time.perf_counter()
                response = session.post(f"{self.url}/rollout/generate", data=body, headers=headers, timeout=120)
                rows.append(f"| {kind} | {response.status_code} | {time.perf_counter() - start:.2f} | {len(response.content)} |")
            healthy = session.get(f"{self.url}/health").status_code
        self.add(
            "Bad inputs",
            f"{len(bad_inputs())} kinds, one request each, JSON bodies unless stated; afterwards `/health` answered {healthy}.",
            "",
            *rows,
        )
        return _rss_mb(ingress_pid)

    def burst(self, clients: int = 200, samples: int = 32) -> None:
        outcomes: list[tuple[int, float]] = []
        health: list[float] = []
        stop = threading.Event()

        def client(i: int) -> None:
            start = time.perf_counter()
            body = {**LIGHT, "prompt": str(i % 10), "num_outputs_per_prompt": samples, "seed": i}
            status = requests.post(f"{self.url}/rollout/generate", json=body, timeout=600).status_code
            outcomes.append((status, time.perf_counter() - start))

        def poll() -> None:
            with requests.Session() as session:
                while not stop.is_set():
                    start = time.perf_counter()
                    session.get(f"{self.url}/health", timeout=30)
                    health.append(time.perf_counter() - start)
                    time.sleep(0.1)

        poller = threading.Thread(target=poll)
        poller.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        stop.set()
        poller.join()
        statuses = Counter(status for status, _ in outcomes)
        admitted = [t for status, t in outcomes if status == 200]
        shed = [t for status, t in outcomes if status == 503]
        self.add(
            "A burst beyond the queue",
            f"{clients} concurrent requests of {samples} light samples each (the default queue admits "
            f"{4 * 2 * 32} samples: 4 batches per worker replica); `/health` polled every 100 ms meanwhile.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| answers by status | {dict(sorted(statuses.items()))} |",
            f"| admitted: p50 / p99 latency (s) | {statistics.median(admitted):.2f} / {_percentile(admitted, 0.99):.2f} |",
            f"| shed (503 + Retry-After): max latency (s) | {max(shed, default=0):.3f} |",
            f"| `/health` during the burst: p50 / p99 / max (s) | {statistics.median(health):.3f} / "
            f"{_percentile(health, 0.99):.3f} / {max(health):.3f} ({len(health)} polls) |",
        )

    def kill_under_load(self, handle, seconds: float = 60.0) -> None:
        sent: dict[int, object] = {}
        lock = threading.Lock()
        counter = iter(range(10**9))
        deadline = time.monotonic() + seconds

        def body(i: int) -> dict:
            return {**LIGHT, "prompt": str(i % 10), "num_outputs_per_prompt": 2, "seed": 1000 * i}

        def bits_http(response: requests.Response):
            rows = from_msgpack(response.content)
            return [(r["sample_seed"], r["generated_output"].numpy().tobytes(), r["rollout_log_probs"].numpy().tobytes()) for r in rows]

        def bits_handle(i: int):
            batch = handle.generate.remote(body(i)).result().batch()
            return [(s.seed, s.image.numpy().tobytes(), s.log_probs.numpy().tobytes()) for s in batch.samples]

        def served(session: requests.Session, i: int):
            if i % 2:
                return bits_handle(i)
            response = self.generate(session, body(i))
            if response.status_code != 200:
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
            return bits_http(response)

        def client() -> None:
            with requests.Session() as session:
                while time.monotonic() < deadline:
                    with lock:
                        i = next(counter)
                    try:
                        outcome = served(session, i)
                    except Exception as error:
                        outcome = error
                    with lock:
                        sent[i] = outcome

        threads = [threading.Thread(target=client) for _ in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(seconds / 3)
        victim = _actor_pids("RolloutWorker")[0]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(timeout=seconds + 300)
        hung = sum(thread.is_alive() for thread in threads)
        failed = {i: repr(o)[:200] for i, o in sent.items() if isinstance(o, Exception)}
        with requests.Session() as session:
            differ = sum(served(session, i) != o for i, o in sent.items() if not isinstance(o, Exception))
        self.add(
            "A worker replica killed under load",
            f"8 clients sending 2-sample light requests for {seconds:.0f} s, half over HTTP and half through the "
            f"handle; one worker replica killed with SIGKILL {seconds / 3:.0f} s in. Each answer is compared "
            "with the same request sent again afterwards.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| requests | {len(sent)} |",
            f"| lost (failed) | {len(failed)} {list(failed.values())[:3] if failed else ''} |",
            f"| hung (client threads still waiting {300:.0f} s after the load) | {hung} |",
            f"| samples that differ from the undisturbed run | {differ} |",
            f"| seconds from the kill to the end of the comparison | {time.monotonic() - killed_at:.0f} |",
        )

    def requests_500(self, handle) -> None:
        with requests.Session() as session:
            for i in range(500):
                body = {**LIGHT, "prompt": str(i % 10), "seed": i, "num_inference_steps": 4}
                if i % 2:
                    handle.generate.remote(body).result().batch()
                else:
                    assert self.generate(session, body).status_code == 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--output", type=Path, default=Path("docs/reliability.md"))
    args = parser.parse_args()
    start = time.monotonic()
    ray.init(include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    probe = Probe(args.port)
    try:
        handle = serve.run(build_app({"app_name": APP}), name=APP, route_prefix=f"/{APP}")
        ingress = _actor_pids("RolloutIngress")[0]
        memory = [("at start", _rss_mb(ingress))]
        probe.requests_500(handle)
        memory.append(("after 500 requests (half HTTP, half handle)", _rss_mb(ingress)))
        memory.append(("after the bad inputs", probe.bad(ingress)))
        probe.burst()
        memory.append(("after the burst", _rss_mb(ingress)))
        probe.kill_under_load(handle)
        probe.add("Ingress memory", "| when | RSS (MB) |", "|---|---|", *(f"| {when} | {mb:.0f} |" for when, mb in memory))
    finally:
        serve.shutdown()
        ray.shutdown()
    head = [
        "# Reliability",
        "",
        f"Command: `.venv/bin/python -m benchmarks.reliability` ({(time.monotonic() - start) / 60:.1f} min), "
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, ray {ray.__version__}. The default "
        "application (`build_app()`: 2 worker replicas, batches of 32, queue of 256 samples).",
    ]
    args.output.write_text("\n".join(head + probe.lines) + "\n")


if __name__ == "__main__":
    main()
