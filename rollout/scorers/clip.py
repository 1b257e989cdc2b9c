"""CLIP-family scorers: CLIP score and PickScore, from a local transformers `CLIPModel` checkpoint.

Both embed a sample's image and its prompt with the checkpoint's two towers and compare the
embeddings by cosine similarity `cos(E_I, E_C)`; they differ only in the scale:

- `clip`: the CLIP score as commonly defined, `max(100 * cos(E_I, E_C), 0)` in [0, 100]
  (Hessel et al. 2021; torchmetrics' `CLIPScore` defines it so, by default on
  openai/clip-vit-large-patch14).
- `clip_consistency`: how much of the input image an edit keeps, `max(100 * cos(E_I, E_R), 0)`
  between the sample's image embedding and its first input image's (`condition_images[0]`): the
  CLIP feature similarity Flow-GRPO rewards FLUX.1-Kontext edits with for consistency, on the CLIP
  score's scale. Each distinct input image is embedded once a call (a group shares one).
- `pickscore`: PickScore (Kirstain et al. 2023), `logit_scale.exp() * cos(E_I, E_C)`: the logit
  of yuvalkirstain/PickScore_v1, a CLIP-ViT-H-14 fine-tuned on human preferences, as its README
  computes it (about 20 to 23 for generated images in published tables). PickScore's code and
  Flow-GRPO (`flow_grpo/pickscore_scorer.py`) preprocess with the processor of
  laion/CLIP-ViT-H-14-laion2B-s32B-b79K: save that processor into the directory beside the
  PickScore weights. Flow-GRPO's reward is this logit divided by 26; the scorer returns the logit
  itself, the published PickScore, since a constant factor leaves GRPO's group-normalised
  advantages unchanged and a trainer that mixes rewards can weight it as it likes.

The checkpoint is a local directory (`save_pretrained` layout: the model with its processor);
nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from transformers import CLIPModel, CLIPProcessor

from rollout.errors import ModelLoadError
from rollout.scorers.base import ScoringSample, in_fixed_batches

KINDS = ("clip", "clip_consistency", "pickscore")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ClipScorer:
    """Per-sample CLIP score (`kind="clip"`) or PickScore (`kind="pickscore"`) of an image or a video
    and its prompt; a video's score is the mean of its frames' scores, each frame scored as an image.

    Args:
        path: local directory with a `CLIPModel` and its `CLIPProcessor` (tokenizer and image processor).
        kind: `"clip"` or `"pickscore"` (see the module docstring).
        micro_batch_size: rows (frames, or prompts) per model call; every call has exactly this many,
            so that a sample's score does not depend on the samples scored with it.
        device: where the model runs; None: CUDA if present, else the CPU.
        dtype: the towers' weights, `"float32"`, `"bfloat16"` or `"float16"`; cosines are fp32 whatever it is.

    Raises:
        ModelLoadError: naming `path` (not a loadable CLIP checkpoint), `kind`, `micro_batch_size` or `dtype`.
    """

    group_aware = False

    def __init__(
        self,
        path: str,
        kind: str = "clip",
        micro_batch_size: int = 8,
        device: str | None = None,
        dtype: str = "float32",
    ):
        if kind not in KINDS:
            raise ModelLoadError("kind", f"must be one of {list(KINDS)}, got {kind!r}")
        if dtype not in _DTYPES:
            raise ModelLoadError("dtype", f"must be one of {list(_DTYPES)}, got {dtype!r}")
        if micro_batch_size < 1:
            raise ModelLoadError("micro_batch_size", f"must be at least 1, got {micro_batch_size}")
        self.kind = kind
        self.micro_batch_size = micro_batch_size
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.processor = _load(Path(path))
        self.model.to(device=self.device, dtype=_DTYPES[dtype]).eval()
        # Prompts are padded to the text tower's length: every prompt's tokens, and so its
        # embedding, are the same whatever prompts come with it.
        self.max_length = self.model.config.text_config.max_position_embeddings

    def score(self, samples: Sequence[ScoringSample]) -> list[float]:
        """One score per sample, in order: its frames' mean (an image is one frame)."""
        if not samples:
            return []
        if self.kind == "clip_consistency":
            return self._consistency(samples)
        frames_per_sample = [_frames(sample.image) for sample in samples]
        # Each prompt is embedded once, however many samples share it (a GRPO group shares one).
        prompt_rows = {prompt: row for row, prompt in enumerate(dict.fromkeys(s.prompt for s in samples))}
        frame_prompt_rows = torch.tensor(
            [prompt_rows[sample.prompt] for sample, frames in zip(samples, frames_per_sample) for _ in frames]
        )
        with torch.no_grad():
            image_embeddings = self._embed_images([frame for frames in frames_per_sample for frame in frames])
            text_embeddings = self._embed_prompts(list(prompt_rows))[frame_prompt_rows.to(self.device)]
            cosines = (image_embeddings * text_embeddings).sum(dim=-1)  # (total frames,)
            if self.kind == "clip":
                frame_scores = (100 * cosines).clamp(min=0)
            else:
                frame_scores = self.model.logit_scale.exp().float() * cosines
        per_sample = frame_scores.double().cpu().split([len(frames) for frames in frames_per_sample])
        return [scores.mean().item() for scores in per_sample]

    def _consistency(self, samples: Sequence[ScoringSample]) -> list[float]:
        """`clip_consistency`: each sample's frames against its first input image, the frames' mean."""
        for index, sample in enumerate(samples):
            if not sample.condition_images:
                raise ValueError(f"clip_consistency compares an edit with its input image: sample {index} has none")
        frames_per_sample = [_frames(sample.image) for sample in samples]
        references: dict[bytes, int] = {}  # an input image's bytes -> its row: each embedded once
        reference_rows = [
            references.setdefault(sample.condition_images[0].numpy().tobytes(), len(references)) for sample in samples
        ]
        reference_images = {row: sample.condition_images[0] for row, sample in zip(reference_rows, samples)}
        with torch.no_grad():
            frames = self._embed_images([frame for sample_frames in frames_per_sample for frame in sample_frames])
            pil_references = [Image.fromarray(reference_images[row].permute(1, 2, 0).numpy()) for row in range(len(references))]
            reference_embeddings = self._embed_images(pil_references)
            rows = torch.tensor([row for row, f in zip(reference_rows, frames_per_sample) for _ in f], device=self.device)
            frame_scores = (100 * (frames * reference_embeddings[rows]).sum(dim=-1)).clamp(min=0)
        per_sample = frame_scores.double().cpu().split([len(f) for f in frames_per_sample])
        return [scores.mean().item() for scores in per_sample]

    def _embed_images(self, frames: list[Image.Image]) -> torch.Tensor:
        """Unit-norm fp32 image embeddings `(len(frames), projection_dim)`.

        Each frame goes through the processor alone: its torchvision backend resizes same-sized
        images as one batch, and a frame's pixels must not depend on its companions either.
        """
        pixel_values = torch.cat(
            [self.processor.image_processor(images=frame, return_tensors="pt").pixel_values for frame in frames]
        )
        pixel_values = pixel_values.to(device=self.device, dtype=self.model.dtype)
        embeddings = in_fixed_batches(
            pixel_values,
            self.micro_batch_size,
            lambda rows: _embedding(self.model.get_image_features(pixel_values=rows)),
        )
        return _unit(embeddings)

    def _embed_prompts(self, prompts: list[str]) -> torch.Tensor:
        """Unit-norm fp32 text embeddings `(len(prompts), projection_dim)`.

        The list is padded with empty prompts to whole calls, so `in_fixed_batches` adds no rows of
        its own: its zero rows would be tokens without an end-of-text and with an all-zero attention
        mask, an input no tokenizer makes, whose fully masked attention each attention
        implementation treats its own way. An empty prompt is an ordinary input, dropped after the call.
        """
        padded = prompts + [""] * (-len(prompts) % self.micro_batch_size)
        tokens = self.processor.tokenizer(
            padded, padding="max_length", max_length=self.max_length, truncation=True, return_tensors="pt"
        )
        rows = torch.stack([tokens.input_ids, tokens.attention_mask], dim=1).to(self.device)  # (N, 2, max_length)
        embeddings = in_fixed_batches(
            rows,
            self.micro_batch_size,
            lambda chunk: _embedding(self.model.get_text_features(input_ids=chunk[:, 0], attention_mask=chunk[:, 1])),
        )
        return _unit(embeddings[: len(prompts)])


