"""What an input image costs an editing request, and what encoding it once per prompt saves (issue 47).

    .venv/bin/python -m benchmarks.conditioning                  # the tiny Qwen-Image-Edit, 5 rounds
    .venv/bin/python -m benchmarks.conditioning --family flux_kontext
    .venv/bin/python -m benchmarks --only conditioning            # the suite's section, in docs/benchmarks.md

One prompt x 16 samples of a tiny editing copy (`rollout.testing.families`), at the request size
below, ODE, taking turns round by round after a warm-up each:
- text-to-image: no input image (the editing model takes none too);
- edit: one input image, encoded once for the prompt and shared by its 16 samples;
- edit, encoded per sample: 16 input images of the same size, each one pixel apart, so each is
  encoded: the transformer's work is the edit's, plus 15 more encodes. What encoding per sample
  (the pipelines' `image` repeated per sample, or a server without per-prompt conditions) costs.
The figures: wall time per request, the transformer rows and tokens a row (the condition's tokens
follow the noise tokens), and the encodes run.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks.serving import Spread, take_turns
from rollout.input_images import InputImage
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample_tree
from rollout.testing.families import CONDITIONED_FAMILIES, TINY_FAMILIES
from rollout.transitions import TransitionKind
from rollout.tree import TreeRoot

SAMPLES, SIZE, STEPS, MICRO_BATCH = 16, 256, 4, 4
PROMPT = "make the sky red"


@dataclass(frozen=True)
class ConditionFigures:
    path: str
    seconds: Spread
    time_ratio: Spread  # against text-to-image
    transformer_rows: int
    tokens_per_row: int
    encodes: int


def input_image(seed: int, changed_pixel: int | None = None) -> InputImage:
    """A 512 x 768 image (a landscape photo's ratio); `changed_pixel` k: pixel k made one level brighter."""
    pixels = torch.randint(0, 255, (3, 512, 768), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    if changed_pixel is not None:
        pixels.view(3, -1)[0, changed_pixel] += 1
    return InputImage(pixels)


def requests(family: str) -> dict[str, list[TreeRoot]]:
    shared = (input_image(0),)
    return {
        "text-to-image": [TreeRoot(PROMPT, "", seed) for seed in range(SAMPLES)],
        "edit": [TreeRoot(PROMPT, "", seed, images=shared) for seed in range(SAMPLES)],
        "edit, encoded per sample": [
            TreeRoot(PROMPT, "", seed, images=(input_image(0, changed_pixel=seed),)) for seed in range(SAMPLES)
        ],
    }


def measure(family: str, directory: Path, rounds: int) -> list[ConditionFigures]:
    pipeline = load_pipeline(family, directory, device="cpu", micro_batching=MicroBatching(MICRO_BATCH))
    options = SamplingOptions(
        num_inference_steps=STEPS, height=SIZE, width=SIZE, sde_type=TransitionKind.ODE, **TINY_FAMILIES[family].unguided
    )
    encodes, tokens = [], []
    pipeline.vae.encoder.register_forward_hook(lambda module, args, output: encodes.append(1))
    denoiser = pipeline.weight_modules[pipeline.experts[0]]
    denoiser.register_forward_hook(lambda m, args, kwargs, out: tokens.append(kwargs["hidden_states"].shape[1]), with_kwargs=True)
    runs: dict[str, Callable[[], object]] = {
        name: (lambda roots=roots: sample_tree(pipeline, roots, options)) for name, roots in requests(family).items()
    }
    counts = {}
    for name, run in runs.items():
        encodes.clear()
        tokens.clear()
        call = run()
        counts[name] = (call.transformer_rows, tokens[0], len(encodes))
    times = take_turns(runs, rounds)
    base = times["text-to-image"]
    return [
        ConditionFigures(name, Spread(tuple(series)), Spread(tuple(t / b for t, b in zip(series, base))), *counts[name])
        for name, series in times.items()
    ]


def table(family: str, figures: list[ConditionFigures]) -> list[str]:
    lines = [
        f"`benchmarks/conditioning.py`: the tiny `{family}` copy, 1 prompt x {SAMPLES} samples at {SIZE}x{SIZE}, "
        f"{STEPS} ODE steps, micro-batches of {MICRO_BATCH}; the input image 512x768 px, resized as the pipeline "
        "resizes it.",
        "",
        "| request | wall time (s) | time / text-to-image | transformer rows | tokens a row | VAE encodes |",
        "|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {f.path} | {f.seconds} | {f.time_ratio} | {f.transformer_rows} | {f.tokens_per_row} | {f.encodes} |"
        )
    return lines


def run(family: str, rounds: int) -> list[str]:
    with tempfile.TemporaryDirectory() as root:
        directory = TINY_FAMILIES[family].build(Path(root) / family)
        return table(family, measure(family, directory, rounds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--family", choices=CONDITIONED_FAMILIES, default=CONDITIONED_FAMILIES[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a worker replica samples
    print("\n".join(run(args.family, args.rounds)))


if __name__ == "__main__":
    main()
