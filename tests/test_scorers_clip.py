"""The CLIP-family scorers (`rollout/scorers/clip.py`) on a tiny random-weight CLIP checkpoint."""

import pytest
import torch
from PIL import Image
from transformers import CLIPModel, CLIPProcessor

from rollout.errors import ModelLoadError
from rollout.scorers.base import ScoringSample
from rollout.scorers.clip import ClipScorer
from rollout.scorers.registry import build_scorer
from rollout.testing.builders import build_tiny_clip

MICRO_BATCH = 4
PROMPTS = ["a photo of a cat", "a red chair", "a dog in the garden", "the background"]


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "clip")


@pytest.fixture(scope="module")
def scorers(clip_dir) -> dict[str, ClipScorer]:
    return {
        kind: ClipScorer(str(clip_dir), kind=kind, micro_batch_size=MICRO_BATCH, device="cpu")
        for kind in ("clip", "pickscore")
    }


def _image(seed: int, frames: int | None = None) -> torch.Tensor:
    """A random image `(3, 40, 48)`, or a video `(3, frames, 40, 48)`: not square, so the processor
    resizes and crops."""
    shape = (3, 40, 48) if frames is None else (3, frames, 40, 48)
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed))


def _samples(count: int, seed: int = 0) -> list[ScoringSample]:
    return [ScoringSample(_image(seed + i), PROMPTS[i % len(PROMPTS)]) for i in range(count)]


