"""Input images: every kind a client may send decodes to the same exact pixels and digest; what
costs more than its bytes (a decompression bomb, a file outside the allowed roots, a URL) is
refused before it is decoded, opened or fetched, naming the entry and the limit."""

import base64
import io
import socket
import struct
import time
import tracemalloc
import urllib.request
import zlib

import numpy as np
import PIL.Image
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageFile

from rollout.codec import encode_tensor
from rollout.errors import InvalidRequestError
from rollout.input_images import ImageInputLimits, InputImage, decode_input_image, input_images_per_prompt

LIMITS = ImageInputLimits()
RNG = np.random.default_rng(0)
PIXELS = RNG.integers(0, 256, (6, 5, 3), dtype=np.uint8)  # (H, W, 3)


def encoded(pixels: np.ndarray = PIXELS, kind: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, kind, **options)
    return buffer.getvalue()


def lossless_webp() -> bytes:
    return encoded(kind="WEBP", lossless=True)


def chw(pixels: np.ndarray = PIXELS) -> torch.Tensor:
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def refusal(value, limits=LIMITS, field="image_path") -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        decode_input_image(value, field, limits)
    assert caught.value.field == field
    return caught.value


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares `width` x `height` 8-bit gray pixels, with a few KB of compressed
    zero rows: what a decompression bomb's header looks like, at a fraction of its size."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    rows = zlib.compress(b"\x00" * (width + 1) * 16, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


# Every kind of value, one picture, one digest.


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(encoded(), id="png-bytes"),
        pytest.param(bytearray(encoded()), id="png-bytearray"),
        pytest.param(memoryview(encoded()), id="png-memoryview"),
        pytest.param(lossless_webp(), id="webp-lossless"),
        pytest.param("data:image/png;base64," + base64.b64encode(encoded()).decode(), id="data-uri"),
        pytest.param("DATA:image/webp;base64," + base64.b64encode(lossless_webp()).decode(), id="data-uri-webp"),
        pytest.param(base64.b64encode(encoded()).decode(), id="bare-base64"),
        pytest.param(encode_tensor(chw()), id="envelope-uint8"),
        pytest.param(encode_tensor(chw(), binary=False), id="envelope-uint8-json"),
        pytest.param(encode_tensor(chw().float() / 255), id="envelope-fp32"),
        pytest.param(chw(), id="torch-uint8"),
        pytest.param(chw().float() / 255, id="torch-fp32"),
        pytest.param(torch.from_numpy(PIXELS).permute(2, 0, 1), id="torch-not-contiguous"),
        pytest.param(Image.fromarray(PIXELS), id="pil"),
    ],
)
def test_every_kind_of_value_gives_the_same_pixels_and_digest(value):
    image = decode_input_image(value, "image_path", LIMITS)
    assert image.pixels.dtype == torch.uint8 and image.pixels.is_contiguous()
    assert torch.equal(image.pixels, chw())
    assert (image.height, image.width) == PIXELS.shape[:2]
    assert image.digest == InputImage(chw()).digest
    assert np.array_equal(np.asarray(image.to_pil()), PIXELS) and image.to_pil().mode == "RGB"


def test_an_image_keeps_its_pixels_when_the_callers_tensor_changes():
    tensor = chw().clone()
    image = decode_input_image(tensor, "image_path", LIMITS)
    tensor.zero_()
    assert torch.equal(image.pixels, chw()) and image.digest == InputImage(chw()).digest


def test_the_digest_tells_apart_different_pixels_and_the_same_bytes_in_another_shape():
    flat = chw()
    assert InputImage(flat).digest != InputImage(flat.flip(2).contiguous()).digest
    reshaped = flat.reshape(3, PIXELS.shape[1], PIXELS.shape[0]).contiguous()  # same bytes, W x H
    assert InputImage(reshaped).digest != InputImage(flat).digest


def test_a_jpeg_decodes_as_pillow_decodes_it():
    data = encoded(kind="JPEG", quality=90)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(decode_input_image(data, "image_path", LIMITS).to_pil(), expected)


def test_grayscale_is_repeated_into_rgb_the_same_from_a_png_and_a_tensor():
    gray = PIXELS[..., 0]
    from_png = decode_input_image(encoded(gray), "image_path", LIMITS)
    from_tensor = decode_input_image(torch.from_numpy(gray)[None], "image_path", LIMITS)
    assert torch.equal(from_png.pixels, torch.from_numpy(gray).expand(3, -1, -1))
    assert from_png.digest == from_tensor.digest


