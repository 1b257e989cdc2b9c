"""Bodies of SGLang's discovery endpoints (`/model_info`, `/server_info`, `/v1/models`).

The fields are those SGLang's diffusion HTTP server returns (its `http_server.py` and
`openai/common_api.py`), which its model gateway and trainers read, filled from a worker's
`info()` and the application's config.
"""

from __future__ import annotations

import importlib.metadata

from deployments.config import RolloutAppConfig

TASK_TYPE = "T2I"  # SGLang's name for text-to-image, the task of every model served here
SERVER_VERSION = importlib.metadata.version("diffusion-rollout")


def served_model_name(config: RolloutAppConfig) -> str:
    return config.served_model_name or config.model.label()


def model_info(info: dict) -> dict:
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


def server_info(info: dict, config: RolloutAppConfig) -> dict:
    return {
        "model_path": info["model_path"],
        "served_model_name": served_model_name(config),
        "tp_size": 1,
        "dp_size": config.num_worker_replicas,  # each worker replica is a data-parallel copy
        "version": SERVER_VERSION,
    }


def model_list(info: dict, config: RolloutAppConfig, created: int) -> dict:
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
