"""`cluster.yaml` passes the checks `ray up` makes before it contacts AWS, and describes the cluster
the docs promise: a CPU head node, GPU workers, and this repository installed on every node.

The config goes through the same two local steps as `ray up`
(`ray.autoscaler._private.commands._bootstrap_config`): `prepare_config` merges it with the AWS
provider's defaults, then `validate_config` checks it against Ray's `ray-schema.json` and adds
its own checks (head_node_type, min/max workers). The step between them, where the AWS provider
fills in each instance type's resources, calls AWS, so it is skipped here. Nothing starts Ray or
touches the network; tests/test_cluster_auth.py starts the head's command on loopback.
"""

from __future__ import annotations

import copy
import re
import shlex
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler._private.util as ray_util
import yaml

REPO = Path(__file__).resolve().parents[1]
CLUSTER_YAML = REPO / "cluster.yaml"
# EC2 instance families with NVIDIA GPUs: g4dn, g5, g6, g6e, p4d, p5, ...
GPU_FAMILY = re.compile(r"^[gp]\d")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# Where Ray looks for its token when neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set.
RAY_TOKEN_PATH = "~/.ray/auth_token"
LOOPBACK = {"127.0.0.1", "localhost"}


def validated(config: dict) -> dict:
    """What `ray up` does locally before it calls the cloud provider."""
    prepared = ray_util.prepare_config(copy.deepcopy(config))
    ray_util.validate_config(prepared)
    return prepared


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


@pytest.fixture(scope="module")
def config(raw) -> dict:
    return validated(raw)


def head_and_workers(config: dict) -> tuple[dict, dict[str, dict]]:
    types = config["available_node_types"]
    head = config["head_node_type"]
    return types[head], {name: spec for name, spec in types.items() if name != head}


def ray_start(commands: list[str]) -> tuple[dict[str, str], list[str]]:
    """The environment and the arguments of the `ray start` among a node's start commands,
    e.g. `ulimit -n 65536; RAY_AUTH_MODE=token ray start --head --port=6379` gives
    ({"RAY_AUTH_MODE": "token"}, ["--head", "--port=6379"])."""
    for command in commands:
        for step in command.split(";"):
            words = shlex.split(step)
            environment = {}
            while words and ENV_ASSIGNMENT.match(words[0]):
                name, value = words.pop(0).split("=", 1)
                environment[name] = value
            if words[:2] == ["ray", "start"]:
                return environment, words[2:]
    raise AssertionError(f"no `ray start` in {commands}")


def options(arguments: list[str]) -> dict[str, str]:
    """`--name=value` arguments by name; a flag alone maps to ""."""
    return {name: value for name, _, value in (argument.partition("=") for argument in arguments)}


def test_ray_validates_the_config(config):
    assert config["provider"]["type"] == "aws"
    assert config["auth"]["ssh_user"] == "ubuntu"


def test_head_node_has_no_gpu(config):
    head, _ = head_and_workers(config)
    assert head["resources"].get("GPU", 0) == 0
    assert head["resources"].get("CPU", 0) > 0, "the head hosts the Serve controller, proxy, ingress and job drivers"
    # On AWS, Ray adds the GPUs it detects from the instance type, so the type must be CPU-only too.
    assert not GPU_FAMILY.match(head["node_config"]["InstanceType"])


def test_workers_have_gpus_and_can_scale_up(config):
    _, workers = head_and_workers(config)
    assert workers, "no worker node type"
    for name, spec in workers.items():
        assert spec["resources"].get("GPU", 0) >= 1, name
        assert GPU_FAMILY.match(spec["node_config"]["InstanceType"]), name
        assert spec["max_workers"] > 0, name
        assert spec.get("min_workers", 0) == 0, f"{name}: GPU nodes should scale to zero when idle"
        assert config["max_workers"] >= spec["max_workers"], name


def test_repository_is_mounted_and_installed_on_every_node(raw, config):
    mounts = {remote: (REPO / local).resolve() for remote, local in raw["file_mounts"].items()}
    repo_mounts = [remote for remote, local in mounts.items() if local == REPO]
    assert repo_mounts, f"file_mounts do not copy the repository: {raw['file_mounts']}"
    remote = repo_mounts[0].rstrip("/")
    project = re.search(r'^name\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE).group(1)
    assert remote.endswith(project)

    install = re.compile(rf"pip install .*-e {re.escape(remote)}/?(\s|$)")
    pinned_ray = re.compile(r"pip install .*[\"']?ray\[[^\]]*\]==[\w.]+")
    # After prepare_config, head_/worker_setup_commands are what each kind of node actually runs.
    for key in ("head_setup_commands", "worker_setup_commands"):
        commands = config[key]
        assert any(install.search(c) for c in commands), f"{key} do not install the project: {commands}"
        assert any(pinned_ray.search(c) for c in commands), f"{key} do not pin Ray's version: {commands}"


def test_start_commands_start_ray(config):
    head = " ; ".join(config["head_start_ray_commands"])
    worker = " ; ".join(config["worker_start_ray_commands"])
    assert "ray start --head" in head and "--port=6379" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head, "without it the head never launches workers"
    assert "--address=$RAY_HEAD_IP:6379" in worker


def test_every_node_starts_ray_with_token_authentication(config):
    # Ray 2.60's `ray start` turns it on by itself only when it finds a token already there;
    # with the mode set, a node without the token refuses to start instead of starting open.
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        environment, _ = ray_start(config[key])
        assert environment.get("RAY_AUTH_MODE") == "token", f"{key}: {config[key]}"


def test_the_dashboard_listens_on_loopback_only(config):
    _, arguments = ray_start(config["head_start_ray_commands"])
    assert options(arguments).get("--dashboard-host") in LOOPBACK, "`ray dashboard` reaches it over SSH"


def test_the_token_reaches_every_node_from_outside_the_repository(raw):
    local = raw["file_mounts"].get(RAY_TOKEN_PATH)
    assert local, f"file_mounts do not copy Ray's token to {RAY_TOKEN_PATH}: {raw['file_mounts']}"
    assert not Path(local).expanduser().resolve().is_relative_to(REPO), local
    # The nodes read it from that file: a value written here would be committed with the config.
    assert "RAY_AUTH_TOKEN=" not in CLUSTER_YAML.read_text()


def test_no_token_is_in_the_repository():
    # What git would commit and `ray up` would sync: tracked files and untracked ones not ignored.
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    tokens = [path for path in listed if Path(path).name == "auth_token" or ".ray" in Path(path).parts]
    assert not tokens, tokens


# The validator is real: configs it must reject.


def test_unknown_top_level_key_is_rejected(raw):
    bad = copy.deepcopy(raw)
    bad["setup_comands"] = bad.pop("setup_commands")  # a typo `ray up` would otherwise ignore
    with pytest.raises(jsonschema.ValidationError, match="setup_comands"):
        validated(bad)


def test_wrong_type_is_rejected(raw):
    bad = copy.deepcopy(raw)
    _, workers = head_and_workers(bad)
    next(iter(workers.values()))["resources"]["GPU"] = "1"  # resources are integers
    with pytest.raises(jsonschema.ValidationError, match="'1' is not of type 'integer'"):
        validated(bad)


def test_unknown_head_node_type_is_rejected(raw):
    bad = copy.deepcopy(raw)
    bad["head_node_type"] = "no-such-type"
    with pytest.raises(ValueError, match="head_node_type"):
        validated(bad)
