"""Replica deaths and overload on a real local cluster: no request fails or hangs, no sample changes.

The replica deaths have an application of their own (they kill its replicas); the overload, an
ingress of its own in front of the session's workers (it fills that ingress's queue).
"""

import os
import signal
import threading
import time

import pytest
import ray
import requests
from ray import serve
from ray.util.state import list_actors

from deployments.dispatch import OverloadedError, RolloutResult, WorkerLostError
from rollout.codec import from_msgpack
from rollout.cost import RequestCost
from deployments.work import DeadlineExceededError
from tests.deployments.apps import deploy, deploy_ingress
from tests.deployments.replicas import STEPS, pids, request_body
from tests.deployments.waiting import wait_until

pytestmark = pytest.mark.faults


def _sample_bits(samples) -> list[tuple]:
    return [(s.seed, s.image.numpy().tobytes(), s.log_probs.numpy().tobytes()) for s in samples]


# An embedded model's sample of `request_body`, in token-steps: 64 tokens x 2 guided branches x STEPS, and 64 decoded.
SAMPLE_COST = 64 * 2 * STEPS + 64


def _row_bits(rows) -> list[tuple]:
    return [(r["sample_seed"], r["generated_output"].numpy().tobytes(), r["rollout_log_probs"].numpy().tobytes()) for r in rows]


def _served(app, session: requests.Session, i: int, over_http: bool) -> list[tuple]:
    if over_http:
        response = session.post(f"{app.url}/rollout/generate", json={**request_body(i), "rollout_debug_mode": False})
        assert response.status_code == 200, response.text
        return _row_bits(from_msgpack(response.content))
    return _sample_bits(app.handle.generate.remote(request_body(i)).result().batch().samples)


@pytest.fixture(scope="module")
def app(serve_app):
    app = deploy(serve_app, "faults-test", max_queued_cost=1024 * SAMPLE_COST)
    yield app
    serve.delete(app.name)


def test_a_worker_replica_killed_under_load_loses_no_request_and_changes_no_sample(app):
    requests_ = range(48)
    with requests.Session() as session:
        undisturbed = {i: _served(app, session, i, over_http=i % 2 == 0) for i in requests_}

    outcomes: dict[int, object] = {}

    def client(ids):
        with requests.Session() as session:
            for i in ids:
                try:
                    outcomes[i] = _served(app, session, i, over_http=i % 2 == 0)
                except Exception as error:  # recorded, and the test fails below naming it
                    outcomes[i] = error

    clients = [threading.Thread(target=client, args=(requests_[k::8],)) for k in range(8)]
    for thread in clients:
        thread.start()
    wait_until(lambda: outcomes, "the first answer under load")  # the other 47 are still to come
    os.kill(pids(app.name, "RolloutWorker")[0], signal.SIGKILL)
    for thread in clients:
        thread.join(timeout=240)
    assert not any(thread.is_alive() for thread in clients), "a request hung"
    failed = {i: repr(o) for i, o in outcomes.items() if isinstance(o, Exception)}
    assert failed == {} and len(outcomes) == len(requests_)
    assert all(outcomes[i] == undisturbed[i] for i in requests_)


def test_results_a_trainer_holds_survive_the_ingress_replica(app):
    undisturbed = [_sample_bits(app.handle.generate.remote(request_body(i, samples=4)).result().batch().samples) for i in (1, 2)]
    results = [app.handle.generate.remote(request_body(i, samples=4)).result() for i in (1, 2)]
    (ingress_pid,) = pids(app.name, "RolloutIngress")

    def ingress_dead() -> bool:  # as Ray sees it: the references the ingress owned are gone with it
        return all(actor.pid != ingress_pid for actor in list_actors(filters=[("state", "=", "ALIVE")]))

    assert not ingress_dead()
    os.kill(ingress_pid, signal.SIGKILL)
    wait_until(ingress_dead, "Ray seeing the ingress dead", poll_s=0.2)
    assert [_sample_bits(r.batch(timeout_s=120).samples) for r in results] == undisturbed


def test_a_request_past_its_deadline_is_dropped_and_answered_504(app, http):
    response = http.post(f"{app.url}/rollout/generate", json={**request_body(5), "rollout_timeout_s": 0.001})
    assert response.status_code == 504 and response.json()["error"]["field"] == "rollout_timeout_s"
    # Through the handle, the worker drops the expired work before sampling it.
    with pytest.raises(DeadlineExceededError, match="deadline passed"):
        app.handle.generate.remote({**request_body(5), "rollout_timeout_s": 0.001}).result().batch()
    assert http.post(f"{app.url}/rollout/generate", json={**request_body(5), "rollout_timeout_s": 60}).status_code == 200


