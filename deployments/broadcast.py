"""Commands that every worker replica runs, in order: a numbered log the replicas follow.

A handle call or an HTTP request reaches one replica, so a command meant for all of them (a weight
update, a checksum, releasing memory) is not sent to the workers. It is posted to the coordinator
(the deployment in `deployments/weights.py`, which holds a `CommandLog`) under a sequence number;
every worker replica registers when it starts, long-polls for commands, runs each on its sampling
thread between sampler calls (so a batch finishes in the state it started in), and reports back.
`CommandLog.broadcast` returns once every live replica has reported; dead replicas are noticed and
not waited for.

What a command means is not this module's business: a `Follower` hands each command to the
replica's handler for its type, and a command of a type the replica has no handler for is refused
(its report says so), never run as something else.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from rollout.errors import logged_failure

logger = logging.getLogger("ray.serve")

# How long a worker's poll waits for a command before asking again.
POLL_TIMEOUT_S = 10.0
# How often the coordinator checks that the replicas it waits for are still alive.
LIVENESS_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Command:
    """What every replica runs; one subclass per kind, each with its handler on the replicas."""

    def refs(self) -> list[ray.ObjectRef]:
        """Object-store references the handler needs, fetched by the follower off the sampling
        thread (kept in a list by the command, so that Ray does not resolve them on the way)."""
        return []


@dataclass(frozen=True)
class Posted:
    seq: int
    command: Command


@dataclass(frozen=True)
class Report:
    """A replica's answer to one command.

    Attributes:
        version: the weights the replica serves after running it (every report carries it, so
            the coordinator always knows what each replica serves).
        result: what the command returns (a checksum, say).
    """

    ok: bool
    message: str = ""
    version: str | None = None
    result: Any = None


@dataclass
class _Replica:
    actor: ray.actor.ActorHandle
    last_seq: int  # the last command it ran


class CommandLog:
    """The coordinator's side: the registered replicas, the posted commands some replica has not
    run yet, and the reports being waited for. Plain asyncio, tested without Serve."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.replicas: dict[str, _Replica] = {}
        self.log: list[Posted] = []  # in seq order
        self._reports: dict[int, dict[str, Report]] = {}  # for the commands being waited for
        self._seq = itertools.count(1)
        # Set, then replaced, when a command is posted or a report arrives: waiters hold the old one.
        self._posted = asyncio.Event()
        self._reported = asyncio.Event()

    def next_seq(self) -> int:
        return next(self._seq)

    def last_seq(self) -> int:
        """What a replica registering now polls after."""
        return self.log[-1].seq if self.log else 0

    def register(self, replica: str, actor: ray.actor.ActorHandle) -> int:
        """A replica that follows from now on; the seq it polls after."""
        last_seq = self.last_seq()
        self.replicas[replica] = _Replica(actor, last_seq)
        return last_seq

    async def next_commands(self, replica: str, after_seq: int) -> list[Posted] | None:
        """Long poll: the commands after `after_seq`, or none after `POLL_TIMEOUT_S`; None for a
        replica this log does not know, which must register."""
        if replica not in self.replicas:
            return None
        if not (self.log and self.log[-1].seq > after_seq):
            try:
                await asyncio.wait_for(self._posted.wait(), POLL_TIMEOUT_S)
            except asyncio.TimeoutError:
                return []
        return [posted for posted in self.log if posted.seq > after_seq]

    def report(self, replica: str, seq: int, report: Report) -> bool:
        """Records a replica's report; False for a replica this log does not know."""
        state = self.replicas.get(replica)
        if state is None:
            return False
        state.last_seq = max(state.last_seq, seq)
        if seq in self._reports:
            self._reports[seq][replica] = report
            self._notify("_reported")
        return True

    def deregister(self, replica: str) -> None:
        self.replicas.pop(replica, None)
        self._notify("_reported")

    def post(self, command: Command, seq: int | None = None) -> Posted:
        """Posts `command` (under `seq`, if it was numbered before) without waiting for reports."""
        posted = Posted(self.next_seq() if seq is None else seq, command)
        # Keep only what some live replica has not run.
        oldest_run = min((state.last_seq for state in self.replicas.values()), default=posted.seq)
        self.log = [p for p in self.log if p.seq > oldest_run] + [posted]
        self._notify("_posted")
        return posted

    async def broadcast(self, command: Command, only: list[str] | None = None, seq: int | None = None) -> dict[str, Report]:
        """Posts `command` and waits for the live replicas among `only` (default: all) to report it;
        a replica that does not answer within `timeout_s` is reported as failed."""
        seq = self.next_seq() if seq is None else seq
        reports = self._reports[seq] = {}
        waiting_for = set(self.replicas if only is None else only)
        self.post(command, seq)
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                waiting_for &= set(self.replicas)  # deregistered, or found dead
                missing = [replica for replica in waiting_for if replica not in reports]
                if not missing:
                    return {replica: reports[replica] for replica in waiting_for}
                if time.monotonic() > deadline:
                    late = Report(False, f"did not answer within {self.timeout_s} s")
                    return {replica: reports.get(replica, late) for replica in waiting_for}
                try:
                    await asyncio.wait_for(self._reported.wait(), LIVENESS_INTERVAL_S)
                except asyncio.TimeoutError:
                    await self._drop_dead(missing)
        finally:
            del self._reports[seq]

    def _notify(self, event_name: str) -> None:
        event = getattr(self, event_name)
        setattr(self, event_name, asyncio.Event())
        event.set()

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


