"""`serve run --name rollout deployments.app:build_app` for one machine, with safe local defaults:
Ray's own servers listen on loopback, Serve's HTTP on 127.0.0.1:8000, `/health` and `/liveness`
also on the probe port 127.0.0.1:8001 (answered however loaded the server is), and Ctrl-C (or
SIGTERM) answers every request in flight before it stops: with its samples if they are done within
half the app config's `graceful_shutdown_timeout_s`, else with a retryable 503.

    .venv/bin/python scripts/serve_local.py                          # or: make serve
    .venv/bin/python scripts/serve_local.py num_worker_replicas=1    # the app config's fields, as serve run takes them
    .venv/bin/python scripts/serve_local.py --model /models/x        # a diffusers directory (make serve MODEL=...)
    .venv/bin/python scripts/serve_local.py model.dtype=bfloat16     # dotted keys set nested fields

A config that breaks a rule (a model directory that is missing or holds another model included)
stops it before Ray starts, and an application that fails to deploy (replicas that cannot load the
model) stops it once Serve gives up on it: both with one line naming the cause, and exit status 1.
"""

import argparse
import os
import re
import signal
import threading

# Ray's switch for a cluster of one machine (named for the platforms where it is the default): the
# node's IP is 127.0.0.1, so Ray's servers listen on loopback. Ray reads it when it is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# serve.shutdown() cuts the controller's graceful_shutdown call short by design, and Ray reports
# every such call as "failed ... will be retried" on the terminal: a notice about nothing.
os.environ.setdefault("RAY_enable_output_error_log_if_still_retry", "0")

import click  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.schema import DeploymentStatus  # noqa: E402
from ray.serve.scripts import convert_args_to_dict  # noqa: E402  (serve run's own key=value parsing)

from deployments.app import build_app  # noqa: E402
from deployments.config import AppConfigError, RolloutAppConfig  # noqa: E402
from deployments.local_ray import start_local_ray  # noqa: E402

HTTP_PORT = 8000
# A traceback's last line: "rollout.errors.ModelLoadError: model.path: ..." (the class without its module).
EXCEPTION_LINE = re.compile(r"^(?:\w+\.)*(?P<name>\w+): (?P<message>.+)$")
PROBE_PORT = 8001


def _stop_as_on_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt


def _failure_cause(app_name: str, error: RuntimeError) -> str:
    """The exception that failed each deployment of `app_name`, one line: serve.run's error only names
    the deployments, and each one's status holds the replica's whole traceback, the exception last."""
    causes = []
    for name, deployment in serve.status().applications[app_name].deployments.items():
        if deployment.status == DeploymentStatus.DEPLOY_FAILED:
            raised = [match for line in deployment.message.splitlines() if (match := EXCEPTION_LINE.match(line))]
            cause = f"{raised[-1]['name']}: {raised[-1]['message']}" if raised else deployment.message
            causes.append(f"{name}: {cause}")
    return "; ".join(causes) or str(error)


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument(
        "--model", metavar="PATH", help="local diffusers directory to serve (model.path), its family from model_index.json"
    )
    parser.add_argument("--port", type=int, default=HTTP_PORT, help=f"Serve's HTTP port on 127.0.0.1 ({HTTP_PORT})")
    parser.add_argument(
        "fields", nargs="*", metavar="FIELD=VALUE", help="app config fields, as serve run takes them: model.dtype=bfloat16"
    )
    return parser.parse_args()


def _config(arguments: argparse.Namespace) -> RolloutAppConfig:
    try:
        fields = convert_args_to_dict(tuple(arguments.fields))
    except click.ClickException as error:
        raise SystemExit(f"arguments: {error.message}") from None
    if arguments.model is not None:
        if "model.path" in fields:
            raise SystemExit("arguments: --model and model.path= both set the model's directory: give one")
        fields["model.path"] = arguments.model
    try:
        return RolloutAppConfig.parse({"probe_port": PROBE_PORT, **fields})
    except AppConfigError as error:
        raise SystemExit(f"app config: {error}") from None


def main() -> None:
    arguments = _arguments()
    config = _config(arguments)
    start_local_ray()
    # `docker stop` and Kubernetes stop the main process with SIGTERM, on which Ray's driver
    # handler would just exit: answer the requests in flight then too.
    signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": arguments.port})
        try:
            ingress = serve.run(build_app(config), name=config.app_name, route_prefix="/")
        except RuntimeError as error:  # what serve.run raises for an application that failed to deploy
            cause = _failure_cause(config.app_name, error)
            raise SystemExit(f"application {config.app_name!r} failed to start: {cause}") from None
        probes = f"http://{config.probe_host}:{config.probe_port}"
        url = f"http://127.0.0.1:{arguments.port}"
        model = f"{config.model.label()} ({config.model.path or 'packaged weights'})"
        print(f"serving application {config.app_name!r}, model {model}, on {url} (probes: {probes}); Ctrl-C stops it", flush=True)
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


if __name__ == "__main__":
    main()
