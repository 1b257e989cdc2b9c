"""Weight updates on every worker replica, all or nothing, and the weight version each serves.

A trainer's update reaches `WeightCoordinator`, a one-replica deployment of the application that
the worker replicas follow (`deployments/broadcast.py`). An update is an `ApplyWeights` command
broadcast to every live replica; if any refuses it, the replicas that took it undo it
(`UndoWeights`) and the update fails naming the refusers; otherwise it is committed
(`CommitWeights`) and kept, so that a replica starting later catches up with it. Each replica
runs the commands on its sampling thread, between sampler calls, so a batch finishes on the
weights it started with (`ServedWeights`).

The weights themselves travel through Ray's object store (a trainer's `ray.put` state dict is
fetched by each replica from wherever it lives, a checkpoint is read once, here, and put once), or
over a weight-update group (`rollout.weight_sync`): every replica joins the trainer's process group
(`JoinWeightGroup`), and an update is a `ReceiveWeights` command that each replica runs while the
trainer broadcasts, then applies and checksums; one replica puts what arrived in the object store,
and this coordinator copies it to own it, for a replica starting later to catch up.
The coordinator also broadcasts the commands of other concerns that every replica must run
(`deployments/memory.py`'s); what it keeps is only the weights' history.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.schema import LoggingConfig

from deployments.broadcast import Command, CommandLog, Posted, Report
from deployments.metrics import WeightMetrics
from rollout.checkpoints import UnreadableCheckpointError, disk_update
from rollout.errors import RolloutError, WeightUpdateError, clip
from rollout.weight_sync import PackedTensors, SharedBucket, TensorSpec, WeightGroup, copy_out, delta_specs, with_delta
from rollout.weights import (
    DEFAULT_TARGET_MODULE,
    TensorLayout,
    WeightUpdate,
    apply_update,
    base_weights,
    check_lora_config,
    check_tensors,
    lora_layout,
    single_target,
    tensor_update,
    weights_checksum,
)

if TYPE_CHECKING:  # the coordinator's process needs no model code
    from rollout.models.base import RolloutPipeline

logger = logging.getLogger("ray.serve")
# An answer names every refusing replica with its reason: each reason is a short error already,
# and these bound what a reason from elsewhere (a crashed command's exception) or their sum adds.
MAX_REPLICA_MESSAGE_CHARS = 500
MAX_MESSAGE_CHARS = 1000


class WeightVersionError(RolloutError):
    """A request requires a weight version the replica does not serve."""

    def __init__(self, served: str, required: str):
        self.field = "weight_version"
        self.served, self.required = served, required
        super().__init__(f"weight_version: this replica serves {served!r}, the request requires {required!r}")

    def __reduce__(self):
        return (type(self), (self.served, self.required))


@dataclass(frozen=True)
class ObjectStoreTensors:
    """Named tensors a trainer put in the object store once: `ObjectStoreTensors(ray.put(state_dict))`.

    Every replica fetches them from the object store itself; nothing is copied per replica by
    the trainer and nothing touches a disk. (Wrapped so that Ray passes the reference along
    instead of fetching the tensors into the ingress.)
    """

    ref: ray.ObjectRef


@dataclass(frozen=True)
class DiskSource:
    model_path: str
    target_modules: list[str] | None = None


@dataclass(frozen=True)
class TensorSource:
    """Named tensors, by reference (`ObjectStoreTensors`) or by value (decoded from HTTP)."""

    tensors: ObjectStoreTensors | dict
    target_modules: list[str] | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None


@dataclass(frozen=True, kw_only=True)
class PackedSource:
    """An update packed in buckets (`rollout.weight_sync`): its tensors' specs, the bucket size the
    trainer packs them with, the LoRA fields as for `TensorSource`, and how its bytes arrive (the
    subclasses)."""

    specs: tuple[TensorSpec, ...]
    bucket_bytes: int
    target_modules: list[str] | None = None
    lora_rank: int | None = None
    lora_alpha: float | None = None
    checksum: str | None = None  # the trainer's weights_checksum of the module after the update
    delta_from: str | None = None  # a delta: changes to this version, `changed` elements per tensor
    changed: tuple[int, ...] | None = None

    def packed_specs(self) -> list[TensorSpec]:
        """What the trainer packs: the tensors, or their changed elements."""
        return list(self.specs) if self.delta_from is None else delta_specs(self.specs, self.changed or ())


@dataclass(frozen=True, kw_only=True)
class GroupSource(PackedSource):
    """An update broadcast over the weight-update group `group_name`."""

    group_name: str

    def __str__(self) -> str:
        return f"received over group {self.group_name!r}"


@dataclass(frozen=True, kw_only=True)
class SharedMemorySource(PackedSource):
    """An update whose buckets a trainer on the replicas' machine shares in memory (`buckets`)."""

    buckets: tuple[SharedBucket, ...]

    def __str__(self) -> str:
        return "copied out of the trainer's shared memory"


