"""What every model family served from a diffusers checkpoint directory has in common.

A family (one file: `sd3.py`, `flux.py`, `qwenimage.py`) wraps the family's diffusers pipeline,
loaded with `from_pretrained` from a local directory, and says only what differs: how a prompt
is encoded, how the scheduler is set for a size, what time input the transformer takes, how
guidance combines the transformer's outputs, and how latents are decoded. The sampler never
calls the diffusers pipeline's own loop: `../shared/REAL_PIPELINES.md` (in the workspace) and
`docs/real_models.md` record what that loop computes and where this one differs on purpose.

Three rules hold for every family, so that a sample's bits never depend on its batch:
- Each distinct prompt is encoded alone (text encoders and their padding differ by ULPs with
  the batch size) and padded to a length that depends on it alone: a fixed one, or (Qwen-Image)
  its own length bucket; rows of different lengths run in separate micro-batches.
- The transformer runs on micro-batches of a fixed size (`MicroBatching`); the sampler pads.
- The VAE decodes micro-batches of the same fixed size (padded).
Latents between steps and all transition math stay fp32 whatever the weights' dtype; the
transformer gets its inputs cast to the weights' dtype and its output is cast back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator, Sequence

import diffusers
import numpy as np
import torch
from torch import nn

from rollout.conditioning import BucketedConditioning, Conditioning, image_input_key
from rollout.encoding_cache import ENCODING_CACHE_BYTES, EncodingCache
from rollout.errors import ModelLoadError, UnknownPromptError
from rollout.kernels import AttentionBackend, zero_padded
from rollout.micro_batching import MicroBatching
from rollout.models.base import (
    ConditionImageRule,
    ImageSizeLimits,
    NegativeBranchRule,
    check_image_frames,
    check_single_denoiser,
)
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot, timesteps_as_they_are

if TYPE_CHECKING:
    from rollout.input_images import InputImage
    from rollout.transitions import HeldFrames


def read_model_index(path: str | Path) -> dict[str, Any]:
    """`model_index.json` of a diffusers pipeline directory, after checking the directory has
    every component it lists; raises `ModelLoadError` naming the path and what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError("model.path", f"{path} is not a directory (models load from a local directory only)")
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise ModelLoadError("model.path", f"{path} has no model_index.json: not a diffusers pipeline directory")
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError) as error:
        raise ModelLoadError("model.path", f"{index_file} cannot be read as JSON: {error}") from None
    if not isinstance(index, dict) or not isinstance(index.get("_class_name"), str):
        raise ModelLoadError("model.path", f"{index_file} has no '_class_name' naming the pipeline class")
    # Components are listed as "name": [library, class]; null entries are optional parts left out.
    components = [name for name, value in index.items() if not name.startswith("_") and isinstance(value, list)]
    missing = [name for name in components if index[name][0] is not None and not (path / name).is_dir()]
    if missing:
        raise ModelLoadError("model.path", f"{path} lacks the component folder(s) {missing} that model_index.json lists")
    return index


def _images_key(images: Sequence[InputImage]) -> tuple[str, ...]:
    """A prompt's input images by their pixels: equal images are encoded once."""
    return tuple(image.digest for image in images)


def stacked_in_one_buffer(rows: int, parts: Iterator[torch.Tensor]) -> torch.Tensor:
    """`parts` (consecutive, `rows` rows in all) as one fp32 tensor, allocated with the first part
    and written part by part: a batch's images are held once, not as a list of parts and then
    their concatenation, and a part's postprocessing temporaries are freed before the next part is
    decoded."""
    stacked, start = None, 0
    for part in parts:
        if stacked is None:
            stacked = torch.empty((rows, *part.shape[1:]), dtype=torch.float32, device=part.device)
        stacked[start : start + len(part)] = part
        start += len(part)
    return stacked


