"""The probe port under the largest burst the admission lets in, before and after a change.

    mkdir /tmp/before && git archive <commit> | tar -x -C /tmp/before
    .venv/bin/python -m benchmarks.probe_burst --before /tmp/before --processes    # about 4 minutes on 2 cores

Serves `build_app()` with its defaults and a probe port (as `make serve` does), from the
`--before` checkout and from this one, each in a process of its own on 127.0.0.1
(`benchmarks.hostile.Server`), and sends `--clients` (150) requests of 32 samples each with the
request's defaults (20 steps, `rollout_debug_mode` on; `--light`: off), from threads of this
process or (`--processes`) each from a process of its own, all released at once, as a shell
loop of 150 clients sends them. The admission budget takes the cost of 256 default samples; the rest are shed (`--retry`:
sent again after Retry-After until served, a load that lasts minutes). Meanwhile processes of
their own poll, every 100 ms, `/health` and `/liveness` on the probe port and `/health` on
Serve's port, and a thread of this process polls the probe port's `/health` too. The CPU of the
ingress and HTTP proxy processes and of the machine is sampled every 250 ms: an ingress near
100% of one core is bound by its interpreter lock, a machine near 100% of all cores by its cores.
Prints a table (markdown); writes nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil
import requests

from benchmarks.hostile import APP, REPO, Server
from benchmarks.reliability import LIGHT, _percentile

BURST_TIMEOUT_S = 180.0  # a client's request unanswered this long counts as hung
# A GET of argv[1] every 100 ms until stdin closes, in a process of its own (stdlib only, so it
# starts at once and the burst's client threads do not take its turns); prints the seconds of each,
# the answers by status, and the seconds of each that the poller itself waited for a core (Linux's
# schedstat), as JSON. A GET unanswered in 30 s counts as 30 s, status "no answer".
POLLER = """
import json, sys, threading, time, urllib.request
done = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
schedstat = f"/proc/self/task/{threading.get_native_id()}/schedstat"
def waited():  # seconds this thread has spent runnable, waiting for a core
    with open(schedstat) as stats:
        return int(stats.read().split()[1]) / 1e9
latencies, own_waits, statuses = [], [], {}
print("ready", flush=True)
while not done.is_set():
    start, waited_before = time.perf_counter(), waited()
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=30) as answer:
            status = str(answer.status)
    except urllib.error.HTTPError as error:
        status = str(error.code)
    except OSError:
        status = "no answer"
    latencies.append(time.perf_counter() - start)
    own_waits.append(waited() - waited_before)
    statuses[status] = statuses.get(status, 0) + 1
    done.wait(0.1)
print(json.dumps([latencies, statuses, own_waits]), flush=True)
"""
# One POST of argv[2] to argv[1] (Accept: argv[3]) at time.monotonic() argv[4]; prints its status.
CLIENT = """
import sys, time, urllib.request
time.sleep(max(0.0, float(sys.argv[4]) - time.monotonic()))
request = urllib.request.Request(
    sys.argv[1], data=sys.argv[2].encode(), headers={"Content-Type": "application/json", "Accept": sys.argv[3]}
)
try:
    with urllib.request.urlopen(request, timeout=180) as answer:
        answer.read()
        print(answer.status)
except urllib.error.HTTPError as error:
    print(error.code)
except OSError as error:
    print("no answer (" + type(error).__name__ + ")")