@dataclass(frozen=True)
class WeightGroupAddress:
    """Where a weight-update group's rank 0 (the trainer) listens, and who is in it."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str
    timeout_s: float | None = None


@dataclass(frozen=True)
class UpdateResult:
    """SGLang's answer (`success`, `message`) and which weights every replica now serves; after an
    update over a weight-update group, each replica's checksum of the module it updated."""

    success: bool
    message: str
    weight_version: str
    failed_replicas: dict[str, str] = field(default_factory=dict)
    checksums: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        # Clipped here, so that no answer or log line echoes a whole value some message holds.
        object.__setattr__(self, "message", clip(self.message, MAX_MESSAGE_CHARS))


# The commands -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyWeights(Command):
    """Serve new weights under `version`: the `WeightUpdate` behind `update`, or named tensors
    with `tensor_args` for `rollout.weights.tensor_update`. `number` names it for its undo."""

    number: int
    version: str
    update: list[ray.ObjectRef]  # one reference, in a list so that Ray does not resolve it
    tensor_args: dict[str, Any] | None = None

    def refs(self) -> list[ray.ObjectRef]:
        return self.update


@dataclass(frozen=True)
class UndoWeights(Command):
    """Undo the apply numbered `undoes`, if it is the one this replica has not committed."""

    undoes: int


@dataclass(frozen=True)
class CommitWeights(Command):
    """Forget the undo of the last apply: it is served for good."""


@dataclass(frozen=True)
class JoinWeightGroup(Command):
    """Join the weight-update group at `address`, each replica as its rank in `ranks`."""

    address: WeightGroupAddress
    ranks: dict[str, int]
    timeout_s: float


@dataclass(frozen=True)
class ReceiveWeights(Command):
    """Receive the tensors the trainer packed (broadcast over the group, or shared in memory), then
    serve them under `version` as `ApplyWeights` would (`number` names it for its undo); `copy_by`
    puts what arrived in the object store and hands back its reference, for replicas that start
    later."""

    number: int
    version: str
    source: PackedSource
    copy_by: str


@dataclass(frozen=True)
class LeaveWeightGroup(Command):
    group_name: str


@dataclass(frozen=True)
class ChecksumWeights(Command):
    """SHA-256 of each module's weights (`module_names`; None: all)."""

    module_names: list[str] | None = None


@dataclass(frozen=True)
class _Committed:
    """A committed apply, kept so that a replica starting later can catch up."""

    posted: Posted
    full_modules: frozenset[str]
    lora_modules: frozenset[str]

    def superseded_by(self, later: "_Committed") -> bool:
        return self.full_modules <= later.full_modules and self.lora_modules <= later.lora_modules


# The coordinator ------------------------------------------------------------------------------

# The `source` label of the weight update metrics.
SOURCE_LABELS = {DiskSource: "disk", TensorSource: "tensors", GroupSource: "group", SharedMemorySource: "shared_memory"}


