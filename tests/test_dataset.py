import hashlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollout import dataset
from rollout.dataset import (
    DamagedShardError,
    DatasetExistsError,
    DatasetFormatError,
    RolloutDatasetWriter,
    load_rollouts,
)
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
    assert index["format"] == 3 and index["complete"]
    [shard] = index["shards"]
    assert shard["model"] == "embedded-digits" and shard["weight_versions"] == ["step-9"]
    written = (tmp_path / shard["file"]).read_bytes()
    assert shard["bytes"] == len(written) and shard["sha256"] == hashlib.sha256(written).hexdigest()
    assert [record["weight_version"] for record in index["samples"]] == ["step-9", "step-9"]


def as_format_2(directory):
    """Rewrites a dataset's index as format 2 wrote it: no sizes, no checksums, no `complete`."""
    index = json.loads((directory / "index.json").read_text())
    for shard in index["shards"]:
        del shard["bytes"], shard["sha256"]
    del index["complete"]
    index["format"] = 2
    (directory / "index.json").write_text(json.dumps(index))


def as_format_1(directory):
    """Rewrites a dataset as format 1 wrote it: no time input, no model, no weight versions per shard."""
    as_format_2(directory)
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
    reseal(tmp_path)  # as if written so: the file is the one its index describes
    with pytest.raises(DatasetFormatError, match=r"shard-00000.safetensors: lacks \['schedule.model_timesteps'\]"):
        load_rollouts(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"format": 7, "shards": [], "samples": []}))
    with pytest.raises(DatasetFormatError, match="unknown rollout dataset format 7"):
        load_rollouts(tmp_path)


def reseal(directory):
    """Records each shard's size and checksum anew, as if the shards had been written as they are."""
    index = json.loads((directory / "index.json").read_text())
    for shard in index["shards"]:
        written = (directory / shard["file"]).read_bytes()
        shard["bytes"], shard["sha256"] = len(written), hashlib.sha256(written).hexdigest()
    (directory / "index.json").write_text(json.dumps(index))


def batches_of(pipeline, count):
    """`count` small batches, each of its own seeds: any mix-up between shards shows."""
    options = SamplingOptions(num_inference_steps=2)
    return [sample(pipeline, ["1", "2"], [2 * n, 2 * n + 1], options) for n in range(count)]


def write_dataset(directory, batches):
    with RolloutDatasetWriter(directory) as writer:
        for batch in batches:
            writer.write(batch)


def assert_same_batches(loaded, originals):
    assert len(loaded) == len(originals)
    for a, b in zip(loaded, originals):
        assert a.schedule.equals(b.schedule) and [s.seed for s in a.samples] == [s.seed for s in b.samples]
        for x, y in zip(a.samples, b.samples):
            assert all(torch.equal(getattr(x, name), getattr(y, name)) for name in dataset.PER_SAMPLE_TENSORS)


def test_a_truncated_shard_is_named(random_pipeline, tmp_path):
    write_dataset(tmp_path, batches_of(random_pipeline, 2))
    shard = tmp_path / "shard-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(DamagedShardError, match=r"shard-00001.safetensors: holds 100 bytes, not the \d+") as raised:
        load_rollouts(tmp_path)
    assert raised.value.path == shard
    # Format 2 records no size: the file itself is found unreadable, and named.
    as_format_2(tmp_path)
    with pytest.raises(DamagedShardError, match="shard-00001.safetensors: is not a readable safetensors file"):
        load_rollouts(tmp_path)


def test_a_shard_with_a_zeroed_half_fails_its_checksum(random_pipeline, tmp_path):
    write_dataset(tmp_path, batches_of(random_pipeline, 1))
    shard = tmp_path / "shard-00000.safetensors"
    written = shard.read_bytes()
    half = len(written) // 2
    shard.write_bytes(written[:half] + bytes(len(written) - half))  # the header parses, the tensors are zeros
    with pytest.raises(DamagedShardError, match="shard-00000.safetensors: its SHA-256 is not the one its index"):
        load_rollouts(tmp_path)


@pytest.mark.parametrize(
    "name", ["../../etc/passwd", "/etc/passwd", "sub/shard-00000.safetensors", "..", "a..b", "outside-link"]
)
def test_an_index_entry_naming_a_file_outside_the_directory_is_refused(random_pipeline, tmp_path, name):
    directory = tmp_path / "dataset"
    write_dataset(directory, batches_of(random_pipeline, 1))
    (tmp_path / "outside.safetensors").write_bytes((directory / "shard-00000.safetensors").read_bytes())
    (directory / "outside-link").symlink_to(tmp_path / "outside.safetensors")
    index = json.loads((directory / "index.json").read_text())
    index["shards"][0]["file"] = name
    (directory / "index.json").write_text(json.dumps(index))
    for on_damaged in ("raise", "skip"):  # the index itself is wrong: nothing in it is trusted
        with pytest.raises(DatasetFormatError, match="shard 0's file .* is not a file name inside its directory"):
            load_rollouts(directory, on_damaged=on_damaged)


