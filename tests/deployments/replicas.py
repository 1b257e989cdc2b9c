"""Deploying test applications of their own, and reaching inside their replicas (to find a
replica's process, to break its pipeline): what the fault tests share."""

import os
from types import SimpleNamespace

import ray
from ray import serve

from deployments.app import build_app
from tests.deployments.conftest import TEST_CONFIG

STEPS = 6


def deploy(serve_app, name: str, **config) -> SimpleNamespace:
    handle = serve.run(build_app({**TEST_CONFIG, **config, "app_name": name}), name=name, route_prefix=f"/{name}")
    return SimpleNamespace(handle=handle, name=name, url=f"{serve_app[1]}/{name}")


def on_replicas(app_name: str, deployment: str, fn) -> list:
    """`fn(servable)` run in each of a deployment's live replicas, on its instance of the
    deployment's class (how these tests reach inside a replica: to find its process, to break it)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    replicas = [ray.get_actor(n, namespace="serve") for n in names if f"::{app_name}#{deployment}#" in n]
    return ray.get([replica.__ray_call__.remote(lambda _: fn(serve.get_replica_context().servable_object)) for replica in replicas])


def pids(app_name: str, deployment: str) -> list[int]:
    return on_replicas(app_name, deployment, lambda _: os.getpid())


def request_body(i: int, samples: int = 2) -> dict:
    return {"prompt": str(i % 10), "num_outputs_per_prompt": samples, "num_inference_steps": STEPS, "seed": 100 * i}


