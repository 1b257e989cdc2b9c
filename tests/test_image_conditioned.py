"""Image-conditioned families (editing: FLUX.1-Kontext, Qwen-Image-Edit; reference images: FLUX.2;
image-to-video: Wan2.1-I2V, Wan2.2-I2V-A14B, Wan2.2-TI2V-5B given its first frame) through the
rollout library, on tiny random-weight copies saved as diffusers directories
(`rollout.testing.families`).

The reference is diffusers' own `pipeline(image=..., ...)`, sampling with the family's scheduler;
the condition is per prompt: encoded once, shared by the prompt's samples, and part of the exact
record a replay reads.
"""

import inspect
import types

import diffusers
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.wan import pipeline_wan_i2v
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout.dataset import RolloutDatasetWriter, load_rollouts
from rollout.errors import InvalidRequestError, ModelLoadError
from rollout.input_images import ImageInputLimits, decode_input_image
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline, resolve_model
from rollout.options import SamplingOptions
from rollout.plan import RequestLimits, checked_against_model
from rollout.replay import replay_log_probs
from rollout.sampler import sample_tree
from rollout.testing.families import CONDITIONED_FAMILIES, TINY_FAMILIES
from rollout.transitions import TransitionKind
from rollout.tree import Branching, TreeRoot
from rollout.weights import apply_update, tensor_update

SIZE = 32
STEPS = 2


