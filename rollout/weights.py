"""Weight updates of a pipeline's modules: full weights and LoRA adapters, from memory or (read by
`rollout.checkpoints`) from disk.

An update is all or nothing. It is checked against the live modules before anything changes
(every weight present, no unknown name, shapes equal, floating-point tensors for floating-point
weights, every value finite in the model's dtype), and `apply_update` returns the update that
undoes it, which restores the previous weights bit for bit if applying fails half-way or if
another replica refuses the same update.

LoRA adapters are PEFT's (`peft.LoraConfig`, tensors named like `blocks.0.attn.to_q.lora_A.weight`)
and are loaded with diffusers' `PeftAdapterMixin`, unmerged: the served forward is the
trainer's PEFT forward, so replaying a rollout with the trainer's adapter gives the same bits.
Nothing here knows about Ray; `deployments/weights.py` broadcasts updates to the replicas.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from rollout.errors import WeightUpdateError, short_repr

# A weight version is copied into every row every client receives and into the server's logs:
# short, and of characters that need no escaping anywhere (a version tag, a step, a timestamp).
MAX_WEIGHT_VERSION_CHARS = 128
_WEIGHT_VERSION = re.compile(r"[A-Za-z0-9._:+@/-]{1,%d}" % MAX_WEIGHT_VERSION_CHARS)


def weight_version_problem(version: str) -> str | None:
    """Why `version` cannot name weights, or None if it can."""
    if _WEIGHT_VERSION.fullmatch(version):
        return None
    return (
        f"1 to {MAX_WEIGHT_VERSION_CHARS} characters of letters, digits and ._:+@/-, "
        f"got {short_repr(version)} ({len(version)} characters)"
    )

# PEFT's default adapter name, so the served parameters have the names a trainer's adapter has.
LORA_ADAPTER_NAME = "default"
DEFAULT_TARGET_MODULE = "transformer"  # SGLang's default target of a tensor update


@dataclass(frozen=True)
class TensorLayout:
    """A weight's shape and dtype: what a checkpoint's header is checked against before its data is read."""

    shape: tuple[int, ...]
    dtype: torch.dtype


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
        return _adapted_layers(self.tensors)


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
    module = single_target(target_modules)
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
    check_known_modules(update.module_names(), modules)
    for name, state_dict in update.state_dicts.items():
        live = base_weights(modules[name])
        check_tensors(f"{name} weights", live, state_dict)
        _check_finite(f"{name} weights", live, state_dict)
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


def weights_layout(modules: Mapping[str, nn.Module]) -> dict[str, dict[str, TensorLayout]]:
    """Per module, the layout of each of its base weights: a few bytes a weight, with which a
    process that holds no model checks a checkpoint's headers (`rollout.checkpoints.disk_update`)."""
    return {
        name: {key: TensorLayout(tuple(t.shape), t.dtype) for key, t in base_weights(module).items()}
        for name, module in modules.items()
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


def single_target(target_modules: Sequence[str] | None) -> str:
    """The one module an update's tensors are for: `target_modules[0]`, by default the transformer."""
    if not target_modules:
        return DEFAULT_TARGET_MODULE
    if len(target_modules) != 1:
        raise WeightUpdateError("target_modules", f"these tensors are for one module, got {list(target_modules)}")
    return target_modules[0]


def check_known_modules(names: Iterable[str], modules: Collection[str]) -> None:
    """Refuses, naming ``target_modules``, any of `names` that is not one of the pipeline's `modules`."""
    unknown = sorted(set(names) - set(modules))
    if unknown:
        raise WeightUpdateError("target_modules", f"no such modules {unknown}; the pipeline has {sorted(modules)}")


def _adapted_layers(tensor_names: Iterable[str]) -> list[str]:
    return sorted({name.rsplit(".lora_", 1)[0] for name in tensor_names})


def lora_layout(layout: Mapping[str, TensorLayout], rank: int, tensor_names: Iterable[str]) -> dict[str, TensorLayout]:
    """The tensors PEFT gives an adapter of `rank` on the layers `tensor_names` adapt, from the base
    weights' layout, in their dtype (a layer without a matrix weight gets none, so its tensors are
    unexpected)."""
    expected = {}
    for layer in _adapted_layers(tensor_names):
        weight = layout.get(f"{layer}.weight")
        if weight is not None and len(weight.shape) == 2:
            out_features, in_features = weight.shape
            expected[f"{layer}.lora_A.weight"] = TensorLayout((rank, in_features), weight.dtype)
            expected[f"{layer}.lora_B.weight"] = TensorLayout((out_features, rank), weight.dtype)
    return expected


def check_tensors(
    what: str,
    expected: Mapping[str, torch.Tensor | TensorLayout],
    given: Mapping[str, torch.Tensor | TensorLayout],
    field: str = "named_tensors",
) -> None:
    """Refuses, naming `field`, `given` tensors (or a checkpoint's layouts of them) that are not
    `expected`'s names, shapes and kinds (floating point or not)."""
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    if missing or unexpected:
        raise WeightUpdateError(
            field,
            f"{what}: {len(missing)} missing {missing[:5]}, {len(unexpected)} unexpected {short_repr(unexpected[:5])}",
        )
    for name, tensor in given.items():
        live = expected[name]
        if tuple(tensor.shape) != tuple(live.shape):
            raise WeightUpdateError(
                field, f"{what}: {name} has shape {tuple(tensor.shape)}, the model's is {tuple(live.shape)}"
            )
        if tensor.dtype.is_floating_point != live.dtype.is_floating_point:
            raise WeightUpdateError(field, f"{what}: {name} is {tensor.dtype}, the model's is {live.dtype}")


def _check_finite(
    what: str, expected: Mapping[str, torch.Tensor | TensorLayout], given: Mapping[str, torch.Tensor]
) -> None:
    """Refuses a tensor holding a value that is not finite, or not once cast to the model's dtype
    (float64 1e300 into float32): sampling with it could only give NaN. A weight the model itself
    holds non-finite (a mask of -inf, say) may stay so."""
    for name, tensor in given.items():
        live = expected[name]
        if not tensor.is_floating_point() or _finite_as(tensor, live.dtype):
            continue
        if isinstance(live, torch.Tensor) and not _finite_as(live, live.dtype):
            continue
        raise WeightUpdateError(
            "named_tensors", f"{what}: {name} has NaN or infinite values, or values beyond the range of {live.dtype}"
        )


def _finite_as(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether every value of `tensor` is finite, and stays finite cast to `dtype`.

    One reduction (1 GiB of float32 here: 0.06 s, where `isfinite` takes 1.4 s): its extremes are
    NaN if any value is, and a cast is monotonic, so they are the values that would overflow first.
    """
    if tensor.numel() == 0:
        return True
    if tensor.dtype.itemsize == 1:  # float8 has no reductions on the CPU
        tensor = tensor.float()
    extremes = torch.stack(torch.aminmax(tensor.detach()))
    return bool(torch.isfinite(extremes.to(dtype)).all())


def check_lora_config(rank: int, alpha: float, dtypes: Iterable[torch.dtype]) -> None:
    """Refuses a LoRA rank or alpha that is not usable on layers of `dtypes`."""
    if rank < 1:
        raise WeightUpdateError("lora_rank", f"must be >= 1, got {rank}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise WeightUpdateError("lora_alpha", f"must be finite and > 0, got {alpha}")
    for dtype in dtypes:  # the adapted layers scale their LoRA term by alpha / rank in their dtype
        if alpha / rank > torch.finfo(dtype).max:
            raise WeightUpdateError("lora_alpha", f"lora_alpha / lora_rank = {alpha / rank:g} is not finite in {dtype}")


def _check_lora(name: str, module: nn.Module, adapter: LoraAdapter) -> None:
    if not hasattr(module, "add_adapter"):
        raise WeightUpdateError("target_modules", f"{name} does not take LoRA adapters (not a diffusers model)")
    layers = dict(module.named_modules())
    adapted = {}
    for layer_name in adapter.layers():
        if ".lora_" in layer_name or layer_name.endswith("base_layer"):
            raise WeightUpdateError("named_tensors", f"{name} LoRA: {layer_name!r} is not a layer of the base model")
        layer = layers.get(layer_name)
        layer = getattr(layer, "base_layer", layer)  # already wrapped by a previous adapter
        if not isinstance(layer, nn.Linear):
            raise WeightUpdateError("named_tensors", f"{name} LoRA: {layer_name} is not a linear layer of the module")
        adapted[f"{layer_name}.weight"] = TensorLayout(tuple(layer.weight.shape), layer.weight.dtype)
    expected = lora_layout(adapted, adapter.rank, adapter.tensors)
    check_lora_config(adapter.rank, adapter.alpha, {layout.dtype for layout in expected.values()})
    check_tensors(f"{name} LoRA", expected, adapter.tensors)
    _check_finite(f"{name} LoRA", expected, adapter.tensors)


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
