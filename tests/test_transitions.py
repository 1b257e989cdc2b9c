"""The transitions against an independent float64 reference written from the formulas."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.properties import reference_transition
from rollout.schedule import ScheduleSnapshot, timesteps_as_they_are
from rollout.transitions import (
    HeldFrames,
    LogProbForm,
    TransitionKind,
    gaussian_log_prob,
    take_step,
)

SCHEDULE = ScheduleSnapshot.from_scheduler(FlowMatchEulerDiscreteScheduler(shift=3.0), 10, model_timesteps=timesteps_as_they_are)
SHAPE = (3, 1, 4, 4)


def reference_step(kind, x, v, s, s_next, eta, sigma_after_one, eps):
    """float64 numpy: returns (mean, noise std of x_next, x_next), by the property test's formulas."""
    mean, noise_std = reference_transition(kind, x, v, s, s_next, eta, sigma_after_one)
    return mean, noise_std, mean + noise_std * eps


def assert_mean_close(kind, actual, expected, x, v, s, s_next, eta):
    """fp32 `actual` against float64 `expected` within what fp32 rounding may move the mean:
    DanceGRPO's score divides x_t - x0_hat (1 - sigma), a difference of two near-equal terms, by
    sigma^2, which the step multiplies by eta^2 |dt| / 2: ulps of x_t and x0_hat grow by that much."""
    bound = 1e-6 + 1e-5 * np.abs(expected)
    if kind == "dance":
        bound = bound + 8 * 2.0**-24 * (np.abs(x) + np.abs(x - s * v)) * 0.5 * eta**2 * (s - s_next) / s**2
    assert (np.abs(actual - expected) <= bound).all(), float((np.abs(actual - expected) / bound).max())


def reference_log_prob(x_next, mean, noise_std, form):
    if noise_std == 0:
        return np.zeros(x_next.shape[0])
    if form == "squared_error":
        density = -((x_next - mean) ** 2)
    else:
        density = -((x_next - mean) ** 2) / (2 * noise_std**2)
    if form == "gaussian":
        density = density - math.log(noise_std) - 0.5 * math.log(2 * math.pi)
    return density.reshape(x_next.shape[0], -1).mean(axis=1)


def draw(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SHAPE, generator=g) for _ in range(3))


