"""Fixed-block kernels (`rollout.kernels`, `BatchInvariance.KERNELS`): any call size gives a sample
the same bits, with no padding, for the operations alone and for every family end to end."""

import contextlib
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from rollout.calibration import calibrate, check_batch_invariance, require_batch_invariance
from rollout.errors import InvalidRequestError, ModelLoadError
from rollout.kernels import BatchInvariance, BatchInvariantKernels, branches_in_one_call
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs, transition_log_probs
from rollout.sampler import sample, sample_call
from rollout.testing.families import IMAGE_FAMILIES, TINY_FAMILIES
from rollout.weights import apply_update, tensor_update

SIZE = 64
LONG_PROMPT = "a very long prompt about a lighthouse on a cliff in a storm at night"  # Qwen-Image's bucket 64


def kernels(default: int = 4) -> MicroBatching:
    return MicroBatching(default, invariance=BatchInvariance.KERNELS)


@pytest.fixture(scope="module")
def family_pipelines(tiny_family_dirs):
    return {
        family: load_pipeline(family, tiny_family_dirs[family], device="cpu", micro_batching=kernels())
        for family in IMAGE_FAMILIES
    }


# The operations alone --------------------------------------------------------------------------


def test_a_linear_row_is_the_same_alone_and_beside_others():
    # Whether the stock kernel gives this row other bits in calls of 1, 2 and 4 depends on the CPU
    # (it did on the machines of earlier sessions, not on an AVX512 one of 2026-12-06), so only the
    # mode's guarantee is asserted.
    generator = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 40, generator=generator), torch.randn(48, generator=generator)
    tokens = torch.randn(7, 5, 40, generator=generator)  # (samples, tokens, features)
    linear_map = tokens @ weight.T + bias
    with BatchInvariantKernels():
        alone = F.linear(tokens[3:4], weight, bias)[0]
        others = [0, 1, 2, 4, 5, 6]
        for count in (2, 4, 7):
            position = count // 2  # sample 3 among count - 1 others
            order = others[:position] + [3] + others[position : count - 1]
            assert torch.equal(F.linear(tokens[order], weight, bias)[position], alone)
        # A transposed (non-contiguous) input is laid out once, whatever its strides.
        transposed = tokens.transpose(1, 2).contiguous().transpose(1, 2)
        assert torch.equal(F.linear(transposed, weight, bias)[3], alone)
        torch.testing.assert_close(F.linear(tokens, weight, bias), linear_map)
        # Unbatched inputs, a single vector or image, are left to the stock kernels.
        assert torch.equal(F.linear(tokens[0, 0], weight, bias), tokens[0, 0] @ weight.T + bias)
        image, kernel = torch.randn(2, 5, 5), torch.randn(3, 2, 3, 3)
        assert F.conv2d(image, kernel).shape == (3, 3, 3)


def test_a_sample_sliced_from_a_call_has_the_strides_it_has_alone():
    # A counterexample of benchmarks.properties (SD3 and FLUX.1 serving a LoRA): a sample's rows
    # sliced from a call of 2 kept a leading stride of 2 rows, and F.linear's CPU kernel computed
    # a LoRA's rank-2 projection of them with other bits than of the same rows alone.
    generator = torch.Generator().manual_seed(0)
    tokens, lora_a = torch.randn(2, 4, 32, generator=generator), torch.randn(2, 32, generator=generator)
    with BatchInvariantKernels():
        alone = [F.linear(tokens[i : i + 1].clone(), lora_a) for i in range(2)]
        together = F.linear(tokens, lora_a)
    assert all(torch.equal(together[i : i + 1], alone[i]) for i in range(2))


