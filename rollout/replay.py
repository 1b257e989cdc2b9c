"""Trainer-side replay: recompute a rollout's per-step log-probs with the trainer's own model.

The trainer indexes the returned schedule by absolute step and scores the latents the rollout
actually took with the same transition function that sampled them. With the rollout's weights
the result equals the rollout's log-probs bit for bit, so the PPO ratio is exactly 1 on-policy.
`replay_log_probs` checks that without gradients; `transition_log_probs` is the same computation
with autograd on, for the policy-gradient loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from rollout.conditioning import BucketedConditioning
from rollout.errors import InvalidRequestError
from rollout.kernels import LinearAsWithoutGradients
from rollout.models.base import RolloutPipeline
from rollout.options import SamplingOptions
from rollout.sampler import pad_buckets, predict_velocity, request_noise_std
from rollout.schedule import ScheduleSnapshot
from rollout.trajectory import RolloutBatch, SampleTrajectory, TreeNode
from rollout.transitions import take_steps


@dataclass(frozen=True)
class ReplayedLogProbs:
    """Attributes:
    step_indices: `(S,)` int64, the absolute steps i whose transition x_i -> x_{i+1} was replayed.
    log_probs: `(N, S)` fp32, one row per sample, in the order the samples were given.
    """

    step_indices: torch.Tensor
    log_probs: torch.Tensor


def replayable_steps(latent_step_indices: torch.Tensor) -> list[int]:
    """Steps i whose start x_i and end x_{i+1} were both kept."""
    kept = set(latent_step_indices.tolist())
    return sorted(i for i in kept if i + 1 in kept)


def _conditioning_of(
    pipeline: RolloutPipeline, options: SamplingOptions, samples: Sequence[SampleTrajectory]
) -> BucketedConditioning:
    if all(s.denoising_env is not None for s in samples):
        return BucketedConditioning.stack([s.denoising_env for s in samples])
    return pipeline.encode_prompts(
        [s.prompt for s in samples], [s.negative_prompt for s in samples], options, [s.condition_images for s in samples]
    )


@torch.no_grad()
def replay_log_probs(
    pipeline: RolloutPipeline,
    schedule: ScheduleSnapshot,
    options: SamplingOptions,
    samples: Sequence[SampleTrajectory],
) -> ReplayedLogProbs:
    """Recomputes the log-probs of every replayable step of `samples`, without gradients.

    Args:
        pipeline: the trainer's model; its velocities are what is being evaluated.
        schedule: the rollout's schedule, exactly as returned (never rebuilt from timesteps).
        options: the rollout's options, as returned with the batch (model defaults filled in).
        samples: samples of one rollout batch; their conditioning comes from `denoising_env`
            when returned, otherwise the prompts (and their input images) are encoded again.
    """
    steps = replayable_steps(_kept_steps(samples))
    if not steps:
        raise InvalidRequestError(
            "samples",
            "no step can be replayed: the samples keep no latents x_i and x_(i+1) of one step; ask the "
            "rollout for them (rollout_return_dit_trajectory, or rollout_return_step_indices)",
        )
    log_probs = transition_log_probs(pipeline, schedule, options, samples, steps).cpu()
    return ReplayedLogProbs(step_indices=torch.tensor(steps, dtype=torch.int64), log_probs=log_probs)


@dataclass(frozen=True)
class ReplayedTransitions:
    """The transitions x_i -> x_{i+1} the samples took at some steps, as the trainer's model sees them.

    Attributes:
        log_probs: `(N, S)` fp32, the log-prob of each sample's x_{i+1} at each step.
        means: `(N, S, ...)` fp32, each transition's mean (Flow-GRPO's KL to a reference model is
            the squared distance of two models' means over the step's variance).
        noise_stds: `(S,)` fp32, each step's standard deviation around its mean (0 on the request's
            ODE steps; a comb's rows that took an ODE step where the request's is stochastic have
            log-prob 0 there).
    """

    log_probs: torch.Tensor
    means: torch.Tensor
    noise_stds: torch.Tensor


def transition_log_probs(
    pipeline: RolloutPipeline,
    schedule: ScheduleSnapshot,
    options: SamplingOptions,
    samples: Sequence[SampleTrajectory],
    steps: Sequence[int],
) -> torch.Tensor:
    """Log-probs `(N, len(steps))` of the transitions x_i -> x_{i+1} the samples took at `steps`.

    Differentiable: with autograd on, gradients flow into the pipeline's trainable weights (a
    policy-gradient loss). The code is the sampler's, so with the rollout's weights the values
    equal the rollout's log-probs bit for bit. Each step needs x_i and x_{i+1} among the kept
    latents (`replayable_steps`). Arguments as for `replay_log_probs`.
    """
    return replayed_transitions(pipeline, schedule, options, samples, steps).log_probs


def replayed_transitions(
    pipeline: RolloutPipeline,
    schedule: ScheduleSnapshot,
    options: SamplingOptions,
    samples: Sequence[SampleTrajectory],
    steps: Sequence[int],
) -> ReplayedTransitions:
    """`transition_log_probs` with each transition's mean and std, differentiable as it is."""
    kept_steps = _kept_steps(samples)
    position = {step: k for k, step in enumerate(kept_steps.tolist())}
    not_replayable = [step for step in steps if step not in position or step + 1 not in position]
    if not_replayable:
        raise InvalidRequestError("steps", f"steps {not_replayable} lack x_i or x_(i+1) among the kept latents")
    if len(pipeline.experts) > 1 and schedule.model_experts is None:
        raise InvalidRequestError(
            "model_experts",
            f"the schedule does not say which of {list(pipeline.experts)} ran each step; replay needs the "
            "rollout's own schedule (dit_trajectory's model_experts), never one rebuilt without it",
        )
    device = pipeline.device
    latents = torch.stack([s.latents for s in samples]).to(device)  # (N, K, ...)
    sigmas = schedule.sigmas.to(device)
    conditioning = _conditioning_of(pipeline, options, samples)
    padded_conditioning = pad_buckets(pipeline, conditioning, options)
    held = pipeline.held_frames(conditioning)
    held = None if held is None else held.to(device)

    transitions, stds = [], []
    for step in steps:
        x_t = latents[:, position[step]]
        x_next = latents[:, position[step + 1]]
        timestep, expert = schedule.model_timesteps[step], schedule.expert_at(step)
        with LinearAsWithoutGradients():  # (under autograd: the rollout's kernels, see rollout.kernels)
            v = predict_velocity(pipeline, x_t, timestep, padded_conditioning, options, expert)
        transition = take_steps(
            [sample.branching.transition_at(options, step, sample.branch_path) for sample in samples],
            x_t,
            v,
            sigmas[step],
            sigmas[step + 1],
            eta=options.noise_level,
            sigma_after_one=sigmas[1],
            x_next=x_next,
            log_prob_form=options.log_prob_form,
            held=held,
            log_prob_std_scales=[sample.branching.log_prob_std_scale_at(step) for sample in samples],
        )
        transitions.append(transition)
        stds.append(request_noise_std(options, sigmas, step))
    if not transitions:
        empty = latents.new_zeros(len(samples), 0)
        return ReplayedTransitions(empty, latents[:, :0], latents.new_zeros(0))
    return ReplayedTransitions(
        torch.stack([t.log_prob for t in transitions], dim=1),
        torch.stack([t.mean for t in transitions], dim=1),
        torch.stack([std.reshape(()) for std in stds]),
    )