# Every worker replica long-polls `next_commands` every `POLL_TIMEOUT_S`, and registers and reports
# through the same calls: Serve's access log of them was a line per replica every 10 s in the
# terminal of `make serve` and in a trainer's Python prompt, with nothing in it for either.
@serve.deployment(
    num_replicas=1,
    max_ongoing_requests=10_000,
    ray_actor_options={"num_cpus": 0},
    logging_config=LoggingConfig(enable_access_log=False),
)
class WeightCoordinator:
    def __init__(
        self,
        initial_version: str,
        allowed_weight_paths: list[str],
        update_timeout_s: float,
        allowed_weight_sync_addresses: list[str],
    ):
        self.version = initial_version
        self.allowed_weight_paths = allowed_weight_paths
        self.allowed_weight_sync_addresses = allowed_weight_sync_addresses
        self.update_timeout_s = update_timeout_s
        self.commands = CommandLog(update_timeout_s)
        self.groups: dict[str, dict[str, int]] = {}  # weight-update group -> its replicas' ranks
        self._owning: asyncio.Task | None = None  # the copy of the last group update being made ours
        self.committed: list[_Committed] = []
        self.served: dict[str, str] = {}  # replica -> the version it last reported
        # The modules that hold weights and their weights' layout, as the replicas name them: what a
        # checkpoint's headers are checked against before its data is read.
        self.layouts: dict[str, dict[str, TensorLayout]] = {}
        self._one_at_a_time = asyncio.Lock()
        self.agreed_micro_batches: dict[str, dict[str, dict[str, int]]] = {}
        self.metrics = WeightMetrics()

    # Worker replicas ---------------------------------------------------------------------------

    async def register(
        self, replica: str, actor: ray.actor.ActorHandle, layouts: dict[str, dict[str, TensorLayout]], version: str
    ):
        """A starting replica: returns the commands that bring it to the committed weights, and the
        seq to poll after.

        Registration waits for an update in progress to finish, so a replica either takes part
        in an update or starts from its result. A replica registers again if this coordinator
        does not know it (it restarted, or took the replica for dead); a restarted coordinator,
        which has lost its history, takes the version the replicas serve.
        """
        async with self._one_at_a_time:
            if self._owning is not None:  # a starting replica catches up from a copy this coordinator owns
                await self._owning
            if not self.committed and not self.commands.log:
                self.version = version
            self.layouts = layouts
            self.served[replica] = version
            last_seq = self.commands.register(replica, actor)
            catch_up = [c.posted for c in self.committed]
            if catch_up:
                catch_up.append(Posted(last_seq, CommitWeights()))
            return catch_up, last_seq

    async def agree_micro_batches(self, key: str, offered: dict[str, dict[str, int]] | None) -> dict | None:
        """The micro-batch sizes every replica that calibrates under `key` (its model, device and
        sizes: `rollout.calibration.digest_of`) serves with: the first offered. None offers
        nothing and asks. A coordinator that restarts forgets them; a replica measuring again on a
        machine that keeps them (`rollout.calibration.CalibrationCache`) reads the same."""
        if offered is not None:
            self.agreed_micro_batches.setdefault(key, offered)
        return self.agreed_micro_batches.get(key)

    async def next_commands(self, replica: str, after_seq: int) -> list[Posted] | None:
        return await self.commands.next_commands(replica, after_seq)

    async def report(self, replica: str, seq: int, report: Report) -> None:
        if self.commands.report(replica, seq, report) and report.version is not None:
            self.served[replica] = report.version

    async def deregister(self, replica: str) -> None:
        self.commands.deregister(replica)
        self.served.pop(replica, None)

    # Trainers, through the ingress ------------------------------------------------------------

    async def state(self) -> dict:
        served = {replica: self.served.get(replica) for replica in self.commands.replicas}
        return {"weight_version": self.version, "replicas": served}

    async def update(self, source: DiskSource | TensorSource | PackedSource, version: str | None = None) -> UpdateResult:
        """Applies an update on every live replica, all or nothing."""
        started = time.perf_counter()
        result = await self._update(source, version)
        self.metrics.updated(SOURCE_LABELS[type(source)], result.success, time.perf_counter() - started)
        return result

    async def _update(self, source: DiskSource | TensorSource | PackedSource, version: str | None) -> UpdateResult:
        async with self._one_at_a_time:
            if not self.commands.replicas:
                return UpdateResult(False, "no worker replica is running", self.version)
            if isinstance(source, GroupSource):
                return await self._update_from_group(source, version)
            if isinstance(source, SharedMemorySource):
                return await self._update_from_shared_memory(source, version)
            try:
                committed = await self._apply_command(source, version)
            except UnreadableCheckpointError as error:  # the same answer for every such path; its cause only here
                logger.warning("weight update refused: %s %s", error.shown, error.cause)
                return UpdateResult(False, str(error), self.version)
            except WeightUpdateError as error:
                return UpdateResult(False, str(error), self.version)
            except Exception:  # refused, not a crash; its text may hold paths and values, so only the log has it
                logger.exception("reading a weight update failed")
                return UpdateResult(False, "cannot read the update; the server log has the details", self.version)
            apply = committed.posted
            reports = await self.commands.broadcast(apply.command, seq=apply.seq)
            failed = _refusals(reports)
            if failed:
                took = [replica for replica, report in reports.items() if report.ok]
                await self.commands.broadcast(UndoWeights(apply.seq), only=took)
                return UpdateResult(False, _refused("update", failed, "undone on the others"), self.version, failed)
            self._commit(committed)
            return UpdateResult(True, f"weights {self.version!r} served by {len(reports)} replica(s)", self.version)

    def _commit(self, committed: _Committed) -> None:
        """Serves `committed`'s version for good, and keeps it for replicas that start later."""
        self.version = committed.posted.command.version
        self.committed = [c for c in self.committed if not c.superseded_by(committed)] + [committed]
        self.commands.post(CommitWeights())

    # Weight-update groups ----------------------------------------------------------------------

    async def init_weight_group(self, address: WeightGroupAddress) -> UpdateResult:
        """Every live replica joins the trainer's group, replica i (in name order) as rank
        `rank_offset + i`; all of them or none (the ones that joined leave again)."""
        async with self._one_at_a_time:
            replicas = sorted(self.commands.replicas)
            if address.master_address not in self.allowed_weight_sync_addresses:
                return UpdateResult(
                    False,
                    f"master_address: {clip(address.master_address)!r} is not in the app's allowed_weight_sync_addresses",
                    self.version,
                )
            if address.rank_offset + len(replicas) != address.world_size:
                return UpdateResult(
                    False,
                    f"world_size: must be rank_offset + {len(replicas)} (this server's worker replicas, one rank "
                    f"each) = {address.rank_offset + len(replicas)}, got {address.world_size}",
                    self.version,
                )
            if address.group_name in self.groups:
                await self._leave(address.group_name)  # SGLang's init replaces a group of the same name
            ranks = {replica: address.rank_offset + i for i, replica in enumerate(replicas)}
            timeout_s = min(address.timeout_s or self.update_timeout_s, self.update_timeout_s)
            reports = await self.commands.broadcast(JoinWeightGroup(address, ranks, timeout_s))
            failed = _refusals(reports) | {replica: "left before joining" for replica in set(ranks) - set(reports)}
            if failed:
                await self.commands.broadcast(LeaveWeightGroup(address.group_name))
                return UpdateResult(False, _refused("joining the group", failed, "left by the others"), self.version, failed)
            self.groups[address.group_name] = ranks
            return UpdateResult(True, f"{len(ranks)} replica(s) joined group {address.group_name!r}", self.version)

    async def destroy_weight_group(self, group_name: str) -> UpdateResult:
        async with self._one_at_a_time:
            if group_name not in self.groups:
                return UpdateResult(False, f"group_name: no weight-update group {clip(group_name)!r}", self.version)
            await self._leave(group_name)
            return UpdateResult(True, f"group {group_name!r} destroyed", self.version)

    async def _leave(self, group_name: str) -> None:
        self.groups.pop(group_name, None)
        await self.commands.broadcast(LeaveWeightGroup(group_name))

    async def _update_from_group(self, source: GroupSource, version: str | None) -> UpdateResult:
        """`update` over a weight-update group. A refusal before the replicas receive anything closes
        the group, since the trainer's broadcast cannot be taken back; so does a replica lost."""
        name = source.group_name
        ranks = self.groups.get(name)
        if ranks is None:
            return UpdateResult(False, f"group_name: no weight-update group {clip(name)!r}: init one first", self.version)
        try:
            if set(ranks) != set(self.commands.replicas):
                raise WeightUpdateError(
                    "group_name", f"the replicas changed since group {name!r} was made, so its broadcast cannot complete"
                )
            self._check_packed_update(source)
        except WeightUpdateError as error:
            await self._leave(name)
            return UpdateResult(False, f"{error}; group {name!r} is closed: init a new one", self.version)
        result, group_lost = await self._update_from_packed(source, version, sorted(ranks, key=ranks.get))
        if group_lost:
            await self._leave(name)
            return dataclasses.replace(result, message=f"{result.message}; group {name!r} is closed: init a new one")
        return result

    async def _update_from_shared_memory(self, source: SharedMemorySource, version: str | None) -> UpdateResult:
        try:
            self._check_packed_update(source)
        except WeightUpdateError as error:
            return UpdateResult(False, str(error), self.version)
        result, _ = await self._update_from_packed(source, version, sorted(self.commands.replicas))
        return result

    async def _update_from_packed(
        self, source: PackedSource, version: str | None, replicas: list[str]
    ) -> tuple[UpdateResult, bool]:
        """Every one of `replicas` receives the packed update and serves it, or none does; the first
        keeps a copy for replicas that start later. Also says whether a replica was lost or left
        the group, which a group's broadcast cannot go on without."""
        seq = self.commands.next_seq()
        version = version or f"update-{seq}"
        copy_by = replicas[0]
        reports = await self.commands.broadcast(ReceiveWeights(seq, version, source, copy_by), seq=seq)
        failed = _refusals(reports) | {replica: "left during the update" for replica in set(replicas) - set(reports)}
        took = [replica for replica, report in reports.items() if report.ok]
        checksums = {replica: reports[replica].result["checksum"] for replica in took}
        if not failed and source.checksum is not None:
            failed = {
                replica: f"serves checksum {checksum}, not the trainer's {source.checksum}"
                for replica, checksum in checksums.items()
                if checksum != source.checksum
            }
        if not failed and len(set(checksums.values())) > 1:
            failed = {replica: f"serves checksum {checksum}, which others do not" for replica, checksum in checksums.items()}
        if failed:
            await self.commands.broadcast(UndoWeights(seq), only=took)
            lost = len(reports) < len(replicas) or any(report.result == "group closed" for report in reports.values())
            return UpdateResult(False, _refused("update", failed, "undone on the others"), self.version, failed), lost
        args = dict(target_modules=source.target_modules, lora_rank=source.lora_rank, lora_alpha=source.lora_alpha)
        module = frozenset([single_target(source.target_modules)])
        full, lora = (frozenset(), module) if source.lora_rank is not None else (module, frozenset())
        copy = reports[copy_by].result["copy"]  # put by the replica that received it, so owned by it
        committed = _Committed(Posted(seq, ApplyWeights(seq, version, [copy], args)), full, lora)
        self._commit(committed)
        # Owned here once copied here, it outlives that replica; meanwhile the trainer has its answer.
        self._owning = asyncio.create_task(self._own_copy(committed))
        stages = "; ".join(f"{replica}: {reports[replica].message}" for replica in took)
        message = f"weights {version!r} served by {len(took)} replica(s), {source} ({stages})"
        return UpdateResult(True, message, version, checksums=checksums), False

    async def _own_copy(self, committed: _Committed) -> None:
        """Replaces `committed`'s tensors, owned by the replica that put them, by a copy put here."""
        apply = committed.posted.command
        try:
            owned = await asyncio.to_thread(lambda: ray.put(ray.get(apply.update[0])))
        except Exception:  # that replica died before the copy was made: later replicas cannot catch up from it
            logger.exception("keeping the weights of update %r for replicas that start later failed", apply.version)
            return
        if committed in self.committed:  # not superseded meanwhile
            kept = dataclasses.replace(committed, posted=Posted(committed.posted.seq, dataclasses.replace(apply, update=[owned])))
            self.committed[self.committed.index(committed)] = kept

    def _check_packed_update(self, source: PackedSource) -> None:
        """The tensors' specs against the layout of the module they are for, as a checkpoint's header
        is checked: before any replica allocates a byte for them."""
        module = single_target(source.target_modules)
        if module not in self.layouts:
            raise WeightUpdateError("target_modules", f"{clip(module)!r} is not one of {sorted(self.layouts)}")
        given = {spec.name: TensorLayout(spec.shape, spec.dtype) for spec in source.specs}
        if len(given) != len(source.specs):
            raise WeightUpdateError("names", "a tensor is named twice")
        layout = self.layouts[module]
        if source.delta_from is not None:
            if source.lora_rank is not None:
                raise WeightUpdateError("delta_from", "a LoRA adapter is sent whole, not as a delta")
            served = {self.served.get(replica) for replica in self.commands.replicas} | {self.version}
            if served != {source.delta_from}:
                raise WeightUpdateError(
                    "delta_from", f"the replicas serve {sorted(served)}, not {clip(source.delta_from)!r}: send it whole"
                )
        if source.lora_rank is not None:
            check_lora_config(source.lora_rank, source.lora_alpha, {spec.dtype for spec in source.specs})
            layout = lora_layout(layout, source.lora_rank, given)
        check_tensors(f"{module} weights", layout, given, "names")
        # What the replicas allocate for the update: never more than the module holds (a LoRA
        # adapter of an absurd rank, or a delta larger than the tensors it changes).
        packed = sum(spec.nbytes for spec in source.packed_specs())
        held = sum(math.prod(entry.shape) * entry.dtype.itemsize for entry in self.layouts[module].values())
        if packed > held:
            raise WeightUpdateError("shapes", f"the update takes {packed:,} bytes, more than {module}'s {held:,}")

    async def broadcast_command(self, command: Command) -> dict[str, Report]:
        """Runs a command that changes no weights (a checksum, releasing memory) on every live
        replica; their reports by replica."""
        if isinstance(command, (ApplyWeights, UndoWeights, CommitWeights, ReceiveWeights, JoinWeightGroup)):
            raise TypeError("weights change through update(), which keeps every replica on the same weights")
        async with self._one_at_a_time:
            return await self.commands.broadcast(command)

    async def _apply_command(self, source: DiskSource | TensorSource, version: str | None) -> _Committed:
        seq = self.commands.next_seq()
        version = version or f"update-{seq}"
        if isinstance(source, DiskSource):
            update: WeightUpdate = await asyncio.to_thread(
                disk_update, source.model_path, self.layouts, source.target_modules, self.allowed_weight_paths
            )
            apply = ApplyWeights(seq, version, [ray.put(update)])
            return _Committed(Posted(seq, apply), frozenset(update.state_dicts), frozenset(update.lora))
        tensors = source.tensors
        ref = tensors.ref if isinstance(tensors, ObjectStoreTensors) else ray.put(tensors)
        args = dict(target_modules=source.target_modules, lora_rank=source.lora_rank, lora_alpha=source.lora_alpha)
        module = frozenset([(source.target_modules or [DEFAULT_TARGET_MODULE])[0]])
        full, lora = (frozenset(), module) if source.lora_rank is not None else (module, frozenset())
        return _Committed(Posted(seq, ApplyWeights(seq, version, [ref], args)), full, lora)


