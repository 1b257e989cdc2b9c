"""A pinned attention kernel (`rollout.kernels.AttentionBackend`, `model.attention_backend`): it
changes what the denoisers compute, and a trainer that loads its pipeline with the server's
backend replays the rollout exactly, without gradients and under autograd (training a LoRA
adapter) alike."""

import pytest
import torch
from peft import LoraConfig

from rollout.errors import ModelLoadError
from rollout.kernels import AttentionBackend
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs, replayable_steps, transition_log_probs
from rollout.sampler import sample
from rollout.testing.families import TINY_FAMILIES

# The two SDPA kernels PyTorch has on a CPU; other backends are for GPUs.
CPU_BACKENDS = ("math", "flash")


def loaded(name: str, directories: dict, backend: str):
    path = None if name == "embedded-digits" else directories[name]
    return load_pipeline(TINY_FAMILIES[name].family.name, path, device="cpu", attention_backend=backend)


@pytest.mark.parametrize("name", ["embedded-digits", "sd3"])
def test_a_pinned_backend_is_what_runs_and_replay_with_it_is_exact(name, tiny_family_dirs, one_torch_thread):
    options = SamplingOptions(num_inference_steps=3, **(TINY_FAMILIES[name].guided or {}))
    latents = {}
    for backend in CPU_BACKENDS:
        server = loaded(name, tiny_family_dirs, backend)
        batch = sample(server, ["7", "nine"], [3, 4], options)  # prompts both models take
        latents[backend] = torch.stack([s.latents for s in batch.samples])

        trainer = loaded(name, tiny_family_dirs, backend)  # the trainer's own pipeline, the server's backend
        replayed = replay_log_probs(trainer, batch.schedule, batch.options, batch.samples)
        steps = replayable_steps(batch.samples[0].latent_step_indices)
        expected = torch.stack([s.log_probs[steps] for s in batch.samples])
        assert torch.equal(replayed.log_probs, expected)
        denoiser = trainer.weight_modules[trainer.experts[0]]
        denoiser.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"]))  # B = 0: the same weights
        with torch.enable_grad():
            differentiable = transition_log_probs(trainer, batch.schedule, batch.options, batch.samples, steps)
        assert differentiable.requires_grad and torch.equal(differentiable.detach(), expected)
    # The pin takes effect: the two kernels sum in other orders.
    assert not torch.equal(latents["math"], latents["flash"])


def test_a_backend_that_cannot_run_here_is_refused_at_load_naming_the_field():
    with pytest.raises(ModelLoadError, match=r"model.attention_backend: 'efficient' has no torch.float32 kernel on cpu"):
        load_pipeline(attention_backend="efficient", device="cpu")
    with pytest.raises(ModelLoadError, match=r"model.attention_backend: must be one of \['default', 'math'"):
        AttentionBackend.checked("fastest", "cpu", torch.float32)
