"""A model is one flag away (`make serve MODEL=...`, `python -m deployments serve --model`, `serve
run ... build_app model.path=...`), and a model that cannot be served stops the start with one line
naming the field, instead of replicas that Serve starts again and again."""

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from unittest.mock import AsyncMock, Mock

import pytest
from ray import serve

from deployments.batching import BatchingQueue
from deployments.broadcast import Follower
from deployments.cli import run_app
from deployments.config import RolloutAppConfig
from deployments.worker import RolloutWorker
from rollout.models.registry import resolve_model
from tests.deployments.apps import TEST_CONFIG
from tests.ports import free_port

REPOSITORY = Path(__file__).resolve().parents[2]
SERVE = Path(sys.executable).with_name("serve")
CONFIG_EXIT_TIMEOUT_S = 60.0  # no Ray starts: imports only (8-17 s here)


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`command`'s result; on a timeout its process group is killed and the test fails."""
    process = subprocess.Popen(
        command,
        cwd=REPOSITORY,
        env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"},
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{command} still running after {timeout_s} s:\n{stdout}\n{stderr}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "arguments",
    # A dotted key alone: tests/deployments/test_cli.py, in this process.
    [["--model", "/no/such/model"], ["--config", "deployments/serve_config.yaml", "model.path=/no/such/model"]],
    ids=["--model", "config file and dotted key"],
)
def test_the_cli_with_a_missing_model_exits_at_once_with_one_line_naming_the_field(arguments):
    result = _run(
        [sys.executable, "-m", "deployments", "serve", "--port", str(free_port()), *arguments], CONFIG_EXIT_TIMEOUT_S
    )
    assert result.returncode == 1, result.stderr
    assert _last_line(result.stderr) == (
        "app config: model.path: /no/such/model is not a directory: it does not exist; give a local model directory (never a hub id)"
    )
    assert "Traceback" not in result.stderr


def test_serve_run_with_a_missing_model_prints_one_line_not_a_traceback():
    result = _run(
        [str(SERVE), "run", "deployments.app:build_app", "model.path=/no/such/model"], CONFIG_EXIT_TIMEOUT_S
    )
    assert result.returncode == 1, result.stderr
    assert _last_line(result.stderr) == (
        "Error: model.path: /no/such/model is not a directory: it does not exist; give a local model directory (never a hub id)"
    )
    assert "Traceback" not in result.stderr


def test_make_serve_passes_model_to_the_cli():
    result = subprocess.run(
        ["make", "-n", "serve", "MODEL=/models/x y", "ARGS=model.dtype=bfloat16"],
        check=False,
        cwd=REPOSITORY,
        capture_output=True,
        text=True,
    )
    assert '-m deployments serve --model "/models/x y" model.dtype=bfloat16' in result.stdout, result.stdout


# Python calls the garbage-collected object's async __del__ too, and drops the coroutine; Serve awaits it.
@pytest.mark.filterwarnings("ignore:coroutine 'RolloutWorker.__del__' was never awaited:RuntimeWarning")
@pytest.mark.parametrize(
    "started",
    [(), ("_queue",), ("_queue", "follower")],
    ids=["raised-at-once", "raised-after-the-queue", "constructed"],
)
def test_a_worker_whose_init_failed_stops_without_an_error_of_its_own(started):
    worker = object.__new__(RolloutWorker.func_or_class)  # as Serve leaves it when __init__ raised
    stoppables = {"_queue": Mock(spec=BatchingQueue), "follower": AsyncMock(spec=Follower)}
    for name in started:
        setattr(worker, name, stoppables[name])
    try:
        asyncio.run(worker.__del__())
    except Exception as error:
        pytest.fail(f"stopping a worker that started only {list(started)} raised {error!r}")
    for name in started:
        stoppables[name].stop.assert_called_once_with()


def test_a_tiny_family_directory_is_served_by_its_path_alone(tiny_family_dirs):
    for family, directory in tiny_family_dirs.items():
        config = RolloutAppConfig.parse({"model.path": str(directory)})
        assert resolve_model(config.model.name, config.model.path) == (family, Path(directory))


def test_the_cli_exits_with_the_cause_when_no_worker_replica_can_load_the_model(serve_app):
    # check_path_at_build=false leaves the directory to the workers, as on a cluster whose GPU
    # nodes alone hold it: their constructors fail, and Serve must give up after one try each.
    # `python -m deployments serve` deploys with run_app, on the session's cluster here.
    config = RolloutAppConfig.parse(
        {
            **TEST_CONFIG,
            "app_name": "no-model",
            "probe_port": free_port(),
            "num_worker_replicas": 1,
            "model.path": "/no/such/model",
            "model.check_path_at_build": False,
        }
    )
    try:
        with pytest.raises(SystemExit) as exited:
            run_app(config, route_prefix="/no-model")
    finally:
        serve.delete(config.app_name)
    assert str(exited.value) == (
        "application 'no-model' failed to start: RolloutWorker: ModelLoadError: model.path: /no/such/model "
        "is not a directory: it does not exist; give a local model directory (never a hub id)"
    )
