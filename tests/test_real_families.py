"""The image families (SD3, FLUX.1, Qwen-Image) through the rollout library, on tiny random-weight
copies saved as diffusers directories (`rollout.testing.families`) and loaded by the real loading code.

The reference is diffusers' own `pipeline(...)`: the rollout's deterministic (ODE) path must
reproduce it, and the schedule must be the scheduler's own after the pipeline set it.
"""

import json
import shutil
import threading
import time

import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout.calibration import (
    UNGUIDED,
    CalibrationCache,
    calibrate,
    calibrate_at_start,
    calibration_keys,
    check_batch_invariance,
    digest_of,
    require_batch_invariance,
)
from rollout.checkpoints import disk_update
from rollout.cost import CostFacts
from rollout.errors import InvalidRequestError, ModelLoadError
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline, resolve_model
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.sampler import micro_batch_size, resolve_options, rows_per_sample, sample, sample_call
from rollout.testing.families import IMAGE_FAMILIES, TINY_FAMILIES
from rollout.transitions import TransitionKind
from rollout.tree import Branching, roots_of
from rollout.weights import (
    apply_update,
    served_adapter,
    tensor_update,
    weights_checksum,
)

SIZE = 64
# Past Qwen-Image's first text-length bucket (58 tokens with the tiny tokenizer: bucket 64).
LONG_PROMPT = "a very long prompt about a lighthouse on a cliff in a storm at night"


@pytest.fixture(scope="module")
def pipelines(tiny_family_dirs):
    """(family, dtype name) -> the loaded pipeline, loaded once."""
    cache = {}

    def load(family: str, dtype: str = "float32", micro_batch_size: int = 2, decode_batch_size: int | None = None):
        key = (family, dtype, micro_batch_size, decode_batch_size)
        if key not in cache:
            cache[key] = load_pipeline(
                family,
                tiny_family_dirs[family],
                device="cpu",
                dtype=getattr(torch, dtype),
                micro_batching=MicroBatching(micro_batch_size, decode_default=decode_batch_size),
            )
        return cache[key]

    return load


def guidance(family: str, on: bool) -> dict:
    """The family's guidance on or off: `SamplingOptions` fields, the same as `pipeline(...)` arguments."""
    record = TINY_FAMILIES[family]
    return dict(record.guided if on else record.unguided)


