"""Weights from a trainer to every worker replica in flat buckets, instead of the object store:
broadcast over one process group (SGLang's weight-update group), or, for a trainer on the replicas'
machine, shared with them in memory they map (POSIX shared memory, or CUDA IPC on a GPU).

The trainer is rank 0 of a `torch.distributed` group (gloo on the CPU, NCCL on GPUs) that every
worker replica joins (`deployments/weights.py`). An update is the tensors' names, dtypes and shapes,
sent to the server as a request, and their bytes, broadcast from rank 0 in buckets: a bucket is one
flat byte buffer holding whole tensors back to back (`buckets_of`), and costs one collective. A
sender packs the next bucket while the last one is on the wire; a receiver posts the next bucket's
broadcast before it unpacks the one it holds.

A group is built from a `TCPStore` and a process group object of its own, never with
`init_process_group`: a trainer keeps its own default group (FSDP, DDP), and a replica joins and
leaves groups without touching global state. Every collective has the group's timeout, so a peer
that dies mid-broadcast fails the others' call instead of hanging it.

A colocated trainer (`SharedMemorySender`) packs each bucket into memory it keeps and shares, and
names it in the request; each replica copies the buckets out before the request is answered, so
the trainer reuses the same memory for its next update.
"""

from __future__ import annotations

import _posixshmem
import dataclasses
import datetime
import math
import mmap
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from rollout.errors import WeightUpdateError
from rollout.schema import BUCKET_BYTES, SharedBucketRequest

