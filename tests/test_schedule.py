import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.errors import InvalidRequestError
from rollout.schedule import ScheduleSnapshot, timesteps_as_they_are


def fresh_schedule(config: dict, num_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas, scheduler.timesteps


@pytest.mark.parametrize("num_steps", [1, 2, 3, 7, 20, 40, 50])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_snapshot_is_bit_identical_to_a_fresh_scheduler(num_steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(13)  # a stale state from an earlier request must not leak in
    snapshot = ScheduleSnapshot.from_scheduler(scheduler, num_steps, model_timesteps=timesteps_as_they_are)
    sigmas, timesteps = fresh_schedule(scheduler.config, num_steps)

    assert snapshot.sigmas.dtype == torch.float32
    assert snapshot.sigmas.shape == (num_steps + 1,)
    assert snapshot.timesteps.shape == (num_steps,)
    assert snapshot.sigmas[-1].item() == 0.0
    assert torch.equal(snapshot.sigmas, sigmas)
    assert torch.equal(snapshot.timesteps, timesteps)
    assert snapshot.timesteps.dtype == timesteps.dtype


def test_snapshot_does_not_change_when_the_scheduler_does():
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    snapshot = ScheduleSnapshot.from_scheduler(scheduler, 40, model_timesteps=timesteps_as_they_are)
    expected = snapshot.sigmas.clone(), snapshot.timesteps.clone()

    scheduler.sigmas.mul_(0.5)
    scheduler.timesteps.add_(1)
    scheduler.set_timesteps(7)

    assert torch.equal(snapshot.sigmas, expected[0])
    assert torch.equal(snapshot.timesteps, expected[1])


def test_shifted_sigmas_are_not_timesteps_over_1000():
    # The drift this project exists to remove: in fp32, timesteps / 1000 is not the schedule.
    snapshot = ScheduleSnapshot.from_scheduler(FlowMatchEulerDiscreteScheduler(shift=3.0), 40, model_timesteps=timesteps_as_they_are)
    rebuilt = snapshot.timesteps / 1000
    assert not torch.equal(rebuilt, snapshot.sigmas[:-1])


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "20", None])
def test_bad_step_count_names_the_field(bad):
    with pytest.raises(InvalidRequestError) as info:
        ScheduleSnapshot.from_scheduler(FlowMatchEulerDiscreteScheduler(), bad, model_timesteps=timesteps_as_they_are)
    assert info.value.field == "num_inference_steps"


def test_snapshot_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="T \\+ 1"):
        ScheduleSnapshot(sigmas=torch.zeros(4), timesteps=torch.zeros(4), model_timesteps=torch.zeros(4))
    with pytest.raises(ValueError, match="float32"):
        ScheduleSnapshot(sigmas=torch.zeros(4, dtype=torch.float64), timesteps=torch.zeros(3), model_timesteps=torch.zeros(3))


def test_the_time_input_is_required_never_defaulted():
    with pytest.raises(TypeError, match="model_timesteps"):
        ScheduleSnapshot(sigmas=torch.zeros(4), timesteps=torch.zeros(3))
    with pytest.raises(TypeError, match="model_timesteps"):
        ScheduleSnapshot.from_scheduler(FlowMatchEulerDiscreteScheduler(), 3)
