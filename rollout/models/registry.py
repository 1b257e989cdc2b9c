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


def resolve_model_path(model: str, path: str | Path | None = None) -> Path:
    """The directory `load_pipeline(model, path)` loads from: `path`, or the model's packaged weights."""
    if model not in _LOADERS:
        raise InvalidRequestError("model", f"unknown model {model!r}; available: {available_models()}")
    return Path(path) if path is not None else _LOADERS[model][1]


def load_pipeline(
    model: str = EMBEDDED_MODEL,
    path: str | Path | None = None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> RolloutPipeline:
    """Loads `model` from `path` (default: its packaged weights) onto `device` (default: CUDA if present)."""
    model_path = resolve_model_path(model, path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return _LOADERS[model][0].from_pretrained(model_path, torch_dtype=dtype, device=device)