class _Stages:
    """How long each stage of a replica's part of an update took, in its report's words."""

    def __init__(self):
        self._since = time.perf_counter()
        self._took: list[str] = []

    def done(self, stage: str) -> None:
        now = time.perf_counter()
        self._took.append(f"{stage} in {now - self._since:.2f} s")
        self._since = now

    def __str__(self) -> str:
        return ", ".join(self._took)


def _refusals(reports: dict[str, Report]) -> dict[str, str]:
    return {replica: clip(report.message, MAX_REPLICA_MESSAGE_CHARS) for replica, report in reports.items() if not report.ok}


def _refused(what: str, failed: dict[str, str], others: str) -> str:
    names = ", ".join(f"{replica}: {message}" for replica, message in failed.items())
    return f"{what} refused by {len(failed)} replica(s), {others}: {names}"


# A replica's side ------------------------------------------------------------------------------


class ServedWeights:
    """A worker replica's weights: the version it serves, the undo of its last apply until that is
    committed, the weight-update groups it is in, and the handlers of the weight commands (run on
    the sampling thread, so `version` never changes during a sampler call)."""

    def __init__(self, pipeline: RolloutPipeline, version: str, replica: str):
        self.pipeline = pipeline
        self.version = version
        self.replica = replica
        self._undo: tuple[int, WeightUpdate, str] | None = None  # (apply number, its undo, the version before)
        self._groups: dict[str, WeightGroup] = {}

    def handlers(self) -> dict[type[Command], Any]:
        return {
            ApplyWeights: self.apply,
            UndoWeights: self.undo,
            CommitWeights: self.commit,
            ChecksumWeights: self.checksum,
            JoinWeightGroup: self.join_group,
            ReceiveWeights: self.receive,
            LeaveWeightGroup: self.leave_group,
        }

    def apply(self, command: ApplyWeights, payload: Any) -> Report:
        if isinstance(payload, PackedTensors):  # an update that came over a group, kept for catching up
            payload = payload.tensors()
        return self._applied(command.number, command.version, payload, command.tensor_args)

    def _applied(self, number: int, version: str, payload: Any, tensor_args: dict[str, Any] | None) -> Report:
        try:
            update = payload if isinstance(payload, WeightUpdate) else tensor_update(payload, **tensor_args)
            undo = apply_update(self.pipeline.weight_modules, update)
        except WeightUpdateError as error:
            return Report(False, str(error))
        self._undo = (number, undo, self.version)
        self.version = version
        return Report(True, f"applied {update.num_bytes() / 2**20:.1f} MiB")

    def join_group(self, command: JoinWeightGroup) -> Report:
        address = command.address
        self.leave_group(LeaveWeightGroup(address.group_name))
        try:
            self._groups[address.group_name] = WeightGroup.join(
                address.master_address,
                address.master_port,
                command.ranks[self.replica],
                address.world_size,
                address.group_name,
                address.backend,
                command.timeout_s,
            )
        except (KeyError, WeightUpdateError) as error:
            return Report(False, f"cannot join: {error}")
        return Report(True, f"rank {command.ranks[self.replica]}")

    def receive(self, command: ReceiveWeights) -> Report:
        """The trainer's packed update, applied as `apply` applies tensors; the report's result holds
        the checksum of the updated module and, from `copy_by`, what arrived, in the object store.
        Its message says how long each stage took."""
        source = command.source
        stages = _Stages()
        if isinstance(source, GroupSource):
            group = self._groups.get(source.group_name)
            if group is None:
                return Report(False, f"not in group {source.group_name!r}", result="group closed")
            try:
                packed = group.receive(source.packed_specs(), source.bucket_bytes)
            except WeightUpdateError as error:  # the trainer or a peer is gone: the group cannot be used again
                self.leave_group(LeaveWeightGroup(source.group_name))
                return Report(False, str(error), result="group closed")
        else:
            try:
                packed = copy_out(source.buckets, source.packed_specs(), source.bucket_bytes, self.pipeline.device)
            except WeightUpdateError as error:
                return Report(False, str(error))
        stages.done("received")
        module = self.pipeline.weight_modules[single_target(source.target_modules)]
        tensors = packed.tensors()
        if source.delta_from is not None:
            if self.version != source.delta_from:
                return Report(False, f"serves {self.version!r}, and the delta is from {source.delta_from!r}")
            try:
                tensors = with_delta(base_weights(module), tensors)
            except WeightUpdateError as error:
                return Report(False, str(error))
            packed = PackedTensors.of(tensors)  # kept whole: a replica that starts later has no base
            stages.done("made whole")
        args = dict(target_modules=source.target_modules, lora_rank=source.lora_rank, lora_alpha=source.lora_alpha)
        applied = self._applied(command.number, command.version, tensors, args)
        if not applied.ok:
            return applied
        stages.done("applied")
        checksum = weights_checksum(module)
        stages.done("checksummed")
        copy = None
        if self.replica == command.copy_by:
            copy = ray.put(packed)
            stages.done("kept")
        message = f"{packed.num_bytes() / 2**20:.1f} MiB: {stages}"
        return Report(True, message, result={"checksum": checksum, "copy": copy})

    def leave_group(self, command: LeaveWeightGroup) -> Report:
        group = self._groups.pop(command.group_name, None)
        if group is not None:
            group.close()
        return Report(True)

    def undo(self, command: UndoWeights) -> Report:
        if self._undo is not None and self._undo[0] == command.undoes:
            _, undo, previous_version = self._undo
            apply_update(self.pipeline.weight_modules, undo)
            self._undo, self.version = None, previous_version
        return Report(True, "undone")

    def commit(self, command: CommitWeights) -> Report:
        self._undo = None
        return Report(True)

    def checksum(self, command: ChecksumWeights) -> Report:
        modules = self.pipeline.weight_modules
        names = dict.fromkeys(command.module_names or modules)
        # An unknown name is answered clipped: the answer is never much larger than the request.
        return Report(
            True, result={clip(n): weights_checksum(modules[n]) if n in modules else "not_found" for n in names}
        )

    def check_version(self, required_version: str | None) -> None:
        """Raises `WeightVersionError` unless this replica serves `required_version` (None: any)."""
        if required_version is not None and required_version != self.version:
            raise WeightVersionError(self.version, required_version)
