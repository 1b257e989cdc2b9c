"""`python -m deployments`: the application's command line.

    python -m deployments serve                                   # embedded model, 127.0.0.1:8000 (make serve)
    python -m deployments serve --model /models/x model.dtype=bfloat16
    python -m deployments serve --config deployments/serve_config.yaml num_worker_replicas=1
    python -m deployments job --prompts examples/prompts.txt --output "$PWD/outputs/rollouts"
    python -m deployments info                                    # what is served, from /rollout/info
    python -m deployments health                                  # the probe port's /health; exit 1 unless 200
    python -m deployments calibrate --model /models/x --size 1024x1024 --write deployments/serve_config_gpu.yaml

`serve` takes the app config as `serve run` and the Serve config file do: `FIELD=VALUE` arguments
(dotted keys set nested fields) over the `args` of the file's one application. Unlike `serve run`,
it stops with one line and exit status 1 when the application cannot start, and on Ctrl-C or
SIGTERM it answers every request in flight before it stops: with its samples if they are done
within half of `graceful_shutdown_timeout_s`, else with a retryable 503. `info` and `health` send
`ROLLOUT_AUTH_TOKEN`, when set, as the bearer token. `calibrate` times a rollout and its decode
at each candidate micro-batch size on this machine (`rollout.calibration`) and prints, or writes
into a Serve config file's application args, the `model.micro_batch_sizes` (transformer) and
`model.decode_batch_sizes` (VAE) it picks for batches of `--load` samples.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

# Ray's switch for a cluster of one machine (named for the platforms where it is the default): the
# node's IP is 127.0.0.1, so Ray's servers listen on loopback. Ray reads it when it is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# serve.shutdown() cuts the controller's graceful_shutdown call short by design, and Ray reports
# every such call as "failed ... will be retried" on the terminal: a notice about nothing.
os.environ.setdefault("RAY_enable_output_error_log_if_still_retry", "0")

import click  # noqa: E402
import yaml  # noqa: E402  (Ray's own dependency, which reads Serve config files)

from deployments.auth import is_loopback  # noqa: E402
from deployments.config import AUTH_TOKEN_ENV, AppConfigError, RolloutAppConfig, nest_dotted_keys  # noqa: E402
from rollout.calibration import DEFAULT_CANDIDATES, DEFAULT_LOAD  # noqa: E402

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentHandle

HTTP_HOST, HTTP_PORT, PROBE_PORT = "127.0.0.1", 8000, 8001
# A traceback's last line: "rollout.errors.ModelLoadError: model.path: ..." (the class without its module).
EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(?P<name>\w+): (?P<message>.+)$")
ANSWER_TIMEOUT_S = 10.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m deployments", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,job,info,health,calibrate}")

    serve = commands.add_parser("serve", help="serve the application on this machine until Ctrl-C")
    serve.add_argument("--model", metavar="PATH", help="local diffusers directory to serve (model.path)")
    serve.add_argument("--config", metavar="FILE", type=Path, help="a Serve config file: its application's args")
    serve.add_argument("--host", help=f"Serve's HTTP host (the file's http_options, else {HTTP_HOST})")
    serve.add_argument("--port", type=int, help=f"Serve's HTTP port (the file's http_options, else {HTTP_PORT})")
    serve.add_argument(
        "--metrics-port", type=int, help="where Ray's metrics agent serves Prometheus (docs/metrics.md); default: a port Ray picks"
    )
    serve.add_argument("fields", nargs="*", metavar="FIELD=VALUE", help="app config fields: model.dtype=bfloat16")

    commands.add_parser(
        "job", help="write rollouts of a prompt file to disk (python -m deployments job --help)", add_help=False
    )

    for name, default, what in (
        ("info", f"http://{HTTP_HOST}:{HTTP_PORT}", "the model, weights and limits served (GET /rollout/info)"),
        ("health", f"http://{HTTP_HOST}:{PROBE_PORT}", "readiness (GET /health); exit 0 only if ready"),
    ):
        command = commands.add_parser(name, help=what)
        command.add_argument("--url", default=default, help=f"the server's base URL ({default})")
        command.add_argument("--json", action="store_true", help="print the whole answer as JSON")

    calibrate = commands.add_parser("calibrate", help="measure and pick the transformer's and the VAE's micro-batch sizes per image size")
    calibrate.add_argument("--model", metavar="PATH", help="local diffusers directory (default: the embedded model)")
    calibrate.add_argument("--size", action="append", metavar="HxW", help="image size to calibrate (repeatable)")
    calibrate.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    calibrate.add_argument("--candidates", type=int, nargs="+", default=list(DEFAULT_CANDIDATES))
    calibrate.add_argument("--guidance-scale", type=float, help="the requests' guidance_scale (CFG doubles the rows)")
    calibrate.add_argument("--true-cfg-scale", type=float, help="the requests' true_cfg_scale")
    calibrate.add_argument("--repeats", type=int, default=5, help="rounds of one timed call per candidate, taken in turns; the fastest counts")
    calibrate.add_argument(
        "--load",
        type=int,
        default=DEFAULT_LOAD,
        help="samples in the batches to serve (an RL group, or several); sizes are picked for this load, padding counted",
    )
    calibrate.add_argument(
        "--batch-invariance",
        default="padding",
        choices=["padding", "kernels"],
        help="measure under this model.batch_invariance; 'kernels' also checks, at each size, that a sample's "
        "bits do not depend on its call here (--write then sets model.batch_invariance too)",
    )
    calibrate.add_argument(
        "--write",
        metavar="FILE",
        type=Path,
        help="set model.micro_batch_sizes (and, with padding, model.decode_batch_sizes) in this Serve config file "
        "(drops its comments)",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["job"]:  # the job's own parser reads its arguments, --help included
        from deployments import job

        return job.main(argv[1:], prog="python -m deployments job")
    arguments = _parser().parse_args(argv)
    if arguments.command == "serve":
        return serve(arguments)
    if arguments.command == "calibrate":
        return calibrate(arguments)
    return show(arguments.command, arguments.url, as_json=arguments.json)


# serve


def app_config(arguments: argparse.Namespace) -> tuple[RolloutAppConfig, dict]:
    """The app config and HTTP options the arguments give, or SystemExit with one line naming the field."""
    args, http_options = {}, {}
    if arguments.config is not None:
        args, http_options = _serve_config_file(arguments.config)
    try:
        fields = nest_dotted_keys(_key_values(arguments.fields))
    except AppConfigError as error:
        raise SystemExit(f"arguments: {error}") from None
    if arguments.model is not None:
        if "path" in fields.get("model", {}):
            raise SystemExit("arguments: --model and model.path= both set the model's directory: give one")
        fields.setdefault("model", {})["path"] = arguments.model
    if "path" in fields.get("model", {}) and "name" in args.get("model", {}) and "name" not in fields["model"]:
        # The path names the family; the file's embedded model name would contradict it.
        args = {**args, "model": {k: v for k, v in args["model"].items() if k != "name"}}
    from deployments.app import checked_app_config

    try:
        config = checked_app_config(_merged({"probe_port": PROBE_PORT, **args}, fields))
    except AppConfigError as error:
        raise SystemExit(f"app config: {error}") from None
    host = arguments.host or http_options.get("host", HTTP_HOST)
    port = arguments.port or http_options.get("port", HTTP_PORT)
    if not is_loopback(host) and config.auth_token is None and not config.allow_unauthenticated:
        raise SystemExit(
            f"app config: serving on {host}, which other machines reach, needs auth_token (or {AUTH_TOKEN_ENV} in "
            "the environment); allow_unauthenticated=true serves without one"
        )
    return config, {"host": host, "port": port}


def _key_values(fields: list[str]) -> dict:
    from ray.serve.scripts import convert_args_to_dict  # serve run's own key=value parsing

    try:
        return convert_args_to_dict(tuple(fields))
    except click.ClickException as error:
        raise SystemExit(f"arguments: {error.message}") from None


def _read_serve_config(path: Path) -> dict:
    """A Serve config file holding one application of this project's, or SystemExit with one line."""
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise SystemExit(f"--config {path}: {type(error).__name__}: {error}") from None
    applications = config.get("applications") if isinstance(config, dict) else None
    if not isinstance(applications, list) or len(applications) != 1 or not isinstance(applications[0], dict):
        raise SystemExit(f"--config {path}: applications: expected a list of one application")
    import_path = applications[0].get("import_path")
    if import_path != "deployments.app:build_app":
        raise SystemExit(
            f"--config {path}: applications[0].import_path: expected deployments.app:build_app, got {import_path!r}"
        )
    return config