def _load(path: Path) -> tuple[CLIPModel, CLIPProcessor]:
    """The model and processor saved in `path`, from local files only."""
    if not path.is_dir():
        raise ModelLoadError("path", f"{path} is not a directory (CLIP scorers load a local checkpoint only)")
    try:
        model = CLIPModel.from_pretrained(path, local_files_only=True)
        processor = CLIPProcessor.from_pretrained(path, local_files_only=True)
    # transformers raises OSError for missing files and ValueError, KeyError or TypeError for
    # files of another model: any of them means the directory is not a CLIP checkpoint.
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ModelLoadError("path", f"cannot load a CLIPModel and its CLIPProcessor from {path}: {error}") from None
    return model, processor


def _frames(image: torch.Tensor) -> list[Image.Image]:
    """An image `(C, H, W)` or a video `(C, F, H, W)`, fp32 in [0, 1] with C 1 or 3, as RGB PIL frames.

    The processor gets 8-bit images, the input it is written for (it rescales by 1/255 itself, then
    resizes and normalises) and what Flow-GRPO gives its scorers.
    """
    if image.dim() == 3:
        image = image.unsqueeze(1)  # one frame
    if image.dim() != 4 or image.shape[0] not in (1, 3) or 0 in image.shape:
        raise ValueError(f"scores (C, H, W) images or (C, F, H, W) videos, C 1 or 3, got {tuple(image.shape)}")
    image = image.expand(3, *image.shape[1:])  # grey to RGB
    pixels = (image.float() * 255).round().clamp(0, 255).to(torch.uint8).permute(1, 2, 3, 0)  # (F, H, W, 3)
    return [Image.fromarray(frame) for frame in pixels.cpu().numpy()]


def _embedding(features) -> torch.Tensor:
    """The projected embeddings of a `get_*_features` call: a tensor in transformers 4, the
    `pooler_output` of a model output in transformers 5."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def _unit(embeddings: torch.Tensor) -> torch.Tensor:
    """`embeddings` scaled to unit length, as CLIP's forward does, in fp32: a bf16 cosine, good to
    about 3 significant digits, would move a CLIP score by tenths of a point."""
    embeddings = embeddings.float()
    return embeddings / embeddings.norm(p=2, dim=-1, keepdim=True)
