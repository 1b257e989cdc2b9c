"""Loads a pipeline by model name from the packaged weights or a local directory (never a hub).

Model names: the embedded digits model, and one per `DiffusersFamily` subclass in this package
(`sd3`, `flux`, `qwenimage`). A family is found by importing this package's modules, so adding
one is adding its file. The families' modules are imported only when a directory is loaded:
they pull in transformers, which takes seconds.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

import torch

from rollout.encoding_cache import ENCODING_CACHE_BYTES
from rollout.errors import ModelLoadError
from rollout.kernels import AttentionBackend
from rollout.micro_batching import MicroBatching
from rollout.models.base import RolloutPipeline
from rollout.models.choice import EMBEDDED_MODEL, check_model_choice
from rollout.models.digits import DEFAULT_WEIGHTS, DigitFlowPipeline


def _families() -> dict[str, type]:
    import rollout.models
    from rollout.models.diffusers_family import DiffusersFamily

    for module in pkgutil.iter_modules(rollout.models.__path__):
        importlib.import_module(f"rollout.models.{module.name}")
    families: dict[str, type] = {}
    pending = list(DiffusersFamily.__subclasses__())
    while pending:
        family = pending.pop()
        pending.extend(family.__subclasses__())
        if "name" in vars(family):
            families[family.name] = family
    return families


def available_models() -> list[str]:
    return sorted([EMBEDDED_MODEL, *_families()])


def resolve_model(name: str | None, path: str | Path | None = None) -> tuple[str, Path]:
    """The model name and the directory that `load_pipeline(name, path)` loads, after checking
    that the directory holds that model (`check_model_directory`).

    With no name, a directory's family is read from its `model_index.json`; with neither, the
    embedded model and its packaged weights.
    """
    check_model_choice(name, path)
    if path is None:
        return EMBEDDED_MODEL, DEFAULT_WEIGHTS
    return check_model_directory(name, path), Path(path)


def check_model_directory(name: str | None, path: str | Path) -> str:
    """The name of the model in directory `path`, after the checks that read no weights: the
    directory exists, holds the embedded model's `pipeline.json` or a diffusers `model_index.json`
    with its component folders, and holds model `name` if one is given. Raises `ModelLoadError`
    naming the field and the fix. Costs milliseconds, so an app config is checked so when built."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(
            "model.path", f"{path} is not a directory: it does not exist; give a local model directory (never a hub id)"
        )
    if not path.is_dir():
        raise ModelLoadError(
            "model.path", f"{path} is a file: give the model's directory, which holds model_index.json"
        )
    is_diffusers = (path / "model_index.json").is_file()
    is_embedded = (path / "pipeline.json").is_file()
    if name == EMBEDDED_MODEL:
        if is_embedded:
            return name
        if is_diffusers:
            raise ModelLoadError(
                "model.name",
                f"{path} is a diffusers directory, not the {EMBEDDED_MODEL} model's: "
                "leave model.name out to read its family from model_index.json",
            )
        raise ModelLoadError(
            "model.path", f"{path} has no pipeline.json: not a directory of the {EMBEDDED_MODEL} model"
        )
    if is_embedded and not is_diffusers:
        raise ModelLoadError("model.name", f"{path} holds the embedded model: set model.name to {EMBEDDED_MODEL!r}")
    if not is_diffusers:
        raise ModelLoadError(
            "model.path",
            f"{path} has no model_index.json: give a diffusers pipeline directory (as save_pretrained writes)",
        )
    from rollout.models.diffusers_family import read_model_index

    class_name = read_model_index(path)["_class_name"]
    families = _families()
    if name is None:
        by_class = {served: family.name for family in families.values() for served in family.served_pipelines()}
        if class_name not in by_class:
            raise ModelLoadError(
                "model.path", f"{path} holds a {class_name}; this server serves {sorted(by_class)} (or set model.name)"
            )
        return by_class[class_name]
    if name not in families:
        raise ModelLoadError("model.name", f"unknown model {name!r}; available: {available_models()}")
    if class_name not in families[name].served_pipelines():
        raise ModelLoadError(
            "model.name",
            f"{path} holds a {class_name}, not the {' or '.join(families[name].served_pipelines())} of model {name!r}: "
            "leave model.name out to read the family from model_index.json",
        )
    return name


def load_pipeline(
    name: str | None = None,
    path: str | Path | None = None,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    micro_batching: MicroBatching | None = None,
    max_sequence_length: int | None = None,
    vae_tiling: bool | None = None,
    encoding_cache_bytes: int = ENCODING_CACHE_BYTES,
    attention_backend: str = AttentionBackend.DEFAULT.value,
) -> RolloutPipeline:
    """Loads model `name` from `path` (see `resolve_model`) onto `device` (default: CUDA if present).

    Args:
        micro_batching: samples per transformer call; None keeps the model's own default.
        max_sequence_length: the text length prompts are padded to; None keeps the family's.
        vae_tiling: decode with the VAE's own tiling; None: on for video families (see
            `DiffusersFamily`).
        encoding_cache_bytes: host memory for the prompt and image encodings a diffusers family
            keeps between requests (`rollout.encoding_cache`); the embedded model's prompt encoder
            is a lookup table it trains, and keeps none.
        attention_backend: the attention kernel the denoisers run (`AttentionBackend`); a trainer
            replays with the server's. Raises `ModelLoadError` for one with no kernel on `device`.
    """
    check_model_choice(name, path, max_sequence_length, vae_tiling)
    name, model_path = resolve_model(name, path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    attention = AttentionBackend.checked(attention_backend, device, dtype)
    if name == EMBEDDED_MODEL:
        pipeline = DigitFlowPipeline.from_pretrained(model_path, torch_dtype=dtype, device=device)
        if micro_batching is not None:
            pipeline.micro_batching = micro_batching
    else:
        pipeline = _families()[name].from_pretrained(
            model_path,
            torch_dtype=dtype,
            device=device,
            micro_batching=micro_batching,
            max_sequence_length=max_sequence_length,
            vae_tiling=vae_tiling,
            encoding_cache_bytes=encoding_cache_bytes,
        )
    pipeline.attention = attention
    return pipeline
