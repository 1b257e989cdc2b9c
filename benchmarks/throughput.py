"""The rollout against the diffusers pipeline it wraps, at equal work (issue 18's table).

    .venv/bin/python -m benchmarks.throughput                       # the table, 5 rounds
    .venv/bin/python -m benchmarks.throughput --micro-batch-sizes 4 16 --batch-sizes 1 4 16 64 --cfg-batch-sizes 16 64
    .venv/bin/python -m benchmarks.throughput --batch-invariance padding kernels   # both ways, in turns
    .venv/bin/python -m benchmarks.throughput --pipeline-output latent pt  # and the pipeline decoding too
    .venv/bin/python -m benchmarks.throughput --families sd3 --memory    # peak memory too
    .venv/bin/python -m benchmarks.throughput --output docs/throughput.md

The tiny image families with a `throughput_steps` (`rollout.testing.families`) widened to 8 heads (width 128),
128 x 128 px, ODE. The rollout is `rollout.sampler.sample` keeping every latent and log-prob, with
its batch invariance kept by padding or by batch-invariant kernels (`rollout/kernels.py`); the
pipeline is the family's own `pipeline(...)` on the same prompt, sizes, steps and guidance, with
`output_type="latent"` (issue 18's baseline: it decodes nothing, the rollout decodes its images) or
`"pt"` (it decodes them too: equal work). Micro-batch sizes count the transformer's rows (two a
guided SD3 sample: `rollout.sampler.micro_batch_size`). The calls take turns, round by round, after a warm-up
each; each cell is the median (min - max) over rounds of rollout time / pipeline time.
"""

from __future__ import annotations

import argparse
import datetime
import math
import multiprocessing
import os
import platform
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

from benchmarks.serving import Spread, take_turns
from rollout.calibration import STARTUP_BUDGET_S, CalibrationCache, calibrate_at_start, calibration_keys
from rollout.kernels import BatchInvariance
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample
from rollout.testing.families import TINY_FAMILIES
from rollout.transitions import TransitionKind

SIZE = 128
TRANSFORMER_HEADS = 8  # width 128
STEPS = {name: record.throughput_steps for name, record in TINY_FAMILIES.items() if record.throughput_steps}
PROMPT = "a photo of a cat"
MEMORY_LOAD = {"batch_size": 64, "steps": 50, "size": 256}  # issue 18's memory figure


def build_families(root: Path, names=tuple(STEPS)) -> dict[str, Path]:
    return {name: TINY_FAMILIES[name].build(root / name, transformer_heads=TRANSFORMER_HEADS) for name in names}


def guidance_of(name: str, cfg: bool) -> dict:
    """The family's guidance with classifier-free guidance on or off, as its pipeline turns it."""
    record = TINY_FAMILIES[name]
    return dict(record.guided if cfg else record.unguided)


def runs(family, name: str, batch_size: int, cfg: bool, pipeline_outputs=("latent",)) -> dict:
    """The calls compared: the rollout, and the pipeline with each `output_type` in `pipeline_outputs`
    (named `pipeline latent`, `pipeline pt`)."""
    guidance = guidance_of(name, cfg)
    options = SamplingOptions(
        num_inference_steps=STEPS[name], height=SIZE, width=SIZE, sde_type=TransitionKind.ODE, **guidance
    )
    # diffusers' pipelines run true CFG only when given a negative prompt.
    negative = {"negative_prompt": ""} if cfg and "true_cfg_scale" in guidance else {}

    def rollout():
        sample(family, [PROMPT] * batch_size, seeds=list(range(batch_size)), options=options)

    def pipeline(output_type: str):
        return lambda: family.pipe(
            prompt=PROMPT,
            num_images_per_prompt=batch_size,
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS[name],
            output_type=output_type,
            generator=torch.Generator().manual_seed(0),
            **negative,
            **guidance,
        )

    return {"rollout": rollout, **{f"pipeline {output}": pipeline(output) for output in pipeline_outputs}}


def calibrated_sizes(path: Path, name: str) -> tuple[int, int, str]:
    """The transformer's and the VAE's micro-batch sizes a worker replica serves the family with at
    SIZE by default: measured at its start (`rollout.calibration.calibrate_at_start`, the model's
    default guidance, the default budget), and its times."""
    with tempfile.TemporaryDirectory() as cache:
        pipeline = load_pipeline(None, path)
        keys = calibration_keys(pipeline, [(SIZE, SIZE)])
        startup = calibrate_at_start(pipeline, keys, STARTUP_BUDGET_S, CalibrationCache(Path(cache)))
    (calibration,) = startup.measured

    def ms(per_sample: dict[int, float]) -> str:
        return "{" + ", ".join(f"{rows}: {seconds * 1e3:.2f}" for rows, seconds in per_sample.items()) + "}"

    report = (
        f"{name}: ms per sample, rollout less its decode {ms(calibration.denoising_seconds_per_sample)}, "
        f"decode {ms(calibration.decode_seconds_per_sample)}; chosen for batches of {calibration.load}: "
        f"{calibration.chosen} for the transformer, {calibration.chosen_for_decode} for the VAE ({startup.notes[0]})"
    )
    return calibration.chosen, calibration.chosen_for_decode, report


