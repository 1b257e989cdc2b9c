"""Wan2.1, Wan2.2 (both layouts) and LTX-Video through the rollout library, on tiny random-weight
copies saved as diffusers directories (`rollout.testing.families`) and loaded by the real loading
code.

The reference is diffusers' own pipeline: `WanPipeline(...)` with its UniPC scheduler swapped for
the flow-matching Euler scheduler at the checkpoint's `flow_shift`, and `LTXPipeline(...)` as it
is. The rollout's ODE path must reproduce it exactly, latents and frames.
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline, WanPipeline
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout.errors import InvalidRequestError, ModelLoadError
from rollout.kernels import BatchInvariance
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline, resolve_model
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.models.wan import WanFamily
from rollout.sampler import sample
from rollout.testing.families import TINY_FAMILIES, VIDEO_FAMILIES
from rollout.video import frames_as_uint8, write_mp4
from rollout.weights import apply_update, tensor_update, weights_checksum
from tests.test_real_families import assert_costed_as_run
from tests.test_transitions import reference_log_prob, reference_step

WAN_LAYOUTS = [name for name in VIDEO_FAMILIES if TINY_FAMILIES[name].family is WanFamily]
TEXT_LENGTH = 16
# Steps whose timesteps fall on both sides of Wan2.2-A14B's boundary (875) at shift 3.
STEPS = 4


def frame_size(layout: str) -> tuple[int, int]:
    """A small (height, width) the layout can make: two by three transformer tokens."""
    token_pixels = TINY_FAMILIES[layout].token_pixels
    return 2 * token_pixels, 3 * token_pixels


def frames_of(layout: str) -> int:
    return TINY_FAMILIES[layout].frames


@pytest.fixture(scope="module")
def pipelines(tiny_video_dirs):
    cache = {}

    def load(
        layout: str, dtype: str = "float32", micro_batch_size: int = 2, invariance: BatchInvariance = BatchInvariance.PADDING
    ):
        key = (layout, dtype, micro_batch_size, invariance)
        if key not in cache:
            cache[key] = load_pipeline(
                None,
                tiny_video_dirs[layout],
                device="cpu",
                dtype=getattr(torch, dtype),
                micro_batching=MicroBatching(micro_batch_size, invariance=invariance),
                max_sequence_length=TEXT_LENGTH,
            )
        return cache[key]

    return load


def options_for(layout: str, **fields) -> SamplingOptions:
    height, width = frame_size(layout)
    return SamplingOptions(num_inference_steps=STEPS, height=height, width=width, num_frames=frames_of(layout), **fields)


def euler_pipeline(path) -> WanPipeline:
    pipe = WanPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    return pipe


@pytest.mark.parametrize("layout", WAN_LAYOUTS)
@pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
def test_the_ode_path_reproduces_the_diffusers_pipeline_with_its_euler_scheduler(pipelines, tiny_video_dirs, layout, guided):
    pipeline = pipelines(layout, micro_batch_size=1)
    record = TINY_FAMILIES[layout]
    scale = record.guided if guided else record.unguided
    negative = "blurry" if guided else ""
    options = options_for(layout, sde_type="ode", **scale)
    (rollout,) = sample(pipeline, ["a cat sitting on a red chair"], [11], options, negative_prompts=[negative]).samples

    height, width = frame_size(layout)
    call = dict(
        prompt="a cat sitting on a red chair",
        negative_prompt=negative,
        height=height,
        width=width,
        num_frames=frames_of(layout),
        num_inference_steps=STEPS,
        max_sequence_length=TEXT_LENGTH,
        **scale,
    )
    pipe = euler_pipeline(tiny_video_dirs[layout])
    latents = pipe(**call, generator=torch.Generator().manual_seed(11), output_type="latent").frames[0]
    frames = pipe(**call, generator=torch.Generator().manual_seed(11), output_type="pt").frames[0]
    assert torch.equal(rollout.final_latents, latents)
    # The pipeline's frames are (F, C, H, W); a row's are SGLang's (C, F, H, W).
    assert rollout.image.shape == (3, frames_of(layout), height, width)
    assert torch.equal(rollout.image, frames.permute(1, 0, 2, 3))


@pytest.mark.parametrize("layout", [name for name in VIDEO_FAMILIES if TINY_FAMILIES[name].tiled_size])
def test_video_vaes_decode_in_their_own_tiles_as_the_pipeline_with_tiling_does(tiny_video_dirs, layout):
    path = tiny_video_dirs[layout]
    tiled = load_pipeline(None, path, device="cpu", micro_batching=MicroBatching(1), max_sequence_length=TEXT_LENGTH)
    untiled = load_pipeline(None, path, device="cpu", max_sequence_length=TEXT_LENGTH, vae_tiling=False)
    assert tiled.vae_tiling and not untiled.vae_tiling
    height, width = TINY_FAMILIES[layout].tiled_size  # above the VAE's tile size: tiles are decoded and blended
    # One frame (1 = 4k + 1 = 8k + 1): the tiles are spatial, and a frame is what they cut.
    options = SamplingOptions(
        num_inference_steps=2, height=height, width=width, num_frames=1, sde_type="ode", guidance_scale=1.0
    )  # fmt: skip
    (rollout,) = sample(tiled, ["a cat"], [3], options).samples

    is_wan = TINY_FAMILIES[layout].family is WanFamily
    pipe = euler_pipeline(path) if is_wan else LTXPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    pipe.vae.enable_tiling()
    frames = pipe(
        prompt="a cat", negative_prompt="", height=height, width=width, num_frames=1,
        num_inference_steps=2, guidance_scale=1.0, max_sequence_length=TEXT_LENGTH,
        generator=torch.Generator().manual_seed(3), output_type="pt",
    ).frames[0]  # fmt: skip
    assert torch.equal(rollout.image, frames.permute(1, 0, 2, 3))
    # The tiles were blended: untiled, the same latents decode to other bits.
    assert not torch.equal(untiled.decode(rollout.final_latents[None])[0], rollout.image)


def test_image_families_decode_untiled_unless_asked(tiny_family_dirs):
    assert not load_pipeline("sd3", tiny_family_dirs["sd3"], device="cpu").vae.use_tiling
    assert load_pipeline("sd3", tiny_family_dirs["sd3"], device="cpu", vae_tiling=True).vae.use_tiling
    with pytest.raises(ModelLoadError, match="the embedded model has no VAE") as refused:
        load_pipeline(vae_tiling=True)
    assert refused.value.field == "model.vae_tiling"


@pytest.mark.parametrize("layout", WAN_LAYOUTS)
def test_the_schedule_is_the_private_euler_schedulers_own(pipelines, tiny_video_dirs, layout):
    pipeline = pipelines(layout)
    flow_shift = json.loads((tiny_video_dirs[layout] / "scheduler" / "scheduler_config.json").read_text())["flow_shift"]
    scheduler = FlowMatchEulerDiscreteScheduler(shift=flow_shift)
    scheduler.set_timesteps(10)
    schedule = pipeline.schedule(10, *frame_size(layout))
    assert torch.equal(schedule.sigmas, scheduler.sigmas) and schedule.sigmas[-1] == 0
    assert torch.equal(schedule.timesteps, scheduler.timesteps)
    assert torch.equal(schedule.model_timesteps, scheduler.timesteps)  # Wan's time input: the timesteps
    assert schedule.sigmas is not pipeline.scheduler.sigmas
    if layout == "wan22_a14b":
        expected = (scheduler.timesteps < 0.875 * 1000).to(torch.int64)  # transformer_2 below the boundary
        assert torch.equal(schedule.model_experts, expected) and 0 < expected.sum() < 10
        assert pipeline.experts == ("transformer", "transformer_2")
    else:
        assert schedule.model_experts is None and pipeline.experts == ("transformer",)


@pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
def test_ltx_videos_ode_path_is_its_pipelines_own(pipelines, tiny_video_dirs, guided):
    pipeline = pipelines("ltx", micro_batch_size=1)
    scale = 3.0 if guided else 1.0
    options = options_for("ltx", sde_type="ode", guidance_scale=scale, fps=24)
    (rollout,) = sample(pipeline, ["a cat sitting on a red chair"], [11], options, negative_prompts=["blurry"]).samples
    height, width = frame_size("ltx")
    pipe = LTXPipeline.from_pretrained(tiny_video_dirs["ltx"], local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    call = dict(
        prompt="a cat sitting on a red chair", negative_prompt="blurry", height=height, width=width,
        num_frames=frames_of("ltx"), frame_rate=24, num_inference_steps=STEPS, guidance_scale=scale,
        max_sequence_length=TEXT_LENGTH,
    )  # fmt: skip
    tokens = pipe(**call, generator=torch.Generator().manual_seed(11), output_type="latent").frames
    frames = pipe(**call, generator=torch.Generator().manual_seed(11), output_type="pt").frames[0]
    latent_shape = pipeline.latent_shape(height, width, frames_of("ltx"))
    assert torch.equal(rollout.final_latents, pipe._unpack_latents(tokens, *latent_shape[1:])[0])
    assert rollout.image.shape == (3, frames_of("ltx"), height, width)
    assert torch.equal(rollout.image, frames.permute(1, 0, 2, 3))


def test_ltx_videos_schedule_is_its_schedulers_own_for_the_videos_token_count(pipelines):
    """Dynamic shift over frames x rows x columns of latent tokens, then stretched to 0.1."""
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    pipeline = pipelines("ltx")
    height, width = frame_size("ltx")
    schedules = {}
    for frames in (9, 33):
        _, latent_frames, rows, columns = pipeline.latent_shape(height, width, frames)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipeline.scheduler.config)
        config = scheduler.config
        mu = calculate_shift(latent_frames * rows * columns, config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)  # fmt: skip
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 10, 10), mu=mu)
        schedules[frames] = pipeline.schedule(10, height, width, frames)
        assert torch.equal(schedules[frames].sigmas, scheduler.sigmas)
        assert torch.equal(schedules[frames].model_timesteps, scheduler.timesteps)
        assert math.isclose(schedules[frames].sigmas[-2].item(), 0.1, rel_tol=1e-5)
    assert not torch.equal(schedules[9].sigmas, schedules[33].sigmas)  # more frames, more shift


def test_ltx_videos_frame_rate_is_a_model_input_kept_for_replay(pipelines):
    pipeline = pipelines("ltx")
    at = {fps: sample(pipeline, ["a cat"], [4], options_for("ltx", fps=fps, return_denoising_env=True)) for fps in (12, 24)}
    assert not torch.equal(at[12].samples[0].final_latents, at[24].samples[0].final_latents)
    (video,) = at[12].samples
    assert video.denoising_env["image_kwargs"]["frame_rate"].item() == 12
    assert torch.equal(replay_log_probs(pipeline, at[12].schedule, at[12].options, [video]).log_probs[0], video.log_probs)


@pytest.mark.parametrize("layout", VIDEO_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_equals_the_rollout_exactly(pipelines, layout, dtype):
    pipeline = pipelines(layout, dtype)
    options = options_for(layout, return_denoising_env=True, **TINY_FAMILIES[layout].guided)
    batch = sample(pipeline, ["a cat", "a dog in the garden"], [1, 2], options, negative_prompts=["dark", ""])
    if layout == "wan22_a14b":
        assert set(batch.schedule.model_experts.tolist()) == {0, 1}  # steps on both sides of the boundary
    rollout_log_probs = torch.stack([s.log_probs for s in batch.samples])
    assert torch.isfinite(rollout_log_probs).all()
    from_env = replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples)
    assert torch.equal(from_env.log_probs, rollout_log_probs)
    without_env = [type(s)(**{**s.__dict__, "denoising_env": None}) for s in batch.samples]
    assert torch.equal(replay_log_probs(pipeline, batch.schedule, batch.options, without_env).log_probs, rollout_log_probs)


def test_a_two_expert_replay_needs_the_recorded_experts(pipelines):
    pipeline = pipelines("wan22_a14b")
    batch = sample(pipeline, ["a cat"], [3], options_for("wan22_a14b"))
    schedule = batch.schedule
    rebuilt = type(schedule)(schedule.sigmas, schedule.timesteps, schedule.model_timesteps)
    with pytest.raises(InvalidRequestError, match="model_experts"):
        replay_log_probs(pipeline, rebuilt, batch.options, batch.samples)
    # The experts are used, not decoration: running every step on the high-noise expert changes the log-probs.
    high_only = type(schedule)(
        schedule.sigmas, schedule.timesteps, schedule.model_timesteps, torch.zeros_like(schedule.model_experts)
    )
    replayed = replay_log_probs(pipeline, high_only, batch.options, batch.samples).log_probs[0]
    low_steps = schedule.model_experts.bool()
    assert torch.equal(replayed[~low_steps], batch.samples[0].log_probs[~low_steps])
    assert not torch.equal(replayed[low_steps], batch.samples[0].log_probs[low_steps])


@pytest.mark.parametrize("invariance", list(BatchInvariance), ids=lambda invariance: invariance.value)
@pytest.mark.parametrize("layout", VIDEO_FAMILIES)
def test_a_video_is_the_same_alone_and_in_a_batch(pipelines, layout, invariance):
    # Micro-batches of 2: with padding the batch of 3 pads its second call; under the kernels
    # LTX-Video's guided rows run in pairs, Wan's branches in calls of their own.
    pipeline = pipelines(layout, invariance=invariance)
    options = options_for(layout, debug=True, **TINY_FAMILIES[layout].guided)
    alone = sample(pipeline, ["a cat"], [7], options).samples[0]
    batched = sample(pipeline, ["a dog", "a cat", "a red chair"], [8, 7, 9], options).samples[1]
    for name in ("final_latents", "latents", "log_probs", "image"):
        assert torch.equal(getattr(alone, name), getattr(batched, name)), name
    assert torch.equal(alone.debug.model_outputs, batched.debug.model_outputs)


def test_sde_log_probs_follow_the_flow_grpo_formula(pipelines):
    pipeline = pipelines("wan22_a14b")
    batch = sample(pipeline, ["a cat"], [5], options_for("wan22_a14b", guidance_scale=3.0, debug=True))
    (video,) = batch.samples
    sigmas = batch.schedule.sigmas.double().numpy()
    latents, velocities = video.latents.double().numpy(), video.debug.model_outputs.double().numpy()
    for step in range(STEPS):
        mean, noise_std, _ = reference_step(
            "sde", latents[step], velocities[step], sigmas[step], sigmas[step + 1], 0.7, sigmas[1], 0
        )
        expected = reference_log_prob(latents[step + 1][None], mean[None], noise_std, "gaussian")[0]
        assert math.isclose(video.log_probs[step].item(), expected, rel_tol=1e-4, abs_tol=1e-4), step


def test_frame_counts_the_model_cannot_make_are_refused_before_sampling(pipelines, tiny_family_dirs):
    pipeline = pipelines("wan21")
    height, width = frame_size("wan21")
    assert pipeline.latent_shape(height, width, 1) == (16, 1, height // 8, width // 8)  # 4k + 1 with k = 0
    assert pipeline.latent_shape(height, width, 9)[1] == 3
    for frames in (4, 6, 80):
        with pytest.raises(InvalidRequestError, match="num_frames.*must be 4k \\+ 1") as refused:
            sample(pipeline, ["a cat"], [0], SamplingOptions(height=height, width=width, num_frames=frames))
        assert refused.value.field == "num_frames"
    with pytest.raises(InvalidRequestError, match="num_frames.*at most 4093"):
        pipeline.latent_shape(height, width, 4 * 1024 + 1)
    with pytest.raises(InvalidRequestError, match="height.*multiple of 16"):
        pipeline.latent_shape(40, width, 5)
    with pytest.raises(InvalidRequestError, match="num_frames.*must be 8k \\+ 1 for model 'ltx'"):
        pipelines("ltx").latent_shape(*frame_size("ltx"), 5)
    image_model = load_pipeline("sd3", tiny_family_dirs["sd3"], device="cpu")
    with pytest.raises(InvalidRequestError, match="'sd3' generates images: must be 1, got 5") as refused:
        sample(image_model, ["a cat"], [0], SamplingOptions(height=64, width=64, num_frames=5))
    assert refused.value.field == "num_frames"


def test_the_family_is_read_from_model_index(tiny_video_dirs):
    for layout, path in tiny_video_dirs.items():
        assert resolve_model(None, path) == (TINY_FAMILIES[layout].model, path)


@pytest.mark.parametrize("experts", [["transformer_2"], ["transformer", "transformer_2"]], ids=["low-noise", "both"])
def test_a_lora_update_on_one_expert_or_both_replays_exactly(tiny_video_dirs, experts):
    served, trainer = (
        load_pipeline(None, tiny_video_dirs["wan22_a14b"], device="cpu", max_sequence_length=TEXT_LENGTH)
        for _ in range(2)
    )
    base = {name: weights_checksum(module) for name, module in served.weight_modules.items()}
    generator = torch.Generator().manual_seed(0)
    for name in experts:
        module = trainer.weight_modules[name]
        module.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]))
        with torch.no_grad():
            for parameter_name, parameter in module.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
        update = tensor_update(get_peft_model_state_dict(module), target_modules=[name], lora_rank=4, lora_alpha=8)
        apply_update(served.weight_modules, update)
    for name, module in served.weight_modules.items():
        changed = weights_checksum(module) != base[name]
        assert changed == (name in experts), name

    options = options_for("wan22_a14b", guidance_scale=3.0)
    batch = sample(served, ["a cat", "a dog"], [0, 1], options)
    replayed = replay_log_probs(trainer, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))


def test_a_video_is_written_as_an_h264_mp4_close_to_its_frames(pipelines, tmp_path):
    av = pytest.importorskip("av")  # the `video` extra, which the set-up installs
    pipeline = pipelines("wan21")
    videos = sample(pipeline, ["a cat", "a dog"], [0, 1], options_for("wan21", sde_type="ode")).samples
    path = write_mp4(videos[0].image, tmp_path / "cat.mp4", fps=8)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "h264" and stream.average_rate == 8
        decoded = torch.tensor(np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]))
    height, width = frame_size("wan21")
    assert decoded.shape == (frames_of("wan21"), height, width, 3)
    # Lossy (yuv420p keeps colour at a quarter of the pixels, which on these noise-like frames costs
    # most), but by brightness its own frames, not another video's.
    brightness = decoded.float().mean(-1)
    own, other = (frames_as_uint8(v.image).float().mean(0) for v in videos)  # [F, H, W]
    assert (brightness - own).abs().mean() < 0.5 * (brightness - other).abs().mean()
    with pytest.raises(InvalidRequestError, match="fps"):
        write_mp4(videos[0].image, tmp_path / "bad.mp4", fps=0)


def test_uint8_frames_round_to_the_nearest_level():
    frames = torch.tensor([0.0, 0.5 / 255, 0.6 / 255, 0.5, 1.0, 1.2, -0.1]).view(1, 7, 1, 1).expand(3, 7, 1, 1)
    assert frames_as_uint8(frames)[0, :, 0, 0].tolist() == [0, 0, 1, 128, 255, 255, 0]
    with pytest.raises(ValueError, match=r"\[3, F, H, W\]"):
        frames_as_uint8(torch.zeros(3, 8, 8))


@pytest.mark.parametrize("layout", VIDEO_FAMILIES)
@pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
def test_a_videos_cost_counts_the_rows_and_tokens_the_transformer_runs(pipelines, layout, guided):
    pipeline = pipelines(layout)
    guidance = TINY_FAMILIES[layout].guided if guided else TINY_FAMILIES[layout].unguided
    options = dataclasses.replace(options_for(layout, **guidance), num_inference_steps=2)
    _, frames, rows, columns = pipeline.latent_shape(options.height, options.width, options.num_frames)
    assert_costed_as_run(pipeline, options, frames * (rows // pipeline.patch_size) * (columns // pipeline.patch_size))
