"""Encodings kept between requests (`rollout.encoding_cache`): bounded in bytes, and exact: over
generated sequences of requests on the tiny copies, every encoding a warm cache gives is, bit for
bit, the one encoding anew gives. A key that missed something an encoder reads (the size, the
frame rate, the images) would hand one request another's encoding, and fail here."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.encoding_cache import EncodingCache
from rollout.input_images import InputImage
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import resolve_options
from rollout.testing.families import TINY_FAMILIES

# A few prompts, so that requests repeat them as RL does.
PROMPTS = ("a red cube", "two cats", "a boat at dawn")


def tensor(nbytes: int) -> dict[str, torch.Tensor]:
    return {"t": torch.zeros(nbytes, dtype=torch.uint8)}


def test_the_least_recently_used_encodings_go_first_and_the_bytes_stay_bounded():
    cache = EncodingCache(max_bytes=100)
    made = []

    def make(nbytes):
        def encode():
            made.append(nbytes)
            return tensor(nbytes)

        return encode

    for key in ("a", "b", "c"):
        cache.get(key, make(40))
    assert len(cache) == 2 and cache.bytes == 80  # "a" went for "c"
    cache.get("b", make(40))  # a hit: "b" is now the most recently used
    cache.get("d", make(40))  # "c" goes, not "b"
    assert (cache.hits, cache.misses) == (1, 4)
    cache.get("b", make(40))  # a hit
    cache.get("c", make(40))  # made again: it went for "d"
    assert made == [40] * 5 and cache.bytes <= 100
    too_large = cache.get("e", make(101))  # given, not kept
    assert too_large["t"].nbytes == 101 and "e" not in cache._entries and cache.bytes <= 100
    nothing = EncodingCache(max_bytes=0)
    nothing.get("a", make(1))
    assert len(nothing) == 0


def test_a_negative_size_is_refused():
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        EncodingCache(-1)


def same_bits(a, b) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[name].view(-1).view(torch.uint8), b[name].view(-1).view(torch.uint8)) for name in a)


def assert_same_conditioning(cached, fresh):
    assert len(cached.buckets) == len(fresh.buckets)
    for mine, theirs in zip(cached.buckets, fresh.buckets):
        assert torch.equal(mine.rows, theirs.rows)
        for part, value in mine.conditioning.parts().items():
            other = theirs.conditioning.parts()[part]
            if isinstance(value, dict):
                assert same_bits(value, other), part
            else:
                assert (value is None and other is None) or torch.equal(value, other), part


def image(height: int, width: int, seed: int) -> InputImage:
    generator = torch.Generator().manual_seed(seed)
    return InputImage(torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator))


# (copy, the fixture of its directory, sequences of requests drawn): text padded to a bucket of the
# image's tokens (Qwen-Image), a text encoder that reads the images and a VAE-encoded condition
# (Qwen-Image-Edit), a first frame (Wan TI2V), a frame rate (LTX). The editing copy resizes every
# image to about a megapixel, whose encodes take seconds on a CPU: fewer sequences.
COPIES = [
    ("sd3", "tiny_family_dirs", 8),
    ("qwenimage", "tiny_family_dirs", 8),
    ("qwenimage_edit", "tiny_conditioned_dirs", 1),
    ("wan22_ti2v_image", "tiny_conditioned_dirs", 8),
    ("ltx", "tiny_video_dirs", 8),
]


@pytest.mark.parametrize("name, directories, examples", COPIES, ids=[name for name, *_ in COPIES])
def test_a_warm_cache_gives_every_request_the_bits_encoding_anew_gives(name, directories, examples, request, one_torch_thread):
    record = TINY_FAMILIES[name]
    pipeline = load_pipeline(record.family.name, request.getfixturevalue(directories)[name], device="cpu")
    # What makes a kept encoding stay right: weight updates address the denoisers only.
    assert set(pipeline.weight_modules) == set(pipeline.experts)
    space = record.requests
    guidance = {**(record.guided or {})}
    prompt_request = st.tuples(
        st.lists(st.sampled_from(PROMPTS), min_size=1, max_size=3),
        st.sampled_from(space.sizes),
        st.sampled_from(space.frames),
        st.sampled_from((None, 24, 30)),
        st.sampled_from(space.image_sizes),
        st.integers(0, 1),  # which of two images of that size
        st.booleans(),  # guided (a negative prompt encoded too)
    )

    @settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(requests=st.lists(prompt_request, min_size=2, max_size=4))
    def check(requests):
        pipeline.encodings = EncodingCache()
        for prompts, size, frames, fps, image_size, which, guided in requests:
            chosen = guidance if guided else record.unguided or {}
            options = resolve_options(pipeline, SamplingOptions(height=size, width=size, num_frames=frames, fps=fps, **chosen))
            images = None if image_size is None else [(image(*image_size, which),)] * len(prompts)
            negatives = ["blurry"] * len(prompts)
            cached = pipeline.encode_prompts(prompts, negatives, options, images)
            warm, pipeline.encodings = pipeline.encodings, EncodingCache(0)
            fresh = pipeline.encode_prompts(prompts, negatives, options, images)
            pipeline.encodings = warm
            assert_same_conditioning(cached, fresh)

    check()
