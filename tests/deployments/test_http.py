"""The HTTP API against a real local Ray cluster."""

import json

import msgpack
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.codec import encode_tensor, from_json, from_msgpack
from tests.reference_bits import DIGITS_REQUESTS, REFERENCE, field_digests


def post(http, base_url, body, accept="application/msgpack"):
    response = http.post(f"{base_url}/rollout/generate", json=body, headers={"Accept": accept})
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith(accept)
    return from_msgpack(response.content) if accept == "application/msgpack" else from_json(response.content)


def fresh_schedule(steps):
    scheduler = FlowMatchEulerDiscreteScheduler()  # the embedded model's config (shift 1.0)
    scheduler.set_timesteps(steps)
    return scheduler.sigmas, scheduler.timesteps


def test_health_and_info(http, base_url, app_config):
    assert http.get(f"{base_url}/health").json() == {"status": "ok", "worker_replicas_running": 2}
    assert http.get(f"{base_url}/liveness").json() == {"status": "ok"}
    info = http.get(f"{base_url}/rollout/info").json()
    assert info["model"] == "embedded-digits"
    assert info["weight_version"] == app_config["weight_version"]
    assert info["limits"]["max_outputs_per_prompt"] == 8
    # The scheduler config is enough to rebuild the server's scheduler with diffusers.
    assert info["scheduler"]["class_name"] == "FlowMatchEulerDiscreteScheduler"
    rebuilt = FlowMatchEulerDiscreteScheduler.from_config(info["scheduler"]["config"])
    rebuilt.set_timesteps(7)
    rows = post(http, base_url, {"prompt": "1", "num_inference_steps": 7, "rollout_return_dit_trajectory": True})
    assert torch.equal(rows[0]["dit_trajectory"]["sigmas"], rebuilt.sigmas)


def test_multi_prompt_fan_out_keeps_the_schedule_whole(http, base_url):
    # T = 3, so T + 1 == num_outputs_per_prompt == 4: a shape-guessing server would slice sigmas.
    steps, per_prompt = 3, 4
    body = {
        "prompt": ["a handwritten 7", "3"],
        "num_outputs_per_prompt": per_prompt,
        "num_inference_steps": steps,
        "seed": 1000,
        "rollout_debug_mode": True,
        "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True,
    }
    rows = post(http, base_url, body)
    sigmas, timesteps = fresh_schedule(steps)
    assert len(rows) == 8
    assert [r["prompt"] for r in rows] == ["a handwritten 7"] * 4 + ["3"] * 4
    assert [r["prompt_index"] for r in rows] == [0] * 4 + [1] * 4
    assert [r["sample_seed"] for r in rows] == list(range(1000, 1008))
    assert {r["seed"] for r in rows} == {1000}
    assert len({r["request_id"] for r in rows}) == 1
    for row in rows:
        trajectory = row["dit_trajectory"]
        assert trajectory["sigmas"].shape == (steps + 1,)
        assert torch.equal(trajectory["sigmas"], sigmas)
        assert torch.equal(trajectory["scheduler_timesteps"], timesteps)
        assert torch.equal(trajectory["timesteps"], torch.cat([timesteps, torch.zeros(1)]))
        assert trajectory["latents"].shape == (steps + 1, 1, 16, 16)
        assert trajectory["latent_step_indices"].tolist() == [0, 1, 2, 3]
        assert row["generated_output"].shape == (1, 16, 16)
        assert row["rollout_log_probs"].shape == (steps,) and row["rollout_log_probs"].dtype == torch.float32
        debug = row["rollout_debug_tensors"]
        assert debug["rollout_model_outputs"].shape == debug["rollout_prev_sample_means"].shape == (steps, 1, 16, 16)
        assert debug["rollout_variance_noises"].shape == (steps, 1, 16, 16)
        assert debug["rollout_noise_std_devs"].shape == (steps, 1)
        assert set(row["denoising_env"]["pos_cond_kwargs"]) == {"encoder_hidden_states", "pooled_projections"}
        assert row["weight_version"] == "test-v1" and row["inference_time_s"] > 0
    # Different samples really are different samples.
    assert not torch.equal(rows[0]["generated_output"], rows[1]["generated_output"])