def test_skip_loads_the_intact_shards_and_names_the_others(random_pipeline, tmp_path):
    batches = batches_of(random_pipeline, 4)
    write_dataset(tmp_path, batches)
    (tmp_path / "shard-00001.safetensors").unlink()
    third = tmp_path / "shard-00002.safetensors"
    third.write_bytes(bytes(third.stat().st_size))

    index, loaded = load_rollouts(tmp_path, on_damaged="skip")
    assert_same_batches(loaded, [batches[0], batches[3]])
    assert [shard["file"] for shard in index["shards"]] == ["shard-00000.safetensors", "shard-00003.safetensors"]
    assert [record["shard"] for record in index["samples"]] == [0, 0, 3, 3]  # their numbers on disk
    skipped = index["skipped_shards"]
    assert [(s["shard"], s["file"]) for s in skipped] == [
        (1, "shard-00001.safetensors"),
        (2, "shard-00002.safetensors"),
    ]
    assert "cannot be read" in skipped[0]["error"] and "SHA-256" in skipped[1]["error"]
    with pytest.raises(ValueError, match="on_damaged: must be 'raise' or 'skip'"):
        load_rollouts(tmp_path, on_damaged="ignore")


def test_a_writer_stopped_between_or_during_shards_leaves_a_dataset_that_loads(random_pipeline, tmp_path, monkeypatch):
    batches = batches_of(random_pipeline, 4)
    with pytest.raises(RuntimeError), RolloutDatasetWriter(tmp_path) as writer:
        writer.write(batches[0])
        writer.write(batches[1])
        raise RuntimeError("the producer failed between shards")
    index, loaded = load_rollouts(tmp_path)
    assert_same_batches(loaded, batches[:2])
    assert not index["complete"]

    def half_written(tensors, path):
        dataset_save_file(tensors, path)
        os.truncate(path, os.path.getsize(path) // 2)
        raise OSError(28, "No space left on device")

    dataset_save_file = dataset.save_file
    monkeypatch.setattr(dataset, "save_file", half_written)
    writer = RolloutDatasetWriter(tmp_path, resume=True)
    with pytest.raises(OSError, match="No space left"):
        writer.write(batches[2])
    assert not (tmp_path / "shard-00002.safetensors").exists()  # only its partial file, which no index lists
    _, loaded = load_rollouts(tmp_path)
    assert_same_batches(loaded, batches[:2])

    monkeypatch.undo()
    with pytest.raises(DatasetExistsError, match="index.json: a dataset is there already"):
        RolloutDatasetWriter(tmp_path)
    with RolloutDatasetWriter(tmp_path, resume=True) as writer:
        assert len(writer.shards) == 2 and writer.damaged_on_resume is None
        writer.write(batches[2])
        writer.write(batches[3])
    index, loaded = load_rollouts(tmp_path)
    assert_same_batches(loaded, batches)
    assert index["complete"] and [record["shard"] for record in index["samples"]] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_resuming_keeps_the_shards_before_the_first_damaged_one(random_pipeline, tmp_path):
    batches = batches_of(random_pipeline, 3)
    write_dataset(tmp_path, batches)
    (tmp_path / "shard-00001.safetensors").write_bytes(b"")
    with RolloutDatasetWriter(tmp_path, resume=True) as writer:
        assert len(writer.shards) == 1 and len(writer.samples) == 2
        assert writer.damaged_on_resume.path == tmp_path / "shard-00001.safetensors"
        assert writer.write(batches[1]).name == "shard-00001.safetensors"
    _, loaded = load_rollouts(tmp_path)
    assert_same_batches(loaded, batches[:2])


# Writes the pickled batch as shard after shard until it is killed.
WRITE_FOREVER = """
import pickle, sys
from rollout.dataset import RolloutDatasetWriter
batch = pickle.loads(open(sys.argv[1], "rb").read())
writer = RolloutDatasetWriter(sys.argv[2])
for _ in range(10_000):
    writer.write(batch)
"""


def test_a_writer_killed_at_any_moment_leaves_a_dataset_that_loads(random_pipeline, tmp_path):
    [batch] = batches_of(random_pipeline, 1)
    (tmp_path / "batch.pkl").write_bytes(pickle.dumps(batch))
    directory = tmp_path / "dataset"
    writer = subprocess.Popen([sys.executable, "-c", WRITE_FOREVER, tmp_path / "batch.pkl", directory])
    try:
        deadline = time.monotonic() + 120
        while not (directory / "index.json").exists() or len(dataset.read_index(directory)["shards"]) < 3:
            assert writer.poll() is None and time.monotonic() < deadline, "the writer did not write 3 shards"
            time.sleep(0.05)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    index, loaded = load_rollouts(directory)
    assert len(loaded) >= 3 and not index["complete"]
    assert_same_batches(loaded, [batch] * len(loaded))


def test_a_format_2_dataset_still_loads(random_pipeline, tmp_path):
    batches = batches_of(random_pipeline, 2)
    write_dataset(tmp_path, batches)
    as_format_2(tmp_path)
    index, loaded = load_rollouts(tmp_path)
    assert index["format"] == 2
    assert_same_batches(loaded, batches)