# A replica's handler for one type of command: runs on the sampling thread with the command and
# its fetched references, and answers (a raised error is reported as a refusal).
Handler = Callable[..., Report]


class Follower:
    """A worker replica's side: registers, catches up, then long-polls the coordinator and runs each
    command with its type's handler on the sampling thread, reporting every one.

    Args:
        coordinator: the coordinator deployment's handle (`register`, `next_commands`, `report`,
            `deregister`).
        replica: this replica's id.
        register: registers with the coordinator; returns the commands to catch up with and the
            seq to poll after.
        handlers: command type -> its handler.
        served_version: the weights this replica serves, stamped on every report.
        run_on_sampling_thread: runs a function on the thread that runs the sampler.
    """

    def __init__(
        self,
        coordinator: Any,
        replica: str,
        register: Callable[[], Awaitable[tuple[list[Posted], int]]],
        handlers: dict[type[Command], Handler],
        served_version: Callable[[], str],
        run_on_sampling_thread: Callable[..., Awaitable[Any]],
    ):
        self.coordinator = coordinator
        self.replica = replica
        self._register_with_coordinator = register
        self._handlers = handlers
        self._served_version = served_version
        self._run_on_sampling_thread = run_on_sampling_thread
        self._task: asyncio.Task | None = None
        self._stopped = False

    async def start(self) -> None:
        """Registers, runs what it must catch up with, then follows."""
        last_seq = await self._register()
        self._task = asyncio.create_task(self._follow(last_seq))

    async def stop(self) -> None:
        self._stopped = True  # as well as cancelling: asyncio.wait_for can swallow a cancellation
        if self._task is not None:
            self._task.cancel()
        try:  # the coordinator may be shutting down with the application
            await asyncio.wait_for(self.coordinator.deregister.remote(self.replica), timeout=2.0)
        except Exception:
            logger.info("could not deregister from the coordinator; it will notice this replica is gone")

    async def _register(self) -> int:
        catch_up, last_seq = await self._register_with_coordinator()
        for posted in catch_up:
            report = await self._run(posted.command)
            if not report.ok:
                raise RuntimeError(f"cannot catch up with {type(posted.command).__name__}: {report.message}")
        await self.coordinator.report.remote(self.replica, last_seq, Report(True, version=self._served_version()))
        return last_seq

    async def _follow(self, last_seq: int) -> None:
        while not self._stopped:
            try:
                commands = await self.coordinator.next_commands.remote(self.replica, last_seq)
                if commands is None:  # the coordinator does not know this replica (any more)
                    last_seq = await self._register()
                    continue
                for posted in commands:
                    report = await self._run(posted.command)
                    await self.coordinator.report.remote(self.replica, posted.seq, report)
                    last_seq = posted.seq
            except asyncio.CancelledError:
                raise
            except RayActorError as error:  # restarting, or stopping with the application: no traceback to read
                logger.warning("the weight coordinator is unavailable (%s); following it again in 1 s", type(error).__name__)
                await asyncio.sleep(1.0)
            except Exception:
                logger.exception("following the coordinator failed; retrying")
                await asyncio.sleep(1.0)

    async def _run(self, command: Command) -> Report:
        """Every command is answered, or the coordinator would wait for it."""
        try:
            fetched = [await ref for ref in command.refs()]
        except Exception as error:  # the object is lost (its owner died), say
            failure = logged_failure(error, logger, f"fetching the data of a {type(command).__name__} command")
            return Report(False, f"cannot fetch the command's data: {failure}", self._served_version())
        try:
            report = await self._run_on_sampling_thread(self._execute, command, fetched)
        except Exception as error:  # its text (paths, device messages) stays in this replica's log
            report = Report(False, logged_failure(error, logger, f"command {type(command).__name__}"))
        return Report(report.ok, report.message, self._served_version(), report.result)

    def _execute(self, command: Command, fetched: list[Any]) -> Report:
        handler = self._handlers.get(type(command))
        if handler is None:
            return Report(False, f"this replica has no handler for {type(command).__name__} commands")
        return handler(command, *fetched)
