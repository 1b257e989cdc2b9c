import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout.dataset import DatasetFormatError, RolloutDatasetWriter, load_rollouts
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample


def test_round_trip_is_exact(random_pipeline, tmp_path):
    # T + 1 == 4 == samples in the first shard: the schedule is stored once, never per sample.
    first = sample(random_pipeline, ["1", "2", "3", "4"], [0, 1, 2, 3], SamplingOptions(num_inference_steps=3))
    second = sample(
        random_pipeline, ["5"], [9], SamplingOptions(num_inference_steps=5, sde_type="cps", return_step_indices=[0, 5])
    )
    with RolloutDatasetWriter(tmp_path, {"note": "test"}) as writer:
        writer.write(first, [{"request_id": "a"}] * 4)
        writer.write(second)

    index, batches = load_rollouts(tmp_path)
    assert index["note"] == "test" and [r.get("request_id") for r in index["samples"]] == ["a"] * 4 + [None]
    for original, loaded in zip([first, second], batches):
        assert loaded.options == original.options
        assert loaded.schedule.equals(original.schedule)
        assert all(s.schedule is loaded.schedule for s in loaded.samples)
        for a, b in zip(original.samples, loaded.samples):
            assert (a.prompt, a.seed) == (b.prompt, b.seed)
            for name in ("image", "final_latents", "log_probs", "latents", "latent_step_indices"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert json.loads((tmp_path / "index.json").read_text())["shards"][1]["num_samples"] == 1


def test_the_index_names_the_model_and_the_weights(random_pipeline, tmp_path):
    batch = sample(random_pipeline, ["1", "2"], [0, 1], SamplingOptions(num_inference_steps=2), weight_version="step-9")
    with RolloutDatasetWriter(tmp_path) as writer:
        writer.write(batch)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["format"] == 2
    [shard] = index["shards"]
    assert shard["model"] == "embedded-digits" and shard["weight_versions"] == ["step-9"]
    assert [record["weight_version"] for record in index["samples"]] == ["step-9", "step-9"]


def as_format_1(directory):
    """Rewrites a dataset as format 1 wrote it: no time input, no model, no weight versions per shard."""
    index = json.loads((directory / "index.json").read_text())
    for shard in index["shards"]:
        tensors = load_file(directory / shard["file"])
        del tensors["schedule.model_timesteps"]
        save_file(tensors, directory / shard["file"])
        del shard["model"], shard["weight_versions"]
    index["format"] = 1
    (directory / "index.json").write_text(json.dumps(index))


def test_a_format_1_dataset_loads_only_where_its_time_input_is_proven(random_pipeline, tiny_family_dirs, tmp_path):
    batch = sample(random_pipeline, ["4"], [3], SamplingOptions(num_inference_steps=3))
    with RolloutDatasetWriter(tmp_path) as writer:
        writer.write(batch)
    as_format_1(tmp_path)

    with pytest.raises(DatasetFormatError, match="format 1.*model_timesteps.*python -m deployments.job"):
        load_rollouts(tmp_path)
    # The pipeline that sampled it gives its schedule, and takes the scheduler's timesteps as they are.
    _, [loaded] = load_rollouts(tmp_path, random_pipeline)
    assert loaded.schedule.equals(batch.schedule) and loaded.model == "embedded-digits"
    # FLUX.1's time input is timesteps / 1000: never taken for timesteps, whatever its schedule.
    flux = load_pipeline(None, tiny_family_dirs["flux"], device="cpu")
    with pytest.raises(DatasetFormatError, match="does not give its schedule"):
        load_rollouts(tmp_path, flux)
    flux_directory = tmp_path / "flux"
    with RolloutDatasetWriter(flux_directory) as writer:
        writer.write(sample(flux, ["a cat"], [0], SamplingOptions(num_inference_steps=2, height=32, width=32)))
    as_format_1(flux_directory)
    with pytest.raises(DatasetFormatError, match="does not take the scheduler's timesteps as they are"):
        load_rollouts(flux_directory, flux)


def test_an_unknown_format_or_a_missing_tensor_is_named(random_pipeline, tmp_path):
    with RolloutDatasetWriter(tmp_path) as writer:
        writer.write(sample(random_pipeline, ["4"], [3], SamplingOptions(num_inference_steps=2)))
    shard = tmp_path / "shard-00000.safetensors"
    tensors = load_file(shard)
    del tensors["schedule.model_timesteps"]
    save_file(tensors, shard)
    with pytest.raises(DatasetFormatError, match=r"shard-00000.safetensors: lacks \['schedule.model_timesteps'\]"):
        load_rollouts(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": 7, "shards": [], "samples": []}))
    with pytest.raises(DatasetFormatError, match="unknown rollout dataset format 7"):
        load_rollouts(tmp_path)
