"""Weight updates of a pipeline in one process: full weights and LoRA, from disk and memory."""

import concurrent.futures
import copy
import json
import os
import re
import resource
import struct

import pytest
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from safetensors.torch import save_file

from rollout.checkpoints import UnreadableCheckpointError, disk_update
from rollout.errors import WeightUpdateError
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs, transition_log_probs
from rollout.sampler import sample
from rollout.weights import (
    WeightUpdate,
    apply_update,
    base_weights,
    served_adapter,
    tensor_update,
    weights_checksum,
    weights_layout,
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
    names = weights_layout(pipeline.weight_modules)  # as the coordinator reads them: headers checked first

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


UNREADABLE = (  # the one refusal of every path that cannot be read as a checkpoint
    "cannot be read as a checkpoint (it is missing, unreadable, outside the allowed weight paths, or not a "
    "safetensors file, PEFT adapter or pipeline directory; the server log says which)"
)


def unreadable_cause(call) -> str:
    """The cause of the one refusal `call` raises for a path that cannot be read as a checkpoint."""
    with pytest.raises(UnreadableCheckpointError) as error:
        call()
    assert UNREADABLE in str(error.value) and error.value.cause not in str(error.value)
    return error.value.cause


def test_bad_disk_checkpoints_name_the_cause_in_the_server_log_only(pipeline, tmp_path):
    names = list(pipeline.weight_modules)
    pipeline.save_pretrained(tmp_path / "checkpoint", weights_dtype=torch.float32)
    before = checksums(pipeline)
    (tmp_path / "checkpoint" / "prompt_encoder.safetensors").unlink()
    cause = unreadable_cause(lambda: disk_update(tmp_path / "checkpoint", names))
    assert "no safetensors weights for ['prompt_encoder']" in cause
    weights_file = tmp_path / "checkpoint" / "transformer" / "diffusion_pytorch_model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])  # a partial file
    cause = unreadable_cause(lambda: disk_update(tmp_path / "checkpoint", names, target_modules=["transformer"]))
    assert "not a safetensors file" in cause
    assert "FileNotFoundError" in unreadable_cause(lambda: disk_update(tmp_path / "nowhere", names))
    cause = unreadable_cause(lambda: disk_update(tmp_path / "checkpoint", names, allowed_roots=[tmp_path / "trusted"]))
    assert "outside allowed_weight_paths" in cause
    # The request's own fields are refused by name, whatever the path.
    for path in (tmp_path / "checkpoint", tmp_path / "nowhere"):
        with pytest.raises(WeightUpdateError, match="no such modules"):
            disk_update(path, names, target_modules=["vae"])
    assert checksums(pipeline) == before


# Reading checkpoints safely ----------------------------------------------------------------------


def write_safetensors(path, header, header_bytes=None, data_bytes=None):
    """A safetensors file written by hand, its data a hole (a sparse file: nothing is written)."""
    raw = json.dumps(header).encode()
    if data_bytes is None:
        data_bytes = max(entry["data_offsets"][1] for entry in header.values())
    path.write_bytes(struct.pack("<Q", len(raw) if header_bytes is None else header_bytes) + raw)
    os.truncate(path, 8 + len(raw) + data_bytes)
    return path


# Only a deadlock takes this long: it bounds the wait for a call that would otherwise never return.
HANG_GUARD_SECONDS = 60


def refusal_without_a_writer(call, fifo):
    """The `WeightUpdateError` `call` raises while nothing ever opens `fifo` for writing.

    A call that waits for a writer is released by opening the FIFO's other end, and fails the test.
    """
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        try:
            error = future.exception(timeout=HANG_GUARD_SECONDS)
        except concurrent.futures.TimeoutError:
            os.close(os.open(fifo, os.O_RDWR))  # releases the open it hangs in, so that the suite goes on
            pytest.fail("reading a checkpoint with a FIFO in it waited for a writer of the FIFO")
    assert isinstance(error, WeightUpdateError), error
    return error


def test_a_fifo_is_refused_without_waiting_for_a_writer(pipeline, tmp_path):
    names = weights_layout(pipeline.weight_modules)
    pipeline.save_pretrained(tmp_path / "checkpoint", weights_dtype=torch.float32)
    fifo = tmp_path / "checkpoint" / "transformer" / "diffusion_pytorch_model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)  # opening it for reading waits for a writer, unless opened without blocking
    for path in (tmp_path / "checkpoint", fifo):
        error = refusal_without_a_writer(lambda path=path: disk_update(path, names), fifo)
        assert UNREADABLE in str(error) and "regular file" in error.cause


def test_symlinks_out_of_the_allowed_roots_are_refused_without_naming_their_target(pipeline, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # short relative paths: a refusal names them whole
    names = weights_layout(pipeline.weight_modules)
    pipeline.save_pretrained("trusted/checkpoint", weights_dtype=torch.float32)
    pipeline.save_pretrained("elsewhere/secret-target", weights_dtype=torch.float32)
    module_file = tmp_path / "trusted/checkpoint/transformer/diffusion_pytorch_model.safetensors"
    module_file.unlink()
    module_file.symlink_to(tmp_path / "elsewhere/secret-target/transformer/diffusion_pytorch_model.safetensors")
    (tmp_path / "trusted/passwd.safetensors").symlink_to("/etc/passwd")
    (tmp_path / "trusted/inside.safetensors").symlink_to(tmp_path / "trusted/checkpoint/prompt_encoder.safetensors")

    for path in ("trusted/checkpoint", "trusted/passwd.safetensors"):
        with pytest.raises(UnreadableCheckpointError) as error:
            disk_update(path, names, allowed_roots=["trusted"])
        assert "secret-target" not in str(error.value) and "/etc" not in str(error.value)
        assert "outside allowed_weight_paths" in error.value.cause
    # Nothing tells an existing path outside the roots from a missing one.
    messages = set()
    for path in ("elsewhere/secret-target", "elsewhere/none"):
        with pytest.raises(WeightUpdateError) as error:
            disk_update(path, names, allowed_roots=["trusted"])
        messages.add(str(error.value).replace(path, "<path>"))
    assert len(messages) == 1 and UNREADABLE in messages.pop()
    # A link that stays inside the roots is followed.
    update = disk_update("trusted/inside.safetensors", names, ["prompt_encoder"], allowed_roots=["trusted"])
    assert set(update.state_dicts["prompt_encoder"]) == set(names["prompt_encoder"])


def _resident_bytes():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def _bytes_read():
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_a_header_that_does_not_fit_the_model_is_refused_before_any_data_is_read(pipeline, tmp_path):
    gib = 2**30
    huge = write_safetensors(
        tmp_path / "transformer.safetensors",
        {"not_a_weight": {"dtype": "F32", "shape": [gib // 4], "data_offsets": [0, gib]}},
    )
    assert huge.stat().st_size > gib and huge.stat().st_blocks * 512 < 2**20  # 1 GiB, a hole
    resident, read = _resident_bytes(), _bytes_read()
    with pytest.raises(
        WeightUpdateError, match=r"transformer weights: \d+ missing .*, 1 unexpected \['not_a_weight'\]"
    ):
        disk_update(huge, weights_layout(pipeline.weight_modules))
    grown, bytes_read = _resident_bytes() - resident, _bytes_read() - read
    assert bytes_read < 2**20, f"{bytes_read} bytes read of a 1 GiB file refused by its header"
    assert grown < 4 * 2**20, f"RSS grew {grown / 2**20:+.1f} MiB refusing a 1 GiB file by its header"

    state_dict = pipeline.transformer.state_dict()
    name = next(iter(state_dict))
    save_file({**state_dict, name: torch.zeros(3, 3)}, tmp_path / "wrong-shape.safetensors")
    with pytest.raises(
        WeightUpdateError, match=rf"model_path: transformer weights: {re.escape(name)} has shape \(3, 3\)"
    ):
        disk_update(tmp_path / "wrong-shape.safetensors", weights_layout(pipeline.weight_modules))


def _entry(dtype="F32", shape=(2, 2), offsets=(0, 16)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


@pytest.mark.parametrize(
    "header,sizes,cause",
    [
        ({"a": _entry(offsets=(16, 32))}, {}, "'a' does not start where the tensor before it ends"),
        ({"a": _entry(), "b": _entry(offsets=(24, 40))}, {}, "'b' does not start where the tensor before it ends"),
        ({"a": _entry()}, {"data_bytes": 8}, "its tensors take 16 bytes, 8 follow its header"),
        ({"a": _entry()}, {"data_bytes": 20}, "its tensors take 16 bytes, 20 follow its header"),
        ({"a": _entry(shape=(2, 3))}, {}, "'a' has 16 bytes of data, its shape and dtype take 24"),
        ({"a": _entry(dtype="F128")}, {}, "'a' has dtype 'F128', not one of"),
        ({"a": _entry(shape=(2, -2))}, {}, "'a' has a shape or data offsets that are not counts"),
        ({"a": _entry(offsets=(16, 0))}, {}, "'a' has a shape or data offsets that are not counts"),
        ({"a": {"dtype": "F32"}}, {"data_bytes": 16}, "the entry of 'a' is not a dtype, a shape and data offsets"),
        ({"a": _entry()}, {"header_bytes": 2**40}, "header length 1099511627776 is out of range: longer than the file"),
        ({"a": _entry()}, {"header_bytes": 3}, "its header is not JSON"),
    ],
    ids=["gap-first", "gap", "short", "trailing", "size", "dtype", "negative", "reversed", "entry", "length", "json"],
)
def test_a_header_that_does_not_fit_its_file_is_refused(pipeline, tmp_path, header, sizes, cause):
    path = write_safetensors(tmp_path / "weights.safetensors", header, **sizes)
    assert cause in unreadable_cause(lambda: disk_update(path, list(pipeline.weight_modules)))


def test_duplicate_names_in_a_header_are_refused(pipeline, tmp_path):
    path = write_safetensors(tmp_path / "weights.safetensors", {"a": _entry()})
    path.write_bytes(path.read_bytes().replace(b'{"a": ', b'{"a": {}, "a": ', 1))
    cause = unreadable_cause(lambda: disk_update(path, list(pipeline.weight_modules)))
    assert "not a safetensors file: its header is not JSON" in cause


def _non_finite(state_dict, value, dtype=None):
    name = next(iter(state_dict))
    tensor = state_dict[name].to(dtype or state_dict[name].dtype).clone()
    tensor.view(-1)[3] = value
    return name, {**state_dict, name: tensor}


@pytest.mark.parametrize(
    "value,dtype",
    [(float("nan"), None), (float("inf"), None), (-float("inf"), None), (1e300, torch.float64)],
    ids=["nan", "inf", "-inf", "float64-overflow"],
)
def test_non_finite_weights_are_refused_naming_the_tensor(pipeline, value, dtype):
    before = checksums(pipeline)
    name, state_dict = _non_finite(perturbed_state_dict(pipeline.transformer), value, dtype)
    with pytest.raises(WeightUpdateError, match=rf"transformer weights: {re.escape(name)} has NaN or infinite values"):
        apply_update(pipeline.weight_modules, tensor_update(state_dict))
    assert checksums(pipeline) == before
    if dtype is torch.float64:  # finite as float64: a float64 model takes it, only the cast to float32 overflows
        float64_transformer = copy.deepcopy(pipeline.transformer).double()
        apply_update({"transformer": float64_transformer}, tensor_update(state_dict))
        assert torch.equal(base_weights(float64_transformer)[name], state_dict[name])


def test_a_weight_the_model_holds_non_finite_may_stay_so(pipeline):
    state_dict = perturbed_state_dict(pipeline.transformer)
    name = next(iter(state_dict))
    with torch.no_grad():
        base_weights(pipeline.transformer)[name].view(-1)[0] = -float("inf")  # as a mask buffer would be
    state_dict[name].view(-1)[0] = -float("inf")
    apply_update(pipeline.weight_modules, tensor_update(state_dict))
    served = base_weights(pipeline.transformer)
    assert served[name].view(-1)[0] == -float("inf")
    unequal = [key for key, tensor in state_dict.items() if not torch.equal(served[key], tensor)]
    assert not unequal, f"the update was not applied to {unequal}"


@pytest.mark.parametrize(
    "change,field,cause",
    [
        (lambda tensors: {**tensors, "alpha": float("inf")}, "lora_alpha", "must be finite and > 0, got inf"),
        (lambda tensors: {**tensors, "alpha": float("nan")}, "lora_alpha", "must be finite and > 0, got nan"),
        (lambda tensors: {**tensors, "alpha": 1e300}, "lora_alpha", "lora_alpha / lora_rank = 2.5e+299 is not finite"),
        (lambda tensors: {**tensors, "rank": 0}, "lora_rank", "must be >= 1"),
    ],
    ids=["alpha-inf", "alpha-nan", "alpha-over-rank", "rank"],
)
def test_lora_configs_that_would_break_sampling_are_refused(pipeline, change, field, cause):
    _, adapter_tensors = trained_adapter(pipeline)
    given = change({"tensors": adapter_tensors, "rank": 4, "alpha": 8.0})
    update = tensor_update(given["tensors"], lora_rank=given["rank"], lora_alpha=given["alpha"])
    with pytest.raises(WeightUpdateError, match=f"^{field}: {re.escape(cause)}"):
        apply_update(pipeline.weight_modules, update)
    assert served_adapter(pipeline.transformer) is None


def test_non_finite_lora_tensors_are_refused_naming_the_tensor(pipeline):
    _, adapter_tensors = trained_adapter(pipeline)
    name = min(adapter_tensors)
    adapter_tensors[name] = adapter_tensors[name].double()
    adapter_tensors[name].view(-1)[0] = 1e300
    with pytest.raises(WeightUpdateError, match=rf"transformer LoRA: {re.escape(name)} has NaN or infinite values"):
        apply_update(pipeline.weight_modules, tensor_update(adapter_tensors, lora_rank=4, lora_alpha=8))
    assert served_adapter(pipeline.transformer) is None


def test_an_adapter_on_disk_is_checked_from_its_header(pipeline, tmp_path):
    _, adapter_tensors = trained_adapter(pipeline)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(
        {"blocks.99.attn.to_q.lora_A.weight": torch.zeros(4, 8), **adapter_tensors},
        adapter / "adapter_model.safetensors",
    )
    (adapter / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    with pytest.raises(WeightUpdateError, match=r"model_path: transformer LoRA: 0 missing \[\], 1 unexpected"):
        disk_update(adapter, weights_layout(pipeline.weight_modules))
    save_file(adapter_tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text('{"r": 4, "lora_alpha": Infinity}')
    with pytest.raises(WeightUpdateError, match="lora_alpha: must be finite"):
        disk_update(adapter, weights_layout(pipeline.weight_modules))


def test_refusals_do_not_tell_missing_readable_or_directory_paths_apart_nor_name_the_process(
    pipeline, tmp_path, monkeypatch
):
    """Whatever is at a path that cannot be read as a checkpoint, the refusal is the same: with
    `allowed_weight_paths` empty, anything else would let a client probe the server's disk."""
    monkeypatch.chdir(tmp_path)  # short relative paths: a refusal names them whole
    names = list(pipeline.weight_modules)
    os.mkfifo("fifo")
    os.symlink("loop", "loop")
    with open("file", "wb") as file:
        file.write(b"x")
    os.makedirs("adapter/adapter_model.safetensors")  # a directory where a file is wanted
    with open("adapter/adapter_config.json", "w") as config:
        config.write('{"r": 4, "lora_alpha": 8}')
    refused = [  # (path, target_modules, allowed_roots)
        ("missing", None, ()),
        ("fifo", None, ()),
        ("loop", None, ()),
        ("file/below", None, ()),
        ("/dev/null", None, ()),
        ("file", None, ()),  # readable, not a safetensors file
        ("/proc/self/status", None, ()),
        (".", None, ()),  # a directory without weights
        ("adapter", None, ()),
        ("file", ["transformer", "prompt_encoder"], ()),  # two modules for one file
        ("/proc/self/status", None, ["."]),  # outside the allowed roots
    ]
    if os.geteuid() != 0:  # root reads a file of mode 000 anyway
        with open("secret", "wb") as file:
            file.write(b"x")
        os.chmod("secret", 0)
        refused.append(("secret", None, ()))
    messages = set()
    for path, target_modules, allowed_roots in refused:
        with pytest.raises(WeightUpdateError) as error:
            disk_update(path, names, target_modules, allowed_roots)
        messages.add(str(error.value).replace(repr(path), "<path>"))
    assert messages == {f"model_path: <path> {UNREADABLE}"}

    with pytest.raises(WeightUpdateError, match="is empty"):
        disk_update("", names)
    with pytest.raises(UnreadableCheckpointError) as error:
        disk_update("/" + "x" * 300_000, names)
    assert len(str(error.value)) < 300
