"""The library side of packed weight updates (`rollout.weight_sync`): buckets, a broadcast from rank 0
to ranks in threads of this process over gloo on 127.0.0.1, as a trainer and replicas run it, and
buckets shared in memory, as a colocated trainer shares them."""

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout.errors import RequestSchemaError, WeightUpdateError
from rollout.schema import SharedBucketRequest, UpdateWeightsFromSharedMemoryRequest, parse_body
from rollout.weight_sync import (
    DTYPES,
    SharedBucket,
    TensorSpec,
    WeightGroup,
    bucket_nbytes,
    buckets_of,
    copy_out,
    delta_of,
    delta_specs,
    iter_specs,
    pack,
    specs_of,
    unpack,
    with_delta,
)
from rollout.weight_sync import _SharedMemory as SharedMemory
from tests.ports import free_port

specs_strategy = st.lists(
    st.builds(
        TensorSpec,
        name=st.text("abcxyz.", min_size=1, max_size=8),
        dtype=st.sampled_from(list(DTYPES.values())),
        shape=st.lists(st.integers(0, 5), max_size=3).map(tuple),
    ),
    max_size=12,
    unique_by=lambda spec: spec.name,
)


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


@settings(max_examples=60, deadline=None)
@given(specs=specs_strategy, bucket_bytes=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_buckets_keep_every_tensor_whole_in_order_and_unpack_to_the_same_bits(specs, bucket_bytes, seed):
    buckets = buckets_of(specs, bucket_bytes)
    assert [spec for bucket in buckets for spec in bucket] == specs
    for bucket in buckets:  # within the size, unless a tensor alone is larger than a bucket
        assert bucket_nbytes(bucket) <= bucket_bytes or len(bucket) == 1
    for earlier, later in zip(buckets, buckets[1:]):  # a bucket closes only when the next tensor does not fit
        assert bucket_nbytes(earlier) + bucket_nbytes(later[:1]) > bucket_bytes
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        spec.name: torch.randint(0, 256, (spec.nbytes,), generator=generator, dtype=torch.uint8).view(spec.dtype).reshape(spec.shape)
        for spec in specs
    }
    for bucket in buckets:
        unpacked = unpack(pack([tensors[spec.name] for spec in bucket], torch.device("cpu")), bucket)
        for spec in bucket:  # raw bytes compared: NaN payloads and -0.0 included
            assert unpacked[spec.name].dtype == spec.dtype and unpacked[spec.name].shape == spec.shape
            assert torch.equal(raw(unpacked[spec.name]), raw(tensors[spec.name]))


def random_tensors(specs, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        spec.name: torch.randint(0, 256, (spec.nbytes,), generator=generator, dtype=torch.uint8).view(spec.dtype).reshape(spec.shape)
        for spec in specs
    }


