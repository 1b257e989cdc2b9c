"""A pipeline that breaks or turns out NaN, a client that goes away, a server that stops: each on
a real local cluster, with the fault injected inside the worker replica."""

import concurrent.futures
import json
import math
import threading
import time
from http.client import HTTPConnection
from urllib.parse import urlparse

import pytest
import ray
import requests
import torch
from ray import serve

from deployments.weights import ObjectStoreTensors
from deployments.work import ServiceUnavailableError
from rollout.errors import NonFiniteOutputError, WeightUpdateError
from rollout.models.registry import load_pipeline
from tests.deployments.apps import deploy
from tests.deployments.replicas import on_replicas, pids, request_body
from tests.deployments.waiting import wait_until

pytestmark = pytest.mark.faults


@pytest.fixture(scope="module")
def one_worker(serve_app):
    """One worker replica taking two samples at a time, checked by Serve every half second."""
    app = deploy(serve_app, "one-worker-test", num_worker_replicas=1, max_batch_size=2, worker_health_check_period_s=0.5)
    yield app
    serve.delete(app.name)


def _health_until(app, status: int, timeout_s: float = 90.0) -> None:
    """Waits until `/health` answers `status` on Serve's port and on the probe port, polled every 0.1 s."""
    start = time.monotonic()
    with requests.Session() as session:
        while {session.get(f"{url}/health", timeout=5).status_code for url in (app.url, app.probe_url)} != {status}:
            assert time.monotonic() - start < timeout_s, f"/health never answered {status} on both ports"
            time.sleep(0.1)


def test_non_finite_samples_are_never_served_as_a_success(one_worker, http):
    def unstable(worker):  # a model whose velocity overflows, whatever the request
        velocity = worker.pipeline.predict_velocity
        worker.pipeline.predict_velocity = lambda *args, **kwargs: velocity(*args, **kwargs) * math.inf

    on_replicas(one_worker.name, "RolloutWorker", unstable)
    try:
        response = http.post(f"{one_worker.url}/rollout/generate", json=request_body(1))
        assert response.status_code == 500
        error = response.json()["error"]
        assert "NaN or infinite values in" in error["message"] and "Traceback" not in response.text
        with pytest.raises(NonFiniteOutputError, match="NaN or infinite values in"):
            one_worker.handle.generate.remote(request_body(1)).result().batch()
        # Two calls: fewer in a row than make a broken pipeline, so the replica stays and /health stays 200.
        assert http.get(f"{one_worker.url}/health").status_code == 200
    finally:
        on_replicas(one_worker.name, "RolloutWorker", lambda worker: vars(worker.pipeline).pop("predict_velocity"))
    assert http.post(f"{one_worker.url}/rollout/generate", json=request_body(1)).status_code == 200


def test_requests_that_raise_inside_the_sampler_leave_the_replica_serving_and_their_companions_sampled(one_worker, http):
    """The client's fault is the client's (issue 46): a request whose sampler call raises (here, any
    call that holds the prompt "3") gets its error; a companion of its call is sampled again alone;
    and since the replica's own probe request still samples, the failures do not count toward
    replacing it."""

    def raising_on_a_three(worker):
        encode = worker.pipeline.encode_prompts
        worker.calls = []

        def encode_unless_three(prompts, *args, **kwargs):
            worker.calls.append(sorted(prompts))
            if "3" in prompts:
                raise ValueError("this request's values overflow inside the model")
            return encode(prompts, *args, **kwargs)

        worker.pipeline.encode_prompts = encode_unless_three

    def both(pool):  # a failing request and a companion, sent together so that they share a call
        bodies = [{**request_body(3, samples=1), "seed": 1}, {**request_body(4, samples=1), "seed": 1}]
        return [f.result().status_code for f in [pool.submit(http_post, f"{one_worker.url}/rollout/generate", b) for b in bodies]]

    (replica,) = pids(one_worker.name, "RolloutWorker")
    on_replicas(one_worker.name, "RolloutWorker", raising_on_a_three)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for _ in range(4):  # more than BROKEN_AFTER_FAILED_CALLS failures
                assert both(pool) == [500, 200]
        (calls,) = on_replicas(one_worker.name, "RolloutWorker", lambda worker: worker.calls)
        assert ["3", "4"] in calls, calls  # a shared call failed, and the companion was sampled alone
        assert on_replicas(one_worker.name, "RolloutWorker", lambda worker: worker._failed_calls_in_a_row) == [0]
        time.sleep(1.5)  # three of Serve's health checks
        assert http.get(f"{one_worker.url}/health").status_code == 200
        assert pids(one_worker.name, "RolloutWorker") == [replica]
    finally:
        on_replicas(one_worker.name, "RolloutWorker", lambda worker: vars(worker.pipeline).pop("encode_prompts") and None)


