"""Why the trainer must not re-derive the schedule: `timesteps / 1000` against the returned sigmas.

For the real families' schedulers (as their pipelines set them) and step counts 1..100, counts
the steps where sigmas rebuilt as `timesteps / 1000` (in fp32, and with timesteps in bf16)
differ from the scheduler's own, and the log-prob error that causes: an SDE step sampled with
the returned sigmas, scored with the rebuilt ones, on 16x64x64 latents (what a 512x512 image
has). Scored with the returned sigmas, the error is 0 by construction (the same function, the
same inputs), which the last column checks.

    .venv/bin/python -m benchmarks.schedule_exactness   # writes docs/schedule_exactness.md and .png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from rollout.schedule import ScheduleSnapshot, timesteps_as_they_are
from rollout.transitions import TransitionKind, take_step

SD3 = {"shift": 3.0}
FLUX = {"shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15,
        "base_image_seq_len": 256, "max_image_seq_len": 4096}  # fmt: skip
QWEN = {"shift": 1.0, "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256,
        "max_image_seq_len": 8192, "shift_terminal": 0.02, "time_shift_type": "exponential"}  # fmt: skip
SCHEDULES = {  # name -> (scheduler config, image tokens for dynamic shifting, or None)
    "SD3/SD3.5 (shift 3)": (SD3, None),
    "FLUX.1 512x512": (FLUX, 1024),
    "FLUX.1 1024x1024": (FLUX, 4096),
    "Qwen-Image 1024x1024": (QWEN, 4096),
}
STEP_COUNTS = range(1, 101)
TABLE_STEPS = (1, 2, 4, 10, 20, 28, 50, 100)


def schedule(config: dict, tokens: int | None, steps: int) -> ScheduleSnapshot:
    """The family's schedule; the time input is the family's in fp32 (only the sigmas are studied here)."""
    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    if tokens is None:  # SD3: static shift, timesteps as they are
        return ScheduleSnapshot.from_scheduler(scheduler, steps, model_timesteps=timesteps_as_they_are)
    mu = calculate_shift(tokens, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"], config["max_shift"])
    sigmas = np.linspace(1.0, 1 / steps, steps)
    # FLUX.1 and Qwen-Image: dynamic shifting, and a time input of timesteps / 1000
    return ScheduleSnapshot.from_scheduler(scheduler, steps, sigmas=sigmas, mu=mu, model_timesteps=lambda t: t / 1000)


def rebuilt_sigmas(snapshot: ScheduleSnapshot, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([(snapshot.timesteps.to(dtype) / 1000).float(), torch.zeros(1)])


def max_log_prob_error(snapshot: ScheduleSnapshot, sigmas: torch.Tensor, generator: torch.Generator) -> float:
    """Largest |log-prob difference| over the steps: sampled with the snapshot, scored with `sigmas`."""
    worst = 0.0
    for step in range(snapshot.num_steps):
        x_t, v, noise = (torch.randn((1, 16, 64, 64), generator=generator) for _ in range(3))
        true = snapshot.sigmas
        sampled = take_step(TransitionKind.SDE, x_t, v, true[step], true[step + 1], eta=0.7,
                            sigma_after_one=true[1], noise=noise)  # fmt: skip
        scored = take_step(TransitionKind.SDE, x_t, v, sigmas[step], sigmas[step + 1], eta=0.7,
                           sigma_after_one=sigmas[1], x_next=sampled.x_next)  # fmt: skip
        worst = max(worst, (scored.log_prob - sampled.log_prob).abs().max().item())
    return worst


def measure() -> tuple[list[dict], dict[str, dict[str, list[float]]]]:
    """The table's rows (at `TABLE_STEPS`) and, per schedule, the plotted series over `STEP_COUNTS`."""
    generator = torch.Generator().manual_seed(0)
    figures: dict[str, dict[str, list[float]]] = {}
    rows = []
    for name, (config, tokens) in SCHEDULES.items():
        series = figures[name] = {"fp32": [], "bf16": []}
        for steps in STEP_COUNTS:
            snapshot = schedule(config, tokens, steps)
            row = {"schedule": name, "steps": steps}
            for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                rebuilt = rebuilt_sigmas(snapshot, dtype)
                differing = int((rebuilt[:-1] != snapshot.sigmas[:-1]).sum())
                series[label].append(differing / steps)
                row[label] = f"{differing}/{steps}"
                if steps in TABLE_STEPS:
                    row[f"dlogp_{label}"] = max_log_prob_error(snapshot, rebuilt, generator)
            if steps in TABLE_STEPS:
                row["dlogp_returned"] = max_log_prob_error(snapshot, snapshot.sigmas, generator)
                rows.append(row)
    return rows, figures


def table(rows: list[dict]) -> list[str]:
    lines = [
        "Steps whose rebuilt sigma differs from the scheduler's, and the largest |log-prob error| of an",
        "SDE step (eta 0.7, 16x64x64 latents) scored with rebuilt sigmas; with the returned sigmas it is 0.",
        "",
        "| schedule | steps | differ, fp32 | differ, bf16 | max dlogp, fp32 | max dlogp, bf16 | max dlogp, returned sigmas |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['schedule']} | {row['steps']} | {row['fp32']} | {row['bf16']} | {row['dlogp_fp32']:.2e} "
            f"| {row['dlogp_bf16']:.2e} | {row['dlogp_returned']:.1f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("docs/schedule_exactness.md"))
    args = parser.parse_args()
    rows, figures = measure()
    lines = [
        "# Schedule exactness: `timesteps / 1000` against the returned sigmas",
        "",
        f"Command: `.venv/bin/python -m benchmarks.schedule_exactness`. Torch {torch.__version__}.",
        *table(rows),
        "",
        f"![fraction of steps that differ]({args.output.with_suffix('.png').name})",
        "",
    ]
    args.output.write_text("\n".join(lines))
    plot(figures, args.output.with_suffix(".png"))
    print("\n".join(lines))


def plot(figures: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for axis, label in zip(axes, ("fp32", "bf16")):
        for name, series in figures.items():
            axis.plot(list(STEP_COUNTS), series[label], label=name)
        axis.set_title(f"timesteps / 1000 in {label}")
        axis.set_xlabel("denoising steps T")
    axes[0].set_ylabel("fraction of steps whose sigma differs")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
