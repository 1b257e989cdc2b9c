import base64
import io
import pickle

import msgpack
import pytest
import torch

from rollout import codec
from rollout.codec import (
    CodecError,
    TensorEncoder,
    decode_tensor,
    encode_tensor,
    from_json,
    from_msgpack,
    to_json,
    to_msgpack,
)

TENSORS = [
    torch.randn(3, 4),
    torch.randn(2, 1, 16, 16).bfloat16(),
    torch.randn(5).half(),
    torch.arange(7, dtype=torch.int64),
    torch.tensor([True, False]),
    torch.randint(0, 255, (3, 2, 2), dtype=torch.uint8),
    torch.tensor(3.5),
    torch.zeros(0, 3),
    torch.randn(4, 6)[:, 1::2],  # not contiguous
]


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{t.dtype}{list(t.shape)}")
@pytest.mark.parametrize("binary", [True, False])
def test_envelope_round_trip_is_exact(tensor, binary):
    envelope = encode_tensor(tensor, binary=binary)
    assert envelope["__tensor__"] is True
    assert envelope["shape"] == list(tensor.shape)
    assert envelope["dtype"] == str(tensor.dtype)
    assert isinstance(envelope["data"], bytes if binary else str)
    decoded = decode_tensor(envelope)
    assert decoded.dtype == tensor.dtype
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize("tensor", TENSORS, ids=lambda t: f"{t.dtype}{list(t.shape)}")
def test_envelope_data_is_the_safetensors_librarys_own_bytes(tensor):
    from safetensors.torch import load, save

    data = encode_tensor(tensor)["data"]
    assert data == save({"t": tensor.contiguous()})  # written here, byte for byte the library's
    loaded = load(data)
    assert list(loaded) == ["t"] and torch.equal(loaded["t"], tensor)
    with_metadata = save({"t": tensor.contiguous()}, metadata={"format": "pt"})
    assert torch.equal(codec.tensor_from_safetensors(with_metadata), tensor)


def test_decoded_tensors_own_their_memory():
    data = encode_tensor(torch.arange(6.0))["data"]
    decoded = codec.tensor_from_safetensors(data)
    decoded += 1  # writable, and not a view of the immutable bytes it came from
    assert torch.equal(codec.tensor_from_safetensors(data), torch.arange(6.0))


def _file(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    return (len(header) if length is None else length).to_bytes(8, "little") + header + data


@pytest.mark.parametrize(
    "data,match",
    [
        (b"\x01\x02", "too short"),
        (_file(b"{}", length=2**40), "out of range"),
        (_file(b"[1, 2]"), "not a map"),
        (_file(b"\xff\xfe"), "its header is not JSON"),
        (_file(b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 4), "its tensors take 8 bytes, 4 follow its header"),
        (_file(b'{"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', b"\0" * 12), "its tensors take 8 bytes, 12 follow its header"),
        (_file(b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8), "'t' does not start where the tensor before it ends"),
        (_file(b'{"t":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}', b"\0" * 8), "'t' has dtype 'C64', not one of"),
        (_file(b'{"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', b"\0" * 4), "'t' has a shape or data offsets that are not counts"),
        (_file(b'{"t":{"dtype":"F32","shape":"1","data_offsets":[0,4]}}', b"\0" * 4), "'t' has a shape or data offsets that are not counts"),
        (_file(b'{"t":[1]}'), "the entry of 't' is not a dtype, a shape and data offsets"),
    ],
)
def test_malformed_safetensors_files_raise_codec_error(data, match):
    with pytest.raises(CodecError, match=match):
        codec.tensor_from_safetensors(data)


@pytest.mark.parametrize("to_wire,from_wire", [(to_msgpack, from_msgpack), (to_json, from_json)])
def test_nested_bodies_round_trip(to_wire, from_wire):
    body = [{"prompt": "7", "seed": 3, "rollout_log_probs": TENSORS[0], "trajectory": {"sigmas": TENSORS[1]}}]
    decoded = from_wire(to_wire(body))
    assert decoded[0]["prompt"] == "7" and decoded[0]["seed"] == 3
    assert torch.equal(decoded[0]["rollout_log_probs"], TENSORS[0])
    assert torch.equal(decoded[0]["trajectory"]["sigmas"], TENSORS[1])


def test_msgpack_bodies_are_msgpacks_own_bytes():
    shared = torch.linspace(1, 0, 5)
    body = [
        {"prompt": "7", "seed": 3, "none": None, "ratio": 0.5, "ok": True, "tensors": TENSORS, "sigmas": shared},
        {"sizes": (1, 2), "big": torch.randn(3, 40000), "medium": torch.randn(100), "sigmas": shared, "nested": {}},
    ]
    assert to_msgpack(body) == msgpack.packb(TensorEncoder().encode(body), use_bin_type=True)


@pytest.mark.parametrize("binary", [True, False])
def test_a_shared_tensor_is_encoded_once(monkeypatch, binary):
    sigmas = torch.linspace(1, 0, 5)  # length 5 == number of rows, which must not matter
    rows = [{"log_probs": torch.randn(4), "sigmas": sigmas} for _ in range(5)]
    calls = []
    original = codec.safetensors_bytes
    monkeypatch.setattr(codec, "safetensors_bytes", lambda tensor: calls.append(1) or original(tensor))

    encoded = TensorEncoder(binary=binary).encode(rows)

    assert len(calls) == 5 + 1
    assert all(row["sigmas"] is encoded[0]["sigmas"] for row in encoded)
    for row in from_msgpack(msgpack.packb(encoded)) if binary else from_json(to_json(encoded)):
        assert torch.equal(row["sigmas"], sigmas)


class _Boom:
    def __reduce__(self):
        return (exec, ("raise SystemExit('unpickled!')",))


@pytest.mark.parametrize(
    "envelope,match",
    [
        ({"__tensor__": True, "data": pickle.dumps(_Boom()), "shape": [], "dtype": "torch.float32"}, "safetensors"),
        ({"__tensor__": True, "data": "not base64!", "shape": [1], "dtype": "torch.float32"}, "base64"),
        ({"__tensor__": True, "data": 12, "shape": [1], "dtype": "torch.float32"}, "bytes"),
        ({"__tensor__": True, "shape": [1], "dtype": "torch.float32"}, "bytes"),
        ({**encode_tensor(torch.zeros(2)), "shape": [3]}, "declares"),
        ({**encode_tensor(torch.zeros(2)), "dtype": "torch.float16"}, "declares"),
    ],
)
def test_malformed_envelopes_raise_codec_error(envelope, match):
    with pytest.raises(CodecError, match=match):
        decode_tensor(envelope)


def test_a_pickled_tensor_is_refused_not_loaded():
    buffer = io.BytesIO()
    torch.save({"t": torch.zeros(1)}, buffer)
    envelope = {"__tensor__": True, "data": base64.b64encode(buffer.getvalue()).decode(), "shape": [1], "dtype": "torch.float32"}
    with pytest.raises(CodecError):
        decode_tensor(envelope)


def test_wrong_key_is_refused():
    from safetensors.torch import save

    envelope = {"__tensor__": True, "data": save({"x": torch.zeros(1)}), "shape": [1], "dtype": "torch.float32"}
    with pytest.raises(CodecError, match="key"):
        decode_tensor(envelope)


@pytest.mark.parametrize("body", [b"\xc1", b"\x92\x01", b"\x81\x80\x01"])
def test_malformed_msgpack_raises_codec_error(body):
    with pytest.raises(CodecError):
        from_msgpack(body)


def test_malformed_json_raises_codec_error():
    with pytest.raises(CodecError):
        from_json("{not json")