def test_a_request_out_of_memory_is_told_to_come_back_and_does_not_count_against_the_replica(one_worker, http):
    def out_of_memory_on_an_eight(worker):
        encode = worker.pipeline.encode_prompts

        def encode_unless_eight(prompts, *args, **kwargs):
            if "8" in prompts:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB on device 3")
            return encode(prompts, *args, **kwargs)

        worker.pipeline.encode_prompts = encode_unless_eight

    on_replicas(one_worker.name, "RolloutWorker", out_of_memory_on_an_eight)
    try:
        for seed in range(4):  # more than BROKEN_AFTER_FAILED_CALLS
            response = http.post(f"{one_worker.url}/rollout/generate", json={**request_body(8, samples=1), "seed": seed})
            assert response.status_code == 503 and response.headers["Retry-After"] == "1", response.text
            assert "ran out of accelerator memory" in response.json()["error"]["message"] and "GiB" not in response.text
        with pytest.raises(ServiceUnavailableError, match="ran out of accelerator memory"):
            one_worker.handle.generate.remote(request_body(8, samples=1)).result().batch()
        assert on_replicas(one_worker.name, "RolloutWorker", lambda worker: worker._failed_calls_in_a_row) == [0]
        assert http.post(f"{one_worker.url}/rollout/generate", json=request_body(1)).status_code == 200
    finally:
        on_replicas(one_worker.name, "RolloutWorker", lambda worker: vars(worker.pipeline).pop("encode_prompts") and None)


def http_post(url: str, body: dict) -> requests.Response:
    return requests.post(url, json=body, timeout=60)


