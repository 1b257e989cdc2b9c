"""A head started the way `cluster.yaml` starts it turns away every job without Ray's token, and
runs the job of whoever submits it the way docs/cluster.md says.

Before the config set RAY_AUTH_MODE, the same command with a fresh HOME printed "Token
authentication is disabled for this Ray cluster", and a `POST /api/jobs/` without a token ran its
job: Ray 2.60's `ray start` turns the token on by itself only when it finds one already there.

The head runs the `ray start` of `head_start_ray_commands`, rewritten only where it meets this
machine: loopback and free ports (other Ray sessions share the machine), its files in a temporary
directory, its token in a temporary HOME, and no AWS autoscaler. Nothing here stops a Ray process
this module did not start, and the head never becomes the machine's current cluster
(/tmp/ray/ray_current_cluster), which `ray.init(address="auto")` elsewhere would join.
"""

from __future__ import annotations

import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests
import yaml
from ray._common.utils import get_ray_address_file

from tests.ports import free_ports
from tests.test_cluster_config import CLUSTER_YAML, options, ray_start

VENV_BIN = Path(sys.executable).parent
START_TIMEOUT_S = 120  # generous: the machine has 2 cores and other sessions use them
CLI_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60  # `ray start --block` drains its node for up to 30 s on SIGTERM

# Every port the head binds, so that none is a default another session's Ray already holds.
PORT_FLAGS = (
    "--port",
    "--dashboard-port",
    "--object-manager-port",
    "--node-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--ray-client-server-port",
)
# The autoscaler's and the dashboard's metrics ports have no flag, only these (44217 and 44227).
METRICS_PORT_VARIABLES = ("AUTOSCALER_METRIC_PORT", "DASHBOARD_METRIC_PORT")


@dataclass(frozen=True)
class Head:
    root: Path
    home: Path
    temp_dir: Path
    url: str
    gcs_address: str
    token: str
    process: subprocess.Popen
    log: Path


def ray_environment(home: Path, **variables: str) -> dict[str, str]:
    # Without the runner's RAY_* variables: its RAY_ADDRESS or token must not point these elsewhere.
    environment = {name: value for name, value in os.environ.items() if not name.startswith("RAY_")}
    return environment | {
        "HOME": str(home),
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",  # a job's `python` is this venv's, as on the nodes
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray keeps 127.0.0.1 as the node's address
        **variables,
    }


def head_start(cluster_config: dict, home: Path, temp_dir: Path) -> tuple[list[str], dict[str, str], dict[str, int]]:
    """The arguments and environment of `head_start_ray_commands`' `ray start`, on loopback and
    free ports, and those ports by flag."""
    environment, arguments = ray_start(cluster_config["head_start_ray_commands"])
    ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
    metrics_ports = dict(zip(METRICS_PORT_VARIABLES, map(str, free_ports(len(METRICS_PORT_VARIABLES)))))
    named = options(arguments)
    named.pop("--autoscaling-config", None)  # the AWS autoscaler's config, which `ray up` writes on the head
    named |= {flag: str(port) for flag, port in ports.items()}
    named |= {
        "--node-ip-address": "127.0.0.1",
        "--dashboard-host": "127.0.0.1",  # whatever the file says: this test opens no port to the network
        "--temp-dir": str(temp_dir),
        "--block": "",  # so that stopping this process stops the node, and nothing else
        "--disable-usage-stats": "",  # its report would leave the machine
        "--num-cpus": "1",  # few idle workers on a shared 2-core machine
    }
    return (
        [f"{name}={value}" if value else name for name, value in named.items()],
        ray_environment(home, **environment, **metrics_ports),
        ports,
    )


def processes_mentioning(temp_dir: Path) -> set[psutil.Process]:
    return {
        process
        for process in psutil.process_iter(["cmdline"])
        if any(str(temp_dir) in word for word in process.info["cmdline"] or ())
    }


def running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE  # a zombie holds nothing
    except psutil.NoSuchProcess:
        return False


def stop(process: subprocess.Popen, temp_dir: Path) -> None:
    """Stops a `ray start --block` and the processes it started, and no other."""
    started = set(psutil.Process(process.pid).children(recursive=True)) if process.poll() is None else set()
    process.terminate()  # it drains its node, then stops what it started
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    left = [leftover for leftover in started | processes_mentioning(temp_dir) if running(leftover)]
    for leftover in left:
        leftover.kill()
    psutil.wait_procs(left, timeout=10)
    alive = [leftover for leftover in left if running(leftover)]
    assert not alive, f"processes of {temp_dir} outlived their node: {alive}"


