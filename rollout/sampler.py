"""The denoising loop: samples a batch and records each sample's exact trajectory.

One loop serves plain samples and tree rollouts (`rollout.tree`): it runs over the live nodes,
and a plain sample is a root of one leaf. Three properties hold by construction and are tested:
- Determinism: sample i draws everything from its own CPU generator seeded `seeds[i]` (its
  initial noise first, then one draw per stochastic step); a tree's nodes draw as
  `rollout.tree` derives.
- Batch invariance: a sample's trajectory is bit-identical whether it is generated alone or in
  any batch. The model runs on micro-batches, each of rows of one conditioning bucket (rows whose
  text is padded to the same length), and either every micro-batch is padded to exactly the
  pipeline's micro-batch size for the image size, so every row sees the same kernels, or the
  calls take the rows there are and run under batch-invariant kernels (`rollout.kernels`).
- Cost: the transformer runs once per live node and step (`SamplerCall.transformer_rows`).

Memory: the conditioning stays on the CPU and goes to the device one micro-batch at a time,
and every latent and debug tensor kept leaves the device as it is produced, into one host
buffer per kept tensor, allocated once per epoch (the steps between two branch steps; one epoch
without them); the samples are views of those buffers (a tree's leaves join their epochs' rows).
Device memory grows with the micro-batch, host memory with what is kept, once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Sequence

import torch

from rollout.conditioning import BucketedConditioning, Conditioning, ConditioningBucket
from rollout.errors import InvalidRequestError, SamplingAbandoned
from rollout.kernels import zero_padded
from rollout.models.base import RolloutPipeline
from rollout.options import SamplingOptions, check_seed
from rollout.schedule import ScheduleSnapshot
from rollout.trajectory import RolloutBatch, SampleTrajectory, StepDebug
from rollout.tree import RESUME_LATENTS_FIELD, Branching, TreeRoot, check_resume_latent, roots_of
from rollout.transitions import HeldFrames, Transition, TransitionKind, noise_std_of, take_steps


def resolve_options(pipeline: RolloutPipeline, options: SamplingOptions) -> SamplingOptions:
    """Fills in the model's defaults (size, guidance) so the options describe the run exactly."""
    return dataclasses.replace(
        options,
        height=pipeline.default_height if options.height is None else options.height,
        width=pipeline.default_width if options.width is None else options.width,
        num_frames=pipeline.default_num_frames if options.num_frames is None else options.num_frames,
        guidance_scale=pipeline.default_guidance_scale if options.guidance_scale is None else options.guidance_scale,
    )


