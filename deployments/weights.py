"""Weight updates on every worker replica: one coordinator that the replicas follow.

A handle call or an HTTP request reaches one replica, so updates are not sent to the workers.
They are posted to `WeightCoordinator`, a one-replica deployment of the application, as numbered
commands; every worker replica registers when it starts (first applying what was committed
before it existed), long-polls for commands, runs each on its sampling thread between sampler
calls (so a batch finishes on the weights it started with), and reports back. An update returns
once every live replica has applied it; if any refused it, the replicas that took it undo it,
and the update fails naming the refusers. Dead replicas are noticed and not waited for.

The weights themselves travel through Ray's object store: a trainer's `ray.put` state dict is
fetched by each replica from wherever it lives, a checkpoint is read once (here) and put once.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Literal

import ray
import torch
from ray import serve

from rollout.errors import RolloutError
from rollout.weights import (
    DEFAULT_TARGET_MODULE,
    WeightUpdate,
    WeightUpdateError,
    apply_update,
    disk_update,
    tensor_update,
    weights_checksum,
)

if TYPE_CHECKING:  # the coordinator's process needs no model code
    from rollout.models.base import RolloutPipeline

logger = logging.getLogger("ray.serve")

# How long a worker's poll waits for a command before asking again.
POLL_TIMEOUT_S = 10.0
# How often the coordinator checks that the replicas it waits for are still alive.
LIVENESS_INTERVAL_S = 1.0


class WeightVersionError(RolloutError):
    """A request requires a weight version the replica does not serve."""

    def __init__(self, served: str, required: str):
        self.field = "weight_version"
        self.served, self.required = served, required
        super().__init__(f"weight_version: this replica serves {served!r}, the request requires {required!r}")

    def __reduce__(self):
        return (type(self), (self.served, self.required))


class MemoryReleasedError(RolloutError):
    """The replica released its memory (`release_memory_occupation`) and samples nothing until resumed."""


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


@dataclass(frozen=True)
class Command:
    """What every replica runs, in `seq` order.

    Attributes:
        kind: ``apply`` (the update behind `update`, then serve `version`), ``undo`` (the last
            apply), ``commit`` (forget the last apply's undo), ``checksum``, ``release``, ``resume``.
        update: for ``apply``: an object-store reference to a `WeightUpdate`, or to named
            tensors with `tensor_args` for `rollout.weights.tensor_update`.
    """

    seq: int
    kind: Literal["apply", "undo", "commit", "checksum", "release", "resume"]
    version: str | None = None
    update: list[ray.ObjectRef] = field(default_factory=list)  # a list, so Ray does not resolve it
    tensor_args: dict[str, Any] | None = None
    module_names: list[str] | None = None
    undoes: int | None = None  # for ``undo``: the seq of the apply to undo


@dataclass(frozen=True)
class Report:
    ok: bool
    message: str = ""
    version: str | None = None
    result: Any = None


@dataclass(frozen=True)
class UpdateResult:
    """SGLang's answer (`success`, `message`) and which weights every replica now serves."""

    success: bool
    message: str
    weight_version: str
    failed_replicas: dict[str, str] = field(default_factory=dict)


@dataclass
class _Replica:
    actor: ray.actor.ActorHandle
    version: str
    module_names: list[str]
    last_seq: int  # the last command it ran


@dataclass(frozen=True)
class _Committed:
    """A committed apply, kept so that a replica starting later can catch up."""

    command: Command
    full_modules: frozenset[str]
    lora_modules: frozenset[str]

    def superseded_by(self, later: "_Committed") -> bool:
        return self.full_modules <= later.full_modules and self.lora_modules <= later.lora_modules


@serve.deployment(num_replicas=1, max_ongoing_requests=10_000, ray_actor_options={"num_cpus": 0})
class WeightCoordinator:
    def __init__(self, initial_version: str, allowed_weight_paths: list[str], update_timeout_s: float):
        self.version = initial_version
        self.allowed_weight_paths = allowed_weight_paths
        self.update_timeout_s = update_timeout_s
        self.replicas: dict[str, _Replica] = {}
        self.log: list[Command] = []  # commands some replica has not run yet, in order
        self.committed: list[_Committed] = []
        self._reports: dict[int, dict[str, Report]] = {}  # for the commands being waited for
        self._seq = itertools.count(1)
        # Set, then replaced, when a command is posted or a report arrives: waiters hold the old one.
        self._posted = asyncio.Event()
        self._reported = asyncio.Event()
        self._one_at_a_time = asyncio.Lock()

    # Worker replicas ---------------------------------------------------------------------------

    async def register(self, replica: str, actor: ray.actor.ActorHandle, module_names: list[str], version: str):
        """A starting replica: returns the committed applies to catch up with, and the seq to poll after.

        Registration waits for an update in progress to finish, so a replica either takes part
        in an update or starts from its result. A replica registers again if this coordinator
        does not know it (it restarted, or took the replica for dead); a restarted coordinator,
        which has lost its history, takes the version the replicas serve.
        """
        async with self._one_at_a_time:
            if not self.committed and not self.log:
                self.version = version
            last_seq = self.log[-1].seq if self.log else 0
            self.replicas[replica] = _Replica(actor, version, module_names, last_seq)
            return [c.command for c in self.committed], last_seq

    async def next_commands(self, replica: str, after_seq: int) -> list[Command] | None:
        """Long poll: the commands after `after_seq`, or none after `POLL_TIMEOUT_S`; None for a
        replica this coordinator does not know, which must register."""
        if replica not in self.replicas:
            return None
        if not (self.log and self.log[-1].seq > after_seq):
            try:
                await asyncio.wait_for(self._posted.wait(), POLL_TIMEOUT_S)
            except asyncio.TimeoutError:
                return []
        return [command for command in self.log if command.seq > after_seq]

    async def report(self, replica: str, seq: int, report: Report) -> None:
        state = self.replicas.get(replica)
        if state is None:
            return
        state.last_seq = max(state.last_seq, seq)
        if report.version is not None:
            state.version = report.version
        if seq in self._reports:
            self._reports[seq][replica] = report
            self._notify("_reported")

    async def deregister(self, replica: str) -> None:
        self.replicas.pop(replica, None)
        self._notify("_reported")

    # Trainers, through the ingress ------------------------------------------------------------

    async def state(self) -> dict:
        return {"weight_version": self.version, "replicas": {r: s.version for r, s in self.replicas.items()}}

    async def update(self, source: DiskSource | TensorSource, version: str | None = None) -> UpdateResult:
        """Applies an update on every live replica, all or nothing."""
        async with self._one_at_a_time:
            if not self.replicas:
                return UpdateResult(False, "no worker replica is running", self.version)
            try:
                command, full, lora = await self._apply_command(source, version)
            except WeightUpdateError as error:
                return UpdateResult(False, str(error), self.version)
            except Exception as error:  # an unreadable checkpoint directory, say: refused, not a crash
                return UpdateResult(False, f"cannot read the update: {type(error).__name__}: {error}", self.version)
            reports = await self._broadcast(command)
            failed = {replica: report.message for replica, report in reports.items() if not report.ok}
            if failed:
                took = [replica for replica, report in reports.items() if report.ok]
                await self._broadcast(Command(next(self._seq), "undo", undoes=command.seq), only=took)
                names = ", ".join(f"{replica}: {message}" for replica, message in failed.items())
                message = f"update refused by {len(failed)} replica(s), undone on the others: {names}"
                return UpdateResult(False, message, self.version, failed)
            self.version = command.version
            self.committed = [c for c in self.committed if not c.superseded_by(_Committed(command, full, lora))]
            self.committed.append(_Committed(command, full, lora))
            await self._post(Command(next(self._seq), "commit"))
            return UpdateResult(True, f"weights {self.version!r} served by {len(reports)} replica(s)", self.version)

    async def run_on_all(self, kind: Literal["checksum", "release", "resume"], module_names: list[str] | None = None):
        """Runs `kind` on every live replica; their reports by replica."""
        async with self._one_at_a_time:
            return await self._broadcast(Command(next(self._seq), kind, module_names=module_names))

    # ------------------------------------------------------------------------------------------

    async def _apply_command(self, source: DiskSource | TensorSource, version: str | None):
        seq = next(self._seq)
        version = version or f"update-{seq}"
        if isinstance(source, DiskSource):
            module_names = next(iter(self.replicas.values())).module_names
            update: WeightUpdate = await asyncio.to_thread(
                disk_update, source.model_path, module_names, source.target_modules, self.allowed_weight_paths
            )
            command = Command(seq, "apply", version, update=[ray.put(update)])
            return command, frozenset(update.state_dicts), frozenset(update.lora)
        tensors = source.tensors
        ref = tensors.ref if isinstance(tensors, ObjectStoreTensors) else ray.put(tensors)
        args = dict(target_modules=source.target_modules, lora_rank=source.lora_rank, lora_alpha=source.lora_alpha)
        module = (source.target_modules or [DEFAULT_TARGET_MODULE])[0]
        is_lora = source.lora_rank is not None
        full, lora = (frozenset(), frozenset([module])) if is_lora else (frozenset([module]), frozenset())
        return Command(seq, "apply", version, update=[ref], tensor_args=args), full, lora

    async def _post(self, command: Command) -> None:
        # Keep only what some live replica has not run; a new replica starts from `committed`.
        oldest_run = min((state.last_seq for state in self.replicas.values()), default=command.seq)
        self.log = [c for c in self.log if c.seq > oldest_run] + [command]
        self._notify("_posted")

    def _notify(self, event_name: str) -> None:
        event = getattr(self, event_name)
        setattr(self, event_name, asyncio.Event())
        event.set()

    async def _broadcast(self, command: Command, only: list[str] | None = None) -> dict[str, Report]:
        """Posts `command` and waits for the live replicas among `only` (default: all) to report it."""
        reports = self._reports[command.seq] = {}
        waiting_for = set(self.replicas if only is None else only)
        await self._post(command)
        deadline = time.monotonic() + self.update_timeout_s
        try:
            while True:
                waiting_for &= set(self.replicas)  # deregistered, or found dead
                missing = [replica for replica in waiting_for if replica not in reports]
                if not missing:
                    return {replica: reports[replica] for replica in waiting_for}
                if time.monotonic() > deadline:
                    late = Report(False, f"did not answer within {self.update_timeout_s} s")
                    return {replica: reports.get(replica, late) for replica in waiting_for}
                try:
                    await asyncio.wait_for(self._reported.wait(), LIVENESS_INTERVAL_S)
                except asyncio.TimeoutError:
                    await self._drop_dead(missing)
        finally:
            del self._reports[command.seq]

    async def _drop_dead(self, replicas: list[str]) -> None:
        for replica in replicas:
            state = self.replicas.get(replica)
            if state is None:
                continue
            try:
                await asyncio.wait_for(state.actor.__ray_ready__.remote(), LIVENESS_INTERVAL_S)
            except ray.exceptions.RayActorError:
                logger.warning("worker replica %s died; it is no longer waited for", replica)
                self.replicas.pop(replica, None)
            except asyncio.TimeoutError:
                pass  # alive but busy


class WeightFollower:
    """A worker replica's side: runs the coordinator's commands on the replica's pipeline.

    Commands run through `run_on_sampling_thread`, the thread that runs the sampler, so they
    fall between sampler calls, and `version` and `released` never change during one.
    """

    def __init__(
        self,
        coordinator: "serve.handle.DeploymentHandle",
        replica: str,
        pipeline: RolloutPipeline,
        version: str,
        run_on_sampling_thread: Callable[..., Awaitable[Any]],
    ):
        self.coordinator = coordinator
        self.replica = replica
        self.pipeline = pipeline
        self.version = version
        self.released = False
        self._run_on_sampling_thread = run_on_sampling_thread
        self._undo: tuple[int, WeightUpdate, str] | None = None  # (apply seq, its undo, the version before)
        self._device = pipeline.device
        self._task: asyncio.Task | None = None
        self._stopped = False

    async def start(self) -> None:
        """Registers, applies what was committed before this replica existed, then follows."""
        last_seq = await self._register()
        self._task = asyncio.create_task(self._follow(last_seq))

    async def _register(self) -> int:
        """Registers and catches up (applying a committed update again changes nothing); the seq to poll after."""
        actor = ray.get_runtime_context().current_actor
        modules = list(self.pipeline.weight_modules)
        committed, last_seq = await self.coordinator.register.remote(self.replica, actor, modules, self.version)
        for command in committed:
            report = await self._run(command)
            if not report.ok:
                raise RuntimeError(f"cannot catch up with the committed weights {command.version!r}: {report.message}")
            self._undo = None
        await self.coordinator.report.remote(self.replica, last_seq, Report(True, version=self.version))
        return last_seq

    async def stop(self) -> None:
        self._stopped = True  # as well as cancelling: asyncio.wait_for can swallow a cancellation
        if self._task is not None:
            self._task.cancel()
        try:  # the coordinator may be shutting down with the application
            await asyncio.wait_for(self.coordinator.deregister.remote(self.replica), timeout=2.0)
        except Exception:
            logger.info("could not deregister from the weight coordinator; it will notice this replica is gone")

    async def _follow(self, last_seq: int) -> None:
        while not self._stopped:
            try:
                commands = await self.coordinator.next_commands.remote(self.replica, last_seq)
                if commands is None:  # the coordinator does not know this replica (any more)
                    last_seq = await self._register()
                    continue
                for command in commands:
                    report = await self._run(command)
                    await self.coordinator.report.remote(self.replica, command.seq, report)
                    last_seq = command.seq
            except asyncio.CancelledError:
                raise
            except Exception:  # the coordinator restarting, say: keep following
                logger.exception("following the weight coordinator failed; retrying")
                await asyncio.sleep(1.0)

    async def _run(self, command: Command) -> Report:
        try:
            payload = await command.update[0] if command.update else None
        except Exception as error:  # the object is lost (its owner died), say
            return Report(False, f"cannot fetch the update: {type(error).__name__}: {error}", self.version)
        try:
            return await self._run_on_sampling_thread(self._execute, command, payload)
        except Exception as error:  # every command is answered, or the coordinator would wait for it
            logger.exception("weight command %s failed", command.kind)
            return Report(False, f"{type(error).__name__}: {error}", self.version)

    def _execute(self, command: Command, payload: Any) -> Report:
        modules = self.pipeline.weight_modules
        if command.kind == "apply":
            try:
                update = payload if isinstance(payload, WeightUpdate) else tensor_update(payload, **command.tensor_args)
                undo = apply_update(modules, update)
            except WeightUpdateError as error:
                return Report(False, str(error), self.version)
            self._undo = (command.seq, undo, self.version)
            self.version = command.version
            return Report(True, f"applied {update.num_bytes() / 2**20:.1f} MiB", self.version)
        if command.kind == "undo":
            if self._undo is not None and self._undo[0] == command.undoes:
                _, undo, previous_version = self._undo
                apply_update(modules, undo)
                self._undo, self.version = None, previous_version
            return Report(True, "undone", self.version)
        if command.kind == "commit":
            self._undo = None
            return Report(True, version=self.version)
        if command.kind == "checksum":
            names = command.module_names or list(modules)
            checksums = {n: weights_checksum(modules[n]) if n in modules else "not_found" for n in names}
            return Report(True, result=checksums)
        return self._occupy(command.kind == "resume")

    def _occupy(self, resume: bool) -> Report:
        """`release_memory_occupation` / `resume_memory_occupation`: weights to the CPU and back."""
        if resume != self.released:
            return Report(True, "already awake" if resume else "already released")
        device = self._device if resume else torch.device("cpu")
        for module in self.pipeline.weight_modules.values():
            module.to(device)
        if self._device.type == "cuda" and not resume:
            torch.cuda.empty_cache()
        self.released = not resume
        where = "nothing to move on the CPU" if self._device.type == "cpu" else f"weights on {device}"
        return Report(True, f"{'resumed' if resume else 'released'} ({where})")

    def check_can_sample(self, required_version: str | None) -> None:
        """Raises why this replica cannot sample now for a request that requires `required_version`."""
        if self.released:
            raise MemoryReleasedError("the replica released its memory; call resume_memory_occupation first")
        if required_version is not None and required_version != self.version:
            raise WeightVersionError(self.version, required_version)