def _serve_config_file(path: Path) -> tuple[dict, dict]:
    """(args, http_options) of the one application of a Serve config file."""
    config = _read_serve_config(path)
    application = config["applications"][0]
    args = application.get("args") or {}
    if application.get("name") is not None:
        args = {"app_name": application["name"], **args}
    return args, config.get("http_options") or {}


def _merged(base: dict, overrides: dict) -> dict:
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = (
            _merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        )
    return merged


def _stop_as_on_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt


def run_app(config: RolloutAppConfig, route_prefix: str = "/") -> DeploymentHandle:
    """Deploys the application and waits until it serves; one that fails to start exits with the
    exception that failed each of its deployments, one line."""
    from ray import serve

    from deployments.app import build_app

    try:
        return serve.run(build_app(config), name=config.app_name, route_prefix=route_prefix)
    except RuntimeError as error:  # what serve.run raises for an application that failed to deploy
        cause = _failure_cause(config.app_name, error)
        raise SystemExit(f"application {config.app_name!r} failed to start: {cause}") from None


def _failure_cause(app_name: str, error: RuntimeError) -> str:
    """The exception that failed each deployment of `app_name`, one line: serve.run's error only names
    the deployments, and each one's status holds the replica's whole traceback, the exception last."""
    from ray import serve
    from ray.serve.schema import DeploymentStatus

    causes = []
    for name, deployment in serve.status().applications[app_name].deployments.items():
        if deployment.status == DeploymentStatus.DEPLOY_FAILED:
            raised = [match for line in deployment.message.splitlines() if (match := EXCEPTION_LINE.match(line))]
            cause = f"{raised[-1]['name']}: {raised[-1]['message']}" if raised else deployment.message
            causes.append(f"{name}: {cause}")
    return "; ".join(causes) or str(error)