def test_per_sample_operations_give_a_sample_the_same_bits_alone_and_beside_others():
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(5, 8, 12, 12, generator=generator)
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    norm = torch.nn.GroupNorm(4, 8)
    query, key, value = (torch.randn(5, 2, 10, 8, generator=generator) for _ in range(3))
    per_sample_mask = torch.rand(5, 1, 10, 10, generator=generator) > 0.3
    shared_mask = torch.rand(10, 10, generator=generator) > 0.3
    hidden = torch.randn(5, 10, 16, generator=generator)
    with torch.no_grad(), BatchInvariantKernels():
        # RMS norm's mean over a sample's own dimensions, as a method and as a function.
        for mean in (lambda x: x.pow(2).mean(-1, keepdim=True), lambda x: torch.mean(x, dim=(1, 2))):
            assert torch.equal(mean(hidden[2:3])[0], mean(hidden)[2])
        assert hidden.mean().shape == () and hidden.mean(0).shape == (10, 16)  # across samples: as it is
        for operation in (
            conv,
            norm,
            lambda x: norm(x.to(memory_format=torch.channels_last)),  # layouts that look alike for one sample
            lambda x: F.conv3d(x.unsqueeze(2), torch.randn(4, 8, 1, 3, 3, generator=torch.Generator().manual_seed(2))),
        ):
            batch = operation(images)
            for i in range(5):
                assert torch.equal(operation(images[i : i + 1])[0], batch[i])
        for mask in (None, per_sample_mask, shared_mask):
            batch = F.scaled_dot_product_attention(query, key, value, attn_mask=mask)
            alone = F.scaled_dot_product_attention(
                query=query[3:4], key=key[3:4], value=value[3:4], attn_mask=mask if mask is None or mask.dim() == 2 else mask[3:4]
            )
            assert torch.equal(alone[0], batch[3])


def test_the_branches_of_guidance_in_one_call_run_a_samples_rows_together():
    """Rows [negative; positive] of three samples: each sample's two rows reach the stock kernel
    as one call, in the call's order again after it; outside `branches_in_one_call`, a row a call."""

    class StockCalls(TorchFunctionMode):  # below the kernels' mode: sees the calls it makes
        def __init__(self):
            super().__init__()
            self.rows = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.linear:
                self.rows.append(args[0].shape[0])
            return func(*args, **(kwargs or {}))

    generator = torch.Generator().manual_seed(3)
    weight, rows = torch.randn(48, 40, generator=generator), torch.randn(6, 5, 40, generator=generator)
    with StockCalls() as stock, BatchInvariantKernels(), branches_in_one_call(2):
        guided = F.linear(rows, weight)
    assert stock.rows == [2, 2, 2]
    for i in range(3):
        assert torch.equal(guided[[i, i + 3]], F.linear(rows[[i, i + 3]], weight))
    with StockCalls() as stock, BatchInvariantKernels():
        F.linear(rows, weight)
    assert stock.rows == [1] * 6


def test_gradients_flow_through_the_blocks():
    linear = torch.nn.Linear(6, 5)
    inputs = torch.randn(2, 7, 6, requires_grad=True)
    with BatchInvariantKernels():
        linear(inputs).square().sum().backward()
    blocked = (inputs.grad.clone(), linear.weight.grad.clone())
    inputs.grad, linear.weight.grad = None, None
    linear(inputs).square().sum().backward()
    torch.testing.assert_close(blocked, (inputs.grad, linear.weight.grad))


def test_the_mode_holds_only_in_the_thread_that_entered_it():
    class CountingKernels(BatchInvariantKernels):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return super().__torch_function__(func, types, args, kwargs)

    inputs, weight = torch.ones(2, 3), torch.randn(4, 3)
    with CountingKernels() as mode:
        F.linear(inputs, weight)
        assert mode.calls == 1
        thread = threading.Thread(target=F.linear, args=(inputs, weight))
        thread.start()
        thread.join()
        assert mode.calls == 1


@pytest.mark.parametrize(
    "arguments, field",
    [
        ({"invariance": "fast"}, "batch_invariance"),
        ({"default": 0}, "micro_batch_size"),
        ({"decode_default": 0}, "decode_batch_size"),
        ({"decode_by_size": {(64, 64): True}}, "decode_batch_size"),
    ],
)
def test_bad_micro_batching_names_the_field(arguments, field):
    with pytest.raises(InvalidRequestError) as caught:
        MicroBatching(**{"default": 4, **arguments})
    assert caught.value.field == field