def diffusers_latents(pipeline, prompts, negative_prompts, seeds, size, steps, pipe_guidance):
    """`pipeline(..., output_type="latent")` from the same seeds, unpacked to the rollout's layout."""
    negative = {"negative_prompt": negative_prompts} if negative_prompts else {}
    latents = pipeline.pipe(
        prompt=prompts,
        height=size,
        width=size,
        num_inference_steps=steps,
        generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
        output_type="latent",
        **negative,
        **pipe_guidance,
    ).images.float()
    if latents.ndim == 3:  # packed tokens (FLUX.1, Qwen-Image)
        latents = pipeline.unpack(latents, size // 8, size // 8)
    return latents


def transformer_rows_of(pipeline, prompts, seeds, options) -> int:
    """The rows every denoiser call of `sample(pipeline, prompts, seeds, options)` ran, summed."""
    rows = []
    hooks = [
        pipeline.weight_modules[expert].register_forward_hook(
            lambda module, args, kwargs, output: rows.append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        for expert in pipeline.experts
    ]
    try:
        sample(pipeline, prompts, seeds, options)
    finally:
        for hook in hooks:
            hook.remove()
    return sum(rows)


def assert_costed_as_run(pipeline, options, tokens: int) -> None:
    """A request's token-steps (`rollout.cost`) are the rows its denoiser calls ran x `tokens` a
    sample (the transformer's, from the family), and its decode: guidance's branches by the
    family's own rule, whether it batches them or not. Two samples of one prompt: micro-batches of 2
    pad nothing (Qwen-Image runs each text-length bucket in calls of its own)."""
    facts = CostFacts.of(pipeline)
    resolved = resolve_options(pipeline, options)
    assert facts.tokens_per_sample(resolved.height, resolved.width, resolved.num_frames) == tokens
    rows = transformer_rows_of(pipeline, ["a red cube"] * 2, [1, 2], options)
    decoded = 2 * resolved.num_frames * (resolved.height // facts.token_pixels) * (resolved.width // facts.token_pixels)
    cost = facts.request_cost(roots_of(["a red cube"] * 2, ["", ""], [1, 2], Branching()), options)
    assert cost.token_steps == rows * tokens + decoded


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
@pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
def test_a_requests_cost_counts_the_rows_and_tokens_the_transformer_runs(pipelines, family, guided):
    pipeline = pipelines(family)
    options = SamplingOptions(num_inference_steps=2, height=SIZE, width=SIZE, sde_type=TransitionKind.ODE, **guidance(family, guided))
    assert_costed_as_run(pipeline, options, pipeline.image_sequence_length(SIZE, SIZE))
    assert CostFacts.of(pipeline).token_pixels == TINY_FAMILIES[family].token_pixels


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
@pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
def test_the_ode_path_reproduces_the_diffusers_pipeline(pipelines, family, guided):
    fields = guidance(family, guided)
    negative = ["blurry"] if guided else None
    # Alone, with a micro-batch of 1: the transformer calls are the pipeline's, row for row.
    alone = pipelines(family, micro_batch_size=1)
    options = SamplingOptions(num_inference_steps=3, height=SIZE, width=SIZE, sde_type=TransitionKind.ODE, **fields)
    rollout = sample(alone, ["a red cube"], [11], options, negative_prompts=negative)
    expected = diffusers_latents(alone, ["a red cube"], negative, [11], SIZE, 3, fields)
    difference = (rollout.samples[0].final_latents - expected[0]).abs().max().item()
    if family == "qwenimage":
        # The only difference from the pipeline: the prompt is padded to a fixed length with a
        # mask (the pipeline pads to the batch's longest prompt and drops an all-ones mask).
        assert 0 < difference <= 1e-5
    else:
        assert difference == 0.0

    # Two prompts of different lengths: each prompt is encoded alone here and in one batch there.
    prompts, seeds = ["a red cube", "two green spheres on a wooden table at dusk"], [3, 4]
    negatives = ["blurry", "low quality, watermark"] if guided else None
    rollout = sample(pipelines(family), prompts, seeds, options, negative_prompts=negatives)
    expected = diffusers_latents(alone, prompts, negatives, seeds, SIZE, 3, fields)
    final = torch.stack([s.final_latents for s in rollout.samples])
    assert (final - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_schedule_is_the_schedulers_own_at_each_size(pipelines, family):
    pipeline = pipelines(family)
    steps = 4
    schedules = {}
    for size in (32, 96):
        schedule = pipeline.schedule(steps, size, size)
        pipeline.pipe(prompt="x", height=size, width=size, num_inference_steps=steps, output_type="latent")
        assert torch.equal(schedule.sigmas, pipeline.pipe.scheduler.sigmas.cpu())
        assert torch.equal(schedule.timesteps, pipeline.pipe.scheduler.timesteps.cpu())
        assert schedule.sigmas.dtype == torch.float32 and schedule.sigmas.shape == (steps + 1,)
        assert schedule.sigmas[-1] == 0
        schedules[size] = schedule
    if family == "sd3":  # a static shift: the size does not matter; the last sigma is shifted twice
        assert torch.equal(schedules[32].sigmas, schedules[96].sigmas)
        assert schedules[32].sigmas[-2].item() == pytest.approx(0.0089286, abs=1e-7)
    else:  # mu grows with the image's token count (Qwen's last nonzero sigma is pinned, below)
        assert (schedules[96].sigmas[1:-2] > schedules[32].sigmas[1:-2]).all()
    if family == "qwenimage":  # stretched to shift_terminal
        assert schedules[32].sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)


def test_concurrent_requests_of_different_sizes_keep_their_own_schedule(pipelines):
    pipeline = pipelines("flux")
    expected = {size: pipeline.schedule(6, size, size) for size in (32, 64, 96)}
    before = pipeline.scheduler.sigmas.clone()
    mismatches = []

    def request(size):
        for _ in range(20):
            if not pipeline.schedule(6, size, size).equals(expected[size]):
                mismatches.append(size)

    threads = [threading.Thread(target=request, args=(size,)) for size in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert mismatches == []
    assert torch.equal(pipeline.scheduler.sigmas, before)  # the pipeline's scheduler is never set


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_transformer_time_input_is_the_familys_own(pipelines, family):
    for dtype in ("float32", "bfloat16"):
        schedule = pipelines(family, dtype).schedule(10, SIZE, SIZE)
        if TINY_FAMILIES[family].inputs.time_per_1000:
            assert torch.equal(schedule.model_timesteps, (schedule.timesteps.to(getattr(torch, dtype)) / 1000).float())
            # Not sigmas in bf16: the model was trained on the rounded input.
            assert dtype == "float32" or not torch.equal(schedule.model_timesteps, schedule.sigmas[:-1])
        else:
            assert torch.equal(schedule.model_timesteps, schedule.timesteps)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
def test_replay_equals_the_rollout_exactly(pipelines, family, dtype, guided):
    pipeline = pipelines(family, dtype)
    fields = guidance(family, guided)
    options = SamplingOptions(num_inference_steps=3, height=SIZE, width=SIZE, return_denoising_env=True, **fields)
    negatives = ["blurry", "dark"] if guided else None
    batch = sample(pipeline, ["a cat", "a dog in the snow"], [1, 2], options, negative_prompts=negatives)
    assert all(s.latents.dtype == torch.float32 and s.log_probs.dtype == torch.float32 for s in batch.samples)
    rollout_log_probs = torch.stack([s.log_probs for s in batch.samples])
    assert torch.isfinite(rollout_log_probs).all()
    from_env = replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples)
    assert torch.equal(from_env.log_probs, rollout_log_probs)
    # A trainer without the returned conditioning encodes the prompts again: the same bits.
    without_env = [type(s)(**{**s.__dict__, "denoising_env": None}) for s in batch.samples]
    assert torch.equal(replay_log_probs(pipeline, batch.schedule, batch.options, without_env).log_probs, rollout_log_probs)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_a_sample_is_the_same_alone_and_in_a_batch(pipelines, family):
    assert_batch_invariant(pipelines(family), family)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_a_sample_is_the_same_alone_and_in_a_batch_when_the_vae_takes_calls_of_another_size(pipelines, family):
    assert_batch_invariant(pipelines(family, micro_batch_size=2, decode_batch_size=4), family)


def moving_the_last_row_changes_its_bits(pipeline, monkeypatch, method: str, rows: int) -> None:
    """Makes `pipeline.<method>` (velocity or decode) give the last row of a call of `rows` the next
    float up, as the stock kernels give a row other bits at another position in some calls here
    (calls of 3 in SD3's transformer and VAE, 2 torch threads)."""
    compute = getattr(pipeline, method)

    def at_the_last_position_other_bits(x, *args, **kwargs):
        out = compute(x, *args, **kwargs)
        if len(x) == rows:
            out = out.clone()
            out[-1] = torch.nextafter(out[-1], torch.full_like(out[-1], float("inf")))
        return out

    monkeypatch.setattr(pipeline, method, at_the_last_position_other_bits)


@pytest.mark.parametrize("method, field", [("predict_velocity", "micro_batch_size"), ("decode", "decode_batch_size")])
def test_padding_is_refused_at_a_size_whose_calls_give_a_sample_other_bits_at_another_position(
    pipelines, monkeypatch, method, field
):
    pipeline = pipelines("sd3", micro_batch_size=4)  # calls of 2 guided samples, and VAE calls of 4
    assert check_batch_invariance(pipeline, SIZE, SIZE).holds
    moving_the_last_row_changes_its_bits(pipeline, monkeypatch, method, rows=2 if method == "predict_velocity" else 4)
    check = check_batch_invariance(pipeline, SIZE, SIZE)
    assert (check.velocity_difference > 0) == (method == "predict_velocity")
    assert (check.image_difference > 0) == (method == "decode")
    with pytest.raises(ModelLoadError) as caught:
        require_batch_invariance(pipeline, SIZE, SIZE)
    assert caught.value.field == f"model.{field}"
    assert caught.value.reason.startswith(f"calls of 4 at {SIZE}x{SIZE} give a sample other bits at another position")


def test_a_request_without_guidance_fills_the_rows_of_a_guided_call_and_its_calls_are_checked_too(pipelines, monkeypatch):
    # SD3 runs guidance's two branches in one call: 3 rows are one guided sample (2 rows) a call,
    # or 3 samples without guidance, whose calls the worker's check makes too.
    pipeline = pipelines("sd3", micro_batch_size=3, decode_batch_size=2)
    guided, unguided = (resolve_options(pipeline, SamplingOptions(**fields)) for fields in ({}, UNGUIDED))
    assert (micro_batch_size(pipeline, guided), micro_batch_size(pipeline, unguided)) == (1, 3)
    assert micro_batch_size(pipelines("flux", micro_batch_size=3), guided) == 3  # FLUX.1 makes a call per branch
    assert check_batch_invariance(pipeline, SIZE, SIZE).holds
    moving_the_last_row_changes_its_bits(pipeline, monkeypatch, "predict_velocity", rows=3)
    assert check_batch_invariance(pipeline, SIZE, SIZE).holds  # the guided calls: one sample each
    with pytest.raises(ModelLoadError) as caught:
        require_batch_invariance(pipeline, SIZE, SIZE)
    assert caught.value.field == "model.micro_batch_size" and caught.value.reason.startswith("calls of 3 at")


@pytest.mark.parametrize("method", ["predict_velocity", "decode"])
def test_calibration_passes_over_a_size_whose_calls_give_a_sample_other_bits_at_another_position(
    pipelines, monkeypatch, method
):
    pipeline = pipelines("sd3")
    # Calls of 4 rows: 2 guided samples in the transformer's, 4 images in the VAE's.
    moving_the_last_row_changes_its_bits(pipeline, monkeypatch, method, rows=2 if method == "predict_velocity" else 4)
    calibration = calibrate(pipeline, SIZE, SIZE, (4, 8), repeats=1, tolerance=float("inf"))
    # With any time tolerated, each model's smallest size that keeps a sample's bits.
    assert (calibration.checks[4].velocity_difference > 0) == (method == "predict_velocity")
    assert (calibration.chosen, calibration.chosen_for_decode) == ((4, 8) if method == "decode" else (8, 4))
    with pytest.raises(ValueError, match="add 1 to the candidates"):
        calibrate(pipeline, SIZE, SIZE, (4,), repeats=1)


def test_calibration_picks_only_whole_guided_samples_rows_for_a_transformer_that_runs_both_branches_in_one_call(pipelines):
    pipeline = pipelines("sd3")
    # With any time tolerated, the smallest even size: 1 row would make calls of 2.
    assert calibrate(pipeline, SIZE, SIZE, (1, 2), repeats=1, tolerance=float("inf")).chosen == 2
    assert calibrate(pipeline, SIZE, SIZE, (1, 2), UNGUIDED, repeats=1, tolerance=float("inf")).chosen == 1
    with pytest.raises(ValueError, match="add an even candidate"):
        calibrate(pipeline, SIZE, SIZE, (1,), repeats=1)


def test_a_calibration_past_its_deadline_compares_the_sizes_it_warmed_by_then(pipelines):
    pipeline = pipelines("sd3")
    # Guided SD3 takes two rows a sample: warming stops after the first size of whole samples' rows.
    calibration = calibrate(pipeline, SIZE, SIZE, (1, 2, 4), repeats=3, deadline=time.monotonic())
    assert set(calibration.denoising_seconds_per_sample) == {1, 2}
    assert calibration.skipped == {4: "deadline"} and calibration.rounds == 0
    assert calibration.chosen == 2 and calibration.checks[2].holds


def test_a_size_that_runs_out_of_memory_is_left_out_with_every_larger_one(pipelines, monkeypatch):
    pipeline = pipelines("flux")
    predict_velocity = pipeline.predict_velocity

    def out_of_memory_above_two_rows(x, *args, **kwargs):
        if len(x) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return predict_velocity(x, *args, **kwargs)

    monkeypatch.setattr(pipeline, "predict_velocity", out_of_memory_above_two_rows)
    calibration = calibrate(pipeline, SIZE, SIZE, (1, 2, 4, 8), UNGUIDED, repeats=1)
    assert calibration.skipped == {4: "out of memory", 8: "out of memory"}
    assert set(calibration.decode_seconds_per_sample) == {1, 2} and calibration.chosen in (1, 2)
    assert pipeline.micro_batching == MicroBatching(2)  # the pipeline's own sizes again
    with pytest.raises(ValueError, match=f"^calls of 4 rows at {SIZE}x{SIZE} do not fit in cpu's memory$"):
        calibrate(pipeline, SIZE, SIZE, (4, 8), UNGUIDED, repeats=1)


def test_a_start_up_calibration_is_kept_on_the_machine_and_read_back_for_its_key_only(pipelines, tmp_path, monkeypatch):
    pipeline, sizes = pipelines("sd3"), [(SIZE, SIZE), (32, 64)]
    cache = CalibrationCache(tmp_path)
    keys = calibration_keys(pipeline, sizes, load=2)
    measured = calibrate_at_start(pipeline, keys, budget_s=60, cache=cache)
    assert [note.split(":")[1].split(" in ")[0] for note in measured.notes] == [" measured"] * 2
    # Guided SD3 at load 2: calls of 2 or 4 rows, each at a size its padding keeps a sample's bits.
    assert set(measured.micro_batch_sizes) == set(measured.decode_batch_sizes) == {f"{SIZE}x{SIZE}", "32x64"}
    assert set(measured.micro_batch_sizes.values()) <= {2, 4}
    assert len(list(tmp_path.glob("*.json"))) == 2

    def measuring(*args, **kwargs):
        raise AssertionError("measured again")

    monkeypatch.setattr("rollout.calibration.calibrate", measuring)
    read = calibrate_at_start(pipeline, keys, budget_s=0, cache=cache)
    assert (read.micro_batch_sizes, read.decode_batch_sizes) == (measured.micro_batch_sizes, measured.decode_batch_sizes)
    assert read.notes == [f"{SIZE}x{SIZE}: read from {tmp_path}", f"32x64: read from {tmp_path}"]
    # Another dtype, load or size is another key: nothing kept for it, and no time left to measure.
    key = keys[0]
    for other in (
        calibration_keys(pipelines("sd3", dtype="bfloat16"), [(SIZE, SIZE)], load=2)[0],
        calibration_keys(pipeline, [(SIZE, SIZE)], load=3)[0],
        calibration_keys(pipeline, [(SIZE, 32)], load=2)[0],
    ):
        assert other != key and cache.read(other) is None
    assert calibrate_at_start(pipeline, calibration_keys(pipeline, [(SIZE, 32)], load=2), budget_s=0, cache=cache).notes == [
        f"{SIZE}x32: not calibrated: the 0 s budget ran out"
    ]
    # A damaged or foreign file reads as absent.
    for damaged in ("{", json.dumps({"key": {**key, "load": 99}, "chosen": 2, "chosen_for_decode": 2})):
        (tmp_path / f"{digest_of([key])}.json").write_text(damaged)
        assert cache.read(key) is None


def test_calibrated_sizes_fill_in_only_what_the_configuration_leaves_out():
    configured = MicroBatching.parse(4, {"64x64": 8}, decode_by_size={"32x32": 1})
    calibrated = configured.with_calibrated({"64x64": 2, "32x32": 16}, {"64x64": 2, "32x32": 8})
    assert (dict(calibrated.by_size), dict(calibrated.decode_by_size)) == ({(64, 64): 8, (32, 32): 16}, {(64, 64): 2, (32, 32): 1})
    every_size_decoded = MicroBatching(4, decode_default=2).with_calibrated({"32x32": 16}, {"32x32": 8})
    assert every_size_decoded.decode_size_for(32, 32) == 2 and every_size_decoded.size_for(32, 32) == 16
    assert MicroBatching.parse(**calibrated.describe()) == calibrated


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_calibrated_micro_batches_are_the_smallest_near_the_fastest_for_the_load_and_keep_invariance(pipelines, family):
    candidates, fields = (1, 2, 4), guidance(family, True)
    pipeline = pipelines(family)
    calibration = calibrate(pipeline, SIZE, SIZE, candidates, fields, repeats=1, load=3)
    assert calibration.size_key == f"{SIZE}x{SIZE}"
    assert "decode" not in vars(pipeline)  # the decode timed within the rollout is the class's again
    # The transformer's size on the rollout less its decode, among whole guided samples' rows (SD3's
    # guided sample is two); the VAE's on the decode alone, among every candidate.
    guided_rows = rows_per_sample(pipeline, resolve_options(pipeline, SamplingOptions(**fields)))
    for chosen, per_sample, for_load, samples_per_call in (
        (
            calibration.chosen,
            calibration.denoising_seconds_per_sample,
            calibration.denoising_seconds_for_load,
            {c: c // guided_rows for c in candidates if c % guided_rows == 0},
        ),
        (
            calibration.chosen_for_decode,
            calibration.decode_seconds_per_sample,
            calibration.decode_seconds_for_load,
            {c: c for c in candidates},
        ),
    ):
        assert set(per_sample) == set(candidates) and all(seconds > 0 for seconds in per_sample.values())
        # A rollout of 4 samples was timed; 3 take a call of 1 sample each, 2 of 2 (the last padded)
        # or 1 of 4: their time per computed sample, times the samples computed.
        computed = {1: 3, 2: 4, 4: 4}
        for c, per_call in samples_per_call.items():
            assert for_load[c] == pytest.approx(per_sample[c] * computed[per_call])
        best = min(for_load[c] for c in samples_per_call)
        assert chosen == min(c for c in samples_per_call if for_load[c] <= best * 1.02)
    # Three samples padded to the chosen sizes, against one alone.
    calibrated = pipelines(family, micro_batch_size=calibration.chosen, decode_batch_size=calibration.chosen_for_decode)
    assert_batch_invariant(calibrated, family)


def assert_batch_invariant(pipeline, family: str) -> None:
    fields = guidance(family, True)
    options = SamplingOptions(num_inference_steps=2, height=SIZE, width=SIZE, debug=True, **fields)
    alone = sample(pipeline, ["a cat"], [7], options).samples[0]
    # For Qwen-Image the first prompt is in another text-length bucket than the other two.
    prompts = [LONG_PROMPT, "a cat", "x"]
    batched = sample(pipeline, prompts, [8, 7, 9], options).samples[1]
    for name in ("final_latents", "latents", "log_probs", "image"):
        assert torch.equal(getattr(alone, name), getattr(batched, name)), name
    assert torch.equal(alone.debug.model_outputs, batched.debug.model_outputs)


@pytest.mark.parametrize(
    ("size", "bucket"), [(64, 8), (128, 8), (176, 8), (192, 16), (240, 16), (256, 32), (1024, 32), (1664, 32)]
)
def test_qwen_image_text_buckets_hold_the_padding_near_an_eighth_of_the_image_tokens(pipelines, size, bucket):
    pipeline = pipelines("qwenimage")
    options = SamplingOptions(height=size, width=size)
    assert pipeline.text_length_bucket(options) == bucket
    # A prompt's padded length is its own token count's bucket: the next multiple, and never past the limit.
    assert [pipeline.padded_text_length(n, options) for n in (1, bucket, bucket + 1)] == [bucket, bucket, 2 * bucket]
    assert pipeline.padded_text_length(pipeline.max_sequence_length, options) == pipeline.max_sequence_length


@pytest.mark.parametrize("size", [SIZE, 2 * SIZE])
def test_qwen_image_decodes_an_image_with_the_vaes_own_bits_without_its_causal_cache(pipelines, size):
    pipeline = pipelines("qwenimage")
    shape = (2, pipeline.vae.config.z_dim, 1, size // 8, size // 8)
    video_latents = torch.randn(shape, generator=torch.Generator().manual_seed(size))
    expected = pipeline.vae.decode(video_latents, return_dict=False)[0][:, :, 0]
    assert torch.equal(pipeline.decode_frame(video_latents), expected)


def test_qwen_image_samples_with_texts_of_different_length_buckets_keep_their_bits(pipelines):
    pipeline = pipelines("qwenimage")  # micro-batches of 2
    options = SamplingOptions(
        num_inference_steps=2, height=SIZE, width=SIZE, true_cfg_scale=3.0, debug=True, return_denoising_env=True
    )
    # (positive, negative) text buckets, in multiples of 8 at 64x64: (64, 8), (8, 8), (64, 8), (8, 64), (8, 8)
    branches = ("pos_cond_kwargs", "neg_cond_kwargs")
    prompts = [LONG_PROMPT, "a cat", LONG_PROMPT, "a cat", "x"]
    negatives = ["", "x", "x", LONG_PROMPT, ""]
    seeds = [3, 4, 5, 6, 7]
    call = sample_call(pipeline, prompts, seeds, options, negatives)
    envs = [s.denoising_env for s in call.batch.samples]
    text_lengths = [tuple(len(env[branch]["encoder_hidden_states_mask"]) for branch in branches) for env in envs]
    assert text_lengths == [(64, 8), (8, 8), (64, 8), (8, 64), (8, 8)]
    # Three buckets of 2, 2 and 1 samples, each in whole micro-batches of 2: 6 rows a step, not 5 or 10.
    assert call.transformer_rows == 2 * 6
    for i, batched in enumerate(call.batch.samples):
        alone = sample(pipeline, [prompts[i]], [seeds[i]], options, [negatives[i]]).samples[0]
        for name in ("final_latents", "latents", "log_probs", "image"):
            assert torch.equal(getattr(alone, name), getattr(batched, name)), (i, name)
        assert torch.equal(alone.debug.model_outputs, batched.debug.model_outputs), i
    rollout_log_probs = torch.stack([s.log_probs for s in call.batch.samples])
    replayed = replay_log_probs(pipeline, call.batch.schedule, call.batch.options, call.batch.samples)
    assert torch.equal(replayed.log_probs, rollout_log_probs)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_denoising_env_holds_every_transformer_input(pipelines, family):
    pipeline = pipelines(family)
    fields = guidance(family, True)
    options = SamplingOptions(num_inference_steps=2, height=32, width=SIZE, return_denoising_env=True, **fields)
    env = sample(pipeline, ["a cat"], [0], options).samples[0].denoising_env
    inputs = TINY_FAMILIES[family].inputs
    assert set(env["pos_cond_kwargs"]) == set(env["neg_cond_kwargs"]) == inputs.per_branch
    assert set(env["image_kwargs"] or ()) == inputs.image
    assert (env["guidance"] is not None) == inputs.guidance
    if family == "flux":
        assert tuple(env["image_kwargs"]["img_ids"].shape) == ((32 // 16) * (SIZE // 16), 3)  # a row per token
    if family == "qwenimage":
        mask = env["pos_cond_kwargs"]["encoder_hidden_states_mask"]
        # padded to its length bucket, not to max_sequence_length
        assert mask.shape == (pipeline.padded_text_length(int(mask.sum()), options),) and 0 < mask.sum() < len(mask)
        assert len(mask) % pipeline.text_length_bucket(options) == 0 and len(mask) < pipeline.max_sequence_length
        assert env["image_kwargs"]["img_shapes"].tolist() == [1, 32 // 16, SIZE // 16]  # (frames, token rows, token columns)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_sizes_the_model_cannot_make_are_refused(pipelines, family):
    with pytest.raises(InvalidRequestError, match="height: must be a multiple of 16"):
        pipelines(family).latent_shape(72, 64)


def test_a_step_count_whose_schedule_is_not_finite_is_refused_naming_the_field(pipelines):
    # A counterexample of benchmarks.properties: Qwen-Image's shift_terminal stretches a schedule of
    # one step by 0 / 0, and the sigmas were [nan, 0].
    with pytest.raises(InvalidRequestError, match="num_inference_steps.*no finite schedule of 1 steps"):
        pipelines("qwenimage").schedule(1, 32, 32)
    assert torch.isfinite(pipelines("qwenimage").schedule(2, 32, 32).sigmas).all()


def test_the_family_is_read_from_model_index(tiny_family_dirs):
    for family, path in tiny_family_dirs.items():
        assert resolve_model(None, path) == (TINY_FAMILIES[family].model, path)


def test_bad_model_directories_fail_at_load_naming_path_and_cause(tiny_family_dirs, tmp_path):
    with pytest.raises(ModelLoadError, match="model.path: .*none is not a directory"):
        load_pipeline("flux", tmp_path / "none", device="cpu")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no model_index.json"):
        load_pipeline(None, tmp_path / "empty", device="cpu")
    broken = shutil.copytree(tiny_family_dirs["sd3"], tmp_path / "broken")
    shutil.rmtree(broken / "text_encoder_3")
    with pytest.raises(ModelLoadError, match=r"lacks the component folder\(s\) \['text_encoder_3'\]"):
        load_pipeline("sd3", broken, device="cpu")
    (broken / "model_index.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot be read as JSON"):
        load_pipeline("sd3", broken, device="cpu")
    with pytest.raises(ModelLoadError, match="model.name: .* holds a FluxPipeline, not the QwenImagePipeline"):
        load_pipeline("qwenimage", tiny_family_dirs["flux"], device="cpu")
    with pytest.raises(ModelLoadError, match="model.name: unknown model 'sdxl'"):
        load_pipeline("sdxl", tiny_family_dirs["flux"], device="cpu")
    unknown = shutil.copytree(tiny_family_dirs["flux"], tmp_path / "unknown")
    index = json.loads((unknown / "model_index.json").read_text())
    (unknown / "model_index.json").write_text(json.dumps({**index, "_class_name": "StableDiffusionXLPipeline"}))
    with pytest.raises(ModelLoadError, match="holds a StableDiffusionXLPipeline; this server serves"):
        load_pipeline(None, unknown, device="cpu")
    corrupt = shutil.copytree(tiny_family_dirs["flux"], tmp_path / "corrupt")
    (corrupt / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot load FluxPipeline from .*corrupt"):
        load_pipeline("flux", corrupt, device="cpu")


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_lora_updates_replay_exactly_and_a_checkpoint_restores_the_base(tiny_family_dirs, family):
    """What a trainer pushes between steps: a PEFT LoRA on the transformer, the policy."""
    served, trainer = (
        load_pipeline(family, tiny_family_dirs[family], device="cpu", micro_batching=MicroBatching(2)) for _ in range(2)
    )
    base_checksum = weights_checksum(served.transformer)
    trainer.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trainer.transformer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    update = tensor_update(get_peft_model_state_dict(trainer.transformer), lora_rank=4, lora_alpha=8)
    apply_update(served.weight_modules, update)
    assert weights_checksum(served.transformer) == weights_checksum(trainer.transformer) != base_checksum

    fields = guidance(family, True)
    options = SamplingOptions(num_inference_steps=3, height=32, width=32, **fields)
    batch = sample(served, ["a cat", "a dog"], [0, 1], options)
    replayed = replay_log_probs(trainer, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))

    # The pipeline's own directory is a whole checkpoint: it serves the base weights again.
    apply_update(served.weight_modules, disk_update(tiny_family_dirs[family], list(served.weight_modules)))
    assert served_adapter(served.transformer) is None and weights_checksum(served.transformer) == base_checksum
