"""The input images of image-conditioned requests (SGLang's `image_path`), decoded under bounds and
confined to the directories an operator allowed.

A request's images are the costliest values a client can send for their size: a PNG of a few KB
can declare 20,000 x 20,000 pixels (1.2 GB decoded), a path can name any file the server can read,
a URL would make the server fetch from anywhere. So every image is first read and checked for what
it costs without decoding it (its bytes against `max_image_bytes`, its format by its signature, its
declared size against `max_image_pixels`), every entry of a request before any is decoded, and only
then decoded in full. The server never fetches a URL, and reads a file only under
`allowed_roots` (the app config's `allowed_image_paths`): none at all unless an operator sets some.

An image is one of:
- `bytes` (msgpack `bin`): a PNG, JPEG or WebP file.
- text, told apart in this order: a `data:image/<png|jpeg|webp>;base64,...` URI; a URL
  (`<scheme>://...`), refused unopened; base64 (strict: no whitespace) of a file whose first bytes
  are an image signature; a file path, if it contains a `/` or ends in an image extension. A
  string that fits none of them is refused. (A path that is also strict base64 of an image
  signature is read as base64: none of a file name's usual dots is base64.)
- a tensor envelope (`rollout.codec`) or, from Python, a `torch.Tensor`: `[C, H, W]`, C 3 (RGB) or
  1 (grayscale, repeated into R, G and B as Pillow's `convert("RGB")` repeats a grayscale PNG's,
  so one picture has one digest however it is sent); uint8, or float32 whose every value is
  exactly k / 255 (see `_uint8_of_float`). Four channels are refused: a tensor has no alpha here.
- from Python, a `PIL.Image.Image`.

Decoded files, and PIL images, go through what `diffusers.utils.load_image` does, so that a
client's file gives the pixels the pipelines' own loading would: `ImageOps.exif_transpose` (the
EXIF orientation is applied), then `convert("RGB")`, which drops an alpha channel without
compositing it over anything. An image of several frames (an animation, a multi-picture JPEG) is
refused rather than cut to its first; a truncated or corrupt file is refused whole, never decoded
in part (see `_decoded_file` on Pillow's `LOAD_TRUNCATED_IMAGES`). Nothing is resized here.

Every refusal is an `InvalidRequestError` naming the entry (`image_path[1][0]`), saying which limit
it breaks and by how much; none echoes the value.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
import math
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFile, ImageOps

from rollout.codec import MAX_ENVELOPE_BYTES, TENSOR_MARKER, decode_tensor
from rollout.errors import CodecError, InvalidRequestError, clip, short_repr

# The formats accepted, by Pillow's name (`_format_of` tells a file's by its signature).
_ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP")
_ACCEPTED = "PNG, JPEG or WebP"
# Formats recognized only to be named in a refusal; SVG and other text shows as "not an image".
_REFUSED_SIGNATURES = {b"GIF87a": "GIF", b"GIF89a": "GIF", b"II*\x00": "TIFF", b"MM\x00*": "TIFF", b"BM": "BMP"}
_IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp")
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
_DATA_URI = re.compile(r"data:image/(?:png|jpeg|jpg|webp);base64,", re.IGNORECASE)
# Linux's PATH_MAX: longer text cannot name a file, so it is base64 and checked for size undecoded.
_MAX_PATH_CHARS = 4096
_TENSOR_DTYPES = {"torch.uint8": torch.uint8, "torch.float32": torch.float32}
_KINDS = "a data URI, base64 text, a file path, PNG/JPEG/WebP bytes or a tensor envelope"


@dataclass(frozen=True)
class ImageInputLimits:
    """What one request's input images may cost.

    Attributes:
        max_image_bytes: the most bytes of one encoded image (a file, or base64's decoded bytes).
        max_image_pixels: the most pixels (H * W) of one image, checked against the size its
            header declares before it is decoded.
        max_images_per_prompt: the most images one prompt is conditioned on.
        allowed_roots: the directories a file path may name a file under, symlinks resolved.
            Empty: file paths are refused. Unlike a weight checkpoint (named by the trainer), an
            image path comes from any client, so none is read unless an operator chose where.
    """

    max_image_bytes: int = 32 * 2**20
    max_image_pixels: int = 4096 * 4096
    max_images_per_prompt: int = 4
    allowed_roots: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("max_image_bytes", "max_image_pixels", "max_images_per_prompt"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {short_repr(value)}")
        roots = tuple(self.allowed_roots)
        if not all(isinstance(root, str) and root for root in roots):
            raise ValueError(f"allowed_roots must be non-empty directory names, got {short_repr(roots)}")
        object.__setattr__(self, "allowed_roots", roots)  # a list from a config, frozen


@dataclass(frozen=True, eq=False)
class InputImage:
    """One decoded input image: RGB pixels as the client sent them (no resizing here), with a file's
    EXIF orientation applied, as `diffusers.utils.load_image` applies it.

    Attributes:
        pixels: `(3, H, W)` uint8, contiguous, on the CPU.
        digest: sha256 (hex) of the height, the width and the pixel bytes, computed here: equal
            pixels, equal digest, whatever format they came in (to cache a prompt's encodings).
    """

    pixels: torch.Tensor
    digest: str = dataclasses.field(init=False)

    def __post_init__(self):
        pixels = self.pixels
        if (
            pixels.dtype != torch.uint8
            or pixels.ndim != 3
            or pixels.shape[0] != 3
            or pixels.device.type != "cpu"
            or not pixels.is_contiguous()
        ):
            raise ValueError(
                f"pixels must be a contiguous CPU uint8 tensor of shape (3, H, W), got {pixels.dtype} "
                f"{tuple(pixels.shape)} on {pixels.device}"
            )
        digest = hashlib.sha256(struct.pack("<QQ", self.height, self.width))
        digest.update(pixels.numpy())
        object.__setattr__(self, "digest", digest.hexdigest())

    @property
    def height(self) -> int:
        return self.pixels.shape[1]

    @property
    def width(self) -> int:
        return self.pixels.shape[2]

    def to_pil(self) -> Image.Image:
        """The image as an RGB PIL image (a copy: changing it leaves `pixels` as they are)."""
        return Image.fromarray(np.ascontiguousarray(self.pixels.permute(1, 2, 0).numpy()))


def decode_input_image(value: Any, field: str, limits: ImageInputLimits) -> InputImage:
    """One input image (any of the module docstring's kinds), checked against `limits` and decoded.

    Raises `InvalidRequestError` naming `field` for anything refused.
    """
    return _decoded(_read(value, field, limits), field, limits)


def input_images_per_prompt(
    image_path: Any, num_prompts: int, prompt_is_list: bool, limits: ImageInputLimits
) -> tuple[tuple[InputImage, ...], ...]:
    """A request's `image_path` as the images of each of its prompts; `()` when it has none.

    As SGLang shapes the field: when the request's `prompt` is one string, `image_path` is one
    image or a list of images, all for that prompt. When `prompt` is a list, `image_path` is a list
    of one entry per prompt, each one image or a list of images, even for a list of one prompt:
    `[a, b]` for a list of one prompt would be ambiguous (two images, or two entries), so it is a
    count mismatch. `None` and `[]` are no images; otherwise every prompt takes 1 to
    `limits.max_images_per_prompt`.

    Every entry's count, kind and size is checked (file paths resolved, files and base64 read)
    before any image is decoded, so a refusal costs at most reading the request's bytes. Identical
    encoded images within the call are decoded once and share one `InputImage`.
    """
    if image_path is None or (isinstance(image_path, (list, tuple)) and not image_path):
        return ()
    if not prompt_is_list and num_prompts != 1:
        raise ValueError(f"one prompt (prompt_is_list=False) but num_prompts={num_prompts}")
    if not prompt_is_list:
        entries = [("image_path", image_path)]
    elif not isinstance(image_path, (list, tuple)) or len(image_path) != num_prompts:
        given = f"a list of {len(image_path)}" if isinstance(image_path, (list, tuple)) else "one image"
        raise InvalidRequestError(
            "image_path",
            f"the prompt is a list of {num_prompts}, so image_path must be a list of {num_prompts} entries, one per "
            f"prompt (an image or a list of images); got {given}",
        )
    else:
        entries = [(f"image_path[{i}]", entry) for i, entry in enumerate(image_path)]
    # 1. Counts, then every image read and checked undecoded.
    listed = [_listed_images(name, entry, limits) for name, entry in entries]
    read = [[(name, _read(value, name, limits)) for name, value in images] for images in listed]
    # 2. Decoding, each distinct file once (a group of prompts often shares its image).
    decoded: dict[bytes, InputImage] = {}

    def image(name: str, source: bytes | torch.Tensor | Image.Image) -> InputImage:
        if not isinstance(source, bytes):
            return _decoded(source, name, limits)
        if source not in decoded:
            decoded[source] = _decoded(source, name, limits)
        return decoded[source]

    return tuple(tuple(image(name, source) for name, source in images) for images in read)


def _listed_images(name: str, entry: Any, limits: ImageInputLimits) -> list[tuple[str, Any]]:
    """One prompt's images, each with its name in refusals, counted against the limit."""
    if entry is None:
        raise InvalidRequestError(name, f"has no image; every prompt takes 1 to {limits.max_images_per_prompt}")
    if not isinstance(entry, (list, tuple)):
        return [(name, entry)]
    if not 1 <= len(entry) <= limits.max_images_per_prompt:
        raise InvalidRequestError(
            name, f"has {len(entry)} images; a prompt takes 1 to max_images_per_prompt ({limits.max_images_per_prompt})"
        )
    return [(f"{name}[{j}]", value) for j, value in enumerate(entry)]


# Reading: what a value costs, checked without decoding any pixels.


def _read(value: Any, name: str, limits: ImageInputLimits) -> bytes | torch.Tensor | Image.Image:
    """`value` checked for its kind and size and read: an encoded file's bytes, an image tensor,
    or a PIL image; nothing is decoded."""
    if isinstance(value, str):
        return _read_text(value, name, limits)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _checked_file_bytes(value, name, limits)
    if isinstance(value, dict):
        return _read_envelope(value, name, limits)
    if isinstance(value, torch.Tensor):
        _check_tensor_kind(tuple(value.shape), value.dtype, name, limits)
        return value.detach().to("cpu", copy=True)  # the caller's tensor may change after; the image may not
    if isinstance(value, Image.Image):
        _check_size(value.width, value.height, name, limits)
        _check_single_frame(value, name)
        return value
    if isinstance(value, (list, tuple)):
        raise InvalidRequestError(name, "is a list, where one image is expected")
    raise InvalidRequestError(name, f"is a {type(value).__name__}; an image is {_KINDS}")


def _read_text(text: str, name: str, limits: ImageInputLimits) -> bytes:
    """The file bytes that `text` carries or names (the rule of the module docstring)."""
    if not text:
        raise InvalidRequestError(name, f"is empty; an image is {_KINDS}")
    if text[:5].lower() == "data:":
        prefix = _DATA_URI.match(text)
        if prefix is None:
            raise InvalidRequestError(name, "is a data URI of another kind; send data:image/<png|jpeg|webp>;base64,...")
        return _checked_file_bytes(_base64_bytes(text[prefix.end() :], name, limits), name, limits)
    if _URL.match(text):
        raise InvalidRequestError(name, "is a URL; the server fetches no URL: send the image inline (base64 or bytes)")
    if len(text) > _MAX_PATH_CHARS:
        return _checked_file_bytes(_base64_bytes(text, name, limits), name, limits)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):  # not base64, or not ASCII
        data = b""
    if _format_of(data) is not None:
        return _checked_file_bytes(data, name, limits)
    if "/" in text or text.lower().endswith(_IMAGE_EXTENSIONS):
        return _read_file(text, name, limits)
    raise InvalidRequestError(
        name,
        f"is neither a data URI, base64 of a {_ACCEPTED} file, nor a file path (one with a '/' or an image extension)",
    )


def _base64_bytes(text: str, name: str, limits: ImageInputLimits) -> bytes:
    if len(text) > _base64_chars(limits.max_image_bytes):
        raise InvalidRequestError(
            name, f"is about {len(text) * 3 // 4} bytes of base64, over max_image_bytes ({limits.max_image_bytes})"
        )
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(name, "is not valid base64 (strict: no whitespace or line breaks)") from None


def _base64_chars(num_bytes: int) -> int:
    """The length of `num_bytes` bytes in base64."""
    return 4 * -(-num_bytes // 3)


def _format_of(data: bytes) -> str | None:
    """Pillow's name of the format whose signature starts `data` (accepted or not), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if data.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return next((kind for signature, kind in _REFUSED_SIGNATURES.items() if data.startswith(signature)), None)


def _checked_file_bytes(data: bytes | bytearray | memoryview, name: str, limits: ImageInputLimits) -> bytes:
    """`data`, if it is an encoded image of an accepted format within `max_image_bytes`."""
    size = memoryview(data).nbytes
    if size > limits.max_image_bytes:
        raise InvalidRequestError(name, f"is {size} bytes, over max_image_bytes ({limits.max_image_bytes})")
    kind = _format_of(bytes(memoryview(data)[:12]))
    if kind is None:
        raise InvalidRequestError(name, f"is not a {_ACCEPTED} file (its first bytes are no such signature)")
    if kind not in _ACCEPTED_FORMATS:
        raise InvalidRequestError(name, f"is a {kind} image; send {_ACCEPTED}")
    return bytes(data)


def _read_file(given: str, name: str, limits: ImageInputLimits) -> bytes:
    """The bytes of the file `given` names, if it resolves under `allowed_roots`.

    Resolved once (symlinks followed, as `rollout.checkpoints` resolves a checkpoint) and opened by
    its resolved path without following a symlink, so a symlink swapped in meanwhile fails; and
    without blocking, so a FIFO is refused rather than waited on. No refusal names the resolved path.
    """
    if not limits.allowed_roots:
        raise InvalidRequestError(
            name, "is a file path, and no allowed_image_paths are configured: send the image inline (base64 or bytes)"
        )
    try:
        path = Path(given).expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long, a NUL byte
        raise InvalidRequestError(name, "is a file path that cannot be resolved") from None
    roots = [Path(root).expanduser().resolve() for root in limits.allowed_roots]
    if not any(path.is_relative_to(root) for root in roots):
        raise InvalidRequestError(name, "is a file path outside allowed_image_paths")
    unreadable = InvalidRequestError(
        name, "is a file path that cannot be read (missing, unreadable or not a regular file)"
    )
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        raise unreadable from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise unreadable
        if info.st_size > limits.max_image_bytes:
            raise InvalidRequestError(
                name, f"is a file of {info.st_size} bytes, over max_image_bytes ({limits.max_image_bytes})"
            )
        # Read to one byte past the limit: the file may have grown since it was examined.
        chunks, left = [], limits.max_image_bytes + 1
        while left and (chunk := os.read(fd, left)):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError:
        raise unreadable from None
    finally:
        os.close(fd)
    return _checked_file_bytes(b"".join(chunks), name, limits)


def _read_envelope(envelope: dict, name: str, limits: ImageInputLimits) -> torch.Tensor:
    """The tensor of an envelope whose declared shape, dtype and size are checked before its data
    is read, so that its one copy (`rollout.codec.decode_tensor`) is of a size the limits allow."""
    if envelope.get(TENSOR_MARKER) is not True:
        raise InvalidRequestError(
            name, f"is a map but not a tensor envelope ({TENSOR_MARKER!r}: true); an image is {_KINDS}"
        )
    shape, declared = envelope.get("shape"), envelope.get("dtype")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise InvalidRequestError(name, f"is a tensor envelope with shape {short_repr(shape)}; a shape is [C, H, W]")
    dtype = _TENSOR_DTYPES.get(declared) if isinstance(declared, str) else None
    if dtype is None:
        shown = clip(declared, 40) if isinstance(declared, str) else short_repr(declared)
        raise InvalidRequestError(name, f"is a tensor envelope of dtype {shown}; send torch.uint8 (or torch.float32)")
    _check_tensor_kind(tuple(shape), dtype, name, limits)
    data = envelope.get("data")
    most = math.prod(shape) * dtype.itemsize + MAX_ENVELOPE_BYTES
    size = len(data) * 3 // 4 if isinstance(data, str) else len(data) if isinstance(data, (bytes, bytearray)) else 0
    if size > most:
        raise InvalidRequestError(
            name, f"is a tensor envelope of {size} bytes, more than its declared shape takes ({most} at most)"
        )
    try:
        return decode_tensor(envelope)
    except CodecError as error:
        raise InvalidRequestError(name, f"is not a valid tensor envelope: {error}") from None


def _check_tensor_kind(shape: tuple[int, ...], dtype: torch.dtype, name: str, limits: ImageInputLimits) -> None:
    if len(shape) != 3 or shape[0] not in (1, 3):
        alpha = " (no alpha: send RGB)" if len(shape) == 3 and shape[0] == 4 else ""
        raise InvalidRequestError(
            name, f"is a tensor of shape {list(shape)}{alpha}; an image tensor is [C, H, W], C 3 (RGB) or 1 (grayscale)"
        )
    if dtype not in (torch.uint8, torch.float32):
        raise InvalidRequestError(name, f"is a tensor of dtype {dtype}; send torch.uint8 (or torch.float32)")
    _check_size(shape[2], shape[1], name, limits)


def _check_size(width: int, height: int, name: str, limits: ImageInputLimits) -> None:
    if width < 1 or height < 1:
        raise InvalidRequestError(name, f"is an empty image ({width}x{height})")
    if width * height > limits.max_image_pixels:
        raise InvalidRequestError(
            name, f"is {width}x{height} = {width * height} pixels, over max_image_pixels ({limits.max_image_pixels})"
        )


def _check_single_frame(image: Image.Image, name: str) -> None:
    frames = getattr(image, "n_frames", 1)
    if frames != 1:
        raise InvalidRequestError(name, f"has {frames} frames (an animation or a multi-picture file); send one image")


# Decoding: the pixels, once everything is checked.


def _decoded(source: bytes | torch.Tensor | Image.Image, name: str, limits: ImageInputLimits) -> InputImage:
    if isinstance(source, bytes):
        return _decoded_file(source, name, limits)
    if isinstance(source, Image.Image):
        return InputImage(_rgb_pixels(source, name))
    pixels = source if source.dtype == torch.uint8 else _uint8_of_float(source, name)
    return InputImage(pixels.expand(3, -1, -1).contiguous())  # grayscale repeated, as convert("RGB") does


def _decoded_file(data: bytes, name: str, limits: ImageInputLimits) -> InputImage:
    """The pixels of a checked PNG, JPEG or WebP file; its declared size is checked before decoding.

    Pillow checks the size too, against its process-wide `Image.MAX_IMAGE_PIXELS` (which other code
    may raise or unset), so this module checks its own limit whatever that is. Pillow warns, once
    per process by Python's default filter, of an image over its limit before this refuses it; the
    warning is let be, since silencing it would change the warning filters of every thread.
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # Process-wide, and read by Pillow's decoders: set, a truncated file decodes as a partial
        # image, padded with gray, and nothing tells. Serving none beats serving that.
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is set in this process: input images are not decoded")
    kind = _format_of(data[:12])
    try:
        image = Image.open(io.BytesIO(data), formats=(kind,))
    except Image.DecompressionBombError:
        raise InvalidRequestError(
            name,
            f"declares more pixels than Pillow's MAX_IMAGE_PIXELS allows (max_image_pixels: {limits.max_image_pixels})",
        ) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as error:
        raise InvalidRequestError(name, f"is not a readable {kind} file: {clip(str(error))}") from None
    with image:
        _check_size(image.width, image.height, name, limits)
        _check_single_frame(image, name)
        return InputImage(_rgb_pixels(image, name, kind))


def _rgb_pixels(image: Image.Image, name: str, kind: str = "PIL") -> torch.Tensor:
    """`(3, H, W)` uint8 pixels, as `diffusers.utils.load_image` makes them: the EXIF orientation
    applied, then `convert("RGB")` (alpha dropped, not composited)."""
    try:
        image.load()  # a truncated or corrupt file fails here, before anything is converted
        rgb = ImageOps.exif_transpose(image).convert("RGB")
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, Image.DecompressionBombError) as error:
        raise InvalidRequestError(
            name, f"is not a readable {kind} image (truncated or corrupt): {clip(str(error))}"
        ) from None
    return torch.from_numpy(np.array(rgb)).permute(2, 0, 1).contiguous()  # (H, W, 3) -> (3, H, W)


def _uint8_of_float(pixels: torch.Tensor, name: str) -> torch.Tensor:
    """float32 pixels that are exactly k / 255 (as fp32 `uint8 / 255` makes them) as the uint8 k.

    Only those: the pipelines' image processors read 8-bit images, and one representation keeps
    the digest and the record of what a sample was conditioned on exact. A float that is no
    multiple of 1/255 could only be rounded, so the client is told to send uint8 instead.
    """
    if not bool(((pixels >= 0) & (pixels <= 1)).all()):  # NaN fails both comparisons
        raise InvalidRequestError(name, "has fp32 pixels outside [0, 1] (or not finite); send uint8")
    levels = (pixels * 255).round()
    if not torch.equal(levels / 255, pixels):
        raise InvalidRequestError(name, "has fp32 pixels that are not multiples of 1/255: send uint8")
    return levels.to(torch.uint8)

