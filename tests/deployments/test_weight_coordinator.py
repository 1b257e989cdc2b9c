"""The coordinator's protocol with scripted replicas: undo when one refuses, dead replicas, catch-up.

Real replicas always agree on whether an update fits (they serve the same model), so a refusal
by one replica only (a lost object, a device error) is scripted here.
"""

import asyncio

import pytest
import ray
import torch

from deployments.broadcast import Command, Report
from deployments.weights import (
    ApplyWeights,
    DiskSource,
    GroupSource,
    SharedMemorySource,
    TensorSource,
    UndoWeights,
    WeightCoordinator,
)
from rollout.errors import WeightUpdateError
from rollout.weight_sync import SharedBucket, TensorSpec
from rollout.weights import TensorLayout


class Liveness:
    """Stands in for a replica's actor handle: `__ray_ready__` answers, or the actor is dead."""

    def __init__(self):
        self.dead = False

    @property
    def __ray_ready__(self):
        return self

    async def _ready(self):
        if self.dead:
            raise ray.exceptions.RayActorError()
        return True

    def remote(self):
        return self._ready()


class ScriptedReplica:
    """Follows the coordinator like a worker's `Follower`, answering applies as scripted."""

    def __init__(self, coordinator, name, refuse_applies=False):
        self.coordinator, self.name, self.refuse_applies = coordinator, name, refuse_applies
        self.liveness = Liveness()
        self.ran: list[tuple[str, int | None]] = []
        self.version = "v0"
        self.stopped = False

    async def start(self):
        catch_up, last_seq = await self.coordinator.register(self.name, self.liveness, ["transformer"], self.version)
        for posted in catch_up:
            if isinstance(posted.command, ApplyWeights):
                self.version = posted.command.version
        self.task = asyncio.create_task(self.follow(last_seq))

    async def stop(self):
        # Not by cancelling: asyncio.wait_for in Python 3.11 can swallow a cancellation.
        self.stopped = True
        self.coordinator.commands._notify("_posted")
        await self.task

    async def follow(self, last_seq):
        while not self.stopped:
            commands = await self.coordinator.next_commands(self.name, last_seq)
            if commands is None:
                _, last_seq = await self.coordinator.register(self.name, self.liveness, ["transformer"], self.version)
                continue
            for posted in commands:
                command = posted.command
                self.ran.append((type(command), getattr(command, "undoes", None)))
                if isinstance(command, ApplyWeights) and not self.refuse_applies:
                    self.version = command.version
                    report = Report(True, version=self.version)
                elif isinstance(command, ApplyWeights):
                    report = Report(False, "device lost", self.version)
                else:
                    report = Report(True, version=self.version)
                await self.coordinator.report(self.name, posted.seq, report)
                last_seq = posted.seq


def coordinator():
    return WeightCoordinator.func_or_class("v0", [], update_timeout_s=30, allowed_weight_sync_addresses=["127.0.0.1"])


def tensors():
    return TensorSource({"proj_out.weight": torch.zeros(2, 2)})


async def started(coordinator, *replicas):
    for replica in replicas:
        await replica.start()
    return replicas


def test_an_update_one_replica_refuses_is_undone_on_the_others(ray_cluster):
    async def scenario():
        c = coordinator()
        good, bad = await started(c, ScriptedReplica(c, "good"), ScriptedReplica(c, "bad", refuse_applies=True))
        result = await c.update(tensors(), "v1")
        await asyncio.sleep(0.1)
        await good.stop(), await bad.stop()
        return c, good, bad, result

    c, good, bad, result = asyncio.run(scenario())
    assert not result.success and result.weight_version == "v0"
    assert result.failed_replicas == {"bad": "device lost"} and "bad: device lost" in result.message
    apply_seq = 1
    assert good.ran == [(ApplyWeights, None), (UndoWeights, apply_seq)]
    assert c.version == "v0" and c.committed == []


