"""Weight updates of a pipeline's modules: full weights and LoRA adapters, from disk or memory.

An update is all or nothing. It is checked against the live modules before anything changes
(every weight present, no unknown name, shapes equal, floating-point tensors for floating-point
weights, every value finite in the model's dtype), and `apply_update` returns the update that
undoes it, which restores the previous weights bit for bit if applying fails half-way or if
another replica refuses the same update.

A checkpoint on disk is read without safetensors' loader. Every path is resolved once and must
stay under the allowed roots; every file is opened without following a symlink and without
blocking, and must be a regular file (a FIFO or a device is refused, never waited on). A file's
header is checked against its size, and, given the pipeline's `weights_layout`, against the
model's names and shapes, before any of its data is read; each tensor is then read straight into
its own buffer. Refusals name the path as it was given, never what it resolves to, and say the
same of a path that does not exist as of one this process cannot read.

LoRA adapters are PEFT's (`peft.LoraConfig`, tensors named like `blocks.0.attn.to_q.lora_A.weight`)
and are loaded with diffusers' `PeftAdapterMixin`, unmerged: the served forward is the
trainer's PEFT forward, so replaying a rollout with the trainer's adapter gives the same bits.
Nothing here knows about Ray; `deployments/weights.py` broadcasts updates to the replicas.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import struct
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from rollout.codec import SAFETENSORS_DTYPES
from rollout.errors import WeightUpdateError, clip, short_repr

# PEFT's default adapter name, so the served parameters have the names a trainer's adapter has.
LORA_ADAPTER_NAME = "default"
DEFAULT_TARGET_MODULE = "transformer"  # SGLang's default target of a tensor update
PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
# Prefixes PEFT and diffusers put before an adapter's tensor names when they save one.
_SAVED_ADAPTER_PREFIXES = ("base_model.model.", "transformer.")
# A safetensors header takes about 100 bytes a tensor, so this is room for 100,000s of tensors;
# it bounds what a file can make this process hold before anything in it is checked.
MAX_SAFETENSORS_HEADER_BYTES = 16 * 2**20
MAX_ADAPTER_CONFIG_BYTES = 2**20
# One answer for every path that cannot be opened as a checkpoint: a refusal must not tell whether
# something exists where the caller cannot read.
_UNREADABLE = "does not exist, cannot be read, or is not a regular file or directory"


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
    modules: Sequence[str] | Mapping[str, Mapping[str, TensorLayout]],
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

    `modules` are the pipeline's module names, or better their `weights_layout`: with it, the
    tensor names and shapes in each file's header are checked against the model's before any
    data is read, so a checkpoint of another model is refused at once, whatever its size.

    `allowed_roots`, when not empty, are the directories checkpoints may be read from: the path
    and every file read, symlinks resolved, must be under one of them. Empty: any path this
    process can read.
    """
    given = os.fspath(model_path)
    if not given:
        raise WeightUpdateError(
            "model_path", "is empty; give a checkpoint directory, a PEFT adapter directory or a .safetensors file"
        )
    layouts = modules if isinstance(modules, Mapping) else dict.fromkeys(modules)
    roots = [Path(root).expanduser().resolve() for root in allowed_roots]
    path = _resolved(Path(given), roots, _shown(given))
    if not _is_directory(path, _shown(given)):
        module = _known_target(target_modules, layouts)
        return WeightUpdate(state_dicts=_read_weights({module: [(path, _shown(given))]}, layouts, roots))
    if os.path.lexists(path / PEFT_CONFIG_FILE):
        module = _known_target(target_modules, layouts)
        return WeightUpdate(lora={module: _read_peft_adapter(path, given, module, layouts[module], roots)})
    _check_known(target_modules or (), layouts)
    names = list(target_modules or layouts)
    files = {name: _module_files(path, given, name, roots) for name in names}
    missing = [name for name, found in files.items() if not found]
    if missing:
        raise WeightUpdateError(
            "model_path",
            f"{_shown(given)} has no safetensors weights for {missing} (looked for <module>/*.safetensors and "
            "<module>.safetensors); no partial update is made",
        )
    lora = {} if target_modules else {name: None for name in names}
    return WeightUpdate(state_dicts=_read_weights(files, layouts, roots), lora=lora)


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
    _check_known(update.module_names(), modules)
    for name, state_dict in update.state_dicts.items():
        live = base_weights(modules[name])
        _check_tensors(f"{name} weights", live, state_dict)
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
    process that holds no model checks a checkpoint's headers (`disk_update`)."""
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


