"""Requests that cost others: issue 46's rows against the served application, before and after.

    git worktree add /tmp/before 9997ae2
    .venv/bin/python -m benchmarks.costly_requests --before /tmp/before     # about 5 minutes on 2 cores

Serves `build_app()` with its defaults plus `allowed_weight_paths` (a temporary root) and a probe
port (`benchmarks.hostile`'s server), from the `--before` checkout and from this one, each in a
process group of its own on 127.0.0.1, and sends each the same requests: fields without a bound,
a weight version of a mebibyte, paths probed through the weight route, a client that floods the
queue beside one that does not, 150 clients at once while the probe port is polled, and a request
of 232 samples whose client leaves after half a second. Results go to the "Costly requests,
served" section of docs/reliability.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.client import HTTPConnection
from pathlib import Path

import requests

from benchmarks.hostile import (
    EMBEDDED_WEIGHTS,
    LIGHT,
    NO_ANSWER_S,
    REPO,
    Server,
    comparison_table,
    run_timed,
    served,
    short_commit,
    timed,
    write_section,
)

SECTION = "## Costly requests, served"


def _post_from(url: str, source: str, body: dict, timeout: float) -> int | None:
    """POSTs `body` as JSON from the local address `source`; the status, or None without an answer."""
    host, port = url.removeprefix("http://").split(":")
    connection = HTTPConnection(host, int(port), timeout=timeout, source_address=(source, 0))
    try:
        connection.request("POST", "/rollout/generate", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.read()
        return response.status
    except OSError:
        return None
    finally:
        connection.close()


def _counts(statuses: list[int | None]) -> str:
    counts = {str(status or "no answer"): statuses.count(status) for status in sorted(set(statuses), key=str)}
    return ", ".join(f"{status}: {count}" for status, count in counts.items())


class CostlyRequests:
    def __init__(self, server: Server, root: Path, probe_url: str):
        self.server, self.root, self.probe_url = server, root, probe_url
        self.rows: dict[str, str] = {}

    def post(self, path: str, body: dict, timeout: float = NO_ANSWER_S) -> requests.Response:
        return requests.post(self.server.url + path, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=timeout)

    def unbounded_fields(self) -> None:
        for label, field, value in (
            ('`"rollout_timeout_s": Infinity` (JSON)', "rollout_timeout_s", float("inf")),
            ('`"fps": 9223372036854775808`', "fps", 2**63),
        ):
            status, seconds, _ = timed(lambda: self.post("/rollout/generate", {**LIGHT, field: value}))
            self.rows[label] = f"{status} in {seconds:.2f} s"

    def long_weight_version(self) -> None:
        model_path = str(self.root / "model")  # the served weights, where updates may be read from
        shutil.copytree(EMBEDDED_WEIGHTS, model_path)
        body = {"model_path": model_path, "weight_version": "v" * 2**19}
        status, seconds, _ = timed(lambda: self.post("/update_weights_from_disk", body, timeout=60))
        _, _, response = timed(lambda: self.post("/rollout/generate", {**LIGHT, "num_outputs_per_prompt": 64}, timeout=60))
        size = "no answer" if response is None else f"{len(response.content) / 2**20:.1f} MiB"
        self.rows["a `weight_version` of 512 KiB on `/update_weights_from_disk` (the served weights)"] = (
            f"{status} in {seconds:.2f} s; a 64-output generate after it: {size}"
        )
        self.post("/update_weights_from_disk", {"model_path": model_path, "weight_version": "restored"}, timeout=60)

    def path_oracle(self) -> None:
        (self.root / "notes.txt").write_text("not a checkpoint")
        (self.root / "a-directory").mkdir(exist_ok=True)
        answers = {}
        for name in ("missing.safetensors", "notes.txt", "a-directory"):
            response = self.post("/update_weights_from_disk", {"model_path": str(self.root / name)})
            message = response.json().get("message", response.text)
            answers[name] = (response.status_code, message.replace(str(self.root / name), "<path>"))
        distinct = len({answer for answer in answers.values()})
        self.rows["`/update_weights_from_disk` of a missing path, a text file, a directory (in the allowed root)"] = (
            f"{distinct} distinct answers of 3: " + "; ".join(f"{status} {message[:60]!r}" for status, message in answers.values())
        )

    def flood_beside_a_client(self, seconds: float = 20.0) -> None:
        """16 threads from 127.0.0.2 send 32-sample requests back to back; 127.0.0.3 sends one-sample
        requests one after the other, for `seconds`."""
        stop = time.monotonic() + seconds
        flood = {"prompt": "7", "num_outputs_per_prompt": 32, "num_inference_steps": 20, "rollout_debug_mode": False}
        flooder: list[int | None] = []
        other: list[int | None] = []
        other_s: list[float] = []

        def flooding() -> None:
            while time.monotonic() < stop:
                flooder.append(_post_from(self.server.url, "127.0.0.2", flood, timeout=60))

        def modest() -> None:
            while time.monotonic() < stop:
                started = time.perf_counter()
                other.append(_post_from(self.server.url, "127.0.0.3", LIGHT, timeout=60))
                other_s.append(time.perf_counter() - started)
                time.sleep(0.2)

        with ThreadPoolExecutor(17) as pool:
            for _ in range(16):
                pool.submit(flooding)
            pool.submit(modest).result()
        self.rows[f"a client flooding from 127.0.0.2 (16 at a time, 32 samples each) for {seconds:.0f} s"] = (
            f"the flooder: {_counts(flooder)}; a client on 127.0.0.3 sending one sample at a time: {_counts(other)}, "
            f"answered in {statistics.median(other_s):.2f} s (median), {max(other_s):.2f} s at most"
        )
        time.sleep(5.0)

    def many_clients_and_the_probe_port(self, clients: int = 150) -> None:
        body = {"prompt": "7", "num_outputs_per_prompt": 32, "num_inference_steps": 20, "rollout_debug_mode": False}
        latencies: list[float | None] = []
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                start = time.perf_counter()
                try:
                    requests.get(self.probe_url + "/health", timeout=NO_ANSWER_S)
                    latencies.append(time.perf_counter() - start)
                except requests.RequestException:
                    latencies.append(None)
                time.sleep(0.1)

        poller = threading.Thread(target=poll)
        poller.start()
        with ThreadPoolExecutor(clients) as pool:
            statuses = list(pool.map(lambda _: _post_from(self.server.url, "127.0.0.1", body, timeout=120), range(clients)))
        done.set()
        poller.join()
        answered = [latency for latency in latencies if latency is not None]
        self.rows[f"{clients} clients each asking for 32 samples at once"] = (
            f"{_counts(statuses)}; the probe port's `/health` ({len(latencies)} polls): "
            f"median {statistics.median(answered):.3f} s, max {max(answered):.3f} s, "
            f"{len(latencies) - len(answered)} unanswered in {NO_ANSWER_S:.0f} s"
        )
        time.sleep(5.0)

    def client_gone_mid_sampling(self) -> None:
        """232 samples x 100 steps (the workers' batches of up to 32 samples), the client gone after
        0.5 s; then one sample, sent again after each 503 as its `Retry-After` says, timed."""
        body = {"prompt": ["7", "3", "5", "1"], "num_outputs_per_prompt": 58, "num_inference_steps": 100, "rollout_debug_mode": False}
        sent = time.perf_counter()
        _post_from(self.server.url, "127.0.0.1", body, timeout=0.5)
        started, refused = time.perf_counter(), 0
        while (response := self.post("/rollout/generate", LIGHT, timeout=120)).status_code == 503 and refused < 60:
            refused += 1
            time.sleep(float(response.headers.get("Retry-After", 1)))
        self.rows["232 samples x 100 steps, the client gone after 0.5 s: a one-sample request sent next"] = (
            f"{response.status_code} in {time.perf_counter() - started:.2f} s after {refused} 503s "
            f"({time.perf_counter() - sent:.2f} s after the big one was sent)"
        )


def probe_checkout(checkout: Path, port: int) -> dict[str, str]:
    with served(checkout, port) as (server, root, probe_url):
        probes = CostlyRequests(server, root, probe_url)
        run_timed(
            (
                probes.unbounded_fields,
                probes.long_weight_version,
                probes.path_oracle,
                probes.client_gone_mid_sampling,
                probes.flood_beside_a_client,
                probes.many_clients_and_the_probe_port,
            )
        )
        return probes.rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="a checkout of the commit to compare with")
    parser.add_argument("--port", type=int, default=8150)
    parser.add_argument("--output", type=Path, default=REPO / "docs/reliability.md")
    args = parser.parse_args()
    start = time.monotonic()
    before_commit, after_commit = short_commit(args.before), short_commit(REPO)
    before = probe_checkout(args.before.resolve(), args.port)
    after = probe_checkout(REPO, args.port)
    lines = [
        "",
        f"Command: `.venv/bin/python -m benchmarks.costly_requests --before <checkout of {before_commit}>` "
        f"({(time.monotonic() - start) / 60:.1f} min), {datetime.date.today().isoformat()}, {os.cpu_count()} cores. "
        f"`build_app()` with its defaults, `allowed_weight_paths` set to a temporary root and a probe port, served "
        f"from {before_commit} (before) and from {after_commit} with its working tree (after), one after the other.",
        "",
        *comparison_table("request", before, after),
    ]
    write_section(args.output, SECTION, lines)


if __name__ == "__main__":
    main()