def node_transition_log_probs(
    pipeline: RolloutPipeline,
    batch: RolloutBatch,
    nodes: Sequence[TreeNode],
    steps: Sequence[int] | None = None,
) -> list[torch.Tensor]:
    """Each node's log-probs of the transitions it owns (`TreeNode.steps`, those among `steps` when
    given), `(k,)` per node, in order: every edge of a tree replayed once, as BranchGRPO trains,
    rather than once per leaf below it. Differentiable as `transition_log_probs`, and equal to the
    rollout's log-probs bit for bit with its weights: a node's transitions are computed from its
    first leaf's latents (x_i of a child's first step is its parent's, which every leaf below holds),
    nodes of equal steps in one call. `nodes` come from `batch.tree()`."""
    wanted = None if steps is None else set(steps)
    groups: dict[tuple[int, ...], list[int]] = {}
    for k, node in enumerate(nodes):
        owned = tuple(step for step in node.steps if wanted is None or step in wanted)
        groups.setdefault(owned, []).append(k)
    replayed: list[torch.Tensor | None] = [None] * len(nodes)
    for owned, members in groups.items():
        leaves = [batch.samples[nodes[k].leaves[0]] for k in members]
        log_probs = transition_log_probs(pipeline, batch.schedule, batch.options, leaves, owned)
        for row, k in enumerate(members):
            replayed[k] = log_probs[row]
    return replayed


def _kept_steps(samples: Sequence[SampleTrajectory]) -> torch.Tensor:
    if len(samples) == 0:
        raise InvalidRequestError("samples", "needs at least one sample")
    kept_steps = samples[0].latent_step_indices
    if any(not torch.equal(s.latent_step_indices, kept_steps) for s in samples):
        raise InvalidRequestError("samples", "all samples must keep the same latent steps")
    return kept_steps
