"""Releasing a worker replica's accelerator memory between rollouts, and taking it back
(SGLang's `release_memory_occupation` / `resume_memory_occupation`): the weights go to the CPU
and back, broadcast to every replica like any command (`deployments/broadcast.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deployments.broadcast import Command, Report
from rollout.errors import RolloutError

if TYPE_CHECKING:
    from rollout.models.base import RolloutPipeline


class MemoryReleasedError(RolloutError):
    """The replica released its memory (`release_memory_occupation`) and samples nothing until resumed."""


class MemoryCommandError(RolloutError):
    """A worker replica failed to release or resume its memory (the handle API; over HTTP the
    answer says `"success": false` with each replica's message)."""


@dataclass(frozen=True)
class ReleaseMemory(Command):
    """Move the weights to the CPU; the replica samples nothing until `ResumeMemory`."""


@dataclass(frozen=True)
class ResumeMemory(Command):
    """Move the weights back to the replica's device."""


class MemoryOccupation:
    """A worker replica's side: whether its memory is released, and the two commands' handlers."""

    def __init__(self, pipeline: RolloutPipeline):
        self.pipeline = pipeline
        self.released = False
        self._device = pipeline.device

    def handlers(self) -> dict[type[Command], Any]:
        return {ReleaseMemory: self.release, ResumeMemory: self.resume}

    def release(self, command: ReleaseMemory) -> Report:
        if self.released:
            return Report(True, "already released")
        self._move_weights(torch.device("cpu"))
        if self._device.type == "cuda":
            torch.cuda.empty_cache()
        self.released = True
        return Report(True, f"released ({self._where(torch.device('cpu'))})")

    def resume(self, command: ResumeMemory) -> Report:
        if not self.released:
            return Report(True, "already awake")
        self._move_weights(self._device)
        self.released = False
        return Report(True, f"resumed ({self._where(self._device)})")

    def check_awake(self) -> None:
        if self.released:
            raise MemoryReleasedError("the replica released its memory; call resume_memory_occupation first")

    def _move_weights(self, device: torch.device) -> None:
        for module in self.pipeline.weight_modules.values():
            module.to(device)

    def _where(self, device: torch.device) -> str:
        return "nothing to move on the CPU" if self._device.type == "cpu" else f"weights on {device}"
