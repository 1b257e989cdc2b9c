"""Video served end to end: Wan2.1-T2V, the two-expert Wan2.2-T2V-A14B and LTX-Video, each loaded
from a tiny diffusers directory whose family is read from its model_index.json, over HTTP (read
with SGLang's own decoding) and the handle, against the library run locally on the same directory.
"""

import numpy as np
import pytest
import torch
from ray import serve

from deployments import job
from deployments.app import build_app
from rollout.client import RolloutClient
from rollout.dataset import load_rollouts
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.rows import schedule_of_row
from rollout.sampler import sample
from rollout.testing.batches import assert_same_batch
from rollout.video import frames_as_uint8
from tests.deployments.apps import delete_side_by_side
from tests.deployments.test_sglang_compat import generate
from tests.test_response_size import response_estimate

LAYOUTS = ["wan21", "wan22_a14b"]

# The worker replicas sample on one thread (`worker_torch_threads`), so the library's reference does
# too: on an AVX512 machine LTX-Video's frames came out with other bits on two threads than on one.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

APPS = [*LAYOUTS, "ltx"]
TEXT_LENGTH = 16
WAN_RESPONSE_LIMIT = 3 * 2**19  # 8 whole trajectories are past it, 8 two-step windows not
HEIGHT, WIDTH, FRAMES, STEPS = 32, 48, 5, 4


