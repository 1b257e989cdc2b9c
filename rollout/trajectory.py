"""What a rollout returns: per-sample trajectories beside the per-request data they share.

Per-sample data (latents, log-probs, seed, image) lives in `SampleTrajectory`; per-request data
(the schedule, the options) lives once in `RolloutBatch`; in a tree rollout (`rollout.tree`),
what a node's leaves share (the prefix's latents, log-probs and debug tensors) is a `TreeNode`'s,
between the two. No code ever has to guess from a tensor's shape which kind it holds. Each sample
refers to its request's one `ScheduleSnapshot` object; pickling keeps that sharing, so the
schedule crosses a process boundary once and the samples still refer to one object on the other
side.

A batch crosses a process boundary with each tensor field stacked over its samples into one
numpy array (the sampler's own buffer, uncopied, when the samples are its consecutive rows): Ray's
object store carries numpy buffers out of band, so the receiver maps them without a copy, and the
samples' tensors are views of them (read-only in spirit: they share the object store's memory;
`clone()` a tensor before changing it in place). A tree's leaves cross as their nodes, each node's
tensors once, stacked over the nodes of equal shapes; on the other side each leaf's tensors are
joined from its path's nodes.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from rollout.errors import CodecError, NonFiniteOutputError, short_repr
from rollout.input_images import InputImage
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot
from rollout.tree import Branching


@dataclass(frozen=True)
class StepDebug:
    """One sample's per-step internals, each stacked over the T steps, fp32.

    Attributes:
        model_outputs: `(T, ...)` velocity used at each step, after guidance.
        prev_sample_means: `(T, ...)` mean of the transition at each step.
        noise_std_devs: `(T,)` std of x_next around the mean at each step of the request (0 on its
            deterministic steps), shared by every sample: a comb's spine and tails, which take
            ODE steps where the request's are stochastic, have zero noise there.
        variance_noises: `(T, ...)` the standard-normal draws (zeros where a step drew none; times
            the noise scale at a tree's scaled branch step: `rollout.tree.Branching.noise_scales`),
            so that x_{i+1} = mean + noise_std * variance_noise at every step.
    """

    model_outputs: torch.Tensor
    prev_sample_means: torch.Tensor
    noise_std_devs: torch.Tensor
    variance_noises: torch.Tensor


@dataclass(frozen=True)
class SampleTrajectory:
    """Everything that belongs to one sample of a request.

    Attributes:
        prompt, negative_prompt: what the sample was conditioned on.
        seed: the seed of this sample's generator: the request's seed + the sample's index, or in
            a request that resumes nodes below a branch step, its leaf's (`rollout.plan.RolloutPlan`).
        image: `(C, H, W)` fp32 in [0, 1].
        final_latents: `(*latent_shape)` fp32, x_T.
        log_probs: `(T,)` fp32, log-prob of the transition taken at each step (0 on ODE steps).
        latents: `(K, *latent_shape)` fp32, the kept latents.
        latent_step_indices: `(K,)` int64, the absolute step of each kept latent (T is x_T).
        schedule: the request's schedule, the same object for every sample of the request.
        weight_version: the version of the weights that sampled it, as the server names them.
        debug: per-step internals, when asked for.
        denoising_env: this sample's conditioning, when asked for: `Conditioning.row`'s map in
            SGLang's layout (`image_kwargs`, `pos_cond_kwargs`, `neg_cond_kwargs`, `guidance`),
            tensors without the batch dimension. Samples of one prompt share one map (an
            image-conditioned prompt's condition latents are held once, not per sample).
        condition_images: its prompt's input images (`rollout.input_images`), the same tuple for
            every sample of the prompt; () for a text prompt.
        branching: the branch steps and factors of the tree it is a leaf of (`rollout.tree`); none
            for an unbranched sample.
        branch_path: its child index at each branch step, from its root; () when unbranched.
        rewards: its score by each scorer the request named (`rollout_reward_models`), None
            where a scorer failed under `rollout_reward_on_error: "null"`; None: not scored.
        advantages: each scorer's reward against its prompt's group (`rollout.advantages`),
            when the request asked for them.
    """

    schedule: ScheduleSnapshot
    prompt: str
    negative_prompt: str
    seed: int
    image: torch.Tensor
    final_latents: torch.Tensor
    log_probs: torch.Tensor
    latents: torch.Tensor
    latent_step_indices: torch.Tensor
    weight_version: str | None = None
    debug: StepDebug | None = None
    denoising_env: dict[str, Any] | None = None
    condition_images: tuple[InputImage, ...] = ()
    branching: Branching = Branching()
    branch_path: tuple[int, ...] = ()
    rewards: dict[str, float | None] | None = None
    advantages: dict[str, float | None] | None = None

    @property
    def root_seed(self) -> int:
        """Its root's seed (`rollout.tree`): its own seed when unbranched."""
        return self.seed - self.branching.offset(self.branch_path)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The sample's tensors by field name, its debug tensors' as `debug.<name>`."""
        tensors = {name: getattr(self, name) for name in _TENSOR_FIELDS}
        if self.debug is not None:
            tensors.update({f"debug.{name}": getattr(self.debug, name) for name in _DEBUG_FIELDS})
        return tensors

    def __reduce__(self):
        # A sample unpacked from a batch holds views of the batch's stacked buffers; pickled on
        # its own, a view would carry the whole buffer along.
        return _sample, (_plain_fields(self), {name: _compact(t) for name, t in self.tensors().items()})


# A leaf's tensors that follow its path: each node holds its own steps of them.
_PATH_FIELDS = ("latents", "log_probs", "debug.model_outputs", "debug.prev_sample_means", "debug.variance_noises")


@dataclass(frozen=True)
class TreeNode:
    """Per-node data of a tree rollout (`rollout.tree`): the partial trajectory shared by every
    leaf below it, held once.

    Attributes:
        root: the index of its root among the batch's roots (in order of their first leaf).
        path: its child index at each branch step so far; () for a root.
        steps: the transitions it owns (its `log_probs` and debug tensors' steps).
        latent_step_indices: `(k,)` int64, the absolute steps of the kept latents it owns.
        tensors: its part of each path-following field, by `SampleTrajectory.tensors` name:
            `latents` `(k, ...)`, `log_probs` `(len(steps),)`, and with debug tensors
            `debug.model_outputs`, `debug.prev_sample_means`, `debug.variance_noises`
            `(len(steps), ...)`.
        leaves: the batch indices of the leaves below it.
        children: the indices, in the batch's `tree()`, of the nodes it branched into at its last
            step (none for a leaf).
    """

    root: int
    path: tuple[int, ...]
    steps: range
    latent_step_indices: torch.Tensor
    tensors: dict[str, torch.Tensor]
    leaves: tuple[int, ...]
    children: tuple[int, ...]


@dataclass(frozen=True)
class RolloutBatch:
    """Samples that share one schedule and one set of options (with the model's defaults filled in).

    Attributes:
        schedule: the request's schedule, the one object every sample refers to.
        options: how the samples were sampled, with the model's defaults filled in.
        model: the model that sampled them, as `rollout.models.registry` names it (a family's
            `name`): what a consumer needs to replay them with the right time input.
        samples: per-sample data, in request order.
    """

    schedule: ScheduleSnapshot
    options: SamplingOptions
    model: str
    samples: list[SampleTrajectory] = field(default_factory=list)

    def __post_init__(self):
        if any(s.schedule is not self.schedule for s in self.samples):
            raise ValueError("every sample of a batch must refer to the batch's schedule object")

    def __reduce__(self):
        plain = [_plain_fields(s) for s in self.samples]
        if not any(s.branching for s in self.samples):
            return _unpacked_batch, (self.schedule, self.options, self.model, plain, _stacked(self.samples))
        return _unpacked_tree_batch, (self.schedule, self.options, self.model, plain, *self._tree_parts())

    def _tree_parts(self) -> tuple[dict, list, list[list[int]]]:
        """A tree batch's tensors as they cross a boundary: the leaves' own (not following their
        paths), each node's once (stacked over the nodes of equal shapes), and each leaf's path
        as positions in `tree()`."""
        nodes = self.tree()
        own = _stacked(self.samples, exclude=_PATH_FIELDS)
        shapes = [{name: tuple(t.shape) for name, t in node.tensors.items()} for node in nodes]
        groups: dict[str, list[int]] = {}  # nodes of equal tensor shapes are stacked together
        for i, shape in enumerate(shapes):
            groups.setdefault(repr(sorted(shape.items())), []).append(i)
        stacked_nodes = [(members, _stacked([_NodeTensors(nodes[i].tensors) for i in members])) for members in groups.values()]
        position = {(node.root, node.path): k for k, node in enumerate(nodes)}
        root_of = {leaf: node.root for node in nodes if not node.path for leaf in node.leaves}
        paths = [
            [position[(root_of[i], leaf.branch_path[:depth])] for depth in range(len(leaf.branch_path) + 1)]
            for i, leaf in enumerate(self.samples)
        ]
        return own, stacked_nodes, paths

    def to_wire(self) -> dict[str, Any]:
        """The batch as maps, lists, strings, numbers and tensors, for `rollout.codec` to encode
        (the batch answer of `POST /rollout/generate`, which `rollout.client` reads): the schedule
        and options once, each tensor field stacked over the samples (a tree's over its nodes,
        each node once), and the maps and image tuples that samples share (a prompt's
        `denoising_env` and `condition_images`) once. `from_wire` is its inverse, bit for bit."""
        shared: dict[str, dict[int, tuple[int, Any]]] = {"denoising_env": {}, "condition_images": {}}

        def share(kind: str, value: Any) -> int | None:
            if value is None or value == ():
                return None
            return shared[kind].setdefault(id(value), (len(shared[kind]), value))[0]

        samples = [
            {
                **{name: getattr(s, name) for name in _WIRE_PLAIN_FIELDS},
                "branching": {
                    "steps": list(s.branching.steps),
                    "factors": list(s.branching.factors),
                    "noise_scales": list(s.branching.noise_scales),
                    "log_prob_std": s.branching.log_prob_std.value,
                    "shape": s.branching.shape.value,
                },
                "branch_path": list(s.branch_path),
                "denoising_env": share("denoising_env", s.denoising_env),
                "condition_images": share("condition_images", s.condition_images),
            }
            for s in self.samples
        ]
        wire = {
            "format": WIRE_FORMAT,
            "model": self.model,
            "options": self.options.to_plain(),
            "schedule": {f.name: getattr(self.schedule, f.name) for f in dataclasses.fields(ScheduleSnapshot)},
            "samples": samples,
            "denoising_envs": [env for _, env in shared["denoising_env"].values()],
            "condition_images": [[image.pixels for image in images] for _, images in shared["condition_images"].values()],
        }
        if not any(s.branching for s in self.samples):
            return {**wire, "tensors": _tensors_to_wire(_stacked(self.samples))}
        own, stacked_nodes, paths = self._tree_parts()
        nodes = [{"members": members, "tensors": _tensors_to_wire(stacked)} for members, stacked in stacked_nodes]
        return {**wire, "tree": {"own": _tensors_to_wire(own), "nodes": nodes, "paths": paths}}

    @classmethod
    def from_wire(cls, wire: Any) -> "RolloutBatch":
        """The batch `to_wire` gave, its tensors decoded (`rollout.codec.decode_tree`); raises
        `CodecError` naming what does not fit the layout."""
        try:
            if not isinstance(wire, dict) or wire.get("format") != WIRE_FORMAT:
                found = wire.get("format") if isinstance(wire, dict) else type(wire).__name__
                raise CodecError(f"not a rollout batch of format {WIRE_FORMAT!r} (got {short_repr(found)})")
            schedule = ScheduleSnapshot(**wire["schedule"])
            options = _options_from_wire(wire["options"])
            envs = wire["denoising_envs"]
            images = [tuple(InputImage(pixels) for pixels in pixels_list) for pixels_list in wire["condition_images"]]
            plain = [
                {
                    **{name: fields[name] for name in _WIRE_PLAIN_FIELDS},
                    "branching": Branching(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields["branching"].items()}),
                    "branch_path": tuple(fields["branch_path"]),
                    "denoising_env": None if fields["denoising_env"] is None else envs[fields["denoising_env"]],
                    "condition_images": () if fields["condition_images"] is None else images[fields["condition_images"]],
                }
                for fields in wire["samples"]
            ]
            if "tree" not in wire:
                return _unpacked_batch(schedule, options, wire["model"], plain, wire["tensors"])
            tree = wire["tree"]
            nodes = [(node["members"], node["tensors"]) for node in tree["nodes"]]
            return _unpacked_tree_batch(schedule, options, wire["model"], plain, tree["own"], nodes, tree["paths"])
        except CodecError:
            raise
        except KeyError as error:
            raise CodecError(f"rollout batch does not fit its layout: a map lacks the key {short_repr(error.args[0])}") from None
        except (IndexError, TypeError, ValueError) as error:
            raise CodecError(f"rollout batch does not fit its layout: {type(error).__name__}: {short_repr(str(error))}") from None

    def tree(self) -> list[TreeNode]:
        """The batch's tree nodes, root by root, each node before its children (`TreeNode`): the
        data each node's leaves share, as views of its first leaf's tensors. Unbranched samples are
        roots of one leaf. A trainer groups rewards with it: BranchGRPO's node reward is the mean of
        its `leaves`' rewards, TempFlow-GRPO's groups are a node's `children`."""
        num_steps = self.options.num_inference_steps
        roots: dict[tuple, int] = {}
        nodes: dict[tuple, dict[str, Any]] = {}
        for i, leaf in enumerate(self.samples):
            key = (leaf.prompt, leaf.negative_prompt, leaf.root_seed, leaf.branching)
            root = roots.setdefault(key, len(roots))
            for depth in range(len(leaf.branch_path) + 1):
                node = nodes.setdefault((root, leaf.branch_path[:depth]), {"first": leaf, "leaves": []})
                node["leaves"].append(i)
        index = {key: k for k, key in enumerate(nodes)}
        children: dict[tuple, list[int]] = {key: [] for key in nodes}
        for root, path in nodes:
            if path:
                children[(root, path[:-1])].append(index[(root, path)])
        tree = []
        for (root, path), node in nodes.items():
            first = node["first"]
            steps = first.branching.owned_steps(path, num_steps)
            owned = [
                k for k, step in enumerate(first.latent_step_indices.tolist()) if first.branching.owns_latent(path, step, num_steps)
            ]
            tensors = first.tensors()
            mine = {"latents": tensors["latents"][owned[0] : owned[-1] + 1] if owned else tensors["latents"][:0]}
            mine.update({name: tensors[name][steps.start : steps.stop] for name in _PATH_FIELDS[1:] if name in tensors})
            tree.append(
                TreeNode(
                    root, path, steps, first.latent_step_indices[owned], mine, tuple(node["leaves"]), tuple(children[(root, path)])
                )
            )
        return tree

    def check_finite(self) -> None:
        """Raises `NonFiniteOutputError` naming the tensors of the samples that hold NaN or inf:
        NaN log-probs returned as a success would poison a training step, and nothing downstream
        would say why."""
        bad: dict[str, int] = {}
        for sample in self.samples:
            for name, tensor in sample.tensors().items():
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    bad[name] = bad.get(name, 0) + 1
        if bad:
            where = ", ".join(f"{name} ({count} of {len(self.samples)} samples)" for name, count in bad.items())
            raise NonFiniteOutputError(
                f"sampling produced NaN or infinite values in {where}; "
                "lower guidance_scale, true_cfg_scale or rollout_noise_level, or check the served weights"
            )

    def subset(self, indices: Sequence[int]) -> "RolloutBatch":
        """The samples at `indices`, sharing this batch's schedule."""
        return RolloutBatch(self.schedule, self.options, self.model, [self.samples[i] for i in indices])

    @classmethod
    def concat(cls, parts: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Joins batches sampled by one model with the same options and a bit-identical schedule.

        The result keeps the first part's schedule object and points every sample at it, so the
        joined batch still carries its schedule once.
        """
        first = parts[0]
        for part in parts[1:]:
            if part.model != first.model:
                raise ValueError(f"cannot join batches of different models: {first.model!r} != {part.model!r}")
            if part.options != first.options:
                raise ValueError(f"cannot join batches with different options: {first.options} != {part.options}")
            if not part.schedule.equals(first.schedule):
                raise ValueError("cannot join batches whose schedules differ")
        samples = [
            sample if sample.schedule is first.schedule else dataclasses.replace(sample, schedule=first.schedule)
            for part in parts
            for sample in part.samples
        ]
        return cls(first.schedule, first.options, first.model, samples)


_TENSOR_FIELDS = ("image", "final_latents", "log_probs", "latents", "latent_step_indices")
_DEBUG_FIELDS = tuple(f.name for f in dataclasses.fields(StepDebug))
# What `RolloutBatch.to_wire` names; a reader that finds another refuses it rather than guess.
WIRE_FORMAT = "rollout-batch/1"
# A sample's fields that cross the wire as they are (strings, numbers, maps of them).
_WIRE_PLAIN_FIELDS = ("prompt", "negative_prompt", "seed", "weight_version", "rewards", "advantages")


def _options_from_wire(fields: dict[str, Any]) -> SamplingOptions:
    """`SamplingOptions` from `SamplingOptions.to_plain`'s map, checked as any options are."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(SamplingOptions)})
    if unknown:
        raise CodecError(f"rollout batch: options {short_repr(unknown)} are not SamplingOptions' fields")
    return SamplingOptions(**fields)


def _tensors_to_wire(stacked: dict[str, np.ndarray | list[torch.Tensor]]) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    """`_stacked`'s columns as tensors (the codec's), numpy's sharing their memory."""
    return {name: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for name, v in stacked.items()}


def _plain_fields(sample: SampleTrajectory) -> dict[str, Any]:
    return {
        f.name: getattr(sample, f.name)
        for f in dataclasses.fields(SampleTrajectory)
        if f.name not in _TENSOR_FIELDS and f.name != "debug"
    }


def _sample(plain: dict[str, Any], tensors: dict[str, torch.Tensor]) -> SampleTrajectory:
    debug = None
    if "debug.model_outputs" in tensors:
        debug = StepDebug(**{name: tensors[f"debug.{name}"] for name in _DEBUG_FIELDS})
    return SampleTrajectory(**plain, **{name: tensors[name] for name in _TENSOR_FIELDS}, debug=debug)


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor


@dataclass(frozen=True)
class _NodeTensors:
    """A node's tensors, stacked over nodes as a sample's are over samples."""

    by_name: dict[str, torch.Tensor]

    def tensors(self) -> dict[str, torch.Tensor]:
        return self.by_name


def _stacked(samples: Sequence[Any], exclude: Sequence[str] = ()) -> dict[str, np.ndarray | list[torch.Tensor]]:
    """Each tensor field over the samples (anything with `tensors()`), but those in `exclude`: one
    numpy array where shapes and dtypes agree (numpy has the dtype), else the samples' own tensors."""
    per_sample = [s.tensors() for s in samples]
    stacked: dict[str, np.ndarray | list[torch.Tensor]] = {}
    for name in [name for name in per_sample[0] if name not in exclude] if per_sample else ():
        tensors = [tensors[name] for tensors in per_sample]
        first = tensors[0]
        if first.dtype != torch.bfloat16 and all(t.shape == first.shape and t.dtype == first.dtype for t in tensors):
            rows = _consecutive_rows(tensors)
            stacked[name] = (torch.stack(tensors) if rows is None else rows).numpy()
        else:
            stacked[name] = [_compact(t) for t in tensors]
    return stacked


def _consecutive_rows(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one `(n, ...)` tensor without a copy when they are consecutive rows of one
    buffer (as the sampler's samples are), else None."""
    first = tensors[0]
    storage, step = first.untyped_storage(), first.nbytes
    for i, tensor in enumerate(tensors):
        if (
            not tensor.is_contiguous()
            or tensor.untyped_storage().data_ptr() != storage.data_ptr()
            or tensor.data_ptr() != first.data_ptr() + i * step
        ):
            return None
    rows = torch.empty(0, dtype=first.dtype)
    return rows.set_(storage, first.storage_offset(), (len(tensors), *first.shape))


def _columns(stacked: dict[str, np.ndarray | list[torch.Tensor]]) -> dict[str, torch.Tensor | list[torch.Tensor]]:
    columns = {}
    with warnings.catch_warnings():
        # Ray hands numpy buffers out of the object store read-only; torch cannot mark a tensor so.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, value in stacked.items():
            columns[name] = torch.from_numpy(value) if isinstance(value, np.ndarray) else value  # a list, or a tensor off the wire
    return columns


def _unpacked_batch(
    schedule: ScheduleSnapshot,
    options: SamplingOptions,
    model: str,
    plain: list[dict[str, Any]],
    stacked: dict[str, np.ndarray | list[torch.Tensor]],
) -> RolloutBatch:
    columns = _columns(stacked)
    samples = [
        _sample({**fields, "schedule": schedule}, {name: column[i] for name, column in columns.items()})
        for i, fields in enumerate(plain)
    ]
    return RolloutBatch(schedule, options, model, samples)


def _unpacked_tree_batch(
    schedule: ScheduleSnapshot,
    options: SamplingOptions,
    model: str,
    plain: list[dict[str, Any]],
    own: dict[str, np.ndarray | list[torch.Tensor]],
    stacked_nodes: list[tuple[list[int], dict[str, np.ndarray | list[torch.Tensor]]]],
    paths: list[list[int]],
) -> RolloutBatch:
    node_tensors: dict[int, dict[str, torch.Tensor]] = {}
    for members, stacked in stacked_nodes:
        columns = _columns(stacked)
        for position, node in enumerate(members):
            node_tensors[node] = {name: column[position] for name, column in columns.items()}
    own_columns = _columns(own)
    samples = []
    for i, fields in enumerate(plain):
        tensors = {name: column[i] for name, column in own_columns.items()}
        for name in node_tensors[paths[i][0]]:  # a leaf's path: its nodes' parts, joined in step order
            tensors[name] = torch.cat([node_tensors[node][name] for node in paths[i]])
        samples.append(_sample({**fields, "schedule": schedule}, tensors))
    return RolloutBatch(schedule, options, model, samples)