def test_calls_take_the_rows_there_are_under_kernels_and_whole_micro_batches_with_padding():
    padding, fixed = MicroBatching(4), kernels(4)
    assert [(c.start, c.stop) for c in padding.calls(5, 4)] == [(0, 4), (4, 8)]
    assert [(c.start, c.stop) for c in fixed.calls(5, 4)] == [(0, 4), (4, 5)]
    assert [padding.padded_rows(n, 4) for n in (1, 4, 5)] == [4, 4, 8]
    assert [fixed.padded_rows(n, 4) for n in (1, 4, 5)] == [1, 4, 5]
    # The VAE: the transformer's size with padding unless it has sizes of its own, one image a
    # call under the kernels.
    assert padding.decode_calls(5, SIZE, SIZE) == padding.calls(5, 4)
    assert [(c.start, c.stop) for c in fixed.decode_calls(3, SIZE, SIZE)] == [(0, 1), (1, 2), (2, 3)]
    own = MicroBatching(4, {(SIZE, SIZE): 8}, decode_default=3, decode_by_size={(2 * SIZE, 2 * SIZE): 2})
    assert [(c.start, c.stop) for c in own.decode_calls(5, SIZE, SIZE)] == [(0, 3), (3, 6)]
    assert [(c.start, c.stop) for c in own.decode_calls(3, 2 * SIZE, 2 * SIZE)] == [(0, 2), (2, 4)]
    assert own.size_for(SIZE, SIZE) == 8  # the transformer's own


# Every family, end to end ----------------------------------------------------------------------


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
@pytest.mark.parametrize("guided", [False, True], ids=["no-guidance", "guidance"])
def test_a_sample_is_the_same_alone_and_in_calls_of_any_size_with_no_padding(family_pipelines, family, guided):
    pipeline = family_pipelines[family]
    record = TINY_FAMILIES[family]
    fields = record.guided if guided else record.unguided
    options = SamplingOptions(num_inference_steps=2, height=SIZE, width=SIZE, debug=True, **fields)
    alone = sample_call(pipeline, ["a cat"], [7], options)
    assert alone.transformer_rows == 2  # one row a step: nothing padded
    # Calls of 3 (ragged against the micro-batch of 4) and of 6 (4 + 2), at other positions; for
    # Qwen-Image the long prompt sits in another text-length bucket.
    for prompts, seeds, position in (
        ([LONG_PROMPT, "a cat", "x"], [8, 7, 9], 1),
        (["x", "a dog", LONG_PROMPT, "x", "y", "a cat"], [1, 2, 3, 4, 5, 7], 5),
    ):
        batched = sample_call(pipeline, prompts, seeds, options)
        assert batched.transformer_rows == 2 * len(prompts)
        for name in ("final_latents", "latents", "log_probs", "image"):
            assert torch.equal(getattr(alone.batch.samples[0], name), getattr(batched.batch.samples[position], name)), name
        assert torch.equal(alone.batch.samples[0].debug.model_outputs, batched.batch.samples[position].debug.model_outputs)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_replay_under_kernels_is_exact_with_and_without_gradients(family_pipelines, family):
    pipeline, guided = family_pipelines[family], TINY_FAMILIES[family].guided
    options = SamplingOptions(num_inference_steps=3, height=SIZE, width=SIZE, return_denoising_env=True, **guided)
    batch = sample(pipeline, ["a cat", LONG_PROMPT, "a dog"], [1, 2, 3], options)
    rollout_log_probs = torch.stack([s.log_probs for s in batch.samples])
    assert torch.equal(replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples).log_probs, rollout_log_probs)
    # The policy-gradient path, with autograd on, one sample at a time.
    with torch.enable_grad():
        for i, sample_ in enumerate(batch.samples):
            scored = transition_log_probs(pipeline, batch.schedule, batch.options, [sample_], [0, 1, 2])
            assert torch.equal(scored.detach()[0], rollout_log_probs[i])