def serve(arguments: argparse.Namespace) -> None:
    config, http_options = app_config(arguments)
    import ray
    from ray import serve

    from deployments.local_ray import start_local_ray

    start_local_ray(**({} if arguments.metrics_port is None else {"_metrics_export_port": arguments.metrics_port}))
    # `docker stop` and Kubernetes stop the main process with SIGTERM, on which Ray's driver
    # handler would just exit: answer the requests in flight then too.
    signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)
    try:
        serve.start(http_options=http_options)
        ingress = run_app(config)
        probes = f"probes: {config.probe_url}" if config.probe_url else "no probe port"
        url = f"http://{http_options['host']}:{http_options['port']}"
        # Its Ray address is what a driver or `ray job submit` needs (RAY_ADDRESS) where other clusters run too.
        ray_address = ray.get_runtime_context().gcs_address
        metrics = "" if arguments.metrics_port is None else f", metrics on http://127.0.0.1:{arguments.metrics_port}/metrics"
        print(
            f"serving application {config.app_name!r}, model {config.model.described()}, on {url} ({probes}), Ray at {ray_address}"
            f"{metrics}; Ctrl-C stops it",
            flush=True,
        )
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            # serve.shutdown() alone kills the HTTP proxy at once, dropping every request in flight;
            # deleting the application first lets its replicas answer them through the proxy, and
            # stop_serving makes the ingress answer what would not finish in time with a 503.
            ingress.stop_serving.remote().result()
            serve.delete(config.app_name)
    except KeyboardInterrupt:
        pass  # while starting: nothing is in flight
    finally:
        serve.shutdown()
        ray.shutdown()


# calibrate


def _image_size(text: str) -> tuple[int, int]:
    from rollout.micro_batching import parse_image_size

    size = parse_image_size(text)
    if size is None:
        raise SystemExit(f"--size: expected HEIGHTxWIDTH such as 1024x1024, got {text!r}")
    return size