def test_replicas_serve_the_micro_batch_sizes_offered_first_for_their_key():
    async def scenario():
        c = coordinator()
        sizes = {"micro_batch_sizes": {"64x64": 8}, "decode_batch_sizes": {"64x64": 4}}
        return [
            await c.agree_micro_batches("h200-flux", None),
            await c.agree_micro_batches("h200-flux", sizes),
            await c.agree_micro_batches("h200-flux", {"micro_batch_sizes": {"64x64": 16}, "decode_batch_sizes": {}}),
            await c.agree_micro_batches("h200-flux", None),
            await c.agree_micro_batches("h100-flux", None),
        ]

    asked, offered, offered_later, asked_later, other_key = asyncio.run(scenario())
    assert asked is None and other_key is None
    assert offered == offered_later == asked_later == {"micro_batch_sizes": {"64x64": 8}, "decode_batch_sizes": {"64x64": 4}}


def test_a_dead_replica_is_not_waited_for_and_a_new_one_catches_up(ray_cluster):
    async def scenario():
        c = coordinator()
        alive, doomed = await started(c, ScriptedReplica(c, "alive"), ScriptedReplica(c, "doomed"))
        await doomed.stop()
        doomed.liveness.dead = True
        result = await c.update(tensors(), "v1")
        newcomer = ScriptedReplica(c, "newcomer")
        await newcomer.start()
        await alive.stop(), await newcomer.stop()
        return c, alive, newcomer, result

    c, alive, newcomer, result = asyncio.run(scenario())
    assert result.success and result.message == "weights 'v1' served by 1 replica(s)"
    assert set(c.commands.replicas) == {"alive", "newcomer"}
    assert alive.version == newcomer.version == "v1"


def test_unreadable_checkpoints_get_one_answer_and_only_the_log_says_why(tmp_path, serve_log):
    """No Ray: nothing is read, so nothing is put in the object store or broadcast."""
    (tmp_path / "not-weights.safetensors").write_bytes(b"x")
    paths = [tmp_path / "missing", tmp_path, tmp_path / "not-weights.safetensors"]

    async def scenario():
        c = coordinator()
        await c.register("replica", Liveness(), ["transformer"], "v0")
        return [await c.update(DiskSource(str(path))) for path in paths]

    results = asyncio.run(scenario())
    assert not any(result.success for result in results)
    assert len({result.message.replace(repr(str(path)), "<path>") for result, path in zip(results, paths)}) == 1
    logged = [record.getMessage() for record in serve_log.records]
    for cause in ("FileNotFoundError", "no safetensors weights for ['transformer']", "too short"):
        assert any(cause in line for line in logged), (cause, logged)
        assert not any(cause in result.message for result in results)


def test_an_update_with_no_replica_fails(ray_cluster):
    result = asyncio.run(coordinator().update(tensors(), "v1"))
    assert not result.success and "no worker replica" in result.message


@pytest.mark.parametrize("later_lora", [True, False])
def test_committed_updates_are_kept_only_until_superseded(ray_cluster, later_lora):
    async def scenario():
        c = coordinator()
        (only,) = await started(c, ScriptedReplica(c, "only"))
        await c.update(TensorSource({"a.weight": torch.zeros(1)}), "full")
        await c.update(TensorSource({"x.lora_A.weight": torch.zeros(1)}, lora_rank=1, lora_alpha=1), "lora-1")
        if later_lora:
            await c.update(TensorSource({"x.lora_A.weight": torch.zeros(1)}, lora_rank=1, lora_alpha=1), "lora-2")
        else:
            await c.update(TensorSource({"a.weight": torch.zeros(1)}), "full-2")
        await only.stop()
        return c

    c = asyncio.run(scenario())
    kept = [entry.posted.command.version for entry in c.committed]
    # A LoRA push replaces the previous adapter; full weights replace full weights, not the adapter.
    assert kept == (["full", "lora-2"] if later_lora else ["lora-1", "full-2"])


