"""The image families (SD3, FLUX.1, Qwen-Image) served end to end: one application per family, loaded from a tiny
diffusers directory with the family read from its model_index.json, over HTTP and the handle;
and, with the embedded model too, the schedule on every served path.

The served bits are compared with the library run locally on the same directory: same seeds,
same micro-batch size, so the same numbers.
"""

import dataclasses
from pathlib import Path

import pytest
import ray
import torch
import yaml
from ray import serve

from deployments.app import build_app
from rollout.codec import from_json, from_msgpack
from rollout.micro_batching import MicroBatching
from rollout.models.choice import EMBEDDED_MODEL
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.rows import schedule_of_row
from rollout.sampler import sample
from rollout.scorers.base import ScoringSample
from rollout.scorers.clip import ClipScorer
from rollout.testing.builders import build_tiny_clip
from rollout.testing.families import IMAGE_FAMILIES, TINY_FAMILIES
from tests.deployments.apps import delete_side_by_side
from tests.reference_bits import (
    REFERENCE,
    batch_records,
    family_requests,
    field_digests,
)

REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("scorers") / "pickscore")


def example_scorers(clip_path) -> dict:
    """deployments/serve_config_rewards.yaml's scorers, on a tiny CLIP copy and the CPU."""
    config = yaml.safe_load((REPOSITORY / "deployments/serve_config_rewards.yaml").read_text())
    scorers = config["applications"][0]["args"]["scorers"]
    for scorer in scorers.values():
        scorer["options"].update(path=str(clip_path), dtype="float32")
        scorer.update(num_gpus=0, num_cpus=0.1)
    return scorers


# FLUX.1's replica measures its sizes at start-up at a size of its own, within a few seconds, and is
# given them at the model's default size. What it measures depends on the machine's speed, so no
# reference request (tests/reference_bits.py: 32x32 and 32x64) is of that size.
CALIBRATED = "flux"
CALIBRATED_SHAPE = (48, 64)
CALIBRATION_SIZE = "48x64"


@pytest.fixture(scope="module")
def family_apps(serve_app, tiny_family_dirs, tiny_clip, tmp_path_factory):
    """Family -> (handle, url, local pipeline), every application deployed at once; SD3's with the
    rewards example's PickScore scorer. The local pipeline samples with the sizes its app reports."""
    _, base_url = serve_app
    targets = []
    # Two guided samples a transformer call (SD3's takes both branches: 4 rows), two images a VAE call.
    micro_batches = {
        family: {"micro_batch_size": 2 * TINY_FAMILIES[family].rows_per_guided_sample, "decode_batch_size": 2}
        for family in IMAGE_FAMILIES
    }
    default = load_pipeline(None, tiny_family_dirs[CALIBRATED], device="cpu")
    micro_batches[CALIBRATED] = {
        "micro_batch_sizes": {f"{default.default_height}x{default.default_width}": 2},
        "calibration_sizes": [CALIBRATION_SIZE],
        "calibration_budget_s": 1,
        "calibration_cache_dir": str(tmp_path_factory.mktemp("calibrations")),
    }
    for family in IMAGE_FAMILIES:
        config = {
            "app_name": f"family-{family}",
            "model": {"path": str(tiny_family_dirs[family]), **micro_batches[family]},
            "weight_version": f"{family}-v0",
            "num_worker_replicas": 1,
            "worker_num_cpus": 0.25,
            "worker_torch_threads": 1,
            "ingress_num_cpus": 0.1,
            "scorers": example_scorers(tiny_clip) if family == "sd3" else {},
        }
        targets.append(serve.RunTarget(build_app(config), name=config["app_name"], route_prefix=f"/{family}"))
    handles = serve.run_many(targets)  # deployed side by side: each worker imports transformers
    apps = {}
    for family, handle in zip(IMAGE_FAMILIES, handles):
        served = MicroBatching.parse(**handle.info.remote().result(timeout_s=60)["micro_batching"])
        apps[family] = handle, f"{base_url}/{family}", load_pipeline(None, tiny_family_dirs[family], device="cpu", micro_batching=served)
    yield apps
    delete_side_by_side(f"family-{family}" for family in IMAGE_FAMILIES)