def micro_batch_size(pipeline: RolloutPipeline, options: SamplingOptions) -> int:
    """Samples per transformer call for a request with `options` (model defaults filled in): the
    micro-batch's rows over the rows a sample takes (`rows_per_sample`), at least one. A call's
    cost and memory go with its rows, so a request without guidance fills the rows a guided one
    does; its options alone decide, so a sample's bits still do not depend on its companions."""
    rows = pipeline.micro_batching.size_for(options.height, options.width)
    return max(1, rows // rows_per_sample(pipeline, options))


def rows_per_sample(pipeline: RolloutPipeline, options: SamplingOptions) -> int:
    """The rows one sample takes in a transformer call: 2 where the family runs classifier-free
    guidance's two branches in one call and `options` turn guidance on, else 1."""
    return 2 if pipeline.batches_guidance_branches and pipeline.uses_negative_branch(options) else 1


def pad_conditioning(conditioning: Conditioning, rows: int) -> Conditioning:
    """Pads to `rows` rows by repeating the last row."""
    missing = rows - len(conditioning)
    if missing == 0:
        return conditioning
    filler = torch.full((missing,), len(conditioning) - 1, dtype=torch.long)
    return conditioning.map(lambda t: torch.cat([t, t[filler.to(t.device)]]))


def pad_buckets(pipeline: RolloutPipeline, conditioning: BucketedConditioning, options: SamplingOptions) -> BucketedConditioning:
    """Each bucket padded to the rows its model calls compute (`MicroBatching.padded_rows`)."""
    samples_per_call = micro_batch_size(pipeline, options)
    padded_rows = pipeline.micro_batching.padded_rows
    return BucketedConditioning(
        tuple(
            ConditioningBucket(b.rows, pad_conditioning(b.conditioning, padded_rows(len(b.rows), samples_per_call)))
            for b in conditioning.buckets
        )
    )


def predict_velocity(
    pipeline: RolloutPipeline,
    x_t: torch.Tensor,
    timestep: torch.Tensor,
    padded_conditioning: BucketedConditioning,
    options: SamplingOptions,
    expert: int,
) -> torch.Tensor:
    """The pipeline's velocity for `(B, ...)` latents, computed in the pipeline's micro-batches
    (`MicroBatching.calls`), each of rows of one conditioning bucket.

    Args:
        timestep: `()` the transformer's time input at this step (`model_timesteps[step]`),
            the same for every row.
        expert: the denoiser of this step (`ScheduleSnapshot.expert_at`).
        padded_conditioning: the batch's conditioning after `pad_buckets`, on any device.
        options: the request's options, with the model's defaults filled in.
    """
    micro_batching, device = pipeline.micro_batching, pipeline.device
    samples_per_call = micro_batch_size(pipeline, options)
    timestep = timestep.to(device)
    velocity = torch.empty_like(x_t)
    with micro_batching.kernels():
        for bucket in padded_conditioning.buckets:
            calls = micro_batching.calls(len(bucket.rows), samples_per_call)
            padded_size = len(bucket.conditioning)
            if padded_size != calls[-1].stop:
                raise ValueError(f"conditioning of {padded_size} rows is not padded to its calls' {calls[-1].stop}")
            batch_rows = bucket.rows.to(x_t.device)
            x_padded = zero_padded(x_t[batch_rows], padded_size)
            velocities = [
                pipeline.predict_velocity(
                    x_padded[call],
                    timestep.expand(call.stop - call.start),
                    bucket.conditioning.rows(call).map(lambda t: t.to(device)),
                    options,
                    expert,
                )
                for call in calls
            ]
            velocity[batch_rows] = torch.cat(velocities)[: len(batch_rows)]
    return velocity


def _draw_noise(generators: Sequence[torch.Generator], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Drawn per sample on the CPU so a sample's noise does not depend on its batch or device.
    return torch.stack([torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]).to(device)


def _host_buffer(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    # Pinned when the model runs on CUDA, so the copies out of the device do not block a step.
    return torch.empty(shape, dtype=torch.float32, pin_memory=device.type == "cuda")


@dataclass(frozen=True)
class SamplerCall:
    """What one `sample_call` made, and what it cost.

    Attributes:
        batch: the samples, as `sample` returns them.
        transformer_rows: rows the transformer computed: every step's calls, each padded to the
            micro-batch within its conditioning bucket. Against the samples times the steps, the
            rest is padding. (Classifier-free guidance doubles each call's rows inside the model.)
        abandoned_roots: the roots dropped during the call because no one waited for them any
            more; `batch` holds the leaves of the others.
    """

    batch: RolloutBatch
    transformer_rows: int
    abandoned_roots: frozenset[int] = frozenset()


# The roots (indices into a call's roots) whose leaves no one waits for any more: asked before
# every step (`sample_tree`'s `abandoned`).
AbandonedRoots = Callable[[], Collection[int]]


def sample(
    pipeline: RolloutPipeline,
    prompts: Sequence[str],
    seeds: Sequence[int],
    options: SamplingOptions,
    negative_prompts: Sequence[str] | None = None,
    weight_version: str | None = None,
) -> RolloutBatch:
    """Generates one sample per prompt and records its trajectory.

    Args:
        prompts: one prompt per sample (repeat a prompt to get several samples of it).
        seeds: one seed per sample.
        negative_prompts: one per sample; defaults to the empty prompt.
        weight_version: the name of the pipeline's current weights, recorded in every sample.

    Returns:
        A `RolloutBatch` holding the schedule once and one `SampleTrajectory` per prompt.
    """
    return sample_call(pipeline, prompts, seeds, options, negative_prompts, weight_version).batch


def sample_call(
    pipeline: RolloutPipeline,
    prompts: Sequence[str],
    seeds: Sequence[int],
    options: SamplingOptions,
    negative_prompts: Sequence[str] | None = None,
    weight_version: str | None = None,
) -> SamplerCall:
    """`sample`, with the transformer rows it computed (arguments as for `sample`)."""
    if len(prompts) == 0:
        raise InvalidRequestError("prompt", "needs at least one prompt")
    if len(seeds) != len(prompts):
        raise InvalidRequestError("seed", f"needs one seed per sample: {len(seeds)} seeds for {len(prompts)} prompts")
    seeds = [check_seed(seed) for seed in seeds]
    negative_prompts = [""] * len(prompts) if negative_prompts is None else list(negative_prompts)
    if len(negative_prompts) != len(prompts):
        raise InvalidRequestError(
            "negative_prompt", f"needs one per sample: {len(negative_prompts)} for {len(prompts)} prompts"
        )
    return sample_tree(pipeline, roots_of(prompts, negative_prompts, seeds, Branching()), options, weight_version)


@dataclass
class _Node:
    """A live node while sampling: its root, its path so far, the leaves to grow below it, and the
    generator it draws from (`rollout.tree`'s noise derivation)."""

    root: int
    path: tuple[int, ...]
    leaf_paths: tuple[tuple[int, ...], ...]
    generator: torch.Generator


@dataclass
class _Epoch:
    """The steps between two branch steps of the call: its rows (live nodes) are fixed, and what it
    keeps is written into one buffer per tensor, a row per node.

    Attributes:
        first_step: the first transition it runs.
        parent: `(rows,)` each row's row in the epoch before (None for the first epoch).
        latent_steps: the kept latents it holds, by absolute step, in the order of its buffer.
    """

    first_step: int
    nodes: list[_Node]
    parent: torch.Tensor | None
    latent_steps: list[int]
    latents: torch.Tensor  # (rows, len(latent_steps), *latent_shape)
    log_probs: torch.Tensor  # (rows, steps)
    debug: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # velocities, means, noises: (rows, steps, ...)


@dataclass
class _TreeRun:
    """What one `sample_tree` call prepares once and its stages share.

    Attributes:
        options: the call's options, with the model's defaults filled in.
        root_paths: each root's leaf paths, in the order its leaves are returned.
        conditioning: every root's conditioning, on the CPU (a micro-batch goes to the device at a time).
        sigmas: the schedule's sigmas, on the device.
        kept_steps: the steps whose latents are kept (`SamplingOptions.kept_latent_steps`).
        branch_steps: every root's branch steps, in order; an epoch ends at each, and at the last step.
        noise_stds: `(steps,)` each step's noise std, shared by every row; None unless debugging.
        held_frames: the latent frames each root holds at every step (`RolloutPipeline.held_frames`),
            on the device; None where none does.
        epochs: the epochs so far, first to last.
    """

    roots: Sequence[TreeRoot]
    options: SamplingOptions
    device: torch.device
    latent_shape: tuple[int, ...]
    root_paths: list[tuple[tuple[int, ...], ...]]
    conditioning: BucketedConditioning
    schedule: ScheduleSnapshot
    sigmas: torch.Tensor
    kept_steps: tuple[int, ...]
    branch_steps: list[int]
    noise_stds: torch.Tensor | None
    held_frames: HeldFrames | None
    epochs: list[_Epoch]

    def taken_by(self, pipeline: RolloutPipeline, nodes: list[_Node]) -> tuple[BucketedConditioning, HeldFrames | None]:
        """What the model calls and the steps of `nodes` take from each one's root: its conditioning,
        bucketed and padded to the calls' rows, and the frames it holds."""
        roots = [node.root for node in nodes]
        padded = pad_buckets(pipeline, self.conditioning.select(roots), self.options)
        held = None if self.held_frames is None else self.held_frames.select(torch.tensor(roots, device=self.device))
        return padded, held

    def start_epoch(self, first_step: int, nodes: list[_Node], parent: torch.Tensor | None, after_branch: bool) -> _Epoch:
        """A new epoch from `first_step` to the next branch step (or the last step), with a buffer
        row per node for what it keeps; it becomes the last of `epochs`. An epoch started by the
        branch at `first_step` (`after_branch`) runs to the branch step after it; one started
        before `first_step`'s velocity (the first, or one that drops abandoned roots) ends at a
        branch at `first_step` itself, with no transition of its own."""
        # x_0 (a resumed call's x_s) is the first epoch's alone: an epoch that starts at a branch at
        # that step also has it as first_step, and keeps only the latents after its transitions.
        end = min(
            (step for step in self.branch_steps if step > first_step or (step == first_step and not after_branch)),
            default=self.options.num_inference_steps,
        )
        first_epoch = not self.epochs
        latent_steps = [step for step in self.kept_steps if first_step < step <= end or (step == first_step and first_epoch)]
        rows, steps = len(nodes), end - first_step
        debug = None
        if self.options.debug:
            debug = tuple(_host_buffer((rows, steps, *self.latent_shape), self.device) for _ in range(3))
        epoch = _Epoch(
            first_step,
            nodes,
            parent,
            latent_steps,
            _host_buffer((rows, len(latent_steps), *self.latent_shape), self.device),
            _host_buffer((rows, steps), self.device),
            debug,
        )
        self.epochs.append(epoch)
        return epoch

    def end_epoch_at(self, step: int) -> None:
        """Cuts the last epoch's buffers back to what it kept before `step`'s transition: it ends
        there, before the end it was started for (the next epoch drops abandoned roots)."""
        epoch = self.epochs[-1]
        kept = [latent_step for latent_step in epoch.latent_steps if latent_step <= step]
        transitions = step - epoch.first_step
        epoch.latent_steps = kept
        epoch.latents = epoch.latents[:, : len(kept)]
        epoch.log_probs = epoch.log_probs[:, :transitions]
        if epoch.debug is not None:
            epoch.debug = tuple(buffer[:, :transitions] for buffer in epoch.debug)


@torch.no_grad()
def sample_tree(
    pipeline: RolloutPipeline,
    roots: Sequence[TreeRoot],
    options: SamplingOptions,
    weight_version: str | None = None,
    abandoned: AbandonedRoots | None = None,
) -> SamplerCall:
    """Grows every root into its leaves and records each leaf's exact trajectory (`rollout.tree`).

    The transformer runs on the batch of live nodes at each step, roots of every branching together:
    once per node and step, in the pipeline's micro-batches. Unbranched roots are plain samples.
    In stages, as a diffusers pipeline's `__call__`:
    1. prepare: check the roots, fill in the model's defaults, encode the prompts, make the schedule;
    2. denoise, epoch by epoch: from each root's initial noise, every step's transition, the live
       nodes branching at each branch step;
    3. decode, and assemble each leaf's trajectory from its rows of every epoch.

    `abandoned`, when given, is asked before every step and before decoding which roots no one
    waits for any more (a request cancelled, or past its deadline): their nodes leave the batch
    there, so the transformer no longer runs on them. Batch invariance keeps every other leaf's
    bits what they would have been; once every root is abandoned the call stops with
    `SamplingAbandoned`.

    Returns:
        The leaves, root after root, each root's in the order of its `paths` (leaf number order by
        default), of every root not abandoned; the transformer rows computed; the roots abandoned.
    """
    run = _prepare(pipeline, roots, options)
    x_t, transformer_rows = _denoise(pipeline, run, abandoned or frozenset)
    if run.noise_stds is not None:  # a resumed call's steps before its resume step: none taken
        run.noise_stds[: run.options.resume_step or 0].zero_()
    samples = _decoded_leaves(pipeline, run, x_t, weight_version)
    batch = RolloutBatch(schedule=run.schedule, options=run.options, model=pipeline.name, samples=samples)
    live_roots = {node.root for node in run.epochs[-1].nodes}
    return SamplerCall(batch, transformer_rows, frozenset(range(len(roots))) - live_roots)


def _prepare(pipeline: RolloutPipeline, roots: Sequence[TreeRoot], options: SamplingOptions) -> _TreeRun:
    """Stage 1: the roots checked, the options completed, the prompts encoded, the schedule made."""
    if len(roots) == 0:
        raise InvalidRequestError("prompt", "needs at least one prompt")
    options = resolve_options(pipeline, options)
    for root in roots:
        check_seed(root.seed)
        check_seed(root.seed + max(root.branching.leaves_per_root - 1, 0))
        root.branching.check(options)
    latent_shape = pipeline.latent_shape(options.height, options.width, options.num_frames)
    device = pipeline.device
    num_steps = options.num_inference_steps
    root_paths = [root.leaf_paths() for root in roots]
    for paths in root_paths:
        if len(set(paths)) != len(paths):
            raise InvalidRequestError("branch_path", "a root grows each leaf once")
    for root in roots:
        _check_resume(root, options, latent_shape)
    prompts, negatives = [root.prompt for root in roots], [root.negative_prompt for root in roots]
    images = [root.images for root in roots]
    conditioning = pipeline.encode_prompts(prompts, negatives, options, images).map(lambda t: t.cpu())
    schedule = pipeline.schedule(num_steps, options.height, options.width, options.num_frames)
    held_frames = pipeline.held_frames(conditioning)
    return _TreeRun(
        roots=roots,
        options=options,
        device=device,
        latent_shape=latent_shape,
        root_paths=root_paths,
        conditioning=conditioning,
        schedule=schedule,
        sigmas=schedule.sigmas.to(device),
        kept_steps=options.kept_latent_steps(),
        branch_steps=sorted({step for root in roots for step in root.branching.steps}),
        noise_stds=_host_buffer((num_steps,), device) if options.debug else None,
        held_frames=None if held_frames is None else held_frames.to(device),
        epochs=[],
    )


def _check_resume(root: TreeRoot, options: SamplingOptions, latent_shape: tuple[int, ...]) -> None:
    """Raises `InvalidRequestError` naming ``rollout_resume_latents`` unless `root` has a latent to
    resume from exactly where the options resume (`rollout.tree.check_resume_latent`), and its
    leaves share their node at that step."""
    if (root.resume_latents is None) != (options.resume_step is None):
        raise InvalidRequestError(
            RESUME_LATENTS_FIELD, "a resumed request (rollout_resume_step) needs a latent for every root, and only it"
        )
    if root.resume_latents is not None:
        check_resume_latent(root.resume_latents, latent_shape)
        root.leaves_at(options.resume_step)


def _denoise(pipeline: RolloutPipeline, run: _TreeRun, abandoned: AbandonedRoots) -> tuple[torch.Tensor, int]:
    """Stage 2: every root from its initial noise to its last step, its nodes branching at the
    branch steps and leaving where their root is abandoned; returns the final latents of the last
    epoch's rows and the transformer rows run.

    Everything kept is written once, in place, into one buffer per tensor and epoch; with no
    branch step (and no root abandoned) there is one epoch, and the samples are views of its buffers."""
    options, device = run.options, run.device
    nodes = [
        _Node(r, (), run.root_paths[r], torch.Generator(device="cpu").manual_seed(root.seed))
        for r, root in enumerate(run.roots)
    ]
    x_t = _draw_noise([node.generator for node in nodes], run.latent_shape, device)
    start = options.resume_step or 0
    if start:  # each root's node at the resume step, its generator where it was there; its latent
        nodes = _skipped_to(run, nodes, start)
        x_t = torch.stack([run.roots[node.root].resume_latents for node in nodes]).to(device)
    epoch = run.start_epoch(start, nodes, None, after_branch=False)
    padded_conditioning, held = run.taken_by(pipeline, nodes)
    transformer_rows = 0
    if held is not None:  # as the pipeline's first model input
        x_t = held.hold(x_t)
    _keep(epoch, start, x_t)
    for step in range(start, options.num_inference_steps + 1):
        if kept := _rows_still_wanted(epoch.nodes, abandoned()):
            run.end_epoch_at(step)
            nodes = [epoch.nodes[row] for row in kept]
            epoch = run.start_epoch(step, nodes, torch.tensor(kept, dtype=torch.int64), after_branch=False)
            x_t = x_t[torch.tensor(kept, device=x_t.device)]
            padded_conditioning, held = run.taken_by(pipeline, nodes)
        if step == options.num_inference_steps:  # the check before decoding
            break
        timestep, expert = run.schedule.model_timesteps[step], run.schedule.expert_at(step)
        v = predict_velocity(pipeline, x_t, timestep, padded_conditioning, options, expert)
        transformer_rows += sum(len(bucket.conditioning) for bucket in padded_conditioning.buckets)
        if step in run.branch_steps:  # the velocity was computed once per node; its children share it
            nodes, parent = _branch(run.roots, epoch.nodes, step)
            epoch = run.start_epoch(step, nodes, parent, after_branch=True)
            x_t, v = x_t[parent.to(x_t.device)], v[parent.to(v.device)]
            padded_conditioning, held = run.taken_by(pipeline, nodes)
        kinds = _kinds(run, nodes, step)
        noise = _drawn_noise(run, nodes, kinds, step)
        log_prob_std_scales = None
        if noise is not None and step in run.branch_steps:
            log_prob_std_scales = [run.roots[node.root].branching.log_prob_std_scale_at(step) for node in nodes]
        transition = take_steps(
            kinds,
            x_t,
            v,
            run.sigmas[step],
            run.sigmas[step + 1],
            eta=options.noise_level,
            sigma_after_one=run.sigmas[1],
            noise=noise,
            log_prob_form=options.log_prob_form,
            held=held,
            log_prob_std_scales=log_prob_std_scales,
        )
        x_t = transition.x_next
        _keep(epoch, step + 1, x_t)
        slot = step - epoch.first_step
        epoch.log_probs[:, slot].copy_(transition.log_prob, non_blocking=True)
        if options.debug:
            _keep_debug(run, epoch, step, v, transition, noise)
    return x_t, transformer_rows


def _skipped_to(run: _TreeRun, nodes: list[_Node], start: int) -> list[_Node]:
    """The nodes at step `start` of a resumed call (one a root: `TreeRoot.leaves_at`), their
    generators advanced by every draw the steps before it make: the branches and draws of those
    steps, without the model."""
    for step in range(start):
        if step in run.branch_steps:
            nodes, _ = _branch(run.roots, nodes, step)
        drawing = [node.generator for node, kind in zip(nodes, _kinds(run, nodes, step)) if kind.draws_noise]
        if drawing:  # the draws themselves are not needed: only where they leave the generators
            _draw_noise(drawing, run.latent_shape, torch.device("cpu"))
    return nodes


def _kinds(run: _TreeRun, nodes: list[_Node], step: int) -> list[TransitionKind]:
    """The transition each node takes at `step` (`Branching.transition_at`)."""
    return [run.roots[node.root].branching.transition_at(run.options, step, node.path) for node in nodes]


def request_noise_std(options: SamplingOptions, sigmas: torch.Tensor, step: int) -> torch.Tensor:
    """The `()` std of the request's transition at `step` (`SamplingOptions.transition_at`),
    whichever rows took it: the debug tensors' `noise_std_devs` and replay's `noise_stds`. A row of
    a comb that took an ODE step there has zero noise and log-prob 0."""
    kind = options.transition_at(step)
    return noise_std_of(kind, sigmas[step], sigmas[step + 1], eta=options.noise_level, sigma_after_one=sigmas[1])


def _drawn_noise(run: _TreeRun, nodes: list[_Node], kinds: list[TransitionKind], step: int) -> torch.Tensor | None:
    """Each row's noise for `step`, drawn from its node's generator where its transition draws
    (zero in a comb's ODE rows, which draw nothing), times its branch step's noise scale at a
    branch step; None where no row draws."""
    drawing = [row for row, kind in enumerate(kinds) if kind.draws_noise]
    if not drawing:
        return None
    drawn = _draw_noise([nodes[row].generator for row in drawing], run.latent_shape, run.device)
    if len(drawing) == len(nodes):
        noise = drawn
    else:
        noise = torch.zeros((len(nodes), *drawn.shape[1:]), dtype=drawn.dtype, device=drawn.device)
        noise[torch.tensor(drawing, device=drawn.device)] = drawn
    if step in run.branch_steps:  # each child's own draw, times its branch step's noise scale
        scales = [run.roots[node.root].branching.noise_scale_at(step) for node in nodes]
        noise = noise * torch.tensor(scales, dtype=noise.dtype, device=noise.device).view(-1, *[1] * (noise.ndim - 1))
    return noise


def _rows_still_wanted(nodes: list[_Node], abandoned_roots: Collection[int]) -> list[int] | None:
    """The rows of `nodes` whose root is not abandoned, where some are (None where none is); raises
    `SamplingAbandoned` where every one is."""
    if not abandoned_roots:
        return None
    kept = [row for row, node in enumerate(nodes) if node.root not in abandoned_roots]
    if not kept:
        raise SamplingAbandoned("no one waits for any sample of this call any more")
    return kept if len(kept) < len(nodes) else None


def _keep_debug(
    run: _TreeRun, epoch: _Epoch, step: int, v: torch.Tensor, transition: Transition, noise: torch.Tensor | None
) -> None:
    """`rollout_debug_mode`: the step's velocity, transition mean and noise into the epoch's buffers."""
    slot = step - epoch.first_step
    velocities, means, noises = epoch.debug
    velocities[:, slot].copy_(v, non_blocking=True)
    means[:, slot].copy_(transition.mean, non_blocking=True)
    # Rows of an ODE step where the request's is stochastic (a comb's) keep zero noise, so
    # x_(i+1) = mean + std * noise holds on every row.
    run.noise_stds[step].copy_(request_noise_std(run.options, run.sigmas, step), non_blocking=True)
    if noise is None:
        noises[:, slot].zero_()
    else:
        noises[:, slot].copy_(noise, non_blocking=True)


def _decoded_leaves(
    pipeline: RolloutPipeline, run: _TreeRun, x_t: torch.Tensor, weight_version: str | None
) -> list[SampleTrajectory]:
    """Stage 3: the last epoch's rows decoded, and each leaf's trajectory joined from its rows of
    every epoch; root after root, and in path order within each root."""
    images = pipeline.decode(x_t).cpu()
    final_latents = x_t.cpu()
    if run.device.type == "cuda":  # the non-blocking copies of stage 2 have landed only once the stream is done
        torch.cuda.current_stream(run.device).synchronize()
    latent_step_indices = torch.tensor(run.kept_steps, dtype=torch.int64)
    rows_of_leaf = _rows_in_each_epoch(run.epochs)
    last = run.epochs[-1]
    row_of = {(node.root, node.path): row for row, node in enumerate(last.nodes)}
    # One map per distinct prompt, negative prompt and input images, shared by their samples.
    envs: dict[tuple, dict] = {}
    samples = []
    for r, paths in enumerate(run.root_paths):
        root = run.roots[r]
        if (r, paths[0]) not in row_of:  # abandoned
            continue
        env = None
        if run.options.return_denoising_env:
            key = (root.prompt, root.negative_prompt, tuple(image.digest for image in root.images))
            if key not in envs:
                envs[key] = run.conditioning.row(r)
            env = envs[key]
        for path in paths:
            row = row_of[(r, path)]
            rows = rows_of_leaf[row]
            debug = None
            if run.options.debug:
                velocities, means, noises = (_along(run, rows, lambda e, i=i: e.debug[i]) for i in range(3))
                debug = StepDebug(velocities, means, run.noise_stds, noises)
            samples.append(
                SampleTrajectory(
                    schedule=run.schedule,
                    prompt=root.prompt,
                    negative_prompt=root.negative_prompt,
                    seed=root.seed + root.branching.offset(path),
                    image=images[row],
                    final_latents=final_latents[row],
                    log_probs=_along(run, rows, lambda e: e.log_probs),
                    latents=_along(run, rows, lambda e: e.latents, per_step=False),
                    latent_step_indices=latent_step_indices,
                    weight_version=weight_version,
                    debug=debug,
                    denoising_env=env,
                    condition_images=root.images,
                    branching=root.branching,
                    branch_path=path,
                )
            )
    return samples


def _keep(epoch: _Epoch, step: int, x: torch.Tensor) -> None:
    if step in epoch.latent_steps:
        epoch.latents[:, epoch.latent_steps.index(step)].copy_(x, non_blocking=True)


def _branch(roots: Sequence[TreeRoot], nodes: list[_Node], step: int) -> tuple[list[_Node], torch.Tensor]:
    """The live nodes after `step`'s branches, and each one's row before them: a node branching here
    becomes its children (child 0 keeps its generator, child c > 0 starts one seeded with its
    first leaf's seed), every other node goes on as it is."""
    children, parent = [], []
    for row, node in enumerate(nodes):
        branching = roots[node.root].branching
        if step not in branching.steps or not branching.branches_below(node.path):
            children.append(node)
            parent.append(row)
            continue
        depth = len(node.path)
        for child in sorted({path[depth] for path in node.leaf_paths}):
            path = (*node.path, child)
            generator = node.generator
            if child > 0:
                seed = roots[node.root].seed + branching.offset(path)
                generator = torch.Generator(device="cpu").manual_seed(seed)
            leaf_paths = tuple(p for p in node.leaf_paths if p[depth] == child)
            children.append(_Node(node.root, path, leaf_paths, generator))
            parent.append(row)
    return children, torch.tensor(parent, dtype=torch.int64)


def _rows_in_each_epoch(epochs: list[_Epoch]) -> list[list[int]]:
    """For each row of the last epoch, its ancestor's row in every epoch, first to last."""
    rows = [[row] for row in range(len(epochs[-1].nodes))]
    for later in reversed(epochs[1:]):
        for ancestry in rows:
            ancestry.insert(0, int(later.parent[ancestry[0]]))
    return rows


def _along(run: _TreeRun, rows: list[int], buffer_of, per_step: bool = True) -> torch.Tensor:
    """A leaf's tensor along its path: its rows of each epoch's buffer, joined on the step axis (a
    view of the buffer when there is one epoch). A tensor `per_step` of a resumed call starts with
    zeros for the steps before its resume step, which it did not take."""
    parts = [buffer_of(e)[row] for e, row in zip(run.epochs, rows)]
    skipped = run.options.resume_step or 0
    if per_step and skipped:
        parts.insert(0, parts[0].new_zeros((skipped, *parts[0].shape[1:])))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
