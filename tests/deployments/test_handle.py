"""The deployment-handle API, as an RL loop inside the cluster uses it."""

import asyncio
import dataclasses
from collections import Counter

import pytest
import ray
import torch

from deployments.load import outstanding_samples
from rollout.errors import InvalidRequestError, RequestSchemaError, UnknownPromptError
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.sampler import micro_batch_size, resolve_options
from rollout.schedule import ScheduleSnapshot
from rollout.schema import RolloutRequest
from tests.deployments.apps import APP_NAME
from tests.deployments.replicas import held_samplers, on_replicas
from tests.deployments.waiting import wait_until
from tests.reference_bits import (
    DIGITS_REQUESTS,
    REFERENCE,
    batch_records,
    field_digests,
)


def test_typed_result_with_one_schedule(handle):
    request = RolloutRequest(prompt=["1", "2", "3"], num_outputs_per_prompt=3, num_inference_steps=8, seed=50)
    result = handle.generate.remote(request).result()
    assert result.seed == 50
    batch = result.batch()
    assert {s.weight_version for s in batch.samples} == {"test-v1"}
    assert [s.seed for s in batch.samples] == list(range(50, 59))
    assert [s.prompt for s in batch.samples] == ["1"] * 3 + ["2"] * 3 + ["3"] * 3
    assert all(s.schedule is batch.schedule for s in batch.samples)
    assert batch.schedule.sigmas.shape == (9,)
    assert batch.options.num_inference_steps == 8 and batch.options.guidance_scale == 2.0


def test_requests_fan_out_over_both_replicas(handle):
    result = handle.generate.remote({"prompt": ["4", "5"], "num_outputs_per_prompt": 8, "num_inference_steps": 2}).result()
    parts = result.fetch().parts
    assert len(parts) == 2
    assert len({part.replica for part in parts}) == 2
    assert [len(part.batch.samples) for part in parts] == [8, 8]


def test_a_part_carries_its_schedule_once_across_the_object_store(handle):
    body = {"prompt": "7", "num_outputs_per_prompt": 8, "num_inference_steps": 50, "seed": 1, "rollout_debug_mode": False}
    ref, other = handle.generate.remote(body).result().parts  # 4 samples each
    part, _ = ray.get([ref, other])  # both waited for: no work may outlive the test
    samples = part.batch.samples
    # Identity survives the trip: every sample refers to the one schedule object.
    assert len(samples) == 4 and all(s.schedule is part.batch.schedule for s in samples)

    serializer = ray._private.worker.global_worker.get_serialization_context()

    def serialized_size(value) -> int:
        return serializer.serialize(value).total_bytes

    def own_copy(sample):
        schedule = ScheduleSnapshot(*(t.clone() for t in (sample.schedule.sigmas, sample.schedule.timesteps, sample.schedule.model_timesteps)))
        return dataclasses.replace(sample, schedule=schedule)

    stored = ray.experimental.get_object_locations([ref])[ref]["object_size"]
    # What was stored is what the shared structure serializes to...
    assert abs(stored - serialized_size(part)) <= 64, (stored, serialized_size(part))
    # ...and had each sample carried its own schedule, the samples would weigh 3 schedules more.
    extra = serialized_size([own_copy(s) for s in samples]) - serialized_size(list(samples))
    assert extra > 3 * serialized_size(part.batch.schedule) // 2, extra


