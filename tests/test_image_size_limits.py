"""Each model reports the image sizes it can make, derived from the model itself; a larger size is
refused naming the field and the limit before anything is sampled, the largest one samples, and
the first size past the limit really breaks the model (so the limit is the model's, not a guess).

Sizes are kept tiny: a largest height goes with the smallest width, and Qwen-Image is loaded with a
text length that leaves its rotary table room for only a few token rows.
"""

import re

import pytest
import torch

from rollout.conditioning import Conditioning
from rollout.errors import InvalidRequestError
from rollout.models.base import ImageSizeLimits
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample

# Qwen-Image's transformer has 4096 rotary positions; the text takes this many of them.
QWEN_TEXT_LENGTH = 4090
QWEN_MAX_SIZE = 16 * (2 * (4096 - QWEN_TEXT_LENGTH) + 1)  # 13 token rows of 16 pixels


@pytest.fixture(scope="module")
def families(tiny_family_dirs):
    """Family -> the tiny pipeline; Qwen-Image both with its default text length and with a long one."""
    loaded = {name: load_pipeline(name, tiny_family_dirs[name], device="cpu") for name in ("sd3", "flux", "qwenimage")}
    loaded["qwenimage-long-text"] = load_pipeline(
        "qwenimage", tiny_family_dirs["qwenimage"], device="cpu", max_sequence_length=QWEN_TEXT_LENGTH
    )
    return loaded


@pytest.fixture(scope="module")
def all_pipelines(families, embedded_pipeline):
    return {**families, "embedded-digits": embedded_pipeline}


EXPECTED_LIMITS = {
    "sd3": ImageSizeLimits(16, 512, "its transformer's pos_embed_max_size 32 x patch 2 x VAE factor 8"),
    "flux": ImageSizeLimits(16),  # rotary embeddings computed from token ids of any size
    "qwenimage": ImageSizeLimits(
        16,
        16 * (2 * (4096 - 512) + 1),
        "its transformer's 4096 rotary positions less max_sequence_length 512 leave 7169 token rows of 16 pixels",
    ),
    "qwenimage-long-text": ImageSizeLimits(
        16,
        QWEN_MAX_SIZE,
        "its transformer's 4096 rotary positions less max_sequence_length 4090 leave 13 token rows of 16 pixels",
    ),
    "embedded-digits": ImageSizeLimits(16, 16, "it is trained on 16x16 digits only"),
}


@pytest.mark.parametrize("name", EXPECTED_LIMITS)
def test_each_family_reports_its_models_limits(all_pipelines, name):
    limits = all_pipelines[name].image_size_limits
    assert limits == EXPECTED_LIMITS[name]
    assert limits.describe() == {
        "multiple_of": limits.multiple,
        "max_size": limits.max_size,
        "max_size_bound_by": limits.bound_by,
    }


@pytest.mark.parametrize("name", ["sd3", "qwenimage-long-text"])
@pytest.mark.parametrize("field", ["height", "width"])
def test_a_size_past_the_limit_is_refused_before_sampling(families, name, field):
    pipeline = families[name]
    limits = pipeline.image_size_limits
    too_large = limits.max_size + limits.multiple
    size = {"height": limits.multiple, "width": limits.multiple, field: too_large}
    expected = (
        f"{field}: must be at most {limits.max_size} for model {pipeline.name!r} ({limits.bound_by}), got {too_large}"
    )
    transformer_calls = []
    hook = pipeline.transformer.register_forward_pre_hook(lambda module, args: transformer_calls.append(args))
    try:
        with pytest.raises(InvalidRequestError, match=re.escape(expected)) as raised:
            sample(pipeline, ["a cat"], [0], SamplingOptions(num_inference_steps=2, **size))
    finally:
        hook.remove()
    assert raised.value.field == field and transformer_calls == []


def test_the_embedded_model_refuses_any_other_size(embedded_pipeline):
    with pytest.raises(
        InvalidRequestError, match="width: the embedded digits model only produces 16x16 images, got 32"
    ):
        sample(embedded_pipeline, ["7"], [0], SamplingOptions(num_inference_steps=2, height=16, width=32))


def test_the_size_multiple_is_still_checked_first_for_its_field(families):
    with pytest.raises(InvalidRequestError, match="height: must be a multiple of 16 for model 'sd3', got 1000"):
        families["sd3"].latent_shape(1000, 16)


@pytest.mark.parametrize("name", ["sd3", "qwenimage-long-text"])
@pytest.mark.parametrize("field", ["height", "width"])
def test_the_largest_servable_size_samples(families, name, field):
    pipeline = families[name]
    limits = pipeline.image_size_limits
    size = {"height": limits.multiple, "width": limits.multiple, field: limits.max_size}
    batch = sample(pipeline, ["a cat"], [0], SamplingOptions(num_inference_steps=2, **size))
    assert batch.samples[0].image.shape == (3, size["height"], size["width"])
    assert torch.isfinite(batch.samples[0].image).all()


def test_past_sd3s_limit_its_transformer_really_fails(families):
    pipeline = families["sd3"]
    (bucket,) = pipeline.encode_prompts(["a cat"], [""], SamplingOptions(guidance_scale=1.0)).buckets
    positive = bucket.conditioning.pos_cond_kwargs

    def velocity(latent_rows: int) -> torch.Tensor:
        latents = torch.zeros(1, pipeline.latent_channels, latent_rows, 2)
        return pipeline.run_transformer(latents, torch.tensor([500.0]), **positive)

    most_rows = pipeline.image_size_limits.max_size // pipeline.vae_scale_factor
    assert velocity(most_rows).shape == (1, pipeline.latent_channels, most_rows, 2)
    with pytest.raises(ValueError, match="cannot be greater than `pos_embed_max_size`: 32"):
        velocity(most_rows + pipeline.patch_size)


def test_past_qwen_images_limit_its_rotary_table_really_runs_out(families):
    pipeline = families["qwenimage-long-text"]
    options = SamplingOptions(height=16, width=16)
    (bucket,) = pipeline.encode_prompts(["a cat"], [""], options).buckets
    # The bound is for the longest text the family pads to: max_sequence_length tokens, masked.
    text = bucket.conditioning.pos_cond_kwargs
    missing = QWEN_TEXT_LENGTH - text["encoder_hidden_states"].shape[1]
    positive = {
        "encoder_hidden_states": torch.nn.functional.pad(text["encoder_hidden_states"], (0, 0, 0, missing)),
        "encoder_hidden_states_mask": torch.nn.functional.pad(text["encoder_hidden_states_mask"], (0, missing)),
    }

    def velocity(token_rows: int) -> torch.Tensor:
        image = {"img_shapes": torch.tensor([[1, token_rows, 1]])}  # (frames, token rows, token columns)
        latents = torch.zeros(1, pipeline.latent_channels, 2 * token_rows, 2)
        return pipeline.predict_velocity(
            latents, torch.tensor([0.5]), Conditioning(image_kwargs=image, pos_cond_kwargs=positive), options
        )

    limits = pipeline.image_size_limits
    most_rows = limits.max_size // limits.multiple
    assert velocity(most_rows).shape == (1, pipeline.latent_channels, 2 * most_rows, 2)
    with pytest.raises(RuntimeError, match="must match the size"):  # the text's rotary embedding is cut short
        velocity(most_rows + 1)
