import copy

import pytest
import torch

from rollout.errors import InvalidRequestError
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs, replayable_steps, transition_log_probs
from rollout.sampler import sample
from rollout.schedule import ScheduleSnapshot
from rollout.testing.families import TINY_FAMILIES

PROMPTS = ["0", "a handwritten 4", "nine"]
SEEDS = [31, 32, 33]


def rollout_log_probs(batch, steps):
    return torch.stack([s.log_probs[steps] for s in batch.samples])


@pytest.mark.parametrize(
    "options",
    [
        dict(num_inference_steps=6),
        dict(num_inference_steps=6, sde_type="cps", noise_level=0.5),
        dict(num_inference_steps=6, log_prob_form="gaussian_no_const", return_denoising_env=True),
        dict(num_inference_steps=6, sde_type="cps", log_prob_form="squared_error", return_denoising_env=True),
        dict(num_inference_steps=6, guidance_scale=1.0, return_denoising_env=True),  # no negative branch
        dict(num_inference_steps=6, sde_step_indices=[1, 2], return_step_indices=[1, 2, 3, 5]),
        dict(num_inference_steps=3),  # T + 1 == 4 samples below
    ],
)
def test_on_policy_replay_is_bit_identical(random_pipeline, options):
    prompts = PROMPTS + ["6"] if options["num_inference_steps"] == 3 else PROMPTS
    seeds = SEEDS + [34] if len(prompts) == 4 else SEEDS
    batch = sample(random_pipeline, prompts, seeds, SamplingOptions(**options))
    trainer_model = copy.deepcopy(random_pipeline)  # the trainer's own copy of the same weights

    replayed = replay_log_probs(trainer_model, batch.schedule, batch.options, batch.samples)

    expected_steps = replayable_steps(batch.samples[0].latent_step_indices)
    assert replayed.step_indices.tolist() == expected_steps
    assert len(expected_steps) > 0
    assert torch.equal(replayed.log_probs, rollout_log_probs(batch, expected_steps))
    # replaying one sample alone gives the same bits (batch invariance on the trainer's side)
    alone = replay_log_probs(trainer_model, batch.schedule, batch.options, batch.samples[1:2])
    assert torch.equal(alone.log_probs[0], replayed.log_probs[1])


def test_replay_with_other_weights_differs(random_pipeline):
    batch = sample(random_pipeline, PROMPTS, SEEDS, SamplingOptions(num_inference_steps=4))
    updated = copy.deepcopy(random_pipeline)
    with torch.no_grad():
        for p in updated.transformer.parameters():
            p.add_(1e-3 * torch.randn_like(p))
    replayed = replay_log_probs(updated, batch.schedule, batch.options, batch.samples)
    assert not torch.equal(replayed.log_probs, rollout_log_probs(batch, list(range(4))))


def test_replayable_steps_need_both_ends():
    assert replayable_steps(torch.tensor([0, 1, 2, 4, 5])) == [0, 1, 4]
    assert replayable_steps(torch.tensor([0, 2, 4])) == []


def test_replaying_samples_without_latents_says_how_to_get_them(random_pipeline):
    options = SamplingOptions(num_inference_steps=3, return_step_indices=())
    batch = sample(random_pipeline, ["1"], [0], options)
    with pytest.raises(InvalidRequestError, match="rollout_return_dit_trajectory"):
        replay_log_probs(random_pipeline, batch.schedule, batch.options, batch.samples)


@pytest.mark.parametrize("rebuild_dtype", [torch.float32, torch.bfloat16])
def test_rebuilding_sigmas_from_timesteps_breaks_the_ratio(random_pipeline, rebuild_dtype):
    """What a consumer gets when it re-derives the schedule as timesteps / 1000: the PPO ratio
    is no longer exactly 1 on-policy. The returned schedule gives exactly 1."""
    steps = 40
    batch = sample(random_pipeline, PROMPTS, SEEDS, SamplingOptions(num_inference_steps=steps))
    rebuilt = ScheduleSnapshot(
        sigmas=torch.cat([(batch.schedule.timesteps.to(rebuild_dtype) / 1000).float(), torch.zeros(1)]),
        timesteps=batch.schedule.timesteps,
        model_timesteps=batch.schedule.model_timesteps,
    )
    assert not torch.equal(rebuilt.sigmas, batch.schedule.sigmas)

    exact = replay_log_probs(random_pipeline, batch.schedule, batch.options, batch.samples)
    drifted = replay_log_probs(random_pipeline, rebuilt, batch.options, batch.samples)
    rollout = rollout_log_probs(batch, list(range(steps)))

    assert torch.equal(torch.exp(exact.log_probs - rollout), torch.ones_like(rollout))
    log_ratio_error = (drifted.log_probs - rollout).abs().max().item()
    assert log_ratio_error > 0
    print(f"{rebuild_dtype}: max |log ratio| from timesteps / 1000 = {log_ratio_error:.3g}")
    if rebuild_dtype == torch.bfloat16:
        assert log_ratio_error > 1e-2  # visibly off: a PPO clip range is typically 1e-4 .. 0.2


@pytest.mark.parametrize("name", ["embedded-digits", "sd3", "flux", "qwenimage"])
@pytest.mark.parametrize("guided", [True, False], ids=["guided", "unguided"])
def test_a_full_fine_tunes_differentiable_replay_is_bit_identical(name, guided, tiny_family_dirs, one_torch_thread):
    """A counterexample found by tests/test_attention_backend.py's first draft (issue 49): with every
    transformer weight trainable, `transition_log_probs` under autograd was about 1e-6 from the
    rollout on this CPU. `F.linear` on a non-contiguous 3-D input (SD3's `to_add_out`, given the
    context tokens' slice of the joint attention's output) runs a batched product without
    gradients and one matrix product of a contiguous copy when its weight requires grad; the
    replay now runs the former under autograd too (`rollout.kernels.LinearAsWithoutGradients`)."""
    record = TINY_FAMILIES[name]
    path = None if name == "embedded-digits" else tiny_family_dirs[name]
    pipeline = load_pipeline(record.family.name, path, device="cpu")
    size = {} if name == "embedded-digits" else dict(height=32, width=32)
    options = SamplingOptions(num_inference_steps=3, **size, **((record.guided if guided else record.unguided) or {}))
    batch = sample(pipeline, ["7", "nine"], [3, 4], options)
    for module in pipeline.weight_modules.values():
        module.requires_grad_(True)  # the trainer's own copy, every weight trained
    steps = replayable_steps(batch.samples[0].latent_step_indices)
    with torch.enable_grad():
        replayed = transition_log_probs(pipeline, batch.schedule, batch.options, batch.samples, steps)
        replayed.sum().backward()
    assert torch.equal(replayed.detach(), rollout_log_probs(batch, steps))
    for expert in pipeline.experts:  # the loss reaches the denoiser's weights, finite
        gradients = [p.grad for p in pipeline.weight_modules[expert].parameters() if p.grad is not None]
        assert gradients and all(torch.isfinite(g).all() for g in gradients)
