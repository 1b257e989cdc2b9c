"""Reliability figures of the default application on this machine, written to docs/reliability.md.

    .venv/bin/python -m benchmarks.reliability      # about 13 minutes on 2 cores

Probes what issue 10 probed, against `build_app()` with its defaults (2 worker replicas):
bad inputs by kind and how each was answered; a burst of 200 requests of 32 samples (served vs
shed, p99 latency of the admitted ones, of `/health` on Serve's port and on the probe port, and of
the HTTP proxy's own health route meanwhile, and the CPU the proxy and the ingress spent); a worker replica killed with SIGKILL
during 60 s of load (requests lost, hung, and samples that differ from an undisturbed run); the
ingress's memory before and after 500 requests and after the largest bad inputs; and a stop with
requests in flight: Ctrl-C and SIGTERM for `make serve`, Ctrl-C for plain `serve run`. The tests in tests/deployments
(test_faults.py, test_failure_modes.py, test_bounded_validation_http.py) assert the same
behaviours on smaller loads, without timing them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgpack
import ray
import requests
from ray import serve

from benchmarks.hostile import SECTION as HOSTILE_SECTION
from deployments.app import build_app
from rollout.codec import from_msgpack

APP = "reliability"
LIGHT = {"num_inference_steps": 20, "rollout_debug_mode": False}


def _actor_pids(deployment: str) -> list[int]:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    replicas = [ray.get_actor(n, namespace="serve") for n in names if f"::{APP}#{deployment}#" in n]
    return ray.get([replica.__ray_call__.remote(lambda self: os.getpid()) for replica in replicas])


def _proxy_pid() -> int:
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    (proxy,) = [ray.get_actor(n, namespace="serve") for n in names if n.startswith("SERVE_PROXY_ACTOR")]
    return ray.get(proxy.__ray_call__.remote(lambda self: os.getpid()))


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stolen_and_total_ticks() -> tuple[int, int]:
    """CPU ticks the hypervisor gave other machines (steal) and all ticks, since boot (/proc/stat)."""
    ticks = [int(field) for field in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return ticks[7], sum(ticks)


def _poll(url: str, stop, results) -> None:
    """Seconds per GET of `url`, one every 100 ms until `stop`; in a process of its own, so that the
    burst's 200 client threads do not take the poller's turns."""
    latencies, statuses = [], Counter()
    with requests.Session() as session:
        while not stop.is_set():
            start = time.perf_counter()
            statuses[session.get(url, timeout=30).status_code] += 1
            latencies.append(time.perf_counter() - start)
            time.sleep(0.1)
    results.put((url, latencies, dict(statuses)))


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
    def __init__(self, port: int, probe_port: int):
        self.url = f"http://127.0.0.1:{port}/{APP}"
        self.probe_url = f"http://127.0.0.1:{probe_port}"
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
        processes = {"ingress": _actor_pids("RolloutIngress")[0], "HTTP proxy": _proxy_pid()}

        def client(i: int) -> None:
            start = time.perf_counter()
            body = {**LIGHT, "prompt": str(i % 10), "num_outputs_per_prompt": samples, "seed": i}
            status = requests.post(f"{self.url}/rollout/generate", json=body, timeout=600).status_code
            outcomes.append((status, time.perf_counter() - start))

        spawn = multiprocessing.get_context("spawn")
        stop, results = spawn.Event(), spawn.Queue()
        health_urls = [f"{self.url}/health", f"{self.probe_url}/health", f"{self.url.rsplit('/', 1)[0]}/-/healthz"]
        pollers = [spawn.Process(target=_poll, args=(url, stop, results)) for url in health_urls]
        for poller in pollers:
            poller.start()
        time.sleep(3.0)  # the pollers are up
        cpu_before = {name: _cpu_s(pid) for name, pid in processes.items()}
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        cpu = {name: _cpu_s(pid) - cpu_before[name] for name, pid in processes.items()}
        stop.set()
        polls = {url: (latencies, statuses) for url, latencies, statuses in (results.get() for _ in pollers)}
        for poller in pollers:
            poller.join()
        statuses = Counter(status for status, _ in outcomes)
        admitted = [t for status, t in outcomes if status == 200]
        shed = [t for status, t in outcomes if status == 503]

        def latency_row(label: str, url: str) -> str:
            latencies, answers = polls[url]
            return (f"| {label}: p50 / p99 / max (s) | {statistics.median(latencies):.3f} / "
                    f"{_percentile(latencies, 0.99):.3f} / {max(latencies):.3f} ({len(latencies)} polls, answers {answers}) |")

        self.add(
            "A burst beyond the queue",
            f"{clients} concurrent requests of {samples} light samples each (the default queue admits "
            f"{4 * 2 * 32} samples: 4 batches per worker replica). Meanwhile three processes of their own "
            "poll, every 100 ms, `/health` on Serve's port, `/health` on the probe port (answered by a "
            "thread of the ingress replica, outside Serve's proxy: deployments/probes.py), and the HTTP "
            "proxy's own health route `/-/healthz`, which Serve answers without any application code.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| answers by status | {dict(sorted(statuses.items()))} |",
            f"| admitted: p50 / p99 latency (s) | {statistics.median(admitted):.2f} / {_percentile(admitted, 0.99):.2f} |",
            f"| shed (503 + Retry-After): max latency (s) | {max(shed, default=0):.3f} |",
            latency_row("`/health` on Serve's port during the burst", health_urls[0]),
            latency_row("`/health` on the probe port during the burst", health_urls[1]),
            latency_row("`/-/healthz` (Serve's proxy alone) during the burst", health_urls[2]),
            *(f"| CPU seconds the {name} process spent on the burst | {seconds:.2f} ({1000 * seconds / clients:.1f} ms per request) |"
              for name, seconds in cpu.items()),
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


def ctrl_c(server: subprocess.Popen) -> None:
    """As a terminal's Ctrl-C: SIGINT to the whole process group."""
    os.killpg(server.pid, signal.SIGINT)