# Loads under this cost a quarter of a B=64 load's time or less, so a fixed time buys them more rounds.
SMALL_LOAD = 64


@dataclass(frozen=True)
class Cell:
    """One load's rollout / pipeline time, for one family and way of batching, against the pipeline
    called with `output_type=pipeline_output` ("latent": it decodes nothing; "pt": it decodes too)."""

    family: str
    invariance: BatchInvariance
    micro_batch: str  # the transformer's size, and the VAE's where it has its own
    batch_size: int
    cfg: bool
    pipeline_output: str
    ratio: Spread


def measure(
    families: dict[str, Path],
    micro_batch_sizes,
    loads,
    rounds: int,
    calibrated: bool,
    invariances=(BatchInvariance.PADDING,),
    pipeline_outputs=("latent",),
    small_load_rounds: int | None = None,
) -> tuple[list[Cell], list[str]]:
    """A `Cell` per family, batch invariance, micro-batch size, load and pipeline output, and the
    calibrations run. The pipeline's outputs take their turns in the same rounds as the rollout.
    Loads of fewer than `SMALL_LOAD` samples take `small_load_rounds` (default: `rounds`)."""
    cells, calibrations = [], []
    for name, path in families.items():
        sizes = [(rows, rows) for rows in micro_batch_sizes]  # (the transformer's, the VAE's)
        if calibrated:
            chosen, chosen_for_decode, report = calibrated_sizes(path, name)
            print(report, flush=True)
            calibrations.append(report)
            sizes = sorted({*sizes, (chosen, chosen_for_decode)})
        for invariance in invariances:
            # Under the kernels the VAE decodes an image a call, whatever its size.
            kernels = invariance is BatchInvariance.KERNELS
            for rows, images in sorted({(rows, rows if kernels else images) for rows, images in sizes}):
                micro_batching = MicroBatching(rows, invariance=invariance, decode_default=images)
                micro_batch = str(rows) if rows == images else f"{rows}, VAE {images}"
                family = load_pipeline(None, path, micro_batching=micro_batching)
                for batch_size, cfg in loads:
                    load_rounds = small_load_rounds if small_load_rounds and batch_size < SMALL_LOAD else rounds
                    times = take_turns(runs(family, name, batch_size, cfg, pipeline_outputs), load_rounds)
                    for output in pipeline_outputs:
                        ratio = Spread(tuple(r / p for r, p in zip(times["rollout"], times[f"pipeline {output}"])))
                        cells.append(Cell(name, invariance, micro_batch, batch_size, cfg, output, ratio))
                        print(
                            f"{name} {invariance.value} micro-batch {micro_batch} B={batch_size}"
                            f"{' CFG' if cfg else ''} against {output}: {ratio}",
                            flush=True,
                        )
    return cells, calibrations


