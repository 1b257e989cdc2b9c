"""Routes sampling work to the worker replica with the fewest samples outstanding.

Serve's default router (power of two choices) balances requests, not samples, and reads queue
lengths the replicas reported a moment ago. A burst of one-sample requests (how SGLang clients
send a group) then reached two replicas split 3/13: one sampler call on one replica, two on the
other, and the burst took twice as long as the same samples sent as one request.

The ingress is the workers' only caller, so the samples it has sent and not yet seen answered
are exact: this router counts them per replica and picks the replica with the fewest, so a
burst of 16 lands 8/8, as one 16-sample request does. Serve routes a burst's requests
concurrently, and a request is only counted once its replica has accepted it, a round trip
later; so a request's samples are also reserved on the replica it is about to be offered,
and the reservation is replaced by the count when the replica accepts. Calls that carry no
samples (weight commands, `info`) count nothing.

Serve's routing task for a request may hand the replica it found to another pending request
(`FIFOMixin` gives it to the oldest). The reservation would then sit on one replica while the
request went to another, and a loaded runner split a burst 9/7; so a replica goes to the request
it was chosen for, and to the oldest only when that one is gone.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ray.serve.request_router import (
    FIFOMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from deployments import load
from deployments.ray_private import pending_request_by_id
from deployments.work import SamplingWork

# A reservation whose request was neither accepted nor cancelled by then (a replica refused it
# and Serve re-queued it under a new pending request) stops counting.
RESERVATION_TTL_S = 10.0


def _samples(request: PendingRequest) -> int:
    return sum(len(arg) for arg in request.args if isinstance(arg, SamplingWork))


@dataclass
class _Reservation:
    request: PendingRequest
    replica_id: ReplicaID
    samples: int
    made_at: float


class FewestSamplesRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        self._outstanding: dict[ReplicaID, int] = {}
        # A request's chunks share its internal request id (Serve passes the caller's on), so
        # what was sent is kept per (id, replica).
        self._sent: dict[tuple[str, ReplicaID], list[int]] = {}
        self._reserved: dict[int, _Reservation] = {}
        self.outstanding_total = 0
        load.register(self)  # the ingress's measure of queued work (`_admit`)

    def _get_pending_request_matching_metadata(self, request_metadata=None) -> PendingRequest | None:
        # FIFOMixin's hook for the request a found replica goes to (ray_private.FIFO_PENDING_REQUEST_HOOK).
        return pending_request_by_id(self, request_metadata)

    def _load(self) -> dict[ReplicaID, int]:
        now = time.monotonic()
        self._reserved = {
            key: r
            for key, r in self._reserved.items()
            if not r.request.future.cancelled() and now - r.made_at < RESERVATION_TTL_S
        }
        load = dict(self._outstanding)
        for reservation in self._reserved.values():
            load[reservation.replica_id] = load.get(reservation.replica_id, 0) + reservation.samples
        return load

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # when every replica is full
            self._reserved.pop(id(pending_request), None)
        load = self._load()
        # Ties are broken at random so that equal replicas share the work that arrives when idle.
        shuffled = random.sample(candidate_replicas, len(candidate_replicas))
        ranked = sorted(shuffled, key=lambda replica: load.get(replica.replica_id, 0))
        if pending_request is not None and ranked:
            reservation = _Reservation(pending_request, ranked[0].replica_id, _samples(pending_request), time.monotonic())
            self._reserved[id(pending_request)] = reservation
        return [[replica] for replica in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._reserved.pop(id(pending_request), None)
        samples = _samples(pending_request)
        self._outstanding[replica_id] = self._outstanding.get(replica_id, 0) + samples
        self.outstanding_total += samples
        self._sent.setdefault((pending_request.metadata.internal_request_id, replica_id), []).append(samples)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        sent = self._sent.get((internal_request_id, replica_id))
        if not sent:
            return
        samples = sent.pop()
        self._outstanding[replica_id] -= samples
        self.outstanding_total -= samples
        if not sent:
            del self._sent[(internal_request_id, replica_id)]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.outstanding_total -= self._outstanding.pop(replica_id, 0)
        self._sent = {key: sent for key, sent in self._sent.items() if key[1] != replica_id}
        self._reserved = {key: r for key, r in self._reserved.items() if r.replica_id != replica_id}
