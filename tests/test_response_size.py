"""The response-size estimate (`rollout.plan.most_response_bytes_per_row`) bounds the real response,
JSON and msgpack, with and without `denoising_env`, on the embedded model and tiny families."""

import pytest

from rollout.codec import to_json, to_msgpack
from rollout.errors import InvalidRequestError
from rollout.models.registry import load_pipeline
from rollout.plan import RequestLimits, RolloutPlan, checked_against_model, most_response_bytes_per_row, plan_rollout
from rollout.rows import response_rows
from rollout.sampler import sample
from rollout.schema import RolloutRequest, parse_request

FULL = {"rollout_debug_mode": True, "rollout_return_dit_trajectory": True, "num_inference_steps": 3, "seed": 1}


def estimated(pipeline, plan: RolloutPlan, limits: RequestLimits = RequestLimits()) -> tuple[dict[str, int], object]:
    """The plan's estimate of one row, by what takes its bytes, and its options with the model's
    defaults, as a worker checks it (`checked_against_model`)."""
    options = checked_against_model(pipeline, plan.options, plan.prompts, plan.negative_prompts, plan.num_samples, limits)
    latent_shape = pipeline.latent_shape(options.height, options.width, options.num_frames)
    return most_response_bytes_per_row(pipeline, options, latent_shape, plan.prompts), options


def response_estimate(pipeline, body: dict) -> int:
    """What the server counts a request's response at."""
    plan = plan_rollout(parse_request(body), RequestLimits())
    return sum(estimated(pipeline, plan)[0].values()) * plan.num_samples


@pytest.fixture(scope="module")
def pipelines(tiny_family_dirs, embedded_pipeline):
    loaded = {name: load_pipeline(name, tiny_family_dirs[name], device="cpu") for name in ("flux", "qwenimage")}
    return {"embedded": embedded_pipeline, **loaded}


def estimate_and_rows(pipeline, name: str, with_env: bool):
    if name == "embedded":
        fields = {"prompt": ["a handwritten 3", "a handwritten 7"], "guidance_scale": 2.0}
    else:  # a long prompt: Qwen-Image pads a prompt to its own length, so its conditioning is bounded, not exact
        fields = {"prompt": ["a cat", "ein Hund, der über die Wiese läuft 🐕 " * 6], "height": 32, "width": 32, "true_cfg_scale": 2.5}
    plan = plan_rollout(RolloutRequest(**FULL, **fields, rollout_return_denoising_env=with_env), RequestLimits())
    per_row, options = estimated(pipeline, plan)
    batch = sample(pipeline, plan.prompts, plan.seeds, options, plan.negative_prompts)
    rows = response_rows(plan, batch, inference_time_s=0.123456789, peak_memory_mb=1234.5678)
    return sum(per_row.values()) * plan.num_samples, per_row, batch, rows


def check_conditioning_bytes(pipeline, name: str, batch, rows: list[dict]) -> None:
    """Each row's `denoising_env` holds the tensors `conditioning_bytes` counts: as many, and as
    large (Qwen-Image's text, padded to its prompt's own length: at most as large)."""
    counted = sorted(pipeline.conditioning_bytes(batch.options))
    for row in rows:
        parts = [part for part in row["denoising_env"].values() if part is not None]
        held = sorted(t.nbytes for part in parts for t in (part.values() if isinstance(part, dict) else [part]))
        assert len(held) == len(counted)
        if name == "qwenimage":
            assert all(h <= c for h, c in zip(held, counted)) and held != counted, (held, counted)
        else:
            assert held == counted


@pytest.mark.parametrize("name", ["embedded", "flux", "qwenimage"])
def test_the_estimate_bounds_the_encoded_response_with_and_without_denoising_env(pipelines, name):
    pipeline = pipelines[name]
    sizes = {}
    for with_env in (False, True):  # guided: both branches' conditioning
        estimate, per_row, batch, rows = estimate_and_rows(pipeline, name, with_env)
        as_json, as_msgpack = len(to_json(rows)), len(to_msgpack(rows))
        assert as_msgpack < as_json <= estimate, (name, with_env, per_row)
        # The slack is per tensor and per row, not a share: even tiny responses stay within twice the JSON.
        if name != "qwenimage":  # whose text is bounded by max_sequence_length tokens, not by the prompt
            assert estimate < 2 * as_json, (name, with_env, per_row, as_json)
        sizes[with_env] = (per_row, estimate, as_json)
        if with_env:
            check_conditioning_bytes(pipeline, name, batch, rows)
    (without, estimate_without, json_without), (with_env, estimate_with, json_with) = sizes[False], sizes[True]
    assert without["denoising_env"] == 0 < with_env["denoising_env"]
    # What the estimate adds for denoising_env covers what it adds to the JSON response.
    assert estimate_with - estimate_without >= json_with - json_without > 0


def test_a_response_past_the_limit_for_its_denoising_env_is_refused_naming_it(random_pipeline):
    body = {"prompt": "a handwritten 3", "num_outputs_per_prompt": 8, **FULL}
    limits = RequestLimits(max_response_bytes=response_estimate(random_pipeline, body))
    estimated(random_pipeline, plan_rollout(parse_request(body), limits), limits)  # at the limit: accepted
    with_env = plan_rollout(parse_request({**body, "rollout_return_denoising_env": True}), limits)
    with pytest.raises(InvalidRequestError) as refused:
        estimated(random_pipeline, with_env, limits)
    message = str(refused.value)
    for named in ("limits.max_response_bytes", "rollout_return_denoising_env", "of denoising_env", "as JSON"):
        assert named in message, message
