"""The schedule survives every path a rollout takes in the library, for every family: the batch the
sampler returns, pickling (how a batch crosses Ray's object store), and a dataset on disk. On each
path the three tensors are bit-equal to the scheduler's own for the request and replay gives a
log-prob difference of 0. (HTTP rows and the handle: `deployments/test_schedule_paths.py`.)"""

import pickle

import pytest
import torch

from rollout.dataset import RolloutDatasetWriter, load_rollouts
from rollout.errors import InvalidRequestError
from rollout.micro_batching import MicroBatching
from rollout.models.choice import EMBEDDED_MODEL
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.rows import schedule_of_row
from rollout.sampler import sample
from rollout.testing.families import IMAGE_FAMILIES

FAMILIES = [EMBEDDED_MODEL, *IMAGE_FAMILIES]


@pytest.fixture(scope="module")
def pipelines(tiny_family_dirs, embedded_pipeline):
    loaded = {EMBEDDED_MODEL: embedded_pipeline}
    for family in IMAGE_FAMILIES:
        loaded[family] = load_pipeline(family, tiny_family_dirs[family], device="cpu", micro_batching=MicroBatching(2))
    return loaded


def rollout(pipeline):
    """4 SDE steps of 2 prompts, every latent kept: what a trainer replays."""
    if pipeline.name == EMBEDDED_MODEL:
        prompts, size = ["3", "7"], {}
    else:
        prompts, size = ["a red cube", "a cat"], {"height": 32, "width": 64}
    return sample(pipeline, prompts, [0, 1], SamplingOptions(num_inference_steps=4, **size), weight_version="v3")


def through_a_pickle(batch, _):
    return pickle.loads(pickle.dumps(batch))


def through_a_dataset(batch, directory):
    with RolloutDatasetWriter(directory) as writer:
        writer.write(batch)
    _, [loaded] = load_rollouts(directory)
    return loaded


@pytest.mark.parametrize("path", [through_a_pickle, through_a_dataset], ids=["pickle", "dataset"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_schedule_survives_the_path_and_replays_exactly(pipelines, family, path, tmp_path):
    pipeline = pipelines[family]
    original = rollout(pipeline)
    arrived = path(original, tmp_path)
    own = pipeline.schedule(4, original.options.height, original.options.width)
    for name in ("sigmas", "timesteps", "model_timesteps"):
        for batch in (original, arrived):
            tensor = getattr(batch.schedule, name)
            assert tensor.dtype == getattr(own, name).dtype and torch.equal(tensor, getattr(own, name)), name
    assert all(s.schedule is arrived.schedule for s in arrived.samples)
    assert arrived.model == family and arrived.options == original.options
    replayed = replay_log_probs(pipeline, arrived.schedule, arrived.options, arrived.samples)
    assert torch.equal(replayed.log_probs - torch.stack([s.log_probs for s in original.samples]), torch.zeros(2, 4))


def test_a_row_without_its_whole_schedule_is_refused_rather_than_guessed(pipelines):
    schedule = rollout(pipelines["flux"]).schedule
    row = {"dit_trajectory": {"sigmas": schedule.sigmas, "scheduler_timesteps": schedule.timesteps}}
    with pytest.raises(InvalidRequestError, match=r"lacks \['model_timesteps'\]"):
        schedule_of_row(row)
    row["dit_trajectory"]["model_timesteps"] = schedule.model_timesteps
    assert schedule_of_row(row).equals(schedule)
    with pytest.raises(InvalidRequestError, match="rollout_return_dit_trajectory"):
        schedule_of_row({"dit_trajectory": None})