def test_concurrent_requests_are_batched(handle, embedded_pipeline):
    bodies = [{"prompt": str(i % 10), "num_inference_steps": 6, "seed": 700 + i} for i in range(16)]
    # Placement is measured from idle workers: the router rightly counts work still running. It
    # hears that the last test's parts are done a moment after their results are (its completion
    # callback runs on the ingress's side, which never fetches them): it waits for that.
    wait_until(lambda: on_replicas(APP_NAME, "RolloutIngress", lambda _: outstanding_samples()) == [0], "idle workers", timeout_s=30)
    # Held until the whole burst is placed: a batch that completes meanwhile frees its replica,
    # and the router rightly sends it more, so the split would depend on the runner's speed.
    with held_samplers(APP_NAME):
        results = [response.result() for response in [handle.generate.remote(b) for b in bodies]]
    parts = [r.fetch().parts[0] for r in results]
    sizes = [part.sampler_batch_size for part in parts]
    assert max(sizes) > 1, sizes
    # Each call's transformer rows: 6 steps of its samples, padded to the micro-batch.
    # The served model's samples a call, as configured (guided by default: two rows each).
    options = resolve_options(embedded_pipeline, SamplingOptions(num_inference_steps=6))
    micro_batch = micro_batch_size(embedded_pipeline, options)
    assert [part.transformer_rows for part in parts] == [6 * -(-size // micro_batch) * micro_batch for size in sizes]
    # 16 one-sample requests took far fewer than 16 sampler calls.
    calls = sum(1 / size for size in sizes)
    assert calls <= 8, sizes
    # The router counts samples, so the burst is split evenly, as one 16-sample request is.
    per_replica = Counter(part.replica for part in parts)
    assert sorted(per_replica.values()) == [8, 8], per_replica


def test_on_policy_replay_of_a_served_rollout_is_exact(handle):
    body = {"prompt": ["3", "8"], "num_outputs_per_prompt": 2, "num_inference_steps": 5, "rollout_return_dit_trajectory": True}
    result = handle.generate.remote(body).result()
    batch = result.batch()
    trainer_model = load_pipeline()  # the trainer's own copy of the served weights
    replayed = replay_log_probs(trainer_model, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))


def test_async_use_inside_an_event_loop(handle):
    async def rl_step():
        responses = [handle.generate.remote({"prompt": "6", "seed": s, "num_inference_steps": 3}) for s in (1, 2)]
        results = await asyncio.gather(*responses)
        return await asyncio.gather(*(r.batch_async() for r in results))

    batches = asyncio.run(rl_step())
    assert [b.samples[0].seed for b in batches] == [1, 2]


@pytest.mark.parametrize(
    "body,error,field",
    [
        ({"prompt": "7", "num_outputs_per_prompt": 0}, InvalidRequestError, "num_outputs_per_prompt"),
        ({"prompt": "7", "num_inference_steps": 51}, InvalidRequestError, "num_inference_steps"),
        ({"prompt": "7", "rollout_noise_level": float("nan")}, InvalidRequestError, "rollout_noise_level"),
        ({"prompt": "7", "bogus": 1}, RequestSchemaError, "bogus"),
        ({"prompt": 7}, RequestSchemaError, "prompt"),
    ],
)
def test_bad_handle_requests_raise_typed_errors(handle, body, error, field):
    with pytest.raises(error) as info:
        handle.generate.remote(body).result()
    assert info.value.field == field


def test_unknown_prompts_raise_when_the_parts_are_fetched(handle):
    result = handle.generate.remote({"prompt": "a dog"}).result()
    with pytest.raises(UnknownPromptError) as info:
        result.batch()
    assert info.value.field == "prompt"
    assert handle.generate.remote({"prompt": "7", "num_inference_steps": 2}).result().batch().samples


def test_sampling_options_match_the_library(handle):
    batch = handle.generate.remote({"prompt": "2", "num_inference_steps": 4, "rollout_sde_type": "cps"}).result().batch()
    # SGLang's defaults: rollout_debug_mode is on unless a request turns it off, and latents
    # travel only when the trajectory is asked for.
    expected = dict(num_inference_steps=4, height=16, width=16, num_frames=1, guidance_scale=2.0, sde_type="cps", debug=True)
    assert batch.options == SamplingOptions(**expected, return_step_indices=())
    assert batch.samples[0].latents.shape == (0, 1, 16, 16)


@pytest.mark.parametrize("name", sorted(DIGITS_REQUESTS))
def test_batches_keep_their_bits(handle, name):
    """The fixed requests of `tests/reference_bits.py` through `batch()`, against the committed digests."""
    batch = handle.generate.remote(DIGITS_REQUESTS[name]).result().batch()
    REFERENCE.check(f"handle:embedded-digits:{name}", field_digests(batch_records(batch)))
