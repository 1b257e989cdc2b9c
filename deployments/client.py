"""What a trainer or a job imports to use a running rollout application from Python.

    handle = running_app("rollout")            # or get_or_deploy_app("rollout", config)
    push_weights(handle, adapter_tensors, "step-1", lora_rank=4, lora_alpha=4)
"""

from __future__ import annotations

import ray
import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.app import build_app
from deployments.weights import ObjectStoreTensors, UpdateResult


class ApplicationNotFoundError(LookupError):
    """No Serve application of that name runs on the cluster this process is connected to."""


def running_app(app_name: str) -> DeploymentHandle:
    """The ingress handle of the running application `app_name`; raises `ApplicationNotFoundError`
    naming the applications that do run, and how to start this one."""
    applications = serve.status().applications
    if app_name not in applications:
        raise ApplicationNotFoundError(
            f"no Serve application {app_name!r} on this Ray cluster (running: {sorted(applications) or 'none'}); "
            f"start it with `make serve`, `serve run --name {app_name} deployments.app:build_app` or "
            "`serve deploy deployments/serve_config_gpu.yaml`, or pass its name"
        )
    return serve.get_app_handle(app_name)


def get_or_deploy_app(app_name: str, config: dict | None = None) -> DeploymentHandle:
    """The running application `app_name`, or a new one with `config` if there is none."""
    try:
        return running_app(app_name)
    except ApplicationNotFoundError:
        print(f"no application {app_name!r} is running; deploying one")
        app = build_app({**(config or {}), "app_name": app_name})
        return serve.run(app, name=app_name, route_prefix="/")  # where make serve serves it


def push_weights(
    handle: DeploymentHandle,
    named_tensors: dict[str, torch.Tensor],
    weight_version: str,
    *,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    target_modules: list[str] | None = None,
) -> UpdateResult:
    """Puts the tensors in the object store once and has every replica serve them.

    Full weights of a module, or a PEFT LoRA adapter with `lora_rank` and `lora_alpha`. Returns
    when every replica serves `weight_version`; raises `WeightUpdateError` naming the cause.
    """
    tensors = ObjectStoreTensors(ray.put({name: t.detach().cpu() for name, t in named_tensors.items()}))
    return handle.update_weights_from_tensor.remote(
        tensors,
        weight_version=weight_version,
        target_modules=target_modules,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
    ).result()