def test_json_and_msgpack_carry_the_same_bits(http, base_url):
    body = {"prompt": "5", "num_outputs_per_prompt": 2, "num_inference_steps": 4, "seed": 3, "rollout_return_dit_trajectory": True}
    packed = post(http, base_url, body)
    as_json = post(http, base_url, body, accept="application/json")
    for a, b in zip(packed, as_json):
        for name in ("generated_output", "rollout_log_probs"):
            assert torch.equal(a[name], b[name])
        for name in ("latents", "sigmas", "timesteps", "scheduler_timesteps", "latent_step_indices"):
            assert torch.equal(a["dit_trajectory"][name], b["dit_trajectory"][name])


def test_the_schedule_is_encoded_once_per_response(http, base_url):
    body = {"prompt": ["2", "8"], "num_outputs_per_prompt": 3, "num_inference_steps": 5, "rollout_return_dit_trajectory": True}
    response = http.post(f"{base_url}/rollout/generate", json=body)
    rows = msgpack.unpackb(response.content)  # raw envelopes, not decoded
    envelopes = [row["dit_trajectory"]["sigmas"] for row in rows]
    assert all(e["__tensor__"] and e["shape"] == [6] and e["dtype"] == "torch.float32" for e in envelopes)
    assert len({e["data"] for e in envelopes}) == 1


def test_step_filters(http, base_url):
    body = {
        "prompt": "9",
        "num_inference_steps": 6,
        "seed": 11,
        "rollout_sde_step_indices": [1, 2],
        "rollout_return_step_indices": [6, 0, 2],
        "rollout_return_dit_trajectory": True,
    }
    filtered = post(http, base_url, body)[0]
    full = post(http, base_url, {**body, "rollout_return_step_indices": None})[0]
    assert filtered["dit_trajectory"]["latent_step_indices"].tolist() == [0, 2, 6]
    assert torch.equal(filtered["dit_trajectory"]["latents"], full["dit_trajectory"]["latents"][[0, 2, 6]])
    assert torch.equal(filtered["dit_trajectory"]["timesteps"], full["dit_trajectory"]["timesteps"][[0, 2, 6]])
    sigmas, timesteps = fresh_schedule(6)
    assert torch.equal(filtered["dit_trajectory"]["sigmas"], sigmas)  # never filtered
    assert torch.equal(filtered["dit_trajectory"]["scheduler_timesteps"], timesteps)
    log_probs = filtered["rollout_log_probs"]
    assert log_probs.shape == (6,) and torch.equal(log_probs, full["rollout_log_probs"])
    assert [i for i in range(6) if log_probs[i] != 0] == [1, 2]


def test_evaluation_mode_returns_images_only(http, base_url):
    rows = post(http, base_url, {"prompt": "4", "rollout": False, "num_outputs_per_prompt": 2})
    assert len(rows) == 2
    for row in rows:
        assert row["generated_output"].shape == (1, 16, 16)
        assert row["rollout_log_probs"] is None and row["dit_trajectory"] is None
        assert row["rollout_debug_tensors"] is None and row["denoising_env"] is None


def test_the_server_picks_and_returns_a_seed(http, base_url):
    rows = post(http, base_url, {"prompt": "6", "num_outputs_per_prompt": 3, "num_inference_steps": 2})
    seed = rows[0]["seed"]
    assert isinstance(seed, int) and [r["seed"] for r in rows] == [seed] * 3
    assert [r["sample_seed"] for r in rows] == [seed, seed + 1, seed + 2]


def test_a_sample_is_the_same_alone_or_batched(http, base_url, handle):
    body = {"prompt": "3", "num_inference_steps": 5, "rollout_return_dit_trajectory": True}
    # A burst of concurrent requests that the workers batch together; take a sample of one that
    # was batched (the first of a burst may have started alone).
    seeds = [4242 + 100 * i for i in range(12)]
    responses = [handle.generate.remote({**body, "seed": seed}) for seed in seeds]
    parts = {seed: response.result().fetch().parts[0] for seed, response in zip(seeds, responses)}
    batched_seeds = [seed for seed, part in parts.items() if part.sampler_batch_size > 1]
    assert batched_seeds, [part.sampler_batch_size for part in parts.values()]
    batched = parts[batched_seeds[-1]].batch.samples[0]
    alone = post(http, base_url, {**body, "seed": batched_seeds[-1]})[0]  # nothing else in flight: sampled alone
    for name, tensor in (("generated_output", batched.image), ("rollout_log_probs", batched.log_probs)):
        assert encode_tensor(alone[name])["data"] == encode_tensor(tensor)["data"]
    assert encode_tensor(alone["dit_trajectory"]["latents"])["data"] == encode_tensor(batched.latents)["data"]


