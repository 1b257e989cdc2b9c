"""`RolloutWorker`: a replica that owns one pipeline and batches sampling work across requests."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.batching import Abandoned, BatchingQueue
from deployments.broadcast import Follower
from deployments.config import ModelConfig, RolloutAppConfig
from deployments.memory import MemoryOccupation
from deployments.metrics import WorkerMetrics
from deployments.weights import ServedWeights
from deployments.work import (
    DeadlineExceededError,
    SamplerOutOfMemoryError,
    SamplingWork,
    ServiceUnavailableError,
    WorkerResult,
)
from rollout.calibration import (
    CALIBRATION_PROMPT,
    CALIBRATION_STEPS,
    UNGUIDED,
    CalibrationCache,
    calibrate_at_start,
    calibration_images,
    calibration_keys,
    default_cache_directory,
    digest_of,
    require_batch_invariance,
)
from rollout.cost import CostFacts, transformer_cost, tree_rows
from rollout.errors import NonFiniteOutputError, RolloutError, SamplingAbandoned
from rollout.kernels import BatchInvariance
from rollout.models.base import RolloutPipeline
from rollout.models.registry import load_pipeline, resolve_model
from rollout.options import SamplingOptions
from rollout.plan import checked_against_model
from rollout.sampler import SamplerCall, micro_batch_size, resolve_options, sample_tree
from rollout.transitions import TransitionKind
from rollout.tree import TreeRoot
from rollout.weights import weights_layout

logger = logging.getLogger("ray.serve")
BROKEN_AFTER_FAILED_CALLS = 3


def _sample_measured(pipeline: RolloutPipeline, *args, **kwargs) -> tuple[SamplerCall, float | None]:
    """`sample_tree(pipeline, ...)` and the peak accelerator memory it allocated, in MB (None on the CPU)."""
    device = pipeline.device
    if device.type != "cuda":
        return sample_tree(pipeline, *args, **kwargs), None
    torch.cuda.reset_peak_memory_stats(device)
    call = sample_tree(pipeline, *args, **kwargs)
    return call, torch.cuda.max_memory_allocated(device) / 2**20


def _abandoned_error(work: SamplingWork) -> RolloutError:
    """What a work dropped from its sampler call answers, should anyone still read it: a request
    cancelled is not, so this is read past a deadline, or when the replica stops."""
    if work.deadline is not None and work.deadline < time.time():
        return DeadlineExceededError("the request's deadline passed while it was being sampled")
    return ServiceUnavailableError("the worker replica stopped sampling this request; send it again")


@serve.deployment
class RolloutWorker:
    async def __init__(self, config: RolloutAppConfig, coordinator: DeploymentHandle):
        threads = config.worker_torch_threads or torch.get_num_threads()
        # One long-lived sampling thread, off the event loop. torch's thread count is per calling
        # thread, and a fresh thread per batch would also rebuild the OpenMP pool every time:
        # measured here, that ran the sampler at half the speed of the main thread.
        self._sampling_thread = ThreadPoolExecutor(1, "sampler", initializer=torch.set_num_threads, initargs=(threads,))
        dtype = getattr(torch, config.model.dtype)
        model = config.model
        name, self.model_path = resolve_model(model.name, model.path)
        self.pipeline = load_pipeline(
            name,
            self.model_path,
            dtype=dtype,
            max_sequence_length=model.max_sequence_length,
            vae_tiling=model.vae_tiling,
            encoding_cache_bytes=model.encoding_cache_mib * 2**20,
            attention_backend=model.attention_backend,
        )
        self.pipeline.micro_batching = model.micro_batching(self.pipeline.micro_batching.default)
        default_size = (self.pipeline.default_height, self.pipeline.default_width)
        if self.pipeline.calibrated_at_start and (sizes := model.sizes_to_calibrate(default_size)):
            calibrated = await self._calibrated_sizes(sizes, model, coordinator)
            self.pipeline.micro_batching = self.pipeline.micro_batching.with_calibrated(**calibrated)
        micro_batching = self.pipeline.micro_batching
        # At the model's default image size and each one configured, on the sampling thread: its
        # torch threads are part of what the kernels do. Video families under padding are left to
        # `calibrate`: the check would cost a transformer call of the micro-batch's full-length
        # videos at every start (minutes for the tiny Wan copy on a CPU), and their VAE decodes a
        # video a call whatever the size.
        if micro_batching.invariance is BatchInvariance.KERNELS or self.pipeline.default_num_frames == 1:
            for height, width in sorted({default_size, *micro_batching.by_size, *micro_batching.decode_by_size}):
                await self._on_sampling_thread(require_batch_invariance, self.pipeline, height, width)
        self.config = config
        self.metrics = WorkerMetrics(model.label())
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.node_id = ray.get_runtime_context().get_node_id()
        self._failed_calls_in_a_row = 0
        self._arrivals: dict[int, float] = {}  # id of a work submitted -> when it arrived (perf_counter)
        self._queue = BatchingQueue(
            self._sample_on_thread,
            config.max_batch_size,
            group_of=lambda work: work.options,
            micro_batch_size=lambda options: micro_batch_size(self.pipeline, options),
            wait_s=config.batch_wait_timeout_s,
            lone_wait_s=config.batch_lone_wait_s,
        )
        self.weights = ServedWeights(self.pipeline, config.weight_version, self.replica)
        self.memory = MemoryOccupation(self.pipeline)
        self.follower = Follower(
            coordinator,
            self.replica,
            self._register,
            {**self.weights.handlers(), **self.memory.handlers()},
            lambda: self.weights.version,
            self._on_sampling_thread,
        )
        self._coordinator = coordinator
        await self.follower.start()

    async def _calibrated_sizes(
        self, sizes: list[tuple[int, int]], model: ModelConfig, coordinator: DeploymentHandle
    ) -> dict[str, dict[str, int]]:
        """The micro-batch sizes this app's replicas sample `sizes` with on this kind of device: the
        sizes a replica offered first, else those measured here (or kept on this machine) and
        offered. A sample's bits depend on the size of its calls: replicas that each kept their own
        measurement would give one seed two results."""
        keys = await self._on_sampling_thread(calibration_keys, self.pipeline, sizes)
        agreement = digest_of(keys)
        agreed = await coordinator.agree_micro_batches.remote(agreement, None)
        if agreed is None:
            directory = model.calibration_cache_dir
            cache = CalibrationCache(default_cache_directory() if directory is None else Path(directory))
            measured = await self._on_sampling_thread(calibrate_at_start, self.pipeline, keys, model.calibration_budget_s, cache)
            for note in measured.notes:
                logger.info("micro-batch sizes at %s", note)
            offered = {"micro_batch_sizes": measured.micro_batch_sizes, "decode_batch_sizes": measured.decode_batch_sizes}
            agreed = await coordinator.agree_micro_batches.remote(agreement, offered)
        logger.info("serving with micro-batch sizes %s", agreed)
        return agreed

    async def _register(self):
        actor = ray.get_runtime_context().current_actor
        layouts = weights_layout(self.pipeline.weight_modules)  # the coordinator checks checkpoints' headers with it
        return await self._coordinator.register.remote(self.replica, actor, layouts, self.weights.version)

    async def __del__(self):
        # Serve calls this after an __init__ that raised (a model that cannot load) too: stop only
        # what was started, so that the cause stays the one error in the replica's log.
        if hasattr(self, "_queue"):
            self._queue.stop()
        if hasattr(self, "follower"):
            await self.follower.stop()

    async def _on_sampling_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._sampling_thread, fn, *args)

    def check_health(self) -> None:
        """Serve's periodic check: sampler calls that fail one after the other, whatever the requests,
        mean a broken pipeline (a device error, weights gone bad). A call that raised counts when the
        replica's own probe request fails too (else the request explains it: issue 46), and so does
        one whose every request's samples were NaN or infinite (weights finite but too large to
        sample with). Serve then replaces the replica; meanwhile `/health` stops counting it."""
        if self._failed_calls_in_a_row >= BROKEN_AFTER_FAILED_CALLS:
            raise RuntimeError(f"the last {self._failed_calls_in_a_row} sampler calls failed or gave no finite samples")

    def _samples_a_probe(self) -> bool:
        """Whether this replica still samples a small request of its own (the calibration prompt and
        the input images a model needs, one frame, no guidance, `CALIBRATION_STEPS` deterministic
        steps) to finite images."""
        options = SamplingOptions(
            num_inference_steps=CALIBRATION_STEPS, num_frames=1, sde_type=TransitionKind.ODE, return_step_indices=(), **UNGUIDED
        )
        try:
            options = resolve_options(self.pipeline, options)
            images = calibration_images(self.pipeline, options.height, options.width)
            sample_tree(self.pipeline, [TreeRoot(CALIBRATION_PROMPT, "", 0, images=images)], options).batch.check_finite()
        except Exception:
            logger.exception("the replica's own probe request failed too: the failure counts toward replacing it")
            return False
        return True

    def info(self) -> dict:
        scheduler = self.pipeline.scheduler
        return {
            "model": self.pipeline.name,
            "model_path": str(self.model_path),
            "pipeline_class": getattr(self.pipeline, "diffusers_pipeline", type(self.pipeline).__name__),
            "dtype": self.config.model.dtype,
            "attention_backend": self.pipeline.attention.value,  # what a trainer replays with
            "micro_batching": self.pipeline.micro_batching.describe(),  # and these
            "scheduler": {"class_name": type(scheduler).__name__, "config": dict(scheduler.config)},
            "default_height": self.pipeline.default_height,
            "default_width": self.pipeline.default_width,
            "default_num_frames": self.pipeline.default_num_frames,
            "experts": list(self.pipeline.experts),
            "default_guidance_scale": self.pipeline.default_guidance_scale,
            "image_size_limits": self.pipeline.image_size_limits.describe(),
            "condition_images": self.pipeline.condition_images.describe(),
            "device": str(self.pipeline.device),
        }

    def cost_facts(self) -> CostFacts:
        """What the ingress, which loads no model, needs to cost requests for this model."""
        return CostFacts.of(self.pipeline)

    async def generate(self, work: SamplingWork) -> WorkerResult:
        """Samples `work` (cut by the ingress to at most `max_batch_size` samples, `cut_into_work`),
        batched with whatever compatible work arrives meanwhile."""
        # Checked here, before batching: a bad request fails alone, and not in a sampler call,
        # where a failure counts toward replacing the replica. The options come back with the
        # model's defaults: the queue groups and the sampler samples by them.
        options = checked_against_model(
            self.pipeline,
            work.options,
            work.prompts,
            work.negative_prompts,
            work.samples_in_response,
            self.config.limits,
            work.images,
            work.resume_latents,
        )
        work = dataclasses.replace(work, options=options)
        self._arrivals[id(work)] = time.perf_counter()  # the sampler call that takes it says how long it waited
        try:
            return await self._queue.submit(work)
        finally:
            del self._arrivals[id(work)]

    async def _sample_on_thread(self, works: list[SamplingWork], abandoned: Abandoned) -> list[WorkerResult | Exception]:
        return await self._on_sampling_thread(self._sample_group, works, abandoned)

    def _sample_group(self, works: list[SamplingWork], abandoned: Abandoned) -> list[WorkerResult | Exception]:
        """On the sampling thread: the works this replica can serve now, in one sampler call, which
        drops the works `abandoned` names between its steps (`deployments/batching.py`).

        Weight commands run on this thread too, so the version checked here is the one sampled.
        """
        results: list[WorkerResult | Exception] = [None] * len(works)  # type: ignore[list-item]
        servable = []
        for i, work in enumerate(works):
            try:
                self.memory.check_awake()
                self.weights.check_version(work.weight_version)
                servable.append(i)
            except RolloutError as error:
                results[i] = error
        if not servable:
            return results
        group = [works[i] for i in servable]
        roots_of_work = [work.roots() for work in group]
        work_of_root = [j for j, roots in enumerate(roots_of_work) for _ in roots]

        def abandoned_roots() -> set[int]:
            gone = abandoned()
            return {r for r, j in enumerate(work_of_root) if servable[j] in gone}

        start = time.perf_counter()
        try:
            roots = [root for roots in roots_of_work for root in roots]  # a branched request's and others', together
            call, peak_memory_mb = _sample_measured(
                self.pipeline, roots, group[0].options, weight_version=self.weights.version, abandoned=abandoned_roots
            )
        except SamplingAbandoned:
            for i, work in zip(servable, group):
                results[i] = _abandoned_error(work)
            return results
        except Exception as error:
            if len(group) > 1:  # one request's failure must not fail its companions: each again alone
                logger.warning("a sampler call of %d requests failed (%r); sampling each alone", len(group), error)
                for i, work in zip(servable, group):
                    (results[i],) = self._sample_group([work], lambda i=i: {0} if i in abandoned() else set())
                return results
            if isinstance(error, torch.cuda.OutOfMemoryError):  # at the sizes this request asked for, alone
                logger.warning("a request of %d samples ran out of accelerator memory", len(group[0]))
                torch.cuda.empty_cache()
                results[servable[0]] = SamplerOutOfMemoryError(
                    "this request's sampler call ran out of accelerator memory: send it again later, or ask for "
                    "fewer samples or a smaller size"
                )
                return results
            logger.exception("sampling failed for a request of %d samples", len(group[0]))
            self.metrics.failed()
            results[servable[0]] = error
            # A failure counts toward replacing the replica only if no request explains it: when the
            # replica cannot sample a request nobody sent either (a device error, weights gone bad).
            self._failed_calls_in_a_row = 0 if self._samples_a_probe() else self._failed_calls_in_a_row + 1
            return results
        elapsed = time.perf_counter() - start
        costs = [transformer_cost(self.pipeline, work.roots(), work.options) for work in group]
        steps = group[0].options.num_inference_steps
        self.metrics.sampled(
            elapsed,
            steps,
            call.transformer_rows,
            useful_rows=tree_rows(roots, group[0].options, lambda rows: rows),
            rows_saved=sum(cost.transformer_rows_unbranched - cost.transformer_rows for cost in costs),
        )
        offset = 0
        served = []
        for j, (i, work) in enumerate(zip(servable, group)):
            if work_of_root.index(j) in call.abandoned_roots:  # its roots left the call together
                results[i] = _abandoned_error(work)
                continue
            served.append(i)
            part = call.batch.subset(range(offset, offset + len(work)))
            offset += len(work)
            try:  # each request on its own: NaN in one request's samples does not fail the others
                part.check_finite()
            except NonFiniteOutputError as error:
                logger.warning("request refused its samples: %s", error)
                results[i] = error
                continue
            results[i] = WorkerResult(
                part,
                sum(len(work) for work in group),
                call.transformer_rows,
                elapsed,
                peak_memory_mb,
                self.replica,
                self.node_id,
                cost=costs[j],
                queued_s=max(0.0, start - self._arrivals.get(id(work), start)),
            )
        served_nothing = all(isinstance(results[i], NonFiniteOutputError) for i in served)
        self._failed_calls_in_a_row = self._failed_calls_in_a_row + 1 if served_nothing else 0
        return results
