"""Ray's private APIs this application relies on, each behind one small function here, so that a
Ray upgrade that changes one breaks in one place, and `tests/deployments/test_ray_private.py`
says which. `pyproject.toml` pins Ray to the versions the tests ran on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray
from ray.serve.handle import DeploymentResponse
from ray.serve.request_router import PendingRequest, RequestRouter


async def object_ref(response: DeploymentResponse) -> ray.ObjectRef:
    """The object reference of a handle call's result, once Serve has chosen its replica.

    Awaiting the response itself would fetch the result into this process; the ingress hands the
    reference on instead, so a worker's tensors go from the worker to whoever fetches them.
    (`DeploymentResponse._to_object_ref`, a developer API.)
    """
    return await response._to_object_ref()


def pending_request_by_id(router: RequestRouter, request_metadata: Any) -> PendingRequest | None:
    """The pending request with the internal request id of `request_metadata`, from the router's
    queue (`RequestRouter._get_pending_request_matching_internal_request_id`)."""
    return router._get_pending_request_matching_internal_request_id(request_metadata)


# `FIFOMixin` asks this method (by this name) which pending request a replica found for
# `request_metadata` goes to; `FewestSamplesRouter` overrides it.
FIFO_PENDING_REQUEST_HOOK = "_get_pending_request_matching_metadata"


def application_url(app_name: str) -> str | None:
    """The URL Serve's HTTP proxy serves `app_name` at (`http://127.0.0.1:8000/`), or None where it
    serves no HTTP or no route to it. Blocks on the controller: call it off the event loop.
    (`serve.context._get_global_client`, whose `root_url` and `get_serve_details` the dashboard uses.)
    """
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    prefix = client.get_serve_details().get("applications", {}).get(app_name, {}).get("route_prefix")
    if not client.root_url or prefix is None:
        return None
    return client.root_url.rstrip("/") + prefix


def object_store_bytes(parts: Sequence[Any]) -> list[int | None]:
    """The bytes each of `parts` holds in Ray's object store, None where it is not yet there (still
    being computed) or not an object reference (a test's fake part). Asks the objects' owner, this
    process for the parts it sent: a lookup, no fetch (`ray.experimental.get_object_locations`)."""
    from ray.experimental import get_object_locations

    refs = [part for part in parts if isinstance(part, ray.ObjectRef)]
    found = get_object_locations(refs, timeout_ms=1000) if refs else {}
    return [(found.get(part) or {}).get("object_size") if isinstance(part, ray.ObjectRef) else None for part in parts]