def test_alpha_is_dropped_as_convert_rgb_drops_it():
    rgba = np.concatenate([PIXELS, RNG.integers(0, 256, (*PIXELS.shape[:2], 1), dtype=np.uint8)], axis=2)
    image = decode_input_image(encoded(rgba), "image_path", LIMITS)
    assert torch.equal(image.pixels, chw())


def test_the_exif_orientation_is_applied_as_diffusers_load_image_applies_it(tmp_path):
    from diffusers.utils import load_image

    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    path = tmp_path / "photo.png"
    Image.fromarray(PIXELS).save(path, exif=exif)
    image = decode_input_image(str(path), "image_path", ImageInputLimits(allowed_roots=(str(tmp_path),)))
    expected = np.asarray(load_image(str(path)))
    assert expected.shape == (PIXELS.shape[1], PIXELS.shape[0], 3)  # the orientation was applied
    assert np.array_equal(np.asarray(image.to_pil()), expected)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.randoms(use_true_random=False))
def test_random_images_round_trip_exactly(height, width, random):
    pixels = np.array(bytearray(random.randbytes(height * width * 3)), dtype=np.uint8).reshape(height, width, 3)
    png = encoded(pixels)
    for value in (png, "data:image/png;base64," + base64.b64encode(png).decode(), encode_tensor(chw(pixels))):
        assert np.array_equal(np.asarray(decode_input_image(value, "image_path", LIMITS).to_pil()), pixels)


# Floats: exact multiples of 1/255 only.


def test_fp32_pixels_are_taken_when_every_value_is_k_over_255_however_computed():
    levels = torch.arange(256, dtype=torch.uint8).reshape(1, 16, 16)
    in_float64 = torch.from_numpy((np.arange(256) / 255).astype(np.float32)).reshape(1, 16, 16)
    for value in (levels.float() / 255, in_float64):
        assert torch.equal(decode_input_image(value, "image_path", LIMITS).pixels, levels.expand(3, -1, -1))


@pytest.mark.parametrize(
    "value, reason", [(0.5, "multiples of 1/255: send uint8"), (1.5, "outside [0, 1]"), (float("nan"), "not finite")]
)
def test_other_fp32_pixels_are_refused(value, reason):
    pixels = torch.zeros(3, 2, 2)
    pixels[0, 0, 0] = value
    assert reason in refusal(encode_tensor(pixels)).reason
    assert reason in refusal(pixels).reason


@pytest.mark.parametrize(
    "tensor, reason",
    [
        (torch.zeros(4, 2, 2, dtype=torch.uint8), "no alpha"),
        (torch.zeros(1, 3, 2, 2, dtype=torch.uint8), "[C, H, W]"),
        (torch.zeros(3, 2, 2, dtype=torch.float16), "torch.float16; send torch.uint8"),
        (torch.zeros(3, 0, 2, dtype=torch.uint8), "empty image"),
        (torch.zeros(3, 5, 5, dtype=torch.uint8), "5x5 = 25 pixels, over max_image_pixels (24)"),
    ],
)
def test_tensors_of_another_shape_or_dtype_are_refused(tensor, reason):
    limits = ImageInputLimits(max_image_pixels=24)
    assert reason in refusal(tensor, limits).reason
    assert reason in refusal(encode_tensor(tensor), limits).reason


def test_an_envelope_is_checked_for_its_declared_shape_and_size_before_its_data_is_read():
    envelope = encode_tensor(torch.zeros(3, 2, 2, dtype=torch.uint8))
    # Data far larger than the declared shape takes: refused by its size, before it is parsed.
    big = {**envelope, "data": envelope["data"] + bytes(10_000)}
    assert "more than its declared shape takes" in refusal(big).reason
    assert "not a valid tensor envelope" in refusal({**envelope, "shape": [3, 1, 4]}).reason
    assert "not a tensor envelope" in refusal({"shape": [3, 2, 2]}).reason


# Encoded files: size, format and declared pixels before decoding.


def test_bytes_over_the_limit_are_refused_without_opening_them(monkeypatch):
    def opened(*args, **kwargs):
        raise AssertionError("Image.open was called")

    monkeypatch.setattr(PIL.Image, "open", opened)
    data = encoded()
    reason = refusal(data, ImageInputLimits(max_image_bytes=len(data) - 1)).reason
    assert f"is {len(data)} bytes, over max_image_bytes ({len(data) - 1})" in reason
    text = base64.b64encode(data).decode()
    assert "over max_image_bytes" in refusal(text, ImageInputLimits(max_image_bytes=len(data) - 1)).reason


