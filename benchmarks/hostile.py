"""Hostile clients and unlucky operators against the default application, before and after a change.

    git worktree add /tmp/before 10dd817
    .venv/bin/python -m benchmarks.hostile --before /tmp/before     # about 10 minutes on 2 cores

Serves `build_app()` with its defaults plus `allowed_weight_paths` (a temporary root) and a probe
port, once from the `--before` checkout and once from this one, each in a process of its own on
127.0.0.1, and runs the same probes against each: clients that stall mid-body or mid-headers,
bodies built to expand when parsed, oversized and malformed tensor envelopes, answers that echo
their input, weight files that are FIFOs, symlinks out of the root or sparse 1 GiB files, and
weights that would break sampling. Then it sends `benchmarks.fuzz`'s bodies (2,000 by default) to
each. RSS figures are the peak over the probe less the figure before it, of the Serve replica
processes named; results go to the "Hostile clients" section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import psutil
import requests
import torch
from safetensors.torch import load_file, save_file

from benchmarks.fuzz import run_fuzz
from rollout.codec import encode_tensor

REPO = Path(__file__).resolve().parents[1]
APP = "hostile"
EMBEDDED_WEIGHTS = REPO / "rollout/models/weights/digit-flow"
LIGHT = {"prompt": "7", "num_inference_steps": 4, "rollout_debug_mode": False}
SECTION = "## Hostile clients"
NO_ANSWER_S = 10.0  # a probe's request unanswered this long counts as hung
STALLED_CLIENTS_NOTE = (
    "Stalled clients send their headers and 11 bytes of a 1,000-byte body, then nothing, from one address"
    " (127.0.0.2) or from 300 (127.0.1.x), while `/liveness` is polled and a generate sent from "
    "127.0.0.1. After, the ingress holds at most `max_unfinished_bodies_per_client` (32) of them from one"
    " address and `max_unfinished_bodies` (128) in all: a newcomer beyond that is refused (503), or takes"
    " the place of the oldest once that has waited a second (which is answered 503 with Retry-After), and"
    " those held are answered 408 at "
    "`body_timeout_s` (30 s). RSS is the peak during the probe less the figure before it: of the ingress "
    "for bodies, of the coordinator and both workers for the sparse file."
)

_SERVER = """
import json, sys, threading
import ray
from ray import serve
from deployments.app import build_app
config = json.loads(sys.argv[1])
ray.init(address="local", include_dashboard=False, log_to_driver=False)
serve.start(http_options={"host": "127.0.0.1", "port": int(sys.argv[2])})
serve.run(build_app(config), name=config["app_name"], route_prefix="/")
print("ready", flush=True)
threading.Event().wait()
"""


class Server:
    """The application served from `checkout` in a process group of its own."""

    def __init__(self, checkout: Path, config: dict, port: int):
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(checkout), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        env.pop("ROLLOUT_AUTH_TOKEN", None)
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, json.dumps(config), str(port)],
            cwd=checkout,
            env=env,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if self.process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the application from {checkout} did not start")

    def pids(self, deployment: str) -> list[int]:
        """The processes of the application's replicas of `deployment` (Ray names them so)."""
        title = f"ServeReplica:{APP}:{deployment}"
        return [
            p.pid for p in psutil.process_iter(["cmdline"]) if any(title in part for part in p.info["cmdline"] or [])
        ]

    def stop(self) -> None:
        os.killpg(self.process.pid, 15)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, 9)
        ray = str(Path(sys.executable).parent / "ray")
        subprocess.run(
            [ray, "stop", "--force"], capture_output=True, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
        )


def rss_mb(pids: list[int]) -> dict[int, float]:
    found = {}
    for pid in pids:
        try:
            found[pid] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return found


class PeakRss:
    """The most RSS each process reached above where it started, sampled every 10 ms."""

    def __init__(self, pids: list[int]):
        self.start = rss_mb(pids)
        self.peak = dict(self.start)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            for pid, mb in rss_mb(list(self.start)).items():
                self.peak[pid] = max(self.peak[pid], mb)

    def __enter__(self) -> "PeakRss":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        self._thread.join()
        self.after = rss_mb(list(self.start))

    def rise(self) -> float:
        return max((self.peak[pid] - self.start[pid] for pid in self.start), default=0.0)

    def kept(self) -> float:
        return max((self.after.get(pid, 0.0) - self.start[pid] for pid in self.start), default=0.0)