@contextmanager
def ray_start_process(arguments: list[str], environment: dict[str, str], temp_dir: Path, log: Path):
    with log.open("w") as output:
        process = subprocess.Popen(
            [str(VENV_BIN / "ray"), "start", *arguments],
            env=environment,
            cwd=temp_dir.parent,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield process
        finally:
            stop(process, temp_dir)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def wait_until_started(head: Head) -> None:
    # `ray start` writes the file once all of the node's processes run, the raylet last.
    started = head.temp_dir / "ray_current_cluster"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        assert head.process.poll() is None, f"`ray start` exited:\n{head.log.read_text()[-3000:]}"
        try:
            if started.exists() and requests.get(f"{head.url}/api/jobs/", headers=bearer(head.token), timeout=5).ok:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no head at {head.url} after {START_TIMEOUT_S} s:\n{head.log.read_text()[-3000:]}")


def cli(head: Head, program: str, *arguments: str, **variables: str) -> subprocess.CompletedProcess:
    """`ray` or `serve` on the client's side, with the token in the client's ~/.ray/auth_token."""
    return subprocess.run(
        [str(VENV_BIN / program), *arguments],
        env=ray_environment(head.home, **variables),
        cwd=head.root,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=False,  # the callers read refusals too
    )


@pytest.fixture(scope="module")
def cluster_config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def head(tmp_path_factory, cluster_config) -> Iterator[Head]:
    root = tmp_path_factory.mktemp("auth")
    home, temp_dir = root / "home", root / "ray"
    home.mkdir()
    # Ray's unix sockets lie about 65 characters below its temp dir, and Linux allows 107.
    assert len(str(temp_dir)) <= 40, f"{temp_dir} is too long for Ray's sockets: use a shorter --basetemp"

    # The docs' command: it writes ~/.ray/auth_token, which `ray up` then copies to every node.
    generated = subprocess.run(
        [str(VENV_BIN / "ray"), "get-auth-token", "--generate"],
        env=ray_environment(home),
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
        check=True,
    )
    token = generated.stdout.strip()
    assert token and (home / ".ray" / "auth_token").read_text().strip() == token

    arguments, environment, ports = head_start(cluster_config, home, temp_dir)
    log = root / "ray-start.log"
    with ray_start_process(arguments, environment, temp_dir, log) as process:
        started = Head(
            root=root,
            home=home,
            temp_dir=temp_dir,
            url=f"http://127.0.0.1:{ports['--dashboard-port']}",
            gcs_address=f"127.0.0.1:{ports['--port']}",
            token=token,
            process=process,
            log=log,
        )
        wait_until_started(started)
        yield started


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_the_head_starts_with_token_authentication_on_loopback_only(head):
    assert "Token authentication is disabled" not in head.log.read_text()
    assert requests.get(f"{head.url}/api/version", timeout=10).status_code == 401

    ours = {head.process.pid, *(child.pid for child in psutil.Process(head.process.pid).children(recursive=True))}
    bound = [
        (psutil.Process(connection.pid).name(), connection.laddr)
        for connection in psutil.net_connections("inet")
        if connection.pid in ours and (connection.status == psutil.CONN_LISTEN or connection.type == socket.SOCK_DGRAM)
    ]
    names = {name for name, _ in bound}
    assert {"gcs_server", "raylet"} <= names, bound
    assert all(is_loopback(address.ip) for _, address in bound), bound


def test_the_head_is_not_the_machines_current_cluster(head):
    assert (head.temp_dir / "ray_current_cluster").read_text() == head.gcs_address
    machines = Path(get_ray_address_file(None))
    assert not machines.exists() or machines.read_text().strip() != head.gcs_address


def test_a_job_without_the_token_is_refused_and_never_runs(head):
    marker = head.root / "unauthenticated-job-ran"
    job = {"entrypoint": shlex.join(["python", "-c", f"open({str(marker)!r}, 'w')"])}
    jobs = f"{head.url}/api/jobs/"

    assert requests.post(jobs, json=job, timeout=30).status_code == 401
    assert requests.post(jobs, json=job, headers=bearer("0" * 64), timeout=30).status_code == 403
    # The token file alone sends nothing: without RAY_AUTH_MODE=token the CLI has no header to add.
    refused = cli(head, "ray", "job", "submit", f"--address={head.url}", "--", *shlex.split(job["entrypoint"]))
    assert refused.returncode != 0
    assert "Authentication required: Unauthorized: Missing authentication token" in refused.stderr

    listed = requests.get(jobs, headers=bearer(head.token), timeout=30)
    assert listed.ok and not [entry for entry in listed.json() if str(marker) in entry["entrypoint"]]
    assert not marker.exists()


def test_the_documented_submission_runs_a_driver_that_reaches_the_cluster(head):
    # The driver runs on the head with the raylet's environment: RAY_AUTH_MODE and ~/.ray/auth_token.
    driver = "import ray; ray.init(); print('driver sees', ray.cluster_resources()['CPU'], 'CPU')"
    submitted = cli(
        head, "ray", "job", "submit", "--", "python", "-c", driver, RAY_ADDRESS=head.url, RAY_AUTH_MODE="token"
    )
    assert submitted.returncode == 0, submitted.stdout[-3000:] + submitted.stderr[-3000:]
    assert "driver sees 1.0 CPU" in submitted.stdout


def test_serve_cli_sends_the_token(head):
    # `serve` reads RAY_DASHBOARD_ADDRESS, not RAY_ADDRESS; through the tunnel its default is right.
    status = cli(head, "serve", "status", f"--address={head.url}", RAY_AUTH_MODE="token")
    assert status.returncode == 0, status.stderr[-3000:]
    assert "applications: {}" in status.stdout
    refused = cli(head, "serve", "status", f"--address={head.url}")
    assert refused.returncode != 0 and "Missing authentication token" in refused.stderr


def test_a_node_without_the_token_does_not_start(cluster_config, tmp_path_factory):
    # The head's command in a HOME without a token. A worker's `ray start` makes the same check
    # (ray/scripts/scripts.py), but no worker can join a head on loopback.
    root = tmp_path_factory.mktemp("bare")
    home, temp_dir, log = root / "home", root / "ray", root / "ray-start.log"
    home.mkdir()
    arguments, environment, _ = head_start(cluster_config, home, temp_dir)
    with ray_start_process(arguments, environment, temp_dir, log) as process:
        try:
            process.wait(timeout=CLI_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"a head without the token started:\n{log.read_text()[-3000:]}")
    assert process.returncode != 0
    assert "Token authentication is enabled but no authentication token was found" in log.read_text()