@pytest.fixture(scope="module")
def video_apps(serve_app, tiny_video_dirs):
    """Layout -> (handle, url, local pipeline), the applications deployed side by side."""
    _, base_url = serve_app
    targets = []
    for layout in APPS:
        config = {
            "app_name": f"video-{layout}",
            "model": {"path": str(tiny_video_dirs[layout]), "micro_batch_size": 2, "max_sequence_length": TEXT_LENGTH},
            "num_worker_replicas": 1,
            "worker_num_cpus": 0.25,
            "worker_torch_threads": 1,
            "ingress_num_cpus": 0.1,
            # A tiny Wan video with its whole trajectory and debug tensors is 203 KB here as JSON; an
            # LTX one's frames alone (64 x 96, 9 frames) are 0.6 MiB.
            "limits": {"max_response_bytes": 4 * 2**20 if layout == "ltx" else WAN_RESPONSE_LIMIT},
        }
        targets.append(serve.RunTarget(build_app(config), name=config["app_name"], route_prefix=f"/{layout}"))
    handles = serve.run_many(targets)
    local = {
        layout: load_pipeline(
            None, tiny_video_dirs[layout], device="cpu", micro_batching=MicroBatching(2), max_sequence_length=TEXT_LENGTH
        )
        for layout in APPS
    }
    yield {layout: (handle, f"{base_url}/{layout}", local[layout]) for layout, handle in zip(APPS, handles)}
    delete_side_by_side(f"video-{layout}" for layout in APPS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_http_video_rows_are_the_librarys_in_sglangs_layout(video_apps, layout, http):
    _, url, local = video_apps[layout]
    body = {
        "prompt": "a cat sitting on a red chair",
        "negative_prompt": "blurry",
        "num_outputs_per_prompt": 2,
        "num_inference_steps": STEPS,
        "height": HEIGHT,
        "width": WIDTH,
        "num_frames": FRAMES,
        "fps": 8,
        "guidance_scale": 3.0,
        "seed": 21,
        "rollout_return_dit_trajectory": True,
        # As miles sends Wan2.2's second scale.
        "extra_sampling_params": {"guidance_scale_2": 2.0},
    }
    rows = generate(http, url, body)  # decoded as SGLang decodes a response

    options = SamplingOptions(
        num_inference_steps=STEPS, height=HEIGHT, width=WIDTH, num_frames=FRAMES, guidance_scale=3.0,
        guidance_scale_2=2.0, debug=True,
    )  # fmt: skip
    expected = sample(local, ["a cat sitting on a red chair"] * 2, [21, 22], options, negative_prompts=["blurry"] * 2)
    schedule = expected.schedule
    for row, video in zip(rows, expected.samples):
        assert row["generated_output"].shape == (3, FRAMES, HEIGHT, WIDTH)  # (C, F, H, W), SGLang's
        assert torch.equal(row["generated_output"], video.image)
        assert row["dit_trajectory"]["latents"].shape == (STEPS + 1, 16, 2, HEIGHT // 8, WIDTH // 8)
        assert torch.equal(row["dit_trajectory"]["latents"], video.latents)
        assert torch.equal(row["rollout_log_probs"], video.log_probs)
        served_schedule = schedule_of_row(row)
        assert served_schedule.equals(schedule)
    if layout == "wan22_a14b":
        assert set(rows[0]["dit_trajectory"]["model_experts"].tolist()) == {0, 1}
        # The low-noise expert's own scale was used: without it the rows differ.
        options_without = SamplingOptions(
            num_inference_steps=STEPS, height=HEIGHT, width=WIDTH, num_frames=FRAMES, guidance_scale=3.0
        )
        other = sample(local, ["a cat sitting on a red chair"], [21], options_without, negative_prompts=["blurry"])
        assert not torch.equal(other.samples[0].log_probs, rows[0]["rollout_log_probs"])
    else:
        assert "model_experts" not in rows[0]["dit_trajectory"]
    info = http.get(f"{url}/rollout/info").json()
    assert info["model"] == "wan" and info["default_num_frames"] == 81
    assert info["experts"] == list(local.experts)


def test_handle_video_rollouts_replay_exactly_across_the_expert_boundary_and_the_client_gets_the_same_bits(video_apps):
    handle, url, local = video_apps["wan22_a14b"]
    body = {
        "prompt": ["a cat", "a dog"],
        "num_outputs_per_prompt": 2,
        "num_inference_steps": STEPS,
        "height": HEIGHT,
        "width": WIDTH,
        "num_frames": FRAMES,
        "guidance_scale": 2.0,
        "seed": 12,
        "rollout_return_dit_trajectory": True,
        "rollout_debug_mode": False,
    }
    batch = handle.generate.remote(body).result().batch()
    assert all(s.schedule is batch.schedule for s in batch.samples)
    assert set(batch.schedule.model_experts.tolist()) == {0, 1}
    replayed = replay_log_probs(local, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))
    assert_same_batch(batch, RolloutClient(url).generate(body))  # the experts' schedule too


def test_bad_frame_counts_are_400s_naming_the_field_and_the_server_keeps_serving(video_apps, serve_app, http):
    _, url, _ = video_apps["wan21"]
    small = {"prompt": "x", "height": HEIGHT, "width": WIDTH, "num_inference_steps": 2}
    for frames, says in ((4, "must be 4k + 1"), (300, "at most 257 (limits.max_num_frames)"), (0, "positive integer")):
        response = http.post(f"{url}/rollout/generate", json={**small, "num_frames": frames})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["field"] == "num_frames" and says in error["message"], error
    _, image_url = serve_app  # the embedded digits model
    response = http.post(f"{image_url}/rollout/generate", json={"prompt": "3", "num_frames": 5})
    assert response.status_code == 400 and "generates images: must be 1" in response.json()["error"]["message"]
    response = http.post(f"{url}/rollout/generate", json={**small, "num_frames": 1})  # 4k + 1 with k = 0
    assert response.status_code == 200, response.text


def test_a_response_past_the_size_limit_is_a_400_before_sampling_naming_what_to_drop(video_apps, http):
    _, url, local = video_apps["wan21"]
    body = {
        "prompt": "x", "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "num_inference_steps": STEPS,
        "num_outputs_per_prompt": 8, "rollout_return_dit_trajectory": True,
    }  # fmt: skip
    window = {"rollout_sde_step_indices": [1, 2], "rollout_return_step_indices": [1, 2, 3], "rollout_debug_mode": False}
    assert response_estimate(local, body) > WAN_RESPONSE_LIMIT > response_estimate(local, {**body, **window})
    response = http.post(f"{url}/rollout/generate", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["field"] == "rollout_return_step_indices"
    for advice in ("limits.max_response_bytes", "rollout_sde_step_indices", "rollout_debug_mode: false"):
        assert advice in error["message"]
    # The same samples with a two-step window and no debug tensors fit, and the server kept serving.
    response = http.post(f"{url}/rollout/generate", json={**body, **window})
    assert response.status_code == 200, response.text


def test_uint8_frames_are_the_fp32_frames_rounded(video_apps, http):
    _, url, local = video_apps["wan21"]
    body = {"prompt": "a dog", "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "num_inference_steps": 2, "seed": 3}
    (as_floats,) = generate(http, url, body)
    (as_bytes,) = generate(http, url, {**body, "rollout_video_dtype": "uint8"})
    assert as_floats["generated_output"].dtype == torch.float32
    assert as_bytes["generated_output"].dtype == torch.uint8 and as_bytes["generated_output"].shape == (3, FRAMES, HEIGHT, WIDTH)
    assert torch.equal(as_bytes["generated_output"], frames_as_uint8(as_floats["generated_output"]))
    assert torch.equal(as_bytes["rollout_log_probs"], as_floats["rollout_log_probs"])  # only the output changes
    response = http.post(f"{url}/rollout/generate", json={**body, "rollout_video_dtype": "float16"})
    assert response.status_code == 400 and response.json()["error"]["field"] == "rollout_video_dtype"


def test_the_job_writes_a_dataset_and_an_mp4_per_video(video_apps, tmp_path):
    av = pytest.importorskip("av", reason="the job writes MP4s with PyAV, the `video` extra")
    _, _, local = video_apps["wan21"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    output = tmp_path / "videos-dataset"
    job.main([
        "--prompts", str(prompts), "--output", str(output), "--app-name", "video-wan21", "--num-outputs-per-prompt", "2",
        "--num-inference-steps", "2", "--prompts-per-request", "1", "--height", str(HEIGHT), "--width", str(WIDTH),
        "--num-frames", str(FRAMES), "--fps", "8", "--videos",
    ])  # fmt: skip
    _, batches = load_rollouts(output)
    samples = [s for b in batches for s in b.samples]
    assert [s.image.shape for s in samples] == [(3, FRAMES, HEIGHT, WIDTH)] * 4
    videos = sorted((output / "videos").iterdir())
    assert [v.name for v in videos] == [f"sample-{i:06d}.mp4" for i in range(4)]
    brightness = [frames_as_uint8(s.image).float().mean(0) for s in samples]  # [F, H, W]
    for i, path in enumerate(videos):
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264" and stream.average_rate == 8
            decoded = torch.tensor(np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]))
        assert decoded.shape == (FRAMES, HEIGHT, WIDTH, 3)
        # H.264 in yuv420p is lossy, colour most: by brightness, this sample's frames, not the next one's.
        decoded_brightness = decoded.float().mean(-1)
        error, other = ((decoded_brightness - brightness[j]).abs().mean() for j in (i, (i + 1) % len(samples)))
        assert error < 0.5 * other


def test_ltx_video_over_http_and_the_handle_is_the_librarys(video_apps, http):
    handle, url, local = video_apps["ltx"]
    height, width, frames = 64, 96, 9
    body = {
        "prompt": "a red chair", "num_outputs_per_prompt": 2, "num_inference_steps": 3, "height": height,
        "width": width, "num_frames": frames, "fps": 12, "seed": 8, "rollout_return_dit_trajectory": True,
        "rollout_return_denoising_env": True, "rollout_debug_mode": False,
    }  # fmt: skip
    rows = generate(http, url, body)
    options = SamplingOptions(num_inference_steps=3, height=height, width=width, num_frames=frames, fps=12)
    expected = sample(local, ["a red chair"] * 2, [8, 9], options)
    for row, video in zip(rows, expected.samples):
        assert row["generated_output"].shape == (3, frames, height, width)
        assert torch.equal(row["generated_output"], video.image)
        assert torch.equal(row["dit_trajectory"]["latents"], video.latents)
        assert torch.equal(row["rollout_log_probs"], video.log_probs)
        assert schedule_of_row(row).equals(expected.schedule)
        assert row["denoising_env"]["image_kwargs"]["frame_rate"].tolist() == 12
    batch = handle.generate.remote(body).result().batch()
    replayed = replay_log_probs(local, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))
    assert_same_batch(batch, RolloutClient(url).generate(body))  # the experts' schedule too