def terminate(server: subprocess.Popen) -> None:
    """As `docker stop` and Kubernetes stop a container: SIGTERM to the main process."""
    server.send_signal(signal.SIGTERM)


def stop_with_requests_in_flight(
    command: list[str], stop: Callable[[subprocess.Popen], None], bodies: list[dict]
) -> tuple[list[requests.Response | requests.RequestException], float | None]:
    """Starts `command` in the repository (an application on 127.0.0.1:8000, on a Ray cluster of
    its own), sends `bodies` at once, and `stop(server)` 3 s later: each request's answer (or the
    error of one that got none), and the seconds the command took to exit (None: not within 60 s)."""
    server = subprocess.Popen(
        command,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        start_new_session=True,
        # A shell running this in the background ignores SIGINT, and its children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        started = time.monotonic()
        while not _answers_200("http://127.0.0.1:8000/health"):
            if server.poll() is not None or time.monotonic() - started > 300:
                raise RuntimeError(f"{command} did not start serving")
            time.sleep(1.0)

        def stop_and_time_the_exit() -> float | None:
            stop(server)
            stopped = time.monotonic()
            try:
                server.wait(timeout=60)
                return time.monotonic() - stopped
            except subprocess.TimeoutExpired:
                return None

        return answers_when_stopped(stop_and_time_the_exit, bodies)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


T = TypeVar("T")


def answers_when_stopped(
    stop: Callable[[], T], bodies: list[dict]
) -> tuple[list[requests.Response | requests.RequestException], T]:
    """Sends `bodies` at once to the application on 127.0.0.1:8000, calls `stop()` 3 s later, and
    waits for every answer: the answers (or the error of a request that got none) and what `stop`
    returned."""
    answers: list[requests.Response | requests.RequestException] = []

    def client(body: dict) -> None:
        try:
            answers.append(requests.post("http://127.0.0.1:8000/rollout/generate", json=body, timeout=120))
        except requests.RequestException as error:
            answers.append(error)

    threads = [threading.Thread(target=client, args=(body,)) for body in bodies]
    for thread in threads:
        thread.start()
    time.sleep(3.0)
    stopped = stop()
    for thread in threads:
        thread.join()
    return answers, stopped


def _answers_200(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:  # not listening yet, or still deploying
        return False


def _stop_row(label: str, stopped_by: str, command: list[str], stop: Callable[[subprocess.Popen], None]) -> str:
    bodies = [{**LIGHT, "prompt": str(i % 10), "num_outputs_per_prompt": 32, "seed": i} for i in range(8)]
    try:
        answers, exit_s = stop_with_requests_in_flight(command, stop, bodies)
    finally:  # Ray's processes of that cluster, whatever became of the command
        env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], env=env, capture_output=True)

    def kind(answer: requests.Response | requests.RequestException) -> str:
        if isinstance(answer, requests.RequestException):
            return f"no answer ({type(answer).__name__})"
        if answer.status_code == 200:
            return "200"
        return f"{answer.status_code} ({'JSON' if answer.headers.get('content-type') == 'application/json' else 'text'})"

    exit_text = "not within 60 s" if exit_s is None else f"{exit_s:.1f}"
    return f"| {label} | {stopped_by} | {dict(sorted(Counter(map(kind, answers)).items()))} | {exit_text} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--probe-port", type=int, default=8125)
    parser.add_argument("--output", type=Path, default=Path("docs/reliability.md"))
    args = parser.parse_args()
    start = time.monotonic()
    stolen_before, total_before = _stolen_and_total_ticks()
    ray.init(include_dashboard=True, dashboard_host="127.0.0.1", log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    probe = Probe(args.port, args.probe_port)
    try:
        handle = serve.run(build_app({"app_name": APP, "probe_port": args.probe_port}), name=APP, route_prefix=f"/{APP}")
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
    bin_dir = Path(sys.executable).parent
    make_serve = [sys.executable, "-m", "deployments", "serve"]
    probe.add(
        "Stopped with requests in flight",
        "8 requests of 32 light samples (about 10 s of sampling), then, 3 s later, SIGINT to the command's "
        "process group (a terminal's Ctrl-C) or SIGTERM to its main process (`docker stop`, Kubernetes).",
        "",
        "| command | stopped by | answers | seconds to exit |",
        "|---|---|---|---|",
        _stop_row("`make serve` (python -m deployments serve)", "Ctrl-C", make_serve, ctrl_c),
        _stop_row("`make serve` (python -m deployments serve)", "SIGTERM", make_serve, terminate),
        _stop_row(
            "`serve run --name rollout deployments.app:build_app`",
            "Ctrl-C",
            [str(bin_dir / "serve"), "run", "--name", "rollout", "deployments.app:build_app"],
            ctrl_c,
        ),
    )
    stolen, total = (after - before for after, before in zip(_stolen_and_total_ticks(), (stolen_before, total_before)))
    head = [
        "# Reliability",
        "",
        f"Command: `.venv/bin/python -m benchmarks.reliability` ({(time.monotonic() - start) / 60:.1f} min), "
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} cores, ray {ray.__version__}. The default "
        "application (`build_app()`: 2 worker replicas, batches of 32, an admission budget of 256 default samples' cost) with a probe port. The hypervisor "
        f"took {100 * stolen / total:.0f}% of this machine's CPU time during the run (steal time, /proc/stat).",
    ]
    # benchmarks.hostile writes the sections from its own on, from another run: they stay.
    text = args.output.read_text() if args.output.exists() else ""
    hostile = re.search(rf"^{re.escape(HOSTILE_SECTION)}$", text, flags=re.MULTILINE)
    kept = ["", text[hostile.start() :].rstrip("\n")] if hostile else []
    args.output.write_text("\n".join(head + probe.lines + kept) + "\n")


if __name__ == "__main__":
    main()