"""


def _proxy_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"]) if any("ProxyActor" in part for part in p.info["cmdline"] or [])]


class CpuSampler:
    """Percent of one core used by each process, and by the machine, every 250 ms until stopped."""

    def __init__(self, pids: dict[str, list[int]]):
        self.processes = {name: [psutil.Process(pid) for pid in found] for name, found in pids.items()}
        self.samples: dict[str, list[float]] = {name: [] for name in [*pids, "machine (all cores)"]}
        self._done = threading.Event()
        for processes in self.processes.values():
            for process in processes:
                process.cpu_percent()
        psutil.cpu_percent()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.25):
            for name, processes in self.processes.items():
                self.samples[name].append(sum(process.cpu_percent() for process in processes))
            self.samples["machine (all cores)"].append(psutil.cpu_percent() * psutil.cpu_count())

    def stop(self) -> dict[str, str]:
        self._done.set()
        self._thread.join()
        return {
            name: f"{statistics.mean(values):.0f}% mean, {max(values):.0f}% max" if values else "no samples"
            for name, values in self.samples.items()
        }


def burst(
    checkout: Path, port: int, clients: int, samples: int, light: bool, accept: str, retry: bool, processes: bool
) -> dict[str, str]:
    probe_url = f"http://127.0.0.1:{port + 1}"
    server = Server(checkout, {"app_name": APP, "probe_port": port + 1}, port)
    try:
        started = time.monotonic()
        while requests.get(f"{probe_url}/health", timeout=30).status_code != 200:
            if time.monotonic() - started > 120:
                raise RuntimeError("no worker replica ran within 120 s")
            time.sleep(1.0)
        urls = {
            "`/health` on the probe port": f"{probe_url}/health",
            "`/liveness` on the probe port": f"{probe_url}/liveness",
            "`/health` on Serve's port": f"{server.url}/health",
        }
        pollers = [
            subprocess.Popen([sys.executable, "-c", POLLER, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for url in urls.values()
        ]
        for poller in pollers:
            assert poller.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # some polls before the burst
        # The same poll from a thread beside the clients' threads: what a measurement taken there sees.
        beside: list[list] = [[], {}]
        beside_done = threading.Event()

        def poll_beside() -> None:
            with requests.Session() as session:
                while not beside_done.is_set():
                    start = time.perf_counter()
                    status = str(session.get(f"{probe_url}/health", timeout=30).status_code)
                    beside[0].append(time.perf_counter() - start)
                    beside[1][status] = beside[1].get(status, 0) + 1
                    beside_done.wait(0.1)

        beside_thread = threading.Thread(target=poll_beside)
        beside_thread.start()
        ingress = server.pids("RolloutIngress")
        cpu = CpuSampler({"ingress": ingress, "HTTP proxy": _proxy_pids()})
        outcomes: list[str] = []

        sends = Counter()
        deadline = time.monotonic() + BURST_TIMEOUT_S

        def client(i: int) -> None:
            body = {**(LIGHT if light else {}), "prompt": str(i % 10), "num_outputs_per_prompt": samples, "seed": i}
            while True:
                sends["sent"] += 1
                try:
                    answer = requests.post(
                        f"{server.url}/rollout/generate", json=body, headers={"Accept": accept}, timeout=BURST_TIMEOUT_S
                    )
                except requests.RequestException as error:
                    outcomes.append(f"no answer ({type(error).__name__})")
                    return
                retry_after = float(answer.headers.get("Retry-After", 1))
                if not retry or answer.status_code != 503 or time.monotonic() + retry_after > deadline:
                    outcomes.append(str(answer.status_code))
                    return
                time.sleep(retry_after)

        def client_process(i: int) -> None:
            """The request from a process of its own, all released at the same instant (`start_at`)."""
            body = {**(LIGHT if light else {}), "prompt": str(i % 10), "num_outputs_per_prompt": samples, "seed": i}
            sends["sent"] += 1
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", CLIENT, f"{server.url}/rollout/generate", json.dumps(body), accept, str(start_at)],
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                outcomes.append(process.communicate(timeout=BURST_TIMEOUT_S + 30)[0].strip())
            except subprocess.TimeoutExpired:
                process.kill()
                outcomes.append("no answer")

        start_at = time.monotonic() + 0.5 + 0.02 * clients  # every client process is up by then
        threads = [threading.Thread(target=client_process if processes else client, args=(i,)) for i in range(clients)]
        for thread in threads:
            thread.start()
        burst_start = max(time.monotonic(), start_at) if processes else time.monotonic()
        for thread in threads:
            thread.join(BURST_TIMEOUT_S + 60)
        burst_s = time.monotonic() - burst_start
        cpu_rows = cpu.stop()
        time.sleep(1.0)  # some polls after it
        beside_done.set()
        beside_thread.join(60)
        label = "`/health` on the probe port, polled from a thread of the clients' process"
        urls[label] = label
        polls = {label: beside}
        for url, poller in zip(list(urls.values()), pollers):
            output, _ = poller.communicate("", timeout=60)
            polls[url] = json.loads(output)
        rows = {
            "answers to the burst by status (each client's last)": str(dict(sorted(Counter(outcomes).items()))),
            "requests sent": str(sends["sent"]),
            "seconds from the first request to the last answer": f"{burst_s:.1f}",
        }
        for label, url in urls.items():
            latencies, statuses, *own_waits = polls[url]
            rows[f"{label}: p50 / p99 / max (s)"] = (
                f"{statistics.median(latencies):.3f} / {_percentile(latencies, 0.99):.3f} / {max(latencies):.3f} "
                f"({len(latencies)} polls, answers {statuses}, {sum(t > 0.5 for t in latencies)} over 0.5 s)"
            )
            if own_waits:  # what is left is the server's (and the kernel's network path)
                served = [latency - wait for latency, wait in zip(latencies, own_waits[0])]
                slowest = max(range(len(latencies)), key=latencies.__getitem__)
                rows[f"{label}: less the poller's own wait for a core, p99 / max (s); the slowest poll's own wait"] = (
                    f"{_percentile(served, 0.99):.3f} / {max(served):.3f}; {own_waits[0][slowest]:.3f} of {latencies[slowest]:.3f}"
                )
        rows.update({f"CPU during the burst, {name} (100% = one core)": text for name, text in cpu_rows.items()})
        return rows
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a checkout of the commit to compare with (left out: this one alone)")
    parser.add_argument("--clients", type=int, default=150)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--accept", default="application/msgpack", help="the answers' encoding (application/json: SGLang's)")
    parser.add_argument("--retry", action="store_true", help="a client answered 503 sends again after Retry-After")
    parser.add_argument("--processes", action="store_true", help="each client a process of its own, all sent at once")
    parser.add_argument("--light", action="store_true", help="rollout_debug_mode off (answers without per-step tensors)")
    parser.add_argument("--port", type=int, default=8140)
    args = parser.parse_args()
    start = time.monotonic()

    def commit(checkout: Path) -> str:
        return subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()

    runs = {}
    if args.before:
        runs[f"before ({commit(args.before)})"] = burst(args.before.resolve(), args.port, args.clients, args.samples, args.light, args.accept, args.retry, args.processes)
    runs[f"after ({commit(REPO)} + working tree)"] = burst(REPO, args.port, args.clients, args.samples, args.light, args.accept, args.retry, args.processes)
    print(
        f"\nCommand: `.venv/bin/python -m benchmarks.probe_burst{' --before <checkout>' if args.before else ''}` "
        f"({(time.monotonic() - start) / 60:.1f} min), {datetime.date.today().isoformat()}, {os.cpu_count()} cores; "
        f"{args.clients} concurrent requests of {args.samples} {'light ' if args.light else ''}samples, answered as {args.accept}{', each sent again after Retry-After until served' if args.retry else ''}{', each from a process of its own' if args.processes else ''}.\n"
    )
    print("| figure | " + " | ".join(runs) + " |")
    print("|---|" + "---|" * len(runs))
    for name in dict.fromkeys(name for rows in runs.values() for name in rows):
        print(f"| {name} | " + " | ".join(rows.get(name, "") for rows in runs.values()) + " |")


if __name__ == "__main__":
    main()