def _single_target(target_modules: Sequence[str] | None) -> str:
    if not target_modules:
        return DEFAULT_TARGET_MODULE
    if len(target_modules) != 1:
        raise WeightUpdateError("target_modules", f"these tensors are for one module, got {list(target_modules)}")
    return target_modules[0]


def _known_target(target_modules: Sequence[str] | None, layouts: Collection[str]) -> str:
    module = _single_target(target_modules)
    _check_known([module], layouts)
    return module


def _check_known(names: Iterable[str], modules: Collection[str]) -> None:
    unknown = sorted(set(names) - set(modules))
    if unknown:
        raise WeightUpdateError("target_modules", f"no such modules {unknown}; the pipeline has {sorted(modules)}")


def _shown(given: str) -> str:
    """A path as a refusal names it: as given, clipped, quoted (a newline in it stays in its line)."""
    return repr(clip(given))


def _unreadable(shown: str) -> WeightUpdateError:
    return WeightUpdateError("model_path", f"{shown} {_UNREADABLE}")


def _not_safetensors(shown: str, reason: str) -> WeightUpdateError:
    return WeightUpdateError("model_path", f"{shown} is not a safetensors file: {reason}")


def _resolved(path: Path, roots: Sequence[Path], shown: str) -> Path:
    """`path` with its symlinks resolved, refused unless it is under one of `roots` (if any).

    Resolved as far as it exists, so that a path outside the roots is refused the same way
    whether or not it exists.
    """
    try:
        resolved = path.expanduser().resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long, a NUL byte
        raise _unreadable(shown) from None
    if roots and not any(resolved.is_relative_to(root) for root in roots):
        raise WeightUpdateError("model_path", f"{shown} is outside the allowed weight paths (allowed_weight_paths)")
    return resolved


def _is_directory(path: Path, shown: str) -> bool:
    """Whether `path` is a directory this process can list; False for a regular file; refused otherwise."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        raise _unreadable(shown) from None
    if stat.S_ISDIR(mode) and os.access(path, os.R_OK | os.X_OK):
        return True
    if stat.S_ISREG(mode):
        return False
    raise _unreadable(shown)


def _module_files(path: Path, given: str, name: str, roots: Sequence[Path]) -> list[tuple[Path, str]]:
    """A module's safetensors files in a checkpoint directory, each with its name in refusals."""
    directory = _resolved(path / name, roots, _shown(os.path.join(given, name)))
    try:
        entries = sorted(entry for entry in os.listdir(directory) if entry.endswith(".safetensors"))
    except (FileNotFoundError, NotADirectoryError):
        single = f"{name}.safetensors"
        return [(path / single, _shown(os.path.join(given, single)))] if os.path.lexists(path / single) else []
    except OSError:
        raise _unreadable(_shown(os.path.join(given, name))) from None
    return [(directory / entry, _shown(os.path.join(given, name, entry))) for entry in entries]


@contextmanager
def _opened(path: Path, roots: Sequence[Path], shown: str) -> Iterator[tuple[int, int]]:
    """A regular file under `roots`, open for reading: its descriptor and size.

    Opened by its resolved path without following a symlink, so that one swapped in since it was
    resolved fails; and without blocking, so that a FIFO is refused rather than waited on.
    """
    resolved = _resolved(path, roots, shown)
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError):
        raise _unreadable(shown) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _unreadable(shown)
        yield fd, info.st_size
    finally:
        os.close(fd)


def _read_exactly(fd: int, buffer: memoryview, offset: int, shown: str) -> None:
    done = 0
    while done < len(buffer):
        try:
            count = os.preadv(fd, [buffer[done:]], offset + done)
        except OSError:
            raise _unreadable(shown) from None
        if count == 0:
            raise _not_safetensors(shown, "it ends before the data its header describes (changed while read?)")
        done += count