def test_a_broken_pipeline_is_unhealthy_until_serve_replaces_its_replica(one_worker, http):
    def broken(worker):
        def device_lost(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        worker.pipeline.predict_velocity = device_lost

    (broken_pid,) = pids(one_worker.name, "RolloutWorker")
    on_replicas(one_worker.name, "RolloutWorker", broken)
    for i in range(3):  # BROKEN_AFTER_FAILED_CALLS sampler calls in a row fail
        response = http.post(f"{one_worker.url}/rollout/generate", json=request_body(i))
        assert response.status_code == 500 and "CUDA" not in response.text and "internal error" in response.text
    _health_until(one_worker, 503)
    for url in (one_worker.url, one_worker.probe_url):
        assert http.get(f"{url}/health").json()["reason"] == "no worker replica is running"
    _health_until(one_worker, 200)
    assert pids(one_worker.name, "RolloutWorker") != [broken_pid]
    assert http.post(f"{one_worker.url}/rollout/generate", json=request_body(1)).status_code == 200


def _serve_until_applied(app, state_dict: dict, version: str, timeout_s: float = 120.0) -> None:
    """Serves `state_dict` on every replica, again until it is applied (no replica may be
    registered while one is being replaced)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            app.handle.update_weights_from_tensor.remote(ObjectStoreTensors(ray.put(state_dict)), version).result()
            return
        except WeightUpdateError:
            assert time.monotonic() < deadline, f"{version} was never applied"
            time.sleep(0.5)


def test_weights_too_large_to_sample_with_make_the_replica_unhealthy_until_replaced(one_worker, http):
    """Finite weights, so the update is taken, but too large to sample with: every sample is NaN.
    The replica counts as broken and is replaced; once the weights are restored, it serves again."""
    served = load_pipeline().transformer.state_dict()
    (broken_pid,) = pids(one_worker.name, "RolloutWorker")
    _serve_until_applied(one_worker, {name: tensor * 1e20 for name, tensor in served.items()}, "too-large")
    try:
        for i in range(3):  # BROKEN_AFTER_FAILED_CALLS sampler calls in a row give no finite sample
            response = http.post(f"{one_worker.url}/rollout/generate", json=request_body(i))
            assert response.status_code == 500 and "NaN or infinite values" in response.json()["error"]["message"]
    finally:  # the replica that replaces it catches up with the weights last served: restore them
        _serve_until_applied(one_worker, served, "test-v1")
    start = time.monotonic()
    while (response := http.get(f"{one_worker.url}/health")).status_code != 503:
        assert time.monotonic() - start < 90, "/health never answered 503"
        time.sleep(0.1)
    assert response.json()["reason"] == "no worker replica is running"
    assert response.json()["worker_replicas_not_running"]  # the replica being replaced, by state
    _health_until(one_worker, 200)
    assert pids(one_worker.name, "RolloutWorker") != [broken_pid]
    assert http.post(f"{one_worker.url}/rollout/generate", json=request_body(1)).status_code == 200


STEP_S = 0.05  # how long each of the worker's model calls takes in the cancellation tests


def _slowed_and_counted():
    """Makes the worker's model calls counted, each taking `STEP_S` more: a step is long enough to
    tell a call that stopped at the next step from one that ran on. (A function made here, not a
    module's: Ray pickles it by value into the replica.)"""

    def slow(worker):
        velocity = worker.pipeline.predict_velocity

        def counted(*args, **kwargs):
            counted.calls += 1
            time.sleep(STEP_S)
            return velocity(*args, **kwargs)

        counted.calls = 0
        worker.pipeline.predict_velocity = counted

    return slow


def _model_calls(app) -> int:
    (calls,) = on_replicas(app.name, "RolloutWorker", lambda worker: worker.pipeline.predict_velocity.calls)
    return calls


def _model_calls_once_idle(app, idle_s: float = 1.0) -> int:
    calls, settled_at = _model_calls(app), time.monotonic()
    while time.monotonic() - settled_at < idle_s:  # until the worker has made no model call for a while
        time.sleep(0.1)
        if (now := _model_calls(app)) != calls:
            calls, settled_at = now, time.monotonic()
    return calls


LONG = {**request_body(3, samples=1), "num_inference_steps": 50, "rollout_debug_mode": False}  # the app's most


def test_a_client_that_goes_away_stops_its_sampler_call_and_its_queued_work(one_worker, http):
    """Six sampler calls of two samples, 50 steps each (300 model calls of the embedded model's one
    micro-batch): the client waits out ten steps and goes; the running call stops at a step soon
    after (Serve cancels the ingress, the ingress its parts, the worker's queue tells the sampler),
    and the queued calls never run."""
    on_replicas(one_worker.name, "RolloutWorker", _slowed_and_counted())
    try:
        url = urlparse(one_worker.url)
        connection = HTTPConnection(url.hostname, url.port, timeout=10 * STEP_S)
        twelve = {**LONG, "prompt": ["3", "4", "5"], "num_outputs_per_prompt": 4}
        connection.request("POST", f"{url.path}/rollout/generate", json.dumps(twelve), {"Content-Type": "application/json"})
        with pytest.raises(TimeoutError):
            connection.getresponse()
        connection.close()
        gone_at = _model_calls(one_worker)
        calls = _model_calls_once_idle(one_worker)
        assert calls < 50, f"{calls} model calls: the call running when the client left ran on (gone at {gone_at})"
    finally:
        on_replicas(one_worker.name, "RolloutWorker", lambda worker: vars(worker.pipeline).pop("predict_velocity"))


def test_a_cancelled_request_leaves_its_sampler_call_and_its_companion_keeps_its_bits(one_worker):
    """Through the handle: two one-sample requests share a sampler call (the worker's batch is two);
    one is cancelled after a few steps. Its sample leaves the call; the other's bits are those it
    has sampled alone. Cancelled alone, a request's call stops at a step soon after."""
    handle = one_worker.handle
    companion = {**LONG, "prompt": "4", "seed": 7}
    alone = handle.generate.remote(companion).result().fetch()
    # Through the handle the ingress sees a request answered within a poll (`ANSWERED_POLL_S`):
    # until then its cost counts against the three requests sent next.
    wait_until(lambda: requests.get(f"{one_worker.url}/rollout/info").json()["cost_in_flight"] == 0, "alone answered")
    on_replicas(one_worker.name, "RolloutWorker", _slowed_and_counted())
    try:
        # A request of 20 steps keeps the worker busy while the two arrive: it takes both next.
        busy = handle.generate.remote({**LONG, "num_inference_steps": 20}).result()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            doomed, kept = pool.map(lambda body: handle.generate.remote(body).result(), [LONG, companion])
        busy.fetch()
        wait_until(lambda: _model_calls(one_worker) >= 20 + 5, "the shared call sampling", timeout_s=60)
        doomed.cancel()
        together = kept.fetch()
        assert together.parts[0].sampler_batch_size == 2  # they shared the call
        for leaf, reference in zip(together.batch().samples, alone.batch().samples):
            for name, tensor in leaf.tensors().items():
                assert torch.equal(tensor, reference.tensors()[name]), name
        calls_before = _model_calls_once_idle(one_worker)
        assert calls_before == 20 + 50  # the call ran on for its companion, one model call a step

        lone = handle.generate.remote({**LONG, "seed": 11}).result()
        wait_until(lambda: _model_calls(one_worker) >= calls_before + 5, "the lone call sampling", timeout_s=60)
        lone.cancel()
        assert _model_calls_once_idle(one_worker) - calls_before < 25
    finally:
        on_replicas(one_worker.name, "RolloutWorker", lambda worker: vars(worker.pipeline).pop("predict_velocity"))


def test_a_stopping_server_answers_every_request_in_flight(one_worker):
    """The module's last test on `one_worker`: it stops and deletes that application."""
    app = one_worker
    long_request = {**request_body(4, samples=8), "prompt": ["4", "5"], "num_inference_steps": 50, "rollout_debug_mode": False}
    answers = []

    def mark_sampling(worker):  # nested: Ray pickles it by value into the replica
        velocity = worker.pipeline.predict_velocity

        def marked(*args, **kwargs):
            marked.sampling = True
            return velocity(*args, **kwargs)

        marked.sampling = False
        worker.pipeline.predict_velocity = marked  # gone with the application, deleted below

    on_replicas(app.name, "RolloutWorker", mark_sampling)
    client = threading.Thread(target=lambda: answers.append(requests.post(f"{app.url}/rollout/generate", json=long_request)))
    client.start()
    wait_until(
        lambda: on_replicas(app.name, "RolloutWorker", lambda worker: worker.pipeline.predict_velocity.sampling) == [True],
        "the worker sampling the long request",
    )
    app.handle.stop_serving.remote().result()
    refused = requests.post(f"{app.url}/rollout/generate", json=request_body(5))
    serve.delete(app.name)  # how soon: benchmarks.reliability
    client.join(timeout=30)

    for response in (refused, *answers):
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert "send it again" in response.json()["error"]["message"]
    assert len(answers) == 1
