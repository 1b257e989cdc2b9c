"""Weight updates of a pipeline's modules: full weights and LoRA adapters, from disk or memory.

An update is all or nothing. It is checked against the live modules before anything changes
(every weight present, no unknown name, shapes equal, floating-point tensors for floating-point
weights), and `apply_update` returns the update that undoes it, which restores the previous
weights bit for bit if applying fails half-way or if another replica refuses the same update.

LoRA adapters are PEFT's (`peft.LoraConfig`, tensors named like `blocks.0.attn.to_q.lora_A.weight`)
and are loaded with diffusers' `PeftAdapterMixin`, unmerged: the served forward is the
trainer's PEFT forward, so replaying a rollout with the trainer's adapter gives the same bits.
Nothing here knows about Ray; `deployments/weights.py` broadcasts updates to the replicas.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from rollout.errors import WeightUpdateError

# PEFT's default adapter name, so the served parameters have the names a trainer's adapter has.
LORA_ADAPTER_NAME = "default"
DEFAULT_TARGET_MODULE = "transformer"  # SGLang's default target of a tensor update
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
# Prefixes PEFT and diffusers put before an adapter's tensor names when they save one.
_SAVED_ADAPTER_PREFIXES = ("base_model.model.", "transformer.")


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter for one module.

    Attributes:
        tensors: PEFT's names without the adapter name (`<layer>.lora_A.weight` `(rank, in)` and
            `<layer>.lora_B.weight` `(out, rank)` for every adapted layer).
        rank, alpha: `LoraConfig.r` and `LoraConfig.lora_alpha`; the update is scaled by alpha / rank.
    """

    tensors: dict[str, torch.Tensor]
    rank: int
    alpha: float

    def layers(self) -> list[str]:
        """The adapted layers' names in the module."""
        return sorted({name.rsplit(".lora_", 1)[0] for name in self.tensors})


