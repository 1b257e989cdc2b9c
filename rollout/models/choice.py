"""A model choice checked without loading or importing any model family: the embedded model's
name, and the rules a name, a directory, a text length and VAE tiling meet before anyone looks
at the directory (`rollout.models.registry.check_model_directory` looks).

Kept apart from the registry because the app config uses it, and the ingress, which reads the
app config, imports no model code (no diffusers, no transformers: pyproject.toml's contracts)."""

from __future__ import annotations

from pathlib import Path

from rollout.errors import ModelLoadError

EMBEDDED_MODEL = "embedded-digits"


def check_model_choice(
    name: str | None, path: str | Path | None, max_sequence_length: int | None = None, vae_tiling: bool | None = None
) -> None:
    """Raises `ModelLoadError` naming the field when the choice breaks a rule that holds whatever
    the directory holds."""
    embedded = name == EMBEDDED_MODEL or (name is None and path is None)
    if embedded and max_sequence_length is not None:
        raise ModelLoadError("model.max_sequence_length", "the embedded model has no text encoder")
    if embedded and vae_tiling is not None:
        raise ModelLoadError("model.vae_tiling", "the embedded model has no VAE (it samples pixels)")
    if not embedded and path is None:
        raise ModelLoadError("model.path", f"model {name!r} loads from a local diffusers directory: set model.path")