def _direct_cosines(clip_dir, samples: list[ScoringSample]) -> tuple[torch.Tensor, float]:
    """Cosines of `samples` with transformers' own processor and `get_*_features` in one call of
    each tower, and the model's `logit_scale.exp()`."""
    model = CLIPModel.from_pretrained(clip_dir, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir, local_files_only=True)
    images = [
        Image.fromarray((sample.image * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).numpy())
        for sample in samples
    ]
    inputs = processor(
        text=[sample.prompt for sample in samples],
        images=images,
        padding="max_length",
        max_length=77,
        truncation=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        image_features = model.get_image_features(pixel_values=inputs.pixel_values)
        text_features = model.get_text_features(input_ids=inputs.input_ids, attention_mask=inputs.attention_mask)
    # transformers 5 returns model outputs, 4 returned the embeddings.
    image_embeds = getattr(image_features, "pooler_output", image_features)
    text_embeds = getattr(text_features, "pooler_output", text_features)
    image_embeds = image_embeds / image_embeds.norm(p=2, dim=-1, keepdim=True)
    text_embeds = text_embeds / text_embeds.norm(p=2, dim=-1, keepdim=True)
    return (image_embeds * text_embeds).sum(dim=-1), model.logit_scale.exp().item()


def test_scores_equal_a_direct_computation_with_transformers(clip_dir, scorers):
    # One whole call of each tower (four samples, four distinct prompts) on both sides: the same
    # fixed batch, so fp32 results are equal bit for bit.
    samples = _samples(MICRO_BATCH)
    cosines, logit_scale = _direct_cosines(clip_dir, samples)
    assert scorers["clip"].score(samples) == (100 * cosines).clamp(min=0).tolist()
    pickscores = scorers["pickscore"].score(samples)
    assert pickscores == (torch.tensor(logit_scale) * cosines).tolist()
    assert len(set(pickscores)) == len(samples)  # the samples are told apart


def test_a_sample_scores_the_same_alone_and_with_others(scorers):
    # Six samples make two calls of four, the second padded; alone, one padded call. The companions
    # have other images and prompts, and a video among them adds frame rows.
    target = ScoringSample(_image(100), "a cat sitting on a red chair")
    companions = _samples(4, seed=10) + [ScoringSample(_image(20, frames=3), "a dog")]
    batch = companions[:2] + [target] + companions[2:]
    for scorer in scorers.values():
        assert scorer.score([target]) == [scorer.score(batch)[2]]


def test_pickscore_is_the_clip_logit_and_clip_score_its_clamped_cosine(scorers):
    samples = _samples(6, seed=30)
    logit_scale = scorers["pickscore"].model.logit_scale.exp().item()
    assert logit_scale == pytest.approx(torch.tensor(2.6592).exp().item())  # CLIP's initial scale
    clip_scores = scorers["clip"].score(samples)
    for clip_score, pickscore in zip(clip_scores, scorers["pickscore"].score(samples), strict=True):
        assert clip_score == pytest.approx(max(100 * pickscore / logit_scale, 0.0), rel=1e-5, abs=1e-4)


def test_a_video_scores_the_mean_of_its_frames(scorers):
    video = _image(40, frames=3)
    for scorer in scorers.values():
        (video_score,) = scorer.score([ScoringSample(video, "a photo of a cat")])
        frame_scores = scorer.score([ScoringSample(video[:, f], "a photo of a cat") for f in range(3)])
        assert video_score == pytest.approx(sum(frame_scores) / 3, rel=1e-12)


def test_a_grey_image_scores_as_its_rgb_copy(scorers):
    grey = torch.rand((1, 40, 48), generator=torch.Generator().manual_seed(50))
    scorer = scorers["pickscore"]
    rgb = grey.expand(3, -1, -1)
    assert scorer.score([ScoringSample(grey, "a cat")]) == scorer.score([ScoringSample(rgb, "a cat")])


def test_the_registry_builds_it_by_kind(clip_dir):
    scorer = build_scorer("clip", {"path": str(clip_dir), "kind": "pickscore", "device": "cpu"})
    assert isinstance(scorer, ClipScorer) and scorer.kind == "pickscore" and not scorer.group_aware


@pytest.mark.parametrize("make_path", [lambda tmp: tmp / "missing", lambda tmp: tmp])
def test_a_path_without_a_clip_checkpoint_is_a_model_load_error(tmp_path, make_path):
    with pytest.raises(ModelLoadError) as error:
        ClipScorer(str(make_path(tmp_path)))
    assert error.value.field == "path"


@pytest.mark.parametrize(("option", "value"), [("kind", "aesthetic"), ("dtype", "float64")])
def test_unknown_kind_or_dtype_is_a_model_load_error(clip_dir, option, value):
    with pytest.raises(ModelLoadError) as error:
        ClipScorer(str(clip_dir), **{option: value})
    assert error.value.field == option


def test_a_bad_image_shape_is_refused(scorers):
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        scorers["clip"].score([ScoringSample(torch.rand(4, 8, 8), "a cat")])


def _uint8(image: torch.Tensor) -> torch.Tensor:
    return (image * 255).round().to(torch.uint8)


def test_clip_consistency_is_the_image_embeddings_cosine_with_the_first_input_image(clip_dir):
    scorer = ClipScorer(str(clip_dir), kind="clip_consistency", micro_batch_size=MICRO_BATCH, device="cpu")
    reference, other = _uint8(_image(50)), _uint8(_image(51))
    edits = [ScoringSample(_image(60 + i), "make it red", condition_images=(reference, other)) for i in range(3)]
    same = ScoringSample(reference.float() / 255, "make it red", condition_images=(reference,))
    scores = scorer.score([*edits, same])
    model = CLIPModel.from_pretrained(clip_dir, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir, local_files_only=True)
    pixels = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in [_uint8(s.image) for s in edits] + [reference]]
    with torch.no_grad():
        features = model.get_image_features(pixel_values=processor(images=pixels, return_tensors="pt").pixel_values)
    embeds = getattr(features, "pooler_output", features)
    embeds = embeds / embeds.norm(p=2, dim=-1, keepdim=True)
    expected = (100 * (embeds[:3] * embeds[3]).sum(dim=-1)).clamp(min=0)
    assert torch.allclose(torch.tensor(scores[:3], dtype=torch.float64), expected.double(), atol=1e-4)
    assert scores[3] == pytest.approx(100, abs=1e-3)  # an image against itself
    assert scorer.score(edits[1:2]) == scores[1:2]  # a score does not depend on its companions


def test_clip_consistency_refuses_a_sample_without_an_input_image(clip_dir):
    scorer = ClipScorer(str(clip_dir), kind="clip_consistency", micro_batch_size=MICRO_BATCH, device="cpu")
    with pytest.raises(ValueError, match="sample 0 has none"):
        scorer.score(_samples(1))


def test_a_scoring_sample_keeps_its_input_images_through_pickling():
    import pickle

    sample = ScoringSample(_image(1), "make it red", {"seed": 1}, condition_images=(_uint8(_image(2)),))
    again = pickle.loads(pickle.dumps(sample))
    assert torch.equal(again.condition_images[0], sample.condition_images[0])
