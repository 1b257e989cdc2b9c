"""What `make serve` (scripts/serve_local.py) prints while nothing happens: its ready line, then
nothing. Serve's access log of the workers' long polls of the coordinator once printed a
`CALL next_commands OK 10014.7ms` line per worker replica every poll."""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from deployments.broadcast import POLL_TIMEOUT_S

REPOSITORY = Path(__file__).resolve().parents[2]
# Every poll of every worker printed a line, so three poll periods would show two or three per
# worker if they came back, and leave room for a poll begun before the ready line; the issue's
# 60 s would add half a minute to the suite and no case this misses.
IDLE_S = 3 * POLL_TIMEOUT_S
START_TIMEOUT_S = 300.0  # a cold start took 40-100 s on the CI machine's 2 shared cores
EXIT_TIMEOUT_S = 60.0


def test_make_serve_prints_its_ready_line_then_stays_quiet_while_idle():
    server = subprocess.Popen(
        [sys.executable, "-u", "scripts/serve_local.py", "num_worker_replicas=1"],
        cwd=REPOSITORY,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        start_new_session=True,  # so that a hung run can be killed with its Ray cluster, and only that
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)
    reader.start()
    try:
        started = time.monotonic()
        while not any(line.startswith("serving application") for line in lines):
            assert server.poll() is None, f"serve_local.py exited before serving:\n{''.join(lines)}"
            assert time.monotonic() - started < START_TIMEOUT_S, f"not serving in {START_TIMEOUT_S} s:\n{''.join(lines)}"
            time.sleep(0.5)
        time.sleep(IDLE_S)
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=EXIT_TIMEOUT_S)
        reader.join(timeout=EXIT_TIMEOUT_S)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()

    output = "".join(lines)
    assert server.returncode == 0, output
    ready = next(line for line in lines if line.startswith("serving application"))
    assert "model embedded-digits (packaged weights)" in ready and "http://127.0.0.1:8000" in ready, ready
    assert "http://127.0.0.1:8001" in ready, ready
    # The ingress replica's own line, which is what `serve run deployments/serve_config.yaml` shows.
    assert "rollout app 'rollout' up: model embedded-digits" in output, output
    internal_calls = [
        line for line in lines if " CALL " in line and ("WeightCoordinator" in line or "RolloutWorker" in line)
    ]
    assert not internal_calls, "".join(internal_calls)
    assert "next_commands" not in output, output
