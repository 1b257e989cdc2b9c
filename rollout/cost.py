"""What a request costs: before it is sampled, in token-steps (`RequestCost`, what the ingress
limits and admits by), and after, in transformer rows (`TransformerCost`, what a response reports).

A request's cost in token-steps. A token-step is one transformer token of one sample carried
through one denoising step; a request's token-steps, from its fields and the served model's
`CostFacts` alone (no model loaded, nothing sampled):
- denoising: tokens per sample x the rows of every step (a tree's live nodes, `tree_rows`, not
  padded: the cost is the request's own, whatever it is batched with) x 2 where the options run
  classifier-free guidance's negative branch (in the same call, as SD3 does, or in a second one,
  as FLUX.1 with `true_cfg_scale`, Qwen-Image and Wan do: the transformer's work doubles either
  way);
- input images (an editing model's): each adds up to the model's `most_tokens_per_image` tokens to
  every row of its prompt's samples (`ConditionImageRule`), counted at that bound; their one
  VAE encode per prompt is not counted;
- decoding: the VAE counted by the pixels and frames it decodes, at the weight of one transformer
  step over a token grid of that size for each output frame (per sample: num_frames x
  (height / token_pixels) x (width / token_pixels)). A rough weight, not a measurement: it keeps
  the decode a small share of a request (1/T of an unguided image's denoising over T steps, a
  few times that for a video, whose frames outnumber its latent frames), never nothing.
Attention makes a step cost more than linear in tokens; the cost stays linear, so that it adds
up over samples and requests as the queue does. Its one use is to compare requests of one served
model (`RequestLimits.max_request_cost`, the app's `max_queued_cost`): a token-step of one family
is not a token-step of another in seconds.

What a request cost the transformer, in rows: both figures count rows the way
`SamplerCall.transformer_rows` does: a row is one node's place in one transformer call at one
step, padding included (classifier-free guidance's second branch,
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

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from rollout.models.base import ConditionImageRule, ImageSizeLimits, NegativeBranchRule, RolloutPipeline
from rollout.options import SamplingOptions
from rollout.sampler import micro_batch_size, resolve_options
from rollout.tree import Branching, TreeRoot, roots_of

COST_UNIT = "token-steps"


@dataclass(frozen=True)
class RequestCost:
    """A request's cost in token-steps (this module's docstring says what one is), computed once
    when it is planned, from its fields and the served model's `CostFacts`."""

    token_steps: int


@dataclass(frozen=True)
class CostFacts:
    """What costing a request needs of the served model, as data: the ingress loads no model, so a
    worker replica sends these once (`CostFacts.of` its pipeline) and the ingress costs every
    request with them.

    Attributes:
        default_height, default_width, default_num_frames, default_guidance_scale: the model's
            defaults, filled in where a request leaves the field out (`resolve_options`).
        token_pixels: the pixels a side of one transformer token covers (VAE downsampling x patch).
        frames_per_latent: the video frames a latent frame after the first stands for; 1 for an
            image model. (Every video family served takes one latent frame a token along time.)
        negative_branch: when classifier-free guidance's negative branch runs.
        condition_images: the input images a prompt takes, and the tokens each adds at most.
        image_size_limits: the heights and widths the model can make, so that the ingress refuses
            any other before it counts the request in flight (any size, for facts made by hand).
        model: the model's name, for the errors that name it.
    """

    default_height: int
    default_width: int
    default_num_frames: int
    default_guidance_scale: float
    token_pixels: int
    frames_per_latent: int
    negative_branch: NegativeBranchRule
    condition_images: ConditionImageRule = ConditionImageRule()
    image_size_limits: ImageSizeLimits = ImageSizeLimits(multiple=1)
    model: str = "the served model"

    @classmethod
    def of(cls, pipeline: RolloutPipeline) -> "CostFacts":
        return cls(
            pipeline.default_height,
            pipeline.default_width,
            pipeline.default_num_frames,
            pipeline.default_guidance_scale,
            pipeline.token_pixels,
            pipeline.frames_per_latent,
            pipeline.negative_branch,
            pipeline.condition_images,
            pipeline.image_size_limits,
            pipeline.name,
        )

    def tokens_per_sample(self, height: int, width: int, num_frames: int) -> int:
        """The transformer tokens of one sample: latent frames x token rows x token columns
        (rounded up: facts made by hand know no size limits, and cost a size not made high, not low)."""
        latent_frames = math.ceil((num_frames - 1) / self.frames_per_latent) + 1
        return latent_frames * self._token_grid(height, width)

    def request_cost(self, roots: Sequence[TreeRoot], options: SamplingOptions) -> RequestCost:
        """What sampling `roots` with `options` costs, in token-steps."""
        # The facts carry the defaults under the pipeline's attribute names: the one function that
        # fills them in fills them in here too.
        options = resolve_options(self, options)  # type: ignore[arg-type]
        tokens = self.tokens_per_sample(options.height, options.width, options.num_frames)
        branches = 2 if self.negative_branch.runs(options) else 1
        # A root's input images add their tokens to each of its rows (at most, before resizing).
        token_rows = sum(
            tree_rows([root], options, lambda rows: rows)
            * (tokens + len(root.images) * self.condition_images.most_tokens_per_image)
            for root in roots
        )
        leaves = sum(len(root.leaf_paths()) for root in roots)
        decoded = leaves * options.num_frames * self._token_grid(options.height, options.width)
        return RequestCost(token_rows * branches + decoded)

    def sample_cost(self, num_inference_steps: int) -> RequestCost:
        """The cost of one plain sample at the model's defaults: the unit of the app's default budget."""
        (root,) = roots_of([""], [""], [0], Branching())
        return self.request_cost([root], SamplingOptions(num_inference_steps=num_inference_steps))

    def _token_grid(self, height: int, width: int) -> int:
        return math.ceil(height / self.token_pixels) * math.ceil(width / self.token_pixels)


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

    leaves = sum(len(root.leaf_paths()) for root in roots)
    return TransformerCost(tree_rows(roots, options, padded), unbranched_rows(leaves, options, padded))


def tree_rows(roots: Sequence[TreeRoot], options: SamplingOptions, padded_rows: Callable[[int], int]) -> int:
    """Rows of the steps `options` take (from the resume step, if any, to the last) of `roots`
    sampled together: each step's live nodes, padded."""
    num_steps = options.num_inference_steps
    starts, stops = [0] * (num_steps + 1), [0] * (num_steps + 1)  # nodes whose steps start, stop there
    for root in roots:
        for path in _nodes(root):
            steps = root.branching.transformer_steps(path, num_steps)
            starts[steps.start] += 1
            stops[steps.stop] += 1
    rows, live = 0, 0
    for step in range(num_steps):
        live += starts[step] - stops[step]
        rows += padded_rows(live) if step >= (options.resume_step or 0) else 0
    return rows


def unbranched_rows(leaves: int, options: SamplingOptions, padded_rows: Callable[[int], int]) -> int:
    """Rows of `leaves` unbranched samples sampled together for the steps `options` take."""
    return (options.num_inference_steps - (options.resume_step or 0)) * padded_rows(leaves)


def _nodes(root: TreeRoot) -> set[tuple[int, ...]]:
    """The paths of the nodes `root` grows: the distinct prefixes of the paths of its leaves (all
    `leaves_per_root` of them, or the ones its `paths` name)."""
    return {path[:depth] for path in root.leaf_paths() for depth in range(len(path) + 1)}
