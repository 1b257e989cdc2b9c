"""A worker replica's `Follower`, without Ray: each command goes to its type's handler, a
command no handler takes is refused, never run as something else, and a handler's exception is
answered by its type and an id, its text only in the replica's log."""

import asyncio
import re
from dataclasses import dataclass

import torch

from deployments.broadcast import Command, Follower, Report
from deployments.memory import MemoryOccupation, ReleaseMemory, ResumeMemory


@dataclass(frozen=True)
class Greet(Command):
    name: str


class Pipeline:
    device = torch.device("cpu")
    weight_modules: dict = {}


def follower(handlers) -> Follower:
    async def on_this_thread(fn, *args):
        return fn(*args)

    return Follower(None, "r", None, handlers, lambda: "v7", on_this_thread)


def test_each_command_goes_to_its_handler_and_reports_the_served_version():
    greeted = []
    handlers = {Greet: lambda command: greeted.append(command.name) or Report(True, f"hello {command.name}")}
    report = asyncio.run(follower(handlers)._run(Greet("ada")))
    assert greeted == ["ada"] and report == Report(True, "hello ada", "v7")


def test_a_command_without_a_handler_is_refused():
    memory = MemoryOccupation(Pipeline())
    report = asyncio.run(follower(memory.handlers())._run(Greet("ada")))
    assert not report.ok and "no handler for Greet commands" in report.message
    assert not memory.released  # nothing else ran in its place


def test_memory_is_released_and_resumed_once_each():
    memory = MemoryOccupation(Pipeline())
    run = follower(memory.handlers())._run
    messages = [asyncio.run(run(command)).message for command in (ReleaseMemory(), ReleaseMemory(), ResumeMemory(), ResumeMemory())]
    assert messages == ["released (nothing to move on the CPU)", "already released", "resumed (nothing to move on the CPU)", "already awake"]


def test_a_handlers_exception_is_answered_by_its_type_and_an_id_its_text_logged(serve_log):
    secret = "/dev/nvidia3 on pid 4242"

    def crashes(command):
        raise OSError(f"CUDA error: device {secret} is gone")

    report = asyncio.run(follower({Greet: crashes})._run(Greet("ada")))
    assert not report.ok and report.message.startswith("OSError (error id") and secret not in report.message
    error_id = re.search(r"error id ([0-9a-f]+)", report.message).group(1)
    logged = [r for r in serve_log.records if error_id in r.getMessage()]
    assert logged and secret in str(logged[0].exc_info[1])
