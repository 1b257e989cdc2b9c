"""The tensor envelope that carries tensors across process and HTTP boundaries.

Compatible with SGLang's diffusion rollout API: a tensor travels as
``{"__tensor__": true, "data": <a safetensors file holding it under key "t">, "shape": [...],
"dtype": "torch.float32"}``; `data` is raw bytes in msgpack bodies and base64 text in JSON.
Decoding parses safetensors and msgpack only, so it never unpickles anything.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import msgpack
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollout.errors import CodecError

TENSOR_MARKER = "__tensor__"
_TENSOR_KEY = "t"


def encode_tensor(tensor: torch.Tensor, binary: bool = True) -> dict[str, Any]:
    """The envelope of one tensor; `binary=False` base64-encodes `data` for JSON."""
    data = save_safetensors({_TENSOR_KEY: tensor.detach().cpu().contiguous()})
    return {
        TENSOR_MARKER: True,
        "data": data if binary else base64.b64encode(data).decode("ascii"),
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype),
    }


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
    try:
        tensors = load_safetensors(bytes(data))
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise CodecError(f"tensor envelope: data is not a safetensors file: {e}") from None
    if set(tensors) != {_TENSOR_KEY}:
        raise CodecError(f"tensor envelope: expected exactly the key {_TENSOR_KEY!r}, got {sorted(tensors)}")
    tensor = tensors[_TENSOR_KEY]
    if list(tensor.shape) != list(envelope.get("shape", [])) or str(tensor.dtype) != envelope.get("dtype"):
        raise CodecError(
            f"tensor envelope declares shape {envelope.get('shape')} and dtype {envelope.get('dtype')}, "
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
    return msgpack.packb(TensorEncoder(binary=True).encode(value), use_bin_type=True)


def parse_msgpack(body: bytes) -> Any:
    """A msgpack body as plain values; tensor envelopes stay maps (request bodies carry none)."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as e:
        raise CodecError(f"body is not valid msgpack: {e}") from None


def from_msgpack(body: bytes) -> Any:
    return decode_tree(parse_msgpack(body))


def to_json(value: Any) -> str:
    return json.dumps(TensorEncoder(binary=False).encode(value))


def parse_json(body: str | bytes) -> Any:
    """A JSON body as plain values; tensor envelopes stay maps (request bodies carry none)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise CodecError(f"body is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None


def from_json(body: str | bytes) -> Any:
    return decode_tree(parse_json(body))