def timed(send: Callable[[], requests.Response]) -> tuple[str, float, requests.Response | None]:
    """(status or 'no answer', seconds, response)."""
    start = time.perf_counter()
    try:
        response = send()
    except requests.RequestException as error:
        return f"no answer ({type(error).__name__})", time.perf_counter() - start, None
    return str(response.status_code), time.perf_counter() - start, response


def poll_latencies(url: str, count: int = 20) -> list[float | None]:
    latencies = []
    for _ in range(count):
        start = time.perf_counter()
        try:
            requests.get(url, timeout=NO_ANSWER_S)
            latencies.append(time.perf_counter() - start)
        except requests.RequestException:
            latencies.append(None)
        time.sleep(0.05)
    return latencies


def latency_text(latencies: list[float | None]) -> str:
    answered = [latency for latency in latencies if latency is not None]
    if not answered:
        return f"no answer in {NO_ANSWER_S:.0f} s ({len(latencies)} polls)"
    missed = len(latencies) - len(answered)
    text = f"median {statistics.median(answered):.3f} s, max {max(answered):.3f} s"
    return text + (f", {missed} of {len(latencies)} unanswered in {NO_ANSWER_S:.0f} s" if missed else "")


class Probes:
    def __init__(self, server: Server, root: Path, probe_url: str):
        self.server, self.root, self.probe_url = server, root, probe_url
        self.rows: dict[str, str] = {}

    def post(self, path: str, body, binary: bool = True, timeout: float = NO_ANSWER_S) -> requests.Response:
        data = msgpack.packb(body, use_bin_type=True) if binary else json.dumps(body)
        content_type = "application/msgpack" if binary else "application/json"
        return requests.post(self.server.url + path, data=data, headers={"Content-Type": content_type}, timeout=timeout)

    def expanding(self, name: str, path: str, body, deployment: str = "RolloutIngress") -> None:
        data = msgpack.packb(body, use_bin_type=True)
        with PeakRss(self.server.pids(deployment)) as rss:
            status, seconds, _ = timed(lambda: self.post(path, body, timeout=60))
        self.rows[name] = (
            f"{status} in {seconds:.2f} s; RSS +{rss.rise():.0f} MB peak ({rss.rise() * 2**20 / len(data):.1f}x the body)"
        )

    # Slow clients ---------------------------------------------------------------------------

    def stalled_clients(self, count: int = 300) -> None:
        for spread, addresses in (
            ("one address", ["127.0.0.2"]),
            ("300 addresses", [f"127.0.1.{i % 250 + 1}" for i in range(count)]),
        ):
            sockets = []
            for number in range(count):
                connection = socket.create_connection(
                    ("127.0.0.1", int(self.server.url.rsplit(":", 1)[1])),
                    source_address=(addresses[number % len(addresses)], 0),
                )
                connection.sendall(
                    b"POST /rollout/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 1000\r\n\r\n" + b'{"prompt": '
                )
                sockets.append(connection)
            time.sleep(1.0)
            liveness = poll_latencies(self.server.url + "/liveness")
            status, seconds, _ = timed(lambda: self.post("/rollout/generate", LIGHT, timeout=30))
            answered = _answered_sockets(sockets)
            for connection in sockets:
                connection.close()
            self.rows[f"{count} clients stalled mid-body ({spread}): port 8000's `/liveness`"] = latency_text(liveness)
            self.rows[f"{count} clients stalled mid-body ({spread}): a generate from another client"] = (
                f"{status} in {seconds:.2f} s"
            )
            self.rows[f"{count} clients stalled mid-body ({spread}): stalled ones answered within 1 s"] = answered
            time.sleep(2.0)

    def stalled_headers(self, count: int = 300) -> None:
        sockets = []
        for _ in range(count):
            connection = socket.create_connection(("127.0.0.1", int(self.server.url.rsplit(":", 1)[1])))
            connection.sendall(b"POST /rollout/generate HTTP/1.1\r\nHost: x\r\n")
            sockets.append(connection)
        time.sleep(1.0)
        self.rows[f"{count} clients stalled mid-headers: port 8000's `/liveness`"] = latency_text(
            poll_latencies(self.server.url + "/liveness")
        )
        for connection in sockets:
            connection.close()

    # Bodies built to expand -----------------------------------------------------------------

    def parse_bombs(self) -> None:
        self.expanding("1 MiB msgpack: `prompt` of 1M empty maps", "/rollout/generate", {"prompt": [{}] * (2**20 - 16)})
        bomb = msgpack.packb({"prompt": [{}] * (2**20 - 16)})
        health: list = []

        def send() -> tuple[str, float, requests.Response | None]:
            return timed(
                lambda: requests.post(
                    self.server.url + "/rollout/generate",
                    data=bomb,
                    headers={"Content-Type": "application/msgpack"},
                    timeout=60,
                )
            )

        with ThreadPoolExecutor(4) as pool:
            answers = [pool.submit(send) for _ in range(3)]
            time.sleep(0.2)
            health = poll_latencies(self.server.url + "/health", count=5)
            seconds = sorted(answer.result()[1] for answer in answers)
        self.rows["three of those at once: answered after"] = (
            " / ".join(f"{s:.2f}" for s in seconds) + f" s; `/health` meanwhile: {latency_text(health)}"
        )
        self.expanding(
            "8 MiB msgpack to `/update_weights_from_tensor`: `named_tensors` of 8M empty maps",
            "/update_weights_from_tensor",
            {"named_tensors": [{}] * (8 * 2**20 - 32)},
        )
        header = json.dumps({"t": {"dtype": "F32", "shape": [1] * 10_000_000, "data_offsets": [0, 4]}}).encode()
        data = len(header).to_bytes(8, "little") + header + b"\x00" * 4
        envelope = {"__tensor__": True, "data": data, "shape": [1], "dtype": "torch.float32"}
        self.expanding(
            "an envelope with a 20 MB safetensors header",
            "/update_weights_from_tensor",
            {"named_tensors": {"w": envelope}},
        )
        digits = b'{"t":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}'
        data = len(digits).to_bytes(8, "little") + digits + b"\x00" * 4
        envelope = {"__tensor__": True, "data": data, "shape": [1], "dtype": "torch.float32"}
        status, _, _ = timed(lambda: self.post("/update_weights_from_tensor", {"named_tensors": {"w": envelope}}))
        self.rows["an envelope whose shape entry has 5,000 digits"] = status

    def echoes(self) -> None:
        envelope = {**encode_tensor(torch.zeros(1)), "shape": list(range(300_000))}
        body = msgpack.packb({"named_tensors": {"w": envelope}}, use_bin_type=True)
        status, _, response = timed(
            lambda: requests.post(
                self.server.url + "/update_weights_from_tensor",
                data=body,
                headers={"Content-Type": "application/msgpack"},
                timeout=30,
            )
        )
        self.rows["error answers: a declared shape of 300,000 ints"] = _answer_size(status, response, len(body))
        body = {"model_path": "/nonexistent/" + "x" * 300_000}
        status, _, response = timed(lambda: self.post("/update_weights_from_disk", body, binary=False, timeout=30))
        self.rows["error answers: a 300 KB `model_path`"] = _answer_size(status, response, len(json.dumps(body)))
        body = {"module_names": [f"m{i}" for i in range(100_000)]}
        status, _, response = timed(lambda: self.post("/get_weights_checksum", body, binary=False, timeout=30))
        self.rows["error answers: a checksum of 100,000 module names"] = _answer_size(
            status, response, len(json.dumps(body))
        )

    # Weight files ---------------------------------------------------------------------------

    def weight_files(self) -> None:
        fifo_checkpoint = self.root / "fifo"
        (fifo_checkpoint / "transformer").mkdir(parents=True)
        os.mkfifo(fifo_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors")
        status, seconds, _ = timed(
            lambda: self.post(
                "/update_weights_from_disk", {"model_path": str(fifo_checkpoint), "target_modules": ["transformer"]}
            )
        )
        info_status, info_seconds, _ = timed(
            lambda: requests.get(self.server.url + "/rollout/info", timeout=NO_ANSWER_S)
        )
        self.rows["a checkpoint whose module file is a FIFO"] = (
            f"{status} in {seconds:.2f} s; `/rollout/info` then: {info_status} in {info_seconds:.2f} s"
        )
        _release_fifo(fifo_checkpoint / "transformer" / "diffusion_pytorch_model.safetensors")
        time.sleep(2.0)

        outside = Path(tempfile.mkdtemp(prefix="outside-"))
        weights = load_file(EMBEDDED_WEIGHTS / "transformer/diffusion_pytorch_model.safetensors")
        save_file(weights, outside / "weights.safetensors")
        linked = self.root / "linked"
        (linked / "transformer").mkdir(parents=True)
        (linked / "transformer" / "diffusion_pytorch_model.safetensors").symlink_to(outside / "weights.safetensors")
        status, seconds, response = timed(
            lambda: self.post(
                "/update_weights_from_disk", {"model_path": str(linked), "target_modules": ["transformer"]}
            )
        )
        self.rows["a module file symlinked out of `allowed_weight_paths`"] = f"{status} in {seconds:.2f} s"
        (self.root / "passwd.safetensors").symlink_to("/etc/passwd")
        status, _, response = timed(
            lambda: self.post("/update_weights_from_disk", {"model_path": str(self.root / "passwd.safetensors")})
        )
        echoed = response is not None and "/etc/passwd" in response.text
        self.rows["a symlink to /etc/passwd inside the root"] = (
            f"{status}; the answer {'names' if echoed else 'does not name'} /etc/passwd"
        )

        sparse = self.root / "sparse.safetensors"
        header = json.dumps({"no.such.weight": {"dtype": "F32", "shape": [2**28], "data_offsets": [0, 2**30]}}).encode()
        header += b" " * (-len(header) % 8)
        with open(sparse, "wb") as file:
            file.write(len(header).to_bytes(8, "little") + header)
            file.truncate(8 + len(header) + 2**30)
        pids = self.server.pids("WeightCoordinator") + self.server.pids("RolloutWorker")
        with PeakRss(pids) as rss:
            status, seconds, _ = timed(
                lambda: self.post("/update_weights_from_disk", {"model_path": str(sparse)}, timeout=120)
            )
        time.sleep(1.0)
        kept = max((mb - rss.start[pid] for pid, mb in rss_mb(list(rss.start)).items()), default=0.0)
        self.rows["a sparse 1 GiB safetensors file with an unknown tensor name"] = (
            f"{status} in {seconds:.2f} s; coordinator and workers: RSS +{rss.rise():.0f} MB peak, +{kept:.0f} MB kept"
        )

    def breaking_weights(self) -> None:
        weights = load_file(EMBEDDED_WEIGHTS / "transformer/diffusion_pytorch_model.safetensors")
        name = min(weights)
        cases = {
            "one NaN": {name: weights[name].float().clone().index_put_((torch.tensor(0),), torch.tensor(float("nan")))},
            "a float64 1e300 (inf in fp32)": {name: weights[name].double().clone().fill_(1e300)},
        }
        for label, changed in cases.items():
            named = {**{key: tensor.float() for key, tensor in weights.items()}, **changed}
            body = {
                "named_tensors": {key: encode_tensor(tensor) for key, tensor in named.items()},
                "weight_version": "bad",
            }
            status, _, _ = timed(lambda body=body: self.post("/update_weights_from_tensor", body, timeout=60))
            after, _, _ = timed(lambda: self.post("/rollout/generate", LIGHT, timeout=60))
            health, _, _ = timed(lambda: requests.get(self.server.url + "/health", timeout=NO_ANSWER_S))
            self.rows[f"full weights with {label}"] = f"{status}; a generate after it: {after}; `/health`: {health}"
            restore = {
                "named_tensors": {key: encode_tensor(tensor.float()) for key, tensor in weights.items()},
                "weight_version": "restored",
            }
            timed(lambda restore=restore: self.post("/update_weights_from_tensor", restore, timeout=60))
        layer = "transformer_blocks.0.attn.to_q"
        shapes = weights[f"{layer}.weight"].shape
        adapter = {
            f"{layer}.lora_A.weight": encode_tensor(torch.zeros(4, shapes[1])),
            f"{layer}.lora_B.weight": encode_tensor(torch.zeros(shapes[0], 4)),
        }
        body = {"named_tensors": adapter, "lora_rank": 4, "lora_alpha": float("inf"), "weight_version": "bad-lora"}
        status, _, _ = timed(lambda: self.post("/update_weights_from_tensor", body, timeout=60))
        after, _, _ = timed(lambda: self.post("/rollout/generate", LIGHT, timeout=60))
        self.rows["a LoRA adapter with `lora_alpha=inf`"] = f"{status}; a generate after it: {after}"


def _answered_sockets(sockets: list[socket.socket]) -> str:
    statuses = []
    for connection in sockets:
        connection.settimeout(0.01)
        try:
            line = connection.recv(64).split(b"\r\n", 1)[0]
            statuses.append(line.split(b" ")[1].decode() if line.startswith(b"HTTP/") else "closed")
        except (TimeoutError, OSError):
            statuses.append("not yet")
    counts = {status: statuses.count(status) for status in sorted(set(statuses))}
    return ", ".join(f"{status}: {count}" for status, count in counts.items())


def _answer_size(status: str, response: requests.Response | None, request_bytes: int) -> str:
    if response is None:
        return status
    return f"{status}: {len(response.content):,} bytes answered to {request_bytes:,}"


def _release_fifo(path: Path) -> None:
    """Opens the FIFO for writing and closes it, so that a reader blocked on it sees its end."""
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:  # no reader: nothing is blocked on it
        pass


@contextmanager
def served(checkout: Path, port: int) -> Iterator[tuple[Server, Path, str]]:
    """The default application served from `checkout` on `port`, with `allowed_weight_paths` a new
    temporary root and its probe port on `port + 1`: (the server, the root, the probe port's URL)."""
    root = Path(tempfile.mkdtemp(prefix="weights-root-"))
    server = Server(checkout, {"app_name": APP, "allowed_weight_paths": [str(root)], "probe_port": port + 1}, port)
    try:
        yield server, root, f"http://127.0.0.1:{port + 1}"
    finally:
        server.stop()


def run_timed(probes: Iterable[Callable[[], None]]) -> None:
    """Runs each probe, printing how long it took."""
    for probe in probes:
        started = time.perf_counter()
        probe()
        print(f"{probe.__name__}: {time.perf_counter() - started:.0f} s", flush=True)


def short_commit(checkout: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def comparison_table(first_column: str, before: dict[str, str], after: dict[str, str]) -> list[str]:
    """The rows of both runs side by side, in the order they were first written."""
    return [
        f"| {first_column} | before | after |",
        "|---|---|---|",
        *(f"| {name} | {before.get(name, '')} | {after.get(name, '')} |" for name in dict.fromkeys([*before, *after])),
    ]


def write_section(output: Path, section: str, lines: list[str]) -> None:
    """`section` (its heading, then `lines`) in place of the one of that heading in `output`, or
    last: the sections around it are kept."""
    before_it, _, after_it = output.read_text().partition(f"\n{section}\n")
    _, heading, following = after_it.partition("\n## ")
    output.write_text(
        before_it.rstrip("\n") + "\n\n" + "\n".join([section, *lines]) + "\n" + (f"\n## {following}" if heading else "")
    )


def probe_checkout(checkout: Path, fuzz_count: int, port: int) -> dict[str, str]:
    with served(checkout, port) as (server, root, probe_url):
        probes = Probes(server, root, probe_url)
        run_timed(
            (
                probes.stalled_clients,
                probes.stalled_headers,
                probes.parse_bombs,
                probes.echoes,
                probes.weight_files,
                probes.breaking_weights,
            )
        )
        report = run_fuzz(server.url, fuzz_count, seed=0)
        statuses: dict[str, int] = {}
        for (_, status), answers in report.statuses.items():
            statuses[str(status)] = statuses.get(str(status), 0) + answers
        probes.rows[f"{fuzz_count} fuzzed bodies (`benchmarks.fuzz`, seed 0)"] = (
            f"5xx: {len(report.server_errors)}, hung: {len(report.hung)}; by status {dict(sorted(statuses.items()))}; "
            f"slowest answer {report.slowest_s:.2f} s"
        )
        return probes.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--fuzz-count", type=int, default=2_000)
    parser.add_argument("--port", type=int, default=8130)
    parser.add_argument("--output", type=Path, default=REPO / "docs/reliability.md")
    args = parser.parse_args()
    start = time.monotonic()
    before_commit, after_commit = short_commit(args.before), short_commit(REPO)
    before = probe_checkout(args.before.resolve(), args.fuzz_count, args.port)
    after = probe_checkout(REPO, args.fuzz_count, args.port)
    lines = [
        "",
        (
            f"Command: `.venv/bin/python -m benchmarks.hostile --before <checkout of {before_commit}>` "
            f"({(time.monotonic() - start) / 60:.1f} min), {datetime.date.today().isoformat()}, {os.cpu_count()} cores. "
            f"`build_app()` with its defaults, `allowed_weight_paths` set to a temporary root and a probe port, served "
            f"from {before_commit} (before) and from {after_commit} with its working tree (after), one after the other."
        ),
        "",
        STALLED_CLIENTS_NOTE,
        "",
        *comparison_table("probe", before, after),
    ]
    write_section(args.output, SECTION, lines)


if __name__ == "__main__":
    main()