def test_replicas_register_again_with_a_restarted_coordinator(ray_cluster):
    async def scenario():
        first = coordinator()
        (replica,) = await started(first, ScriptedReplica(first, "r"))
        await first.update(tensors(), "v3")
        restarted = coordinator()  # a new process: no replicas, no history, the initial version
        replica.coordinator = restarted
        first.commands._notify("_posted")  # the poll in flight ends; the next one goes to the new coordinator
        for _ in range(50):
            if "r" in restarted.commands.replicas:
                break
            await asyncio.sleep(0.05)
        state = await restarted.state()
        result = await restarted.update(tensors(), "v4")
        await replica.stop()
        return state, result, replica

    state, result, replica = asyncio.run(scenario())
    assert state == {"weight_version": "v3", "replicas": {"r": "v3"}}  # it took the version served
    assert result.success and replica.version == "v4"


def test_one_off_commands_reach_every_replica_but_weights_change_only_through_update(ray_cluster):
    async def scenario():
        c = coordinator()
        first, second = await started(c, ScriptedReplica(c, "first"), ScriptedReplica(c, "second"))
        reports = await c.broadcast_command(Command())  # a command of no concern's, which changes no weights
        with pytest.raises(TypeError, match="through update"):
            await c.broadcast_command(UndoWeights(1))
        await first.stop(), await second.stop()
        return reports, first

    reports, first = asyncio.run(scenario())
    assert set(reports) == {"first", "second"} and all(report.ok for report in reports.values())
    assert [kind for kind, _ in first.ran] == [Command]


ABSURD_LORA = (
    TensorSpec("w.lora_A.weight", torch.float32, (10**6, 4)),
    TensorSpec("w.lora_B.weight", torch.float32, (4, 10**6)),
)


W = (TensorSpec("w.weight", torch.float32, (4, 4)),)


@pytest.mark.parametrize(
    "specs, fields, problem",
    [
        (W, {}, None),
        ((TensorSpec("w.weight", torch.float32, (4, 5)),), {}, "names: transformer weights: w.weight has shape"),
        (W + W, {}, "named twice"),
        # A LoRA adapter of an absurd rank: the replicas would allocate more than the module holds.
        (ABSURD_LORA, dict(lora_rank=10**6, lora_alpha=1.0), "shapes: the update takes 32,000,000 bytes, more than transformer's 64"),
        # A delta of every element, larger than the tensor it changes.
        (W, dict(delta_from="v0", changed=(16,)), "shapes: the update takes 192 bytes, more than transformer's 64"),
        (W, dict(delta_from="v9", changed=(1,)), "delta_from"),
        (W, dict(delta_from="v0", changed=(17,)), "changed: w.weight: 17"),
    ],
    ids=["fits", "shape", "twice", "lora-rank", "delta-larger", "delta-stale", "delta-count"],
)
@pytest.mark.parametrize(
    "carried_by", [dict(group_name="g"), dict(buckets=(SharedBucket(shm_name="rollout_ws_x"),))], ids=["group", "shared"]
)
def test_a_packed_update_is_checked_against_the_served_layout_before_any_replica_allocates(specs, fields, problem, carried_by):
    c = coordinator()
    c.layouts = {"transformer": {"w.weight": TensorLayout((4, 4), torch.float32)}}
    kind = GroupSource if "group_name" in carried_by else SharedMemorySource
    source = kind(specs=specs, bucket_bytes=2**20, **fields, **carried_by)
    if problem is None:
        c._check_packed_update(source)
        return
    with pytest.raises(WeightUpdateError, match=problem):
        c._check_packed_update(source)


def test_a_delta_is_checked_against_the_live_replicas_only():
    """A replica that died after reporting an older version (Serve replaced it) does not make the
    coordinator refuse a delta from what every live replica serves."""
    c = coordinator()
    c.layouts = {"transformer": {"w.weight": TensorLayout((4, 4), torch.float32)}}
    c.served = {"dead": "v-old"}
    c._check_packed_update(SharedMemorySource(specs=W, bucket_bytes=2**20, delta_from="v0", changed=(1,), buckets=()))
