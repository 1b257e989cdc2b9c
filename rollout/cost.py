"""What a request cost the transformer, and what it would have cost unbranched.

Both figures count rows the way `SamplerCall.transformer_rows` does: a row is one node's place in
one transformer call at one step, padding included (classifier-free guidance's second branch,
computed in the same call where the family batches both, is not a row of its own).
- `transformer_rows`: at each step, the live nodes (`rollout.tree`: a root runs steps 0 .. s_1, a
  child created at s_d runs s_d + 1 .. s_{d+1}), padded to whole calls of `micro_batch_size`
  samples under padding, left as they are under batch-invariant kernels (`MicroBatching.padded_rows`).
- `transformer_rows_unbranched`: every leaf a root of its own, run for all T steps, padded by the
  same rule: T x padded(leaves). Taken from the leaves and the steps alone, never by walking the
  tree, so that a client checks what a tree saved against a figure the tree did not produce.

Attribution. A request is sampled in parts (`deployments/work.py`'s `SamplingWork`), each in one
worker call, and a worker call may hold other requests' parts too (`deployments/batching.py`).
Each part is charged its own rows, padded as if it had the call to itself, and a request's figures
are its parts' sums:
- a part alone in its call is charged exactly what the transformer computed
  (`SamplerCall.transformer_rows`; tests/test_cost.py holds the two equal);
- parts that share a call share its padding: the call computes at most the sum of their figures
  (rounding up to whole calls is subadditive), and exactly that sum where nothing is padded;
- the figures depend on the request and the server's configuration only (the model's micro-batches;
  the worker replicas and `max_batch_size`, which cut a request into parts), never on the load or on
  which requests it met: the same request reports the same figures every time.
A part sampled again after its worker replica was lost is counted once. One approximation: a part's
rows are taken as one conditioning bucket. Qwen-Image pads each prompt's text to a length bucket of
its own (`BucketedConditioning`) and runs each bucket in calls of their own; where one part's
prompts fall in several buckets, the padding of those extra calls is not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rollout.models.base import RolloutPipeline
from rollout.options import SamplingOptions
from rollout.sampler import micro_batch_size, resolve_options
from rollout.tree import TreeRoot


@dataclass(frozen=True)
class TransformerCost:
    """A request's (or a part's) transformer rows, padding included, and the rows it would have
    cost unbranched by the same padding rule; the second minus the first is what its trees saved."""

    transformer_rows: int
    transformer_rows_unbranched: int

    def __add__(self, other: "TransformerCost") -> "TransformerCost":
        return TransformerCost(
            self.transformer_rows + other.transformer_rows,
            self.transformer_rows_unbranched + other.transformer_rows_unbranched,
        )

    @classmethod
    def total(cls, costs: Iterable["TransformerCost"]) -> "TransformerCost":
        """The sum of `costs` (a request's parts'); zero for none."""
        return sum(costs, cls(0, 0))


def transformer_cost(pipeline: RolloutPipeline, roots: Sequence[TreeRoot], options: SamplingOptions) -> TransformerCost:
    """What `sample_tree(pipeline, roots, options)` costs the transformer, in calls of its own, and
    what the same leaves would cost unbranched. Its `transformer_rows` equals that call's
    `SamplerCall.transformer_rows` whenever the roots' conditioning is one bucket (every family but
    Qwen-Image, whose prompts of different text-length buckets run in calls apart)."""
    options = resolve_options(pipeline, options)
    samples_per_call = micro_batch_size(pipeline, options)

    def padded(rows: int) -> int:
        return pipeline.micro_batching.padded_rows(rows, samples_per_call)

    num_steps = options.num_inference_steps
    leaves = sum(len(root.leaf_paths()) for root in roots)
    return TransformerCost(tree_rows(roots, num_steps, padded), unbranched_rows(leaves, num_steps, padded))


def tree_rows(roots: Sequence[TreeRoot], num_steps: int, padded_rows: Callable[[int], int]) -> int:
    """Rows of `num_steps` steps of `roots` sampled together: each step's live nodes, padded."""
    nodes = [_nodes_by_depth(root) for root in roots]
    return sum(
        padded_rows(sum(by_depth[_depth_at(root, step)] for root, by_depth in zip(roots, nodes)))
        for step in range(num_steps)
    )


def unbranched_rows(leaves: int, num_steps: int, padded_rows: Callable[[int], int]) -> int:
    """Rows of `leaves` unbranched samples sampled together for `num_steps` steps."""
    return num_steps * padded_rows(leaves)


def _depth_at(root: TreeRoot, step: int) -> int:
    """The depth of `root`'s nodes the transformer runs at `step`: one more per branch step before
    it (at a branch step the velocity is the parent's, computed once for all its children)."""
    return sum(branch_step < step for branch_step in root.branching.steps)


def _nodes_by_depth(root: TreeRoot) -> list[int]:
    """The nodes `root` grows at each depth, 0 (the root) to m (its leaves): the distinct prefixes
    of the paths it grows (all `leaves_per_root` leaves, or the ones its `paths` name)."""
    paths = root.leaf_paths()
    return [len({path[:depth] for path in paths}) for depth in range(len(root.branching.steps) + 1)]
