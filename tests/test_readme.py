"""Every command in the README runs as written: its shell and Python blocks, in the README's
order, against `make serve` started from this checkout, as a reader with a second terminal runs
them. Python blocks share one interpreter, as when pasted into one session.

Each `bash` and `python` block is marked on the line before it: `<!-- readme-test: run -->`, or
`<!-- readme-test: skip: <why> -->` for one that cannot run here (a GPU, a cluster, a second
server on port 8000). A block without a mark fails the test, so a new one is not left out unseen.

A reader has one Ray cluster, which `ray job submit` and `ray.init("auto")` find alone, and
whose dashboard agent has Ray's fixed port: `tests/conftest.py` runs this test first, before the
suite's own cluster starts.

The same `make serve` shows what its terminal prints: its ready line, then nothing about the
replicas' calls to each other (the workers' long polls of the weight coordinator once printed
`CALL next_commands OK 10014.7ms` every 10 s per worker), over at least 60 s of serving; and it
ends as a terminal's Ctrl-C ends it, with requests in flight.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.reliability import answers_when_stopped

REPOSITORY = Path(__file__).resolve().parents[1]
README = REPOSITORY / "README.md"
VENV_PYTHON = REPOSITORY / ".venv/bin/python"
FENCE = re.compile(r"^(?P<indent> *)```(?P<language>\w*)\s*$")
MARK = re.compile(r"^\s*<!-- readme-test: (?:(?P<run>run)|skip: (?P<reason>.+)) -->\s*$")
START_TIMEOUT_S = 300.0  # a cold start took 40-100 s on the CI machine's 2 shared cores
BLOCK_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 60.0
SERVED_AT_LEAST_S = 60.0
LONG_REQUEST = {
    "prompt": ["1", "2"],
    "num_outputs_per_prompt": 16,
    "num_inference_steps": 40,
    "rollout_debug_mode": False,
}
# The output path the README's job writes to; moved aside while the test runs if a reader's run left it.
JOB_OUTPUT = REPOSITORY / "outputs/rollouts"

# Runs the Python blocks it is sent, one JSON line each, in one namespace; after each it prints a
# line of its own: the block's name and "ok", or the traceback's last line.
SESSION = r"""
import json, sys, traceback
namespace = {"__name__": "__main__"}
for line in sys.stdin:
    block = json.loads(line)
    try:
        exec(compile(block["source"], block["name"], "exec"), namespace)
        outcome = "ok"
    except BaseException:
        traceback.print_exc()
        outcome = "failed"
    sys.stderr.flush()
    print("\0" + json.dumps({"name": block["name"], "outcome": outcome}), flush=True)
"""


@dataclass
class Block:
    line: int  # of its opening fence, 1-based
    language: str
    source: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def readme_blocks() -> list[Block]:
    lines = README.read_text().splitlines()
    blocks, number = [], 0
    while number < len(lines):
        fence = FENCE.match(lines[number])
        if not fence:
            number += 1
            continue
        end = next(i for i in range(number + 1, len(lines)) if lines[i].strip() == "```")
        if fence["language"] in ("bash", "python"):
            mark = MARK.match(lines[number - 1]) if number else None
            assert mark, (
                f"README.md:{number + 1}: a {fence['language']} block without a readme-test mark on the line before"
            )
            indent = len(fence["indent"])
            source = "\n".join(line[indent:] for line in lines[number + 1 : end]) + "\n"
            blocks.append(Block(number + 1, fence["language"], source, None if mark["run"] else mark["reason"]))
        number = end + 1
    return blocks


def test_every_shell_and_python_block_is_marked_and_skips_say_why():
    blocks = readme_blocks()
    assert len([b for b in blocks if b.skip_reason is None]) >= 6
    assert all(len(b.skip_reason) > 20 for b in blocks if b.skip_reason is not None)


def reader_environment() -> dict:
    """A reader's shell: none of this test session's Ray settings, and the README's one export."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    return {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


class Output:
    """A process's output, read on a thread as it comes."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(stream), daemon=True)
        self._reader.start()

    def wait_for(self, predicate, process: subprocess.Popen, timeout_s: float, what: str) -> str:
        started = time.monotonic()
        while True:
            found = next((line for line in self.lines if predicate(line)), None)
            if found is not None:
                return found
            assert process.poll() is None, f"exited before {what}:\n{self.text()}"
            assert time.monotonic() - started < timeout_s, f"not {what} in {timeout_s} s:\n{self.text()}"
            time.sleep(0.2)

    def join(self, timeout_s: float) -> None:
        self._reader.join(timeout_s)

    def text(self, last: int = 200) -> str:
        return "".join(self.lines[-last:])


def stop(process: subprocess.Popen, signum: int) -> bool:
    """Sends `signum` to the process's group and waits for the whole group (its Ray cluster) to exit:
    whether it did within EXIT_TIMEOUT_S (else it is killed)."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    while time.monotonic() < deadline:
        process.poll()  # reaps the group's leader (make), which would stay in the group as a zombie
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=EXIT_TIMEOUT_S)
    return False