@dataclass(frozen=True)
class _StoredTensor:
    """A tensor in an open safetensors file whose header was checked: where its bytes are."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fd: int
    offset: int
    num_bytes: int
    shown: str  # the file, as refusals name it

    def read(self) -> torch.Tensor:
        tensor = torch.empty(self.shape, dtype=self.dtype)
        _read_exactly(self.fd, memoryview(tensor.reshape(-1).view(torch.uint8).numpy()), self.offset, self.shown)
        return tensor


def _read_weights(
    files: Mapping[str, Sequence[tuple[Path, str]]],
    layouts: Mapping[str, Mapping[str, TensorLayout] | None],
    roots: Sequence[Path],
) -> dict[str, dict[str, torch.Tensor]]:
    """Per module, the tensors of its safetensors files; every file's header is checked against
    the module's layout (if known) before any data is read."""
    with ExitStack() as stack:
        stored = {
            name: stack.enter_context(_stored_tensors(found, roots, f"{name} weights")) for name, found in files.items()
        }
        for name, tensors in stored.items():
            if layouts[name] is not None:
                _check_tensors(f"{name} weights", layouts[name], tensors, "model_path")
        return {name: {key: tensor.read() for key, tensor in tensors.items()} for name, tensors in stored.items()}


@contextmanager
def _stored_tensors(
    files: Sequence[tuple[Path, str]], roots: Sequence[Path], what: str
) -> Iterator[dict[str, _StoredTensor]]:
    """The tensors that safetensors files hold, by name, the files open until the context ends."""
    with ExitStack() as stack:
        stored: dict[str, _StoredTensor] = {}
        for path, shown in files:
            fd, size = stack.enter_context(_opened(path, roots, shown))
            tensors = _safetensors_header(fd, size, shown)
            twice = sorted(set(tensors) & set(stored))
            if twice:
                raise WeightUpdateError("model_path", f"{what}: {short_repr(twice)} are in more than one file")
            stored.update(tensors)
        yield stored