@settings(max_examples=40, deadline=None)
@given(
    updates=st.lists(specs_strategy, min_size=1, max_size=3),
    bucket_bytes=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
def test_shared_buckets_copy_out_to_the_same_bits_update_after_update(updates, bucket_bytes, seed):
    """A trainer writes each update into the memory it keeps (growing a bucket that no longer fits);
    a reader that knows only the request's fields (the buckets as the body names them) copies
    out every tensor's bits."""
    memory = SharedMemory(torch.device("cpu"))
    try:
        for number, specs in enumerate(updates):
            tensors = random_tensors(specs, seed + number)
            shared = [
                memory.share(k, [tensors[spec.name] for spec in bucket]) for k, bucket in enumerate(buckets_of(specs, bucket_bytes))
            ]
            named = [SharedBucket.of_request(SharedBucketRequest(**bucket.as_body()), "b") for bucket in shared]
            copied = copy_out(named, specs, bucket_bytes, torch.device("cpu")).tensors()
            assert list(copied) == [spec.name for spec in specs]
            for spec in specs:
                assert copied[spec.name].dtype == spec.dtype and copied[spec.name].shape == spec.shape
                assert torch.equal(raw(copied[spec.name]), raw(tensors[spec.name]))
    finally:
        memory.close()


def test_shared_buckets_that_cannot_be_read_are_refused_naming_the_bucket():
    specs = [TensorSpec("w", torch.float32, (64,))]
    memory = SharedMemory(torch.device("cpu"))
    try:
        small = memory.share(0, [torch.zeros(8)])
        with pytest.raises(WeightUpdateError, match=r"buckets\[0\]: 'rollout_ws_\w+' holds 32 bytes, its tensors take 256"):
            copy_out([small], specs, 2**20, torch.device("cpu"))
        with pytest.raises(WeightUpdateError, match=r"buckets: these tensors take 1 bucket\(s\) of at most 1048576 bytes, got 2"):
            copy_out([small, small], specs, 2**20, torch.device("cpu"))
    finally:
        memory.close()
    with pytest.raises(WeightUpdateError, match=r"buckets\[0\]: no shared memory '.*' on this replica's machine"):
        copy_out([small], specs, 2**20, torch.device("cpu"))  # unlinked by the trainer's close
    ipc = {"handle": "00", "storage_bytes": 256, "storage_offset": 0, "ref_counter_handle": "", "ref_counter_offset": 0,
           "event_handle": "", "event_sync_required": False}  # fmt: skip
    gpu_bucket = SharedBucket.of_request(SharedBucketRequest(cuda_ipc=ipc), "buckets[0]")
    with pytest.raises(WeightUpdateError, match=r"buckets\[0\]: a CUDA IPC bucket needs a replica on a GPU"):
        copy_out([gpu_bucket], specs, 2**20, torch.device("cpu"))
    for neither_or_both in ({}, {"shm_name": "rollout_ws_a", "cuda_ipc": ipc}):
        with pytest.raises(WeightUpdateError, match=r"buckets\[3\]: names its memory by exactly one of"):
            SharedBucket.of_request(SharedBucketRequest(**neither_or_both), "buckets[3]")
    body = {"names": ["w"], "dtypes": ["float32"], "shapes": [[64]]}
    for name in ("../../etc/passwd", "/dev/shm/rollout_ws_a", "rollout_ws_a/b", "other"):
        with pytest.raises(RequestSchemaError, match="buckets"):
            parse_body(UpdateWeightsFromSharedMemoryRequest, {**body, "buckets": [{"shm_name": name}]})


def test_specs_from_sglangs_lists_name_the_field_that_does_not_fit():
    assert list(iter_specs(["w"], ["bfloat16"], [[2, 3]])) == [TensorSpec("w", torch.bfloat16, (2, 3))]
    with pytest.raises(WeightUpdateError, match="dtypes: w: 'float8' is not one of"):
        list(iter_specs(["w"], ["float8"], [[2]]))
    with pytest.raises(WeightUpdateError, match="names: names, dtypes and shapes differ in length"):
        list(iter_specs(["w", "v"], ["float32"], [[2]]))
    with pytest.raises(WeightUpdateError, match="shapes: w: sizes must not be negative"):
        list(iter_specs(["w"], ["float32"], [[-1]]))


def run_ranks(world_size: int, rank_work, timeout_s: float = 20.0) -> dict:
    """Each rank joins one group in a thread of its own and runs `rank_work(rank, group)`; their
    results (or the exceptions raised) by rank."""
    port = free_port()
    results: dict = {}

    def rank_thread(rank: int):
        try:
            group = WeightGroup.join("127.0.0.1", port, rank, world_size, "test", timeout_s=timeout_s)
            try:
                results[rank] = rank_work(rank, group)
            finally:
                group.close()
        except Exception as error:
            results[rank] = error

    threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return results


def test_rank_0_broadcasts_a_state_dict_in_buckets_and_every_rank_gets_its_bits():
    generator = torch.Generator().manual_seed(0)
    state = {
        "blocks.0.weight": torch.randn(64, 32, generator=generator).to(torch.bfloat16),
        "blocks.0.bias": torch.randn(64, generator=generator),
        "norm.scale": torch.tensor([float("nan"), -0.0, 1.0]),
        "steps": torch.tensor([3], dtype=torch.int64),
    }
    specs = specs_of(state)

    def work(rank, group):
        if rank == 0:
            return group.send(state, bucket_bytes=1024)  # 4 KiB of bf16 weights: several buckets
        return group.receive(specs, bucket_bytes=1024)

    results = run_ranks(3, work)
    assert results[0] is None
    for rank in (1, 2):
        packed = results[rank]
        assert len(packed.buckets) == len(buckets_of(specs, 1024)) > 1
        received = packed.tensors()
        assert list(received) == list(state)
        for name, tensor in state.items():
            assert torch.equal(raw(received[name]), raw(tensor))


def test_a_receiver_whose_trainer_never_sends_fails_after_the_timeout():
    def work(rank, group):
        if rank == 1:
            return group.receive([TensorSpec("w", torch.float32, (4,))])
        threading.Event().wait(4)  # rank 0 joined, and sends nothing

    results = run_ranks(2, work, timeout_s=1.5)
    assert isinstance(results[1], WeightUpdateError) and "the broadcast of bucket 1 failed" in str(results[1])


def test_a_sender_gives_up_when_told_and_closes_the_group():
    told = threading.Event()

    def work(rank, group):
        if rank == 0:
            threading.Timer(0.3, told.set).start()  # as the server refusing the update would
            return group.send({"w": torch.zeros(4)}, given_up=told.is_set)
        threading.Event().wait(1)  # rank 1 never receives

    results = run_ranks(2, work)
    assert isinstance(results[0], WeightUpdateError) and "given up" in str(results[0])


def test_joining_refuses_a_rank_outside_the_world_and_an_unknown_backend():
    with pytest.raises(WeightUpdateError, match="rank_offset: rank 3 is outside a world of 2"):
        WeightGroup.join("127.0.0.1", free_port(), 3, 2, "test")
    with pytest.raises(WeightUpdateError, match="backend: must be one of"):
        WeightGroup.join("127.0.0.1", free_port(), 0, 2, "test", backend="mpi")


@settings(max_examples=60, deadline=None)
@given(
    specs=specs_strategy.filter(lambda specs: all(spec.dtype != torch.bool for spec in specs)),
    changed_fraction=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_a_delta_makes_the_new_tensors_whole_again_bit_for_bit_and_sends_only_what_changed(specs, changed_fraction, seed):
    generator = torch.Generator().manual_seed(seed)

    def random_bits(spec):
        return torch.randint(0, 256, (spec.nbytes,), generator=generator, dtype=torch.uint8).view(spec.dtype).reshape(spec.shape)

    previous = {spec.name: random_bits(spec) for spec in specs}
    current = {}
    for spec in specs:  # some elements replaced by other bits: NaN payloads and signed zeros among them
        keep = torch.rand(spec.shape, generator=generator) >= changed_fraction
        current[spec.name] = torch.where(keep, previous[spec.name], random_bits(spec))
    delta = delta_of(previous, current)
    counts = [len(delta[spec.name + ":changed_positions"]) for spec in specs]
    assert [(s.name, s.dtype, s.shape) for s in delta_specs(specs, counts)] == [
        (name, t.dtype, tuple(t.shape)) for name, t in delta.items()
    ]
    for spec, count in zip(specs, counts):  # exactly the elements whose bits differ
        assert count == int((raw(previous[spec.name]).view(-1, spec.dtype.itemsize) != raw(current[spec.name]).view(-1, spec.dtype.itemsize)).any(1).sum())
    base = {name: t.clone() for name, t in previous.items()}
    whole = with_delta(previous, delta)
    assert list(whole) == list(current)
    for name in current:
        assert torch.equal(raw(whole[name]), raw(current[name]))
        assert torch.equal(raw(previous[name]), raw(base[name]))  # the base is not written


def test_a_delta_names_counts_that_do_not_fit_its_tensors():
    specs = [TensorSpec("w", torch.float32, (2, 3))]
    with pytest.raises(WeightUpdateError, match="changed: w: 7 of its 6 elements"):
        delta_specs(specs, [7])
    with pytest.raises(WeightUpdateError, match="changed: needs one count per tensor"):
        delta_specs(specs, [1, 2])
    outside = {"w:changed_positions": torch.tensor([6]), "w:changed_values": torch.tensor([1.0])}
    with pytest.raises(WeightUpdateError, match="changed: w: a changed position lies outside the tensor"):
        with_delta({"w": torch.zeros(2, 3)}, outside)
