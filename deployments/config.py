"""The application's configuration; `build_app` validates YAML and Python input the same way."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rollout.api import RequestLimits, RequestValidation
from rollout.models.registry import EMBEDDED_MODEL


class ModelConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(EMBEDDED_MODEL, description="Model family, as `rollout.models.registry` knows it.")
    path: str | None = Field(None, description="Local directory to load from; None takes the packaged weights.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Model weights' dtype.")


class RolloutAppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    app_name: str = Field("rollout", description="Serve application name, for `serve.get_app_handle`.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    served_model_name: str | None = Field(
        None, description="Name reported by `/v1/models` and `/server_info`; None: the model's name."
    )
    weight_version: str = Field("0", description="Name of the weights served at start; every sample reports its version.")
    allowed_weight_paths: list[str] = Field(
        default_factory=list,
        description="Directories that weight updates may read checkpoints from; empty: any local path, as SGLang.",
    )
    weight_update_timeout_s: float = Field(
        600.0, gt=0, description="How long an update waits for every replica before it is undone everywhere."
    )
    num_worker_replicas: int = Field(2, ge=1, description="Worker replicas, one pipeline each.")
    worker_num_cpus: float = Field(0.5, gt=0, description="CPUs each worker replica reserves.")
    worker_num_gpus: float | None = Field(
        None, ge=0, description="GPUs each worker replica reserves; None: 1 if the cluster has GPUs, else 0."
    )
    worker_torch_threads: int | None = Field(None, ge=1, description="torch intra-op threads per worker replica.")
    worker_max_replicas_per_node: int | None = Field(
        None, ge=1, description="Most worker replicas on one node (1 spreads them over the nodes); None: no limit."
    )
    ingress_num_cpus: float = Field(0.25, gt=0, description="CPUs the ingress replica reserves.")
    max_batch_size: int = Field(32, ge=1, description="Most samples in one sampler call on a worker.")
    # Serve forms a worker's next batch while the current one runs, so this wait, not the run,
    # is what lets concurrent requests meet (docs/benchmarks.md).
    batch_wait_timeout_s: float = Field(0.05, ge=0, description="How long a worker waits to fill a batch.")
    limits: RequestLimits = Field(default_factory=RequestLimits)
    request_validation: RequestValidation = Field(
        "strict",
        description="strict: refuse unknown request fields and mistyped values (422, naming the field). "
        "sglang: SGLang's lenient pydantic, which drops unknown fields and coerces values where it can.",
    )

    def max_ongoing_requests_per_worker(self) -> int:
        # Serve caps a replica's batch at its ongoing requests: allow a full batch of
        # one-sample requests plus as many queued behind it.
        return 2 * self.max_batch_size
