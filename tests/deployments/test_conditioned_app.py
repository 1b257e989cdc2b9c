"""An image-conditioned family (FLUX.1-Kontext) served end to end: input images over HTTP (a data
URI in JSON, raw bytes in msgpack, a file under `allowed_image_paths`) and through the handle (a
PIL image) give the library's bits; every bad image is a 400 naming `image_path`, refused fast,
and the server keeps serving.
"""

import base64
import io
import json
import struct
import time
import zlib

import msgpack
import numpy
import pytest
import torch
from PIL import Image
from ray import serve

from deployments import job
from rollout.codec import from_msgpack
from rollout.dataset import load_rollouts
from rollout.input_images import ImageInputLimits, decode_input_image
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.replay import replay_log_probs
from rollout.sampler import sample_tree
from rollout.scorers.base import ScoringSample
from rollout.scorers.clip import ClipScorer
from rollout.testing.builders import build_tiny_clip
from rollout.tree import TreeRoot
from benchmarks.hostile import PeakRss
from tests.deployments.apps import deploy
from tests.deployments.replicas import pids

FAMILY = "flux_kontext"
BODY = {
    "num_inference_steps": 2,
    "height": 32,
    "width": 32,
    "seed": 3,
    "rollout_return_denoising_env": True,
    "rollout_return_dit_trajectory": True,
}


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def declared_png(width: int, height: int) -> bytes:
    """A valid PNG header declaring `width` x `height` pixels with a few bytes of data: a
    decompression bomb's shape, refused from its header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")


IMAGE = Image.fromarray(
    torch.randint(0, 256, (40, 72, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8).numpy()
)
DATA_URI = "data:image/png;base64," + base64.b64encode(png_bytes(IMAGE)).decode()


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("scorers") / "clip")


@pytest.fixture(scope="module")
def kontext_app(serve_app, tiny_conditioned_dirs, tmp_path_factory, tiny_clip):
    """(the application, the library's pipeline on the same directory, the allowed image root),
    with a `clip_consistency` scorer on a tiny CLIP copy."""
    root = tmp_path_factory.mktemp("images")
    IMAGE.save(root / "cat.png")
    consistency = {"kind": "clip", "options": {"path": str(tiny_clip), "kind": "clip_consistency", "device": "cpu"}}
    app = deploy(
        serve_app,
        "kontext-test",
        model={"path": str(tiny_conditioned_dirs[FAMILY]), "micro_batch_size": 2, "decode_batch_size": 2},
        num_worker_replicas=1,
        allowed_image_paths=[str(root)],
        scorers={"consistency": {**consistency, "num_cpus": 0.1, "num_gpus": 0}},
    )
    local = load_pipeline(None, tiny_conditioned_dirs[FAMILY], device="cpu", micro_batching=MicroBatching(2, decode_default=2))
    yield app, local, root
    serve.delete(app.name)


def library_rollout(local, prompts_and_seeds):
    image = decode_input_image(png_bytes(IMAGE), "image_path", ImageInputLimits())
    options = SamplingOptions(num_inference_steps=2, height=32, width=32, debug=True, return_denoising_env=True)
    roots = [TreeRoot(prompt, "", seed, images=(image,)) for prompt, seed in prompts_and_seeds]
    return sample_tree(local, roots, options).batch


def test_every_way_an_image_comes_in_gives_the_librarys_bits(kontext_app, http, one_torch_thread):
    # On one torch thread, as the workers run: the condition's VAE encode at a megapixel gives other
    # bits on two (docs/real_models.md); a replay from the returned env needs none of it.
    app, local, root = kontext_app
    expected = library_rollout(local, [("make it red", 3), ("make it red", 4)])
    by_json = http.post(
        f"{app.url}/rollout/generate", json={**BODY, "prompt": "make it red", "num_outputs_per_prompt": 2, "image_path": DATA_URI}
    )
    msgpack_body = {**BODY, "prompt": ["make it red"], "num_outputs_per_prompt": 2, "image_path": [png_bytes(IMAGE)]}
    by_msgpack = http.post(
        f"{app.url}/rollout/generate",
        data=msgpack.packb(msgpack_body),
        headers={"Content-Type": "application/msgpack"},
    )
    by_path = http.post(
        f"{app.url}/rollout/generate",
        json={**BODY, "prompt": "make it red", "num_outputs_per_prompt": 2, "image_path": str(root / "cat.png")},
    )
    for response in (by_json, by_msgpack, by_path):
        assert response.status_code == 200, response.text
        rows = from_msgpack(response.content)
        for row, sample in zip(rows, expected.samples, strict=True):
            assert torch.equal(row["rollout_log_probs"], sample.log_probs)
            assert torch.equal(row["dit_trajectory"]["latents"], sample.latents)
            env = row["denoising_env"]["image_kwargs"]
            assert torch.equal(env["condition_latents"], sample.denoising_env["image_kwargs"]["condition_latents"])

    handle_body = {**BODY, "prompt": "make it red", "num_outputs_per_prompt": 2, "image_path": IMAGE}
    batch = app.handle.generate.remote(handle_body).result().batch()
    assert all(torch.equal(a.latents, b.latents) for a, b in zip(batch.samples, expected.samples, strict=True))
    assert batch.samples[0].denoising_env is batch.samples[1].denoising_env  # held once for the prompt
    assert batch.samples[0].condition_images[0].digest == expected.samples[0].condition_images[0].digest
    replayed = replay_log_probs(local, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))

    info = http.get(f"{app.url}/rollout/info").json()
    assert info["condition_images"] == local.condition_images.describe()


def test_a_scorer_gets_the_input_images_and_clip_consistency_rewards_an_edit(kontext_app, http, tiny_clip):
    app, _, _ = kontext_app
    body = {**BODY, "prompt": "make it red", "num_outputs_per_prompt": 2, "image_path": DATA_URI}
    response = http.post(f"{app.url}/rollout/generate", json={**body, "rollout_reward_models": ["consistency"]})
    assert response.status_code == 200, response.text
    rows = from_msgpack(response.content)
    reference = torch.from_numpy(numpy.asarray(IMAGE)).permute(2, 0, 1).contiguous()
    scorer = ClipScorer(str(tiny_clip), kind="clip_consistency", device="cpu")
    direct = scorer.score([ScoringSample(row["generated_output"], row["prompt"], condition_images=(reference,)) for row in rows])
    assert [row["rewards"]["consistency"] for row in rows] == direct


def test_a_job_sends_a_jsonl_files_images_and_writes_a_dataset_that_replays(kontext_app, tmp_path, one_torch_thread):
    # The replay encodes the images again: on one torch thread, as the workers encoded them.
    app, local, _ = kontext_app
    IMAGE.save(tmp_path / "cat.png")
    IMAGE.transpose(Image.Transpose.ROTATE_90).save(tmp_path / "tall.png")
    lines = [{"prompt": "make it red", "image_path": "cat.png"}, {"prompt": "a hat", "image_path": ["tall.png"]}]
    (tmp_path / "edits.jsonl").write_text("\n".join(json.dumps(line) for line in lines))
    arguments = ["--prompts", str(tmp_path / "edits.jsonl"), "--output", str(tmp_path / "out"), "--app-name", app.name]
    job.main([*arguments, "--num-outputs-per-prompt", "2", "--num-inference-steps", "2", "--height", "32", "--width", "32"])
    index, (batch,) = load_rollouts(tmp_path / "out")
    assert [record["prompt"] for record in index["samples"]] == ["make it red"] * 2 + ["a hat"] * 2
    assert [s.condition_images[0].height for s in batch.samples] == [40, 40, 72, 72]
    with torch.no_grad():
        replayed = replay_log_probs(local, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))


def gif_bytes() -> bytes:
    buffer = io.BytesIO()
    IMAGE.save(buffer, format="GIF")
    return buffer.getvalue()


BAD_IMAGES = {
    "a URL": ("https://example.com/cat.png", "image_path"),
    "a path outside the root": ("/etc/hostname", "image_path"),
    "a truncated PNG": (png_bytes(IMAGE)[:200], "image_path"),
    "a 20,000 x 20,000 PNG of a few KB": (declared_png(20_000, 20_000), "image_path"),
    "a GIF": (gif_bytes(), "image_path"),
    "two images for a model that takes one": ([png_bytes(IMAGE)] * 2, "image_path[0]"),
}


def test_every_bad_image_is_a_fast_400_naming_image_path_and_the_server_keeps_serving(kontext_app, http):
    app, _, _ = kontext_app
    (ingress,) = pids(app.name, "RolloutIngress")
    for name, (image, field) in BAD_IMAGES.items():
        body = {**BODY, "prompt": ["make it red"], "image_path": [image]}
        with PeakRss([ingress]) as ingress_memory:
            start = time.perf_counter()
            response = http.post(
                f"{app.url}/rollout/generate", data=msgpack.packb(body), headers={"Content-Type": "application/msgpack"}
            )
            elapsed = time.perf_counter() - start
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["field"].startswith(field), (name, response.json())
        assert elapsed < 0.5, f"{name} took {elapsed:.2f} s to refuse"
        # The bomb's pixels would be 1.2 GB: a refusal never decodes them, and holds nothing after.
        assert ingress_memory.rise() < 64 and ingress_memory.kept() < 16, (name, ingress_memory.rise(), ingress_memory.kept())
    served = http.post(f"{app.url}/rollout/generate", json={**BODY, "prompt": "make it red", "image_path": DATA_URI})
    assert served.status_code == 200, served.text


def test_a_text_to_image_model_refuses_an_input_image_naming_the_field(serve_app, http):
    _, url = serve_app
    response = http.post(f"{url}/rollout/generate", json={"prompt": "3", "num_inference_steps": 2, "image_path": DATA_URI})
    assert response.status_code == 400
    assert response.json()["error"]["field"] == "image_path"
    assert "takes no input image" in response.json()["error"]["message"]

