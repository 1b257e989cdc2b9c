"""Tree rollouts: the leaves of a root share its prefix and branch at chosen steps.

A request with branch steps s_1 < ... < s_m and factors f_1, ..., f_m grows each root into
L = f_1 x ... x f_m leaves: the root's trajectory runs alone up to x_{s_1}; there its velocity is
computed once, and each of its f_1 children draws its own noise for the transition
x_{s_1} -> x_{s_1 + 1}; every child does the same at s_2, and so on. A node is a partial trajectory:
the root owns x_0 .. x_{s_1} and the transitions before s_1, a child created at s_d owns the
transitions s_d .. s_{d+1} - 1 and the latents after them. A leaf's trajectory is its nodes' in
order, and reads as any sample's (`SampleTrajectory`), with its `branch_path` (c_1, ..., c_m), its
child index at each branch step.

How each node's noise is drawn, so that the same request gives the same bits and a leaf can be
regenerated alone:
- A root's leaves are L consecutive samples of the request, with consecutive seeds; the root's seed
  is its first leaf's. The leaf with path (c_1, ..., c_m) is the root's leaf number
  `offset = sum_d c_d * (f_{d+1} x ... x f_m)`, and its seed is the root's seed plus its offset.
- Every node draws from one CPU generator. The root's is seeded with the root's seed and draws what
  an unbranched sample draws: its initial noise, then one draw per stochastic step. At a branch
  step, child 0 keeps its parent's generator (the parent's first leaf is child 0's first leaf), and
  child c > 0 starts one seeded with its own first leaf's seed; either way the child's next draw is
  the noise of its branch step's transition.
- So a leaf's noise comes from the generators seeded `branch_seeds(root_seed, path)`: one per
  segment of its path, the same seed again where a child 0 kept its parent's generator. Its root's
  seed is its seed minus its offset; with its path and the branching, that is all it takes to grow
  it alone (`TreeRoot.of_leaf`).
- With no branch steps a root is one leaf, and draws exactly what an unbranched sample draws.

Cost: the transformer runs once per node and step owned, `sum over nodes of the steps it runs`: a
root runs steps 0 .. s_1, a child created at s_d runs s_d + 1 .. s_{d+1} (its velocity at s_{d+1}
is computed once for all its children). For one branch into 16 at step 4 of 10 steps, that is
5 + 16 x 5 = 85 rows per root instead of 16 x 10 = 160.

A comb (`BranchShape.COMB`, TempFlow-GRPO's rollout) is a tree whose leaves stop at different
depths. Its spine runs every step by ODE; at each branch step s_d it grows K_d children (the
factors, each >= 1) that take one stochastic step from the spine's x_{s_d} with the spine's
velocity there, never branch again, and finish by ODE. The spine is child 0 at every branch step
and a leaf itself, path (0, ..., 0); the k-th child of s_d (k >= 1) is the leaf (0, ..., 0, k) of
length d. The root's L = 1 + K_1 + ... + K_m leaves are numbered spine first, then s_1's children,
s_2's, ...: the leaf (0, ..., 0, k) of length d is number 1 + K_1 + ... + K_{d-1} + k - 1. Seeds
follow the rule above: the spine keeps the root's generator, each child starts one seeded with its
own seed, whose one draw is its stochastic step's noise. The spine runs T rows, a child of s_d
T - 1 - s_d; one request per branch step instead would recompute the spine up to s_d each time.

Resuming (`SamplingOptions.resume_step` s, each root's `resume_latents` x_s): a root's generators
are a function of its seed, its branching and the options' steps before s, so a resumed call
makes those steps' branches and draws again without the model and starts the loop at s from the
given latent; with the options that sampled it, a leaf comes back bit for bit from s on.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from rollout.errors import InvalidRequestError, short_repr
from rollout.options import SamplingOptions
from rollout.transitions import TransitionKind

if TYPE_CHECKING:
    from rollout.input_images import InputImage

STEPS_FIELD = "rollout_branch_steps"
FACTORS_FIELD = "rollout_branch_factors"
NOISE_SCALES_FIELD = "rollout_branch_noise_scales"
LOG_PROB_STD_FIELD = "rollout_branch_log_prob_std"
SHAPE_FIELD = "rollout_branch_shape"
RESUME_LATENTS_FIELD = "rollout_resume_latents"
RESUME_PATHS_FIELD = "rollout_resume_branch_paths"
# The largest noise scale of a branch step: BranchGRPO's scripts use 4; past this a child's latents
# are noise, not an exploration around its parent's mean.
MAX_NOISE_SCALE = 100.0


class BranchShape(str, enum.Enum):
    """How a root's nodes branch (this module's docstring)."""

    TREE = "tree"  # every node at a branch step branches, every leaf is as deep as the branch steps
    COMB = "comb"  # an ODE spine; each branch step's children take one stochastic step and finish by ODE


class BranchLogProbStd(str, enum.Enum):
    """The std in the log-prob of a branch step whose noise is scaled (`Branching.noise_scales`)."""

    SCALED = "scaled"  # the std the children's noise was drawn with: the log-prob of what was sampled
    NOMINAL = "nominal"  # the step's own std, unscaled (BranchGRPO's): off-policy where the scale is not 1


@dataclass(frozen=True)
class Branching:
    """Where a root branches and into how many children: the same for every root of a request.

    Attributes:
        steps: the branch steps, strictly increasing (absolute step indices).
        factors: children per node at each branch step, each >= 2; a comb's stochastic children
            of the spine at each, each >= 1.
        noise_scales: per branch step, the factor on the noise each child draws there (BranchGRPO's
            `tree_split_noise_scale`, Dynamic-TreeRPO's per-layer noise levels); () for 1 at each.
        log_prob_std: the std the log-prob of a scaled branch step takes (`BranchLogProbStd`).
        shape: a tree or a comb (`BranchShape`).
    """

    steps: tuple[int, ...] = ()
    factors: tuple[int, ...] = ()
    noise_scales: tuple[float, ...] = ()
    log_prob_std: BranchLogProbStd = BranchLogProbStd.SCALED
    shape: BranchShape = BranchShape.TREE

    def __post_init__(self):
        for field, values in ((STEPS_FIELD, self.steps), (FACTORS_FIELD, self.factors)):
            if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
                raise InvalidRequestError(field, f"must be a list of integers, got {short_repr(values)}")
            if any(isinstance(v, bool) or not isinstance(v, int) for v in values):
                raise InvalidRequestError(field, f"must contain integers, got {short_repr(list(values))}")
        object.__setattr__(self, "steps", tuple(self.steps))
        object.__setattr__(self, "factors", tuple(self.factors))
        if len(self.factors) != len(self.steps):
            raise InvalidRequestError(
                FACTORS_FIELD,
                f"needs one factor per branch step: {len(self.factors)} factors for {len(self.steps)} steps",
            )
        if any(step < 0 for step in self.steps) or any(b <= a for a, b in zip(self.steps, self.steps[1:])):
            raise InvalidRequestError(STEPS_FIELD, f"must be strictly increasing steps >= 0, got {list(self.steps)}")
        try:
            object.__setattr__(self, "shape", BranchShape(self.shape))
        except ValueError:
            choices = [member.value for member in BranchShape]
            raise InvalidRequestError(SHAPE_FIELD, f"must be one of {choices}, got {short_repr(self.shape)}") from None
        least = 1 if self.is_comb else 2
        if any(factor < least for factor in self.factors):
            what = "a comb's children of each branch step" if self.is_comb else "each"
            raise InvalidRequestError(FACTORS_FIELD, f"{what} must be >= {least}, got {list(self.factors)}")
        self._check_noise_scales()

    def _check_noise_scales(self) -> None:
        scales = self.noise_scales
        if isinstance(scales, (str, bytes)) or not hasattr(scales, "__iter__"):
            raise InvalidRequestError(NOISE_SCALES_FIELD, f"must be a list of numbers, got {short_repr(scales)}")
        scales = tuple(scales)
        if scales and len(scales) != len(self.steps):  # by its length first: a long list is refused unread
            raise InvalidRequestError(
                NOISE_SCALES_FIELD, f"needs one scale per branch step: {len(scales)} scales for {len(self.steps)} steps"
            )
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= MAX_NOISE_SCALE for v in scales):
            raise InvalidRequestError(NOISE_SCALES_FIELD, f"each must be a number in (0, {MAX_NOISE_SCALE}], got {short_repr(list(scales))}")
        try:
            log_prob_std = BranchLogProbStd(self.log_prob_std)
        except ValueError:
            choices = [member.value for member in BranchLogProbStd]
            raise InvalidRequestError(LOG_PROB_STD_FIELD, f"must be one of {choices}, got {short_repr(self.log_prob_std)}") from None
        # All ones is no scaling, whichever std the log-prob would take: one value for it, so that
        # equal trees compare equal (a dataset records the fields only where a scale is not 1).
        if all(v == 1 for v in scales):
            scales, log_prob_std = (), BranchLogProbStd.SCALED
        object.__setattr__(self, "noise_scales", tuple(float(v) for v in scales))
        object.__setattr__(self, "log_prob_std", log_prob_std)

    def noise_scale_at(self, step: int) -> float:
        """The factor on the noise a child draws at `step` (1 where `step` is not a branch step)."""
        if not self.noise_scales or step not in self.steps:
            return 1.0
        return self.noise_scales[self.steps.index(step)]

    def log_prob_std_scale_at(self, step: int) -> float:
        """The factor on the step's std in the log-prob of a transition at `step`: its noise scale
        where the log-prob takes the scaled std, else 1."""
        return self.noise_scale_at(step) if self.log_prob_std is BranchLogProbStd.SCALED else 1.0

    def __bool__(self) -> bool:
        return bool(self.steps)

    @property
    def is_comb(self) -> bool:
        return self.shape is BranchShape.COMB

    @property
    def leaves_per_root(self) -> int:
        return 1 + sum(self.factors) if self.is_comb else math.prod(self.factors)

    @property
    def leaves_rule(self) -> str:
        """`leaves_per_root` in words, for the errors that name it."""
        if self.is_comb:
            return f"1 + the sum of {FACTORS_FIELD}, a comb's spine and children ({self.leaves_per_root})"
        return f"the product of {FACTORS_FIELD} ({self.leaves_per_root})"

    def check(self, options: SamplingOptions) -> None:
        """Raises `InvalidRequestError` naming ``rollout_branch_steps`` unless every branch step is a
        stochastic step of a request with `options`: children that drew no noise would be copies."""
        last = options.num_inference_steps - 1
        for step in self.steps:
            if step > last:
                raise InvalidRequestError(
                    STEPS_FIELD,
                    f"step {step} is out of range [0, {last}] of num_inference_steps {options.num_inference_steps}",
                )
            kind = options.transition_at(step)
            if kind is TransitionKind.ODE:
                window = "" if options.sde_step_indices is None else f" (rollout_sde_step_indices {list(options.sde_step_indices)})"
                raise InvalidRequestError(
                    STEPS_FIELD, f"step {step} is a deterministic (ode) step of this request{window}: a branch needs a stochastic step"
                )
            if options.noise_level == 0 or (kind is TransitionKind.CPS and step == last):
                raise InvalidRequestError(
                    STEPS_FIELD,
                    f"step {step} draws noise with a standard deviation of 0 here (rollout_noise_level "
                    f"{options.noise_level}, {kind.value}): its children would be copies",
                )

    def transition_at(self, options: SamplingOptions, step: int, path: Sequence[int]) -> TransitionKind:
        """The transition a node at `path` (or any leaf below it) takes at `step`: the request's
        (`SamplingOptions.transition_at`) in a tree; in a comb, that at a child's branch step and
        an ODE step everywhere else (the spine, and every child's tail)."""
        if not self.is_comb:
            return options.transition_at(step)
        if self._is_comb_child(path) and step == self.steps[len(path) - 1]:
            return options.transition_at(step)
        return TransitionKind.ODE

    def _is_comb_child(self, path: Sequence[int]) -> bool:
        """Whether the node at `path` is one of a comb's stochastic children, not on its spine."""
        return self.is_comb and bool(path) and path[-1] != 0

    def branches_below(self, path: Sequence[int]) -> bool:
        """Whether the node at `path` has children: in a tree, every node above the leaves; in a comb,
        the spine's nodes above its last branch step."""
        return len(path) < len(self.steps) and not self._is_comb_child(path)

    def offset(self, path: Sequence[int]) -> int:
        """The leaf number, among its root's leaves, of the first leaf below the node at `path`."""
        if self.is_comb:
            if not self._is_comb_child(path):
                return 0  # the spine's nodes: the spine is leaf 0
            return 1 + sum(self.factors[: len(path) - 1]) + path[-1] - 1
        return sum(child * math.prod(self.factors[depth + 1 :]) for depth, child in enumerate(path))

    def path_of(self, offset: int) -> tuple[int, ...]:
        """The path of the root's leaf number `offset`."""
        if self.is_comb:
            if offset == 0:
                return (0,) * len(self.steps)
            for depth, factor in enumerate(self.factors):
                if offset <= factor:
                    return (0,) * depth + (offset,)
                offset -= factor
            raise ValueError(f"a root of this comb has {self.leaves_per_root} leaves")
        return tuple((offset // math.prod(self.factors[depth + 1 :])) % factor for depth, factor in enumerate(self.factors))

    def check_path(self, path: Sequence[int]) -> tuple[int, ...]:
        path = tuple(path)
        if self.is_comb:
            spine = (0,) * len(self.steps)
            valid = path == spine or (
                0 < len(path) <= len(self.steps)
                and path[:-1] == spine[: len(path) - 1]
                and not isinstance(path[-1], bool)
                and isinstance(path[-1], int)
                and 1 <= path[-1] <= self.factors[len(path) - 1]
            )
            if not valid:
                raise InvalidRequestError(
                    "branch_path",
                    f"must be a comb's leaf: the spine {list(spine)}, or zeros then k in [1, K_d] ending at branch step d, "
                    f"for factors {list(self.factors)}; got {short_repr(path)}",
                )
            return path
        if len(path) != len(self.factors) or any(
            isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < f for c, f in zip(path, self.factors)
        ):
            raise InvalidRequestError(
                "branch_path", f"must be one child index per branch step, below factors {list(self.factors)}, got {short_repr(path)}"
            )
        return path

    def owned_steps(self, path: Sequence[int], num_steps: int) -> range:
        """The transitions the node at `path` owns (() for a root): its log-probs' and debug
        tensors' steps. A comb's child owns its stochastic step and its whole ODE tail."""
        bounds = (0, *self.steps, num_steps)
        depth = len(path)
        if self._is_comb_child(path):
            return range(bounds[depth], num_steps)
        return range(bounds[depth], bounds[depth + 1])

    def owns_latent(self, path: Sequence[int], step: int, num_steps: int) -> bool:
        """Whether latent x_step is the node at `path`'s: a root's are x_0 .. x_{s_1}, a child's
        those after the transitions it owns."""
        owned = self.owned_steps(path, num_steps)
        return owned.start < step <= owned.stop or step == 0 == len(path)

    def transformer_steps(self, path: Sequence[int], num_steps: int) -> range:
        """The steps at which the transformer computes the node at `path`'s velocity: those it owns
        but a child's first (its parent's velocity, computed once for all its children), and the
        branch step where its own children start."""
        owned = self.owned_steps(path, num_steps)
        first = owned.start if not path else owned.start + 1
        last = owned.stop if self.branches_below(path) else owned.stop - 1
        return range(first, last + 1)

    def depth_at(self, step: int) -> int:
        """How many branch steps come before `step`: the length of the path of the node that holds
        latent x_step (a comb child's whole path where it is shorter)."""
        return sum(branch_step < step for branch_step in self.steps)

    def leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        """The paths of a root's `leaves_per_root` leaves, in leaf-number order."""
        return tuple(self.path_of(offset) for offset in range(self.leaves_per_root))

    def leaves_below(self, node: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """The paths of the leaves below the node at `node` (the node itself where it is a leaf), in
        leaf-number order; () is the root, whose leaves are all of them."""
        node = tuple(node)
        return tuple(path for path in self.leaf_paths() if path[: len(node)] == node)

    def check_node_at(self, node: Sequence[int], step: int, field: str = RESUME_PATHS_FIELD) -> tuple[int, ...]:
        """`node` as a path, raising `InvalidRequestError` naming `field` unless it is the path of a
        node that holds latent x_step: a leaf's path cut at `depth_at(step)`."""
        if isinstance(node, (str, bytes)) or not hasattr(node, "__iter__"):
            raise InvalidRequestError(field, f"must be a list of child indices, got {short_repr(node)}")
        node = tuple(node)
        depth = self.depth_at(step)
        nodes = {path[:depth] for path in self.leaf_paths()}
        if node not in nodes:
            raise InvalidRequestError(
                field,
                f"must be the path of a node at step {step}: one child index for each of the {depth} branch steps "
                f"before it (a comb's child ends at its own), for factors {list(self.factors)}; got {short_repr(node)}",
            )
        return node

    def branch_seeds(self, root_seed: int, path: Sequence[int]) -> tuple[int, ...]:
        """The seeds of the generators a leaf's noise came from: the root's, then after each branch
        step its node's (equal to the one before where a child 0 kept its parent's generator)."""
        return tuple(root_seed + self.offset(path[:depth]) for depth in range(len(path) + 1))


@dataclass(frozen=True)
class TreeRoot:
    """One root to grow, and which of its leaves (all of them by default).

    Attributes:
        seed: the root's seed, its first leaf's.
        paths: the leaves to grow, as branch paths, in the order to return them; None: every leaf,
            in order (leaf number 0 .. L - 1).
        images: its prompt's input images (an image-conditioned model's), the same tuple for every
            root of the prompt; () for a text prompt.
        resume_latents: in a resumed request (`SamplingOptions.resume_step`), the latent x_s at
            that step of the node its leaves share there: where it starts.
    """

    prompt: str
    negative_prompt: str
    seed: int
    branching: Branching = Branching()
    paths: tuple[tuple[int, ...], ...] | None = None
    images: tuple[InputImage, ...] = ()
    resume_latents: torch.Tensor | None = field(default=None, compare=False)

    def leaf_paths(self) -> tuple[tuple[int, ...], ...]:
        if self.paths is None:
            return self.branching.leaf_paths()
        return tuple(self.branching.check_path(path) for path in self.paths)

    @classmethod
    def of_leaf(cls, leaf) -> "TreeRoot":
        """The root that grows `leaf` (a `SampleTrajectory`) alone: the same bits as in its tree."""
        return cls(
            leaf.prompt,
            leaf.negative_prompt,
            leaf.root_seed,
            leaf.branching,
            paths=(leaf.branch_path,),
            images=leaf.condition_images,
        )

    @classmethod
    def resumed_from(cls, leaf, step: int) -> "TreeRoot":
        """The root that grows `leaf` (a `SampleTrajectory`) alone from its latent at `step`, in a
        request with `SamplingOptions.resume_step` `step`: with the leaf's own options, the same
        bits from there on."""
        kept = leaf.latent_step_indices.tolist()
        if step not in kept:
            raise InvalidRequestError("rollout_resume_step", f"the leaf keeps no latent at step {step} (it keeps {kept})")
        return dataclasses.replace(cls.of_leaf(leaf), resume_latents=leaf.latents[kept.index(step)])

    def leaves_at(self, step: int) -> tuple[int, ...]:
        """The path of the node whose latent x_step all its leaves share: raises
        `InvalidRequestError` naming ``branch_path`` where they part before it."""
        depth = self.branching.depth_at(step)
        prefixes = {path[:depth] for path in self.leaf_paths()}
        if len(prefixes) > 1:
            raise InvalidRequestError(
                "branch_path",
                f"a resumed root grows leaves of one node at step {step}, these part before it: {sorted(prefixes)} "
                f"(over HTTP, {RESUME_PATHS_FIELD} names the node)",
            )
        return prefixes.pop()


def check_resume_latent(latent: torch.Tensor, latent_shape: tuple[int, ...]) -> None:
    """Raises `InvalidRequestError` naming ``rollout_resume_latents`` unless `latent` is one the
    model can resume from: fp32, of its latent shape for the request's size, and finite."""
    if tuple(latent.shape) != tuple(latent_shape) or latent.dtype != torch.float32:
        raise InvalidRequestError(
            RESUME_LATENTS_FIELD,
            f"must be float32 latents of shape {list(latent_shape)} for this size, got {list(latent.shape)} {latent.dtype}",
        )
    if not torch.isfinite(latent).all():
        raise InvalidRequestError(RESUME_LATENTS_FIELD, "must be finite: a latent holds NaN or infinite values")


def roots_of(
    prompts: Sequence[str],
    negative_prompts: Sequence[str],
    seeds: Sequence[int],
    branching: Branching,
    images: Sequence[tuple[InputImage, ...]] | None = None,
    resume_latents: Sequence[torch.Tensor] | None = None,
    resume_nodes: Sequence[tuple[int, ...]] | None = None,
) -> list[TreeRoot]:
    """A request's samples (leaves, request order) as its roots. Each sample comes with its prompt,
    its input `images` (one tuple per sample, shared by a prompt's samples; None: no images), and
    in a resumed request its latent at the resume step and the path of the node it resumes
    (likewise; None: the root, ()). A root is a block of consecutive samples: the leaves below its
    node (`Branching.leaves_below`), one prompt, and the seeds of those leaves, `root seed +
    Branching.offset(leaf)` (consecutive where the node is the root)."""
    images = [()] * len(seeds) if images is None else images
    roots, start = [], 0
    while start < len(seeds):
        node = () if resume_nodes is None else tuple(resume_nodes[start])
        leaves = branching.leaves_below(node)
        block = range(start, start + len(leaves))
        if block.stop > len(seeds):
            rule = f"the {len(leaves)} leaves below the node {list(node)}" if node else branching.leaves_rule
            raise InvalidRequestError("num_outputs_per_prompt", f"must be a multiple of {rule}: {len(seeds)} samples")
        if any(
            prompts[i] != prompts[start] or negative_prompts[i] != negative_prompts[start] or images[i] != images[start]
            for i in block
        ):
            raise InvalidRequestError(
                "prompt", f"the {len(leaves)} samples of a root need one prompt, negative prompt and input images"
            )
        root_seed = seeds[start] - branching.offset(leaves[0])
        if any(seeds[i] != root_seed + branching.offset(leaf) for i, leaf in zip(block, leaves)):
            raise InvalidRequestError(
                "seed", f"the {len(leaves)} samples of a root need its leaves' seeds: its own plus each leaf's number among them"
            )
        resume = None if resume_latents is None else resume_latents[start]
        paths = None if node == () else leaves
        roots.append(
            TreeRoot(prompts[start], negative_prompts[start], root_seed, branching, paths, images[start], resume_latents=resume)
        )
        start = block.stop
    return roots


class RootedSamples:
    """What a request's plan and each part of it sent to a worker share: one entry per sample, in
    request order (see `roots_of`), and `roots()`, the roots those samples grow."""

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    branching: Branching
    images: tuple[tuple[InputImage, ...], ...]
    resume_latents: tuple[torch.Tensor, ...]
    resume_nodes: tuple[tuple[int, ...], ...]

    def roots(self) -> list[TreeRoot]:
        return roots_of(
            self.prompts,
            self.negative_prompts,
            self.seeds,
            self.branching,
            self.images or None,
            self.resume_latents or None,
            self.resume_nodes or None,
        )
