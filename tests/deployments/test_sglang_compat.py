"""The SGLang contract, as SGLang 0.5.23's own code defines it, against this server over HTTP.

A trainer written for SGLang's diffusion rollout API must work unchanged. So the requests here
are the ones SGLang's clients send (miles' diffusion rollout client, below), and responses are
decoded the way SGLang's `post_training/utils.py` decodes them: msgpack, then every
``{"__tensor__": true, "data": <safetensors bytes>}`` map loaded with `safetensors.torch.load`
under the key ``"t"``. The JSON variant (this server's extension) only base64-decodes `data`
first. Each test names the item of the compatibility issue it covers.
"""

import base64
import json
import math

import msgpack
import pytest
import torch
from ray import serve
from safetensors.torch import load as load_safetensors

from tests.deployments.apps import deploy_ingress


# miles' `build_rollout_sampling_params` + `build_rollout_generate_payload` with its defaults:
# the exact body its rollout loop posts for one group of 4 samples.
MILES_BODY = {
    "generator_device": "cuda",
    "negative_prompt": " ",  # FlowGRPO's default, set when none is configured
    "width": None,
    "height": None,
    "num_inference_steps": 6,
    "guidance_scale": None,
    "true_cfg_scale": None,
    "rollout": True,
    "rollout_sde_type": "sde",
    "rollout_noise_level": 0.7,
    "rollout_log_prob_no_const": False,
    "rollout_debug_mode": False,
    "rollout_return_denoising_env": True,
    "rollout_return_dit_trajectory": True,
    "prompt": "a handwritten 7",
    "num_outputs_per_prompt": 4,
    "seed": 1234,
}
# `RolloutResponse` in SGLang's io_struct.py, in its order; every row has every key.
SGLANG_ROW_KEYS = [
    "request_id",
    "prompt",
    "seed",
    "generated_output",
    "rollout_log_probs",
    "rollout_debug_tensors",
    "denoising_env",
    "dit_trajectory",
    "inference_time_s",
    "peak_memory_mb",
]
EXTENSION_ROW_KEYS = [
    "prompt_index",
    "sample_seed",
    "weight_version",
    "branch_path",
    "branch_seeds",
    "transformer_rows",
    "transformer_rows_unbranched",
    "request_cost",
]
ENCODINGS = ["application/msgpack", "application/json"]


