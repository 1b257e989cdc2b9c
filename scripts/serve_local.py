"""`serve run --name rollout deployments.app:build_app` for one machine, with safe local defaults:
Ray's own servers listen on loopback, Serve's HTTP on 127.0.0.1:8000, `/health` and `/liveness`
also on the probe port 127.0.0.1:8001 (answered however loaded the server is), and Ctrl-C (or
SIGTERM) answers every request in flight before it stops: with its samples if they are done within
half the app config's `graceful_shutdown_timeout_s`, else with a retryable 503.

    .venv/bin/python scripts/serve_local.py                          # or: make serve
    .venv/bin/python scripts/serve_local.py num_worker_replicas=1    # the app config's fields, as serve run takes them
"""

import os
import signal
import sys
import threading

# Ray's switch for a cluster of one machine (named for the platforms where it is the default): the
# node's IP is 127.0.0.1, so Ray's servers listen on loopback. Ray reads it when it is imported.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.scripts import convert_args_to_dict  # noqa: E402  (serve run's own key=value parsing)

from deployments.app import build_app  # noqa: E402
from deployments.config import AppConfigError, RolloutAppConfig  # noqa: E402

PROBE_PORT = 8001


def _stop_as_on_ctrl_c(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    try:
        config = RolloutAppConfig.parse({"probe_port": PROBE_PORT, **convert_args_to_dict(tuple(sys.argv[1:]))})
    except AppConfigError as error:
        raise SystemExit(f"app config: {error}") from None
    ray.init(address="local")
    # `docker stop` and Kubernetes stop the main process with SIGTERM, on which Ray's driver
    # handler would just exit: answer the requests in flight then too.
    signal.signal(signal.SIGTERM, _stop_as_on_ctrl_c)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8000})
        ingress = serve.run(build_app(config), name=config.app_name, route_prefix="/")
        probes = f"http://{config.probe_host}:{config.probe_port}"
        print(f"serving application {config.app_name!r} on http://127.0.0.1:8000 (probes: {probes}); Ctrl-C stops it", flush=True)
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
