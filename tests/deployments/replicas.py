"""Reaching inside an application's replicas (to find a replica's process, to hold or break its
pipeline): what the fault tests share."""

import os
import threading
from contextlib import contextmanager

import ray
from ray import serve

STEPS = 6


def on_replicas(app_name: str, deployment: str, fn) -> list:
    """`fn(servable)` run in each of a deployment's live replicas, on its instance of the
    deployment's class (how these tests reach inside a replica: to find its process, to break it)."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    replicas = [ray.get_actor(n, namespace="serve") for n in names if f"::{app_name}#{deployment}#" in n]
    return ray.get([replica.__ray_call__.remote(lambda _: fn(serve.get_replica_context().servable_object)) for replica in replicas])


@contextmanager
def held_samplers(app_name: str, hold_s: float = 60.0):
    """Within the block, the worker replicas' sampler calls wait at their first model call (at most
    `hold_s`): a test sees how work is placed before any of it completes and frees its replica."""

    def hold(worker):
        gate, velocity = threading.Event(), worker.pipeline.predict_velocity

        def held_velocity(*args, **kwargs):
            gate.wait(hold_s)
            return velocity(*args, **kwargs)

        held_velocity.gate = gate
        worker.pipeline.predict_velocity = held_velocity

    def release(worker):
        vars(worker.pipeline).pop("predict_velocity").gate.set()

    on_replicas(app_name, "RolloutWorker", hold)
    try:
        yield
    finally:
        on_replicas(app_name, "RolloutWorker", release)


def pids(app_name: str, deployment: str) -> list[int]:
    return on_replicas(app_name, deployment, lambda _: os.getpid())


def request_body(i: int, samples: int = 2) -> dict:
    return {"prompt": str(i % 10), "num_outputs_per_prompt": samples, "num_inference_steps": STEPS, "seed": 100 * i}