def _safetensors_header(fd: int, size: int, shown: str) -> dict[str, _StoredTensor]:
    """The tensors a safetensors file's header describes, checked against the file: a known dtype,
    as many bytes as the shape takes, and data that follow each other and fill the file exactly."""
    if size < 8:
        raise _not_safetensors(shown, "it is too short")
    prelude = bytearray(8)
    _read_exactly(fd, memoryview(prelude), 0, shown)
    (header_bytes,) = struct.unpack("<Q", prelude)
    if header_bytes > min(size - 8, MAX_SAFETENSORS_HEADER_BYTES):
        raise _not_safetensors(shown, f"its header is longer than the file or {MAX_SAFETENSORS_HEADER_BYTES} bytes")
    raw = bytearray(header_bytes)
    _read_exactly(fd, memoryview(raw), 8, shown)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):
        raise _not_safetensors(shown, "its header is not JSON naming each tensor once") from None
    if not isinstance(header, dict):
        raise _not_safetensors(shown, "its header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + header_bytes
    tensors = {name: _stored_tensor(name, entry, fd, data_start, shown) for name, entry in header.items()}
    end = data_start
    for name, tensor in sorted(tensors.items(), key=lambda item: (item[1].offset, item[1].num_bytes)):
        if tensor.offset != end:
            raise _not_safetensors(shown, f"{short_repr(name)} does not start where the tensor before it ends")
        end += tensor.num_bytes
    if end != size:
        data_bytes = size - data_start
        raise _not_safetensors(shown, f"its tensors take {end - data_start} bytes, {data_bytes} follow its header")
    return tensors


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    entries = dict(pairs)
    if len(entries) != len(pairs):
        raise ValueError("a name is given twice")
    return entries


def _stored_tensor(name: str, entry: object, fd: int, data_start: int, shown: str) -> _StoredTensor:
    shown_name = short_repr(name)
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise _not_safetensors(shown, f"the entry of {shown_name} is not a dtype, a shape and data offsets") from None
    dtype = SAFETENSORS_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        known = list(SAFETENSORS_DTYPES)
        raise _not_safetensors(shown, f"{shown_name} has dtype {short_repr(dtype_name)}, not one of {known}")
    counts = [*shape, begin, end] if isinstance(shape, list) else None
    if counts is None or not all(type(count) is int and count >= 0 for count in counts) or begin > end:
        raise _not_safetensors(shown, f"{shown_name} has a shape or data offsets that are not counts")
    num_bytes = math.prod(shape) * dtype.itemsize
    if end - begin != num_bytes:
        raise _not_safetensors(
            shown, f"{shown_name} has {end - begin} bytes of data, its shape and dtype take {num_bytes}"
        )
    return _StoredTensor(tuple(shape), dtype, fd, data_start + begin, num_bytes, shown)


def _read_peft_adapter(
    path: Path, given: str, module: str, layout: Mapping[str, TensorLayout] | None, roots: Sequence[Path]
) -> LoraAdapter:
    config_shown = _shown(os.path.join(given, PEFT_CONFIG_FILE))
    with _opened(path / PEFT_CONFIG_FILE, roots, config_shown) as (fd, size):
        if size > MAX_ADAPTER_CONFIG_BYTES:
            raise WeightUpdateError("model_path", f"{config_shown} is over {MAX_ADAPTER_CONFIG_BYTES} bytes")
        raw = bytearray(size)
        _read_exactly(fd, memoryview(raw), 0, config_shown)
    try:
        config = json.loads(raw)
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        raise WeightUpdateError("model_path", f"{config_shown} is not a PEFT LoRA config (r, lora_alpha)") from None
    what = f"{module} LoRA"
    weights_file = (path / PEFT_WEIGHTS_FILE, _shown(os.path.join(given, PEFT_WEIGHTS_FILE)))
    with _stored_tensors([weights_file], roots, what) as stored:
        stored = {_without_saved_prefix(name): tensor for name, tensor in stored.items()}
        if layout is not None:
            expected = _lora_layout(layout, rank, _adapted_layers(stored))
            _check_lora_config(rank, alpha, {tensor.dtype for tensor in expected.values()})
            _check_tensors(what, expected, stored, "model_path")
        return LoraAdapter({name: tensor.read() for name, tensor in stored.items()}, rank, alpha)


def _without_saved_prefix(name: str) -> str:
    for prefix in _SAVED_ADAPTER_PREFIXES:
        name = name.removeprefix(prefix)
    return name


def _adapted_layers(tensor_names: Iterable[str]) -> list[str]:
    return sorted({name.rsplit(".lora_", 1)[0] for name in tensor_names})


def _lora_layout(layout: Mapping[str, TensorLayout], rank: int, layers: Iterable[str]) -> dict[str, TensorLayout]:
    """The tensors PEFT gives an adapter of `rank` on `layers`, from the base weights' layout (a
    layer without a matrix weight gets none, so its tensors are unexpected)."""
    expected = {}
    for layer in layers:
        weight = layout.get(f"{layer}.weight")
        if weight is not None and len(weight.shape) == 2:
            out_features, in_features = weight.shape
            expected[f"{layer}.lora_A.weight"] = TensorLayout((rank, in_features), weight.dtype)
            expected[f"{layer}.lora_B.weight"] = TensorLayout((out_features, rank), weight.dtype)
    return expected


def _check_tensors(
    what: str,
    expected: Mapping[str, torch.Tensor | TensorLayout],
    given: Mapping[str, torch.Tensor | TensorLayout],
    field: str = "named_tensors",
) -> None:
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


def _check_lora_config(rank: int, alpha: float, dtypes: Iterable[torch.dtype]) -> None:
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
    expected = {}
    for layer_name in adapter.layers():
        if ".lora_" in layer_name or layer_name.endswith("base_layer"):
            raise WeightUpdateError("named_tensors", f"{name} LoRA: {layer_name!r} is not a layer of the base model")
        layer = layers.get(layer_name)
        layer = getattr(layer, "base_layer", layer)  # already wrapped by a previous adapter
        if not isinstance(layer, nn.Linear):
            raise WeightUpdateError("named_tensors", f"{name} LoRA: {layer_name} is not a linear layer of the module")
        # PEFT gives the adapter its layer's dtype.
        expected[f"{layer_name}.lora_A.weight"] = TensorLayout((adapter.rank, layer.in_features), layer.weight.dtype)
        expected[f"{layer_name}.lora_B.weight"] = TensorLayout((layer.out_features, adapter.rank), layer.weight.dtype)
    _check_lora_config(adapter.rank, adapter.alpha, {layout.dtype for layout in expected.values()})
    _check_tensors(f"{name} LoRA", expected, adapter.tensors)
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
