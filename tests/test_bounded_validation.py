"""Validation stays cheap and its answers small whatever the input: depth and length limits,
excerpts instead of echoed values, limits on values that make non-finite outputs, and the guard
that refuses non-finite outputs. Library level, no Ray."""

import dataclasses
import difflib
import json
import pickle
import time

import msgpack
import pytest
import torch

import rollout.plan as plan_module
from rollout.codec import (
    MAX_NESTING_DEPTH,
    CodecError,
    DecodeBudget,
    decode_tensor,
    encode_tensor,
    from_json,
    from_msgpack,
    parse_json,
    parse_msgpack,
    to_json,
    to_msgpack,
)
from rollout.errors import (
    InvalidRequestError,
    NonFiniteOutputError,
    RequestSchemaError,
    UnknownPromptError,
)
from rollout.cost import CostFacts, RequestCost
from rollout.models.base import NegativeBranchRule
from rollout.models.digits import parse_digit_prompt
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.plan import RequestLimits, checked_cost, plan_rollout
from rollout.sampler import sample
from rollout.schema import parse_request

LIMITS = RequestLimits()


def plan(body, limits=LIMITS):
    return plan_rollout(parse_request(body), limits)


def refusal(body, limits=LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        plan(body, limits)
    return caught.value


# Nesting ---------------------------------------------------------------------------------------


def json_nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def msgpack_nested(depth: int) -> bytes:
    return b"\x81\xa1k" * (depth - 1) + b"\x80"  # maps {"k": {"k": ... {}}}


@pytest.mark.parametrize("parse,nested", [(parse_json, json_nested), (parse_msgpack, msgpack_nested)])
def test_bodies_nested_up_to_the_limit_parse_and_deeper_ones_are_a_codec_error(parse, nested):
    assert parse(nested(MAX_NESTING_DEPTH)) is not None
    # Past the limit, past Python's recursion limit, and (msgpack) past msgpack's own stack of 1,024;
    # JSON that deep is also more lists than its size allows, which is counted before it is parsed.
    for depth in (MAX_NESTING_DEPTH + 1, 990, 5_000, 100_000):
        with pytest.raises(CodecError, match=f"deeper than {MAX_NESTING_DEPTH} levels|more than [0-9]+ maps and lists"):
            parse(nested(depth))


def test_a_deep_value_inside_a_request_field_is_refused_when_parsed():
    # At depth 900 msgpack parses it, and repr and pydantic then overflowed Python's stack (a 500).
    inner = b"\x91" * 900 + b"\x00"
    body = b"\x82" + msgpack.packb("prompt") + msgpack.packb("7") + msgpack.packb("extra_sampling_params")
    body += b"\x81" + msgpack.packb("seed") + inner
    with pytest.raises(CodecError, match="deeper than"):
        parse_msgpack(body)


def test_responses_decode_within_the_depth_limit():
    rows = [{"dit_trajectory": {"latents": torch.zeros(2, 3)}, "denoising_env": {"pos_cond_kwargs": {"x": [torch.ones(1)]}}}]
    decoded = from_msgpack(to_msgpack(rows))
    assert torch.equal(decoded[0]["denoising_env"]["pos_cond_kwargs"]["x"][0], torch.ones(1))


# Decoding costs what the bytes cost ---------------------------------------------------------------


def test_a_body_built_to_expand_is_refused_while_it_decodes():
    # A million empty maps in 1 MiB: 1 GB of Python objects and 4.6 s before, the decoder's hooks now
    # stop it once the maps outnumber what the body's size allows.
    body = msgpack.packb({"prompt": [{}] * (2**20 - 16)})
    built = DecodeBudget.for_body(len(body))
    seen = []
    with pytest.raises(CodecError, match=f"more than {built.containers} maps and lists"):
        parse_msgpack(body, object_hook=lambda mapping: seen.append(1) or mapping)
    assert len(seen) == built.containers  # not one map more was handed on
    with pytest.raises(CodecError, match="maps and lists"):
        parse_json(json.dumps({"prompt": [[]] * 300_000}))
    with pytest.raises(CodecError, match="items in them"):
        parse_msgpack(msgpack.packb({"prompt": [1000] * 130_000}))


def test_brackets_and_commas_inside_strings_cost_nothing():
    prompt = "[{," * 200_000
    assert parse_json(json.dumps({"prompt": prompt}))["prompt"] == prompt


def test_a_real_weight_update_fits_the_budget():
    # Thousands of small tensors, as a transformer's full state dict: each envelope is a map around
    # a safetensors file, far more bytes than the budget asks of a map.
    named = {f"blocks.{i}.norm.weight": torch.ones(1) for i in range(5_000)}
    for to_wire, from_wire in ((to_msgpack, from_msgpack), (to_json, from_json)):
        decoded = from_wire(to_wire({"named_tensors": named}))["named_tensors"]
        assert len(decoded) == 5_000 and torch.equal(decoded["blocks.7.norm.weight"], torch.ones(1))


def test_a_list_field_stops_at_its_first_bad_item():
    with pytest.raises(RequestSchemaError) as caught:
        parse_request({"prompt": [1] * 100_000})
    assert len(caught.value.errors) <= 2  # one per union branch, not one per item


def test_envelope_headers_and_shapes_are_bounded():
    def envelope(header: bytes, data: bytes = b"\x00" * 4, shape=None) -> dict:
        return {"__tensor__": True, "data": len(header).to_bytes(8, "little") + header + data, "shape": shape or [1], "dtype": "torch.float32"}

    huge_header = json.dumps({"t": {"dtype": "F32", "shape": [1] * 100_000, "data_offsets": [0, 4]}}).encode()
    with pytest.raises(CodecError, match="header length .* is out of range"):
        decode_tensor(envelope(huge_header))
    digits = b'{"t":{"dtype":"F32","shape":[' + b"9" * 5_000 + b'],"data_offsets":[0,4]}}'
    with pytest.raises(CodecError, match="not a safetensors file"):
        decode_tensor(envelope(digits))
    good = encode_tensor(torch.zeros(1))
    for shape in (5, "1", None, [[1]]):
        with pytest.raises(CodecError, match="declares shape"):
            decode_tensor({**good, "shape": shape})
    with pytest.raises(CodecError) as caught:
        decode_tensor({**good, "shape": list(range(300_000))})
    assert len(str(caught.value)) < 1_000


# Linear checks -----------------------------------------------------------------------------------


def walks_no_step_list(**fields):
    raise AssertionError("a step list over its length was walked")


@pytest.mark.parametrize(
    "field,steps,most",
    [("rollout_return_step_indices", 20, 21), ("rollout_sde_step_indices", 20, 20), ("rollout_return_step_indices", 100, 101)],
)
def test_a_step_list_longer_than_the_steps_is_refused_by_its_length_at_once(field, steps, most, monkeypatch):
    body = {"prompt": "7", "num_inference_steps": steps, field: [0] * 150_000}
    # Refused by its length, before the entries are walked (a quadratic duplicate check took 12.8 s;
    # benchmarks.reliability times the refusal): SamplingOptions, which walks them, is never built.
    monkeypatch.setattr(plan_module, "SamplingOptions", walks_no_step_list)
    error = refusal(body)
    assert error.field == field
    assert f"at most {most} entries" in error.reason and "150000" in error.reason


def test_a_step_list_naming_every_step_once_is_accepted():
    options = plan({"prompt": "7", "num_inference_steps": 5, "rollout_return_step_indices": [5, 4, 3, 2, 1, 0]}).options
    assert options.return_step_indices == (0, 1, 2, 3, 4, 5)
    assert plan({"prompt": "7", "num_inference_steps": 5, "rollout_sde_step_indices": list(range(5))}).options


# Limits on values that make non-finite outputs --------------------------------------------------


@pytest.mark.parametrize(
    "field,value,limit_name,option",
    [
        ("guidance_scale", 1e308, "max_guidance_scale", "guidance_scale"),
        ("true_cfg_scale", 1e6, "max_guidance_scale", "true_cfg_scale"),
        ("rollout_noise_level", 1e6, "max_noise_level", "noise_level"),
        ("width", 10**6, "max_image_size", "width"),
        ("height", 4097, "max_image_size", "height"),
        # LTX-Video puts fps in an int64 tensor: 2**63 raised inside the sampler call (issue 46).
        ("fps", 2**63, "max_fps", "fps"),
    ],
)
def test_values_over_a_configured_limit_are_refused_naming_the_field_and_the_limit(field, value, limit_name, option):
    error = refusal({"prompt": "7", field: value})
    assert error.field == field
    assert f"at most {getattr(LIMITS, limit_name)} (limits.{limit_name})" in error.reason
    # The limit is the configuration's: raised, the same value passes.
    raised = RequestLimits(**{limit_name: value})
    assert getattr(plan({"prompt": "7", field: value}, raised).options, option) == value



def test_a_request_over_its_cost_limit_is_refused_at_once_naming_what_drives_it():
    # FLUX.1-dev's published facts: 1024 px, 16 px a token (VAE 8 x packing 2), classifier-free
    # guidance only with true_cfg_scale. The 341 samples at 1024x1024 and 100 steps.
    flux = CostFacts(1024, 1024, 1, 3.5, 16, 1, NegativeBranchRule("true_cfg_scale"))
    size = {"height": 1024, "width": 1024}
    body = {"prompt": [str(d) for d in range(11)], "num_outputs_per_prompt": 31, **size, "num_inference_steps": 100}
    started = time.perf_counter()
    with pytest.raises(InvalidRequestError) as caught:
        checked_cost(plan(body), flux, LIMITS)
    assert time.perf_counter() - started < 0.1
    assert caught.value.field == "num_outputs_per_prompt, height, width, num_inference_steps"
    assert caught.value.reason.startswith("this request costs 141,070,336 token-steps, over limits.max_request_cost (128,000,000)")
    # A typical RL request passes: 64 samples at 1024x1024, 50 steps, guided.
    typical = {**body, "prompt": [str(d) for d in range(8)], "num_outputs_per_prompt": 8, "num_inference_steps": 50, "true_cfg_scale": 4.0}
    assert checked_cost(plan(typical), flux, LIMITS) == RequestCost(64 * 2 * 4096 * 50 + 64 * 4096)
    wan = CostFacts(480, 832, 81, 5.0, 16, 4, NegativeBranchRule("guidance_scale"))
    with pytest.raises(InvalidRequestError) as caught:  # a video model names its frames too
        checked_cost(plan({"prompt": "a cat", "num_outputs_per_prompt": 64, "num_inference_steps": 50}), wan, LIMITS)
    assert caught.value.field == "num_outputs_per_prompt, height, width, num_frames, num_inference_steps"


def test_a_size_the_model_cannot_make_is_refused_with_the_cost_before_anything_is_sent(tiny_family_dirs):
    """Refused by the model's own limits at the ingress, not by a worker after the request was
    counted in flight (stop 59's CI: the cost of a refused 1024 px request outlived its 400)."""
    sd3 = CostFacts.of(load_pipeline(None, tiny_family_dirs["sd3"], device="cpu"))  # its positions stop at 512 px
    for field, size, reason in (
        ("height", {"height": 1024, "width": 32}, "must be at most 512 for model 'sd3' (its transformer's pos_embed_max_size"),
        ("width", {"height": 32, "width": 40}, "must be a multiple of 16 for model 'sd3', got 40"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            checked_cost(plan({"prompt": "a cat", **size}), sd3, LIMITS)
        assert caught.value.field == field and reason in caught.value.reason
    assert checked_cost(plan({"prompt": "a cat", "height": 512, "width": 32}), sd3, LIMITS).token_steps > 0


def test_values_at_the_limits_are_accepted():
    options = plan({"prompt": "7", "guidance_scale": 100.0, "true_cfg_scale": 100.0, "rollout_noise_level": 2.0}).options
    assert (options.guidance_scale, options.true_cfg_scale, options.noise_level) == (100.0, 100.0, 2.0)


# Fields that reach every sample, every other client or the deadline (issue 46) --------------------


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_a_prompt_longer_than_its_byte_limit_is_refused_counting_utf8_bytes(field):
    most = LIMITS.max_prompt_bytes
    assert plan({"prompt": "7", field: "7" * most}).prompts
    for text in ("7" * (most + 1), "é" * (most // 2 + 1)):  # "é" is 2 bytes
        error = refusal({"prompt": "7", field: text})
        assert error.field == field and f"at most {most} UTF-8 bytes (limits.max_prompt_bytes)" in error.reason


def test_rollout_timeout_s_is_finite_and_at_most_the_servers_request_timeout():
    def timeout_refusal(timeout_s):
        with pytest.raises(InvalidRequestError) as caught:
            plan_rollout(parse_json_request({"prompt": "7", "rollout_timeout_s": timeout_s}), LIMITS, max_timeout_s=600)
        return caught.value

    # JSON's Infinity is what Python's JSON reader takes for a float: it must not become a deadline.
    assert timeout_refusal(float("inf")).field == "rollout_timeout_s"
    assert "finite" in timeout_refusal(float("inf")).reason
    assert "at most the server's request_timeout_s (600)" in timeout_refusal(600.5).reason
    assert plan_rollout(parse_request({"prompt": "7", "rollout_timeout_s": 600}), LIMITS, max_timeout_s=600).request


def parse_json_request(body: dict):
    return parse_request(parse_json(json.dumps(body).encode()))


@pytest.mark.parametrize(
    "version, refused",
    [
        ("step-100", False),
        ("run/2026-12-06T10:00:00+00:00@trainer.v2", False),
        ("x" * 128, False),
        ("x" * 129, True),
        ("", True),
        ("a b", True),
        ("v1\nforged log line", True),
        ("\u202eversion", True),
    ],
)
def test_a_weight_version_is_short_and_of_a_safe_alphabet(version, refused):
    """A request's `weight_version` is checked as a weight update's and the app config's are (one
    rule, `rollout.weights.weight_version_problem`): an update's is copied into every later row."""
    body = {"prompt": "7", "weight_version": version}
    if refused:
        error = refusal(body)
        assert error.field == "weight_version" and "1 to 128 characters" in error.reason
        assert len(str(error)) < 400
    else:
        assert plan(body).request.weight_version == version


# Errors carry excerpts ----------------------------------------------------------------------------


def schema_refusal(body) -> RequestSchemaError:
    with pytest.raises(RequestSchemaError) as caught:
        parse_request(body)
    return caught.value


def error_size(error: InvalidRequestError) -> int:
    return len(str(error)) + len(json.dumps(getattr(error, "errors", [])))


def test_a_huge_value_in_an_unknown_field_is_not_echoed():
    error = schema_refusal({"prompt": "7", "notes": "x" * 50_000_000})
    assert error.field == "notes" and error_size(error) < 1_000


def test_a_huge_unknown_key_is_clipped_and_answered_at_once(monkeypatch):
    # difflib indexes every character of a name it is given (0.7 s per 5 MB key): never given this one.
    compared = []
    monkeypatch.setattr(difflib, "get_close_matches", lambda name, *args, **kwargs: compared.append(len(name)) or [])
    error = schema_refusal({"prompt": "7", "k" * 5_000_000: 1})
    assert compared == []
    assert error.field.startswith("kkkk") and "characters left out" in error.field
    assert error_size(error) < 1_000


def test_a_body_with_many_bad_items_reports_the_first_few():
    error = schema_refusal({"prompt": "7", **{f"unknown_{i}": i for i in range(10_000)}})
    assert len(error.errors) == 10 and error.field == "unknown_0"
    error = schema_refusal({"prompt": ["x" * 1_000_000] + [1] * 10_000})
    assert error.field.startswith("prompt") and error_size(error) < 2_000


def test_a_mistyped_huge_value_is_shown_as_a_short_excerpt():
    error = schema_refusal({"prompt": "7", "seed": "9" * 1_000_000})
    assert error.field == "seed" and "..." in error.reason and len(error.reason) < 300


def test_an_error_raised_with_a_huge_value_keeps_its_start_and_its_advice():
    # The embedded model's message quotes the whole prompt; the error itself clips it.
    with pytest.raises(UnknownPromptError) as caught:
        parse_digit_prompt("x" * 1_000_000)
    error = caught.value
    assert len(str(error)) < 700
    assert "does not know the prompt 'xxx" in error.reason and error.reason.endswith("'a handwritten 7'")
    copy = pickle.loads(pickle.dumps(error))  # Ray carries errors pickled: the clip is idempotent
    assert (copy.field, copy.reason) == (error.field, error.reason)


# The non-finite output guard ----------------------------------------------------------------------


def test_the_guard_passes_finite_batches_through(random_pipeline):
    batch = sample(random_pipeline, ["3", "4"], seeds=[0, 1], options=SamplingOptions(num_inference_steps=3, debug=True))
    batch.check_finite()  # returns, raising nothing


def test_the_guard_refuses_a_batch_whose_sampling_overflowed(random_pipeline):
    # What the limits keep requests from: a finite guidance scale that overflows the latents.
    options = SamplingOptions(num_inference_steps=3, guidance_scale=1e30)
    batch = sample(random_pipeline, ["3", "4"], seeds=[0, 1], options=options)
    with pytest.raises(NonFiniteOutputError, match=r"NaN or infinite values in .*latents \(2 of 2 samples\)"):
        batch.check_finite()


def test_the_guard_names_each_non_finite_tensor_and_how_many_samples_have_one(random_pipeline):
    batch = sample(random_pipeline, ["3", "4", "5"], seeds=[0, 1, 2], options=SamplingOptions(num_inference_steps=3, debug=True))
    poisoned = batch.samples[1].log_probs.clone()
    poisoned[0] = float("inf")
    debug = dataclasses.replace(batch.samples[2].debug, noise_std_devs=torch.full((3,), float("nan")))
    samples = [batch.samples[0], dataclasses.replace(batch.samples[1], log_probs=poisoned), dataclasses.replace(batch.samples[2], debug=debug)]
    with pytest.raises(NonFiniteOutputError) as caught:
        dataclasses.replace(batch, samples=samples).check_finite()
    message = str(caught.value)
    assert "log_probs (1 of 3 samples)" in message and "debug.noise_std_devs (1 of 3 samples)" in message
    assert "image" not in message