# How often a sender asks whether the server gave up the update while a bucket is on the wire.
_POLL = datetime.timedelta(seconds=0.1)
BACKENDS = ("gloo", "nccl")
# The dtypes a weight travels in, by SGLang's names (`update_weights_from_distributed`'s `dtypes`).
DTYPES = {
    name: getattr(torch, name)
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of an update as the request names it: what a receiver allocates and checks."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorSpec":
        return cls(name, tensor.dtype, tuple(tensor.shape))


def specs_of(named_tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec.of(name, tensor) for name, tensor in named_tensors.items()]


def spec_lists(specs: Sequence[TensorSpec]) -> dict[str, list]:
    """SGLang's three parallel lists for `specs`: `names`, `dtypes` and `shapes` (`iter_specs`'s inverse)."""
    return {
        "names": [spec.name for spec in specs],
        "dtypes": [str(spec.dtype).removeprefix("torch.") for spec in specs],
        "shapes": [list(spec.shape) for spec in specs],
    }


def iter_specs(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> Iterator[TensorSpec]:
    """SGLang's three parallel lists (`update_weights_from_distributed`) as specs; raises
    `WeightUpdateError` naming the field."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightUpdateError(
            "names", f"names, dtypes and shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
        )
    for name, dtype, shape in zip(names, dtypes, shapes):
        if dtype not in DTYPES:
            raise WeightUpdateError("dtypes", f"{name}: {dtype!r} is not one of {sorted(DTYPES)}")
        if any(size < 0 for size in shape):
            raise WeightUpdateError("shapes", f"{name}: sizes must not be negative, got {list(shape)}")
        yield TensorSpec(name, DTYPES[dtype], tuple(int(size) for size in shape))


# Where a tensor starts in its bucket: a multiple of this many bytes, so that each one is a view of
# the bucket in its own dtype (a view needs an offset its element size divides).
_ALIGNMENT = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def bucket_nbytes(bucket: Sequence[TensorSpec]) -> int:
    """The bytes of a bucket's buffer: its tensors, each starting at an aligned offset."""
    return sum(_aligned(spec.nbytes) for spec in bucket)


def buckets_of(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[tuple[TensorSpec, ...]]:
    """`specs` in order, cut into buckets whose buffers (`bucket_nbytes`) take at most `bucket_bytes`;
    a tensor larger than that is a bucket of its own (tensors are never split, so a bucket unpacks
    into whole tensors)."""
    if bucket_bytes < 1:
        raise WeightUpdateError("bucket_bytes", f"must be at least 1, got {bucket_bytes}")
    buckets: list[tuple[TensorSpec, ...]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and size + _aligned(spec.nbytes) > bucket_bytes:
            buckets.append(tuple(current))
            current, size = [], 0
        current.append(spec)
        size += _aligned(spec.nbytes)
    if current:
        buckets.append(tuple(current))
    return buckets


def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' bytes in one flat uint8 buffer on `device`, each at an aligned offset."""
    nbytes = sum(_aligned(t.nbytes) for t in tensors)
    return pack_into(torch.zeros(nbytes, dtype=torch.uint8, device=device), tensors)


def pack_into(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """`pack` into the front of a flat uint8 `buffer` (at least as large); returns that part."""
    offset = 0
    for tensor in tensors:
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + flat.numel()].copy_(flat)
        offset += _aligned(flat.numel())
    return buffer[:offset]


def unpack(buffer: torch.Tensor, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
    """Inverse of `pack`: each tensor a view of `buffer` (no copy), by name."""
    tensors, offset = {}, 0
    for spec in specs:
        if spec.nbytes == 0:  # (no bytes to view: an empty buffer's stride may not be 1)
            tensors[spec.name] = torch.empty(spec.shape, dtype=spec.dtype, device=buffer.device)
            continue
        tensors[spec.name] = buffer[offset : offset + spec.nbytes].view(spec.dtype).reshape(spec.shape)
        offset += _aligned(spec.nbytes)
    if offset != buffer.numel():
        raise WeightUpdateError("shapes", f"the tensors take {offset} bytes, their bucket holds {buffer.numel()}")
    return tensors


@dataclass(frozen=True)
class PackedTensors:
    """An update's tensors as they arrived: its buckets' specs and byte buffers (numpy, so that Ray's
    object store holds them out of band: a replica that starts later catches up from them)."""

    buckets: tuple[tuple[TensorSpec, ...], ...]
    buffers: tuple[np.ndarray, ...]

    def tensors(self) -> dict[str, torch.Tensor]:
        named: dict[str, torch.Tensor] = {}
        for specs, buffer in zip(self.buckets, self.buffers, strict=True):
            named.update(unpack(torch.from_numpy(buffer), specs))
        return named

    def num_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)

    @classmethod
    def of(cls, named_tensors: Mapping[str, torch.Tensor]) -> "PackedTensors":
        """Tensors in one bucket (an update made whole from a delta, kept for catching up)."""
        specs = tuple(specs_of(named_tensors))
        return cls((specs,), (pack(list(named_tensors.values()), torch.device("cpu")).numpy(),))


# Deltas: only the elements that changed since the version a replica serves, each tensor as the
# positions (flat, int64) and the new values of its changed elements, compared bit for bit.
_POSITIONS, _VALUES = ":changed_positions", ":changed_values"
_SAME_WIDTH_INTEGERS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_positions(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """The flat positions whose bits differ (a NaN's payload and the sign of a zero included)."""
    width = _SAME_WIDTH_INTEGERS[current.dtype.itemsize]
    before, after = (t.detach().cpu().contiguous().reshape(-1).view(width) for t in (previous, current))
    return (before != after).nonzero().reshape(-1)


def delta_of(previous: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`current` as changes to `previous` (same names, dtypes and shapes): per tensor, the positions
    and the values of its changed elements, in `current`'s order."""
    delta = {}
    for name, tensor in current.items():
        positions = changed_positions(previous[name], tensor)
        delta[name + _POSITIONS] = positions
        delta[name + _VALUES] = tensor.detach().cpu().reshape(-1)[positions]
    return delta


def delta_specs(specs: Sequence[TensorSpec], changed: Sequence[int]) -> list[TensorSpec]:
    """What a delta of the tensors `specs` broadcasts, `changed[i]` elements of tensor i."""
    if len(changed) != len(specs):
        raise WeightUpdateError("changed", f"needs one count per tensor: {len(changed)} for {len(specs)}")
    out = []
    for spec, count in zip(specs, changed):
        if not 0 <= count <= math.prod(spec.shape):
            raise WeightUpdateError("changed", f"{spec.name}: {count} of its {math.prod(spec.shape)} elements")
        out += [TensorSpec(spec.name + _POSITIONS, torch.int64, (count,)), TensorSpec(spec.name + _VALUES, spec.dtype, (count,))]
    return out


def with_delta(base: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The whole tensors a delta describes: copies of `base`'s, the changed elements written in.
    Raises `WeightUpdateError` for a position outside its tensor."""
    whole = {}
    for name in (key.removesuffix(_POSITIONS) for key in delta if key.endswith(_POSITIONS)):
        positions, values = delta[name + _POSITIONS], delta[name + _VALUES]
        tensor = base[name].detach().to("cpu", copy=True)
        if len(positions) and not (0 <= int(positions.min()) and int(positions.max()) < tensor.numel()):
            raise WeightUpdateError("changed", f"{name}: a changed position lies outside the tensor")
        tensor.view(-1)[positions] = values.to(tensor.dtype)
        whole[name] = tensor
    return whole


class WeightGroup:
    """One rank's end of a weight-update group: rank 0 sends, every other rank receives."""

    def __init__(self, process_group: Any, rank: int, world_size: int, device: torch.device, name: str):
        self._group = process_group
        self.rank, self.world_size, self.device, self.name = rank, world_size, device, name

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str,
        backend: str = "gloo",
        timeout_s: float = 600.0,
    ) -> "WeightGroup":
        """Joins (rank 0: creates) the group whose store listens at `master_address:master_port`;
        returns once all `world_size` ranks have joined, or raises `WeightUpdateError` after
        `timeout_s`."""
        if backend not in BACKENDS:
            raise WeightUpdateError("backend", f"must be one of {list(BACKENDS)}, got {backend!r}")
        if not 0 <= rank < world_size:
            raise WeightUpdateError("rank_offset", f"rank {rank} is outside a world of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            store = dist.TCPStore(
                master_address, master_port, world_size, rank == 0, timeout=timeout, wait_for_workers=False
            )
            store = dist.PrefixStore(f"rollout-weights/{group_name}", store)
            if backend == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
                group = dist.ProcessGroupNCCL(store, rank, world_size, dist.ProcessGroupNCCL.Options())
            else:
                device = torch.device("cpu")
                group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
            # A first collective: every rank is there before anyone is told the group is up.
            group.barrier().wait()
        except (RuntimeError, ValueError, OSError) as error:
            raise WeightUpdateError(
                "master_address", f"cannot join weight-update group {group_name!r} as rank {rank}: {error}"
            ) from None
        return cls(group, rank, world_size, device, group_name)

    def send(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        bucket_bytes: int = BUCKET_BYTES,
        given_up: Callable[[], bool] = lambda: False,
    ) -> None:
        """Rank 0: broadcasts the tensors, bucket after bucket, in `specs_of(named_tensors)`'s order.

        `given_up` is asked while a bucket is on the wire: once it is true (the server refused the
        update, so no replica will receive it), the group is aborted and `WeightUpdateError` raised,
        rather than waiting for receivers that will never come."""
        if self.rank != 0:
            raise WeightUpdateError("rank", "only rank 0 (the trainer) sends")
        in_flight = None
        for bucket in buckets_of(specs_of(named_tensors), bucket_bytes):
            buffer = pack([named_tensors[spec.name] for spec in bucket], self.device)  # while the last one travels
            if in_flight is not None:
                self._finish(in_flight, given_up)
            in_flight = self._broadcast(buffer)
        if in_flight is not None:
            self._finish(in_flight, given_up)

    def _finish(self, work: Any, given_up: Callable[[], bool]) -> None:
        while not work.is_completed():
            if given_up():
                self.close()
                raise WeightUpdateError("group_name", f"the broadcast was given up; group {self.name!r} is closed")
            try:
                work.wait(_POLL)
            except RuntimeError as error:
                if "timed out" not in str(error).lower():
                    raise WeightUpdateError("group_name", f"the broadcast failed: {error}") from None
        work.wait()  # raises what the collective met, if anything

    def receive(self, specs: Sequence[TensorSpec], bucket_bytes: int = BUCKET_BYTES) -> PackedTensors:
        """A rank after 0: the tensors rank 0 sends for `specs` (in that order), as they arrived;
        raises `WeightUpdateError` if a broadcast fails (rank 0 gone, or past the timeout)."""
        buckets = buckets_of(specs, bucket_bytes)
        buffers = [self._empty(bucket) for bucket in buckets]
        posted = [self._broadcast(buffers[0])] if buffers else []
        for k, bucket in enumerate(buckets):
            if k + 1 < len(buckets):  # the next bucket on the wire while this one is unpacked
                posted.append(self._broadcast(buffers[k + 1]))
            try:
                posted[k].wait()
            except RuntimeError as error:
                raise WeightUpdateError("group_name", f"the broadcast of bucket {k + 1} failed: {error}") from None
            unpack(buffers[k], bucket)  # checks that the bucket is exactly its tensors
        return PackedTensors(tuple(buckets), tuple(buffer.cpu().numpy() for buffer in buffers))

    def close(self) -> None:
        """Leaves the group (its other ranks' next collective fails); safe to call twice."""
        group, self._group = self._group, None
        if group is not None:
            group.abort()  # ends a broadcast still waiting for its peers

    def _empty(self, bucket: tuple[TensorSpec, ...]) -> torch.Tensor:
        return torch.empty(bucket_nbytes(bucket), dtype=torch.uint8, device=self.device)

    def _broadcast(self, buffer: torch.Tensor):
        if self._group is None:
            raise WeightUpdateError("group_name", f"weight-update group {self.name!r} is closed")
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self._group.broadcast([buffer], options)


# Shared buckets ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedBucket:
    """Where one packed bucket lies in memory a trainer shares with the replicas on its machine: a
    POSIX shared-memory segment (`shm_name`), or a GPU allocation (`cuda_ipc`: the fields of
    `torch.UntypedStorage._share_cuda_`, which `_new_shared_cuda` maps in another process)."""

    shm_name: str | None = None
    cuda_ipc: tuple | None = None

    @classmethod
    def of_request(cls, request: SharedBucketRequest, field: str) -> "SharedBucket":
        if (request.shm_name is None) == (request.cuda_ipc is None):
            raise WeightUpdateError(field, "names its memory by exactly one of shm_name and cuda_ipc")
        if request.shm_name is not None:
            return cls(shm_name=request.shm_name)
        ipc = request.cuda_ipc
        return cls(cuda_ipc=(
            bytes.fromhex(ipc.handle), ipc.storage_bytes, ipc.storage_offset, bytes.fromhex(ipc.ref_counter_handle),
            ipc.ref_counter_offset, bytes.fromhex(ipc.event_handle), ipc.event_sync_required,
        ))  # fmt: skip

    def as_body(self) -> dict:
        """The bucket as the request names it (`SharedBucketRequest`)."""
        if self.shm_name is not None:
            return {"shm_name": self.shm_name}
        handle, size, offset, counter, counter_offset, event, sync = self.cuda_ipc
        return {"cuda_ipc": {
            "handle": handle.hex(), "storage_bytes": size, "storage_offset": offset,
            "ref_counter_handle": counter.hex(), "ref_counter_offset": counter_offset,
            "event_handle": (event or b"").hex(), "event_sync_required": sync,
        }}  # fmt: skip

    def copy_out(self, nbytes: int, device: torch.device, field: str) -> np.ndarray:
        """The bucket's first `nbytes` bytes, copied into host memory of this process; raises
        `WeightUpdateError` naming `field` if this process cannot map it or it is smaller."""
        if self.shm_name is not None:
            return _copy_out_of_segment(self.shm_name, nbytes, field)
        return _copy_out_of_gpu(self.cuda_ipc, nbytes, device, field)


def _copy_out_of_segment(name: str, nbytes: int, field: str) -> np.ndarray:
    # Opened as Python's `SharedMemory` opens it, but without registering it with this process's
    # resource tracker, which would unlink it when this process ends: the segment is the trainer's.
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600)
    except FileNotFoundError:
        raise WeightUpdateError(
            field, f"no shared memory {name!r} on this replica's machine: a trainer shares its buckets only "
            "with the replicas on its own machine",
        ) from None  # fmt: skip
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise WeightUpdateError(field, f"{name!r} holds {size} bytes, its tensors take {nbytes}")
        with mmap.mmap(fd, nbytes, prot=mmap.PROT_READ) as mapped:
            view = np.frombuffer(mapped, dtype=np.uint8, count=nbytes)
            copied = view.copy()
            del view  # the map cannot close while a view of it lives
        return copied
    finally:
        os.close(fd)


def _copy_out_of_gpu(ipc: tuple, nbytes: int, device: torch.device, field: str) -> np.ndarray:
    if device.type != "cuda":
        raise WeightUpdateError(field, "a CUDA IPC bucket needs a replica on a GPU")
    handle, size, offset, counter, counter_offset, event, sync = ipc
    if size < nbytes:
        raise WeightUpdateError(field, f"its storage holds {size} bytes, its tensors take {nbytes}")
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            torch.cuda.current_device() if device.index is None else device.index, handle, size, offset, counter, counter_offset, event or None, sync
        )
    except RuntimeError as error:
        raise WeightUpdateError(field, f"cannot map the trainer's GPU memory: {error}") from None
    mapped = torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))
    return mapped.cpu().numpy()


def copy_out(
    buckets: Sequence[SharedBucket], specs: Sequence[TensorSpec], bucket_bytes: int, device: torch.device
) -> PackedTensors:
    """A replica's copy of the tensors `specs` a trainer packed (`buckets_of` at `bucket_bytes`)
    into `buckets`; raises `WeightUpdateError` naming the bucket it cannot read."""
    cut = buckets_of(specs, bucket_bytes)
    if len(buckets) != len(cut):
        raise WeightUpdateError(
            "buckets", f"these tensors take {len(cut)} bucket(s) of at most {bucket_bytes} bytes, got {len(buckets)}"
        )
    buffers = []
    for k, (bucket, bucket_specs) in enumerate(zip(buckets, cut)):
        buffers.append(bucket.copy_out(bucket_nbytes(bucket_specs), device, f"buckets[{k}]"))
    return PackedTensors(tuple(cut), tuple(buffers))


class _SharedMemory:
    """A trainer's shared buckets, kept between updates and grown as needed: memory the replicas
    copy out of before their server answers, so the next update can write it again."""

    def __init__(self, device: torch.device):
        self.device = device
        self._prefix = f"rollout_ws_{os.getpid()}_{secrets.token_hex(4)}_"
        self._segments: list[shared_memory.SharedMemory] = []
        self._gpu_buffers: list[torch.Tensor] = []

    def share(self, k: int, tensors: Sequence[torch.Tensor]) -> SharedBucket:
        """Packs `tensors` into bucket `k`'s memory."""
        nbytes = sum(_aligned(t.nbytes) for t in tensors)
        if self.device.type == "cuda":
            while len(self._gpu_buffers) <= k:
                self._gpu_buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
            if self._gpu_buffers[k].numel() < nbytes:
                self._gpu_buffers[k] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            pack_into(self._gpu_buffers[k], tensors)
            torch.cuda.current_stream(self.device).synchronize()  # written before a replica reads it
            storage = self._gpu_buffers[k].untyped_storage()
            _, handle, size, offset, counter, counter_offset, event, sync = storage._share_cuda_()
            return SharedBucket(cuda_ipc=(handle, size, offset, counter, counter_offset, event, sync))
        while len(self._segments) <= k:
            self._segments.append(None)
        if self._segments[k] is None or self._segments[k].size < nbytes:
            self._unlink(k)
            self._segments[k] = shared_memory.SharedMemory(f"{self._prefix}{k}", create=True, size=max(nbytes, 1))
        segment = self._segments[k]
        if nbytes:  # (a bucket of empty tensors has no bytes to view)
            pack_into(torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes), tensors)
        return SharedBucket(shm_name=segment.name)

    def _unlink(self, k: int) -> None:
        segment, self._segments[k] = self._segments[k], None
        if segment is not None:
            segment.close()
            segment.unlink()

    def close(self) -> None:
        for k in range(len(self._segments)):
            self._unlink(k)
        self._gpu_buffers.clear()


# The trainer's side ------------------------------------------------------------------------------

# How a trainer reaches the server: `call(route, body)` answers SGLang's route `route` (its name,
# e.g. "update_weights_from_distributed") with `body`, as a dict, or raises `WeightUpdateError`:
# `rollout.client.RolloutClient(url).weight_route` over HTTP, `handle_server(handle)` through a handle.
ServerCall = Callable[[str, dict], dict]


class _BucketSender:
    """What both senders share: an update's body (SGLang's names, dtypes and shapes, the LoRA
    fields, the checksum), deltas of the last update served, and the server's answer."""

    def __init__(self, server: ServerCall, bucket_bytes: int, deltas: bool):
        self.server, self.bucket_bytes, self.deltas = server, bucket_bytes, deltas
        self._last_sent: tuple[str, dict[str, torch.Tensor]] | None = None  # (its version, the tensors)

    def update(
        self,
        named_tensors: Mapping[str, torch.Tensor],
        weight_version: str | None = None,
        target_modules: Sequence[str] | None = None,
        lora_rank: int | None = None,
        lora_alpha: float | None = None,
        checksum: str | None = None,
        whole: bool = False,
    ) -> dict:
        """Sends the tensors to every replica; returns the server's answer (`success`, `message`,
        `weight_version`, and each replica's checksum of what it serves now), or raises
        `WeightUpdateError` with the server's reason (every replica then keeps its old weights).
        `checksum`: the trainer's `weights_checksum` of the module after the update, which every
        replica must then serve, or the update is undone everywhere. `whole`: every element, even
        where a delta would be smaller."""
        specs = specs_of(named_tensors)
        delta = None if whole or lora_rank is not None else self._delta(named_tensors)
        body = {
            **spec_lists(specs),
            "weight_version": weight_version,
            "target_modules": None if target_modules is None else list(target_modules),
            "lora_rank": lora_rank,
            "lora_alpha": lora_alpha,
            "bucket_bytes": self.bucket_bytes,
            "checksum": checksum,
        }
        sent_tensors = named_tensors
        if delta is not None:
            version, sent_tensors = delta
            body["delta_from"] = version
            body["changed"] = [len(sent_tensors[spec.name + _POSITIONS]) for spec in specs]
        # Refused, the update left every replica on what was last sent: the next delta is from that
        # (and the coordinator refuses a delta from a version the replicas do not all serve).
        last_sent, self._last_sent = self._last_sent, None
        try:
            answer = self._send(body, sent_tensors)
        except Exception:
            self._last_sent = last_sent
            raise
        if self.deltas and lora_rank is None:
            self._last_sent = (answer["weight_version"], {name: t.detach().clone() for name, t in named_tensors.items()})
        return answer

    def _send(self, body: dict, tensors: Mapping[str, torch.Tensor]) -> dict:
        """Posts `body` to the server while its tensors' bytes go their way; the server's answer."""
        raise NotImplementedError

    def _delta(self, named_tensors: Mapping[str, torch.Tensor]) -> tuple[str, dict[str, torch.Tensor]] | None:
        """(the version it changes, the delta) where a delta of the last update is smaller, else None."""
        if not self.deltas or self._last_sent is None:
            return None
        version, previous = self._last_sent
        if specs_of(previous) != specs_of(named_tensors):
            return None
        delta = delta_of(previous, named_tensors)
        if sum(t.nbytes for t in delta.values()) >= sum(t.nbytes for t in named_tensors.values()):
            return None
        return version, delta


class WeightSender(_BucketSender):
    """The trainer's end of a weight-update group with one server: it creates the group as rank 0,
    has the server's replicas join it, and broadcasts each update while the server receives it.

        sender = RolloutClient("http://127.0.0.1:8000").weight_sender(server_ranks=2, master_port=29600)
        sender.update(model.state_dict(), weight_version="step-1")   # or a PEFT adapter, with lora_rank/alpha
        sender.close()

    `server_ranks` is the number of the server's worker replicas (`/rollout/info`'s
    `replica_weight_versions`); `master_address` is this trainer's address as the replicas reach it.
    With `deltas`, an update of full weights after one that succeeded sends only the elements
    that changed (their positions and values, bit for bit) where that is smaller than the tensors;
    the sender then keeps a copy of what it last sent.
    """

    def __init__(
        self,
        server: ServerCall,
        server_ranks: int,
        master_port: int,
        master_address: str = "127.0.0.1",
        group_name: str = "rollout",
        backend: str = "gloo",
        timeout_s: float = 600.0,
        bucket_bytes: int = BUCKET_BYTES,
        deltas: bool = False,
    ):
        super().__init__(server, bucket_bytes, deltas)
        self.group_name = group_name
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": 1,
            "world_size": 1 + server_ranks,
            "group_name": group_name,
            "backend": backend,
            "timeout_s": timeout_s,
        }
        joined: dict[str, Any] = {}
        server_side = threading.Thread(target=_into, args=(joined, lambda: server("init_weights_update_group", body)))
        server_side.start()
        try:
            self.group = WeightGroup.join(master_address, master_port, 0, 1 + server_ranks, group_name, backend, timeout_s)
        finally:
            server_side.join()
        if "error" in joined:
            self.group.close()
            raise joined["error"]

    def _send(self, body: dict, tensors: Mapping[str, torch.Tensor]) -> dict:
        body = {**body, "group_name": self.group_name}
        answered: dict[str, Any] = {}
        server_side = threading.Thread(
            target=_into, args=(answered, lambda: self.server("update_weights_from_distributed", body))
        )
        server_side.start()
        sent = None
        try:
            self.group.send(tensors, self.bucket_bytes, given_up=lambda: "error" in answered)
        except WeightUpdateError as failure:
            sent = failure
        finally:
            server_side.join()
        if "error" in answered:  # the server's reason, which says whether the group is still up
            raise answered["error"]
        if sent is not None:  # served by the replicas that received it; a rank of this group is gone
            self.group.close()
        return answered["answer"]

    def close(self) -> None:
        """Has the replicas leave the group, and leaves it."""
        try:
            self.server("destroy_weights_update_group", {"group_name": self.group_name})
        finally:
            self.group.close()


