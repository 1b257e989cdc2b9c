"""The embedded default model: a tiny class-conditional rectified-flow transformer for digits.

It is trained here (``training/train_digit_flow.py``) on the 8x8 handwritten digits that
scikit-learn ships, upsampled to 16x16, and its weights ship inside the package, so the whole
system runs on a laptop with no download. The denoiser is a diffusers `SD3Transformer2DModel`
with 1-channel pixel-space "latents" in [-1, 1]; the "text encoder" is a learned embedding per
digit plus one for the empty (unconditional) prompt, used for classifier-free guidance.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from rollout.conditioning import BucketedConditioning, Conditioning
from rollout.errors import InvalidRequestError, UnknownPromptError, short_repr
from rollout.kernels import AttentionBackend
from rollout.micro_batching import MicroBatching
from rollout.models.base import (
    ConditionImageRule,
    ImageSizeLimits,
    NegativeBranchRule,
    batched_cfg_velocity,
    cfg_scale,
    check_image_frames,
    check_single_denoiser,
)
from rollout.models.choice import EMBEDDED_MODEL
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot, timesteps_as_they_are

# Imported where a model is built: the ingress and the CLI import this module for its name and
# weights path alone, and diffusers was about half of the ingress's 10 s of imports.
if TYPE_CHECKING:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from rollout.input_images import InputImage
    from rollout.transitions import HeldFrames

DEFAULT_WEIGHTS = Path(__file__).parent / "weights" / "digit-flow"
IMAGE_SIZE = 16
PATCH_SIZE = 2  # latent pixels a side of one transformer token; the latents are the image's pixels
NUM_DIGITS = 10
UNCONDITIONAL_CLASS = NUM_DIGITS  # the empty prompt

_DIGIT_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
_PROMPT_PATTERN = re.compile(
    r"^(?:(?:a|an|the)\s+)?(?:handwritten\s+)?(?:digit\s+)?(?P<digit>[0-9]|" + "|".join(_DIGIT_WORDS) + r")$"
)


def parse_digit_prompt(prompt: str, field: str = "prompt") -> int:
    """Class index of a prompt: ``"7"``, ``"seven"``, ``"a handwritten 7"``, ``"the digit 7"``.

    The empty prompt means "no condition" and maps to `UNCONDITIONAL_CLASS`.
    """
    if not isinstance(prompt, str):
        raise UnknownPromptError(field, f"expected a string, got {type(prompt).__name__}")
    text = " ".join(prompt.lower().split())
    if text == "":
        return UNCONDITIONAL_CLASS
    match = _PROMPT_PATTERN.match(text)
    if match is None:
        raise UnknownPromptError(
            field,
            f"the embedded digits model does not know the prompt {short_repr(prompt)}; "
            "use a digit such as '7', 'seven' or 'a handwritten 7'",
        )
    digit = match.group("digit")
    return int(digit) if digit.isdigit() else _DIGIT_WORDS.index(digit)


def digit_prompt(digit: int) -> str:
    return f"a handwritten {digit}"


class DigitPromptEncoder(nn.Module):
    """Maps a class index to SD3-style conditioning: a short token sequence and a pooled vector."""

    def __init__(self, num_tokens: int = 2, token_dim: int = 32, pooled_dim: int = 32):
        super().__init__()
        self.num_tokens = num_tokens
        self.token_dim = token_dim
        self.tokens = nn.Embedding(NUM_DIGITS + 1, num_tokens * token_dim)
        self.pooled = nn.Embedding(NUM_DIGITS + 1, pooled_dim)

    def forward(self, class_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `prompt_embeds` `(B, num_tokens, token_dim)` and `pooled_prompt_embeds` `(B, pooled_dim)`."""
        prompt_embeds = self.tokens(class_ids).view(-1, self.num_tokens, self.token_dim)
        return prompt_embeds, self.pooled(class_ids)


