"""Throughput of the rollout server against the library alone, on one machine in one run.

    python -m benchmarks.throughput --output docs/benchmarks.md

Measures samples/s for the same work (`--prompts` prompts x `--outputs-per-prompt` SDE samples,
`--steps` steps) three ways, taking turns run by run, each the median of `--repeats` runs after
a warm-up:
- in-process: `rollout.sampler.sample` in this process, in chunks of the worker's batch size
  (with the Ray cluster up but idle, so all three share the machine's conditions);
- handle: `handle.generate` + `RolloutResult.batch()` on a one-replica application;
- HTTP: `POST /rollout/generate` with a msgpack response, decoded by the client;
then dynamic batching: 16 concurrent one-sample requests through the handle, with batching on
(`max_batch_size` 16) and off (`max_batch_size` 1). Prints one JSON line per measurement and
writes a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import ray
import requests
import torch
from ray import serve

from deployments.app import build_app
from rollout.api import RequestLimits, RolloutRequest, plan_rollout
from rollout.codec import from_msgpack
from rollout.models.registry import load_pipeline
from rollout.sampler import sample

APP = "rollout-benchmark"
NOTES = """Reading the table:
- The ratios compare one worker replica with the library in one process at the same torch thread
  count, the three taking turns. The Ray cluster is up throughout, idle during in-process runs.
  With as many model threads as cores, a served request also shares those cores with the Ray
  processes that carry it (proxy, ingress, router, object transfers); with one model thread, the
  other core absorbs them.
- Batching on/off runs 16 one-sample requests at once through the handle with `max_batch_size`
  16 or 1 and the default `batch_wait_timeout_s`. The embedded model always runs 8-row
  micro-batches (for batch invariance), so an unbatched one-sample request pays for 8 rows.
  Serve forms a replica's next batch while the current one runs, so requests that arrive during
  a run meet only within the wait window; that is why the default wait is 50 ms, not 10 ms.
"""


def interleaved_rates(runs: dict, num_samples: int, repeats: int) -> dict[str, tuple[float, list[float]]]:
    """samples/s (median) and run times of each named run, taking turns so drift hits all alike."""
    for run in runs.values():
        run()  # warm-up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: (num_samples / statistics.median(t), t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--outputs-per-prompt", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="the worker's max_batch_size")
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[1, os.cpu_count()], help="torch thread counts to measure"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--output", type=Path, default=None, help="markdown file for the results table")
    args = parser.parse_args()

    body = {
        "prompt": [str(d % 10) for d in range(args.prompts)],
        "num_outputs_per_prompt": args.outputs_per_prompt,
        "num_inference_steps": args.steps,
        "seed": 0,
        "rollout_debug_mode": False,  # on by default, as in SGLang
    }
    single = [
        {"prompt": str(i % 10), "num_inference_steps": args.steps, "seed": i, "rollout_debug_mode": False}
        for i in range(16)
    ]
    num_samples = args.prompts * args.outputs_per_prompt
    results = []

    def record(threads: int, name: str, rate: float, times: list[float], **extra) -> None:
        row = {"threads": threads, "measurement": name, "samples_per_s": round(rate, 2)}
        row.update(times_s=[round(t, 3) for t in times], **extra)
        results.append(row)
        print(json.dumps(row), flush=True)

    # The same work in-process: the plan the server makes, sampled in chunks of the worker batch.
    pipeline = load_pipeline()
    works = plan_rollout(RolloutRequest(**body), RequestLimits()).work(args.batch_size)

    def in_process():
        for work in works:
            sample(pipeline, work.prompts, work.seeds, work.options, work.negative_prompts)

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    session = requests.Session()
    url = f"http://127.0.0.1:{args.port}/rollout/generate"

    def over_http():
        response = session.post(url, json=body, headers={"Accept": "application/msgpack"})
        response.raise_for_status()
        return from_msgpack(response.content)

    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            base = {"app_name": APP, "num_worker_replicas": 1, "worker_num_cpus": 1, "worker_torch_threads": threads}
            handle = serve.run(build_app({**base, "max_batch_size": args.batch_size}), name=APP, route_prefix="/")
            runs = {
                "in-process (library alone)": in_process,
                "handle": lambda h=handle: h.generate.remote(body).result().batch(),
                "HTTP (msgpack)": over_http,
            }
            measured = interleaved_rates(runs, num_samples, args.repeats)
            baseline = measured["in-process (library alone)"][0]
            for name, (rate, times) in measured.items():
                extra = {} if name.startswith("in-process") else {"vs_in_process": round(rate / baseline, 3)}
                record(threads, name, rate, times, **extra)

            bursts = {}
            for batching, max_batch_size in (("on", 16), ("off", 1)):
                app = build_app({**base, "max_batch_size": max_batch_size})
                burst_handle = serve.run(app, name=APP, route_prefix="/")
                bursts[batching] = interleaved_rates({batching: lambda h=burst_handle: burst(h, single)}, 16, args.repeats)
            for batching, measured in bursts.items():
                rate, times = measured[batching]
                extra = {"speedup": round(bursts["on"]["on"][0] / rate, 2)} if batching == "off" else {}
                record(threads, f"16 concurrent 1-sample requests, batching {batching}", rate, times, **extra)
    finally:
        serve.shutdown()
        ray.shutdown()

    if args.output is not None:
        write_table(args, results)


def burst(handle, bodies: list[dict]) -> list:
    """Sends every request before waiting for any, as concurrent clients would."""
    results = [response.result() for response in [handle.generate.remote(body) for body in bodies]]
    return [result.batch() for result in results]


def write_table(args, results: list[dict]) -> None:
    lines = ["| torch threads | measurement | samples/s | vs in-process | runs (s) |", "|---|---|---|---|---|"]
    for row in results:
        if "vs_in_process" in row:
            ratio = f"{row['vs_in_process']:.3f}x"
        elif "speedup" in row:
            ratio = f"batching on is {row['speedup']:.2f}x this"
        else:
            ratio = ""
        runs = ", ".join(map(str, row["times_s"]))
        lines.append(f"| {row['threads']} | {row['measurement']} | {row['samples_per_s']:.2f} | {ratio} | {runs} |")
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, ray {ray.__version__}"
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        "# Throughput\n\n"
        f"Command: `python -m benchmarks.throughput --output {args.output}`  \n"
        f"Machine: {machine}.  \n"
        f"Work: {args.prompts} prompts x {args.outputs_per_prompt} SDE samples, {args.steps} steps, worker batch "
        f"{args.batch_size}, one worker replica with the same torch thread count as the in-process run; "
        f"the three paths take turns; median of {args.repeats} runs after a warm-up.\n\n" + "\n".join(lines) + "\n\n" + NOTES
    )


if __name__ == "__main__":
    main()