@pytest.mark.parametrize("kind", list(TransitionKind))
@pytest.mark.parametrize("step", [0, 1, 5, 9])
@pytest.mark.parametrize("eta", [0.3, 0.7, 1.0])
@pytest.mark.parametrize("form", list(LogProbForm))
def test_sampling_matches_the_reference(kind, step, eta, form):
    x, v, eps = draw(step)
    sigmas = SCHEDULE.sigmas
    transition = take_step(
        kind,
        x,
        v,
        sigmas[step],
        sigmas[step + 1],
        eta=eta,
        sigma_after_one=sigmas[1],
        noise=None if kind is TransitionKind.ODE else eps,
        log_prob_form=form,
    )
    mean, noise_std, x_next = reference_step(
        kind.value,
        x.double().numpy(),
        v.double().numpy(),
        sigmas[step].item(),
        sigmas[step + 1].item(),
        eta,
        sigmas[1].item(),
        eps.double().numpy(),
    )
    x64, v64 = x.double().numpy(), v.double().numpy()
    s, s_next = sigmas[step].item(), sigmas[step + 1].item()
    assert_mean_close(kind.value, transition.mean.numpy(), mean, x64, v64, s, s_next, eta)
    np.testing.assert_allclose(transition.noise_std.item(), noise_std, rtol=1e-5, atol=1e-7)
    assert_mean_close(kind.value, transition.x_next.numpy(), x_next, x64, v64, s, s_next, eta)
    expected = reference_log_prob(transition.x_next.double().numpy(), mean, noise_std, form.value)
    np.testing.assert_allclose(transition.log_prob.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert transition.log_prob.shape == (SHAPE[0],)
    assert transition.x_next.dtype == transition.log_prob.dtype == torch.float32


def test_sde_first_step_uses_sigma_after_one():
    assert SCHEDULE.sigmas[0].item() == 1.0
    x, v, eps = draw(0)
    sigmas = SCHEDULE.sigmas
    transition = take_step(
        TransitionKind.SDE, x, v, sigmas[0], sigmas[1], eta=0.7, sigma_after_one=sigmas[1], noise=eps
    )
    expected_std = 0.7 * math.sqrt(1 / (1 - sigmas[1].item())) * math.sqrt(sigmas[0].item() - sigmas[1].item())
    assert math.isfinite(transition.noise_std.item())
    assert transition.noise_std.item() == pytest.approx(expected_std, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ode_is_bit_identical_to_the_diffusers_euler_step(dtype):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    x, v, _ = draw(3)
    x = x.to(dtype)
    for step in range(10):
        scheduler._step_index = step
        expected = scheduler.step(v, scheduler.timesteps[step], x, return_dict=False)[0]
        ours = take_step(
            TransitionKind.ODE, x, v, scheduler.sigmas[step], scheduler.sigmas[step + 1],
            eta=0.7, sigma_after_one=scheduler.sigmas[1],
        )
        assert torch.equal(ours.x_next, expected.float())
        assert torch.equal(ours.log_prob, torch.zeros(SHAPE[0]))


def dance_grpo_flux_step(model_output, latents, eta, sigmas, index, prev_sample):
    """DanceGRPO's `flux_step` with `sde_solver` and `grpo` on (fastvideo/train_grpo_flux.py; the
    same in MixGRPO and BranchGRPO), written again in float64 numpy: (mean, std, log_prob)."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
    log_term = -0.5 * eta**2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    log_prob = -((prev_sample - prev_sample_mean) ** 2) / (2 * std_dev_t**2) - math.log(std_dev_t) - math.log(math.sqrt(2 * math.pi))
    return prev_sample_mean, std_dev_t, log_prob.reshape(len(log_prob), -1).mean(axis=1)


@pytest.mark.parametrize("step", range(10))  # the first (sigma 1) and the last (sigma_next 0) included
@pytest.mark.parametrize("eta", [0.3, 1.0])  # DanceGRPO's default, and more
def test_dance_is_dance_grpos_own_step_and_log_prob(step, eta):
    x, v, eps = draw(20 + step)
    sigmas = SCHEDULE.sigmas
    common = dict(eta=eta, sigma_after_one=sigmas[1])
    sampled = take_step(TransitionKind.DANCE, x, v, sigmas[step], sigmas[step + 1], noise=eps, **common)
    mean, std, log_prob = dance_grpo_flux_step(
        v.double().numpy(), x.double().numpy(), eta, sigmas.double().numpy(), step, sampled.x_next.double().numpy()
    )
    x64, v64, s, s_next = x.double().numpy(), v.double().numpy(), sigmas[step].item(), sigmas[step + 1].item()
    assert_mean_close("dance", sampled.mean.numpy(), mean, x64, v64, s, s_next, eta)
    assert sampled.noise_std.item() == pytest.approx(std, rel=1e-6)
    assert_mean_close("dance", sampled.x_next.numpy(), mean + std * eps.double().numpy(), x64, v64, s, s_next, eta)
    np.testing.assert_allclose(sampled.log_prob.numpy(), log_prob, rtol=1e-4, atol=1e-4)
    # Without the constants (the ratio is the same), as a trainer replaying it scores it.
    no_const = take_step(
        TransitionKind.DANCE, x, v, sigmas[step], sigmas[step + 1], x_next=sampled.x_next, log_prob_form=LogProbForm.GAUSSIAN_NO_CONST, **common
    )
    np.testing.assert_allclose(no_const.log_prob.numpy(), log_prob + math.log(std) + 0.5 * math.log(2 * math.pi), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", [TransitionKind.SDE, TransitionKind.CPS, TransitionKind.DANCE])
def test_scoring_the_sampled_latent_gives_the_same_bits(kind):
    x, v, eps = draw(7)
    sigmas = SCHEDULE.sigmas
    common = dict(eta=0.7, sigma_after_one=sigmas[1])
    sampled = take_step(kind, x, v, sigmas[4], sigmas[5], noise=eps, **common)
    scored = take_step(kind, x, v, sigmas[4], sigmas[5], x_next=sampled.x_next.clone(), **common)
    assert torch.equal(sampled.log_prob, scored.log_prob)
    assert torch.equal(sampled.mean, scored.mean)


def log_ratio(form, kind=TransitionKind.SDE):
    """log p_new(x_next) - log p_old(x_next) for a velocity moved by 0.01, in `form`."""
    x, v, eps = draw(8)
    sigmas = SCHEDULE.sigmas
    common = dict(eta=0.7, sigma_after_one=sigmas[1], log_prob_form=form)
    old = take_step(kind, x, v, sigmas[2], sigmas[3], noise=eps, **common)
    new = take_step(kind, x, v + 0.01, sigmas[2], sigmas[3], x_next=old.x_next, **common)
    return new.log_prob - old.log_prob, old.noise_std


@pytest.mark.parametrize("kind", [TransitionKind.SDE, TransitionKind.CPS, TransitionKind.DANCE])
def test_only_the_constants_free_gaussian_keeps_the_ppo_ratio(kind):
    true_ratio, noise_std = log_ratio(LogProbForm.GAUSSIAN, kind)
    without_constants, _ = log_ratio(LogProbForm.GAUSSIAN_NO_CONST, kind)
    squared_error, _ = log_ratio(LogProbForm.SQUARED_ERROR, kind)
    torch.testing.assert_close(without_constants, true_ratio)
    # SGLang's constant-free form is the true log-ratio times 2 std^2: a step-dependent temperature.
    torch.testing.assert_close(squared_error, true_ratio * 2 * noise_std**2, rtol=1e-3, atol=1e-7)
    assert not torch.allclose(squared_error, true_ratio, rtol=0.1, atol=0)


def test_zero_noise_is_deterministic_with_zero_log_prob():
    x, v, eps = draw(9)
    sigmas = SCHEDULE.sigmas
    last = SCHEDULE.num_steps - 1
    # cps at the last step has std = sigma_next * sin(...) = 0; an sde with eta = 0 is the ODE.
    for kind, eta, step in [(TransitionKind.CPS, 0.7, last), (TransitionKind.SDE, 0.0, 3)]:
        t = take_step(kind, x, v, sigmas[step], sigmas[step + 1], eta=eta, sigma_after_one=sigmas[1], noise=eps)
        assert t.noise_std.item() == 0.0
        assert torch.equal(t.x_next, t.mean)
        assert torch.equal(t.log_prob, torch.zeros(SHAPE[0]))


def test_a_stochastic_step_needs_exactly_one_of_noise_or_x_next():
    x, v, eps = draw(10)
    sigmas = SCHEDULE.sigmas
    with pytest.raises(ValueError, match="exactly one"):
        take_step(TransitionKind.SDE, x, v, sigmas[0], sigmas[1], eta=0.7, sigma_after_one=sigmas[1])
    with pytest.raises(ValueError, match="exactly one"):
        take_step(TransitionKind.SDE, x, v, sigmas[0], sigmas[1], eta=0.7, sigma_after_one=sigmas[1], noise=eps, x_next=x)


def test_gaussian_log_prob_is_a_per_sample_mean():
    x = torch.zeros(2, 3)
    log_prob = gaussian_log_prob(x, torch.zeros(2, 3), torch.tensor(1.0))
    assert log_prob.shape == (2,)
    assert log_prob[0].item() == pytest.approx(-0.5 * math.log(2 * math.pi))


@settings(max_examples=40, deadline=None)
@given(
    held_rows=st.lists(st.booleans(), min_size=1, max_size=4),
    frames=st.integers(2, 4),
    held_frames=st.integers(1, 3),
    kind=st.sampled_from([TransitionKind.SDE, TransitionKind.CPS]),
    form=st.sampled_from(list(LogProbForm)),
    step=st.integers(0, 8),
    seed=st.integers(0, 2**16),
)
def test_held_frames_are_replaced_and_the_log_prob_is_the_free_frames_alone_in_any_batch(
    held_rows, frames, held_frames, kind, form, step, seed
):
    """A row that holds its first frames (a video's first frame given as an image) gets them in x_next
    whatever was drawn, and its log-prob is, bit for bit, that of its other frames scored alone; a
    row that holds none is scored as without `held`; each row is what it is in a batch of one."""
    held_frames = min(held_frames, frames - 1)
    g = torch.Generator().manual_seed(seed)
    x, v, noise = (torch.randn((len(held_rows), 3, frames, 2, 2), generator=g) for _ in range(3))
    held = HeldFrames(torch.tensor(held_rows), torch.randn((len(held_rows), 3, held_frames, 2, 2), generator=g))
    sigmas = SCHEDULE.sigmas

    def taken(rows, **given):
        return take_step(kind, x[rows], v[rows], sigmas[step], sigmas[step + 1], eta=0.7, sigma_after_one=sigmas[1],
                         log_prob_form=form, **given)

    every_row = slice(None)
    with_held = taken(every_row, noise=noise, held=held)
    without = taken(every_row, noise=noise)
    for row, holds in enumerate(held_rows):
        if holds:
            assert torch.equal(with_held.x_next[row, :, :held_frames], held.values[row])
            free = gaussian_log_prob(
                without.x_next[row : row + 1, :, held_frames:].contiguous(),
                without.mean[row : row + 1, :, held_frames:].contiguous(),
                without.noise_std,
                form,
            )
            assert torch.equal(with_held.log_prob[row : row + 1], free)
        else:
            assert torch.equal(with_held.x_next[row], without.x_next[row])
            assert torch.equal(with_held.log_prob[row], without.log_prob[row])
        assert torch.equal(with_held.x_next[row, :, held_frames:], without.x_next[row, :, held_frames:])
        alone = taken(slice(row, row + 1), noise=noise[row : row + 1], held=held.select(torch.tensor([row])))
        assert torch.equal(alone.x_next[0], with_held.x_next[row]) and torch.equal(alone.log_prob[0], with_held.log_prob[row])
    # Scoring what was sampled gives its bits back, whatever x_next held before.
    scored = taken(every_row, x_next=without.x_next, held=held)
    assert torch.equal(scored.x_next, with_held.x_next) and torch.equal(scored.log_prob, with_held.log_prob)


def test_held_frames_refuse_rows_and_values_that_disagree():
    with pytest.raises(ValueError, match="held frames need"):
        HeldFrames(torch.tensor([True, False]), torch.zeros(3, 4, 1, 2, 2))