def sglang_deserialize(value):
    """SGLang's `_maybe_deserialize`: tensor maps become tensors, via safetensors only."""
    if isinstance(value, dict):
        if value.get("__tensor__"):
            return load_safetensors(value["data"])["t"]
        return {key: sglang_deserialize(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [sglang_deserialize(item) for item in value]
    return value


def base64_data_to_bytes(value):
    """The JSON body's only difference: `data` is base64 text instead of msgpack bytes."""
    if isinstance(value, dict):
        if value.get("__tensor__"):
            return {**value, "data": base64.b64decode(value["data"])}
        return {key: base64_data_to_bytes(item) for key, item in value.items()}
    if isinstance(value, list):
        return [base64_data_to_bytes(item) for item in value]
    return value


def generate(http, base_url, body, accept="application/msgpack", path="/rollout/generate"):
    response = http.post(f"{base_url}{path}", json=body, headers={"Accept": accept})
    assert response.status_code == 200, response.text
    if accept == "application/msgpack":
        return sglang_deserialize(msgpack.unpackb(response.content))
    return sglang_deserialize(base64_data_to_bytes(json.loads(response.content)))


@pytest.fixture(params=ENCODINGS)
def accept(request):
    return request.param


def test_miles_request_is_served_with_sglangs_rows(http, base_url, accept):
    """Items 1 and 3: the exact body miles sends; every row has all of SGLang's keys."""
    rows = generate(http, base_url, MILES_BODY, accept)
    assert len(rows) == 4
    for row in rows:
        assert list(row) == SGLANG_ROW_KEYS + EXTENSION_ROW_KEYS
        assert row["prompt"] == "a handwritten 7" and isinstance(row["request_id"], str)
        assert row["generated_output"].shape == (1, 16, 16)
        assert row["rollout_log_probs"].shape == (6,) and row["rollout_log_probs"].dtype == torch.float32
        assert row["rollout_debug_tensors"] is None  # miles turned debug mode off
        assert row["peak_memory_mb"] is None  # measured on accelerators only; this is the CPU
        assert row["inference_time_s"] > 0
    assert len({row["request_id"] for row in rows}) == 1


def test_unset_outputs_are_nil_not_missing(http, base_url, accept):
    """Item 3: unset keys are None (msgpack nil, JSON null), in rollout and evaluation rows."""
    body = {"prompt": "3", "num_inference_steps": 2, "rollout_debug_mode": False}
    for row in generate(http, base_url, body, accept) + generate(http, base_url, {**body, "rollout": False}, accept):
        assert list(row) == SGLANG_ROW_KEYS + EXTENSION_ROW_KEYS
        assert row["rollout_debug_tensors"] is None and row["denoising_env"] is None
        assert row["dit_trajectory"] is None and row["peak_memory_mb"] is None
    evaluation = generate(http, base_url, {**body, "rollout": False}, accept)[0]
    assert evaluation["rollout_log_probs"] is None


def test_debug_mode_is_on_unless_turned_off(http, base_url, accept):
    """Item 2: SGLang's `rollout_debug_mode` defaults to true."""
    row = generate(http, base_url, {"prompt": "5", "num_inference_steps": 3}, accept)[0]
    assert set(row["rollout_debug_tensors"]) == {
        "rollout_variance_noises",
        "rollout_prev_sample_means",
        "rollout_noise_std_devs",
        "rollout_model_outputs",
    }


def test_seed_is_the_requests_in_every_row(http, base_url, accept):
    """Item 4: `seed` is the request's seed; each sample's own seed is `sample_seed` (seed + i)."""
    rows = generate(http, base_url, MILES_BODY, accept)
    assert [row["seed"] for row in rows] == [1234] * 4
    assert [row["sample_seed"] for row in rows] == [1234, 1235, 1236, 1237]
    # Sample i is what a one-sample request with seed + i gives.
    alone = generate(http, base_url, {**MILES_BODY, "seed": 1236, "num_outputs_per_prompt": 1}, accept)[0]
    assert torch.equal(alone["rollout_log_probs"], rows[2]["rollout_log_probs"])


def test_noise_std_devs_are_t_by_1(http, base_url, accept):
    """Item 5: `rollout_noise_std_devs` is `[T, 1]`, as SGLang's per-sample slice of `[B, T, 1]`."""
    steps = 5
    row = generate(http, base_url, {"prompt": "8", "num_inference_steps": steps, "seed": 2}, accept)[0]
    debug = row["rollout_debug_tensors"]
    assert debug["rollout_noise_std_devs"].shape == (steps, 1)
    for name in ("rollout_variance_noises", "rollout_prev_sample_means", "rollout_model_outputs"):
        assert debug[name].shape == (steps, 1, 16, 16)


@pytest.mark.parametrize("guidance_scale", [2.0, 1.0])
def test_denoising_env_has_sglangs_nesting(http, base_url, accept, guidance_scale):
    """Item 6: `{image_kwargs, pos_cond_kwargs, neg_cond_kwargs, guidance}`, per sample, the
    transformer's own keyword arguments per branch; no negative branch without CFG."""
    body = {**MILES_BODY, "guidance_scale": guidance_scale, "num_outputs_per_prompt": 2}
    rows = generate(http, base_url, body, accept)
    for row in rows:
        env = row["denoising_env"]
        assert list(env) == ["image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"]
        assert env["image_kwargs"] is None and env["guidance"] is None
        assert env["pos_cond_kwargs"]["encoder_hidden_states"].shape == (2, 32)  # no batch dimension
        assert env["pos_cond_kwargs"]["pooled_projections"].shape == (32,)
        if guidance_scale == 1.0:
            assert env["neg_cond_kwargs"] is None
        else:
            assert set(env["neg_cond_kwargs"]) == {"encoder_hidden_states", "pooled_projections"}


def test_trajectory_timesteps_label_each_returned_latent(http, base_url, accept):
    """Item 7: `timesteps` has one entry per returned latent (the final one is 0), as SGLang's
    runtime records them; the scheduler's own `[T]` is `scheduler_timesteps`; `sigmas` stays
    `[T + 1]` whatever the filter."""
    steps = 3  # SGLang's unit test: three loop steps, then the final latent at step T = 3
    body = {"prompt": "2", "num_inference_steps": steps, "seed": 7, "rollout_return_dit_trajectory": True}
    full = generate(http, base_url, body, accept)[0]["dit_trajectory"]
    scheduler_timesteps = full["scheduler_timesteps"]
    assert scheduler_timesteps.shape == (steps,)
    assert full["sigmas"].shape == (steps + 1,) and full["sigmas"][-1] == 0
    assert full["latents"].shape[0] == full["timesteps"].shape[0] == steps + 1
    assert torch.equal(full["timesteps"], torch.cat([scheduler_timesteps, torch.zeros(1)]))
    assert full["latent_step_indices"].tolist() == [0, 1, 2, 3]

    # SGLang's filter cases: [0, 2] -> steps 0 and 2; [0, 1, 2] drops the final latent; [3] keeps only it.
    for kept in ([0, 2], [0, 1, 2], [3]):
        filtered = generate(http, base_url, {**body, "rollout_return_step_indices": kept}, accept)[0]["dit_trajectory"]
        assert filtered["latent_step_indices"].tolist() == kept
        assert torch.equal(filtered["timesteps"], full["timesteps"][kept])
        assert torch.equal(filtered["latents"], full["latents"][kept])
        assert torch.equal(filtered["sigmas"], full["sigmas"])
        assert torch.equal(filtered["scheduler_timesteps"], scheduler_timesteps)
    # Keeping no latent: SGLang drops dit_trajectory (and the schedule with it); here it stays.
    empty = generate(http, base_url, {**body, "rollout_return_step_indices": []}, accept)[0]["dit_trajectory"]
    assert empty["latents"].shape == (0, 1, 16, 16) and empty["timesteps"].shape == (0,)
    assert torch.equal(empty["sigmas"], full["sigmas"])


def flow_grpo_step(kind, x_t, v, sigma, sigma_next, sigma_max, eta):
    """Flow-GRPO's `sde_step_with_logprob` mean and std, the way an SGLang trainer recomputes them."""
    dt = sigma_next - sigma
    if kind == "sde":
        std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
        mean = x_t * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        return mean, std_dev_t * torch.sqrt(-dt)
    std_dev_t = sigma_next * math.sin(eta * math.pi / 2)
    mean = (x_t - sigma * v) * (1 - sigma_next) + (x_t + v * (1 - sigma)) * torch.sqrt(sigma_next**2 - std_dev_t**2)
    return mean, std_dev_t


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
@pytest.mark.parametrize("no_const", [True, False])
def test_log_probs_are_sglangs_and_replay_sglangs_way(http, base_url, accept, sde_type, no_const):
    """Item 10: with `rollout_log_prob_no_const` the per-step value is SGLang's mean of
    -(x' - mean)^2; without it the Gaussian log-density. A trainer that recomputes the mean from
    the returned latents and velocities, Flow-GRPO's way, gets a ratio of 1."""
    steps, eta = 5, 0.7
    body = {
        "prompt": ["4", "9"],
        "num_outputs_per_prompt": 2,
        "num_inference_steps": steps,
        "seed": 40,
        "rollout_sde_type": sde_type,
        "rollout_noise_level": eta,
        "rollout_log_prob_no_const": no_const,
        "rollout_return_dit_trajectory": True,
    }
    for row in generate(http, base_url, body, accept):
        trajectory, debug = row["dit_trajectory"], row["rollout_debug_tensors"]
        sigmas, latents = trajectory["sigmas"], trajectory["latents"]
        noise, std = debug["rollout_variance_noises"], debug["rollout_noise_std_devs"]
        # SGLang's controller: `log_prob_no_const_val = -((noise * noise_std_dev) ** 2)`.
        sglang_no_const = -((noise * std.view(-1, 1, 1, 1)) ** 2)
        for i in range(steps):
            v = debug["rollout_model_outputs"][i]
            mean, step_std = flow_grpo_step(sde_type, latents[i], v, sigmas[i], sigmas[i + 1], sigmas[1], eta)
            squared_error = -((latents[i + 1] - mean) ** 2)
            if step_std == 0:  # cps's last step is deterministic: 0 in every form
                assert row["rollout_log_probs"][i] == 0
                continue
            if no_const:
                expected, controller = squared_error.mean(), sglang_no_const[i].mean()
            else:
                constants = torch.log(step_std) + 0.5 * math.log(2 * math.pi)
                expected = (squared_error / (2 * step_std**2) - constants).mean()
                controller = (sglang_no_const[i] / (2 * std[i] ** 2) - constants).mean()
            torch.testing.assert_close(row["rollout_log_probs"][i], expected, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(row["rollout_log_probs"][i], controller, rtol=1e-5, atol=1e-6)


def test_the_variance_normalised_form_is_an_extension(http, base_url, accept):
    """Item 10: the constants-free Gaussian stays available as `rollout_log_prob_form`."""
    body = {"prompt": "6", "num_inference_steps": 4, "seed": 3}
    gaussian = generate(http, base_url, body, accept)[0]
    without_constants = generate(http, base_url, {**body, "rollout_log_prob_form": "gaussian_no_const"}, accept)[0]
    no_const = {**body, "rollout_log_prob_no_const": True}
    squared_error = generate(http, base_url, no_const, accept)[0]["rollout_log_probs"]
    assert not torch.allclose(without_constants["rollout_log_probs"], squared_error)
    # It differs from the log-density by -log(std) - log(sqrt(2 pi)) per step: the same PPO ratio.
    std = gaussian["rollout_debug_tensors"]["rollout_noise_std_devs"].squeeze(-1)
    constants = torch.log(std) + 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(without_constants["rollout_log_probs"] - constants, gaussian["rollout_log_probs"])
    response = http.post(
        f"{base_url}/rollout/generate",
        json={**body, "rollout_log_prob_no_const": True, "rollout_log_prob_form": "gaussian_no_const"},
    )
    assert response.status_code == 400 and response.json()["error"]["field"] == "rollout_log_prob_form"


def test_every_sglang_request_field_is_accepted(http, base_url, accept):
    """Item 1: SGLang's other fields, with values an image model can serve."""
    body = {
        "prompt": "1",
        "num_inference_steps": 3,
        "seed": 9,
        "generator_device": "cpu",
        "suppress_logs": True,
        "num_frames": 1,
        "fps": 24,
        "image_path": None,
        "num_outputs_per_prompt": None,
        "extra_sampling_params": {"num_inference_steps": 4, "rollout": True},
    }
    rows = generate(http, base_url, body, accept)
    assert len(rows) == 1  # num_outputs_per_prompt: null is SGLang's default, 1
    assert rows[0]["rollout_log_probs"].shape == (4,)  # extra_sampling_params overrides, as SGLang merges it
    assert rows[0]["peak_memory_mb"] is None
    # Noise comes from per-sample CPU generators whatever generator_device says.
    on_cuda = generate(http, base_url, {**body, "generator_device": "cuda"}, accept)[0]
    assert torch.equal(on_cuda["generated_output"], rows[0]["generated_output"])


def test_true_cfg_scale_is_honoured(http, base_url, accept):
    """Item 1: `true_cfg_scale` is the embedded model's classifier-free guidance weight."""
    body = {"prompt": "0", "num_inference_steps": 4, "seed": 11, "rollout_debug_mode": False}
    by_true_cfg = generate(http, base_url, {**body, "true_cfg_scale": 4.0}, accept)[0]["generated_output"]
    by_guidance = generate(http, base_url, {**body, "guidance_scale": 4.0}, accept)[0]["generated_output"]
    default = generate(http, base_url, body, accept)[0]["generated_output"]
    assert torch.equal(by_true_cfg, by_guidance) and not torch.equal(by_true_cfg, default)


# (body, field, status): SGLang answers invalid sampling values with 400 (and a string detail),
# and a body its pydantic model refuses with FastAPI's 422 (a list of errors).
SGLANG_ERRORS = [
    ({"rollout_noise_level": -1.0}, "rollout_noise_level", 400),
    ({"rollout_sde_type": "euler"}, "rollout_sde_type", 400),
    ({"guidance_scale": -2.0}, "guidance_scale", 400),
    ({"num_inference_steps": 0}, "num_inference_steps", 400),
    ({"num_outputs_per_prompt": 0}, "num_outputs_per_prompt", 400),
    ({"width": 0}, "width", 400),
    ({"seed": -1}, "seed", 400),
    ({"fps": 0}, "fps", 400),
    ({"num_frames": 0}, "num_frames", 400),
    ({"num_frames": 17}, "num_frames", 400),  # a value this image model cannot serve
    ({"image_path": ["cat.png"]}, "image_path[0]", 400),  # a file path, and no allowed_image_paths configured
    ({"extra_sampling_params": {"sigmas": [1.0, 0.5]}}, "extra_sampling_params.sigmas", 400),
    ({"extra_sampling_params": {"rollout": False}}, "extra_sampling_params.rollout", 400),
    ({"extra_sampling_params": {"num_inference_steps": "8"}}, "extra_sampling_params.num_inference_steps", 422),
    ({"prompt": 7}, "prompt", 422),
    ({"seed": "seven"}, "seed", 422),
    ({"rollout_return_step_indices": "all"}, "rollout_return_step_indices", 422),
    ({"rollout_sde_tyep": "cps"}, "rollout_sde_tyep", 422),
]


@pytest.mark.parametrize("change,field,status", SGLANG_ERRORS, ids=[f for _, f, _ in SGLANG_ERRORS])
def test_errors_use_sglangs_status_and_detail(http, base_url, change, field, status):
    """Item 8: SGLang's status and `detail` body, beside this server's field-naming `error`."""
    response = http.post(f"{base_url}/rollout/generate", json={**MILES_BODY, **change})
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"]["field"] == field
    if status == 400:
        assert body["detail"].startswith("Invalid sampling params: ") and field in body["detail"]
    else:
        location = body["detail"][0]["loc"]
        assert location[0] == "body" and ".".join(map(str, location[1:])).startswith(field)


def test_a_typo_is_refused_with_a_suggestion(http, base_url):
    """Item 1: in the default strict mode, an unknown field is a 422 that names it."""
    response = http.post(f"{base_url}/rollout/generate", json={**MILES_BODY, "rollout_sde_tyep": "cps"})
    assert response.status_code == 422
    assert "did you mean 'rollout_sde_type'?" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/liveness", "/model_info", "/server_info", "/v1/models", "/health"])
def test_discovery_endpoints(http, base_url, path):
    """Item 9: the endpoints a trainer and SGLang's model gateway call."""
    response = http.get(f"{base_url}{path}")
    assert response.status_code == 200, response.text
    info = response.json()
    if path == "/model_info":
        assert info["model_type"] == "diffusion" and info["is_image_gen"] is True
        assert info["architectures"] == ["DigitFlowPipeline"] and info["task_type"] == "T2I"
        assert info["model_path"].endswith("digit-flow")
    elif path == "/server_info":
        assert info["served_model_name"] == "embedded-digits" and info["dp_size"] == 2
        assert info["model_path"].endswith("digit-flow") and info["version"]
    elif path == "/v1/models":
        assert info["object"] == "list" and info["data"][0]["id"] == "embedded-digits"
        assert info["data"][0]["object"] == "model"
    else:  # SGLang's status; /health adds the worker replicas it counted
        assert info["status"] == "ok"


def test_better_than_sglang_where_sglang_fails(http, base_url, accept):
    """Item 11: SGLang answers 500 without a seed and asserts on ODE with constants kept."""
    rows = generate(http, base_url, {"prompt": "3", "num_outputs_per_prompt": 2, "num_inference_steps": 2}, accept)
    assert isinstance(rows[0]["seed"], int) and rows[0]["seed"] == rows[1]["seed"]
    assert rows[1]["sample_seed"] == rows[0]["seed"] + 1
    ode = generate(http, base_url, {"prompt": "3", "rollout_sde_type": "ode", "num_inference_steps": 3}, accept)[0]
    assert torch.equal(ode["rollout_log_probs"], torch.zeros(3))


@pytest.fixture(scope="module")
def lenient_url(serve_app):
    """An ingress configured for SGLang's lenient request validation, before the session's workers."""
    app = deploy_ingress(serve_app, "sglang-mode", request_validation="sglang")
    yield app.url
    serve.delete(app.name)


def test_sglang_mode_ignores_unknown_fields_and_coerces(http, lenient_url):
    """Item 1: the app-config switch to SGLang's own behaviour: unknown fields dropped, values
    coerced as pydantic's lax mode does."""
    body = {"prompt": "4", "num_inference_steps": "3", "seed": 5.0, "rollout_sde_tyep": "cps"}
    body["rollout_debug_mode"] = False
    row = generate(http, lenient_url, body, path="/rollout/generate")[0]
    assert row["seed"] == 5 and row["rollout_log_probs"].shape == (3,)
    # The typo was ignored, so the default transition ran: SDE has a noise std at every step.
    strict_sde = {"prompt": "4", "num_inference_steps": 3, "seed": 5, "rollout_debug_mode": False}
    assert torch.equal(row["rollout_log_probs"], generate(http, lenient_url, strict_sde)[0]["rollout_log_probs"])
    # SGLang keeps the top-level `rollout` whatever `extra_sampling_params` says.
    kept = generate(http, lenient_url, {**strict_sde, "extra_sampling_params": {"rollout": False}})[0]
    assert torch.equal(kept["rollout_log_probs"], row["rollout_log_probs"])
    # Values are still checked: 400 as in SGLang.
    response = http.post(f"{lenient_url}/rollout/generate", json={**body, "rollout_noise_level": -1})
    assert response.status_code == 400


def test_every_route_that_acts_has_its_handle_twin():
    """A trainer inside Ray does through the handle whatever an HTTP client can do: each POST route
    has, beside it in its concern's mixin, a method named as its path's last part. (GET routes are
    views of the handle's `info`.)"""
    from deployments.ingress import CONCERNS

    routes = [(mixin, endpoint.http_route) for mixin in CONCERNS for endpoint in vars(mixin).values()
              if hasattr(endpoint, "http_route")]
    actions = [(mixin, path) for mixin, (method, path) in routes if method == "POST"]
    assert len(actions) >= 6, routes
    missing = [path for mixin, path in actions if not callable(vars(mixin).get(path.rsplit("/", 1)[-1]))]
    assert missing == []