class DiffusersFamily:
    """A `RolloutPipeline` over one family's diffusers pipeline; subclasses fill in the family.

    Attributes:
        pipe: the diffusers pipeline, used for its components and its own helper methods
            (`encode_prompt`, latent packing, the image processor), never for its loop.
        max_sequence_length: the text length every prompt is padded (or truncated) to.
        vae_tiling: whether the VAE decodes in overlapping spatial tiles (diffusers'
            `enable_tiling`; each VAE has its own tile size and only tiles larger frames). On by
            default for video families, whose decoder activations at their published sizes are
            what tiling bounds; off for image families, which decode as their pipelines do.
    """

    name: ClassVar[str]
    diffusers_pipeline: ClassVar[str]  # the `_class_name` in model_index.json
    also_serves: ClassVar[tuple[str, ...]] = ()  # other pipeline classes the family serves (a variant)
    default_guidance_scale: ClassVar[float]
    default_max_sequence_length: ClassVar[int]
    default_micro_batch_size: ClassVar[int] = 4
    batches_guidance_branches: ClassVar[bool] = False
    default_num_frames: ClassVar[int] = 1  # an image
    frames_per_latent: int = 1  # an image; a video family sets its VAE's
    negative_branch: ClassVar[NegativeBranchRule]
    condition_images: ClassVar[ConditionImageRule] = ConditionImageRule()  # text only
    text_sees_images: ClassVar[bool] = False  # whether the text encoder reads the input images too
    attention: AttentionBackend = AttentionBackend.DEFAULT  # `load_pipeline` pins the configured one
    # Video families set False: calibrating would check a call of a micro-batch of full-length
    # videos per candidate size (minutes for the tiny Wan copy on a CPU).
    calibrated_at_start: ClassVar[bool] = True

    def __init__(
        self,
        pipe: Any,
        micro_batching: MicroBatching | None = None,
        max_sequence_length: int | None = None,
        vae_tiling: bool | None = None,
        encoding_cache_bytes: int = ENCODING_CACHE_BYTES,
    ):
        self.pipe = pipe
        self.scheduler = pipe.scheduler
        self.transformer = pipe.transformer
        self.vae = pipe.vae
        # Read once: diffusers' `dtype` walks every submodule, and each transformer call needs it.
        # Loading sets it; weight updates and moving memory keep it.
        self.dtype: torch.dtype = self.transformer.dtype
        for module in pipe.components.values():
            if isinstance(module, nn.Module):
                module.eval().requires_grad_(False)
        self.micro_batching = micro_batching or MicroBatching(self.default_micro_batch_size)
        self.max_sequence_length = max_sequence_length or self.default_max_sequence_length
        self.vae_scale_factor = self.spatial_scale_factor(pipe)
        self.default_height, self.default_width = self.default_size(pipe)
        self.experts = tuple(name for name in ("transformer", "transformer_2") if getattr(pipe, name, None) is not None)
        self.vae_tiling = self.default_num_frames > 1 if vae_tiling is None else vae_tiling
        if self.vae_tiling:
            self.vae.enable_tiling()
        self._one_word_text: dict[str, torch.Tensor] | None = None  # `text_bytes`' measure
        self.encodings = EncodingCache(encoding_cache_bytes)

    @classmethod
    def spatial_scale_factor(cls, pipe: Any) -> int:
        """Pixels a side of one latent pixel."""
        return pipe.vae_scale_factor

    @classmethod
    def default_size(cls, pipe: Any) -> tuple[int, int]:
        """`(height, width)` of the pipeline's `__call__` when given none."""
        size = pipe.default_sample_size * pipe.vae_scale_factor
        return size, size

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        torch_dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        micro_batching: MicroBatching | None = None,
        max_sequence_length: int | None = None,
        vae_tiling: bool | None = None,
        encoding_cache_bytes: int = ENCODING_CACHE_BYTES,
    ) -> "DiffusersFamily":
        """Loads the family's diffusers pipeline from the local directory `path`; never downloads."""
        index = read_model_index(path)
        class_name = index["_class_name"]
        if class_name not in cls.served_pipelines():
            raise ModelLoadError(
                "model.name",
                f"{path} holds a {class_name}, not the {' or '.join(cls.served_pipelines())} of model {cls.name!r}",
            )
        pipeline_class = getattr(diffusers, class_name)  # imports transformers, on first use
        try:
            components = cls.loaded_components(Path(path))
            pipe = pipeline_class.from_pretrained(path, dtype=torch_dtype, local_files_only=True, **components)
        except (OSError, ValueError, KeyError) as error:
            raise ModelLoadError("model.path", f"cannot load {class_name} from {path}: {error}") from error
        pipe.set_progress_bar_config(disable=True)
        for module in pipe.components.values():
            if isinstance(module, nn.Module):
                # `nn.Module.to`: diffusers' override warns on every call about fp32 modules these models lack.
                nn.Module.to(module, device)
        return cls(
            pipe,
            micro_batching=micro_batching,
            max_sequence_length=max_sequence_length,
            vae_tiling=vae_tiling,
            encoding_cache_bytes=encoding_cache_bytes,
        )

    @classmethod
    def served_pipelines(cls) -> tuple[str, ...]:
        """The `_class_name`s of the directories the family loads: its pipeline's, then `also_serves`."""
        return (cls.diffusers_pipeline, *cls.also_serves)

    @classmethod
    def loaded_components(cls, path: Path) -> dict[str, Any]:
        """Components of the directory `path` that the family loads itself and hands to the
        pipeline's `from_pretrained` (one its own loading cannot make here); none by default."""
        return {}

    @property
    def device(self) -> torch.device:
        # The first parameter's, where diffusers' `device` finds it too, but without first walking
        # every submodule for offloading hooks (these pipelines use none): the loop asks every step.
        # Not cached: releasing memory moves the weights.
        return next(self.transformer.parameters()).device

    @property
    def weight_modules(self) -> dict[str, nn.Module]:
        # The denoisers are the policy RL trains; the text encoders and the VAE stay frozen (as in
        # Flow-GRPO and DanceGRPO), and transformers' checkpoints of them (tied embeddings,
        # renamed keys) do not map one to one onto their state dicts.
        return {name: getattr(self.pipe, name) for name in self.experts}

    # Sizes and schedule ------------------------------------------------------------------------

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels

    @property
    def patch_size(self) -> int:
        """Latent pixels a side of one transformer token: FLUX.1's and Qwen-Image's pipelines pack
        2x2 latents into a token, whatever their transformer's own `patch_size` config says."""
        return 2

    @property
    def token_pixels(self) -> int:
        return self.vae_scale_factor * self.patch_size

    @property
    def image_size_limits(self) -> ImageSizeLimits:
        # FLUX.1's rotary embeddings are computed from the token ids of any size and the VAEs are
        # convolutional: only the token grid bounds the size. Families whose transformer holds a
        # table of positions bound it too.
        return ImageSizeLimits(multiple=self.vae_scale_factor * self.patch_size)

    def latent_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        check_image_frames(num_frames, self.name)
        self.image_size_limits.check(height, width, self.name)
        return (self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def image_sequence_length(self, height: int, width: int) -> int:
        """Image tokens the transformer sees: the `image_seq_len` that dynamic shifting reads."""
        _, latent_height, latent_width = self.latent_shape(height, width)
        return (latent_height // self.patch_size) * (latent_width // self.patch_size)

    def schedule(self, num_steps: int, height: int, width: int, num_frames: int = 1) -> ScheduleSnapshot:
        return ScheduleSnapshot.from_scheduler(
            self.scheduler,
            num_steps,
            model_timesteps=self.model_timesteps,
            **self.set_timesteps_kwargs(num_steps, height, width),
        )

    def set_timesteps_kwargs(self, num_steps: int, height: int, width: int) -> dict[str, Any]:
        """`sigmas` and `mu` for `set_timesteps`, as the family's pipeline passes them."""
        return {}

    def model_timesteps(self, timesteps: torch.Tensor) -> torch.Tensor:
        """The transformer's time input at each step; by default the scheduler's `timesteps`."""
        return timesteps_as_they_are(timesteps)

    def dynamic_shift_kwargs(self, num_steps: int, height: int, width: int, max_shift: float) -> dict[str, Any]:
        """FLUX.1's and Qwen-Image's call: sigmas `linspace(1, 1/T, T)` and a `mu` that grows with
        the image's token count (`max_shift` is the pipeline's default for a config without one)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = self.scheduler.config
        mu = calculate_shift(
            self.image_sequence_length(height, width),
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", max_shift),
        )
        sigmas = None if config.get("use_flow_sigmas") else np.linspace(1.0, 1 / num_steps, num_steps)
        return {"sigmas": sigmas, "mu": mu}

    # Conditioning ------------------------------------------------------------------------------

    def check_prompts(self, prompts: Sequence[str], negative_prompts: Sequence[str]) -> None:
        for field, texts in (("prompt", prompts), ("negative_prompt", negative_prompts)):
            for text in texts:
                if not isinstance(text, str):
                    raise UnknownPromptError(field, f"expected a string, got {type(text).__name__}")

    def encode_prompts(
        self,
        prompts: Sequence[str],
        negative_prompts: Sequence[str],
        options: SamplingOptions,
        images: Sequence[tuple[InputImage, ...]] | None = None,
    ) -> BucketedConditioning:
        self.check_prompts(prompts, negative_prompts)
        images = [()] * len(prompts) if images is None else list(images)
        self.condition_images.check(images, self.name, options.num_frames)
        negatives = negative_prompts if self.uses_negative_branch(options) else None

        def text_key(texts: Sequence[str], row: int) -> tuple:
            # A text encoder that reads the prompt's images encodes the text anew for other images.
            return (texts[row], _images_key(images[row]) if self.text_sees_images else ())

        # Each distinct text and image set is encoded once, alone: a prompt's fan-out shares it, and
        # later requests take it from the pipeline's cache, keyed by all an encoder is given.
        encoding = options.for_encoding()

        def encode_text(text: str, row: int) -> dict[str, torch.Tensor]:
            if self.text_sees_images:
                return self.encode_prompt_seeing(text, images[row], encoding)
            return self.encode_prompt(text, encoding)

        encoded: dict[tuple, dict[str, torch.Tensor]] = {}
        encoded_images: dict[tuple[str, ...], dict[str, torch.Tensor]] = {(): {}}
        with torch.no_grad():
            for texts in (prompts, negatives or ()):
                for row, text in enumerate(texts):
                    key = text_key(texts, row)
                    if key not in encoded:
                        encoded[key] = self.encodings.get(("text", key, encoding), lambda: encode_text(text, row))
            for prompt_images in images:
                key = _images_key(prompt_images)
                if key not in encoded_images:
                    made = lambda: self.encode_images(prompt_images, encoding)  # noqa: E731
                    encoded_images[key] = self.encodings.get(("images", key, encoding), made)

        def stacked(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
            return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

        def conditioning_of(rows: list[int]) -> Conditioning:
            condition = stacked([encoded_images[_images_key(images[i])] for i in rows])
            return Conditioning(
                image_kwargs={**(self.image_kwargs(len(rows), options) or {}), **condition} or None,
                pos_cond_kwargs=stacked([encoded[text_key(prompts, i)] for i in rows]),
                neg_cond_kwargs=None if negatives is None else stacked([encoded[text_key(negatives, i)] for i in rows]),
                guidance=self.guidance(len(rows), options),
            )

        def shapes(texts: Sequence[str] | None, row: int) -> tuple:
            return () if texts is None else tuple(t.shape for t in encoded[text_key(texts, row)].values())

        def condition_shapes(row: int) -> tuple:
            encoded_row = encoded_images[_images_key(images[row])]
            return tuple(image_input_key(name, t) for name, t in encoded_row.items())

        keys = [(shapes(prompts, row), shapes(negatives, row), condition_shapes(row)) for row in range(len(prompts))]
        return BucketedConditioning.grouped(keys, conditioning_of)

    def encode_prompt_seeing(
        self, prompt: str, images: tuple[InputImage, ...], options: SamplingOptions
    ) -> dict[str, torch.Tensor]:
        """`encode_prompt` for a family whose text encoder reads the prompt's images too
        (`text_sees_images`: Qwen-Image-Edit's vision-language encoder)."""
        raise NotImplementedError(f"model {self.name!r} encodes its prompts without their images")

    def encode_images(self, images: tuple[InputImage, ...], options: SamplingOptions) -> dict[str, torch.Tensor]:
        """One prompt's input images as the transformer's image inputs (`image_kwargs`), each
        `(1, ...)`, encoded alone, for a request with `options`; {} for none. A family that takes
        images (`condition_images`) says how."""
        if images:
            raise NotImplementedError(f"model {self.name!r} takes no input images")
        return {}

    def conditioning_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        # The image inputs and the guidance are made from the options alone: made here for one sample.
        guidance = self.guidance(1, options)
        made = [*(self.image_kwargs(1, options) or {}).values(), *(() if guidance is None else (guidance,))]
        text = self.text_bytes(options)
        return (*text, *(text if self.uses_negative_branch(options) else ()), *(t.nbytes for t in made))

    def text_bytes(self, options: SamplingOptions) -> tuple[int, ...]:
        """The bytes of each tensor of one prompt's encoding (`encode_prompt`) at its longest. A family
        that pads every prompt to `max_sequence_length` makes the same shapes for any prompt, so a
        one-word prompt's, encoded once in the pipeline's life (`one_word_text`), are exact."""
        return tuple(t.nbytes for t in self.one_word_text(options).values())

    def one_word_text(self, options: SamplingOptions) -> dict[str, torch.Tensor]:
        """`encode_prompt` of a one-word prompt, made on the first call and kept as meta tensors (their
        shapes and dtypes, no memory): its shapes measure every prompt's (`text_bytes`)."""
        if self._one_word_text is None:
            with torch.no_grad():
                encoded = self.encode_prompt("a", options)
            self._one_word_text = {name: t.to("meta") for name, t in encoded.items()}
        return self._one_word_text

    def encode_prompt(self, prompt: str, options: SamplingOptions) -> dict[str, torch.Tensor]:
        """One prompt's transformer keyword arguments, each `(1, ...)`, encoded alone for a request
        with `options` (its image size may set the text padding)."""
        raise NotImplementedError

    def uses_negative_branch(self, options: SamplingOptions) -> bool:
        return self.negative_branch.runs(options)

    def held_frames(self, conditioning: BucketedConditioning) -> HeldFrames | None:
        return None  # every latent element is sampled (`rollout.models.wan` holds a given first frame)

    def image_kwargs(self, batch_size: int, options: SamplingOptions) -> dict[str, torch.Tensor] | None:
        """Per-sample transformer inputs that describe the image (ids, shapes), `(B, ...)`."""
        return None

    def guidance(self, batch_size: int, options: SamplingOptions) -> torch.Tensor | None:
        """A guidance-distilled transformer's guidance input, `(B,)` fp32; None for the others."""
        if not self.transformer.config.get("guidance_embeds", False):
            return None
        return torch.full((batch_size,), float(options.guidance_scale), dtype=torch.float32)

    # Model calls -------------------------------------------------------------------------------

    def run_transformer(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, expert: int = 0, **kwargs
    ) -> torch.Tensor:
        """Denoiser `experts[expert]`'s output in fp32, its inputs cast to the weights' dtype."""
        if not 0 <= expert < len(self.experts):
            raise ValueError(f"model {self.name!r} has the denoisers {list(self.experts)}, not expert {expert}")
        denoiser = getattr(self.pipe, self.experts[expert])
        with self.attention.running():
            output = denoiser(hidden_states=hidden_states.to(self.dtype), timestep=timestep, return_dict=False, **kwargs)
        return output[0].float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images of `(B, *latent_shape)` latents, decoded in the VAE calls of the micro-batching for
        their image size (`MicroBatching.decode_calls`: whole micro-batches padded with zeros, or one
        image a call), so that, as for the transformer, an image's bits do not depend on what it was
        decoded with."""
        batch_size, _, latent_height, latent_width = latents.shape
        height, width = latent_height * self.vae_scale_factor, latent_width * self.vae_scale_factor

        def images():
            for call in self.micro_batching.decode_calls(batch_size, height, width):
                padded = zero_padded(latents[call], call.stop - call.start).to(self.vae.dtype)
                kept = self.decode_latents(padded)[: batch_size - call.start]  # the padding's images dropped
                yield self.pipe.image_processor.postprocess(kept, output_type="pt")

        with torch.no_grad():
            return stacked_in_one_buffer(batch_size, images())

    def decode_videos(self, latents: torch.Tensor, decode_one: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Videos `(B, C, F, H, W)` in [0, 1] (SGLang's layout) of `(B, *latent_shape)` latents, each
        decoded alone by `decode_one` (a `(1, *latent_shape)` latent to the VAE's frames in [-1, 1]),
        so a video's bits and the VAE's memory do not depend on the request."""

        def videos():
            for latent in latents.split(1):
                # (1, F, C, H, W), as the pipelines return them.
                video = self.pipe.video_processor.postprocess_video(decode_one(latent), output_type="pt")
                yield video.permute(0, 2, 1, 3, 4)

        with torch.no_grad():
            return stacked_in_one_buffer(len(latents), videos())

    def decode_latents(self, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's images in [-1, 1] for latents `(n, *latent_shape)`."""
        config = self.vae.config
        return self.vae.decode(latents / config.scaling_factor + config.shift_factor, return_dict=False)[0]


class PackedLatentFamily(DiffusersFamily):
    """FLUX.1 and Qwen-Image: the transformer takes latents packed into 2x2 tokens, its time
    input is the timestep rounded to the model dtype and divided by 1000, and the schedule
    shifts dynamically with the image size.

    Latents are kept unpacked, `(C, H/8, W/8)`, in trajectories (the layout a video family
    extends with a frames axis); packing is a permutation, so it changes no value.
    """

    # diffusers also asks for a negative prompt; here an absent one is the empty prompt, so the
    # requested scale is never silently dropped.
    negative_branch = NegativeBranchRule("true_cfg_scale")

    @property
    def latent_channels(self) -> int:
        return self.transformer.config.in_channels // 4

    def set_timesteps_kwargs(self, num_steps: int, height: int, width: int) -> dict[str, Any]:
        return self.dynamic_shift_kwargs(num_steps, height, width, max_shift=1.15)

    def model_timesteps(self, timesteps: torch.Tensor) -> torch.Tensor:
        # The pipelines compute `t.to(latents.dtype) / 1000` in the model dtype (bf16: off by up
        # to 4e-3 from sigmas), and the model was trained on that input.
        return timesteps.to(self.dtype) / 1000

    def pack(self, latents: torch.Tensor) -> torch.Tensor:
        batch_size, channels, height, width = latents.shape
        return self.pipe._pack_latents(latents, batch_size, channels, height, width)

    def unpack(self, tokens: torch.Tensor, latent_height: int, latent_width: int) -> torch.Tensor:
        unpacked = self.pipe._unpack_latents(
            tokens, latent_height * self.vae_scale_factor, latent_width * self.vae_scale_factor, self.vae_scale_factor
        )
        return unpacked.reshape(tokens.shape[0], self.latent_channels, latent_height, latent_width)


    def predict_velocity(
        self,
        x_t: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning,
        options: SamplingOptions,
        expert: int = 0,
    ) -> torch.Tensor:
        check_single_denoiser(expert)
        tokens = self.pack(x_t)
        noise_tokens = tokens.shape[1]
        condition = self.condition_tokens(conditioning)
        if condition is not None:  # after the noise tokens, as the editing pipelines concatenate them
            tokens = torch.cat([tokens, condition.to(tokens.dtype)], dim=1)
        inputs = self.transformer_inputs(conditioning)

        def velocity_of(branch: dict[str, torch.Tensor]) -> torch.Tensor:
            # The condition's own outputs are dropped: only the noise tokens move.
            return self.run_transformer(tokens, timestep, **inputs(branch))[:, :noise_tokens]

        velocity = velocity_of(conditioning.pos_cond_kwargs)
        if self.uses_negative_branch(options):
            if conditioning.neg_cond_kwargs is None:
                raise ValueError("true CFG needs the negative branch's conditioning (neg_cond_kwargs)")
            # A separate call, as the pipelines make it.
            negative = velocity_of(conditioning.neg_cond_kwargs)
            velocity = self.combine_guidance(velocity, negative, options.true_cfg_scale)
        return self.unpack(velocity, x_t.shape[-2], x_t.shape[-1])

    def transformer_inputs(self, conditioning: Conditioning):
        """A function from one branch's cond kwargs to the transformer's keyword arguments."""
        raise NotImplementedError

    def condition_tokens(self, conditioning: Conditioning) -> torch.Tensor | None:
        """`(B, n, C)` packed tokens of the input images, which the transformer sees after the noise
        tokens; None for a text-only model."""
        return None

    def combine_guidance(self, positive: torch.Tensor, negative: torch.Tensor, scale: float) -> torch.Tensor:
        return negative + scale * (positive - negative)
