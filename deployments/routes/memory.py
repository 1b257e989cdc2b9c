"""Memory: SGLang's `/release_memory_occupation` and `/resume_memory_occupation`, on every replica,
and their handle twins.

Needs from the ingress: `coordinator` (the `WeightCoordinator` handle, which broadcasts the commands).
"""

from fastapi.responses import JSONResponse, Response

from deployments.broadcast import Command, Report
from deployments.memory import MemoryCommandError, ReleaseMemory, ResumeMemory
from deployments.routes import route


class MemoryRoutes:
    async def release_memory_occupation(self) -> dict[str, str]:
        """Handle API: every worker replica moves its weights to the CPU and samples nothing until
        resumed; per replica, what it did. Raises `MemoryCommandError` if a replica failed."""
        return _done_on_every_replica(await self._on_every_replica(ReleaseMemory()))

    async def resume_memory_occupation(self) -> dict[str, str]:
        """Handle API: every worker replica moves its weights back to its device; per replica, what
        it did. Raises `MemoryCommandError` if a replica failed."""
        return _done_on_every_replica(await self._on_every_replica(ResumeMemory()))

    @route("POST", "/release_memory_occupation", operator=True)
    async def http_release_memory_occupation(self) -> Response:
        return _answer(await self._on_every_replica(ReleaseMemory()))

    @route("POST", "/resume_memory_occupation", operator=True)
    async def http_resume_memory_occupation(self) -> Response:
        return _answer(await self._on_every_replica(ResumeMemory()))

    async def _on_every_replica(self, command: Command) -> dict[str, Report]:
        return await self.coordinator.broadcast_command.remote(command)


def _answer(reports: dict[str, Report]) -> Response:
    """SGLang's answer: success, and the replicas' distinct messages."""
    success = all(report.ok for report in reports.values())
    messages = sorted({report.message for report in reports.values()})
    return JSONResponse(status_code=200 if success else 400, content={"success": success, "message": "; ".join(messages)})


def _done_on_every_replica(reports: dict[str, Report]) -> dict[str, str]:
    failed = sorted(f"{replica}: {report.message}" for replica, report in reports.items() if not report.ok)
    if failed:
        raise MemoryCommandError("; ".join(failed))
    return {replica: report.message for replica, report in reports.items()}
