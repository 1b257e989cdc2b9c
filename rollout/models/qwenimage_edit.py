"""Qwen-Image-Edit (`QwenImageEditPipeline`) and Qwen-Image-Edit-2509/2511
(`QwenImageEditPlusPipeline`, several input images), both model `qwenimage_edit`: Qwen-Image
(`rollout.models.qwenimage`) that edits the prompt's input images.

What the pipelines compute, and this family with them:
- Each input image is resized (a plain stretch, `VaeImageProcessor.resize`) to about 1 megapixel
  at its aspect ratio, sides rounded to multiples of 32 (`calculate_dimensions(1024 * 1024, w / h)`),
  whatever the output size; the VAE encodes it (its mode: no noise drawn), normalised with the
  VAE's per-channel `latents_mean` and `latents_std`, packed into 2x2 tokens. Its tokens follow the
  noise tokens (several images: in their order), and the transformer's outputs for them are dropped.
- The text encoder (Qwen2.5-VL) reads the prompt with the image: the chat template puts
  `<|vision_start|><|image_pad|><|vision_end|>` before the prompt (Plus: one "Picture i: " entry
  per image), the VL processor expands it to the image's vision tokens, and the hidden states after
  the 64-token system prefix are the text input, the image's vision tokens included. Edit shows the
  encoder the 1 MP image; Plus shows it each image resized to about 384 x 384.
- `img_shapes` lists the noise's token grid and then each condition's, `[(1, H/16, W/16), (1, h/16,
  w/16), ...]`: the transformer's rotary positions give each image a frame index, and a
  transformer with `zero_cond_t` (Qwen-Image-Edit-2511) reads from it which tokens are condition
  tokens and gives them the time 0, so such a model is served exactly too.
- The schedule's shift reads the noise tokens alone; true CFG (`true_cfg_scale` > 1) encodes the
  negative prompt with the same images and rescales the guided velocity as Qwen-Image's does.

Where this differs on purpose:
- As for Qwen-Image, each prompt (with its images) is encoded alone and padded with a mask to its
  own length bucket: the pipeline pads a batch to its longest prompt and drops an all-ones mask,
  so a padded prompt's samples differ from the pipeline's by ULPs (at most 1e-5 on the tiny copy).
- The request's height and width are the output size (the pipeline's default is the condition's).
- The pipeline's `__call__` needs an image; here a prompt may come without one (as the start-up
  probes send one): it is encoded as `QwenImageEditPlusPipeline` encodes a prompt without images
  (Edit's template without its image placeholder) and runs without condition tokens. An
  image whose aspect ratio makes a condition side 0 or over 200 times the other is refused (the VL
  processor fails there).
- The pipeline never truncates the text; here a prompt whose text (vision tokens included) is
  longer than `max_sequence_length` (default 1024, the pipeline's `tokenizer_max_length`) is
  refused, which bounds the text's memory and its rotary positions.
- The condition latents are kept unpacked, one `(1, C, h/8, w/8)` tensor an image
  (`condition_latents_1`, ...): their shapes say the condition's size, so rows whose conditions
  differ in size never share a transformer call (which takes one `img_shapes` for all its rows).

The VL processor (`Qwen2VLProcessor`) cannot be built without torchvision (its video processor
needs it); where torchvision is missing, the family builds it from the directory's `processor/`
tokenizer and image processor config without a video processor (`ImageOnlyQwen2VLProcessor`), which
processes images as the full one does.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions
from transformers import Qwen2VLProcessor

from rollout.conditioning import Conditioning
from rollout.errors import InvalidRequestError
from rollout.models.base import ConditionImageRule
from rollout.models.qwenimage import QwenImageFamily
from rollout.options import SamplingOptions

if TYPE_CHECKING:
    from rollout.input_images import InputImage

CONDITION_AREA = 1024 * 1024  # the pipelines' VAE_IMAGE_SIZE: every condition's area in pixels
PLUS_TEXT_IMAGE_AREA = 384 * 384  # QwenImageEditPlusPipeline's CONDITION_IMAGE_SIZE: what its text encoder sees
MOST_ASPECT_RATIO = 200  # Qwen2-VL's image processor refuses images more elongated (its `smart_resize`)
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"  # Edit's template's one image
CONDITION_KEY = "condition_latents_"  # image i's latents: f"{CONDITION_KEY}{i}", i from 1


def resized_size(image: InputImage, area: int) -> tuple[int, int]:
    """`(height, width)` the pipelines resize `image` to for a target `area`: its aspect ratio,
    sides rounded to multiples of 32 (`calculate_dimensions`). Raises `InvalidRequestError` naming
    ``image_path`` where a side comes to 0 or the sides' ratio exceeds Qwen2-VL's 200 (the
    pipeline fails there)."""
    _, height, width = image.pixels.shape
    width, height = calculate_dimensions(area, width / height)[:2]
    if min(width, height) == 0 or max(width, height) > MOST_ASPECT_RATIO * min(width, height):
        raise InvalidRequestError(
            "image_path",
            f"an input image of {image.pixels.shape[2]}x{image.pixels.shape[1]} pixels resizes to "
            f"{width}x{height} at {area} pixels: its aspect ratio is too far from 1 (at most {MOST_ASPECT_RATIO})",
        )
    return height, width


def most_condition_tokens(area: int) -> int:
    """A bound on the 2x2 tokens (16 px a side) of a condition resized to `area` at any aspect
    ratio `resized_size` accepts. Rounding the sides can exceed `area / 256`: a shorter side that
    rounds to `short` was at least `short - 16` pixels, so the longer was at most
    `area / (short - 16)` before its own rounding, and at most 200 times `short`."""
    most = 0
    for short in range(32, math.isqrt(area) + 64, 32):
        longest = min(round(area / (short - 16) / 32) * 32, MOST_ASPECT_RATIO * short)
        most = max(most, (short // 16) * (longest // 16))
    return most


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """`Qwen2VLProcessor` without a video processor: constructible without torchvision, and
    processing text and images as the full processor does."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def image_only_processor(directory: Path) -> ImageOnlyQwen2VLProcessor:
    """The VL processor of a saved processor folder (tokenizer files and the image processor's
    config: `preprocessor_config.json` or `processor_config.json`), without its video processor."""
    from transformers import AutoTokenizer, Qwen2VLImageProcessor

    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    image_processor = Qwen2VLImageProcessor.from_pretrained(directory, local_files_only=True)
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer)


