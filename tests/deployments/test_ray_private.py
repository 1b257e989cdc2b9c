"""The Ray private APIs `deployments/ray_private.py` wraps are still there and shaped as it
expects: a Ray upgrade that changes one fails here, by name, before anything subtler breaks."""

import importlib.metadata
import inspect
import re
from pathlib import Path

from ray.serve.handle import DeploymentResponse
from ray.serve.request_router import FIFOMixin, RequestRouter

from deployments import ray_private
from deployments.routing import FewestSamplesRouter

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_a_handle_response_still_gives_its_object_reference_asynchronously():
    assert inspect.iscoroutinefunction(DeploymentResponse._to_object_ref)
    assert list(inspect.signature(DeploymentResponse._to_object_ref).parameters) == ["self"]


def test_the_router_can_still_look_a_pending_request_up_by_id():
    lookup = RequestRouter._get_pending_request_matching_internal_request_id
    assert list(inspect.signature(lookup).parameters) == ["self", "request_metadata"]


def test_fifo_routing_still_asks_the_hook_the_router_overrides():
    hook = ray_private.FIFO_PENDING_REQUEST_HOOK
    assert list(inspect.signature(getattr(FIFOMixin, hook)).parameters) == ["self", "request_metadata"]
    # FIFOMixin hands a found replica to the request this hook names...
    assert f"self.{hook}(" in inspect.getsource(FIFOMixin)
    # ...and the router overrides it, under that name.
    assert hook in vars(FewestSamplesRouter)


def test_ray_is_within_the_range_pyproject_pins():
    pinned = re.search(r'"ray\[serve\]>=([\d.]+),<([\d.]+)"', PYPROJECT.read_text())
    assert pinned, "pyproject.toml pins ray[serve] to a range"
    low, high = (tuple(int(part) for part in bound.split(".")) for bound in pinned.groups())
    installed = tuple(int(part) for part in importlib.metadata.version("ray").split(".")[:3])
    assert low <= installed < high, (installed, pinned.groups())


def test_the_serve_client_still_gives_the_root_url_and_each_applications_route(serve_app, app_config):
    _, base_url = serve_app
    assert ray_private.application_url(app_config["app_name"]) == base_url + "/"
    assert ray_private.application_url("no-such-application") is None


def test_the_object_store_still_says_how_many_bytes_an_object_holds_without_fetching_it(ray_cluster):
    import ray
    import torch

    @ray.remote
    def later():
        import time

        time.sleep(30)

    stored, running = ray.put(torch.zeros(2**20, dtype=torch.uint8)), later.remote()
    sizes = ray_private.object_store_bytes([stored, running, "a fake part"])
    assert 2**20 <= sizes[0] < 2**20 + 4096 and sizes[1:] == [None, None]
    ray.cancel(running, force=True)
