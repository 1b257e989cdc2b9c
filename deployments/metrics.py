"""The application's metrics, through Ray Serve's metrics API (`ray.serve.metrics`): Ray's metrics
agent on each node exports them to Prometheus (`ray start --metrics-export-port`, or `ray.init(
_metrics_export_port=...)`) and its dashboard shows them, with no server of this project's own.

Names follow Prometheus' conventions: a `rollout_` prefix (Ray adds `ray_`), base units in the
name (`_seconds`, `_bytes`), counters exported with `_total`. Labels are bounded: Serve's own
(deployment, replica, application, route), the model, an HTTP status (`code`, from
`deployments/http_errors.py`'s table), the way a request came (`entry`: http or handle), and a
few fixed words. Never a request id, prompt, seed or weight version: a series is kept for the
life of the process, so one per distinct value would grow without bound.

Each deployment makes its own (`IngressMetrics`, `WorkerMetrics`, `WeightMetrics`); a process that
records none exports none.
"""

from __future__ import annotations

from ray.serve import metrics

# Seconds: a tiny model's call on a CPU (milliseconds) to a video family's request on a GPU (minutes).
SECONDS_BOUNDARIES = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000]


class IngressMetrics:
    """What the ingress sees of requests: by `entry` (http, handle) and `code` (the HTTP status the
    request was, or would be over HTTP, answered with)."""

    def __init__(self, model: str):
        self.requests = metrics.Counter(
            "rollout_requests", "Generate requests answered, by entry and HTTP status.", ("model", "entry", "code")
        )
        self.samples = metrics.Counter(
            "rollout_samples",
            "Samples (a tree's leaves) of the generate requests answered, by entry and HTTP status.",
            ("model", "entry", "code"),
        )
        self.request_seconds = metrics.Histogram(
            "rollout_request_seconds",
            "Wall time of a generate request at the ingress, from its body read to its answer built.",
            SECONDS_BOUNDARIES,
            ("model", "entry"),
        )
        self.response_bytes = metrics.Counter(
            "rollout_response_bytes", "Bytes of the generate responses' bodies sent over HTTP.", ("model",)
        )
        self.cost_in_flight = metrics.Gauge(
            "rollout_cost_in_flight_token_steps",
            "Cost of the requests this ingress replica has admitted and not yet seen answered, in token-steps.",
            ("model",),
        )
        for metric in (self.requests, self.samples, self.request_seconds, self.response_bytes, self.cost_in_flight):
            metric.set_default_tags({"model": model})

    def answered(self, entry: str, code: int, samples: int, seconds: float | None = None) -> None:
        tags = {"entry": entry, "code": str(code)}
        self.requests.inc(1, tags)
        if samples:
            self.samples.inc(samples, tags)
        if seconds is not None:
            self.request_seconds.observe(seconds, {"entry": entry})


class WorkerMetrics:
    """What a worker replica's sampler calls cost: time, and the transformer's rows computed, of
    which those the samples needed (`useful`) and the rest padding; and the rows a tree saved
    against sampling its leaves unbranched."""

    def __init__(self, model: str):
        self.calls = metrics.Counter("rollout_sampler_calls", "Sampler calls, by outcome (ok, failed).", ("model", "outcome"))
        self.call_seconds = metrics.Histogram(
            "rollout_sampler_call_seconds", "Wall time of a sampler call.", SECONDS_BOUNDARIES, ("model",)
        )
        self.step_seconds = metrics.Histogram(
            "rollout_sampler_step_seconds",
            "Wall time of a sampler call over its denoising steps.",
            SECONDS_BOUNDARIES,
            ("model",),
        )
        self.transformer_rows = metrics.Counter(
            "rollout_transformer_rows",
            "Rows the transformer computed, by kind: useful (the samples') or padding.",
            ("model", "kind"),
        )
        self.tree_rows_saved = metrics.Counter(
            "rollout_tree_rows_saved",
            "Transformer rows tree requests did not compute, against sampling their leaves unbranched.",
            ("model",),
        )
        for metric in (self.calls, self.call_seconds, self.step_seconds, self.transformer_rows, self.tree_rows_saved):
            metric.set_default_tags({"model": model})

    def sampled(self, seconds: float, steps: int, computed_rows: int, useful_rows: int, rows_saved: int) -> None:
        self.calls.inc(1, {"outcome": "ok"})
        self.call_seconds.observe(seconds)
        self.step_seconds.observe(seconds / max(steps, 1))
        self.transformer_rows.inc(useful_rows, {"kind": "useful"})
        if computed_rows > useful_rows:
            self.transformer_rows.inc(computed_rows - useful_rows, {"kind": "padding"})
        if rows_saved > 0:
            self.tree_rows_saved.inc(rows_saved)

    def failed(self) -> None:
        self.calls.inc(1, {"outcome": "failed"})


class WeightMetrics:
    """Weight updates the coordinator ran, by source (disk, tensors, group, shared_memory) and
    outcome (ok, refused), and how long they took."""

    def __init__(self):
        self.updates = metrics.Counter("rollout_weight_updates", "Weight updates, by source and outcome.", ("source", "outcome"))
        self.update_seconds = metrics.Histogram(
            "rollout_weight_update_seconds", "Wall time of a weight update, all replicas.", SECONDS_BOUNDARIES, ("source",)
        )

    def updated(self, source: str, success: bool, seconds: float) -> None:
        self.updates.inc(1, {"source": source, "outcome": "ok" if success else "refused"})
        self.update_seconds.observe(seconds, {"source": source})
