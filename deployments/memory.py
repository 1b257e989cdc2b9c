"""Releasing a worker replica's accelerator memory between rollouts, and taking it back
(SGLang's `release_memory_occupation` / `resume_memory_occupation`): the weights go to host memory
and back (`rollout.offload`, pinned on a GPU), broadcast to every replica like any command
(`deployments/broadcast.py`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deployments.broadcast import Command, Report
from rollout.errors import RolloutError
from rollout.offload import HostCopies

if TYPE_CHECKING:
    from rollout.models.base import RolloutPipeline


class MemoryReleasedError(RolloutError):
    """The replica released its memory (`release_memory_occupation`) and samples nothing until resumed."""


class MemoryCommandError(RolloutError):
    """A worker replica failed to release or resume its memory (the handle API; over HTTP the
    answer says `"success": false` with each replica's message)."""


@dataclass(frozen=True)
class ReleaseMemory(Command):
    """Move the weights to host memory; the replica samples nothing until `ResumeMemory`."""


@dataclass(frozen=True)
class ResumeMemory(Command):
    """Move the weights back to the replica's device."""


class MemoryOccupation:
    """A worker replica's side: whether its memory is released, and the two commands' handlers."""

    def __init__(self, pipeline: RolloutPipeline):
        self.pipeline = pipeline
        self.released = False
        self._device = pipeline.device
        self._host_copies = HostCopies(pipeline.weight_modules, self._device)

    def handlers(self) -> dict[type[Command], Any]:
        return {ReleaseMemory: self.release, ResumeMemory: self.resume}

    def release(self, command: ReleaseMemory) -> Report:
        if self.released:
            return Report(True, "already released")
        moved = self._moved(self._host_copies.to_host)
        self.released = True
        return Report(True, f"released ({moved})")

    def resume(self, command: ResumeMemory) -> Report:
        if not self.released:
            return Report(True, "already awake")
        moved = self._moved(self._host_copies.to_device)
        self.released = False
        return Report(True, f"resumed ({moved})")

    def check_awake(self) -> None:
        if self.released:
            raise MemoryReleasedError("the replica released its memory; call resume_memory_occupation first")

    def _moved(self, move) -> str:
        if self._device.type == "cpu":
            return "nothing to move on the CPU"
        start = time.perf_counter()
        nbytes = move()
        seconds = time.perf_counter() - start
        return f"{nbytes / 2**30:.2f} GiB in {seconds:.2f} s, {nbytes / 2**30 / max(seconds, 1e-9):.1f} GiB/s"
