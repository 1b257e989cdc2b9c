"""The Grafana dashboard of the application's metrics (`docs/metrics.md`), and a picture of it
drawn from what a real Prometheus stored while the app served a load.

    .venv/bin/python -m benchmarks.dashboard --json docs/grafana/rollout_dashboard.json
    .venv/bin/python -m benchmarks.dashboard --picture docs/metrics_dashboard.png --seconds 90

The dashboard is built with Grafana's own typed builders (`grafana-foundation-sdk`, the dashboard
schema as Python classes), so what they accept is what Grafana's schema does; the JSON in the
repository is their output (`tests/deployments/test_metrics.py` builds it again and compares, and
checks that every metric a panel queries is one the app exports). `--picture` starts a local Ray
cluster with its metrics port, serves the embedded model, starts Debian's `prometheus` scraping
that port every second, sends a mixed load (groups, a tree, refused requests, a refused weight
update) for `--seconds`, then asks Prometheus's HTTP API for each panel's queries over the run and
plots them.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Grafana's rate window, and the picture's (Prometheus scraping every second over a short run).
GRAFANA_WINDOW = "$__rate_interval"
PICTURE_WINDOW = "20s"


@dataclass(frozen=True)
class Query:
    expr: str  # PromQL, with {window} for the rate window
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str  # Grafana's unit id
    queries: tuple[Query, ...]


PANELS = (
    Panel("Requests by HTTP status", "reqps", (Query('sum by (code) (rate(ray_rollout_requests_total[{window}]))', "{{code}}"),)),
    Panel(
        "Samples served",
        "short",
        (Query('sum by (entry) (rate(ray_rollout_samples_total{{code="200"}}[{window}]))', "{{entry}}"),),
    ),
    Panel(
        "Request time at the ingress",
        "s",
        tuple(
            Query(f"histogram_quantile({q}, sum by (le) (rate(ray_rollout_request_seconds_bucket[{{window}}])))", f"p{round(q * 100)}")
            for q in (0.5, 0.95)
        ),
    ),
    Panel(
        "Sampler time per step",
        "s",
        (
            Query(
                "sum(rate(ray_rollout_sampler_step_seconds_sum[{window}])) / sum(rate(ray_rollout_sampler_step_seconds_count[{window}]))",
                "mean",
            ),
            Query("histogram_quantile(0.95, sum by (le) (rate(ray_rollout_sampler_step_seconds_bucket[{window}])))", "p95"),
        ),
    ),
    Panel(
        "Transformer rows: useful, padding, saved by trees",
        "short",
        (
            Query("sum by (kind) (rate(ray_rollout_transformer_rows_total[{window}]))", "{{kind}}"),
            Query("sum(rate(ray_rollout_tree_rows_saved_total[{window}]))", "saved by trees"),
        ),
    ),
    Panel("Cost in flight (queue depth)", "short", (Query("sum(ray_rollout_cost_in_flight_token_steps)", "token-steps"),)),
    Panel("Response bytes", "Bps", (Query("sum(rate(ray_rollout_response_bytes_total[{window}]))", "bytes/s"),)),
    Panel(
        "Weight updates",
        "short",
        (
            Query("sum by (source, outcome) (increase(ray_rollout_weight_updates_total[{window}]))", "{{source}} {{outcome}}"),
            Query("sum(rate(ray_rollout_sampler_calls_total{{outcome=\"failed\"}}[{window}]))", "failed sampler calls"),
        ),
    ),
)


def metric_names(panels=PANELS) -> set[str]:
    """Every exported series name the panels query."""
    return {name for panel in panels for query in panel.queries for name in re.findall(r"ray_rollout_[a-z_]+", query.expr)}


def build_dashboard() -> dict:
    """The dashboard, through Grafana's builders, as the JSON Grafana imports."""
    from grafana_foundation_sdk.builders import dashboard, prometheus, timeseries
    from grafana_foundation_sdk.cog.encoder import JSONEncoder
    from grafana_foundation_sdk.models.dashboard import DataSourceRef

    source = DataSourceRef(type_val="prometheus", uid="${datasource}")
    board = (
        dashboard.Dashboard("Diffusion rollout server")
        .uid("diffusion-rollout")
        .tags(["ray", "serve", "diffusion-rollout"])
        .refresh("10s")
        .time("now-30m", "now")
        .with_variable(dashboard.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
    )
    for panel in PANELS:
        built = timeseries.Panel().title(panel.title).unit(panel.unit).datasource(source).height(8).span(12)
        for ref, query in zip("ABCDEFGH", panel.queries):
            target = prometheus.Dataquery().expr(query.expr.format(window=GRAFANA_WINDOW)).legend_format(query.legend).ref_id(ref)
            built = built.with_target(target)
        board = board.with_panel(built)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


# The picture --------------------------------------------------------------------------------------


def _load(url: str, stop: threading.Event, handle) -> None:
    """Groups, a tree, requests the model refuses, and a weight update it refuses, in turns."""
    import requests

    bodies = [
        {"prompt": ["1", "7"], "num_outputs_per_prompt": 8, "num_inference_steps": 10},
        {"prompt": "3", "num_outputs_per_prompt": 4, "num_inference_steps": 10, "rollout_branch_steps": [2], "rollout_branch_factors": [2]},
        {"prompt": "a cat", "num_inference_steps": 10},  # the embedded model knows digits only: 400
        {"prompt": "5", "num_inference_steps": 10},
    ]
    turn = 0
    while not stop.is_set():
        body = {**bodies[turn % len(bodies)], "seed": turn}
        requests.post(f"{url}/rollout/generate", json=body, timeout=120)
        if turn % 25 == 24:
            try:
                handle.update_weights_from_disk.remote(model_path="/not/an/allowed/path").result()
            except Exception:  # refused, as the panel shows
                pass
        turn += 1


def _query_range(prometheus_url: str, expr: str, start: float, end: float) -> list[dict]:
    import requests

    answer = requests.get(
        f"{prometheus_url}/api/v1/query_range", params={"query": expr, "start": start, "end": end, "step": 2}, timeout=30
    ).json()
    if answer["status"] != "success":
        raise RuntimeError(f"{expr}: {answer}")
    return answer["data"]["result"]


def draw_picture(out: Path, seconds: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import ray
    from ray import serve

    from deployments.app import build_app
    from deployments.local_ray import start_local_ray
    from tests.ports import free_ports

    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("needs Debian's prometheus: apt-get install prometheus")
    metrics_port, http_port, prometheus_port = free_ports(3)
    start_local_ray(include_dashboard=False, _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    with tempfile.TemporaryDirectory() as storage:
        config = Path(storage) / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s}\n"
            f"scrape_configs: [{{job_name: ray, static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]}}]\n"
        )
        server = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={storage}/data", f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
            handle = serve.run(build_app({"num_worker_replicas": 2, "worker_torch_threads": 1}), name="rollout", route_prefix="/")
            stop = threading.Event()
            load = threading.Thread(target=_load, args=(f"http://127.0.0.1:{http_port}", stop, handle), daemon=True)
            started = time.time()
            load.start()
            time.sleep(seconds)
            stop.set()
            load.join(timeout=120)
            time.sleep(5)  # the last report reaches the agent, and a scrape takes it
            ended = time.time()
            prometheus_url = f"http://127.0.0.1:{prometheus_port}"
            figure, axes = plt.subplots(4, 2, figsize=(14, 14))
            for axis, panel in zip(axes.flat, PANELS):
                for query in panel.queries:
                    for series in _query_range(prometheus_url, query.expr.format(window=PICTURE_WINDOW), started, ended):
                        times, values = zip(*[(float(t) - started, float(v)) for t, v in series["values"]])
                        label = query.legend
                        for key, value in series["metric"].items():
                            label = label.replace("{{" + key + "}}", value)
                        axis.plot(times, values, label=label)
                axis.set_title(f"{panel.title} ({panel.unit})")
                axis.set_xlabel("seconds into the run")
                axis.legend(fontsize=8)
            figure.suptitle(f"Prometheus {_prometheus_version(binary)} scraping the embedded model's app, 2 worker replicas, {seconds:g} s of load")
            figure.tight_layout()
            out.parent.mkdir(parents=True, exist_ok=True)
            figure.savefig(out, dpi=80)
            print(f"wrote {out}")
        finally:
            server.terminate()
            server.wait(timeout=30)
            serve.shutdown()
            ray.shutdown()


def _prometheus_version(binary: str) -> str:
    first_line = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    return first_line.split()[2] if len(first_line.split()) > 2 else first_line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the dashboard here")
    parser.add_argument("--picture", type=Path, help="serve a load, let Prometheus scrape it, plot the panels here")
    parser.add_argument("--seconds", type=float, default=90)
    args = parser.parse_args()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    if args.picture:
        draw_picture(args.picture, args.seconds)


if __name__ == "__main__":
    main()