def test_a_replica_serves_the_configured_sizes_and_those_it_measured_at_start(family_apps, tiny_family_dirs):
    for family, (_, _, local) in family_apps.items():
        if family != CALIBRATED:
            rows = 2 * TINY_FAMILIES[family].rows_per_guided_sample
            assert local.micro_batching == MicroBatching(rows, decode_default=2)
            continue
        # The model's default for sizes not named, the configured size at the model's size, and at the
        # tests' size what the replica measured (the tests' samples are the library's with them).
        default = load_pipeline(None, tiny_family_dirs[family], device="cpu")
        default_size = (default.default_height, default.default_width)
        assert local.micro_batching.default == default.micro_batching.default
        assert set(local.micro_batching.by_size) == {default_size, CALIBRATED_SHAPE} and local.micro_batching.by_size[default_size] == 2
        assert set(local.micro_batching.decode_by_size) == {CALIBRATED_SHAPE}


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_http_rollouts_are_the_librarys(family_apps, family, http):
    """At 32x64, or for FLUX.1 at the size its replica calibrated at start-up: the local pipeline
    samples with the sizes the app reports, so its bits are the served ones."""
    _, url, local = family_apps[family]
    height, width = CALIBRATED_SHAPE if family == CALIBRATED else (32, 64)
    body = {
        "prompt": ["a red cube", "a lighthouse in a storm"],
        "negative_prompt": "blurry",
        "num_outputs_per_prompt": 2,
        "num_inference_steps": 3,
        "height": height,
        "width": width,
        "seed": 5,
        "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True,
        **TINY_FAMILIES[family].guided,
    }
    response = http.post(f"{url}/rollout/generate", json=body)
    assert response.status_code == 200, response.text
    rows = from_msgpack(response.content)
    assert [row["weight_version"] for row in rows] == [f"{family}-v0"] * 4

    options = SamplingOptions(num_inference_steps=3, height=height, width=width, debug=True, **TINY_FAMILIES[family].guided)
    prompts = ["a red cube"] * 2 + ["a lighthouse in a storm"] * 2
    expected = sample(local, prompts, [5, 6, 7, 8], options, negative_prompts=["blurry"] * 4)
    schedule = local.schedule(3, height, width)
    for row, sample_ in zip(rows, expected.samples):
        assert row["generated_output"].shape == (3, height, width)
        assert torch.equal(row["rollout_log_probs"], sample_.log_probs)
        assert torch.equal(row["dit_trajectory"]["latents"], sample_.latents)
        assert torch.equal(row["rollout_debug_tensors"]["rollout_model_outputs"], sample_.debug.model_outputs)
        trajectory = row["dit_trajectory"]
        assert torch.equal(trajectory["sigmas"], schedule.sigmas)
        assert torch.equal(trajectory["scheduler_timesteps"], schedule.timesteps)
        assert torch.equal(trajectory["model_timesteps"], schedule.model_timesteps)
        assert set(row["denoising_env"]) == {"image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"}

    info = http.get(f"{url}/model_info").json()
    assert info["architectures"] == [local.diffusers_pipeline]
    assert http.get(f"{url}/rollout/info").json()["model"] == family


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_handle_rollouts_replay_exactly(family_apps, family):
    handle, _, local = family_apps[family]
    body = {"prompt": ["a cat", "a dog"], "num_outputs_per_prompt": 2, "num_inference_steps": 3, "height": 32, "width": 32,
            "rollout_return_dit_trajectory": True}  # fmt: skip
    batch = handle.generate.remote({**body, **TINY_FAMILIES[family].guided, "rollout_debug_mode": False}).result().batch()
    assert all(s.schedule is batch.schedule for s in batch.samples)
    replayed = replay_log_probs(local, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))


def test_the_rewards_example_scores_a_real_family_with_pickscore(family_apps, tiny_clip, http):
    _, url, _ = family_apps["sd3"]
    body = {"prompt": ["a red cube", "a cat"], "num_outputs_per_prompt": 2, "num_inference_steps": 2, "height": 32,
            "width": 32, "seed": 1, "rollout_reward_models": ["pickscore"], "rollout_advantages": "group"}  # fmt: skip
    response = http.post(f"{url}/rollout/generate", json=body)
    assert response.status_code == 200, response.text
    rows = from_msgpack(response.content)
    scorer = ClipScorer(str(tiny_clip), kind="pickscore")
    direct = scorer.score([ScoringSample(row["generated_output"], row["prompt"]) for row in rows])
    assert [row["rewards"]["pickscore"] for row in rows] == direct
    assert all(isinstance(row["advantages"]["pickscore"], float) for row in rows)


def test_bad_sizes_are_refused_and_the_server_keeps_serving(family_apps, http):
    _, url, _ = family_apps["flux"]
    response = http.post(f"{url}/rollout/generate", json={"prompt": "x", "height": 40, "width": 32})
    assert response.status_code == 400 and "height" in response.text and "multiple of 16" in response.text
    response = http.post(f"{url}/rollout/generate", json={"prompt": "x", "height": 32, "width": 32, "num_inference_steps": 2})
    assert response.status_code == 200


def test_a_size_past_the_models_limit_is_a_400_naming_it_and_info_shows_it(family_apps, http):
    """Tiny SD3's positions stop at 512 px, far below the configured `limits.max_image_size`."""
    _, url, local = family_apps["sd3"]
    response = http.post(f"{url}/rollout/generate", json={"prompt": "x", "height": 1024, "width": 1024})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == "height"
    assert "must be at most 512 for model 'sd3' (its transformer's pos_embed_max_size 32 x patch 2" in error["message"]
    info = http.get(f"{url}/rollout/info").json()
    assert info["cost_in_flight"] == 0  # refused before it was counted: the next request is not turned away
    assert info["image_size_limits"] == local.image_size_limits.describe()
    assert info["image_size_limits"]["max_size"] == 512 and info["limits"]["max_image_size"] == 4096
    assert info["max_image_size"] == 512


