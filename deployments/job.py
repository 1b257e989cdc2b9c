"""Job entrypoint: generates rollouts for a prompt file and writes them to disk.

    ray job submit --working-dir . -- python -m deployments job --prompts prompts.txt --output /data/rollouts

Connects to the cluster's running rollout application (`--app-name`; it exits at once, naming
the applications that do run, if there is none), sends the prompts in requests of `--prompts-per-request`
with at most `--max-in-flight` requests outstanding, and writes one safetensors shard per request
plus `index.json` (see `rollout.dataset`). A progress bar counts samples. For an image-conditioned
model the prompt file is JSON lines with each prompt's `image_path` (`read_prompts`): the job reads
the images and sends their bytes, and the dataset keeps each image once per shard. With a video model,
`--num-frames` sets the frame count and `--videos` also writes each sample's frames as an MP4
(`videos/sample-<index>.mp4` next to the shards, at `--fps`; `rollout.video`).

The requests follow from the arguments alone (request r's seed is `--seed` plus the samples before
it), and the index records the arguments under `job`. A job stopped early (a failed request, Ctrl-C,
a kill) leaves a dataset of the shards written so far, which loads; `--resume` continues it: the
shards its index lists and that pass their checks are kept and their requests not sent again, so
that the dataset ends as an uninterrupted run's would (the same tensors, bit for bit, and records,
but for their `request_id`). Without `--resume`, an output that holds a dataset is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import ray
from tqdm import tqdm

from deployments.client import ApplicationNotFoundError, running_app
from rollout.dataset import INDEX_FILE, DatasetFormatError, RolloutDatasetWriter, read_index
from rollout.errors import clip, short_repr
from rollout.schema import RolloutRequest

# The recorded arguments that decide the requests, and so the shards: `--resume` continues only a
# dataset whose index records the same ones.
REQUEST_ARGUMENTS = (
    "prompts_sha256",
    "num_outputs_per_prompt",
    "num_inference_steps",
    "sde_type",
    "noise_level",
    "seed",
    "prompts_per_request",
    "height",
    "width",
    "num_frames",
)
# Wan2.1 and Wan2.2 make 16 frames a second; an MP4 needs some rate even where the request gave none.
DEFAULT_FPS = 16


class RequestFailedError(RuntimeError):
    """A request of the job failed, whatever the cause: the job stops, its shards so far written."""


@dataclass(frozen=True)
class JobPrompt:
    """One line of the prompt file: a prompt and, for an image-conditioned model, its input images'
    file bytes (read here, on the job's side, and sent as bytes: the server reads no job's files)."""

    prompt: str
    images: tuple[bytes, ...] = ()

    def digest(self) -> str | dict:
        """What the job's `prompts_sha256` hashes of it: a text prompt alone (as jobs before images
        did, so they resume), else with its images' SHA-256."""
        if not self.images:
            return self.prompt
        return {"prompt": self.prompt, "images": [hashlib.sha256(image).hexdigest() for image in self.images]}


def read_prompts(path: Path) -> list[JobPrompt]:
    """A text file's prompts, one per non-empty line; or a `.jsonl` file's, one JSON object per
    non-empty line: `{"prompt": "...", "image_path": "cat.png"}` (or a list of paths), paths
    relative to the file's directory, every line with images or none."""
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        raise SystemExit(f"{path}: no prompts")
    if path.suffix != ".jsonl":
        return [JobPrompt(line) for line in lines]
    prompts = [_jsonl_prompt(path, number, line) for number, line in enumerate(lines, start=1)]
    if len({bool(prompt.images) for prompt in prompts}) > 1:
        raise SystemExit(f"{path}: some lines have an image_path and some do not; a job sends one kind of prompt")
    return prompts


def _jsonl_prompt(path: Path, number: int, line: str) -> JobPrompt:
    try:
        entry = json.loads(line)
    except ValueError as error:
        raise SystemExit(f"{path}:{number}: not JSON ({error})") from None
    if not isinstance(entry, dict) or not isinstance(entry.get("prompt"), str):
        raise SystemExit(f'{path}:{number}: expected an object with a "prompt" string')
    names = entry.get("image_path", [])
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list) or not all(isinstance(name, str) for name in names):
        raise SystemExit(f"{path}:{number}: image_path must be a path or a list of paths")
    try:
        images = tuple((path.parent / name).read_bytes() for name in names)
    except OSError as error:
        raise SystemExit(f"{path}:{number}: cannot read an image: {error}") from None
    return JobPrompt(entry["prompt"], images)


