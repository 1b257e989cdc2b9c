"""Weight updates of a pipeline in one process: full weights and LoRA, from disk and memory."""

import copy

import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs, transition_log_probs
from rollout.sampler import sample
from rollout.weights import (
    WeightUpdate,
    WeightUpdateError,
    apply_update,
    base_weights,
    disk_update,
    served_adapter,
    tensor_update,
    weights_checksum,
)

PROMPTS, SEEDS = ["3", "8", "a handwritten 5"], [11, 12, 13]
OPTIONS = SamplingOptions(num_inference_steps=5, debug=True)
LORA = dict(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"])


@pytest.fixture
def pipeline(random_pipeline):
    return copy.deepcopy(random_pipeline)  # each test mutates its own copy


def checksums(pipeline):
    return {name: weights_checksum(module) for name, module in pipeline.weight_modules.items()}


def perturbed_state_dict(module, scale=1e-2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return {
        name: t.detach() + scale * torch.randn(t.shape, generator=generator) if t.is_floating_point() else t.clone()
        for name, t in module.state_dict().items()
    }


def trained_adapter(pipeline, seed=0):
    """A trainer's copy with a PEFT adapter whose B is not zero, and the adapter's tensors."""
    trainer = copy.deepcopy(pipeline)
    trainer.transformer.add_adapter(LoraConfig(**LORA))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in trainer.transformer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    return trainer, get_peft_model_state_dict(trainer.transformer)


def test_a_full_update_serves_the_new_weights_and_undoes_exactly(pipeline):
    before = checksums(pipeline)
    new = perturbed_state_dict(pipeline.transformer)
    undo = apply_update(pipeline.weight_modules, tensor_update(new))
    assert all(torch.equal(base_weights(pipeline.transformer)[k], v) for k, v in new.items())
    assert checksums(pipeline)["transformer"] != before["transformer"]
    assert checksums(pipeline)["prompt_encoder"] == before["prompt_encoder"]
    apply_update(pipeline.weight_modules, undo)
    assert checksums(pipeline) == before


@pytest.mark.parametrize(
    "change,cause",
    [
        (lambda sd: sd.pop(next(iter(sd))), "missing"),
        (lambda sd: sd.update({"extra.weight": torch.zeros(2)}), "unexpected"),
        (lambda sd: sd.update({k: torch.zeros(3, 3) for k in list(sd)[:1]}), "shape"),
        (lambda sd: sd.update({k: v.to(torch.int32) for k, v in list(sd.items())[:1]}), "torch.int32"),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
def test_a_bad_update_names_the_cause_and_changes_nothing(pipeline, change, cause):
    before = checksums(pipeline)
    state_dict = perturbed_state_dict(pipeline.transformer)
    change(state_dict)
    with pytest.raises(WeightUpdateError, match=cause):
        apply_update(pipeline.weight_modules, tensor_update(state_dict))
    assert checksums(pipeline) == before


def test_an_update_that_fails_half_way_is_undone(pipeline, monkeypatch):
    from rollout import weights

    before = checksums(pipeline)
    _, adapter_tensors = trained_adapter(pipeline)
    update = WeightUpdate(
        state_dicts={"transformer": perturbed_state_dict(pipeline.transformer)},
        lora={"transformer": tensor_update(adapter_tensors, lora_rank=4, lora_alpha=8).lora["transformer"]},
    )
    serve_adapter = weights._serve_adapter

    def failing_once(module, adapter):
        monkeypatch.setattr(weights, "_serve_adapter", serve_adapter)
        raise RuntimeError("device lost")

    monkeypatch.setattr(weights, "_serve_adapter", failing_once)
    with pytest.raises(WeightUpdateError, match="undone: device lost"):
        apply_update(pipeline.weight_modules, update)
    assert checksums(pipeline) == before  # the full weights written first were restored
    assert served_adapter(pipeline.transformer) is None


def test_lora_rollouts_replay_exactly_with_the_trainers_peft_model(pipeline):
    trainer, adapter_tensors = trained_adapter(pipeline)
    base = sample(pipeline, PROMPTS, SEEDS, OPTIONS)
    undo = apply_update(pipeline.weight_modules, tensor_update(adapter_tensors, lora_rank=4, lora_alpha=8))
    assert weights_checksum(pipeline.transformer) == weights_checksum(trainer.transformer)

    batch = sample(pipeline, PROMPTS, SEEDS, OPTIONS)
    # The adapter moved the trajectory. (Not the log-probs of the rollout's own draws: those are
    # log N(noise) whatever the mean, so they may round to the same bits.)
    assert not torch.equal(batch.samples[0].latents, base.samples[0].latents)
    replayed = replay_log_probs(trainer, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))
    # With gradients on, as a trainer computes its loss: the same bits, and a gradient for the adapter.
    trainer.transformer.train()
    with_grad = transition_log_probs(trainer, batch.schedule, batch.options, batch.samples, [1, 2, 3])
    assert torch.equal(with_grad.detach(), replayed.log_probs[:, 1:4])
    with_grad.sum().backward()
    lora_grads = [p.grad for n, p in trainer.transformer.named_parameters() if "lora_A" in n]
    assert lora_grads and all(g is not None and g.abs().sum() > 0 for g in lora_grads)

    apply_update(pipeline.weight_modules, undo)
    assert served_adapter(pipeline.transformer) is None
    restored = sample(pipeline, PROMPTS, SEEDS, OPTIONS)
    assert torch.equal(restored.samples[0].latents, base.samples[0].latents)


def test_a_new_lora_replaces_the_served_one(pipeline):
    _, first = trained_adapter(pipeline, seed=1)
    second_trainer, second = trained_adapter(pipeline, seed=2)
    apply_update(pipeline.weight_modules, tensor_update(first, lora_rank=4, lora_alpha=8))
    apply_update(pipeline.weight_modules, tensor_update(second, lora_rank=4, lora_alpha=8))
    assert weights_checksum(pipeline.transformer) == weights_checksum(second_trainer.transformer)
    # A different rank re-creates the adapter.
    rank_two = {k: v[:2] if "lora_A" in k else v[:, :2] for k, v in second.items()}
    apply_update(pipeline.weight_modules, tensor_update(rank_two, lora_rank=2, lora_alpha=2))
    assert served_adapter(pipeline.transformer).rank == 2


@pytest.mark.parametrize(
    "kwargs,cause",
    [
        (dict(lora_rank=8, lora_alpha=8), "shape"),
        (dict(lora_rank=4, lora_alpha=8, target_modules=["prompt_encoder"]), "does not take LoRA"),
        (dict(), "need lora_rank"),
        (dict(lora_rank=4, lora_alpha=8, target_modules=["vae"]), "no such modules"),
    ],
)
def test_bad_lora_updates_name_the_cause(pipeline, kwargs, cause):
    _, adapter_tensors = trained_adapter(pipeline)
    with pytest.raises(WeightUpdateError, match=cause):
        apply_update(pipeline.weight_modules, tensor_update(adapter_tensors, **kwargs))
    assert served_adapter(pipeline.transformer) is None


def test_disk_checkpoints_in_every_layout(pipeline, tmp_path):
    trained = copy.deepcopy(pipeline)
    apply_update(trained.weight_modules, tensor_update(perturbed_state_dict(trained.transformer)))
    names = list(pipeline.weight_modules)

    # 1. The embedded model's packaged layout (transformer/ in diffusers' layout, prompt_encoder.safetensors).
    trained.save_pretrained(tmp_path / "checkpoint", weights_dtype=torch.float32)
    before = checksums(pipeline)
    apply_update(pipeline.weight_modules, disk_update(tmp_path / "checkpoint", names))
    assert checksums(pipeline) == checksums(trained) != before

    # 2. One safetensors file of the trainable module.
    save_file(perturbed_state_dict(pipeline.transformer, seed=5), tmp_path / "transformer.safetensors")
    apply_update(pipeline.weight_modules, disk_update(tmp_path / "transformer.safetensors", names))
    assert checksums(pipeline)["transformer"] != checksums(trained)["transformer"]

    # 3. A PEFT adapter directory, as PEFT's save_pretrained writes it.
    adapter_trainer, _ = trained_adapter(pipeline)
    adapter_trainer.transformer.save_lora_adapter(tmp_path / "adapter")
    peft_layout = tmp_path / "peft"
    peft_layout.mkdir()
    (peft_layout / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (tmp_path / "adapter" / "pytorch_lora_weights.safetensors").rename(peft_layout / "adapter_model.safetensors")
    apply_update(pipeline.weight_modules, disk_update(peft_layout, names))
    assert served_adapter(pipeline.transformer).rank == 4

    # A whole checkpoint is served as it is: the adapter goes.
    apply_update(pipeline.weight_modules, disk_update(tmp_path / "checkpoint", names))
    assert served_adapter(pipeline.transformer) is None and checksums(pipeline) == checksums(trained)


def test_bad_disk_checkpoints_name_the_cause(pipeline, tmp_path):
    names = list(pipeline.weight_modules)
    pipeline.save_pretrained(tmp_path / "checkpoint", weights_dtype=torch.float32)
    before = checksums(pipeline)
    (tmp_path / "checkpoint" / "prompt_encoder.safetensors").unlink()
    with pytest.raises(WeightUpdateError, match=r"no safetensors weights for \['prompt_encoder'\]"):
        disk_update(tmp_path / "checkpoint", names)
    weights_file = tmp_path / "checkpoint" / "transformer" / "diffusion_pytorch_model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])  # a partial file
    with pytest.raises(WeightUpdateError, match="cannot read"):
        disk_update(tmp_path / "checkpoint", names, target_modules=["transformer"])
    with pytest.raises(WeightUpdateError, match="does not exist"):
        disk_update(tmp_path / "nowhere", names)
    with pytest.raises(WeightUpdateError, match="outside the allowed weight paths"):
        disk_update(tmp_path / "checkpoint", names, allowed_roots=[tmp_path / "trusted"])
    with pytest.raises(WeightUpdateError, match="no such modules"):
        disk_update(tmp_path / "checkpoint", names, target_modules=["vae"])
    assert checksums(pipeline) == before