@dataclass(frozen=True)
class WeightUpdate:
    """New weights for some of a pipeline's modules.

    Attributes:
        state_dicts: per module name, all of its base weights (a full replacement).
        lora: per module name, the adapter to serve on it, or None to serve it without one.
    """

    state_dicts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    lora: dict[str, LoraAdapter | None] = field(default_factory=dict)

    def module_names(self) -> list[str]:
        return sorted(set(self.state_dicts) | set(self.lora))

    def num_bytes(self) -> int:
        tensors = [t for sd in self.state_dicts.values() for t in sd.values()]
        tensors += [t for adapter in self.lora.values() if adapter is not None for t in adapter.tensors.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


def tensor_update(
    named_tensors: Mapping[str, torch.Tensor],
    target_modules: Sequence[str] | None = None,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
) -> WeightUpdate:
    """The update that named tensors from a trainer describe (SGLang's `update_weights_from_tensor`).

    Tensors for one module: its full weights, or with `lora_rank` and `lora_alpha` a LoRA adapter
    (PEFT's tensor names). The module is `target_modules[0]`, by default the transformer.
    """
    if not named_tensors:
        raise WeightUpdateError("named_tensors", "no tensors given")
    bad = [name for name, t in named_tensors.items() if not isinstance(t, torch.Tensor)]
    if bad:
        raise WeightUpdateError("named_tensors", f"not tensors: {bad[:5]}")
    module = _single_target(target_modules)
    tensors = dict(named_tensors)
    is_lora = any(".lora_" in name for name in tensors)
    if is_lora != (lora_rank is not None or lora_alpha is not None):
        raise WeightUpdateError(
            "lora_rank",
            "LoRA tensors (named *.lora_A / *.lora_B) need lora_rank and lora_alpha, and only they take them",
        )
    if is_lora:
        if lora_rank is None or lora_alpha is None:
            raise WeightUpdateError("lora_alpha", "a LoRA update needs both lora_rank and lora_alpha")
        return WeightUpdate(lora={module: LoraAdapter(tensors, int(lora_rank), float(lora_alpha))})
    return WeightUpdate(state_dicts={module: tensors})


def disk_update(
    model_path: str | os.PathLike,
    module_names: Sequence[str],
    target_modules: Sequence[str] | None = None,
    allowed_roots: Sequence[str | os.PathLike] = (),
) -> WeightUpdate:
    """The update a local checkpoint describes (SGLang's `update_weights_from_disk`).

    `model_path` is one of:
    - a pipeline directory in diffusers' `save_pretrained` layout (`<module>/*.safetensors`, or
      `<module>.safetensors` as the embedded model stores its prompt encoder): every module, or
      `target_modules`. A whole checkpoint is served as it is, so it also removes LoRA adapters.
    - a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`): a LoRA
      adapter for `target_modules[0]` (default: the transformer).
    - a `.safetensors` file: the full weights of `target_modules[0]` (default: the transformer).

    `allowed_roots`, when not empty, are the directories checkpoints may be read from.
    """
    path = _allowed_path(model_path, allowed_roots)
    if path.is_file():
        return WeightUpdate(state_dicts={_single_target(target_modules): _read_safetensors(path)})
    if (path / PEFT_CONFIG_FILE).is_file():
        return WeightUpdate(lora={_single_target(target_modules): _read_peft_adapter(path)})
    unknown = sorted(set(target_modules or ()) - set(module_names))
    if unknown:
        raise WeightUpdateError("target_modules", f"no such modules {unknown}; the pipeline has {list(module_names)}")
    names = list(target_modules or module_names)
    files = {name: _module_files(path, name) for name in names}
    missing = [name for name, found in files.items() if not found]
    if missing:
        raise WeightUpdateError(
            "model_path",
            f"{path} has no safetensors weights for {missing} (looked for <module>/*.safetensors and "
            "<module>.safetensors); no partial update is made",
        )
    state_dicts = {name: _read_safetensors(*found) for name, found in files.items()}
    lora = {} if target_modules else {name: None for name in names}
    return WeightUpdate(state_dicts=state_dicts, lora=lora)


def apply_update(modules: Mapping[str, nn.Module], update: WeightUpdate) -> WeightUpdate:
    """Applies `update` to `modules` in place, all or nothing; returns the update that undoes it."""
    check_update(modules, update)
    undo = _undo_update(modules, update)
    try:
        _write(modules, update)
    except Exception as error:
        _write(modules, undo)
        raise WeightUpdateError("named_tensors", f"applying the update failed and was undone: {error}") from error
    return undo


def check_update(modules: Mapping[str, nn.Module], update: WeightUpdate) -> None:
    """Raises `WeightUpdateError` naming everything about `update` that does not fit `modules`."""
    unknown = [name for name in update.module_names() if name not in modules]
    if unknown:
        raise WeightUpdateError("target_modules", f"no such modules {unknown}; the pipeline has {sorted(modules)}")
    for name, state_dict in update.state_dicts.items():
        _check_tensors(f"{name} weights", base_weights(modules[name]), state_dict)
    for name, adapter in update.lora.items():
        if adapter is not None:
            _check_lora(name, modules[name], adapter)


def base_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's own weights (parameters and persistent buffers) by their names without LoRA.

    With an adapter injected, PEFT renames a wrapped layer's weight `<layer>.base_layer.weight`
    and adds `lora_*` tensors; this is the module's state dict as it was before the adapter.
    The tensors are the live ones.
    """
    return {
        name.replace(".base_layer.", "."): tensor
        for name, tensor in module.state_dict(keep_vars=True).items()
        if ".lora_" not in name
    }


def served_adapter(module: nn.Module) -> LoraAdapter | None:
    """The LoRA adapter the module serves, copied; None when it serves none."""
    config = getattr(module, "peft_config", {}).get(LORA_ADAPTER_NAME)
    if config is None:
        return None
    from peft.utils import get_peft_model_state_dict

    tensors = get_peft_model_state_dict(module, adapter_name=LORA_ADAPTER_NAME)
    return LoraAdapter({k: t.detach().clone() for k, t in tensors.items()}, config.r, config.lora_alpha)


def weights_checksum(module: nn.Module) -> str:
    """SHA-256 over the module's parameters, sorted by name: each name, then its raw bytes.

    The same as SGLang's `compute_weights_checksum(module.named_parameters())`, so a trainer
    checks what a replica serves by computing it on its own copy.
    """
    hasher = hashlib.sha256()
    for name, tensor in sorted(module.named_parameters(), key=lambda item: item[0]):
        hasher.update(name.encode())
        hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def _single_target(target_modules: Sequence[str] | None) -> str:
    if not target_modules:
        return DEFAULT_TARGET_MODULE
    if len(target_modules) != 1:
        raise WeightUpdateError("target_modules", f"these tensors are for one module, got {list(target_modules)}")
    return target_modules[0]


def _allowed_path(model_path: str | os.PathLike, allowed_roots: Sequence[str | os.PathLike]) -> Path:
    path = Path(model_path).expanduser().resolve()
    roots = [Path(root).expanduser().resolve() for root in allowed_roots]
    if roots and not any(path.is_relative_to(root) for root in roots):
        raise WeightUpdateError(
            "model_path", f"{path} is outside the allowed weight paths {[str(root) for root in roots]}"
        )
    if not path.exists():
        raise WeightUpdateError("model_path", f"{path} does not exist")
    return path


def _module_files(path: Path, name: str) -> list[Path]:
    directory = path / name
    if directory.is_dir():
        return sorted(directory.glob("*.safetensors"))
    single = path / f"{name}.safetensors"
    return [single] if single.is_file() else []


def _read_safetensors(*files: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file))
        except (SafetensorError, OSError, ValueError) as error:
            raise WeightUpdateError("model_path", f"cannot read {file}: {error}") from None
    return tensors


def _read_peft_adapter(path: Path) -> LoraAdapter:
    try:
        config = json.loads((path / PEFT_CONFIG_FILE).read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise WeightUpdateError("model_path", f"{path / PEFT_CONFIG_FILE} is not a PEFT LoRA config: {error}") from None
    tensors = {}
    for name, tensor in _read_safetensors(path / PEFT_WEIGHTS_FILE).items():
        for prefix in _SAVED_ADAPTER_PREFIXES:
            name = name.removeprefix(prefix)
        tensors[name] = tensor
    return LoraAdapter(tensors, rank, alpha)


def _check_tensors(what: str, expected: Mapping[str, torch.Tensor], given: Mapping[str, torch.Tensor]) -> None:
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing or unexpected:
        raise WeightUpdateError(
            "named_tensors",
            f"{what}: {len(missing)} missing {missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}",
        )
    for name, tensor in given.items():
        live = expected[name]
        if tuple(tensor.shape) != tuple(live.shape):
            raise WeightUpdateError(
                "named_tensors", f"{what}: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(live.shape)}"
            )
        if tensor.dtype.is_floating_point != live.dtype.is_floating_point:
            raise WeightUpdateError("named_tensors", f"{what}: {name} is {tensor.dtype}, the model's is {live.dtype}")


def _check_lora(name: str, module: nn.Module, adapter: LoraAdapter) -> None:
    if not hasattr(module, "add_adapter"):
        raise WeightUpdateError("target_modules", f"{name} does not take LoRA adapters (not a diffusers model)")
    if adapter.rank < 1 or not adapter.alpha > 0:
        raise WeightUpdateError("lora_rank", f"rank must be >= 1 and alpha > 0, got {adapter.rank} and {adapter.alpha}")
    layers = dict(module.named_modules())
    expected = {}
    for layer_name in adapter.layers():
        if ".lora_" in layer_name or layer_name.endswith("base_layer"):
            raise WeightUpdateError("named_tensors", f"{name} LoRA: {layer_name!r} is not a layer of the base model")
        layer = layers.get(layer_name)
        layer = getattr(layer, "base_layer", layer)  # already wrapped by a previous adapter
        if not isinstance(layer, nn.Linear):
            raise WeightUpdateError("named_tensors", f"{name} LoRA: {layer_name} is not a linear layer of the module")
        expected[f"{layer_name}.lora_A.weight"] = torch.empty(adapter.rank, layer.in_features)
        expected[f"{layer_name}.lora_B.weight"] = torch.empty(layer.out_features, adapter.rank)
    _check_tensors(f"{name} LoRA", expected, adapter.tensors)


def _undo_update(modules: Mapping[str, nn.Module], update: WeightUpdate) -> WeightUpdate:
    return WeightUpdate(
        state_dicts={
            name: {key: t.detach().clone() for key, t in base_weights(modules[name]).items()}
            for name in update.state_dicts
        },
        lora={name: served_adapter(modules[name]) for name in update.lora},
    )


@torch.no_grad()
def _write(modules: Mapping[str, nn.Module], update: WeightUpdate) -> None:
    for name, state_dict in update.state_dicts.items():
        live = base_weights(modules[name])
        for key, tensor in state_dict.items():
            live[key].copy_(tensor)
    for name, adapter in update.lora.items():
        _serve_adapter(modules[name], adapter)


def _serve_adapter(module: nn.Module, adapter: LoraAdapter | None) -> None:
    from peft import LoraConfig
    from peft.utils import set_peft_model_state_dict

    current = getattr(module, "peft_config", {}).get(LORA_ADAPTER_NAME)
    same_shape = (
        current is not None
        and adapter is not None
        and (current.r, current.lora_alpha) == (adapter.rank, adapter.alpha)
        and set(current.target_modules) == set(adapter.layers())
    )
    if current is not None and not same_shape:
        module.unload_lora()
    if adapter is None:
        return
    if not same_shape:
        config = LoraConfig(r=adapter.rank, lora_alpha=adapter.alpha, target_modules=adapter.layers())
        module.add_adapter(config, adapter_name=LORA_ADAPTER_NAME)
        module.requires_grad_(False)  # served, not trained
    result = set_peft_model_state_dict(module, adapter.tensors, adapter_name=LORA_ADAPTER_NAME)
    if result.unexpected_keys:
        raise WeightUpdateError("named_tensors", f"LoRA tensors PEFT did not load: {result.unexpected_keys[:5]}")
