"""Memory: SGLang's `/release_memory_occupation` and `/resume_memory_occupation`, on every replica.

Needs from the ingress: `coordinator` (the `WeightCoordinator` handle, which broadcasts the commands).
"""

from fastapi.responses import JSONResponse, Response

from deployments.broadcast import Command
from deployments.memory import ReleaseMemory, ResumeMemory
from deployments.routes import route


class MemoryRoutes:
    @route("POST", "/release_memory_occupation")
    async def http_release_memory_occupation(self) -> Response:
        return await self._on_every_replica(ReleaseMemory())

    @route("POST", "/resume_memory_occupation")
    async def http_resume_memory_occupation(self) -> Response:
        return await self._on_every_replica(ResumeMemory())

    async def _on_every_replica(self, command: Command) -> Response:
        reports = await self.coordinator.broadcast_command.remote(command)
        success = all(report.ok for report in reports.values())
        messages = sorted({report.message for report in reports.values()})
        return JSONResponse(
            status_code=200 if success else 400, content={"success": success, "message": "; ".join(messages)}
        )
