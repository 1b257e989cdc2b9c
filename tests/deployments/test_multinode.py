"""Worker replicas on different nodes: updates reach them and results come back through the object store."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).parent / "scripts" / "multinode_check.py"


def test_updates_and_requests_span_two_nodes():
    # Its own process: a multi-node cluster cannot share a driver with the session's cluster.
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), str(free_port())],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    findings = [line for line in completed.stdout.splitlines() if line.startswith("{")]
    assert completed.returncode == 0 and findings, completed.stdout[-3000:] + completed.stderr[-3000:]
    found = json.loads(findings[-1])
    assert found["nodes"] == 2
    assert found["update_success"] and found["replicas_checked"] == 2 and found["replica_checksums_match"]
    # The request's parts came from the two replicas, one on each node.
    assert len(set(found["part_replicas"])) == 2 and len(set(found["part_nodes"])) == 2
    assert found["sample_versions"] == ["multinode-1"]
    assert found["one_schedule"] and found["num_samples"] == 8 and found["sigmas_shape"] == [4]
    assert found["finite"]