class QwenImageEditFamily(QwenImageFamily):
    name = "qwenimage_edit"
    diffusers_pipeline = "QwenImageEditPipeline"
    # Qwen-Image-Edit-2509 and later: up to 3 images a prompt (the published models' tested count),
    # each encoded by the VAE at about 1 megapixel while the text encoder reads each at about
    # 384 x 384 pixels, named "Picture i: " in the prompt.
    also_serves = ("QwenImageEditPlusPipeline",)
    default_max_sequence_length = 1024  # the pipeline's `tokenizer_max_length` (it truncates nothing)
    text_sees_images = True
    condition_images = ConditionImageRule(
        most_per_prompt=1,
        preprocessing="stretched to about 1 megapixel at its aspect ratio, sides multiples of 32 "
        "(the pipeline's calculate_dimensions); the text encoder reads it too",
        most_tokens_per_image=most_condition_tokens(CONDITION_AREA),
    )

    plus_condition_images = ConditionImageRule(
        most_per_prompt=3,
        preprocessing="each stretched to about 1 megapixel at its aspect ratio, sides multiples of 32, for the "
        "VAE, and to about 384x384 for the text encoder (the pipeline's calculate_dimensions)",
        most_tokens_per_image=most_condition_tokens(CONDITION_AREA),
    )

    def __init__(self, pipe: Any, *args, **kwargs):
        super().__init__(pipe, *args, **kwargs)
        self.plus = type(pipe).__name__ == "QwenImageEditPlusPipeline"
        # The text encoder sees the condition itself (Edit), or a copy of each image at 384x384 area (Plus).
        self.text_image_area: int | None = PLUS_TEXT_IMAGE_AREA if self.plus else None
        if self.plus:
            self.condition_images = self.plus_condition_images

    @classmethod
    def loaded_components(cls, path: Path) -> dict[str, Any]:
        if importlib.util.find_spec("torchvision") is not None:
            return {}  # the pipeline loads its own Qwen2VLProcessor
        return {"processor": image_only_processor(path / "processor")}

    def condition_size(self, image: InputImage) -> tuple[int, int]:
        """`(height, width)` the pipeline resizes `image` to before the VAE encodes it."""
        return resized_size(image, CONDITION_AREA)

    def text_images(self, images: tuple[InputImage, ...]) -> list:
        """The PIL images the text encoder reads with the prompt, resized as the pipeline resizes them."""
        resize = self.pipe.image_processor.resize
        sizes = [
            self.condition_size(i) if self.text_image_area is None else resized_size(i, self.text_image_area)
            for i in images
        ]
        return [resize(image.to_pil(), height, width) for image, (height, width) in zip(images, sizes)]

    def encode_prompt_seeing(
        self, prompt: str, images: tuple[InputImage, ...], options: SamplingOptions
    ) -> dict[str, torch.Tensor]:
        if images:
            text_images = self.text_images(images)
            # Edit's template holds one image and is given it alone; Plus is given a list, as the pipelines give them.
            image = text_images if self.plus else text_images[0]
            embeds, mask = self.pipe.encode_prompt(prompt=[prompt], image=image, device=self.device)
        else:
            embeds, mask = self.text_without_images(prompt)
        if embeds.shape[1] > self.max_sequence_length:
            raise InvalidRequestError(
                "prompt",
                f"the prompt with its images encodes to {embeds.shape[1]} tokens, more than "
                f"max_sequence_length {self.max_sequence_length}",
            )
        return self.padded_text(embeds, mask, options)

    def text_without_images(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A prompt's hidden states and mask without an image, as `QwenImageEditPlusPipeline` encodes
        one: Edit's template without its image placeholder (the VL processor refuses a placeholder
        with no image), which is Plus's template, read by the pipeline's own `_get_qwen_prompt_embeds`."""
        pipe = self.pipe
        template = pipe.prompt_template_encode.replace(IMAGE_PLACEHOLDER, "")
        view = SimpleNamespace(
            prompt_template_encode=template,
            prompt_template_encode_start_idx=pipe.prompt_template_encode_start_idx,
            processor=pipe.processor,
            text_encoder=pipe.text_encoder,
            _extract_masked_hidden=pipe._extract_masked_hidden,
        )
        return type(pipe)._get_qwen_prompt_embeds(view, [prompt], None, self.device)

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        raise NotImplementedError(f"model {self.name!r} encodes a prompt with its images (encode_prompt_seeing)")

    def text_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        # `max_sequence_length` tokens of the text encoder's hidden states, and their int64 mask.
        encoder = self.pipe.text_encoder
        width = encoder.config.text_config.hidden_size
        return (self.max_sequence_length * width * encoder.dtype.itemsize, self.max_sequence_length * 8)

    def encode_images(self, images: tuple[InputImage, ...], options: SamplingOptions) -> dict[str, torch.Tensor]:
        encoded = {}
        processor = self.pipe.image_processor
        for i, image in enumerate(images, start=1):
            height, width = self.condition_size(image)
            pixels = processor.preprocess(processor.resize(image.to_pil(), height, width), height, width)
            # (1, 3, frames=1, h, w) for the video VAE; its mode, normalised as the pipeline does.
            latents = self.pipe._encode_vae_image(pixels.unsqueeze(2).to(self.device, self.dtype), generator=None)
            encoded[f"{CONDITION_KEY}{i}"] = latents[:, :, 0]
        return encoded

    def condition_latents(self, conditioning: Conditioning) -> list[torch.Tensor]:
        """The rows' condition latents `(B, C, h, w)`, image by image."""
        kwargs = conditioning.image_kwargs or {}
        count = sum(name.startswith(CONDITION_KEY) for name in kwargs)
        return [kwargs[f"{CONDITION_KEY}{i}"] for i in range(1, count + 1)]

    def condition_tokens(self, conditioning: Conditioning) -> torch.Tensor | None:
        latents = self.condition_latents(conditioning)
        if not latents:
            return None
        return torch.cat([self.pack(image) for image in latents], dim=1)

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        # Each image at its most tokens: 4 latent pixels of `latent_channels` a token, in the model's dtype.
        rule = self.condition_images
        image = rule.most_tokens_per_image * 4 * self.latent_channels * self.dtype.itemsize
        return (*super().conditioning_bytes(options), *(image,) * rule.most_per_prompt)

    def transformer_inputs(self, conditioning: Conditioning):
        inputs = super().transformer_inputs(conditioning)
        # Rows of one bucket have conditions of one size (their latents' shapes): one grid for all.
        conditions = [(1, latents.shape[-2] // 2, latents.shape[-1] // 2) for latents in self.condition_latents(conditioning)]

        def with_conditions(branch: dict[str, torch.Tensor]) -> dict:
            given = inputs(branch)
            return {**given, "img_shapes": [[*shapes, *conditions] for shapes in given["img_shapes"]]}

        return with_conditions
