"""What an input image costs an editing request, what encoding it once per prompt saves (issue 47),
and what keeping the encodings between requests saves (issue 49).

    .venv/bin/python -m benchmarks.conditioning                  # the tiny Qwen-Image-Edit, 5 rounds
    .venv/bin/python -m benchmarks.conditioning --family flux_kontext
    .venv/bin/python -m benchmarks --only conditioning            # the suite's section, in docs/benchmarks.md
    .venv/bin/python -m benchmarks.conditioning --picture docs/image_editing.png   # draws an edit instead

One prompt x 16 samples of a tiny editing copy (`rollout.testing.families`), at the request size
below, ODE, taking turns round by round after a warm-up each:
- text-to-image: no input image (the editing model takes none too);
- edit: one input image, encoded once for the prompt and shared by its 16 samples;
- edit, encoded per sample: 16 input images of the same size, each one pixel apart, so each is
  encoded: the transformer's work is the edit's, plus 15 more encodes. What encoding per sample
  (the pipelines' `image` repeated per sample, or a server without per-prompt conditions) costs;
- edit, encodings kept: the edit again, as the next epoch sends it, its prompt and image encodings
  taken from the pipeline's cache (`rollout.encoding_cache`); the other paths run with no cache.
The figures: wall time per request, the transformer rows and tokens a row (the condition's tokens
follow the noise tokens), and the VAE encodes run (each path's second request).
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy
import torch

from benchmarks.serving import Spread, take_turns
from rollout.encoding_cache import EncodingCache
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

    def with_cache(roots: list[TreeRoot], cache: EncodingCache) -> Callable[[], object]:
        def run():
            pipeline.encodings = cache
            return sample_tree(pipeline, roots, options)

        return run

    roots_by_path = requests(family)
    runs = {name: with_cache(roots, EncodingCache(0)) for name, roots in roots_by_path.items()}
    runs["edit, encodings kept"] = with_cache(roots_by_path["edit"], EncodingCache())
    counts = {}
    for name, run in runs.items():
        run()  # the kept path's first request fills its cache
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


def drawn_input_image() -> InputImage:
    """A 192 x 288 picture drawn in code: a sky, a sun, a house on a hill."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (288, 192), (110, 170, 230))
    draw = ImageDraw.Draw(image)
    draw.ellipse((200, 20, 250, 70), fill=(250, 220, 60))
    draw.ellipse((-60, 120, 360, 330), fill=(70, 150, 60))
    draw.rectangle((90, 95, 170, 150), fill=(200, 80, 60))
    draw.polygon([(80, 95), (130, 55), (180, 95)], fill=(120, 50, 40))
    return InputImage(torch.from_numpy(numpy.array(image)).permute(2, 0, 1).contiguous())


def picture(family: str, path: Path) -> None:
    """The input image, then a row of edits of it: 1 prompt x 4 samples of the tiny copy (random
    weights: the layout of a request, not the quality of a model), 64 x 64, 8 SDE steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image = drawn_input_image()
    with tempfile.TemporaryDirectory() as root:
        pipeline = load_pipeline(family, TINY_FAMILIES[family].build(Path(root) / family), device="cpu")
        options = SamplingOptions(num_inference_steps=8, height=64, width=64, **TINY_FAMILIES[family].unguided)
        roots = [TreeRoot(PROMPT, "", seed, images=(image,)) for seed in range(4)]
        samples = sample_tree(pipeline, roots, options).batch.samples
    figure, axes = plt.subplots(1, 1 + len(samples), figsize=(2.2 * (1 + len(samples)), 2.4))
    axes[0].imshow(image.pixels.permute(1, 2, 0).numpy())
    axes[0].set_title("image_path", fontsize=9)
    for axis, sample in zip(axes[1:], samples):
        axis.imshow(sample.image.permute(1, 2, 0).numpy())
        axis.set_title(f"seed {sample.seed}", fontsize=9)
    for axis in axes:
        axis.set_xticks([])
        axis.set_yticks([])
    figure.suptitle(f'{family} (tiny, random weights): "{PROMPT}", num_outputs_per_prompt 4', fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--family", choices=CONDITIONED_FAMILIES, default="qwenimage_edit")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--picture", type=Path, help="draw an input image and a row of its edits here, and measure nothing")
    args = parser.parse_args()
    if args.picture is not None:
        return picture(args.family, args.picture)
    torch.set_num_threads(1)  # as a worker replica samples
    print("\n".join(run(args.family, args.rounds)))


if __name__ == "__main__":
    main()
