"""What an operator watches. The application's metrics as Prometheus scrapes them: the session's Ray
cluster exports them on its metrics port (`ray_cluster`), and after known requests the kernels
application (one worker replica, under batch-invariant kernels) shows what they added exactly, with
label sets that do not grow with the prompts and seeds it is sent. And each request's stage times,
in its response's headers and on the handle's result. And the Grafana dashboard over them
(`benchmarks/dashboard.py`)."""

import json
import re
import time
from pathlib import Path

import pytest
import requests

from benchmarks.dashboard import build_dashboard, metric_names
from rollout.errors import WeightUpdateError

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "rollout_dashboard.json"

STEPS = 2
SAMPLE_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
LABEL = re.compile(r'(?P<key>[a-zA-Z_][a-zA-Z0-9_]*)="(?P<value>(?:[^"\\]|\\.)*)"')
SCRAPE_PATIENCE_S = 60
REPORT_INTERVAL_S = 1.0  # the session cluster's metrics_report_interval_ms


def scraped(metrics_url: str, application: str) -> dict[tuple[str, frozenset], float]:
    """(name, labels) -> value of every `ray_rollout_*` series of `application`."""
    series = {}
    for line in requests.get(metrics_url, timeout=10).text.splitlines():
        match = SAMPLE_LINE.match(line)
        if match is None or not match["name"].startswith("ray_rollout_"):
            continue
        labels = {m["key"]: m["value"] for m in LABEL.finditer(match["labels"] or "")}
        if labels.get("application") == application:
            series[match["name"], frozenset(labels.items())] = float(match["value"])
    return series


def value(series: dict, name: str, **labels) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, have), v in series.items() if n == name and wanted <= have)


def settled(metrics_url: str, application: str) -> dict:
    """A scrape that two report intervals later is still the same: what earlier tests recorded has
    all arrived."""
    deadline = time.monotonic() + SCRAPE_PATIENCE_S
    series = scraped(metrics_url, application)
    while time.monotonic() < deadline:
        time.sleep(2 * REPORT_INTERVAL_S)
        series, previous = scraped(metrics_url, application), series
        if series == previous:
            break
    return series


def scraped_once(metrics_url: str, application: str, done) -> dict:
    """The first scrape `done` accepts: Ray's agent exports what a replica recorded a moment later."""
    deadline = time.monotonic() + SCRAPE_PATIENCE_S
    while True:
        series = scraped(metrics_url, application)
        if done(series) or time.monotonic() > deadline:
            return series
        time.sleep(0.5)


def generate(app, **fields) -> requests.Response:
    body = {"num_inference_steps": STEPS, "rollout": True, **fields}
    return requests.post(f"{app.url}/rollout/generate", json=body, timeout=120)


def test_the_metrics_count_the_requests_samples_and_rows_sent(kernels_app, metrics_url):
    before = settled(metrics_url, kernels_app.name)
    for seed in range(3):  # 3 requests of 4 samples
        assert generate(kernels_app, prompt=["1", "2"], num_outputs_per_prompt=2, seed=seed).status_code == 200
    for steps in (0, 10_000):  # refused, naming num_inference_steps
        assert generate(kernels_app, prompt="3", num_inference_steps=steps).status_code == 400
    handled = kernels_app.handle.generate.remote({"prompt": "4", "num_outputs_per_prompt": 3, "num_inference_steps": STEPS})
    assert len(handled.result(timeout_s=120).batch().samples) == 3

    def added(series, name, **labels):
        return value(series, name, **labels) - value(before, name, **labels)

    series = scraped_once(
        metrics_url,
        kernels_app.name,
        lambda series: added(series, "ray_rollout_requests_total") == 6
        and added(series, "ray_rollout_transformer_rows_total") == 15 * STEPS,
    )
    requests_added = {
        (entry, code): added(series, "ray_rollout_requests_total", entry=entry, code=code)
        for entry, code in (("http", "200"), ("http", "400"), ("handle", "200"))
    }
    assert requests_added == {("http", "200"): 3, ("http", "400"): 2, ("handle", "200"): 1}
    assert added(series, "ray_rollout_samples_total", entry="http", code="200") == 12
    assert added(series, "ray_rollout_samples_total", entry="handle", code="200") == 3
    assert added(series, "ray_rollout_requests_total", model="embedded-digits") == 6
    # Every sample's steps are useful rows; under the kernels nothing is padded.
    assert added(series, "ray_rollout_transformer_rows_total", kind="useful") == 15 * STEPS
    assert added(series, "ray_rollout_transformer_rows_total", kind="padding") == 0
    calls = added(series, "ray_rollout_sampler_calls_total", outcome="ok")
    assert 1 <= calls <= 4 and added(series, "ray_rollout_sampler_call_seconds_count") == calls
    assert added(series, "ray_rollout_request_seconds_count", entry="http") == 5
    assert added(series, "ray_rollout_response_bytes_total") > 0


