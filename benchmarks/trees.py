"""Tree rollouts against the same request unbranched: transformer rows and wall time (issue 19).

    .venv/bin/python -m benchmarks.trees              # the library, 5 rounds
    .venv/bin/python -m benchmarks                    # the suite runs it, with the handle path too
    .venv/bin/python -m benchmarks.trees --picture docs/tree_rollout.png   # draws a small tree instead

8 prompts x 16 outputs of the embedded model, 10 steps, the SDE window steps 4 and 5 (the others
ODE), kept latents x_4 .. x_6 as a trainer of that window asks: unbranched (16 roots a prompt),
one branch at step 4 into 16 (1 root a prompt: 5 + 16 x 5 = 85 rows instead of 160), and two
levels, 4 x 4 at steps 4 and 5 (5 + 4 x 1 + 16 x 4 = 73). The requests take turns, round by round,
after a warm-up each. The target: the wall-time ratio to unbranched within 15% of the row ratio.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks.serving import Spread, take_turns
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample_tree
from rollout.tree import Branching, TreeRoot, roots_of

PROMPTS, OUTPUTS, STEPS, WINDOW = 8, 16, 10, (4, 5)
OPTIONS = SamplingOptions(num_inference_steps=STEPS, sde_step_indices=WINDOW, return_step_indices=(4, 5, 6))
TREES = {
    "unbranched": Branching(),
    "one branch at step 4 into 16": Branching((4,), (16,)),
    "4 x 4 at steps 4 and 5": Branching((4, 5), (4, 4)),
}


def request_fields(branching: Branching) -> dict:
    """The same request as a body for `/rollout/generate` or the handle."""
    fields = {
        "prompt": [str(d) for d in range(PROMPTS)],
        "num_outputs_per_prompt": OUTPUTS,
        "num_inference_steps": STEPS,
        "seed": 0,
        "rollout_sde_step_indices": list(WINDOW),
        "rollout_return_step_indices": list(OPTIONS.return_step_indices),
        "rollout_debug_mode": False,
    }
    if branching:
        fields.update(rollout_branch_steps=list(branching.steps), rollout_branch_factors=list(branching.factors))
    return fields


def roots(branching: Branching) -> list[TreeRoot]:
    prompts = [str(d) for d in range(PROMPTS) for _ in range(OUTPUTS)]
    return roots_of(prompts, [""] * len(prompts), list(range(len(prompts))), branching)


@dataclass(frozen=True)
class TreeFigures:
    name: str
    rows: int
    seconds: Spread
    row_ratio: float
    time_ratio: Spread

    @property
    def within_target(self) -> bool:
        return abs(self.time_ratio.median - self.row_ratio) <= 0.15 * self.row_ratio


def measure(runs: dict[str, Callable[[], object]], rows: dict[str, int], rounds: int) -> list[TreeFigures]:
    """`runs` by tree name, timed in turns; ratios against "unbranched"."""
    times = take_turns(runs, rounds)
    base = times["unbranched"]
    return [
        TreeFigures(
            name,
            rows[name],
            Spread(tuple(series)),
            rows[name] / rows["unbranched"],
            Spread(tuple(t / b for t, b in zip(series, base))),
        )
        for name, series in times.items()
    ]


def library_runs() -> tuple[dict[str, Callable[[], object]], dict[str, int]]:
    pipeline = load_pipeline(device="cpu")
    runs = {name: (lambda b=branching: sample_tree(pipeline, roots(b), OPTIONS)) for name, branching in TREES.items()}
    rows = {name: sample_tree(pipeline, roots(branching), OPTIONS).transformer_rows for name, branching in TREES.items()}
    return runs, rows


def table(figures: list[TreeFigures], path: str) -> list[str]:
    lines = [
        "| path | tree | transformer rows | rows / unbranched | wall time (s) | time / unbranched | within 15% of the row ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in figures:
        lines.append(
            f"| {path} | {f.name} | {f.rows} | {f.row_ratio:.3f} | {f.seconds} | {f.time_ratio} | "
            f"{'yes' if f.within_target else 'no'} |"
        )
    return lines


def picture(path: Path) -> None:
    """A tree of the embedded model drawn as it was sampled: one root of "3", branching at steps 3
    and 6 of 10 (2 x 3 leaves), each node a line over the steps it owns, each leaf's image at its end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    branching, steps = Branching((3, 6), (2, 3)), 10
    batch = sample_tree(load_pipeline(device="cpu"), [TreeRoot("3", "", 7, branching)], SamplingOptions(num_inference_steps=steps)).batch
    leaves = len(batch.samples)
    figure, axis = plt.subplots(figsize=(8, 3.6))
    height = {}  # a node's vertical place: the mean of its leaves'
    for node in reversed(batch.tree()):
        height[node.path] = sum(leaves - 1 - leaf for leaf in node.leaves) / len(node.leaves)
    for node in batch.tree():
        start, end = node.steps.start, node.steps.stop
        y = height[node.path]
        if node.path:  # joined to its parent at its branch step
            axis.plot([start, start], [height[node.path[:-1]], y], color="0.5", linewidth=1)
        axis.plot([start, end], [y, y], color="tab:blue", linewidth=2)
        label = "root" if not node.path else f"child {node.path[-1]}"
        axis.text((start + end) / 2, y + 0.12, label, ha="center", fontsize=7)
    for leaf, sample in enumerate(batch.samples):
        y = leaves - 1 - leaf
        axis.imshow(sample.image[0].numpy(), cmap="gray_r", extent=(steps + 0.2, steps + 1.0, y - 0.4, y + 0.4))
        axis.text(steps + 1.1, y, f"path {list(sample.branch_path)}, seeds {list(branching.branch_seeds(7, sample.branch_path))}", va="center", fontsize=7)
    for step in branching.steps:
        axis.axvline(step, color="tab:orange", linestyle=":", linewidth=1)
    axis.set_xlim(-0.3, steps + 4.5)
    axis.set_ylim(-0.7, leaves - 0.3)
    axis.set_xticks(range(steps + 1))
    axis.set_yticks([])
    axis.set_xlabel("step (branch steps dotted): a node owns the transitions along its line")
    figure.suptitle('One root of "3": rollout_branch_steps [3, 6], rollout_branch_factors [2, 3], seed 7')
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--picture", type=Path, help="draw a small tree of the embedded model here, and measure nothing")
    args = parser.parse_args()
    if args.picture is not None:
        return picture(args.picture)
    torch.set_num_threads(args.threads)
    runs, rows = library_runs()
    print("\n".join(table(measure(runs, rows, args.rounds), "library")))


if __name__ == "__main__":
    main()