@pytest.mark.parametrize("kind", ["GIF", "BMP", "TIFF"])
def test_other_formats_are_refused_by_name(kind):
    data = encoded(kind=kind)
    assert refusal(data).reason == f"is a {kind} image; send PNG, JPEG or WebP"
    assert refusal(base64.b64encode(data).decode()).reason == f"is a {kind} image; send PNG, JPEG or WebP"


def test_text_and_svg_are_not_images():
    assert "is not a PNG, JPEG or WebP file" in refusal(b'<svg xmlns="http://www.w3.org/2000/svg"/>').reason
    assert "data URI of another kind" in refusal("data:image/gif;base64,R0lGODlh").reason
    assert "neither a data URI" in refusal("not an image").reason
    assert "is empty" in refusal("").reason and "is a int" in refusal(7).reason


def test_a_truncated_png_is_refused_not_decoded_in_part():
    data = encoded(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    reason = refusal(data[: len(data) // 2]).reason
    assert "not a readable PNG" in reason
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_no_image_is_decoded_while_pillow_is_told_to_load_truncated_images(monkeypatch):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        decode_input_image(encoded(), "image_path", LIMITS)


def test_an_animation_is_refused():
    buffer = io.BytesIO()
    frames = [Image.fromarray(PIXELS), Image.fromarray(255 - PIXELS)]
    frames[0].save(buffer, "PNG", save_all=True, append_images=frames[1:])
    assert "has 2 frames" in refusal(buffer.getvalue()).reason


@pytest.mark.parametrize(
    "width, height, pillow_limit, reason",
    [
        # Over Pillow's own limit too, which refuses it first.
        (20_000, 20_000, PIL.Image.MAX_IMAGE_PIXELS, "more pixels than Pillow's MAX_IMAGE_PIXELS allows"),
        # Pillow's limit lifted by some other code: this module's still holds.
        (20_000, 20_000, None, "is 20000x20000 = 400000000 pixels, over max_image_pixels (16777216)"),
        # Under Pillow's limit, over max_image_pixels.
        (5_000, 5_000, PIL.Image.MAX_IMAGE_PIXELS, "is 5000x5000 = 25000000 pixels, over max_image_pixels"),
    ],
)
def test_a_decompression_bomb_is_refused_from_its_header(monkeypatch, width, height, pillow_limit, reason):
    def loaded(*args, **kwargs):
        raise AssertionError("the bomb was decoded")

    monkeypatch.setattr(PIL.Image, "MAX_IMAGE_PIXELS", pillow_limit)
    monkeypatch.setattr(ImageFile.ImageFile, "load", loaded)
    bomb = png_declaring(width, height)
    assert len(bomb) < 10_000
    tracemalloc.start()
    start = time.perf_counter()
    try:
        error = refusal(bomb)
        seconds = time.perf_counter() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reason in error.reason
    assert seconds < 0.5 and peak < 50 * 2**20


# File paths and URLs.


def test_a_file_under_an_allowed_root_is_read(tmp_path):
    path = tmp_path / "images" / "cat.png"
    path.parent.mkdir()
    path.write_bytes(encoded())
    limits = ImageInputLimits(allowed_roots=(str(tmp_path / "images"),))
    assert torch.equal(decode_input_image(str(path), "image_path", limits).pixels, chw())
    # No '/' needed when it ends in an image extension (relative to the working directory).
    assert "outside allowed_image_paths" in refusal("cat.png", limits).reason


def test_files_outside_the_allowed_roots_are_refused_without_saying_where_they_resolve(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (outside / "secret.png").write_bytes(encoded())
    (root / "link.png").symlink_to(outside / "secret.png")
    limits = ImageInputLimits(allowed_roots=(str(root),))
    for path in (outside / "secret.png", root / "link.png", root / ".." / "outside" / "secret.png"):
        error = refusal(str(path), limits)
        assert error.reason == "is a file path outside allowed_image_paths"
        assert "secret" not in str(error)
    assert "cannot be read" in refusal(str(root / "missing.png"), limits).reason
    assert "cannot be read" in refusal(str(root), limits).reason  # a directory


def test_file_paths_are_refused_when_no_root_is_configured(tmp_path, monkeypatch):
    path = tmp_path / "cat.png"
    path.write_bytes(encoded())
    monkeypatch.setattr("os.open", lambda *args, **kwargs: pytest.fail("a file was opened"))
    assert "no allowed_image_paths are configured" in refusal(str(path)).reason


def test_a_file_over_the_byte_limit_is_refused_from_its_size(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(encoded())
    limits = ImageInputLimits(max_image_bytes=100, allowed_roots=(str(tmp_path),))
    assert f"is a file of {path.stat().st_size} bytes, over max_image_bytes (100)" in refusal(str(path), limits).reason


@pytest.mark.parametrize(
    "url",
    ["http://example.com/a.png", "https://example.com/a.png", "ftp://host/a", "file:///etc/passwd", "s3://b/x.png"],
)
def test_urls_are_refused_without_being_fetched(url, monkeypatch, tmp_path):
    def no_network(*args, **kwargs):
        raise AssertionError("the network was used")

    monkeypatch.setattr(socket, "socket", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    monkeypatch.setattr("os.open", no_network)
    assert "is a URL; the server fetches no URL" in refusal(url, ImageInputLimits(allowed_roots=("/",))).reason


# The request field: one entry per prompt, counted before anything is decoded.


def test_one_prompt_takes_one_image_or_a_list():
    png = encoded()
    assert input_images_per_prompt(None, 1, False, LIMITS) == () and input_images_per_prompt([], 3, True, LIMITS) == ()
    ((one,),) = input_images_per_prompt(png, 1, False, LIMITS)
    assert torch.equal(one.pixels, chw())
    ((first, second),) = input_images_per_prompt([png, chw()], 1, False, LIMITS)
    assert first.digest == second.digest


def test_a_list_of_prompts_takes_one_entry_per_prompt():
    png, other = encoded(), encoded(255 - PIXELS)
    images = input_images_per_prompt([png, [other, png], png], 3, True, LIMITS)
    assert [len(prompt) for prompt in images] == [1, 2, 1]
    assert images[0][0] is images[2][0] is images[1][1]  # the same file decoded once
    assert images[1][0].digest != images[0][0].digest


@pytest.mark.parametrize(
    "image_path, num_prompts, field, reason",
    [
        ([b"png", b"png"], 3, "image_path", "must be a list of 3 entries, one per prompt"),
        ([b"png", b"png"], 1, "image_path", "must be a list of 1 entries"),  # a list prompt of one is no exception
        (b"png", 1, "image_path", "got one image"),
        ([b"png", [b"png"] * 5], 2, "image_path[1]", "has 5 images; a prompt takes 1 to max_images_per_prompt (4)"),
        ([b"png", []], 2, "image_path[1]", "has 0 images"),
        ([b"png", None], 2, "image_path[1]", "has no image"),
        ([b"png", [b"png", [b"png"]]], 2, "image_path[1][1]", "is a list, where one image is expected"),
        ([b"png", [b"png", "http://example.com/x.png"]], 2, "image_path[1][1]", "is a URL"),
    ],
)
def test_the_field_is_refused_naming_the_entry(image_path, num_prompts, field, reason, monkeypatch):
    png = encoded()

    def real(value):
        return png if value == b"png" else [real(item) for item in value] if isinstance(value, list) else value

    # Nothing is decoded before every entry is counted and checked.
    monkeypatch.setattr(PIL.Image, "open", lambda *args, **kwargs: pytest.fail("an image was decoded"))
    with pytest.raises(InvalidRequestError) as caught:
        input_images_per_prompt(real(image_path), num_prompts, True, LIMITS)
    assert caught.value.field == field and reason in caught.value.reason


def test_one_prompt_with_too_many_images_names_the_limit():
    with pytest.raises(InvalidRequestError) as caught:
        input_images_per_prompt([encoded()] * 3, 1, False, ImageInputLimits(max_images_per_prompt=2))
    assert caught.value.field == "image_path" and "has 3 images" in caught.value.reason


def test_every_entry_is_checked_for_size_before_any_is_decoded(monkeypatch):
    monkeypatch.setattr(PIL.Image, "open", lambda *args, **kwargs: pytest.fail("an image was decoded"))
    small, large = encoded(), encoded(RNG.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    limits = ImageInputLimits(max_image_bytes=len(small))
    with pytest.raises(InvalidRequestError) as caught:
        input_images_per_prompt([small, large], 1, False, limits)
    assert caught.value.field == "image_path[1]" and "over max_image_bytes" in caught.value.reason


def test_refusals_never_echo_the_value():
    secret = base64.b64encode(b"SECRET" * 1000).decode()
    assert "U0VDUkVU" not in str(refusal(secret)) and len(str(refusal(secret))) < 300


def test_limits_are_checked():
    with pytest.raises(ValueError, match="max_images_per_prompt"):
        ImageInputLimits(max_images_per_prompt=0)
    assert ImageInputLimits(allowed_roots=["/data"]).allowed_roots == ("/data",)
    with pytest.raises(ValueError, match="pixels must be"):
        InputImage(torch.zeros(2, 2, 3, dtype=torch.uint8))
