"""Checkpoints on disk: the weight update a checkpoint directory, a PEFT adapter or a safetensors
file describes (SGLang's `update_weights_from_disk`); `rollout.weights` applies it.

A checkpoint is read without safetensors' loader. Every path is resolved once and must stay under
the allowed roots; every file is opened without following a symlink and without blocking, and
must be a regular file (a FIFO or a device is refused, never waited on). A file's header is
checked against its size (`rollout.safetensors_header`), and, given the pipeline's
`weights_layout`, against the model's names and shapes, before any of its data is read; each
tensor is then read straight into its own buffer.

Refusals name the path as it was given, never what it resolves to. Every path that cannot be read
as a checkpoint (missing, unreadable, outside the allowed roots, a directory where a file is
wanted, a file that is no safetensors file or PEFT config) gets one message,
`UnreadableCheckpointError`, whose `cause` only the server logs: otherwise a client could probe the
file system through refusals. A checkpoint that was read says why it does not fit the model (its
tensors' names and shapes, its LoRA rank): that tells only what a safetensors file holds.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.errors import WeightUpdateError, clip, short_repr
from rollout.safetensors_header import (
    HEADER_LENGTH_BYTES,
    SAFETENSORS_DTYPES,
    SafetensorsHeaderError,
    TensorEntry,
    header_length,
    tensor_entries,
)
from rollout.weights import (
    LoraAdapter,
    TensorLayout,
    WeightUpdate,
    check_known_modules,
    check_lora_config,
    check_tensors,
    lora_layout,
    single_target,
)

PEFT_CONFIG_FILE = "adapter_config.json"
PEFT_WEIGHTS_FILE = "adapter_model.safetensors"
# Prefixes PEFT and diffusers put before an adapter's tensor names when they save one.
_SAVED_ADAPTER_PREFIXES = ("base_model.model.", "transformer.")
# A safetensors header takes about 100 bytes a tensor, so this is room for 100,000s of tensors;
# it bounds what a file can make this process hold before anything in it is checked.
MAX_SAFETENSORS_HEADER_BYTES = 16 * 2**20
MAX_ADAPTER_CONFIG_BYTES = 2**20
MAX_CAUSE_CHARS = 500  # a cause names paths and OS errors: a log line's worth
_UNREADABLE = (
    "cannot be read as a checkpoint (it is missing, unreadable, outside the allowed weight paths, or not a "
    "safetensors file, PEFT adapter or pipeline directory; the server log says which)"
)


class UnreadableCheckpointError(WeightUpdateError):
    """A path that cannot be read as a checkpoint, whatever the reason, in one message.

    Attributes:
        cause: which reason, for the server log only: it tells what is on the server's disk.
    """

    def __init__(self, shown: str, cause: str):
        self.shown, self.cause = shown, clip(cause, MAX_CAUSE_CHARS)
        super().__init__("model_path", f"{shown} {_UNREADABLE}")

    def __reduce__(self):
        return (type(self), (self.shown, self.cause))


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
    # Checked before the path, so that no refusal of the request's own fields depends on what is on disk.
    check_known_modules(target_modules or (), layouts)
    roots = [Path(root).expanduser().resolve() for root in allowed_roots]
    try:
        return _checkpoint_update(given, layouts, target_modules, roots)
    except UnreadableCheckpointError as error:
        if error.shown == _shown(given):
            raise
        # Named by the path as given: naming a file in it would tell what the directory holds.
        raise UnreadableCheckpointError(_shown(given), f"{error.shown}: {error.cause}") from None


def _checkpoint_update(
    given: str,
    layouts: Mapping[str, Mapping[str, TensorLayout] | None],
    target_modules: Sequence[str] | None,
    roots: Sequence[Path],
) -> WeightUpdate:
    path = _resolved(Path(given), roots, _shown(given))
    if not _is_directory(path, _shown(given)):
        module = _single_target(target_modules, layouts, _shown(given), "a safetensors file")
        return WeightUpdate(state_dicts=_read_weights({module: [(path, _shown(given))]}, layouts, roots))
    if os.path.lexists(path / PEFT_CONFIG_FILE):
        module = _single_target(target_modules, layouts, _shown(given), "a PEFT adapter")
        return WeightUpdate(lora={module: _read_peft_adapter(path, given, module, layouts[module], roots)})
    names = list(target_modules or layouts)
    files = {name: _module_files(path, given, name, roots) for name in names}
    missing = [name for name, found in files.items() if not found]
    if missing:
        raise UnreadableCheckpointError(
            _shown(given),
            f"a directory with no safetensors weights for {missing} (looked for <module>/*.safetensors and "
            "<module>.safetensors); no partial update is made",
        )
    lora = {} if target_modules else {name: None for name in names}
    return WeightUpdate(state_dicts=_read_weights(files, layouts, roots), lora=lora)


def _single_target(
    target_modules: Sequence[str] | None, layouts: Collection[str], shown: str, kind: str
) -> str:
    """The one module `kind` of checkpoint holds. Several targets get the one refusal of an
    unreadable path: a refusal naming the kind would tell that such a checkpoint is there."""
    try:
        module = single_target(target_modules)
    except WeightUpdateError as error:
        raise UnreadableCheckpointError(shown, f"{kind}, which holds one module: {error}") from None
    check_known_modules([module], layouts)
    return module


def _shown(given: str) -> str:
    """A path as a refusal names it: as given, clipped, quoted (a newline in it stays in its line)."""
    return repr(clip(given))


def _not_safetensors(shown: str, reason: str) -> UnreadableCheckpointError:
    return UnreadableCheckpointError(shown, f"not a safetensors file: {reason}")


def _resolved(path: Path, roots: Sequence[Path], shown: str) -> Path:
    """`path` with its symlinks resolved, refused unless it is under one of `roots` (if any).

    Resolved as far as it exists, so that a path outside the roots is refused the same way
    whether or not it exists.
    """
    try:
        resolved = path.expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as error:  # a symlink loop, a name too long, a NUL byte
        raise UnreadableCheckpointError(shown, f"cannot be resolved: {error!r}") from None
    if roots and not any(resolved.is_relative_to(root) for root in roots):
        raise UnreadableCheckpointError(shown, f"resolves to {str(resolved)!r}, outside allowed_weight_paths")
    return resolved


def _is_directory(path: Path, shown: str) -> bool:
    """Whether `path` is a directory this process can list; False for a regular file; refused otherwise."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as error:
        raise UnreadableCheckpointError(shown, f"cannot be examined: {error!r}") from None
    if stat.S_ISDIR(mode) and os.access(path, os.R_OK | os.X_OK):
        return True
    if stat.S_ISREG(mode):
        return False
    raise UnreadableCheckpointError(shown, f"neither a regular file nor a listable directory (mode {mode:o})")