def test_concurrent_requests_of_different_sizes_are_sampled_apart(family_apps):
    """Sizes differ in `mu`, so in schedule: each response has its own size's schedule."""
    handle, _, local = family_apps["qwenimage"]
    sizes = [32, 64, 32, 64]
    responses = [
        handle.generate.remote({"prompt": "a cat", "num_inference_steps": 2, "height": s, "width": s, "seed": i})
        for i, s in enumerate(sizes)
    ]
    for size, response in zip(sizes, responses):
        batch = response.result().batch()
        assert batch.schedule.equals(local.schedule(2, size, size))
        assert batch.samples[0].image.shape == (3, size, size)


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_served_rollouts_keep_their_bits(family_apps, family, http):
    """The fixed requests of `tests/reference_bits.py`, over HTTP (msgpack and JSON) and the handle."""
    handle, url, _ = family_apps[family]
    for name, body in family_requests(family).items():
        for accept in ("application/msgpack", "application/json"):
            response = http.post(f"{url}/rollout/generate", json=body, headers={"Accept": accept})
            assert response.status_code == 200, response.text
            rows = (from_msgpack if accept == "application/msgpack" else from_json)(response.content)
            REFERENCE.check(f"http:{family}:{name}", field_digests(rows))
        batch = handle.generate.remote(body).result().batch()
        REFERENCE.check(f"handle:{family}:{name}", field_digests(batch_records(batch)))


def served_rollout(family, family_apps, serve_app, embedded_pipeline):
    """(handle, url, local pipeline, a body of 2 prompts x 2 samples, 4 SDE steps) for a family."""
    if family == EMBEDDED_MODEL:
        handle, url = serve_app
        return handle, url, embedded_pipeline, {"prompt": ["3", "7"], "height": 16, "width": 16}
    handle, url, local = family_apps[family]
    return handle, url, local, {"prompt": ["a red cube", "a cat"], "height": 32, "width": 64}


@pytest.mark.parametrize("family", [EMBEDDED_MODEL, *IMAGE_FAMILIES])
def test_the_schedule_survives_every_served_path(family, family_apps, serve_app, embedded_pipeline, http):
    """HTTP rows (msgpack and JSON), the handle's `batch()`, and a batch put through the object store:
    sigmas, timesteps and the time input bit-equal to the scheduler's own, and replay exact."""
    handle, url, local, body = served_rollout(family, family_apps, serve_app, embedded_pipeline)
    body = {**body, "num_outputs_per_prompt": 2, "num_inference_steps": 4, "seed": 3, "rollout_debug_mode": False,
            "rollout_return_dit_trajectory": True}  # fmt: skip
    own = local.schedule(4, body["height"], body["width"])
    batch = handle.generate.remote(body).result().batch()
    stored = ray.get(ray.put(batch))
    for arrived in (batch, stored):
        assert arrived.model == family and all(s.schedule is arrived.schedule for s in arrived.samples)
        assert arrived.schedule.equals(own)
        replayed = replay_log_probs(local, arrived.schedule, arrived.options, arrived.samples)
        assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in arrived.samples]))
    for accept, decode in (("application/msgpack", from_msgpack), ("application/json", from_json)):
        response = http.post(f"{url}/rollout/generate", json=body, headers={"Accept": accept})
        assert response.status_code == 200, response.text
        rows = decode(response.content)
        for row in rows:
            from_row = schedule_of_row(row)
            assert from_row.equals(own), accept
        samples = [dataclasses.replace(s, schedule=from_row, latents=row["dit_trajectory"]["latents"]) for s, row in zip(batch.samples, rows)]
        replayed = replay_log_probs(local, from_row, batch.options, samples)
        assert torch.equal(replayed.log_probs, torch.stack([row["rollout_log_probs"] for row in rows])), accept


def test_the_flow_grpo_example_trains_a_lora_through_the_client(family_apps, tiny_family_dirs, tmp_path):
    """examples/flow_grpo.py on the tiny SD3 copy against its application (its PickScore scorer on a
    tiny CLIP): every iteration's first replay on-policy to the bit, the rollouts sampled by the
    adapter the trainer pushed before them, rewards logged. Last in this file: it leaves the
    application serving the adapter."""
    from examples import flow_grpo

    _, url, _ = family_apps["sd3"]
    steps = 3
    argv = ["--model", str(tiny_family_dirs["sd3"]), "--url", url, "--iterations", "3", "--steps", str(steps)]
    argv += ["--height", "32", "--width", "32", "--group-size", "2", "--minibatch", "4", "--lora-rank", "4"]
    history = flow_grpo.main([*argv, "--lora-alpha", "8", "--learning-rate", "0.01", "--output", str(tmp_path)])
    assert [h["rollout_weight_version"] for h in history] == ["flow-grpo-0", "flow-grpo-1", "flow-grpo-2"]
    assert all(h["first_replay_abs_dlogp_per_step"] == [0.0] * steps for h in history)
    assert all(torch.isfinite(torch.tensor([h["reward_mean"], h["kl"], h["policy_loss"]])).all() for h in history)
    assert history[0]["kl"] == 0 and history[-1]["kl"] > 0  # the adapter moved away from the reference
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 3
