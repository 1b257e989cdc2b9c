"""Image-conditioned families (editing: FLUX.1-Kontext; image-to-video: Wan2.1-I2V, Wan2.2-I2V-A14B)
through the rollout library, on tiny random-weight copies saved as diffusers directories
(`rollout.testing.families`).

The reference is diffusers' own `pipeline(image=..., ...)`, sampling with the family's scheduler;
the condition is per prompt: encoded once, shared by the prompt's samples, and part of the exact
record a replay reads.
"""

import types

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.wan import pipeline_wan_i2v

from rollout.dataset import RolloutDatasetWriter, load_rollouts
from rollout.errors import InvalidRequestError, ModelLoadError
from rollout.input_images import ImageInputLimits, decode_input_image
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline, resolve_model
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.sampler import sample_tree
from rollout.testing.families import CONDITIONED_FAMILIES, TINY_FAMILIES
from rollout.transitions import TransitionKind
from rollout.tree import Branching, TreeRoot

SIZE = 32
STEPS = 2


def random_image(height: int, width: int, seed: int):
    pixels = torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return decode_input_image(pixels, "image_path", ImageInputLimits())


# Aspect ratios that the pipeline resizes to conditions of different sizes (token counts).
WIDE, TALL = random_image(40, 72, 0), random_image(64, 24, 1)


@pytest.fixture(scope="module")
def pipelines(tiny_conditioned_dirs):
    cache = {}

    def load(family: str, dtype: str = "float32", micro_batch_size: int = 2):
        key = (family, dtype, micro_batch_size)
        if key not in cache:
            cache[key] = load_pipeline(
                TINY_FAMILIES[family].model,  # a copy's model (Wan's two image-to-video layouts are one)
                tiny_conditioned_dirs[family],
                device="cpu",
                dtype=getattr(torch, dtype),
                micro_batching=MicroBatching(micro_batch_size),
            )
        return cache[key]

    return load


def options_for(family: str, guided: bool = False, **fields) -> SamplingOptions:
    record = TINY_FAMILIES[family]
    guidance = record.guided if guided else record.unguided
    size = {"num_inference_steps": STEPS, "height": SIZE, "width": SIZE, "num_frames": record.frames}
    return SamplingOptions(**{**size, **guidance, **fields})


# What each family's diffusers pipeline is given besides the prompts, the size, the steps, the
# generator and the guidance, for the request's output size and `image` (a PIL image).
PIPELINE_ARGUMENTS = {
    # The request's size is the output size (rollout/models/flux_kontext.py).
    "flux_kontext": lambda image: {"image": image, "max_area": SIZE * SIZE},
    # The image is stretched to the output size (rollout/models/wan_i2v.py).
    "wan21_i2v": lambda image: {"image": image},
    "wan22_i2v_a14b": lambda image: {"image": image},
}


def reference_pipe(pipeline, monkeypatch):
    """The family's diffusers pipeline sampling with a fresh copy of the family's own scheduler
    (Wan's private Euler in place of its UniPC), and with `ftfy`, which Wan's image-to-video
    prompt cleaning calls unguarded, stubbed as the identity where it is not installed (the
    family cleans prompts as `WanPipeline` does: without it)."""
    monkeypatch.setattr(pipeline.pipe, "scheduler", FlowMatchEulerDiscreteScheduler.from_config(pipeline.scheduler.config))
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)
    return pipeline.pipe


# Wan2.2-I2V-A14B takes Wan2.1-I2V's condition on two experts (which tests/test_video_families.py
# tests): its copy runs the ODE test alone, so the two Wan copies take little of this file's time.
ONE_WAN_LAYOUT = [name for name in CONDITIONED_FAMILIES if name != "wan22_i2v_a14b"]
WAN_I2V = [name for name in CONDITIONED_FAMILIES if TINY_FAMILIES[name].model == "wan_i2v"]


def edit(pipeline, roots, options):
    return sample_tree(pipeline, roots, options).batch