@pytest.fixture(scope="module")
def small_queue(serve_app):
    app = deploy_ingress(serve_app, "overload-test", max_queued_cost=8 * SAMPLE_COST)
    yield app
    serve.delete(app.name)


def test_beyond_its_queue_the_server_sheds_load_and_recovers(small_queue):
    app = small_queue
    answers: list[requests.Response] = []
    health: list[int] = []
    stop = threading.Event()

    def client(i):
        answers.append(requests.post(f"{app.url}/rollout/generate", json={**request_body(i, samples=4), "rollout_debug_mode": False}))

    def poll_health():  # on Serve's port and on the probe port
        with requests.Session() as session:
            while not stop.is_set():
                health.extend(session.get(f"{url}/health", timeout=30).status_code for url in (app.url, app.probe_url))
                time.sleep(0.05)

    poller = threading.Thread(target=poll_health)
    poller.start()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(24)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join(timeout=120)
    stop.set()
    poller.join()

    served = [a for a in answers if a.status_code == 200]
    shed = [a for a in answers if a.status_code == 503]
    assert len(served) + len(shed) == 24 and served and shed
    assert all(a.headers.get("retry-after") == "1" for a in shed)
    # Refused by admission, before any sampling (how soon is measured by benchmarks.reliability).
    assert all("OverloadedError" not in a.text and "max_queued_cost" in a.text for a in shed)
    assert health and set(health) == {200}
    # Service recovers once the burst is over, and the ingress stops counting what it answered.
    again = requests.post(f"{app.url}/rollout/generate", json={**request_body(99, samples=4), "rollout_debug_mode": False})
    assert again.status_code == 200 and request_cost_of(again) == 4 * SAMPLE_COST
    wait_until(lambda: nothing_in_flight(app), "the ingress counting nothing in flight", poll_s=0.05)


def request_cost_of(response: requests.Response) -> int:
    return from_msgpack(response.content)[0]["request_cost"]


def nothing_in_flight(app) -> bool:
    return requests.get(f"{app.url}/rollout/info").json()["cost_in_flight"] == 0


def test_beyond_its_queue_the_handle_raises_a_typed_error(small_queue):
    wait_until(lambda: nothing_in_flight(small_queue), "the ingress counting nothing in flight", poll_s=0.05)
    body = {**request_body(1, samples=8), "num_inference_steps": 50}  # long enough to still be queued
    responses = [small_queue.handle.generate.remote({**body, "seed": seed}) for seed in (1, 2)]
    outcomes = []
    for response in responses:
        try:
            outcomes.append(len(response.result().batch().samples))
        except OverloadedError as error:
            outcomes.append(error)
    refused = [o for o in outcomes if isinstance(o, OverloadedError)]
    assert len(refused) == 1 and 8 in outcomes, outcomes
    assert "max_queued_cost" in str(refused[0]) and refused[0].retry_after_s == 1
    # Sent again as the error says, it is served: the first request's cost stops counting once the
    # ingress has seen its worker answer, which can come a moment after the trainer fetched them.
    for attempt in range(5):
        try:
            assert len(small_queue.handle.generate.remote(body).result().batch().samples) == 8
            break
        except OverloadedError as error:
            assert attempt < 4, error
            time.sleep(error.retry_after_s)
    wait_until(lambda: nothing_in_flight(small_queue), "the ingress counting nothing in flight", poll_s=0.05)


@ray.remote(num_cpus=0)
class _Doomed:
    def ping(self) -> int:
        return 1


def test_a_part_lost_on_every_try_is_a_retryable_error(ray_cluster):
    doomed = _Doomed.remote()
    ray.kill(doomed)
    resent = []

    class DeadWorkers:  # stands in for the worker deployment: every part sent is lost
        async def send(self, work):
            resent.append(work)
            return doomed.ping.remote()

    parts = (doomed.ping.remote(),)
    result = RolloutResult("r", 0, 1, ("work",), parts, DeadWorkers(), max_attempts=3, request_cost=RequestCost(1))
    with pytest.raises(WorkerLostError, match="lost 3 times") as caught:
        result.fetch()
    assert resent == ["work", "work"] and caught.value.retry_after_s == 1
