"""Discovery: `/rollout/info` (and the handle's `info`), and SGLang's `/model_info`,
`/server_info` and `/v1/models`.

SGLang's fields are those its diffusion HTTP server returns (its `http_server.py` and
`openai/common_api.py`), which its model gateway and trainers read, filled from a worker's
`info()` and the application's config.

Needs from the ingress: `config`, `worker` (the worker deployment's handle), `coordinator`,
`dispatcher` (the cost facts it keeps) and `started` (when the ingress started, in seconds since
the epoch).
"""

import dataclasses
import importlib.metadata

from deployments.config import RolloutAppConfig
from deployments.routes import route

TASK_TYPE = "T2I"  # SGLang's name for text-to-image, the task of every model served here
SERVER_VERSION = importlib.metadata.version("diffusion-rollout")


class DiscoveryRoutes:
    _worker_info: dict | None = None  # the model's description, read from a worker once

    async def info(self) -> dict:
        """Handle API: the model, its scheduler, defaults and image size limits, the configured limits
        (a request's cost and the queue's among them, with the facts requests are costed by, and
        the cost this ingress has in flight), the
        weights served and the scorers a request may name (`rollout_reward_models`)."""
        if self._worker_info is None:
            self._worker_info = await self.worker.info.remote()
        cost_facts = await self.dispatcher.cost_facts()
        weights = await self.coordinator.state.remote()
        configured = self.config.limits.max_image_size
        model_max = self._worker_info["image_size_limits"]["max_size"]
        return {
            **self._worker_info,
            "weight_version": weights["weight_version"],
            "replica_weight_versions": weights["replicas"],
            "limits": self.config.limits.model_dump(),
            # What a request may ask for: the smaller of the configured limit and the model's own.
            "max_image_size": configured if model_max is None else min(configured, model_max),
            "max_batch_size": self.config.max_batch_size,
            "max_queued_cost": self.config.queued_cost_limit(cost_facts),  # in token-steps, as limits.max_request_cost
            "cost_in_flight": sum(self.dispatcher.cost_in_flight.values()),  # of this ingress replica's budget, now
            "cost_facts": dataclasses.asdict(cost_facts),
            "scorers": {name: scorer.kind for name, scorer in self.config.scorers.items()},
        }

    @route("GET", "/rollout/info")
    async def http_info(self) -> dict:
        return await self.info()

    @route("GET", "/model_info")
    async def model_info(self) -> dict:
        return model_info_body(await self.info())

    @route("GET", "/server_info")
    async def server_info(self) -> dict:
        return server_info_body(await self.info(), self.config)

    @route("GET", "/v1/models")
    async def models(self) -> dict:
        return model_list_body(await self.info(), self.config, self.started)


def served_model_name(config: RolloutAppConfig) -> str:
    return config.served_model_name or config.model.label()


def model_info_body(info: dict) -> dict:
    return {
        "model_path": info["model_path"],
        "is_generation": True,
        "model_type": "diffusion",
        "architectures": [info["pipeline_class"]],
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "task_type": TASK_TYPE,
        "supported_task_types": [TASK_TYPE],
        "output_types": ["IMAGE"],
        "is_image_gen": True,
        "weight_version": info["weight_version"],
    }


def server_info_body(info: dict, config: RolloutAppConfig) -> dict:
    return {
        "model_path": info["model_path"],
        "served_model_name": served_model_name(config),
        "tp_size": 1,
        "dp_size": config.num_worker_replicas,  # each worker replica is a data-parallel copy
        "version": SERVER_VERSION,
    }


def model_list_body(info: dict, config: RolloutAppConfig, created: int) -> dict:
    """OpenAI's model list with SGLang's diffusion fields, for one served model."""
    name = served_model_name(config)
    card = {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "diffusion-rollout",
        "root": name,
        "parent": None,
        "max_model_len": None,
        "num_gpus": config.num_worker_replicas if info["device"].startswith("cuda") else 0,
        "task_type": TASK_TYPE,
        "supported_task_types": [TASK_TYPE],
        "dit_precision": info["dtype"],
        "vae_precision": info["dtype"],
        "pipeline_name": info["model"],
        "pipeline_class": info["pipeline_class"],
    }
    return {"object": "list", "data": [card]}
