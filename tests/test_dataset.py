import json

import torch

from rollout.dataset import RolloutDatasetWriter, load_rollouts
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