def job_requests(prompts: list[JobPrompt], args: argparse.Namespace) -> list[RolloutRequest]:
    """The job's requests, which follow from its arguments alone."""
    per_request = args.prompts_per_request
    return [
        RolloutRequest(
            prompt=[p.prompt for p in prompts[start : start + per_request]],
            image_path=[list(p.images) for p in prompts[start : start + per_request]] if prompts[0].images else None,
            num_outputs_per_prompt=args.num_outputs_per_prompt,
            num_inference_steps=args.num_inference_steps,
            rollout_sde_type=args.sde_type,
            rollout_noise_level=args.noise_level,
            rollout_debug_mode=False,  # the shards keep no debug tensors
            rollout_return_dit_trajectory=True,  # but every latent
            seed=args.seed + start * args.num_outputs_per_prompt,
            height=args.height,
            width=args.width,
            num_frames=args.num_frames,
            fps=args.fps,
        )
        for start in range(0, len(prompts), per_request)
    ]


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--prompts",
        type=Path,
        required=True,
        help='text file, one prompt per line; or .jsonl, {"prompt": ..., "image_path": ...} per line',
    )
    parser.add_argument("--output", type=Path, required=True, help="directory for the shards and index.json")
    parser.add_argument("--app-name", default="rollout")
    parser.add_argument("--num-outputs-per-prompt", type=int, default=4)
    parser.add_argument("--num-inference-steps", type=int, default=20)
    parser.add_argument("--sde-type", default="sde", choices=["sde", "cps", "dance", "ode"])
    parser.add_argument("--noise-level", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0, help="base seed; request r starts where request r-1 ended")
    parser.add_argument("--prompts-per-request", type=int, default=8)
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--height", type=int, help="pixels; default: the model's")
    parser.add_argument("--width", type=int, help="pixels; default: the model's")
    parser.add_argument("--num-frames", type=int, help="frames per sample of a video model; default: the model's")
    parser.add_argument("--fps", type=int, help=f"frame rate of a video model's output (MP4s: default {DEFAULT_FPS})")
    parser.add_argument("--videos", action="store_true", help="also write each video as videos/sample-<index>.mp4")
    parser.add_argument(
        "--resume", action="store_true", help="continue the dataset in --output, written with the same arguments"
    )
    args = parser.parse_args(argv)

    prompts = read_prompts(args.prompts)
    requests = job_requests(prompts, args)
    arguments = {name: str(value) if isinstance(value, Path) else value for name, value in vars(args).items()}
    arguments["prompts_sha256"] = hashlib.sha256(json.dumps([p.digest() for p in prompts]).encode()).hexdigest()
    _check_output(args.output, args.resume, arguments)
    ray.init(address="auto", ignore_reinit_error=True)
    try:
        handle = running_app(args.app_name)
    except ApplicationNotFoundError as error:
        raise SystemExit(str(error)) from None

    writer = RolloutDatasetWriter(args.output, {"app_name": args.app_name, "job": arguments}, resume=args.resume)
    kept_shards, kept_samples = len(writer.shards), len(writer.samples)
    if writer.damaged_on_resume is not None:
        print(f"{writer.damaged_on_resume}; sampling it and the shards after it again")
    if args.resume:
        print(f"resuming {args.output}: {kept_shards} of {len(requests)} shards are written")
    start_time = time.perf_counter()
    in_flight: deque = deque()
    total = len(prompts) * args.num_outputs_per_prompt
    with writer, tqdm(total=total, initial=kept_samples, unit="sample", desc="rollouts") as progress:
        try:
            for number in range(kept_shards, len(requests)):
                in_flight.append((number, handle.generate.remote(requests[number])))
                if len(in_flight) >= args.max_in_flight:
                    _write(writer, *in_flight.popleft(), args, progress)
            while in_flight:
                _write(writer, *in_flight.popleft(), args, progress)
        except (RequestFailedError, KeyboardInterrupt) as stop:
            reason = str(stop) if isinstance(stop, RequestFailedError) else "interrupted"
            raise SystemExit(
                f"{reason}; {args.output} holds {len(writer.shards)} of {len(requests)} shards "
                f"({len(writer.samples)} samples), a dataset that loads: run the job again with --resume to continue it"
            ) from None
    elapsed = time.perf_counter() - start_time
    kept = f", after the {kept_shards} shards kept from an earlier run" if kept_shards else ""
    print(
        f"wrote {len(writer.samples) - kept_samples} samples in {len(writer.shards) - kept_shards} shards "
        f"to {args.output} in {elapsed:.1f} s{kept}"
    )


def _check_output(output: Path, resume: bool, arguments: dict) -> None:
    """Refuses an output that holds a dataset, unless `--resume` and its requests are these arguments'."""
    if not (output / INDEX_FILE).exists():
        return
    if not resume:
        raise SystemExit(f"{output} holds a dataset already: pass --resume to continue it, or choose another --output")
    try:
        recorded = read_index(output).get("job", {})
    except DatasetFormatError as error:
        raise SystemExit(f"cannot --resume: {error}") from None
    if not recorded:
        raise SystemExit(f"cannot --resume {output}: its index records no job arguments; choose another --output")
    differing = [name for name in REQUEST_ARGUMENTS if recorded.get(name) != arguments[name]]
    if differing:
        changes = ", ".join(
            "--prompts: other prompts"
            if name == "prompts_sha256"
            else f"--{name.replace('_', '-')} {short_repr(arguments[name])}, not {short_repr(recorded.get(name))}"
            for name in differing
        )
        raise SystemExit(
            f"cannot --resume {output}: its index records other requests ({changes}); "
            "pass the arguments it was written with, or choose another --output"
        )


def _write(writer: RolloutDatasetWriter, number: int, response, args: argparse.Namespace, progress: tqdm) -> None:
    try:
        result = response.result()
        batch = result.batch()
    except Exception as error:  # the job stops at its first failed request, whatever failed it
        raise RequestFailedError(f"request {number} failed: {clip(f'{type(error).__name__}: {error}', 300)}") from error
    records = [
        {
            "request_id": result.request_id,
            "prompt_index": number * args.prompts_per_request + i // result.num_outputs_per_prompt,
        }
        for i in range(len(batch.samples))
    ]
    first_index = len(writer.samples)
    writer.write(batch, records)
    if args.videos:
        _write_videos(args.output / "videos", batch, first_index, args.fps or DEFAULT_FPS)
    progress.update(len(batch.samples))


def _write_videos(directory: Path, batch, first_index: int, fps: int) -> None:
    """Each sample's frames as `sample-<its index in the dataset>.mp4`."""
    from rollout.video import write_mp4

    if batch.samples[0].image.ndim != 4:
        raise SystemExit("--videos: the served model makes images, not videos")
    directory.mkdir(exist_ok=True)
    for offset, sample in enumerate(batch.samples):
        write_mp4(sample.image, directory / f"sample-{first_index + offset:06d}.mp4", fps)


if __name__ == "__main__":
    main()