# (body, field, status): SGLang's status for the same input, 422 for a body that does not fit
# the schema and 400 for a value the server cannot serve.
BAD_REQUESTS = [
    ({"prompt": 7}, "prompt", 422),
    ({"prompt": "7", "num_outputs_per_prompt": "2"}, "num_outputs_per_prompt", 422),
    ({"prompt": "7", "seed": 1.5}, "seed", 422),
    ({"prompt": "7", "temperature": 1.0}, "temperature", 422),
    ({}, "prompt", 422),
    ({"prompt": "7", "num_outputs_per_prompt": 0}, "num_outputs_per_prompt", 400),
    ({"prompt": "7", "num_outputs_per_prompt": 9}, "num_outputs_per_prompt", 400),
    ({"prompt": ["7"] * 5, "num_outputs_per_prompt": 8}, "num_outputs_per_prompt", 400),
    ({"prompt": ["7"] * 9}, "prompt", 400),
    ({"prompt": "7", "num_inference_steps": 0}, "num_inference_steps", 400),
    ({"prompt": "7", "num_inference_steps": 51}, "num_inference_steps", 400),
    ({"prompt": "7", "num_inference_steps": 5, "rollout_return_step_indices": [6]}, "rollout_return_step_indices", 400),
    ({"prompt": "7", "num_inference_steps": 5, "rollout_sde_step_indices": [5]}, "rollout_sde_step_indices", 400),
    ({"prompt": "7", "num_inference_steps": 5, "rollout_sde_step_indices": [2, 2]}, "rollout_sde_step_indices", 400),
    ({"prompt": "7", "rollout_noise_level": -1}, "rollout_noise_level", 400),
    ({"prompt": "7", "rollout_sde_type": "euler"}, "rollout_sde_type", 400),
    ({"prompt": "a cat"}, "prompt", 400),
    ({"prompt": "7", "negative_prompt": "a cat"}, "negative_prompt", 400),
    ({"prompt": ["7", "8"], "negative_prompt": ["1"]}, "negative_prompt", 400),
    ({"prompt": "7", "height": 32}, "height", 400),
    ({"prompt": "7", "width": 0}, "width", 400),
]


@pytest.mark.parametrize("body,field,status", BAD_REQUESTS, ids=[f for _, f, _ in BAD_REQUESTS])
def test_bad_requests_get_a_4xx_naming_the_field(http, base_url, body, field, status):
    response = http.post(f"{base_url}/rollout/generate", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["field"] == field
    assert field in error["message"]


@pytest.mark.parametrize(
    "raw,content_type,field,status",
    [
        (b'{"prompt": "7", "rollout_noise_level": NaN}', "application/json", "rollout_noise_level", 400),
        (b'{"prompt": "7", "guidance_scale": Infinity}', "application/json", "guidance_scale", 400),
        (b"{not json", "application/json", "body", 422),
        (b"[1, 2]", "application/json", "body", 422),
        (b"\xc1\xc1", "application/msgpack", "body", 422),
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "body", 422),
    ],
)
def test_malformed_bodies_get_a_4xx(http, base_url, raw, content_type, field, status):
    response = http.post(f"{base_url}/rollout/generate", data=raw, headers={"Content-Type": content_type})
    assert response.status_code == status, response.text
    assert response.json()["error"]["field"] == field


def test_msgpack_request_bodies_are_accepted(http, base_url):
    body = msgpack.packb({"prompt": "2", "num_inference_steps": 2, "seed": 1})
    response = http.post(f"{base_url}/rollout/generate", data=body, headers={"Content-Type": "application/msgpack"})
    assert response.status_code == 200
    assert from_msgpack(response.content)[0]["seed"] == 1


def test_the_server_keeps_serving_after_bad_requests(http, base_url):
    for body, _, _ in BAD_REQUESTS:
        http.post(f"{base_url}/rollout/generate", data=json.dumps(body))
    rows = post(http, base_url, {"prompt": "0", "num_inference_steps": 3, "seed": 5})
    assert rows[0]["rollout_log_probs"].shape == (3,)


@pytest.mark.parametrize("name", sorted(DIGITS_REQUESTS))
def test_rows_keep_their_bits(http, base_url, name):
    """The fixed requests of `tests/reference_bits.py`, msgpack and JSON rows against the committed digests."""
    for accept in ("application/msgpack", "application/json"):
        rows = post(http, base_url, DIGITS_REQUESTS[name], accept)
        REFERENCE.check(f"http:embedded-digits:{name}", field_digests(rows))
