"""The header of a safetensors file, read and checked without safetensors' loader.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each tensor's
name to its dtype, shape and data offsets (and `__metadata__` to strings), then the tensors' bytes.
Both readers of such files go through here, with limits of their own: the codec
(`rollout.codec.tensor_from_safetensors`, a tensor envelope's one-tensor file, in memory) and the
checkpoint reader (`rollout.checkpoints`, files on disk, read only once their header is checked).
A header is checked against the file's size before any data is trusted: every entry a known
dtype, a shape and offsets of counts, as many bytes as its shape takes, the tensors' data one after
another filling the file exactly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import NamedTuple

import torch

from rollout.errors import short_repr

# The safetensors format's dtype names (its `Dtype`), for every file this project reads.
SAFETENSORS_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "U16": torch.uint16,
    "I16": torch.int16,
    "U32": torch.uint32,
    "I32": torch.int32,
    "U64": torch.uint64,
    "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
HEADER_LENGTH_BYTES = 8
_METADATA_KEY = "__metadata__"
_METADATA_NAME = _METADATA_KEY.encode()
# A one-tensor header as safetensors and `rollout.codec` write it, read without a JSON parser:
# responses carry hundreds of small tensors. Counts of up to 19 digits (any int64) written as JSON
# writes them; anything else is left to the JSON parser, which refuses what is not JSON.
_COUNT = rb"(?:0|[1-9][0-9]{0,18})"
_ONE_TENSOR_HEADER = re.compile(
    rb'\{"([\w.\-]+)":\{"dtype":"([A-Z0-9_]+)","shape":\[((?:' + _COUNT + rb",)*" + _COUNT + rb")?\],"
    rb'"data_offsets":\[(' + _COUNT + rb"),(" + _COUNT + rb")\]\}\} *"
)


class SafetensorsHeaderError(ValueError):
    """A file is not a safetensors file; the message says why. Each reader turns it into its own
    refusal, naming what it read."""


# A tuple rather than a frozen dataclass: one is made for every tensor a body carries.
class TensorEntry(NamedTuple):
    """A tensor as a checked header describes it: `begin` and `end` count bytes from the end of
    the header."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def header_length(prelude: bytes | bytearray | memoryview, file_bytes: int, max_header_bytes: int) -> int:
    """The length of the header a file of `file_bytes` declares in its first 8 bytes (`prelude`),
    refused if it is longer than the rest of the file or `max_header_bytes`: it bounds what the
    file makes the reader hold before anything in it is checked."""
    if file_bytes < HEADER_LENGTH_BYTES:
        raise SafetensorsHeaderError("it is too short for its header length")
    length = int.from_bytes(prelude[:HEADER_LENGTH_BYTES], "little")
    if length > min(file_bytes - HEADER_LENGTH_BYTES, max_header_bytes):
        raise SafetensorsHeaderError(
            f"header length {length} is out of range: longer than the file or {max_header_bytes} bytes"
        )
    return length


def tensor_entries(
    header: bytes | bytearray | memoryview, data_bytes: int, dtypes: Mapping[str, torch.dtype]
) -> dict[str, TensorEntry]:
    """The tensors a header describes, by name, checked against the `data_bytes` that follow it;
    a dtype not in `dtypes` (safetensors' names) is refused."""
    one_tensor = _ONE_TENSOR_HEADER.fullmatch(header)
    if one_tensor is not None and one_tensor[1] != _METADATA_NAME:
        # The pattern admits only counts: what is left to check is the dtype and the data's size.
        name, dtype_name, sizes, begin, end = one_tensor.groups()
        shape = tuple(map(int, sizes.split(b","))) if sizes else ()
        name = name.decode()
        tensors = {name: _sized_entry(name, dtype_name.decode(), shape, int(begin), int(end), dtypes)}
    else:
        tensors = {
            name: _sized_entry(name, *_counted_parts(name, *_entry_parts(name, entry)), dtypes)
            for name, entry in _parsed(header).items()
        }
    ordered = tensors.items() if len(tensors) == 1 else sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end))
    end = 0
    for name, tensor in ordered:
        if tensor.begin != end:
            raise SafetensorsHeaderError(f"{short_repr(name)} does not start where the tensor before it ends")
        end = tensor.end
    if end != data_bytes:
        raise SafetensorsHeaderError(f"its tensors take {end} bytes, {data_bytes} follow its header")
    return tensors


def _parsed(header: bytes | bytearray | memoryview) -> dict[str, object]:
    try:
        entries = json.loads(bytes(header), object_pairs_hook=_unique_keys)
    except (ValueError, RecursionError):  # a UnicodeDecodeError is a ValueError
        raise SafetensorsHeaderError("its header is not JSON naming each tensor once") from None
    if not isinstance(entries, dict):
        raise SafetensorsHeaderError("its header is not a map")
    entries.pop(_METADATA_KEY, None)
    return entries


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    entries = dict(pairs)
    if len(entries) != len(pairs):
        raise ValueError("a name is given twice")
    return entries


def _entry_parts(name: str, entry: object) -> tuple[object, object, object, object]:
    """A header entry's dtype, shape, and first and last data offsets, as they are written."""
    try:
        dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise SafetensorsHeaderError(
            f"the entry of {short_repr(name)} is not a dtype, a shape and data offsets"
        ) from None
    return dtype_name, shape, begin, end


def _counted_parts(
    name: str, dtype_name: object, shape: object, begin: object, end: object
) -> tuple[object, tuple[int, ...], int, int]:
    """A JSON entry's parts, its shape and offsets checked to be counts."""
    counts = [*shape, begin, end] if isinstance(shape, list) else None
    if counts is None or not all(type(count) is int and count >= 0 for count in counts):
        raise SafetensorsHeaderError(f"{short_repr(name)} has a shape or data offsets that are not counts")
    return dtype_name, tuple(shape), begin, end


def _sized_entry(
    name: str, dtype_name: object, shape: tuple[int, ...], begin: int, end: int, dtypes: Mapping[str, torch.dtype]
) -> TensorEntry:
    dtype = dtypes.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise SafetensorsHeaderError(f"{short_repr(name)} has dtype {short_repr(dtype_name)}, not one of {list(dtypes)}")
    if begin > end:
        raise SafetensorsHeaderError(f"{short_repr(name)} has a shape or data offsets that are not counts")
    num_bytes = math.prod(shape) * dtype.itemsize
    if end - begin != num_bytes:
        raise SafetensorsHeaderError(
            f"{short_repr(name)} has {end - begin} bytes of data, its shape and dtype take {num_bytes}"
        )
    return TensorEntry(dtype, shape, begin, end)