def calibrate(arguments: argparse.Namespace) -> None:
    import torch

    from rollout.calibration import calibrate as measure
    from rollout.calibration import check_batch_invariance
    from rollout.errors import RolloutError
    from rollout.micro_batching import MicroBatching
    from rollout.models.registry import load_pipeline

    sizes = [_image_size(text) for text in arguments.size or []]
    guidance = {
        name: value
        for name, value in (("guidance_scale", arguments.guidance_scale), ("true_cfg_scale", arguments.true_cfg_scale))
        if value is not None
    }
    try:
        pipeline = load_pipeline(None, arguments.model, dtype=getattr(torch, arguments.dtype))
        pipeline.micro_batching = MicroBatching(pipeline.micro_batching.default, invariance=arguments.batch_invariance)
        sizes = sizes or [(pipeline.default_height, pipeline.default_width)]
        results = [
            measure(pipeline, h, w, tuple(arguments.candidates), guidance, arguments.repeats, arguments.load)
            for h, w in sizes
        ]
        kernels = arguments.batch_invariance == "kernels"
        checks = [check_batch_invariance(pipeline, h, w, guidance) for h, w in sizes] if kernels else []
    except (RolloutError, ValueError) as error:
        raise SystemExit(f"calibrate: {error}") from None
    candidates = sorted(set(arguments.candidates))
    print(
        f"{pipeline.name}, {arguments.dtype}, on {pipeline.device}, batch invariance by {arguments.batch_invariance}: "
        f"ms for a batch of {arguments.load} samples in calls of each size, its last call padded, from a rollout of "
        f"{max(candidates)} samples: the rollout less its decode (transformer), and the decode alone (VAE)"
    )
    print("| size | calls of | " + " | ".join(map(str, candidates)) + " | chosen |")
    print("|---" * (len(candidates) + 3) + "|")
    for result in results:
        for part, seconds, chosen in (
            ("transformer", result.denoising_seconds_for_load, result.chosen),
            ("VAE", result.decode_seconds_for_load, result.chosen_for_decode),
        ):
            times = " | ".join(f"{seconds[c] * 1e3:.2f}" for c in candidates)
            print(f"| {result.size_key} | {part} | {times} | {'an image a call' if chosen is None else chosen} |")
    for result, check in zip(results, checks):
        verdict = "holds" if check.holds else "does NOT hold: use padding"
        print(
            f"{result.size_key}: a sample alone and beside two others, velocity differs by "
            f"{check.velocity_difference:.3g}, image by {check.image_difference:.3g}: batch invariance {verdict}"
        )
    if not all(check.holds for check in checks):
        raise SystemExit(1)
    tables = {"micro_batch_sizes": {result.size_key: result.chosen for result in results}}
    if not kernels:  # under the kernels the VAE decodes an image a call, whatever its size
        tables["decode_batch_sizes"] = {result.size_key: result.chosen_for_decode for result in results}
    for field, table in tables.items():
        print(f"model.{field}: {json.dumps(table)}")
    if arguments.write is not None:
        _write_micro_batch_sizes(arguments.write, tables, arguments.batch_invariance if kernels else None)
        print(f"wrote them into {arguments.write}")


def _write_micro_batch_sizes(path: Path, tables: dict[str, dict[str, int]], batch_invariance: str | None) -> None:
    config = _read_serve_config(path)
    model = config["applications"][0].setdefault("args", {}).setdefault("model", {})
    for field, table in tables.items():
        model[field] = {**(model.get(field) or {}), **table}
    if batch_invariance is not None:  # the sizes were measured under it
        model["batch_invariance"] = batch_invariance
    path.write_text(yaml.safe_dump(config, sort_keys=False))


# info, health


def fetch_json(url: str) -> tuple[int, dict]:
    """(status, JSON object) of a GET, with the bearer token from ROLLOUT_AUTH_TOKEN; SystemExit with
    one line when nothing answers or the answer is not a JSON object."""
    headers = {"Accept": "application/json"}
    if token := os.environ.get("ROLLOUT_AUTH_TOKEN"):
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=ANSWER_TIMEOUT_S) as answer:
            status, body = answer.status, answer.read()
    except urllib.error.HTTPError as error:
        status, body = error.code, error.read()
    except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
        reason = getattr(error, "reason", error)
        raise SystemExit(f"{url}: no answer ({reason}); is the server running (make serve)?") from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise SystemExit(f"{url}: {status}, not a JSON object: {body[:200]!r}")
    return status, answer


def show(command: str, base_url: str, *, as_json: bool) -> None:
    url = base_url.rstrip("/") + ("/rollout/info" if command == "info" else "/health")
    status, body = fetch_json(url)
    if status == 401:
        raise SystemExit(f"{url}: 401: set ROLLOUT_AUTH_TOKEN to the server's token")
    if as_json:
        print(json.dumps(body, indent=2))
    elif command == "info" and status == 200:
        print(_info_lines(body))
    elif status == 200:
        print(f"ready: {body['worker_replicas_running']} worker replica(s) running")
    if status != 200:
        detail = body.get("reason") or body.get("detail") or body
        raise SystemExit(f"{url}: {status}: {detail}")


def _info_lines(info: dict) -> str:
    sizes, limits = info["image_size_limits"], info["limits"]
    replicas = info["replica_weight_versions"]
    return "\n".join(
        [
            f"model: {info['model']} ({info['pipeline_class']}, {info['dtype']}, on {info['device']}) from {info['model_path']}",
            f"weights: {info['weight_version']}, on {len(replicas)} worker replica(s)",
            f"scheduler: {info['scheduler']['class_name']}",
            (
                f"image sizes: multiples of {sizes['multiple_of']} up to {info['max_image_size']}, "
                f"default {info['default_height']}x{info['default_width']}"
            ),
            f"per request: up to {limits['max_samples_per_request']} samples and {limits['max_inference_steps']} steps",
        ]
    )
