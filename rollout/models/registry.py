"""Loads a pipeline by model name, from the packaged weights or a local directory (never a hub)."""

from __future__ import annotations

from pathlib import Path

import torch

from rollout.errors import InvalidRequestError
from rollout.models.base import RolloutPipeline
from rollout.models.digits import DEFAULT_WEIGHTS, DigitFlowPipeline

EMBEDDED_MODEL = DigitFlowPipeline.name
_LOADERS = {EMBEDDED_MODEL: (DigitFlowPipeline, DEFAULT_WEIGHTS)}


def available_models() -> list[str]:
    return sorted(_LOADERS)


def load_pipeline(
    model: str = EMBEDDED_MODEL,
    path: str | Path | None = None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> RolloutPipeline:
    """Loads `model` from `path` (default: its packaged weights) onto `device` (default: CUDA if present)."""
    if model not in _LOADERS:
        raise InvalidRequestError("model", f"unknown model {model!r}; available: {available_models()}")
    pipeline_class, default_path = _LOADERS[model]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return pipeline_class.from_pretrained(path or default_path, torch_dtype=dtype, device=device)