class PeakResidentMemory:
    """The most resident memory this process held above what it held on entry, sampled every
    millisecond by a thread (torch's kernels release the GIL), in bytes."""

    def __enter__(self) -> Self:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._baseline = self._resident()
        self.peak_bytes = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak_bytes = max(self.peak_bytes, self._resident() - self._baseline)

    def _resident(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self._page

    def _watch(self) -> None:
        while not self._done.wait(0.001):
            self.peak_bytes = max(self.peak_bytes, self._resident() - self._baseline)


def memory_of(path: Path, which: str, batch_size: int, steps: int, size: int) -> int:
    """Peak resident memory, in bytes, of one rollout or pipeline call in this (fresh) process."""
    family = load_pipeline(None, path)
    options = SamplingOptions(num_inference_steps=steps, height=size, width=size, sde_type=TransitionKind.ODE)
    with PeakResidentMemory() as memory:
        if which == "rollout":
            sample(family, [PROMPT] * batch_size, seeds=list(range(batch_size)), options=options)
        else:
            family.pipe(
                prompt=PROMPT, num_images_per_prompt=batch_size, height=size, width=size,
                num_inference_steps=steps, output_type="latent", generator=torch.Generator().manual_seed(0),
            )  # fmt: skip
    return memory.peak_bytes


@dataclass(frozen=True)
class PeakMemory:
    """One family's peak resident memory above the loaded model, in bytes."""

    family: str
    kept: int  # the latents the rollout keeps
    rollout: int
    pipeline: int

    @property
    def target(self) -> float:
        """Issue 18's bound on the rollout's peak: 1.3 x what it keeps, plus the pipeline's own peak."""
        return 1.3 * self.kept + self.pipeline


def peak_memory(families: dict[str, Path], batch_size: int, steps: int, size: int) -> list[PeakMemory]:
    """Each call in a fresh process, so that no memory freed by an earlier one is reused."""
    spawn = multiprocessing.get_context("spawn")
    rows = []
    for name, path in families.items():
        peaks = {}
        for which in ("rollout", "pipeline"):
            with spawn.Pool(1) as pool:
                peaks[which] = pool.apply(memory_of, (path, which, batch_size, steps, size))
        latent_shape = load_pipeline(None, path).latent_shape(size, size)
        kept = batch_size * (steps + 1) * math.prod(latent_shape) * 4
        rows.append(PeakMemory(name, kept, **peaks))
        print(rows[-1], flush=True)
    return rows


def memory_table(rows: list[PeakMemory], batch_size: int, steps: int, size: int) -> list[str]:
    lines = [
        (
            f"Peak resident memory above the loaded model, B={batch_size}, T={steps}, {size} x {size} px, ODE, every "
            "latent kept, each call in a fresh process. The rollout decodes its images (in micro-batches); the "
            "pipeline, called with `output_type=\"latent\"`, does not:"
        ),
        "",
        "| family | latents kept | rollout peak | pipeline peak | target: 1.3 x kept + pipeline peak |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        figures = " | ".join(f"{value / 1e6:.0f} MB" for value in (row.kept, row.rollout, row.pipeline, row.target))
        lines.append(f"| {row.family} | {figures} |")
    return lines


def table(cells: list[Cell], loads) -> list[str]:
    columns = [f"B={b}{' with CFG' if cfg else ''}" for b, cfg in loads]
    lines = [
        "| family (steps) | batch invariance | micro-batch | pipeline output | " + " | ".join(columns) + " |",
        "|---" * (len(columns) + 4) + "|",
    ]
    keys = list(dict.fromkeys((c.family, c.invariance, c.micro_batch, c.pipeline_output) for c in cells))
    keys.sort(key=lambda k: (list(STEPS).index(k[0]), list(BatchInvariance).index(k[1])))
    for key in keys:
        name, invariance, micro_batch, output = key
        row = {(c.batch_size, c.cfg): c.ratio for c in cells if (c.family, c.invariance, c.micro_batch, c.pipeline_output) == key}
        values = " | ".join(f"{row[load]:.2f}" for load in loads)
        lines.append(f"| {name} (T={STEPS[name]}) | {invariance.value} | {micro_batch} | {output} | {values} |")
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
    parser.add_argument("--micro-batch-sizes", type=int, nargs="*", default=[4], help="none: only the calibrated one")
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[1, 4, 16], help="none (and no CFG ones): only --memory")
    parser.add_argument("--cfg-batch-sizes", type=int, nargs="*", default=[16], help="batch sizes also run with CFG")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--calibrate", action="store_true", help="also the sizes a worker replica measures at start-up")
    parser.add_argument("--output", type=Path, help="write the table, with the command and machine, here")
    parser.add_argument("--families", nargs="+", choices=list(STEPS), default=list(STEPS))
    parser.add_argument("--memory", action="store_true", help="also the peak memory table (B=64, T=50, 256 px)")
    parser.add_argument(
        "--batch-invariance", nargs="+", type=BatchInvariance, default=[BatchInvariance.PADDING], help="padding, kernels"
    )
    parser.add_argument(
        "--pipeline-output", nargs="+", choices=["latent", "pt"], default=["latent"], help="the pipeline's output_types"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loads = [(b, False) for b in args.batch_sizes] + [(b, True) for b in args.cfg_batch_sizes]
    with tempfile.TemporaryDirectory() as root:
        families = build_families(Path(root), args.families)
        counts = parameter_counts(families)
        print(f"transformer parameters: {counts}")
        lines = []
        if loads:
            cells, calibrations = measure(
                families, args.micro_batch_sizes, loads, args.rounds, args.calibrate, args.batch_invariance, args.pipeline_output
            )
            lines = table(cells, loads)
            if calibrations:
                lines += ["", "Measured at a worker replica's start (`rollout.calibration.calibrate_at_start`):", "", *(f"- {c}" for c in calibrations)]
        if args.memory:
            memory = peak_memory(families, **MEMORY_LOAD)
            lines += ["", *memory_table(memory, **MEMORY_LOAD)]
    print("\n".join(lines))
    if args.output is not None:
        head = [
            f"Command: `.venv/bin/python -m benchmarks.throughput {' '.join(sys.argv[1:])}`.  ",
            (
                f"Machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} torch threads; "
                f"torch {torch.__version__}. Date: {datetime.date.today().isoformat()}.  "
            ),
            (
                f"Transformer parameters: {counts}. Rollout time / `pipeline(..., output_type=...)` time (the "
                f"table's pipeline output), median (min - max) of {args.rounds} rounds taken in turns."
            ),
            "",
        ]
        args.output.write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
