"""What the ingress sends a worker replica and what it answers: the contract between the two.

The ingress imports this module, so it stays light: no model code (the worker's module loads it).
- `cut_into_work` cuts a plan into the `SamplingWork` the worker replicas sample, whole tree roots
  per piece;
- `WorkerResult` is a worker's answer to one piece: its samples and what their sampler call
  cost; rewards are the request's, not a piece's (`deployments/scoring.py`);
- `DeadlineExceededError`: a request's deadline passed before it was sampled;
  `ServiceUnavailableError`: not served now, maybe if sent again (`SamplerOutOfMemoryError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rollout.cost import TransformerCost
from rollout.errors import RolloutError
from rollout.input_images import InputImage
from rollout.options import SamplingOptions
from rollout.plan import RolloutPlan
from rollout.trajectory import RolloutBatch
from rollout.tree import Branching, RootedSamples


class ServiceUnavailableError(RolloutError):
    """The request was not served now, but may be if sent again after `retry_after_s` (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        self.retry_after_s = retry_after_s
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.retry_after_s)


class SamplerOutOfMemoryError(ServiceUnavailableError):
    """The request's sampler call, alone, ran out of accelerator memory at the sizes it asked for:
    the request's doing, not the replica's (it does not count toward replacing the replica)."""


class DeadlineExceededError(RolloutError):
    """A request's deadline (`SamplingWork.deadline`: its `rollout_timeout_s`, or the server's
    `request_timeout_s`) passed before it was sampled."""


@dataclass(frozen=True)
class SamplingWork(RootedSamples):
    """One sampler call's worth of one request's samples: what a worker replica receives.

    Attributes:
        prompts, negative_prompts, seeds: one per sample (a leaf, in a tree rollout), in request order.
        options: the request's options (a worker fills in its model's defaults once, on arrival).
        branching: the request's tree (`rollout.tree`); its samples are whole roots' leaves.
        weight_version: the weights the request requires; None: whichever are served.
        deadline: `time.time()` past which the work is not worth sampling.
        request_samples: the samples of the whole request this work is part of (what its response
            holds); None: the work's own.
        companions_in_flight: the other samples the ingress that sent this work had in flight when
            it sent it (admitted and not answered: on any worker replica, or still being routed;
            its own request's other chunks included). 0: no other work of that ingress can be on
            its way to the worker. None: unknown (the work was not sent by an ingress).
        client: who sent the request (the ingress's client key: an HTTP client's address, or the
            handle's caller); a replica's queue takes turns between clients. None: unnamed.
        images: each sample's prompt's input images, decoded by the ingress (`RolloutPlan.images`);
            () for a request without images.
        resume_latents: each sample's prompt's latent to resume from (`RolloutPlan.resume_latents`);
            () for a request that starts from noise.
        resume_nodes: each sample's prompt's node to resume (`RolloutPlan.resume_nodes`); () for the
            roots.
    """

    prompts: tuple[str, ...]
    negative_prompts: tuple[str, ...]
    seeds: tuple[int, ...]
    options: SamplingOptions
    weight_version: str | None = None
    deadline: float | None = None
    companions_in_flight: int | None = None
    branching: Branching = Branching()
    request_samples: int | None = None
    client: str | None = None
    images: tuple[tuple[InputImage, ...], ...] = ()
    resume_latents: tuple[torch.Tensor, ...] = ()
    resume_nodes: tuple[tuple[int, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.seeds)

    @property
    def samples_in_response(self) -> int:
        """The samples the response this work is part of holds."""
        return len(self) if self.request_samples is None else self.request_samples


def cut_into_work(
    plan: RolloutPlan, num_worker_replicas: int, max_batch_size: int, deadline: float | None = None
) -> list[SamplingWork]:
    """The plan's samples in order, cut so that every worker replica gets a share and no piece is
    larger than a worker's batch; each piece holds whole roots (a root's leaves are sampled in one
    call, and `plan_rollout` refused a root larger than `max_batch_size`)."""
    size = max(1, min(max_batch_size, math.ceil(plan.num_samples / num_worker_replicas)))
    starts, piece = [0], 0
    for leaves in (len(root.leaf_paths()) for root in plan.roots()):
        if piece and piece + leaves > size:
            starts.append(starts[-1] + piece)
            piece = 0
        piece += leaves
    return [
        SamplingWork(
            plan.prompts[start:stop],
            plan.negative_prompts[start:stop],
            plan.seeds[start:stop],
            plan.options,
            plan.request.weight_version,
            deadline,
            branching=plan.branching,
            request_samples=plan.num_samples,
            images=plan.images[start:stop],
            resume_latents=plan.resume_latents[start:stop],
            resume_nodes=plan.resume_nodes[start:stop],
        )
        for start, stop in zip(starts, [*starts[1:], plan.num_samples])
    ]


@dataclass(frozen=True)
class WorkerResult:
    """A worker's answer to one `SamplingWork`.

    Attributes:
        batch: the work's samples, all referring to one schedule object (their rewards set once
            the request is scored).
        sampler_batch_size: samples (a tree's leaves) the sampler call that produced them took (shows
            batching), those it dropped midway included (`deployments/batching.py`).
        transformer_rows: rows the transformer computed in that call, other requests' work in it and
            its padding included: once per node and step for trees (`rollout.tree`), and for
            unbranched samples the padding is what exceeds `sampler_batch_size` times the steps.
        sampler_call_s: wall time of that sampler call, whatever else it sampled (the response's
            `inference_time_s` is the whole request's).
        peak_memory_mb: peak accelerator memory allocated during that call; None on the CPU.
        replica: the worker replica that sampled them.
        node_id: the Ray node it runs on.
        cost: the work's own transformer rows, padded as if it had the call to itself, and its rows
            unbranched (`rollout.cost`): what a request's figures sum, whatever its call held. None
            only in a result no worker made (a test's).
        queued_s: how long the work waited on its worker replica, from its arrival to the start of
            the sampler call that sampled it.
    """

    batch: RolloutBatch
    sampler_batch_size: int
    transformer_rows: int
    sampler_call_s: float
    peak_memory_mb: float | None
    replica: str
    node_id: str
    cost: TransformerCost | None = None
    queued_s: float = 0.0