def tiny_transformer(prompt_encoder: DigitPromptEncoder) -> SD3Transformer2DModel:
    """The denoiser's architecture (about 0.6M parameters: 64 tokens of a 16x16 image, patch 2)."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
        in_channels=1,
        out_channels=1,
        num_layers=4,
        attention_head_dim=32,
        num_attention_heads=2,
        joint_attention_dim=prompt_encoder.token_dim,
        caption_projection_dim=64,
        pooled_projection_dim=prompt_encoder.pooled.embedding_dim,
        pos_embed_max_size=IMAGE_SIZE // PATCH_SIZE,
    )


def _cast_state_dict(module: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", dtype).contiguous() for k, v in module.state_dict().items()}


def images_to_latents(images: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] to the model's latent space, [-1, 1]."""
    return images * 2 - 1


class DigitFlowPipeline:
    """`RolloutPipeline` for the embedded digits model."""

    name = EMBEDDED_MODEL
    batches_guidance_branches = True
    negative_branch = NegativeBranchRule("cfg_scale", also_below_one=True)
    token_pixels = PATCH_SIZE
    frames_per_latent = 1
    condition_images = ConditionImageRule()  # text (a digit) only
    attention = AttentionBackend.DEFAULT  # `load_pipeline` pins the configured one
    # Its bits at its fixed micro-batch are the project's reference (tests/reference_digests.json).
    calibrated_at_start = False

    def __init__(
        self,
        transformer: SD3Transformer2DModel,
        prompt_encoder: DigitPromptEncoder,
        scheduler: FlowMatchEulerDiscreteScheduler,
        default_guidance_scale: float = 2.0,
        micro_batch_size: int = 16,
    ):
        self.transformer = transformer.eval().requires_grad_(False)
        self.prompt_encoder = prompt_encoder.eval().requires_grad_(False)
        self.scheduler = scheduler
        self.default_guidance_scale = default_guidance_scale
        self.micro_batching = MicroBatching(micro_batch_size)
        self.default_height = IMAGE_SIZE
        self.default_width = IMAGE_SIZE
        self.default_num_frames = 1
        self.experts = ("transformer",)

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def weight_modules(self) -> dict[str, nn.Module]:
        return {"transformer": self.transformer, "prompt_encoder": self.prompt_encoder}

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "DigitFlowPipeline":
        # `nn.Module.to`, not diffusers' override: that one warns about modules "that should be kept
        # in float32" on every dtype cast even though SD3 has none.
        nn.Module.to(self.transformer, device=device, dtype=dtype)
        self.prompt_encoder.to(device=device, dtype=dtype)
        return self

    @classmethod
    def from_pretrained(
        cls, path: str | Path = DEFAULT_WEIGHTS, torch_dtype: torch.dtype = torch.float32, device: str = "cpu"
    ) -> "DigitFlowPipeline":
        from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

        path = Path(path)
        options = json.loads((path / "pipeline.json").read_text())
        encoder_config = options.pop("prompt_encoder")
        prompt_encoder = DigitPromptEncoder(**encoder_config)
        prompt_encoder.load_state_dict(load_file(path / "prompt_encoder.safetensors"))
        transformer = SD3Transformer2DModel.from_pretrained(
            path / "transformer", torch_dtype=torch_dtype, low_cpu_mem_usage=False
        )
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(path / "scheduler")
        return cls(transformer, prompt_encoder, scheduler, **options).to(device=device, dtype=torch_dtype)

    def save_pretrained(self, path: str | Path, weights_dtype: torch.dtype = torch.float16) -> None:
        """Saves the pipeline; weights are stored in `weights_dtype` to keep the package small."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        # The layout of diffusers' `save_pretrained`, written directly so the live model is not cast.
        (path / "transformer").mkdir(exist_ok=True)
        self.transformer.save_config(path / "transformer")
        save_file(
            _cast_state_dict(self.transformer, weights_dtype),
            path / "transformer" / "diffusion_pytorch_model.safetensors",
            metadata={"format": "pt"},
        )
        save_file(_cast_state_dict(self.prompt_encoder, weights_dtype), path / "prompt_encoder.safetensors")
        self.scheduler.save_pretrained(path / "scheduler")
        options = {
            "default_guidance_scale": self.default_guidance_scale,
            "micro_batch_size": self.micro_batching.default,
            "prompt_encoder": {
                "num_tokens": self.prompt_encoder.num_tokens,
                "token_dim": self.prompt_encoder.token_dim,
                "pooled_dim": self.prompt_encoder.pooled.embedding_dim,
            },
        }
        (path / "pipeline.json").write_text(json.dumps(options, indent=2) + "\n")

    @property
    def image_size_limits(self) -> ImageSizeLimits:
        return ImageSizeLimits(
            multiple=IMAGE_SIZE, max_size=IMAGE_SIZE, bound_by=f"it is trained on {IMAGE_SIZE}x{IMAGE_SIZE} digits only"
        )

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        check_image_frames(num_frames, self.name)
        for field, value in (("height", height), ("width", width)):
            if value != IMAGE_SIZE:
                raise InvalidRequestError(
                    field, f"the embedded digits model only produces {IMAGE_SIZE}x{IMAGE_SIZE} images, got {value}"
                )
        return (1, IMAGE_SIZE, IMAGE_SIZE)

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> ScheduleSnapshot:
        return ScheduleSnapshot.from_scheduler(self.scheduler, num_steps, model_timesteps=timesteps_as_they_are)

    def _class_ids(self, prompts: Sequence[str], negative_prompts: Sequence[str]) -> tuple[list[int], list[int]]:
        return (
            [parse_digit_prompt(p, "prompt") for p in prompts],
            [parse_digit_prompt(p, "negative_prompt") for p in negative_prompts],
        )

    def check_prompts(self, prompts: Sequence[str], negative_prompts: Sequence[str]) -> None:
        self._class_ids(prompts, negative_prompts)

    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        options: SamplingOptions,
        images: Sequence[tuple[InputImage, ...]] | None = None,
    ) -> BucketedConditioning:
        self.condition_images.check(images or (), self.name, options.num_frames)
        positive_ids, negative_ids = self._class_ids(prompts, negative_prompts)
        with torch.no_grad():
            positive = self._transformer_kwargs(positive_ids)
            negative = self._transformer_kwargs(negative_ids) if self.uses_negative_branch(options) else None
        return BucketedConditioning.single(Conditioning(pos_cond_kwargs=positive, neg_cond_kwargs=negative))

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        # Every digit's embedding has the same shapes: one digit's, encoded, is exact (and costs two lookups).
        (bucket,) = self.encode_prompts([digit_prompt(0)], [""], options).buckets
        return bucket.conditioning.row_bytes()

    def _transformer_kwargs(self, class_ids: list[int]) -> dict[str, torch.Tensor]:
        prompt_embeds, pooled = self.prompt_encoder(torch.tensor(class_ids, device=self.device))
        return {"encoder_hidden_states": prompt_embeds, "pooled_projections": pooled}

    def predict_velocity(
        self,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning,
        options: SamplingOptions,
        expert: int = 0,
    ) -> torch.Tensor:
        check_single_denoiser(expert)
        if not self.uses_negative_branch(options):
            return self._velocity(x_t, timestep, conditioning.pos_cond_kwargs)
        return batched_cfg_velocity(self._velocity, x_t, timestep, conditioning, cfg_scale(options))

    def uses_negative_branch(self, options: SamplingOptions) -> bool:
        return self.negative_branch.runs(options)

    def held_frames(self, conditioning: BucketedConditioning) -> HeldFrames | None:
        return None  # an image model: nothing held

    def _velocity(self, x_t: torch.Tensor, timestep: torch.Tensor, kwargs: dict[str, torch.Tensor]) -> torch.Tensor:
        with self.attention.running():
            output = self.transformer(hidden_states=x_t.to(self.dtype), timestep=timestep, return_dict=False, **kwargs)
        return output[0].float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return ((latents.float() + 1) / 2).clamp(0, 1)
