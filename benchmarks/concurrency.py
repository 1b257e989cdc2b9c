"""Concurrent small requests against one big one, through the default application.

SGLang clients send one prompt per request, so a trainer's group of 16 arrives as 16 concurrent
one-sample requests. This measures their throughput against the same 16 samples sent as one
request, in interleaved rounds, with the default application (2 worker replicas), and the
sampler calls each path took.

    .venv/bin/python -m benchmarks.concurrency --rounds 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
from ray import serve

from deployments.app import build_app

BODY = {"num_inference_steps": 20, "rollout_debug_mode": False}


def one_request(handle, samples: int, seed: int) -> list[int]:
    result = handle.generate.remote({**BODY, "prompt": "3", "num_outputs_per_prompt": samples, "seed": seed}).result()
    return [part.sampler_batch_size for part in result.worker_results()]


def concurrent_requests(handle, samples: int, seed: int) -> list[int]:
    responses = [handle.generate.remote({**BODY, "prompt": "3", "seed": seed + i}) for i in range(samples)]
    return [part.sampler_batch_size for r in responses for part in r.result().worker_results()]


def timed(fn, *args) -> tuple[float, list[int]]:
    start = time.perf_counter()
    sizes = fn(*args)
    return time.perf_counter() - start, sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--samples", type=int, default=16)
    parser.add_argument("--batch-wait", type=float, help="the app's batch_wait_timeout_s (default: the app's default)")
    args = parser.parse_args()

    ray.init(include_dashboard=False, log_to_driver=False)
    config = {} if args.batch_wait is None else {"batch_wait_timeout_s": args.batch_wait}
    handle = serve.run(build_app(config), name="concurrency-benchmark", route_prefix=None)
    one_request(handle, args.samples, 0)  # warm-up: both paths, both replicas
    concurrent_requests(handle, args.samples, 0)
    ratios, calls = [], []
    for round_ in range(args.rounds):
        big, _ = timed(one_request, handle, args.samples, 1000 * round_)
        small, sizes = timed(concurrent_requests, handle, args.samples, 1000 * round_)
        ratios.append(big / small)  # samples/s of the small requests over that of the big one
        calls.append(sorted(set(sizes)))
    print(f"{args.samples} concurrent one-sample requests / one {args.samples}-sample request, samples/s:")
    print(f"median {statistics.median(ratios):.2f}, min {min(ratios):.2f}, max {max(ratios):.2f} over {args.rounds} rounds")
    print(f"sampler call sizes seen by the small requests, per round: {calls}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
