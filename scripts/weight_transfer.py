"""Weight transfer on one machine, measured in GiB/s: a replica's release and resume of its weights
(`rollout.offload`: page-locked host copies on a GPU, against `module.to`'s pageable ones), a
colocated trainer's shared buckets copied out by another process (`rollout.weight_sync`: CUDA IPC
on a GPU, POSIX shared memory on the CPU), and, with two GPUs, a broadcast over a weight-update
group between two processes (NCCL; gloo on the CPU: NCCL refuses two ranks on one device).

    python scripts/weight_transfer.py --gib 4 --out docs/gpu_weight_transfer.json   # on a GPU
    python scripts/weight_transfer.py --gib 0.01 --cpu                              # the code, on the CPU (tested)

Every path's bits are checked: the receiving process sums the bytes it got (as int64), the sender
sums what it sent. Needs torch only (and pydantic, which `rollout.schema` imports).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollout.offload import HostCopies  # noqa: E402
from rollout.weight_sync import (  # noqa: E402
    BUCKET_BYTES,
    SharedBucket,
    TensorSpec,
    WeightGroup,
    _SharedMemory,
    buckets_of,
    copy_out,
    specs_of,
)

TENSOR_BYTES = 64 * 2**20  # a large transformer's typical weight: 4096 x 8192 in bf16
CHILD_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def weights(nbytes: int, device: str) -> dict[str, torch.Tensor]:
    """Random bf16 tensors of up to 64 MiB each, `nbytes` in all."""
    sizes = [TENSOR_BYTES] * (nbytes // TENSOR_BYTES) + ([nbytes % TENSOR_BYTES] if nbytes % TENSOR_BYTES else [])
    generator = torch.Generator(device).manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(size // 2, generator=generator, device=device, dtype=torch.bfloat16) for i, size in enumerate(sizes)}


def byte_sum(tensors) -> int:
    return sum(int(t.reshape(-1).view(torch.uint8).sum(dtype=torch.int64)) for t in tensors)


def timed(device: str, fn) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return max(time.perf_counter() - start, 1e-9)  # (a move to where a tensor already is takes no time)


def release_and_resume(tensors: dict[str, torch.Tensor], device: str) -> dict:
    gib = sum(t.nbytes for t in tensors.values()) / 2**30
    module = nn.ParameterList(nn.Parameter(t, requires_grad=False) for t in tensors.values())
    found = {}
    pageable = {"release": lambda: module.to("cpu"), "resume": lambda: module.to(device)}
    for way, move in pageable.items():
        found[f"pageable_{way}_gib_per_s"] = gib / timed(device, move)
    copies = HostCopies({"weights": module}, torch.device(device))
    for round_ in ("first", "again"):  # the first release pins its host copies
        found[f"pinned_release_{round_}_gib_per_s"] = gib / timed(device, copies.to_host)
        found[f"pinned_resume_{round_}_gib_per_s"] = gib / timed(device, copies.to_device)
    found["bits_kept"] = byte_sum(module) == byte_sum(tensors.values())
    return found


def _copy_out_child(connection, shared: list[SharedBucket], specs: list[TensorSpec], device: str) -> None:
    start = time.perf_counter()
    packed = copy_out(shared, specs, BUCKET_BYTES, torch.device(device))
    seconds = time.perf_counter() - start
    connection.send({"seconds": seconds, "byte_sum": byte_sum(packed.tensors().values())})


def shared_buckets(tensors: dict[str, torch.Tensor], device: str) -> dict:
    gib = sum(t.nbytes for t in tensors.values()) / 2**30
    specs = specs_of(tensors)
    memory = _SharedMemory(torch.device(device))
    shared: list[SharedBucket] = []
    try:
        share_s = timed(device, lambda: shared.extend(
            memory.share(k, [tensors[spec.name] for spec in bucket]) for k, bucket in enumerate(buckets_of(specs, BUCKET_BYTES))
        ))  # fmt: skip
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        child = context.Process(target=_copy_out_child, args=(theirs, shared, specs, device))
        child.start()
        if not ours.poll(CHILD_TIMEOUT_S):
            child.kill()
            raise TimeoutError("the copying process did not answer")
        copied = ours.recv()
        child.join(30)
        copy_out_s = max(copied["seconds"], 1e-9)
    finally:
        memory.close()
    return {
        "pack_and_share_gib_per_s": gib / share_s,
        "copy_out_gib_per_s": gib / copy_out_s,
        "bits_equal": copied["byte_sum"] == byte_sum(tensors.values()),
    }


def _receiving_rank(connection, port: int, specs: list[TensorSpec], backend: str) -> None:
    if backend == "nccl":
        torch.cuda.set_device(1)
    group = WeightGroup.join("127.0.0.1", port, 1, 2, "transfer", backend, CHILD_TIMEOUT_S)
    start = time.perf_counter()
    packed = group.receive(specs, BUCKET_BYTES)
    seconds = time.perf_counter() - start
    group.close()
    connection.send({"seconds": seconds, "byte_sum": byte_sum(packed.tensors().values())})


def broadcast(tensors: dict[str, torch.Tensor], device: str) -> dict:
    if device == "cuda" and torch.cuda.device_count() < 2:
        return {"skipped": "needs 2 GPUs: NCCL refuses two ranks on one device"}
    backend = "nccl" if device == "cuda" else "gloo"
    gib = sum(t.nbytes for t in tensors.values()) / 2**30
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_receiving_rank, args=(theirs, port, specs_of(tensors), backend))
    child.start()
    group = WeightGroup.join("127.0.0.1", port, 0, 2, "transfer", backend, CHILD_TIMEOUT_S)
    send_s = timed(device, lambda: group.send(tensors, BUCKET_BYTES))
    if not ours.poll(CHILD_TIMEOUT_S):
        child.kill()
        raise TimeoutError("the receiving rank did not answer")
    received = ours.recv()
    child.join(30)
    group.close()
    return {
        "backend": backend,
        "send_gib_per_s": gib / send_s,
        "receive_gib_per_s": gib / received["seconds"],
        "bits_equal": received["byte_sum"] == byte_sum(tensors.values()),
    }


def check_weight_transfer(nbytes: int, device: str) -> dict:
    tensors = weights(nbytes, device)
    found = {"section": "weight_transfer", "device": device, "gib": nbytes / 2**30, "tensors": len(tensors)}
    if device == "cuda":
        found["gpu"] = torch.cuda.get_device_name()
    for name, measure in (("release_and_resume", release_and_resume), ("shared_buckets", shared_buckets), ("broadcast", broadcast)):
        started = time.perf_counter()
        found[name] = measure(tensors, device)
        found[name]["seconds"] = time.perf_counter() - started
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="bytes of weights moved, in GiB")
    parser.add_argument("--cpu", action="store_true", help="on the CPU even where a GPU is")
    parser.add_argument("--out", type=Path, help="write the findings here as JSON")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    found = check_weight_transfer(int(args.gib * 2**30) // 2 * 2, device)
    print(json.dumps(found, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