class SharedMemorySender(_BucketSender):
    """The trainer's end for a server whose replicas run on the trainer's machine (a colocated
    trainer): each update's buckets are packed into memory this sender keeps and shares, POSIX
    shared memory for `device` "cpu", CUDA IPC for a GPU, and the replicas copy them out. No group
    and no collective; the same checks, checksums and deltas as `WeightSender`.

        sender = RolloutClient("http://127.0.0.1:8000").shared_memory_sender()
        sender.update(model.state_dict(), weight_version="step-1")
        sender.close()   # frees the shared memory
    """

    def __init__(
        self,
        server: ServerCall,
        device: torch.device | str = "cpu",
        bucket_bytes: int = BUCKET_BYTES,
        deltas: bool = False,
    ):
        super().__init__(server, bucket_bytes, deltas)
        self.memory = _SharedMemory(torch.device(device))

    def _send(self, body: dict, tensors: Mapping[str, torch.Tensor]) -> dict:
        buckets = [
            self.memory.share(k, [tensors[spec.name] for spec in bucket]).as_body()
            for k, bucket in enumerate(buckets_of(specs_of(tensors), self.bucket_bytes))
        ]
        return self.server("update_weights_from_shared_memory", {**body, "buckets": buckets})

    def close(self) -> None:
        self.memory.close()


def handle_server(handle: Any) -> ServerCall:
    """The server behind a Serve handle of its ingress: the route's handle twin, its answer as a dict."""

    def call(route: str, body: dict) -> dict:
        answer = getattr(handle, route).remote(**body).result()
        return answer if isinstance(answer, dict) else dataclasses.asdict(answer)

    return call


def _into(box: dict, call: Callable[[], dict]) -> None:
    try:
        box["answer"] = call()
    except Exception as error:  # handed to the trainer's thread, which raises it
        box["error"] = error
