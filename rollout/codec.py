"""The tensor envelope that carries tensors across process and HTTP boundaries.

Compatible with SGLang's diffusion rollout API: a tensor travels as
``{"__tensor__": true, "data": <a safetensors file holding it under key "t">, "shape": [...],
"dtype": "torch.float32"}``; `data` is raw bytes in msgpack bodies and base64 text in JSON.
Decoding parses safetensors and msgpack only, so it never unpickles anything.

The one-tensor safetensors file is written here and read with `rollout.safetensors_header`
rather than through safetensors' dict API, whose per-call work dominated small tensors and copied
large ones several times (`docs/benchmarks.md`): an 8-byte little-endian header length, a JSON
header padded with spaces to a multiple of 8, then the bytes. `tests/test_codec.py` checks that the
bytes are the library's, byte for byte, and that the library reads them.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from rollout.errors import CodecError, short_repr
from rollout.safetensors_header import (
    HEADER_LENGTH_BYTES,
    SAFETENSORS_DTYPES,
    SafetensorsHeaderError,
    header_length,
    tensor_entries,
)

# The media type of a msgpack body, both ways.
MSGPACK = "application/msgpack"
TENSOR_MARKER = "__tensor__"
_TENSOR_KEY = "t"
# The dtypes a tensor envelope carries (SGLang's), by safetensors name.
_TORCH_DTYPES = {
    name: SAFETENSORS_DTYPES[name] for name in ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")
}
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _TORCH_DTYPES.items()}
# A one-tensor header is about 100 bytes; safetensors allows 100 MB, which as JSON took 1.6 GB
# and 3.8 s to refuse. This leaves room for a shape of any rank and some `__metadata__`.
_MAX_HEADER_BYTES = 64 * 2**10


def _safetensors_parts(tensor: torch.Tensor) -> tuple[bytes, Any, int]:
    """A one-tensor safetensors file as (header length and header, a byte view of the data, its size).

    Per-tensor work is kept to the few calls it needs: responses carry hundreds of small tensors.
    """
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    name = _SAFETENSORS_DTYPES.get(tensor.dtype)
    if name is None:
        raise CodecError(f"tensor dtype {tensor.dtype} has no safetensors encoding")
    nbytes = tensor.nbytes
    header = f'{{"{_TENSOR_KEY}":{{"dtype":"{name}","shape":[{",".join(map(str, tensor.shape))}],"data_offsets":[0,{nbytes}]}}}}'
    header += " " * (-len(header) % 8)
    # A view of the tensor's own storage (numpy has no bfloat16: its bits travel as int16).
    data = (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy() if nbytes else b""
    return len(header).to_bytes(HEADER_LENGTH_BYTES, "little") + header.encode(), data, nbytes


def safetensors_bytes(tensor: torch.Tensor) -> bytes:
    """A safetensors file holding `tensor` under key "t", as `safetensors.torch.save` writes it."""
    head, data, _ = _safetensors_parts(tensor)
    return b"".join((head, data))


def tensor_from_safetensors(data: bytes) -> torch.Tensor:
    """The tensor under key "t" of a one-tensor safetensors file, copied once out of `data`.

    Validates as strictly as the safetensors library (`rollout.safetensors_header`): a header of
    exactly key "t", a known dtype, a shape of non-negative integers and offsets that cover the
    data exactly.
    """
    try:
        start = HEADER_LENGTH_BYTES + header_length(data, len(data), _MAX_HEADER_BYTES)
        tensors = tensor_entries(memoryview(data)[HEADER_LENGTH_BYTES:start], len(data) - start, _TORCH_DTYPES)
    except SafetensorsHeaderError as error:
        raise CodecError(f"tensor envelope: data is not a safetensors file: {error}") from None
    if len(tensors) != 1 or _TENSOR_KEY not in tensors:
        raise CodecError(f"tensor envelope: expected exactly the key {_TENSOR_KEY!r}, got {short_repr(sorted(tensors))}")
    tensor = tensors[_TENSOR_KEY]
    if tensor.end == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    # One copy, into a buffer the tensor owns: `data` is immutable bytes.
    return torch.frombuffer(bytearray(memoryview(data)[start:]), dtype=tensor.dtype).reshape(tensor.shape)


def encode_tensor(tensor: torch.Tensor, binary: bool = True) -> dict[str, Any]:
    """The envelope of one tensor; `binary=False` base64-encodes `data` for JSON."""
    data = safetensors_bytes(tensor)
    return {
        TENSOR_MARKER: True,
        "data": data if binary else base64.b64encode(data).decode("ascii"),
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype),
    }


# The most bytes an envelope adds to its tensor's data, in a JSON or a msgpack response: the
# safetensors header (its 8-byte length, and JSON padded to 8: at most 192 bytes for 8 dimensions of
# 12 digits) base64'd, the keys, the shape and the dtype (about 180 more).
MAX_ENVELOPE_BYTES = 512


def most_encoded_tensor_bytes(nbytes: int) -> int:
    """The most bytes a tensor of `nbytes` bytes of data takes in a response, JSON or msgpack: JSON
    carries its safetensors file as base64 (4 characters per 3 bytes), msgpack as the bytes
    themselves, and either wraps them in an envelope of at most `MAX_ENVELOPE_BYTES`."""
    return 4 * -(-nbytes // 3) + MAX_ENVELOPE_BYTES


def most_encoded_text_bytes(text: str) -> int:
    """The most bytes `text` takes in a response, JSON or msgpack: JSON escapes it (`\\uXXXX` for
    every character outside ASCII, 12 bytes for one outside the BMP), msgpack writes its UTF-8
    bytes after a header of at most 5 bytes (JSON's quotes are 2, and its escapes never shorter)."""
    return len(json.dumps(text)) + 3


def decode_tensor(envelope: dict[str, Any]) -> torch.Tensor:
    """Inverse of `encode_tensor`; checks the declared shape and dtype against the payload."""
    data = envelope.get("data")
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise CodecError(f"tensor envelope: data is not valid base64: {e}") from None
    if not isinstance(data, (bytes, bytearray)):
        raise CodecError(f"tensor envelope: data must be bytes or base64 text, got {type(data).__name__}")
    tensor = tensor_from_safetensors(data)
    declared_shape, declared_dtype = envelope.get("shape"), envelope.get("dtype")
    if declared_shape != list(tensor.shape) or declared_dtype != str(tensor.dtype):
        raise CodecError(
            f"tensor envelope declares shape {short_repr(declared_shape)} and dtype {short_repr(declared_dtype)}, "
            f"but holds {list(tensor.shape)} {tensor.dtype}"
        )
    return tensor


class TensorEncoder:
    """Encodes nested maps and lists, replacing tensors by envelopes.

    One encoder serves one response: a tensor object that appears in several places (the shared
    schedule in every sample's row) is encoded once and its envelope reused.
    """

    def __init__(self, binary: bool = True):
        self.binary = binary
        self._envelopes: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}

    def encode(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            cached = self._envelopes.get(id(value))
            if cached is None:
                # The tensor is kept with its envelope so its id cannot be reused meanwhile.
                cached = self._envelopes[id(value)] = (value, encode_tensor(value, self.binary))
            return cached[1]
        if isinstance(value, dict):
            return {key: self.encode(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.encode(item) for item in value]
        return value


def decode_tree(value: Any) -> Any:
    """Replaces every envelope in nested maps and lists by its tensor."""
    if isinstance(value, dict):
        if value.get(TENSOR_MARKER) is True:
            return decode_tensor(value)
        return {key: decode_tree(item) for key, item in value.items()}
    if isinstance(value, list):
        return [decode_tree(item) for item in value]
    return value


def to_msgpack(value: Any) -> bytes:
    """The bytes of `msgpack.packb(TensorEncoder().encode(value))`, each tensor's data copied once.

    Built as a list of chunks joined at the end: msgpack's framing for the values around the
    tensors, and for each tensor its envelope with the safetensors file written in place (a
    msgpack `bin` is a length and the raw bytes), so no intermediate file or buffer is built.
    """
    return b"".join(_MsgpackChunks().add(value).chunks)


class _MsgpackChunks:
    def __init__(self):
        self.chunks: list = []
        self._packer = msgpack.Packer(use_bin_type=True)
        self._tensors: dict[int, tuple[torch.Tensor, list]] = {}  # as TensorEncoder: shared tensors once

    def add(self, value: Any) -> "_MsgpackChunks":
        pack = self._packer
        if isinstance(value, torch.Tensor):
            cached = self._tensors.get(id(value))
            if cached is None:
                cached = self._tensors[id(value)] = (value, self._envelope(value))
            self.chunks.extend(cached[1])
        elif isinstance(value, dict):
            self.chunks.append(pack.pack_map_header(len(value)))
            for key, item in value.items():
                self.chunks.append(pack.pack(key))
                self.add(item)
        elif isinstance(value, (list, tuple)):
            self.chunks.append(pack.pack_array_header(len(value)))
            for item in value:
                self.add(item)
        else:
            self.chunks.append(pack.pack(value))
        return self

    def _envelope(self, tensor: torch.Tensor) -> list:
        """The chunks of `encode_tensor(tensor)` packed: the same keys, in the same order."""
        head, data, nbytes = _safetensors_parts(tensor)
        pack = self._packer
        return [
            _ENVELOPE_START,
            _msgpack_bin_header(len(head) + nbytes) + head,
            data,
            _SHAPE_KEY + pack.pack(list(tensor.shape)) + _DTYPE_KEY + pack.pack(_DTYPE_NAMES[tensor.dtype]),
        ]


# The constant framing of an envelope (`encode_tensor`'s keys, in its order) around its values.
_ENVELOPE_START = msgpack.Packer().pack_map_header(4) + msgpack.packb(TENSOR_MARKER) + msgpack.packb(True) + msgpack.packb("data")
_SHAPE_KEY, _DTYPE_KEY = msgpack.packb("shape"), msgpack.packb("dtype")
_DTYPE_NAMES = {dtype: str(dtype) for dtype in _SAFETENSORS_DTYPES}


def _msgpack_bin_header(length: int) -> bytes:
    """msgpack's `bin 8/16/32` marker and length, as msgpack writes them for bytes of `length`."""
    if length < 2**8:
        return b"\xc4" + length.to_bytes(1, "big")
    if length < 2**16:
        return b"\xc5" + length.to_bytes(2, "big")
    if length < 2**32:
        return b"\xc6" + length.to_bytes(4, "big")
    raise CodecError(f"a tensor of {length} bytes is larger than msgpack's 4 GiB limit for one value")


# This server's bodies nest 6 deep at most (a response's envelope's shape). Deeper ones are refused
# when parsed: the recursive code that reads values (repr, pydantic, `decode_tree`) would hit
# Python's recursion limit at about 1,000, and msgpack's own stack allows 1,024.
MAX_NESTING_DEPTH = 32
_TOO_DEEP = f"body nests maps and lists deeper than {MAX_NESTING_DEPTH} levels"
_CONTAINERS = {dict, list}  # the types the parsers build maps and arrays as


@dataclass(frozen=True)
class DecodeBudget:
    """The most maps and lists (`containers`) and the most items in them (`elements`, a map's
    entry counting once) that a body may decode into, checked while it is decoded.

    A map or a list costs 60 to 100 bytes of Python objects and an item at least a pointer, for as
    little as one byte of msgpack: a 1 MiB body of a million empty maps took 1 GB and 4.6 s to
    refuse. What this server reads spends far more bytes on each (a tensor envelope is a map of
    four items around a safetensors file; a request has a handful of lists), so a budget in
    proportion to the body's size refuses only bodies built to expand.
    """

    containers: int
    elements: int

    @classmethod
    def for_body(cls, num_bytes: int) -> "DecodeBudget":
        return cls(_BASE_BUDGET + num_bytes // _BYTES_PER_CONTAINER, _BASE_BUDGET + num_bytes // _BYTES_PER_ELEMENT)

    def refusal(self) -> CodecError:
        return CodecError(
            f"body decodes into more than {self.containers} maps and lists or {self.elements} items in them, "
            "the most its size allows"
        )


_BASE_BUDGET = 4096
_BYTES_PER_CONTAINER = 32
_BYTES_PER_ELEMENT = 8


class _Spending:
    """The hooks the msgpack decoder calls for each list and map it builds, innermost first: they
    count them against the budget and stop the decoder as soon as it is spent."""

    def __init__(self, budget: DecodeBudget, object_hook: Callable[[dict], Any] | None):
        self.budget = budget
        self.containers_left, self.elements_left = budget.containers, budget.elements
        self.map_hook = object_hook

    def _spend(self, items: int) -> None:
        self.containers_left -= 1
        self.elements_left -= items
        if self.containers_left < 0 or self.elements_left < 0:
            raise self.budget.refusal()

    def list_hook(self, items: list) -> list:
        self._spend(len(items))
        return items

    def object_hook(self, mapping: dict) -> Any:
        self._spend(len(mapping))
        return mapping if self.map_hook is None else self.map_hook(mapping)


def _within_depth(value: Any) -> Any:
    """`value`, if its maps and lists nest at most `MAX_NESTING_DEPTH` deep; one pass, level by level."""
    level = [value] if type(value) in _CONTAINERS else []
    for _ in range(MAX_NESTING_DEPTH):
        children = []
        for node in level:
            items = node.values() if type(node) is dict else node
            # Looks at a long list of numbers in C: a Python loop over every item took 2 s for 8M.
            if not _CONTAINERS.isdisjoint(map(type, items)):
                children.extend(item for item in items if type(item) in _CONTAINERS)
        level = children
    if level:
        raise CodecError(_TOO_DEEP)
    return value


def parse_msgpack(body: bytes, object_hook: Callable[[dict], Any] | None = None) -> Any:
    """A msgpack body as plain values; tensor envelopes stay maps (request bodies carry none).

    Raises `CodecError` if it does not parse, nests too deep or outgrows its `DecodeBudget`.
    """
    spending = _Spending(DecodeBudget.for_body(len(body)), object_hook)
    try:
        value = msgpack.unpackb(
            body, raw=False, strict_map_key=True, object_hook=spending.object_hook, list_hook=spending.list_hook
        )
    except CodecError:
        raise
    except msgpack.StackError:
        raise CodecError(_TOO_DEEP) from None
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise CodecError(f"body is not valid msgpack: {e}") from None
    return _within_depth(value)


def _decoded_if_envelope(value: dict) -> Any:
    # Called by the parsers for every map, innermost first: no second walk over the tree.
    return decode_tensor(value) if value.get(TENSOR_MARKER) is True else value


def from_msgpack(body: bytes) -> Any:
    """A msgpack body with its tensor envelopes decoded, each as the decoder reaches it."""
    return parse_msgpack(body, object_hook=_decoded_if_envelope)


def to_json(value: Any) -> str:
    return json.dumps(TensorEncoder(binary=False).encode(value))


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _json_within_budget(body: bytes | bytearray) -> None:
    """Raises `CodecError` if the JSON `body` has more maps, lists or items than its budget.

    Python's JSON decoder has no hook for lists, so they are counted in the text before it is
    decoded, in C: an opening bracket per map or list, a comma between items. Brackets and commas
    inside strings count too, so only a body over the budget is counted again without its strings.
    """
    budget = DecodeBudget.for_body(len(body))

    def over(text: bytes | bytearray) -> bool:
        containers = text.count(b"[") + text.count(b"{")
        return containers > budget.containers or containers + text.count(b",") > budget.elements

    if over(body) and over(_JSON_STRING.sub(b"", body)):
        raise budget.refusal()


def parse_json(body: str | bytes, object_hook: Callable[[dict], Any] | None = None) -> Any:
    """A JSON body as plain values; tensor envelopes stay maps (request bodies carry none).

    Raises `CodecError` if it does not parse, nests too deep or outgrows its `DecodeBudget`.
    """
    _json_within_budget(body.encode() if isinstance(body, str) else body)
    try:
        value = json.loads(body, object_hook=object_hook)
    except CodecError:
        raise
    except RecursionError:
        raise CodecError(_TOO_DEEP) from None
    except ValueError as e:
        raise CodecError(f"body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    return _within_depth(value)


def from_json(body: str | bytes) -> Any:
    """A JSON body with its tensor envelopes decoded, each as the decoder reaches it."""
    return parse_json(body, object_hook=_decoded_if_envelope)
