"""The rollout against the diffusers pipeline it wraps, at equal work (issue 18's table).

    .venv/bin/python -m benchmarks.throughput                       # the table, 5 rounds
    .venv/bin/python -m benchmarks.throughput --micro-batch-sizes 4 16 --batch-sizes 1 4 16 64
    .venv/bin/python -m benchmarks.throughput --output docs/throughput.md

Tiny SD3, FLUX.1 and Qwen-Image copies (`rollout/tiny_families.py`) widened to 8 heads (width 128),
128 x 128 px, ODE. The rollout is `rollout.sampler.sample` keeping every latent and log-prob; the
pipeline is the family's own `pipeline(..., output_type="latent")` on the same prompt, sizes, steps
and guidance. The two take turns, round by round, after a warm-up each; each cell is the median
(min - max) over rounds of rollout time / pipeline time, per micro-batch size.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.serving import Spread, take_turns
from rollout.calibration import calibrate
from rollout.models.base import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample
from rollout.tiny_families import FAMILY_BUILDERS
from rollout.transitions import TransitionKind

SIZE = 128
TRANSFORMER_HEADS = 8  # width 128
STEPS = {"sd3": 28, "flux": 28, "qwenimage": 10}
PROMPT = "a photo of a cat"
CALIBRATION_CANDIDATES = (1, 2, 4, 8, 16)
# With and without classifier-free guidance, as each family's pipeline turns it on and off.
GUIDANCE = {
    "sd3": ({"guidance_scale": 1.0}, {"guidance_scale": 4.5}),
    "flux": ({"guidance_scale": 3.5}, {"guidance_scale": 3.5, "true_cfg_scale": 2.5}),
    "qwenimage": ({"true_cfg_scale": 1.0}, {"true_cfg_scale": 4.0}),
}


def build_families(root: Path) -> dict[str, Path]:
    return {name: build(root / name, transformer_heads=TRANSFORMER_HEADS) for name, build in FAMILY_BUILDERS.items()}


def runs(family, name: str, batch_size: int, cfg: bool) -> dict:
    """The two calls compared: the rollout and the pipeline, at equal work."""
    guidance = GUIDANCE[name][cfg]
    options = SamplingOptions(
        num_inference_steps=STEPS[name], height=SIZE, width=SIZE, sde_type=TransitionKind.ODE, **guidance
    )
    # diffusers' FLUX.1 and Qwen-Image pipelines run true CFG only when given a negative prompt.
    negative = {"negative_prompt": ""} if cfg and name != "sd3" else {}

    def rollout():
        sample(family, [PROMPT] * batch_size, seeds=list(range(batch_size)), options=options)

    def pipeline():
        family.pipe(
            prompt=PROMPT,
            num_images_per_prompt=batch_size,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS[name],
            output_type="latent",
            generator=torch.Generator().manual_seed(0),
            **negative,
            **guidance,
        )

    return {"rollout": rollout, "pipeline": pipeline}


def calibrated_size(path: Path, name: str) -> tuple[int, str]:
    """The micro-batch size `rollout.calibration` picks for the family at SIZE, with CFG, and its times."""
    calibration = calibrate(load_pipeline(None, path), SIZE, SIZE, CALIBRATION_CANDIDATES, GUIDANCE[name][True])
    per_row = ", ".join(f"{rows}: {seconds * 1e3:.2f}" for rows, seconds in calibration.seconds_per_row.items())
    return calibration.chosen, f"{name}: ms per row {{{per_row}}}, chosen {calibration.chosen}"


def measure(families: dict[str, Path], micro_batch_sizes, loads, rounds: int, calibrated: bool) -> tuple[list, list]:
    """(family, micro-batch size, batch size, cfg, Spread of rollout / pipeline time) per cell, and
    the calibrations run."""
    cells, calibrations = [], []
    for name, path in families.items():
        sizes = list(micro_batch_sizes)
        if calibrated:
            chosen, report = calibrated_size(path, name)
            print(report, flush=True)
            calibrations.append(report)
            sizes = sorted({*sizes, chosen})
        for micro_batch_size in sizes:
            family = load_pipeline(None, path, micro_batching=MicroBatching(micro_batch_size))
            for batch_size, cfg in loads:
                times = take_turns(runs(family, name, batch_size, cfg), rounds)
                ratio = Spread(tuple(r / p for r, p in zip(times["rollout"], times["pipeline"])))
                cells.append((name, micro_batch_size, batch_size, cfg, ratio))
                print(
                    f"{name} micro-batch {micro_batch_size} B={batch_size}{' CFG' if cfg else ''}: {ratio}", flush=True
                )
    return cells, calibrations


def table(cells: list[tuple], loads) -> list[str]:
    columns = [f"B={b}{' with CFG' if cfg else ''}" for b, cfg in loads]
    lines = ["| family (steps) | micro-batch | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    keys = sorted({(name, mb) for name, mb, *_ in cells}, key=lambda k: (list(STEPS).index(k[0]), k[1]))
    for name, micro_batch_size in keys:
        row = {(b, cfg): ratio for n, mb, b, cfg, ratio in cells if (n, mb) == (name, micro_batch_size)}
        values = " | ".join(f"{row[load]:.2f}" for load in loads)
        lines.append(f"| {name} (T={STEPS[name]}) | {micro_batch_size} | {values} |")
    return lines


def parameter_counts(families: dict[str, Path]) -> str:
    counts = []
    for name, path in families.items():
        transformer = load_pipeline(None, path).transformer
        counts.append(f"{name} {sum(p.numel() for p in transformer.parameters()) / 1e6:.2f} M")
    return ", ".join(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[4])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--calibrate", action="store_true", help="also measure the size calibrate picks")
    parser.add_argument("--output", type=Path, help="write the table, with the command and machine, here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loads = [(b, False) for b in args.batch_sizes] + [(max(args.batch_sizes), True)]
    with tempfile.TemporaryDirectory() as root:
        families = build_families(Path(root))
        counts = parameter_counts(families)
        print(f"transformer parameters: {counts}")
        cells, calibrations = measure(families, args.micro_batch_sizes, loads, args.rounds, args.calibrate)
    lines = table(cells, loads)
    if calibrations:
        lines += ["", "Calibration (`rollout.calibration.calibrate`, with CFG):", "", *(f"- {c}" for c in calibrations)]
    print("\n".join(lines))
    if args.output is not None:
        head = [
            f"Command: `.venv/bin/python -m benchmarks.throughput {' '.join(sys.argv[1:])}`.  ",
            (
                f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} torch threads; "
                f"torch {torch.__version__}. Date: {datetime.date.today().isoformat()}.  "
            ),
            (
                f"Transformer parameters: {counts}. Rollout time / pipeline time, median (min - max) of "
                f"{args.rounds} rounds taken in turns."
            ),
            "",
        ]
        args.output.write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
