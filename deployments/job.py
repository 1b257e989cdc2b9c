"""Job entrypoint: generates rollouts for a prompt file and writes them to disk.

    ray job submit --working-dir . -- python -m deployments.job --prompts prompts.txt --output /data/rollouts

Connects to the cluster's running rollout application (`--app-name`; it exits at once, naming
the applications that do run, if there is none), sends the prompts in requests of `--prompts-per-request`
with at most `--max-in-flight` requests outstanding, and writes one safetensors shard per request
plus `index.json` (see `rollout.dataset`). A progress bar counts samples.
"""

from __future__ import annotations

import argparse
import time
from collections import deque
from pathlib import Path

import ray
from tqdm import tqdm

from deployments.client import ApplicationNotFoundError, running_app
from rollout.dataset import RolloutDatasetWriter
from rollout.schema import RolloutRequest


def read_prompts(path: Path) -> list[str]:
    """One prompt per non-empty line."""
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, required=True, help="text file, one prompt per line")
    parser.add_argument("--output", type=Path, required=True, help="directory for the shards and index.json")
    parser.add_argument("--app-name", default="rollout")
    parser.add_argument("--num-outputs-per-prompt", type=int, default=4)
    parser.add_argument("--num-inference-steps", type=int, default=20)
    parser.add_argument("--sde-type", default="sde", choices=["sde", "cps", "ode"])
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0, help="base seed; request r starts where request r-1 ended")
    parser.add_argument("--prompts-per-request", type=int, default=8)
    parser.add_argument("--max-in-flight", type=int, default=4)
    args = parser.parse_args(argv)

    prompts = read_prompts(args.prompts)
    ray.init(address="auto", ignore_reinit_error=True)
    try:
        handle = running_app(args.app_name)
    except ApplicationNotFoundError as error:
        raise SystemExit(str(error)) from None

    per_request = args.prompts_per_request
    requests = [
        RolloutRequest(
            prompt=prompts[start : start + per_request],
            num_outputs_per_prompt=args.num_outputs_per_prompt,
            num_inference_steps=args.num_inference_steps,
            rollout_sde_type=args.sde_type,
            rollout_noise_level=args.noise_level,
            rollout_debug_mode=False,  # the shards keep no debug tensors
            rollout_return_dit_trajectory=True,  # but every latent
            seed=args.seed + start * args.num_outputs_per_prompt,
        )
        for start in range(0, len(prompts), per_request)
    ]
    total = len(prompts) * args.num_outputs_per_prompt
    start_time = time.perf_counter()
    in_flight: deque = deque()
    with RolloutDatasetWriter(args.output, {"app_name": args.app_name}) as writer, tqdm(
        total=total, unit="sample", desc="rollouts"
    ) as progress:
        for number, request in enumerate(requests):
            in_flight.append((number, handle.generate.remote(request)))
            if len(in_flight) >= args.max_in_flight:
                _write(writer, *in_flight.popleft(), args.prompts_per_request, progress)
        while in_flight:
            _write(writer, *in_flight.popleft(), args.prompts_per_request, progress)
    elapsed = time.perf_counter() - start_time
    print(f"wrote {total} samples in {len(requests)} shards to {args.output} in {elapsed:.1f} s")


def _write(writer: RolloutDatasetWriter, number: int, response, prompts_per_request: int, progress: tqdm) -> None:
    result = response.result()
    batch = result.batch()
    records = [
        {
            "request_id": result.request_id,
            "prompt_index": number * prompts_per_request + i // result.num_outputs_per_prompt,
        }
        for i in range(len(batch.samples))
    ]
    writer.write(batch, records)
    progress.update(len(batch.samples))


if __name__ == "__main__":
    main()
