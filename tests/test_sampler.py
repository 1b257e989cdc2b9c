import dataclasses
import pickle

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.errors import InvalidRequestError, UnknownPromptError
from rollout.options import SamplingOptions
from rollout.sampler import sample
from rollout.transitions import TransitionKind

PROMPTS = ["a handwritten 7", "3", "seven", "the digit 0", "1", "9", "two", "5", "8"]


def run(pipeline, prompts, seeds, **options):
    return sample(pipeline, prompts, seeds, SamplingOptions(**options))


def assert_same_sample(a, b):
    for name in ("image", "final_latents", "log_probs", "latents", "latent_step_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if a.debug is not None:
        for name in ("model_outputs", "prev_sample_means", "noise_std_devs", "variance_noises"):
            assert torch.equal(getattr(a.debug, name), getattr(b.debug, name)), name


def test_shapes_and_dtypes(random_pipeline):
    steps = 6
    batch = run(random_pipeline, PROMPTS[:2], [10, 11], num_inference_steps=steps, debug=True)
    assert len(batch.samples) == 2
    for s in batch.samples:
        assert s.log_probs.shape == (steps,) and s.log_probs.dtype == torch.float32
        assert s.latents.shape == (steps + 1, 1, 16, 16) and s.latents.dtype == torch.float32
        assert s.latent_step_indices.tolist() == list(range(steps + 1))
        assert s.latent_step_indices.dtype == torch.int64
        assert torch.equal(s.latents[-1], s.final_latents)
        assert s.image.shape == (1, 16, 16) and 0 <= s.image.min() and s.image.max() <= 1
        assert s.debug.model_outputs.shape == s.debug.prev_sample_means.shape == (steps, 1, 16, 16)
        assert s.debug.variance_noises.shape == (steps, 1, 16, 16)
        assert s.debug.noise_std_devs.shape == (steps,)
        assert s.denoising_env is None
    assert batch.options.guidance_scale == random_pipeline.default_guidance_scale
    assert (batch.options.height, batch.options.width) == (16, 16)


@pytest.mark.parametrize("num_steps,batch_size", [(3, 4), (40, 2), (8, 9)])
def test_schedule_is_the_schedulers_own_and_is_not_sliced(random_pipeline, num_steps, batch_size):
    # (3, 4): T + 1 equals the batch size, where shape-guessing code would slice the schedule.
    batch = run(
        random_pipeline,
        PROMPTS[:batch_size],
        list(range(batch_size)),
        num_inference_steps=num_steps,
        return_step_indices=[0, num_steps],
    )
    fresh = FlowMatchEulerDiscreteScheduler.from_config(random_pipeline.scheduler.config)
    fresh.set_timesteps(num_steps)
    assert batch.schedule.sigmas.shape == (num_steps + 1,)
    assert torch.equal(batch.schedule.sigmas, fresh.sigmas)
    assert torch.equal(batch.schedule.timesteps, fresh.timesteps)
    assert len(batch.samples) == batch_size


def test_same_request_gives_identical_bits(random_pipeline):
    options = dict(num_inference_steps=5, debug=True, sde_type="cps", noise_level=0.5)
    first = run(random_pipeline, PROMPTS[:3], [1, 2, 3], **options)
    second = run(random_pipeline, PROMPTS[:3], [1, 2, 3], **options)
    for a, b in zip(first.samples, second.samples):
        assert_same_sample(a, b)


def test_initial_noise_comes_first_from_the_samples_own_generator(random_pipeline):
    batch = run(random_pipeline, ["4", "4"], [123, 124], num_inference_steps=2, debug=True)
    for s in batch.samples:
        g = torch.Generator().manual_seed(s.seed)
        assert torch.equal(s.latents[0], torch.randn((1, 16, 16), generator=g))
        assert torch.equal(s.debug.variance_noises[0], torch.randn((1, 16, 16), generator=g))
    assert not torch.equal(batch.samples[0].latents, batch.samples[1].latents)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_batch_invariance(random_pipeline, sde_type):
    options = dict(num_inference_steps=4, debug=True, sde_type=sde_type)
    seeds = [100 + i for i in range(len(PROMPTS))]
    # 9 samples with micro-batches of 4 puts rows in every position, including a padded chunk.
    batched = run(random_pipeline, PROMPTS, seeds, **options)
    for i in (0, 4, 8):
        alone = run(random_pipeline, [PROMPTS[i]], [seeds[i]], **options)
        assert_same_sample(alone.samples[0], batched.samples[i])
    pair = run(random_pipeline, [PROMPTS[5], PROMPTS[2]], [seeds[5], seeds[2]], **options)
    assert_same_sample(pair.samples[0], batched.samples[5])
    assert_same_sample(pair.samples[1], batched.samples[2])


def test_debug_tensors_reconstruct_each_step(random_pipeline):
    batch = run(random_pipeline, ["6"], [5], num_inference_steps=5, debug=True)
    s, sigmas = batch.samples[0], batch.schedule.sigmas
    for i in range(5):
        x_next = s.debug.prev_sample_means[i] + s.debug.noise_std_devs[i] * s.debug.variance_noises[i]
        assert torch.equal(x_next, s.latents[i + 1])
    # The mean and std of an SDE step follow from x_i, the recorded velocity and the schedule
    # (Flow-GRPO's SDE, written out again here in float64).
    eta = batch.options.noise_level
    for i in range(1, 5):  # sigma < 1 from the second step on
        sigma, dt = sigmas[i].double(), (sigmas[i + 1] - sigmas[i]).double()
        x, v = s.latents[i].double(), s.debug.model_outputs[i].double()
        std = eta * torch.sqrt(sigma / (1 - sigma))
        mean = x * (1 + std**2 * dt / (2 * sigma)) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
        torch.testing.assert_close(s.debug.prev_sample_means[i].double(), mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(s.debug.noise_std_devs[i].double(), std * torch.sqrt(-dt), rtol=1e-5, atol=0)


def test_return_step_indices_keep_the_right_latents(random_pipeline):
    full = run(random_pipeline, PROMPTS[:2], [7, 8], num_inference_steps=6)
    kept = [6, 0, 3, 4]
    filtered = run(random_pipeline, PROMPTS[:2], [7, 8], num_inference_steps=6, return_step_indices=kept)
    assert torch.equal(filtered.schedule.sigmas, full.schedule.sigmas)  # never filtered
    assert torch.equal(filtered.schedule.timesteps, full.schedule.timesteps)
    for f, a in zip(filtered.samples, full.samples):
        assert f.latent_step_indices.tolist() == [0, 3, 4, 6]
        assert torch.equal(f.latents, a.latents[[0, 3, 4, 6]])
        assert torch.equal(f.log_probs, a.log_probs)  # log-probs stay one per step
        assert torch.equal(f.final_latents, a.final_latents)


def test_sde_window_runs_other_steps_as_ode(random_pipeline):
    window = [1, 3]
    batch = run(random_pipeline, ["2"], [9], num_inference_steps=5, debug=True, sde_step_indices=window)
    s, sigmas = batch.samples[0], batch.schedule.sigmas
    for i in range(5):
        if i in window:
            assert s.debug.noise_std_devs[i] > 0 and s.log_probs[i] != 0
            assert s.debug.variance_noises[i].abs().sum() > 0
        else:
            assert s.debug.noise_std_devs[i] == 0 and s.log_probs[i] == 0
            assert torch.equal(s.debug.variance_noises[i], torch.zeros(1, 16, 16))
            expected = s.latents[i] + (sigmas[i + 1] - sigmas[i]) * s.debug.model_outputs[i]
            assert torch.equal(s.latents[i + 1], expected)
    # ODE steps draw no noise: the second draw of the generator went to step 3.
    g = torch.Generator().manual_seed(9)
    draws = [torch.randn((1, 16, 16), generator=g) for _ in range(3)]
    assert torch.equal(s.debug.variance_noises[1], draws[1])
    assert torch.equal(s.debug.variance_noises[3], draws[2])


def test_ode_sampling_draws_nothing_and_scores_zero(random_pipeline):
    batch = run(random_pipeline, ["2"], [9], num_inference_steps=4, sde_type="ode", debug=True)
    s = batch.samples[0]
    assert torch.equal(s.log_probs, torch.zeros(4))
    assert torch.equal(s.debug.variance_noises, torch.zeros(4, 1, 16, 16))


@pytest.mark.parametrize("guidance_scale", [2.0, 1.0])
def test_denoising_env_holds_the_samples_conditioning(random_pipeline, guidance_scale):
    options = dict(num_inference_steps=2, return_denoising_env=True, guidance_scale=guidance_scale)
    batch = run(random_pipeline, ["2", "5"], [1, 2], **options)
    (bucket,) = random_pipeline.encode_prompts(["5"], [""], batch.options).buckets
    encoded = bucket.conditioning
    env = batch.samples[1].denoising_env
    # SGLang's layout: transformer keyword arguments per branch; no negative branch without CFG.
    assert list(env) == ["image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"]
    assert env["image_kwargs"] is None and env["guidance"] is None
    assert set(env["pos_cond_kwargs"]) == {"encoder_hidden_states", "pooled_projections"}
    for name, tensor in encoded.pos_cond_kwargs.items():
        assert torch.equal(env["pos_cond_kwargs"][name], tensor[0])
    if guidance_scale == 1.0:
        assert env["neg_cond_kwargs"] is None
    else:
        for name, tensor in encoded.neg_cond_kwargs.items():
            assert torch.equal(env["neg_cond_kwargs"][name], tensor[0])


def test_true_cfg_scale_is_the_embedded_models_cfg_weight(random_pipeline):
    common = dict(num_inference_steps=3, guidance_scale=2.0)
    by_true_cfg = run(random_pipeline, ["4"], [3], true_cfg_scale=4.0, **common)
    by_guidance = run(random_pipeline, ["4"], [3], num_inference_steps=3, guidance_scale=4.0)
    default = run(random_pipeline, ["4"], [3], **common)
    assert torch.equal(by_true_cfg.samples[0].latents, by_guidance.samples[0].latents)
    assert not torch.equal(by_true_cfg.samples[0].latents, default.samples[0].latents)


def test_keeping_no_latent_returns_an_empty_trajectory(random_pipeline):
    batch = run(random_pipeline, ["1", "2"], [1, 2], num_inference_steps=3, return_step_indices=[])
    for s in batch.samples:
        assert s.latents.shape == (0, 1, 16, 16) and s.latent_step_indices.tolist() == []
        assert s.log_probs.shape == (3,)


@pytest.mark.parametrize(
    "options,field",
    [
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(num_inference_steps=-3), "num_inference_steps"),
        (dict(noise_level=-0.1), "rollout_noise_level"),
        (dict(noise_level=float("nan")), "rollout_noise_level"),
        (dict(noise_level=float("inf")), "rollout_noise_level"),
        (dict(noise_level=1.5, sde_type="cps"), "rollout_noise_level"),
        (dict(sde_type="langevin"), "rollout_sde_type"),
        (dict(num_inference_steps=5, sde_step_indices=[5]), "rollout_sde_step_indices"),
        (dict(num_inference_steps=5, sde_step_indices=[-1]), "rollout_sde_step_indices"),
        (dict(num_inference_steps=5, sde_step_indices=[1, 1]), "rollout_sde_step_indices"),
        (dict(num_inference_steps=5, return_step_indices=[6]), "rollout_return_step_indices"),
        (dict(num_inference_steps=5, return_step_indices=[0, 2, 2]), "rollout_return_step_indices"),
        (dict(num_inference_steps=5, return_step_indices=["1"]), "rollout_return_step_indices"),
        (dict(guidance_scale=float("nan")), "guidance_scale"),
        (dict(guidance_scale=-1.0), "guidance_scale"),
        (dict(true_cfg_scale=float("inf")), "true_cfg_scale"),
        (dict(log_prob_form="log_density"), "rollout_log_prob_form"),
        (dict(height=0), "height"),
    ],
)
def test_bad_options_name_the_field(options, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingOptions(**options)
    assert info.value.field == field
    assert field in str(info.value)


@pytest.mark.parametrize(
    "prompts,seeds,options,error,field",
    [
        (["a cat"], [0], {}, UnknownPromptError, "prompt"),
        (["7", "77"], [0, 1], {}, UnknownPromptError, "prompt"),
        (["7"], [0, 1], {}, InvalidRequestError, "seed"),
        (["7"], [-1], {}, InvalidRequestError, "seed"),
        (["7"], [2**63], {}, InvalidRequestError, "seed"),
        ([], [], {}, InvalidRequestError, "prompt"),
        (["7"], [0], dict(height=32), InvalidRequestError, "height"),
        (["7"], [0], dict(width=8), InvalidRequestError, "width"),
    ],
)
def test_bad_requests_name_the_field(random_pipeline, prompts, seeds, options, error, field):
    with pytest.raises(error) as info:
        run(random_pipeline, prompts, seeds, num_inference_steps=2, **options)
    assert info.value.field == field


def test_unknown_negative_prompt_names_its_field(random_pipeline):
    with pytest.raises(UnknownPromptError) as info:
        sample(random_pipeline, ["7"], [0], SamplingOptions(num_inference_steps=1), negative_prompts=["blurry"])
    assert info.value.field == "negative_prompt"


def test_options_are_frozen():
    options = SamplingOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.num_inference_steps = 3
    assert options.sde_type is TransitionKind.SDE


def test_samples_share_one_schedule_object_across_pickling(random_pipeline):
    import pickle

    one = run(random_pipeline, ["3"], [1], num_inference_steps=7)
    many = run(random_pipeline, ["3"] * 8, list(range(1, 9)), num_inference_steps=7)
    assert all(s.schedule is many.schedule for s in many.samples)

    restored = pickle.loads(pickle.dumps(many))
    assert all(s.schedule is restored.schedule for s in restored.samples)
    assert torch.equal(restored.schedule.sigmas, many.schedule.sigmas)
    # The schedule is paid for once: 8 samples cost 8 samples, not 8 schedules more.
    schedule_size = len(pickle.dumps(many.schedule))
    per_sample = len(pickle.dumps(one.samples[0])) - schedule_size
    assert len(pickle.dumps(many)) < len(pickle.dumps(one)) + 7 * per_sample + schedule_size // 2


def test_a_pickled_batch_carries_each_field_as_one_stacked_buffer(random_pipeline):
    import pickle

    batch = run(random_pipeline, PROMPTS[:4], [5, 6, 7, 8], num_inference_steps=5, debug=True, return_denoising_env=True)
    restored = pickle.loads(pickle.dumps(batch, protocol=5))
    for original, copy in zip(batch.samples, restored.samples):
        assert_same_sample(original, copy)
        assert (copy.prompt, copy.seed, copy.weight_version) == (original.prompt, original.seed, original.weight_version)
        assert torch.equal(copy.denoising_env["pos_cond_kwargs"]["encoder_hidden_states"],
                           original.denoising_env["pos_cond_kwargs"]["encoder_hidden_states"])
    # One buffer per field, shared by the samples' views: what Ray maps without a copy.
    latents = [s.latents for s in restored.samples]
    assert len({t.untyped_storage().data_ptr() for t in latents}) == 1
    buffers = []
    pickle.dumps(batch, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) == 9  # 5 sample fields + 4 debug fields, out of band


def test_a_sample_unpacked_from_a_batch_pickles_alone_without_the_batch(random_pipeline):
    import pickle

    batch = run(random_pipeline, ["3"] * 8, list(range(8)), num_inference_steps=5)
    one = pickle.loads(pickle.dumps(batch)).samples[3]
    alone = pickle.dumps(one)
    assert len(alone) < len(pickle.dumps(batch)) / 4
    assert_same_sample(pickle.loads(alone), batch.samples[3])


def test_samples_that_cannot_stack_cross_pickling_as_they_are(random_pipeline):
    import pickle

    a = run(random_pipeline, ["3"], [1], num_inference_steps=4)
    b = run(random_pipeline, ["4"], [2], num_inference_steps=4, return_step_indices=(4,))
    mixed = type(a)(a.schedule, a.options, [a.samples[0], dataclasses.replace(b.samples[0], schedule=a.schedule)])
    bf16 = dataclasses.replace(a.samples[0], image=a.samples[0].image.bfloat16())
    for batch in (mixed, type(a)(a.schedule, a.options, [bf16, bf16])):
        restored = pickle.loads(pickle.dumps(batch))
        for original, copy in zip(batch.samples, restored.samples):
            assert_same_sample(original, copy)
            assert copy.image.dtype == original.image.dtype


def test_concat_keeps_one_schedule_and_refuses_mismatches(random_pipeline):
    a = run(random_pipeline, ["3", "4"], [1, 2], num_inference_steps=3)
    b = run(random_pipeline, ["5"], [3], num_inference_steps=3)
    joined = type(a).concat([a, b])
    assert [s.seed for s in joined.samples] == [1, 2, 3]
    assert all(s.schedule is a.schedule for s in joined.samples)
    assert joined.subset([2]).samples[0].schedule is a.schedule
    with pytest.raises(ValueError, match="options"):
        type(a).concat([a, run(random_pipeline, ["5"], [3], num_inference_steps=4)])


def test_kept_tensors_are_written_into_one_buffer_each_and_a_part_pickles_only_its_own_rows(random_pipeline):
    batch = run(random_pipeline, PROMPTS[:4], [0, 1, 2, 3], num_inference_steps=3, debug=True)
    for name in ("latents", "log_probs", "debug.model_outputs", "debug.variance_noises"):
        storages = {s.tensors()[name].untyped_storage().data_ptr() for s in batch.samples}
        assert len(storages) == 1, name  # views of one buffer, not a copy per sample
    part = batch.subset([1, 2])  # what a worker returns for one of the requests it batched
    buffers = []
    unpickled = pickle.loads(pickle.dumps(part, protocol=5, buffer_callback=buffers.append), buffers=buffers)
    # Out of band, each field as one array of the part's rows: the bytes of its two samples, no more.
    assert sum(memoryview(b).nbytes for b in buffers) == sum(t.nbytes for s in part.samples for t in s.tensors().values())
    for original, copy in zip(part.samples, unpickled.samples):
        assert_same_sample(original, copy)