def test_a_lora_adapter_runs_under_the_kernels_and_replays_exactly(tiny_family_dirs):
    served, trainer = (
        load_pipeline("flux", tiny_family_dirs["flux"], device="cpu", micro_batching=kernels()) for _ in range(2)
    )
    trainer.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"]))
    with torch.no_grad():
        for name, parameter in trainer.transformer.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
    apply_update(served.weight_modules, tensor_update(get_peft_model_state_dict(trainer.transformer), lora_rank=4, lora_alpha=8))
    options = SamplingOptions(num_inference_steps=2, height=32, width=32, **TINY_FAMILIES["flux"].guided)
    alone = sample(served, ["a cat"], [0], options)
    batch = sample(served, ["a dog", "a cat", "x"], [3, 0, 4], options)
    assert torch.equal(alone.samples[0].log_probs, batch.samples[1].log_probs)
    assert torch.equal(alone.samples[0].image, batch.samples[1].image)
    replayed = replay_log_probs(trainer, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))


def test_the_embedded_model_is_batch_invariant_under_kernels():
    pipeline = load_pipeline(micro_batching=kernels(8))
    options = SamplingOptions(num_inference_steps=4, debug=True)
    batch = sample(pipeline, ["3", "seven", "a handwritten 7", "1", "9"], [10, 11, 12, 13, 14], options)
    for i in (0, 2, 4):
        alone = sample(pipeline, [batch.samples[i].prompt], [batch.samples[i].seed], options).samples[0]
        for name in ("final_latents", "latents", "log_probs", "image"):
            assert torch.equal(getattr(alone, name), getattr(batch.samples[i], name)), (i, name)


# On the serving device -------------------------------------------------------------------------


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_the_device_check_holds_under_kernels_and_sees_what_they_are_for(family_pipelines, monkeypatch, family):
    guided = TINY_FAMILIES[family].guided
    check = check_batch_invariance(family_pipelines[family], SIZE, SIZE, guided)
    assert check.holds and check.device == "cpu"
    require_batch_invariance(family_pipelines[family], SIZE, SIZE)
    # Unpadded calls with the stock kernels: the check sees the difference, and a server refuses them.
    monkeypatch.setattr("rollout.micro_batching.kernels_for", lambda invariance: contextlib.nullcontext())
    assert check_batch_invariance(family_pipelines[family], SIZE, SIZE, guided).velocity_difference > 0
    with pytest.raises(ModelLoadError) as caught:
        require_batch_invariance(family_pipelines[family], SIZE, SIZE)
    assert caught.value.field == "model.batch_invariance" and "use 'padding'" in caught.value.reason


def test_calibration_under_kernels_picks_the_best_time_per_sample(family_pipelines):
    calibration = calibrate(family_pipelines["sd3"], SIZE, SIZE, (1, 2, 4), TINY_FAMILIES["sd3"].guided, repeats=1)
    # A guided SD3 sample takes two rows of a call: a size of 1 is timed (as calls of 2 rows) but
    # is not a size of whole samples, so the best is among the even sizes.
    per_sample = calibration.denoising_seconds_per_sample
    whole_samples = {rows: seconds for rows, seconds in per_sample.items() if rows % 2 == 0}
    assert calibration.chosen in whole_samples
    assert whole_samples[calibration.chosen] == min(whole_samples.values())
    assert calibration.chosen_for_decode is None  # the kernels decode an image a call
    assert family_pipelines["sd3"].micro_batching == kernels()  # each candidate's setting undone


@pytest.mark.parametrize(
    "arguments", [{"candidates": ()}, {"candidates": (0, 2)}, {"repeats": 0}, {"repeats": True}, {"load": 0}]
)
def test_calibration_names_a_bad_argument(family_pipelines, arguments):
    name = next(iter(arguments))
    with pytest.raises(ValueError, match=f"^{name} must be"):
        calibrate(family_pipelines["sd3"], SIZE, SIZE, **arguments)