@pytest.fixture
def job_output_moved_aside(tmp_path):
    kept = tmp_path / "reader's outputs/rollouts"
    if JOB_OUTPUT.exists():
        kept.parent.mkdir()
        shutil.move(JOB_OUTPUT, kept)
    yield
    shutil.rmtree(JOB_OUTPUT, ignore_errors=True)
    if kept.exists():
        shutil.move(kept, JOB_OUTPUT)


def test_the_readme_runs_as_written_against_make_serve(job_output_moved_aside):
    assert VENV_PYTHON.exists(), "the README's commands use .venv: run the suite with `make test`"
    env = reader_environment()
    server = subprocess.Popen(
        ["make", "serve"],
        cwd=REPOSITORY,
        env={**env, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,  # its own group: stopped, with its Ray cluster, as a terminal's Ctrl-C does
        # A shell running the suite in the background ignores SIGINT, and its children inherit that.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    served = Output(server.stdout)
    session = None
    try:
        ready = served.wait_for(lambda line: line.startswith("serving application"), server, START_TIMEOUT_S, "serving")
        ready_at = time.monotonic()
        assert "model embedded-digits (packaged weights)" in ready and "on http://127.0.0.1:8000" in ready, ready
        assert "(probes: http://127.0.0.1:8001)" in ready, ready
        assert re.search(r"Ray at 127\.0\.0\.1:\d+;", ready), ready
        session = subprocess.Popen(
            [str(VENV_PYTHON), "-u", "-c", SESSION],
            cwd=REPOSITORY,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        python = Output(session.stdout)
        for block in readme_blocks():
            if block.skip_reason is not None:
                print(f"{block.name}: skipped: {block.skip_reason}")
                continue
            started = time.monotonic()
            if block.language == "bash":
                _run_shell_block(block, env)
            else:
                _run_python_block(block, session, python)
            print(f"{block.name}: ran in {time.monotonic() - started:.1f} s")

        time.sleep(max(0.0, SERVED_AT_LEAST_S - (time.monotonic() - ready_at)))
        # A terminal's Ctrl-C (SIGINT to the group) 3 s after three requests of several seconds.
        answers, exited = answers_when_stopped(
            lambda: stop(server, signal.SIGINT), [{**LONG_REQUEST, "seed": seed} for seed in range(3)]
        )
        served.join(EXIT_TIMEOUT_S)
    finally:
        if session is not None:
            session.kill()
            session.wait()
        if server.poll() is None:
            stop(server, signal.SIGKILL)

    # Ctrl-C answers every request in flight, with its samples if they were done in time, else with a
    # retryable 503, and stops the server and its Ray cluster.
    assert exited, served.text()
    statuses = [getattr(answer, "status_code", answer) for answer in answers]
    assert len(statuses) == 3 and set(statuses) <= {200, 503} and 503 in statuses, statuses
    assert all(answer.headers["retry-after"] == "1" for answer in answers if answer.status_code == 503)
    output = "".join(served.lines)
    print(f"make serve's terminal:\n{output}")
    # The ingress replica's own line, which is what `serve run deployments/serve_config.yaml` shows.
    ready_line = "rollout app 'rollout' up on http://127.0.0.1:8000/: model embedded-digits (packaged weights)"
    assert ready_line in output, output[-5000:]
    internal = [
        line for line in served.lines if " CALL " in line and ("WeightCoordinator" in line or "RolloutWorker" in line)
    ]
    assert not internal, "".join(internal[:20])
    assert "next_commands" not in output, output[-5000:]


def _run_shell_block(block: Block, env: dict) -> None:
    result = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", block.source],
        check=False,
        cwd=REPOSITORY,
        env=env,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{block.name} exited {result.returncode}:\n{block.source}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    )


def _run_python_block(block: Block, session: subprocess.Popen, output: Output) -> None:
    session.stdin.write(json.dumps({"name": block.name, "source": block.source}) + "\n")
    session.stdin.flush()
    done = output.wait_for(
        lambda line: line.startswith("\0") and block.name in line, session, BLOCK_TIMEOUT_S, f"done with {block.name}"
    )
    assert json.loads(done[1:])["outcome"] == "ok", f"{block.name} failed:\n{block.source}\n{output.text(60)}"