def random_image(height: int, width: int, seed: int):
    pixels = torch.randint(0, 256, (3, height, width), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return decode_input_image(pixels, "image_path", ImageInputLimits())


# Aspect ratios that the pipelines resize to conditions of different sizes (token counts), at least
# 64 px a side (FLUX.2's pipeline refuses smaller images).
WIDE, TALL = random_image(72, 136, 0), random_image(136, 88, 1)


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here on one torch thread: the megapixel conditions' VAE encodes and the long
    texts' encoders run several times faster so on 2 cores (the bits compared are computed on
    the same thread count on both sides)."""


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


# How far a family's ODE path may be from its pipeline's (0: bit for bit), and why.
ODE_TOLERANCE = {
    # As Qwen-Image's (tests/test_real_families.py): each prompt is padded to its length bucket with
    # a mask, where the pipeline drops an all-ones mask (rollout/models/qwenimage_edit.py).
    "qwenimage_edit": 1e-5,
}


def reference_pipe(pipeline, monkeypatch, family: str):
    """The family's diffusers pipeline (the copy's `image_pipeline` made from it where its own takes
    no image) sampling with a fresh copy of the family's own scheduler (Wan's private Euler in
    place of its UniPC), and with `ftfy`, which Wan's image-to-video prompt cleaning calls
    unguarded, stubbed as the identity where it is not installed (the family cleans prompts as
    `WanPipeline` does: without it)."""
    pipe = pipeline.pipe
    if TINY_FAMILIES[family].image_pipeline is not None:
        pipe = getattr(diffusers, TINY_FAMILIES[family].image_pipeline).from_pipe(pipe)
    monkeypatch.setattr(pipe, "scheduler", FlowMatchEulerDiscreteScheduler.from_config(pipeline.scheduler.config))
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", types.SimpleNamespace(fix_text=lambda text: text), raising=False)
    return pipe


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
    reference = reference_pipe(alone, monkeypatch, family)
    # A pipeline without classifier-free guidance (FLUX.2's) takes no negative prompt.
    takes_negative = "negative_prompt" in inspect.signature(type(reference).__call__).parameters
    output = reference(
        prompt="make it red",
        **({"negative_prompt": negative or None} if takes_negative else {}),
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
        **TINY_FAMILIES[family].pipeline_arguments(WIDE.to_pil(), SIZE, SIZE),
        **frames,
        **guidance,
    )
    expected = (output.frames if TINY_FAMILIES[family].video else output.images).float()
    if expected.ndim == 3:  # packed tokens
        expected = alone.unpack(expected, *alone.latent_shape(SIZE, SIZE)[-2:])
    difference = (batch.samples[0].final_latents - expected[0]).abs().max().item()
    assert difference <= ODE_TOLERANCE.get(family, 0.0)


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
    # 72 x 136 px read as 64 x 128 (multiples of 16): the ratio 2 is nearest 720 x 1456's.
    height, width = pipeline.condition_size(WIDE)
    assert (height, width) == (720, 1456)
    assert image["condition_latents"].shape == (1, (height // 16) * (width // 16), 64)
    assert image["img_ids"].shape == (1, (SIZE // 16) ** 2, 3)
    assert torch.equal(image["condition_ids"][0, :, 0], torch.ones((height // 16) * (width // 16)))
    assert pipeline.condition_size(TALL) != (height, width)  # conditions of two sizes: two buckets


def test_flux2_crops_its_references_as_its_pipeline_and_puts_them_after_the_noise_at_their_own_time_ids(pipelines):
    pipeline = pipelines("flux2")
    # Under 1 MP: sides floored to 16 and the rest centre-cropped, in [-1, 1].
    pixels = pipeline.reference_pixels(WIDE)  # 72 x 136 px
    assert torch.equal(pixels[0], WIDE.pixels[:, 4:68, 4:132].float() / 255 * 2 - 1)
    # Over 1 MP: downscaled to 1024 x 1024 px of area (sides truncated), then floored to 16.
    assert pipeline.reference_pixels(random_image(1100, 1000, 2)).shape == (1, 3, 1072, 976)
    options = options_for("flux2")
    (bucket,) = pipeline.encode_prompts(["make it red"], [""], options, [(WIDE, TALL)]).buckets
    image = bucket.conditioning.image_kwargs
    wide, tall = (4, 8), (8, 5)  # token grids: 64 x 128 and 128 x 80 px
    tokens = wide[0] * wide[1] + tall[0] * tall[1]
    assert image["condition_latents"].shape == (1, tokens, pipeline.latent_channels)
    grid = lambda t, h, w: torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(1))
    assert torch.equal(image["condition_ids"][0], torch.cat([grid(10, *wide), grid(20, *tall)]))
    assert torch.equal(image["img_ids"][0], grid(0, SIZE // 16, SIZE // 16))
    text_ids = bucket.conditioning.pos_cond_kwargs["txt_ids"][0]
    assert torch.equal(text_ids, torch.cartesian_prod(*(torch.arange(1),) * 3, torch.arange(512)))
    # As many tokens on another grid (8 x 4): other ids, so another bucket (one set of ids a call).
    portrait = random_image(136, 72, 3)
    buckets = pipeline.encode_prompts(["a", "a"], ["", ""], options, [(WIDE,), (portrait,)]).buckets
    assert [len(b.rows) for b in buckets] == [1, 1]


@pytest.mark.parametrize("size", [(60, 200), (64, 600)], ids=["small", "narrow"])
def test_flux2_refuses_the_images_its_pipeline_refuses_naming_the_field(pipelines, size):
    expected = r"image_path\[1\]: .* (at least 64 px a side|aspect ratio at most 8:1)"
    roots = [TreeRoot("x", "", 1, images=(WIDE,)), TreeRoot("x", "", 1, images=(random_image(*size, 4),))]
    with pytest.raises(InvalidRequestError, match=expected):
        edit(pipelines("flux2"), roots, options_for("flux2"))


@pytest.mark.parametrize("images", [(), (WIDE, TALL)], ids=["text-to-image", "two-references"])
def test_flux2_without_and_with_two_references_reproduces_its_pipeline(pipelines, images):
    alone = pipelines("flux2", micro_batch_size=1)
    options = options_for("flux2", guided=True, sde_type=TransitionKind.ODE)
    batch = edit(alone, [TreeRoot("a cat", "", 13, images=images)], options)
    expected = alone.pipe(
        prompt="a cat",
        image=[image.to_pil() for image in images] or None,
        height=SIZE,
        width=SIZE,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(13),
        output_type="latent",
        **TINY_FAMILIES["flux2"].guided,
    ).images
    assert torch.equal(batch.samples[0].final_latents, alone.unpack(expected, SIZE // 16, SIZE // 16)[0])
    assert batch.schedule.sigmas[0] == 1.0 and torch.equal(
        batch.schedule.timesteps, alone.pipe.scheduler.timesteps
    )  # the pipeline's own schedule for this size and step count


def test_flux2_refuses_a_true_cfg_scale_its_pipeline_has_no_branch_for(pipelines):
    pipeline = pipelines("flux2")
    with pytest.raises(InvalidRequestError, match="true_cfg_scale: model 'flux2' runs no classifier-free guidance"):
        checked_against_model(pipeline, SamplingOptions(true_cfg_scale=2.0), ["a cat"], [""], 1, RequestLimits())
    options = checked_against_model(pipeline, SamplingOptions(true_cfg_scale=1.0), ["a cat"], [""], 1, RequestLimits())
    assert options.guidance_scale == pipeline.default_guidance_scale  # 1 is no guidance: served


def test_qwenimage_edit_conditions_at_1mp_after_the_noise_and_its_text_reads_the_image(pipelines):
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    from rollout.models.qwenimage_edit import most_condition_tokens

    pipeline = pipelines("qwenimage_edit")
    options = options_for("qwenimage_edit")
    (bucket,) = pipeline.encode_prompts(["make it red"], [""], options, [(WIDE,)]).buckets
    conditioning = bucket.conditioning
    # The image's ratio at about 1 MP, sides multiples of 32 (the pipeline's own function), whatever
    # the output size (32 px): 736 x 1408 px for 72 x 136.
    width, height, _ = calculate_dimensions(1024 * 1024, WIDE.width / WIDE.height)
    assert pipeline.condition_size(WIDE) == (height, width) == (736, 1408)
    assert conditioning.image_kwargs["condition_latents_1"].shape == (1, 16, height // 8, width // 8)
    (shapes,) = pipeline.transformer_inputs(conditioning)(conditioning.pos_cond_kwargs)["img_shapes"]
    assert shapes == [(1, SIZE // 16, SIZE // 16), (1, height // 16, width // 16)]
    assert pipeline.condition_tokens(conditioning).shape == (1, (height // 16) * (width // 16), 64)
    # The text encoder reads the image: the same prompt with another image encodes otherwise.
    (tall,) = pipeline.encode_prompts(["make it red"], [""], options, [(TALL,)]).buckets
    assert not torch.equal(
        conditioning.pos_cond_kwargs["encoder_hidden_states"], tall.conditioning.pos_cond_kwargs["encoder_hidden_states"]
    )
    # Rounding the sides can pass 1 MP: the bound counts it (1088 x 992 px at the ratio 1.1).
    assert most_condition_tokens(1024 * 1024) >= (1088 // 16) * (992 // 16) > 1024 * 1024 // 256
    with pytest.raises(InvalidRequestError, match="image_path: .* aspect ratio"):
        pipeline.encode_prompts(["x"], [""], options, [(random_image(1, 300, 2),)])


def without_env(samples):
    return [sample.__class__(**{**vars(sample), "denoising_env": None}) for sample in samples]


@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
def test_conditions_of_two_sizes_in_one_call_keep_each_samples_bits_and_replay_exactly_from_env_images_and_a_dataset(
    pipelines, family, tmp_path
):
    """One call of prompts conditioned on images of two sizes (and none, where the model allows it),
    checked as a trainer reads it: each sample is what it is alone (sampled again: the same bits),
    and its log-probs replay from the returned env, from its images encoded again, and from a
    dataset that keeps the images."""
    pipeline = pipelines(family)
    options = options_for(family, return_denoising_env=True)
    roots = [TreeRoot("make it red", "blurry", 5, images=(WIDE,)), TreeRoot("a hat", "", 6, images=(TALL,))]
    if pipeline.condition_images.least_per_prompt == 0:
        roots.append(TreeRoot("no image at all", "", 8))
    else:
        roots.append(TreeRoot("make it red", "", 7, images=(TALL,)))  # an image a second prompt shares
    together = edit(pipeline, roots, options)
    for root, sample in zip(roots, together.samples, strict=True):
        alone = edit(pipeline, [root], options).samples[0]
        assert torch.equal(alone.latents, sample.latents)
        assert torch.equal(alone.log_probs, sample.log_probs)
    log_probs = torch.stack([s.log_probs for s in together.samples])
    assert torch.equal(replay_log_probs(pipeline, together.schedule, together.options, together.samples).log_probs, log_probs)
    encoded_again = replay_log_probs(pipeline, together.schedule, together.options, without_env(together.samples))
    assert torch.equal(encoded_again.log_probs, log_probs)

    with RolloutDatasetWriter(tmp_path / "set") as writer:
        writer.write(together)
    _, (loaded,) = load_rollouts(tmp_path / "set")
    digests = [tuple(i.digest for i in s.condition_images) for s in loaded.samples]
    assert digests == [tuple(i.digest for i in root.images) for root in roots]
    assert torch.equal(loaded.samples[1].condition_images[0].pixels, TALL.pixels)
    assert torch.equal(replay_log_probs(pipeline, loaded.schedule, loaded.options, loaded.samples).log_probs, log_probs)


@pytest.mark.parametrize("family", ONE_WAN_LAYOUT)
def test_replay_in_bf16_from_the_returned_env_and_from_the_images_again_is_exact(pipelines, family):
    pipeline = pipelines(family, "bfloat16")
    options = options_for(family, guided=True, return_denoising_env=True)
    batch = edit(pipeline, [TreeRoot("make it red", "blurry", 3, images=(WIDE,))], options)
    from_env = replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples)
    assert torch.equal(from_env.log_probs, batch.samples[0].log_probs[None])
    encoded_again = replay_log_probs(pipeline, batch.schedule, batch.options, without_env(batch.samples))
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


# An adapter changes the denoiser, whatever its condition: the families whose tiny conditions are
# small show it for token (FLUX.2's references) and channel (Wan's) conditions, cheaply.
@pytest.mark.parametrize("family", ["flux2", "wan21_i2v"])
def test_an_edit_after_a_lora_update_replays_exactly_on_the_trainers_model(tiny_conditioned_dirs, family):
    served, trainer = (
        load_pipeline(
            TINY_FAMILIES[family].model, tiny_conditioned_dirs[family], device="cpu", micro_batching=MicroBatching(2)
        )
        for _ in range(2)
    )
    denoiser = trainer.weight_modules[trainer.experts[0]]
    denoiser.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in denoiser.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    apply_update(served.weight_modules, tensor_update(get_peft_model_state_dict(denoiser), lora_rank=4, lora_alpha=8))
    batch = edit(served, [TreeRoot("make it red", "blurry", 9, images=(WIDE,))], options_for(family, guided=True))
    replayed = replay_log_probs(trainer, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, batch.samples[0].log_probs[None])


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


def test_kontext_conditions_of_one_token_count_on_transposed_grids_keep_their_own_ids(pipelines):
    """A counterexample (found reading FLUX.2's bucketing): Kontext's 672x1568 and 1568x672
    resolutions have one token count, so their rows had one shape and shared a call that gave
    every row the first row's condition ids."""
    pipeline = pipelines("flux_kontext")
    options = options_for("flux_kontext")
    wide, tall = random_image(48, 112, 5), random_image(112, 48, 6)
    assert pipeline.condition_size(wide) == (672, 1568) and pipeline.condition_size(tall) == (1568, 672)
    roots = [TreeRoot("make it red", "", 1, images=(wide,)), TreeRoot("make it red", "", 2, images=(tall,))]
    together = edit(pipeline, roots, options).samples
    for root, sample in zip(roots, together):
        assert torch.equal(edit(pipeline, [root], options).samples[0].latents, sample.latents)


def test_ti2v_holds_its_image_as_latent_frame_0_at_time_0_and_equals_its_pipeline_at_several_tokens_a_frame(
    pipelines, monkeypatch
):
    """Wan2.2-TI2V-5B given an image (`WanImageToVideoPipeline` with `expand_timesteps`, on the same
    directory), at 64x96: frames of 2x3 tokens, so the time input's frame-0 tokens are told apart.
    The ODE path is the pipeline's bit for bit; every kept latent's frame 0 is the image's
    normalised latents; the transformer takes time 0 on frame 0's tokens and the step's time on
    the others."""
    family = "wan22_ti2v_image"
    alone = pipelines(family, micro_batch_size=1)
    height, width, frames = 64, 96, 9
    options = options_for(family, guided=True, height=height, width=width, num_frames=frames, sde_type=TransitionKind.ODE)
    times = []
    hook = alone.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: times.append(kwargs["timestep"].clone()), with_kwargs=True
    )
    try:
        sample = edit(alone, [TreeRoot("make it red", "blurry", 11, images=(WIDE,))], options).samples[0]
    finally:
        hook.remove()
    output = reference_pipe(alone, monkeypatch, family)(
        prompt="make it red",
        negative_prompt="blurry",
        image=WIDE.to_pil(),
        height=height,
        width=width,
        num_frames=frames,
        num_inference_steps=STEPS,
        generator=torch.Generator().manual_seed(11),
        output_type="latent",
        **TINY_FAMILIES[family].guided,
    )
    assert torch.equal(sample.final_latents, output.frames[0].float())

    pixels = alone.pipe.video_processor.preprocess(WIDE.to_pil(), height=height, width=width).unsqueeze(2)
    config = alone.vae.config
    mean, std = (torch.tensor(v).view(1, -1, 1, 1, 1) for v in (config.latents_mean, config.latents_std))
    image_latents = ((alone.vae.encode(pixels).latent_dist.mode() - mean) * (1.0 / std))[0]
    assert all(torch.equal(latent[:, :1], image_latents) for latent in sample.latents)
    assert not torch.equal(sample.latents[0][:, 1:], sample.latents[-1][:, 1:])  # the frames after it are sampled

    tokens_per_frame = (height // 32) * (width // 32)
    assert len(times) == 2 * STEPS  # both guidance branches at every step
    for step, time in enumerate(times[::2]):
        assert time.shape == (1, 3 * tokens_per_frame)
        assert not time[:, :tokens_per_frame].any()
        assert bool((time[:, tokens_per_frame:] == sample.schedule.model_timesteps[step]).all())


def test_ti2v_given_an_image_refuses_a_video_of_one_latent_frame_naming_num_frames(pipelines):
    pipeline = pipelines("wan22_ti2v_image")
    one_frame = options_for("wan22_ti2v_image", num_frames=1)
    with pytest.raises(InvalidRequestError, match="num_frames: must be at least 5 for model 'wan' given an image"):
        edit(pipeline, [TreeRoot("make it red", "", 1, images=(WIDE,))], one_frame)
    with pytest.raises(InvalidRequestError, match="num_frames: must be at least 5"):
        checked_against_model(pipeline, SamplingOptions(num_frames=1), ["x"], [""], 1, RequestLimits(), [(WIDE,)])
    assert len(edit(pipeline, [TreeRoot("no image", "", 1)], one_frame).samples) == 1  # text to one frame


def test_a_ti2v_directory_saved_as_an_image_to_video_pipeline_needs_an_image_and_gives_the_same_bits(
    pipelines, tmp_path
):
    """Wan2.2-TI2V-5B's weights saved as a `WanImageToVideoPipeline` (its `expand_timesteps` kept) are
    model `wan_i2v`: the same held first frame, and an image needed, as that pipeline needs one."""
    text_to_video = pipelines("wan22_ti2v_image")
    pipeline_wan_i2v.WanImageToVideoPipeline.from_pipe(text_to_video.pipe).save_pretrained(tmp_path / "ti2v_i2v")
    assert resolve_model(None, tmp_path / "ti2v_i2v")[0] == "wan_i2v"
    image_to_video = load_pipeline(None, tmp_path / "ti2v_i2v", device="cpu", micro_batching=MicroBatching(2))
    options = options_for("wan22_ti2v_image", sde_type=TransitionKind.SDE)
    root = TreeRoot("make it red", "", 4, images=(TALL,))
    assert torch.equal(edit(image_to_video, [root], options).samples[0].latents, edit(text_to_video, [root], options).samples[0].latents)
    with pytest.raises(InvalidRequestError, match=r"image_path\[0\]: .* takes 1 to 1 images per prompt, got 0"):
        edit(image_to_video, [TreeRoot("no image", "", 1)], options)
