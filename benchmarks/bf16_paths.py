"""How far the rollout's bf16 ODE path is from `pipeline(...)` in bf16, per family.

The rollout keeps latents and the Euler update in fp32 whatever the weights' dtype; diffusers'
pipelines compute `dt * v` in the model dtype and cast the latents back to it after every step.
With the same weights, seeds and prompts, this prints the largest absolute difference of the
final latents between:
- the rollout (ODE) and `pipeline(...)`, both with bf16 weights;
- each of them and the fp32 pipeline (the reference both approximate);
- the rollout and the pipeline with fp32 weights (the batch-composition floor).

    .venv/bin/python -m benchmarks.bf16_paths --steps 4 10

It runs on the tiny random-weight copies the tests build (`rollout.testing.families`): their
numbers say how the two paths differ, not how large the difference is on real weights; the GPU
check (`scripts/gpu_check.py`) measures the real-size one.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample
from rollout.testing.families import IMAGE_FAMILIES, TINY_FAMILIES
from rollout.transitions import TransitionKind

PROMPTS = ["a red cube on a table", "a lighthouse in a storm at night"]
SEEDS = [0, 1]
SIZE = 64


def final_latents(path: Path, dtype: torch.dtype, steps: int, guidance: dict) -> dict[str, torch.Tensor]:
    pipeline = load_pipeline(None, path, device="cpu", dtype=dtype, micro_batching=MicroBatching(len(PROMPTS)))
    options = SamplingOptions(num_inference_steps=steps, height=SIZE, width=SIZE, sde_type=TransitionKind.ODE, **guidance)
    negative = [""] * len(PROMPTS)
    rollout = sample(pipeline, PROMPTS, SEEDS, options, negative_prompts=negative)
    reference = pipeline.pipe(
        prompt=PROMPTS, negative_prompt=negative, height=SIZE, width=SIZE, num_inference_steps=steps,
        generator=[torch.Generator("cpu").manual_seed(s) for s in SEEDS], output_type="latent", **guidance,
    ).images.float()  # fmt: skip
    if reference.ndim == 3:
        reference = pipeline.unpack(reference, SIZE // 8, SIZE // 8)
    return {"rollout": torch.stack([s.final_latents for s in rollout.samples]), "pipeline": reference}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[4, 10])
    args = parser.parse_args()

    print("| family | steps | rollout bf16 vs pipeline bf16 | rollout bf16 vs pipeline fp32 | pipeline bf16 vs pipeline fp32 | rollout fp32 vs pipeline fp32 |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for family in IMAGE_FAMILIES:
            record = TINY_FAMILIES[family]
            path = record.build(Path(scratch) / family)
            for steps in args.steps:
                bf16 = final_latents(path, torch.bfloat16, steps, record.trained)
                fp32 = final_latents(path, torch.float32, steps, record.trained)

                def gap(a, b):
                    return f"{(a - b).abs().max().item():.2e}"

                print(
                    f"| {family} | {steps} | {gap(bf16['rollout'], bf16['pipeline'])} | {gap(bf16['rollout'], fp32['pipeline'])} "
                    f"| {gap(bf16['pipeline'], fp32['pipeline'])} | {gap(fp32['rollout'], fp32['pipeline'])} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