def test_label_sets_do_not_grow_with_prompts_and_seeds(kernels_app, metrics_url):
    assert generate(kernels_app, prompt="5", seed=1).status_code == 200  # every series of a 200 exists
    before = settled(metrics_url, kernels_app.name)
    # 1,000 distinct prompts with 1,000 distinct sample seeds, in 125 requests the model refuses
    # after reading them (the embedded model knows digits only), and 224 more seeds sampled.
    for request in range(125):
        prompts = [f"prompt number {request * 8 + i}" for i in range(8)]
        assert generate(kernels_app, prompt=prompts, num_inference_steps=1, seed=7_000 + request * 8).status_code == 400
    for request in range(7):
        digits = [str(i) for i in range(8)]
        response = generate(kernels_app, prompt=digits, num_outputs_per_prompt=4, num_inference_steps=1, seed=9_000 + request * 32)
        assert response.status_code == 200

    def samples(series, code):
        return value(series, "ray_rollout_samples_total", entry="http", code=code)

    after = scraped_once(metrics_url, kernels_app.name, lambda series: samples(series, "200") == samples(before, "200") + 224)
    assert (samples(after, "200"), samples(after, "400")) == (samples(before, "200") + 224, samples(before, "400") + 1000)
    # No series for a prompt or a seed: new ones only for a 400, if no test before made one.
    assert set(after) - set(before) <= {key for key in after if dict(key[1]).get("code") == "400"}
    label_values = {v for _, labels in after for _, v in labels}
    assert not any("number" in v or (v.isdigit() and int(v) >= 7_000) for v in label_values)
    assert len(after) < 300


def test_a_response_says_where_its_time_went_over_http_and_through_the_handle(kernels_app):
    response = generate(kernels_app, prompt=["1", "2"], num_outputs_per_prompt=2)
    assert response.status_code == 200
    total_ms = float(response.headers["x-sgld-timing"])
    stages = json.loads(response.headers["x-sgld-stages"])
    assert list(stages) == ["read_ms", "plan_ms", "fetch_ms", "queue_ms", "sample_ms", "score_ms", "encode_ms"]
    assert all(ms >= 0 for ms in stages.values()) and stages["sample_ms"] > 0
    # The ingress's stages follow one another within its whole time; the workers' lie within the fetch.
    assert stages["read_ms"] + stages["plan_ms"] + stages["fetch_ms"] + stages["encode_ms"] <= total_ms + 0.01
    assert stages["queue_ms"] + stages["sample_ms"] <= stages["fetch_ms"]
    assert response.headers["server-timing"].startswith(f"read;dur={stages['read_ms']}, plan;dur={stages['plan_ms']}")

    fetched = kernels_app.handle.generate.remote({"prompt": "3", "num_inference_steps": STEPS}).result(timeout_s=120).fetch()
    handled = fetched.stage_times()
    assert handled.read == handled.encode == 0 and handled.plan > 0 and handled.sample > 0
    assert handled.fetch == fetched.fetch_s and handled.score == 0


def test_the_dashboard_is_grafanas_builders_output_and_queries_only_what_the_app_exports(kernels_app, metrics_url):
    assert json.loads(DASHBOARD.read_text()) == build_dashboard()  # `python -m benchmarks.dashboard --json` wrote it
    # A tree request and a refused weight update, so that the counters only they move exist.
    tree = {"prompt": "3", "num_outputs_per_prompt": 2, "rollout_branch_steps": [1], "rollout_branch_factors": [2]}
    assert generate(kernels_app, **tree).status_code == 200
    with pytest.raises(WeightUpdateError):
        kernels_app.handle.update_weights_from_disk.remote(model_path="/not/an/allowed/path").result(timeout_s=60)
    queried = metric_names()
    series = scraped_once(metrics_url, kernels_app.name, lambda series: queried <= {name for name, _ in series})
    assert queried <= {name for name, _ in series}, queried - {name for name, _ in series}
