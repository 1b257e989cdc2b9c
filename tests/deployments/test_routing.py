"""`FewestSamplesRouter`'s accounting, driven as Serve's router drives it, without a cluster."""

import asyncio
from types import SimpleNamespace

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    RequestMetadata,
)
from ray.serve.request_router import PendingRequest, ReplicaID

from deployments.routing import FewestSamplesRouter
from rollout.options import SamplingOptions
from deployments.work import SamplingWork

WORKER = DeploymentID(name="RolloutWorker", app_name="rollout")


@pytest.fixture(autouse=True)
def event_loop():
    """Serve builds routers and pending requests on a running process's event loop."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    asyncio.set_event_loop(None)
    loop.close()


def _choose(router, replicas, request) -> ReplicaID:
    """Serve offers the request to the first replica of the ranking."""
    ranking = asyncio.get_event_loop().run_until_complete(router.choose_replicas(replicas, request))
    return ranking[0][0].replica_id


def _replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(unique_id=name, deployment_id=WORKER))


def _request(samples: int, request_id: str) -> PendingRequest:
    work = SamplingWork(("3",) * samples, ("",) * samples, tuple(range(samples)), SamplingOptions())
    return PendingRequest(args=[work], kwargs={}, metadata=RequestMetadata(request_id, request_id))


def _router() -> FewestSamplesRouter:
    router = FewestSamplesRouter(WORKER, DeploymentHandleSource.REPLICA)
    router.initialize_state()
    return router


def _route(router, replicas, request) -> ReplicaID:
    """Chooses as Serve does, then reports the replica's acceptance."""
    chosen = _choose(router, replicas, request)
    router.on_request_routed(request, chosen, result=None)
    return chosen


def test_a_burst_of_one_sample_requests_is_split_evenly():
    router, replicas = _router(), [_replica("a"), _replica("b")]
    chosen = [_route(router, replicas, _request(1, f"r{i}")) for i in range(16)]
    assert sorted(chosen.count(r.replica_id) for r in replicas) == [8, 8]


def test_requests_offered_before_any_is_accepted_are_still_spread():
    """Serve routes a burst concurrently: each choice must see the samples offered before it."""
    router, replicas = _router(), [_replica("a"), _replica("b")]
    requests = [_request(1, f"r{i}") for i in range(8)]
    offered = [_choose(router, replicas, r) for r in requests]
    assert sorted(offered.count(r.replica_id) for r in replicas) == [4, 4]


def test_samples_are_weighed_not_requests_and_completions_free_them():
    router, replicas = _router(), [_replica("a"), _replica("b")]
    big = _route(router, replicas, _request(12, "big"))
    small = [_route(router, replicas, _request(1, f"s{i}")) for i in range(12)]
    assert all(choice != big for choice in small)
    router.on_request_completed(big, "big")
    assert _route(router, replicas, _request(1, "next")) == big


def test_chunks_of_one_request_share_its_id_and_each_completion_counts_once():
    router, replicas = _router(), [_replica("a"), _replica("b")]
    first, second = _route(router, replicas, _request(4, "req")), _route(router, replicas, _request(4, "req"))
    assert first != second
    router.on_request_completed(first, "req")
    router.on_request_completed(first, "req")  # a duplicate report frees nothing more
    assert _route(router, replicas, _request(1, "next")) == first


def test_a_dead_replica_is_forgotten():
    router, replicas = _router(), [_replica("a"), _replica("b")]
    _route(router, replicas, _request(8, "x"))
    router.on_replica_actor_died(replicas[0].replica_id)
    router.on_replica_actor_died(replicas[1].replica_id)
    assert router._outstanding == {} and router._sent == {} and router._reserved == {}


def test_a_replica_found_for_a_request_goes_to_that_request():
    """Serve's routing task hands the replica it found to a pending request: to the one it was
    chosen (and reserved) for, not to the oldest; to the oldest only when that one is gone."""
    router, replica = _router(), _replica("a")
    older, chosen_for = _request(1, "older"), _request(1, "chosen-for")
    for request in (older, chosen_for):
        router._pending_requests_to_fulfill.append(request)
        router._add_pending_request_to_indices(request)
    router._fulfill_next_pending_request(replica, chosen_for.metadata)
    assert chosen_for.future.result() is replica and not older.future.done()
    router._fulfill_next_pending_request(replica, _request(1, "cancelled").metadata)
    assert older.future.result() is replica
