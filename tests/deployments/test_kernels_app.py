"""A worker serving under fixed-block kernels (`model.batch_invariance: kernels`) and SDPA's math
kernel (`model.attention_backend: math`): nothing padded, and a sample's bits are the library's,
loaded with the same kernels, for that sample alone, whatever it was batched with."""

import torch

from rollout.kernels import BatchInvariance
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.sampler import sample


def test_served_samples_are_the_librarys_alone_and_nothing_is_padded(kernels_app):
    body = {
        "prompt": ["3", "seven", "a handwritten 1"],
        "num_inference_steps": 5,
        "seed": 40,
        "rollout_return_dit_trajectory": True,
    }
    lone = kernels_app.handle.generate.remote({**body, "prompt": "seven", "seed": 41}).result()
    group = kernels_app.handle.generate.remote(body).result()
    for result in (lone, group):
        (part,) = result.fetch().parts
        # One row a step for each sample of the sampler call (with padding: whole calls of 8 guided samples).
        assert part.transformer_rows == 5 * part.sampler_batch_size
    assert kernels_app.handle.info.remote().result()["attention_backend"] == "math"  # what a trainer loads
    library = load_pipeline(micro_batching=MicroBatching(16, invariance=BatchInvariance.KERNELS), attention_backend="math")
    batch = group.batch()
    assert batch.samples[1].seed == 41 and batch.samples[1].prompt == "seven"
    for served in (*batch.samples, lone.batch().samples[0]):
        alone = sample(library, [served.prompt], [served.seed], batch.options).samples[0]
        for name in ("image", "final_latents", "latents", "log_probs"):
            assert torch.equal(getattr(served, name), getattr(alone, name)), (served.seed, name)