@pytest.mark.parametrize("family", CONDITIONED_FAMILIES)
@pytest.mark.parametrize("guided", [False, True], ids=["unguided", "guided"])
def test_the_ode_path_reproduces_the_diffusers_pipeline_given_the_same_image(pipelines, family, guided, monkeypatch):
    alone = pipelines(family, micro_batch_size=1)  # the pipeline's own calls, row for row
    options = options_for(family, guided, sde_type=TransitionKind.ODE)
    negative = "blurry" if guided else ""
    batch = edit(alone, [TreeRoot("make it red", negative, 11, images=(WIDE,))], options)
    guidance = TINY_FAMILIES[family].guided if guided else TINY_FAMILIES[family].unguided
    frames = {"num_frames": TINY_FAMILIES[family].frames} if TINY_FAMILIES[family].video else {}
    output = reference_pipe(alone, monkeypatch)(
        prompt="make it red",
        negative_prompt=negative or None,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
        **PIPELINE_ARGUMENTS[family](WIDE.to_pil()),
        **frames,
        **guidance,
    )
    expected = (output.frames if TINY_FAMILIES[family].video else output.images).float()
    if expected.ndim == 3:  # packed tokens
        expected = alone.unpack(expected, SIZE // 8, SIZE // 8)
    assert torch.equal(batch.samples[0].final_latents, expected[0])


@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
def test_the_condition_is_encoded_once_per_prompt_and_shared_by_its_samples(pipelines, family):
    pipeline = pipelines(family)
    encodes = []
    encode = pipeline.vae.encode  # a video VAE runs its encoder once per chunk of frames: count the encodes

    def counted(pixels, *args, **kwargs):
        encodes.append(pixels.shape)
        return encode(pixels, *args, **kwargs)

    pipeline.vae.encode = counted
    try:
        options = options_for(family, return_denoising_env=True)
        roots = [TreeRoot("make it red", "", seed, images=(WIDE,)) for seed in range(4)]
        batch = edit(pipeline, roots, options)
    finally:
        del pipeline.vae.encode
    assert len(encodes) == 1  # four samples of one prompt and image: one VAE encode
    envs = {id(sample.denoising_env) for sample in batch.samples}
    assert len(envs) == 1  # held once for the prompt, not copied per sample
    assert all(sample.condition_images == (WIDE,) for sample in batch.samples)
    env = batch.samples[0].denoising_env
    assert set(env["image_kwargs"]) == TINY_FAMILIES[family].inputs.image


def test_kontext_resizes_the_condition_to_its_preferred_resolution_and_puts_its_tokens_after_the_noise(pipelines):
    pipeline = pipelines("flux_kontext")
    (bucket,) = pipeline.encode_prompts(["make it red"], [""], options_for("flux_kontext"), [(WIDE,)]).buckets
    image = bucket.conditioning.image_kwargs
    # 40 x 72 px read as 32 x 64 (multiples of 16): the ratio 2 is nearest 720 x 1456's.
    height, width = pipeline.condition_size(WIDE)
    assert (height, width) == (720, 1456)
    assert image["condition_latents"].shape == (1, (height // 16) * (width // 16), 64)
    assert image["img_ids"].shape == (1, (SIZE // 16) ** 2, 3)
    assert torch.equal(image["condition_ids"][0, :, 0], torch.ones((height // 16) * (width // 16)))
    assert pipeline.condition_size(TALL) != (height, width)  # conditions of two sizes: two buckets

@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
def test_conditions_of_two_sizes_in_one_call_keep_each_samples_bits(pipelines, family):
    pipeline = pipelines(family)
    options = options_for(family, guided=True)
    roots = [
        TreeRoot("make it red", "blurry", 5, images=(WIDE,)),
        TreeRoot("a hat", "", 6, images=(TALL,)),
        TreeRoot("make it red", "blurry", 7, images=(TALL,)),
    ]
    if pipeline.condition_images.least_per_prompt == 0:
        roots.append(TreeRoot("no image at all", "", 8))
    together = edit(pipeline, roots, options)
    for root, sample in zip(roots, together.samples):
        alone = edit(pipeline, [root], options).samples[0]
        assert torch.equal(alone.latents, sample.latents)
        assert torch.equal(alone.log_probs, sample.log_probs)
    again = edit(pipeline, roots, options)  # seeded: the same request gives the same bits
    assert all(torch.equal(a.image, b.image) for a, b in zip(together.samples, again.samples))


@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_from_the_returned_env_and_from_the_images_again_is_exact(pipelines, family, dtype):
    pipeline = pipelines(family, dtype)
    options = options_for(family, guided=True, return_denoising_env=True)
    roots = [TreeRoot("make it red", "blurry", 3, images=(WIDE,)), TreeRoot("a hat", "", 4, images=(TALL,))]
    batch = edit(pipeline, roots, options)
    from_env = replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples)
    assert torch.equal(from_env.log_probs, torch.stack([s.log_probs for s in batch.samples]))
    without_env = [sample.__class__(**{**vars(sample), "denoising_env": None}) for sample in batch.samples]
    encoded_again = replay_log_probs(pipeline, batch.schedule, batch.options, without_env)
    assert torch.equal(encoded_again.log_probs, from_env.log_probs)


@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
def test_a_tree_grows_from_one_edit_prompt_and_a_leaf_regrows_alone(pipelines, family):
    pipeline = pipelines(family)
    options = options_for(family, sde_type=TransitionKind.SDE, num_inference_steps=3)
    branching = Branching((1,), (2,))
    leaves = edit(pipeline, [TreeRoot("make it red", "", 20, branching, images=(WIDE,))], options).samples
    assert len(leaves) == 2 and not torch.equal(leaves[0].final_latents, leaves[1].final_latents)
    alone = edit(pipeline, [TreeRoot.of_leaf(leaves[1])], options).samples[0]
    assert torch.equal(alone.latents, leaves[1].latents)


@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
def test_a_dataset_keeps_the_condition_images_for_a_replay(pipelines, family, tmp_path):
    pipeline = pipelines(family)
    options = options_for(family)
    batch = edit(pipeline, [TreeRoot("make it red", "", 1, images=(WIDE,)), TreeRoot("a hat", "", 2, images=(TALL,))], options)
    with RolloutDatasetWriter(tmp_path / "set") as writer:
        writer.write(batch)
    _, (loaded,) = load_rollouts(tmp_path / "set")
    assert [tuple(i.digest for i in s.condition_images) for s in loaded.samples] == [(WIDE.digest,), (TALL.digest,)]
    assert torch.equal(loaded.samples[1].condition_images[0].pixels, TALL.pixels)
    replayed = replay_log_probs(pipeline, loaded.schedule, loaded.options, loaded.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))


@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
def test_more_images_than_the_model_takes_are_refused_naming_the_field(pipelines, family):
    pipeline = pipelines(family)
    rule = pipeline.condition_images
    expected = rf"image_path\[0\]: .* takes {rule.least_per_prompt} to {rule.most_per_prompt} images per prompt, got "
    with pytest.raises(InvalidRequestError, match=expected + str(rule.most_per_prompt + 1)):
        edit(pipeline, [TreeRoot("x", "", 1, images=(WIDE,) * (rule.most_per_prompt + 1))], options_for(family))


def test_a_text_to_image_model_refuses_an_input_image():
    pipeline = load_pipeline(device="cpu")
    with pytest.raises(InvalidRequestError, match="image_path: .* takes no input image"):
        sample_tree(pipeline, [TreeRoot("3", "", 1, images=(WIDE,))], SamplingOptions(num_inference_steps=2))


@pytest.mark.parametrize("family", WAN_I2V)
def test_wan_takes_the_mask_and_the_condition_after_the_latents_along_channels(pipelines, family):
    pipeline = pipelines(family)
    options = options_for(family, guided=True)
    (bucket,) = pipeline.encode_prompts(["make it red"], ["blurry"], options, [(WIDE,)]).buckets
    image = bucket.conditioning.image_kwargs
    channels, frames, height, width = pipeline.latent_shape(SIZE, SIZE, TINY_FAMILIES[family].frames)
    assert image["condition_mask"].shape == (1, 4, frames, height, width)  # the VAE's 4 frames per latent frame
    assert torch.equal(image["condition_mask"][:, :, 0], torch.ones(1, 4, height, width))  # the given first frame
    assert not image["condition_mask"][:, :, 1:].any()
    # The image stretched to the output size, first of a video of zeros, encoded whole and normalised.
    first = pipeline.pipe.video_processor.preprocess(WIDE.to_pil(), height=SIZE, width=SIZE)
    video = torch.cat([first.unsqueeze(2), torch.zeros(1, 3, TINY_FAMILIES[family].frames - 1, SIZE, SIZE)], dim=2)
    config = pipeline.vae.config
    latents = pipeline.vae.encode(video).latent_dist.mode()
    mean, std = (torch.tensor(v).view(1, channels, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
    assert torch.equal(image["condition_latents"], (latents - mean) * (1.0 / std))
    with_clip = TINY_FAMILIES[family].inputs.image >= {"encoder_hidden_states_image"}
    assert ("encoder_hidden_states_image" in image) == with_clip
    if with_clip:  # Wan2.1: CLIP's penultimate hidden states of the image as given, 16 patches and the class token
        assert image["encoder_hidden_states_image"].shape == (1, 17, 24)

    inputs = []
    hook = pipeline.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: inputs.append(kwargs["hidden_states"]), with_kwargs=True
    )
    try:
        x_t = torch.randn((2, channels, frames, height, width), generator=torch.Generator().manual_seed(0))
        rows = bucket.conditioning.map(lambda t: torch.cat([t, t]))
        pipeline.predict_velocity(x_t, torch.full((2,), 999.0), rows, options)
    finally:
        hook.remove()
    assert len(inputs) == 2  # the positive and the negative branch, each with the same condition
    for hidden_states in inputs:
        assert hidden_states.shape == (2, 2 * channels + 4, frames, height, width)
        assert torch.equal(hidden_states[:, :channels], x_t)
        assert torch.equal(hidden_states[:, channels : channels + 4], torch.cat([image["condition_mask"]] * 2))
        assert torch.equal(hidden_states[:, channels + 4 :], torch.cat([image["condition_latents"]] * 2))


@pytest.mark.parametrize("family", WAN_I2V[:1])
def test_wan_encodes_the_condition_for_each_requests_size_and_frames_and_needs_an_image(pipelines, family):
    pipeline = pipelines(family)
    conditions = {
        (size, frames): pipeline.encode_images((WIDE,), options_for(family, height=size, width=size, num_frames=frames))
        for size, frames in ((SIZE, 5), (SIZE, 1), (2 * SIZE, 5))
    }
    assert conditions[(SIZE, 5)]["condition_latents"].shape[2:] == (2, SIZE // 8, SIZE // 8)
    assert conditions[(SIZE, 1)]["condition_latents"].shape[2:] == (1, SIZE // 8, SIZE // 8)
    assert conditions[(2 * SIZE, 5)]["condition_latents"].shape[2:] == (2, SIZE // 4, SIZE // 4)
    with pytest.raises(InvalidRequestError, match=r"image_path\[0\]: .* takes 1 to 1 images per prompt, got 0"):
        edit(pipeline, [TreeRoot("no image", "", 1)], options_for(family))


def test_wan21_i2v_refuses_a_text_length_its_attention_would_cut_wrongly(tiny_conditioned_dirs):
    with pytest.raises(ModelLoadError, match="model.max_sequence_length: must be 512"):
        load_pipeline("wan_i2v", tiny_conditioned_dirs["wan21_i2v"], device="cpu", max_sequence_length=16)


@pytest.mark.parametrize("family", WAN_I2V)
def test_a_wan_image_to_video_directory_is_read_as_its_model_from_model_index(tiny_conditioned_dirs, family):
    path = tiny_conditioned_dirs[family]
    assert resolve_model(None, path) == ("wan_i2v", path)
    with pytest.raises(ModelLoadError, match="holds a WanImageToVideoPipeline, not the WanPipeline of model 'wan'"):
        resolve_model("wan", path)