def _module_files(path: Path, given: str, name: str, roots: Sequence[Path]) -> list[tuple[Path, str]]:
    """A module's safetensors files in a checkpoint directory, each with its name in refusals."""
    directory = _resolved(path / name, roots, _shown(os.path.join(given, name)))
    try:
        entries = sorted(entry for entry in os.listdir(directory) if entry.endswith(".safetensors"))
    except (FileNotFoundError, NotADirectoryError):
        single = f"{name}.safetensors"
        return [(path / single, _shown(os.path.join(given, single)))] if os.path.lexists(path / single) else []
    except OSError as error:
        raise UnreadableCheckpointError(_shown(os.path.join(given, name)), f"cannot be listed: {error!r}") from None
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
    except (OSError, ValueError) as error:
        raise UnreadableCheckpointError(shown, f"cannot be opened: {error!r}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableCheckpointError(shown, f"not a regular file (mode {info.st_mode:o})")
        yield fd, info.st_size
    finally:
        os.close(fd)


def _read_exactly(fd: int, buffer: memoryview, offset: int, shown: str) -> None:
    done = 0
    while done < len(buffer):
        try:
            count = os.preadv(fd, [buffer[done:]], offset + done)
        except OSError as error:
            raise UnreadableCheckpointError(shown, f"cannot be read: {error!r}") from None
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

    @classmethod
    def at(cls, entry: TensorEntry, fd: int, data_start: int, shown: str) -> "_StoredTensor":
        return cls(entry.shape, entry.dtype, fd, data_start + entry.begin, entry.end - entry.begin, shown)

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
                check_tensors(f"{name} weights", layouts[name], tensors, "model_path")
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
            tensors = _tensors_in(fd, size, shown)
            twice = sorted(set(tensors) & set(stored))
            if twice:
                raise WeightUpdateError("model_path", f"{what}: {short_repr(twice)} are in more than one file")
            stored.update(tensors)
        yield stored


def _tensors_in(fd: int, size: int, shown: str) -> dict[str, _StoredTensor]:
    """The tensors a safetensors file's header describes, checked against the file."""
    prelude = bytearray(min(size, HEADER_LENGTH_BYTES))
    _read_exactly(fd, memoryview(prelude), 0, shown)
    try:
        data_start = HEADER_LENGTH_BYTES + header_length(prelude, size, MAX_SAFETENSORS_HEADER_BYTES)
        header = bytearray(data_start - HEADER_LENGTH_BYTES)
        _read_exactly(fd, memoryview(header), HEADER_LENGTH_BYTES, shown)
        entries = tensor_entries(header, size - data_start, SAFETENSORS_DTYPES)
    except SafetensorsHeaderError as error:
        raise _not_safetensors(shown, str(error)) from None
    return {name: _StoredTensor.at(entry, fd, data_start, shown) for name, entry in entries.items()}


def _read_peft_adapter(
    path: Path, given: str, module: str, layout: Mapping[str, TensorLayout] | None, roots: Sequence[Path]
) -> LoraAdapter:
    config_shown = _shown(os.path.join(given, PEFT_CONFIG_FILE))
    with _opened(path / PEFT_CONFIG_FILE, roots, config_shown) as (fd, size):
        if size > MAX_ADAPTER_CONFIG_BYTES:
            raise UnreadableCheckpointError(config_shown, f"over {MAX_ADAPTER_CONFIG_BYTES} bytes")
        raw = bytearray(size)
        _read_exactly(fd, memoryview(raw), 0, config_shown)
    try:
        config = json.loads(raw)
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError):
        raise UnreadableCheckpointError(config_shown, "not a PEFT LoRA config (r, lora_alpha)") from None
    what = f"{module} LoRA"
    weights_file = (path / PEFT_WEIGHTS_FILE, _shown(os.path.join(given, PEFT_WEIGHTS_FILE)))
    with _stored_tensors([weights_file], roots, what) as stored:
        stored = {_without_saved_prefix(name): tensor for name, tensor in stored.items()}
        if layout is not None:
            expected = lora_layout(layout, rank, stored)
            check_lora_config(rank, alpha, {tensor.dtype for tensor in expected.values()})
            check_tensors(what, expected, stored, "model_path")
        return LoraAdapter({name: tensor.read() for name, tensor in stored.items()}, rank, alpha)


def _without_saved_prefix(name: str) -> str:
    for prefix in _SAVED_ADAPTER_PREFIXES:
        name = name.removeprefix(prefix)
    return name

