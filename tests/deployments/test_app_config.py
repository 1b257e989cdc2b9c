"""The app builder and the Serve config files validate through one path."""

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app
from deployments.config import ModelConfig, RolloutAppConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "deployments").glob("serve_config*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_serve_config_files_are_valid(path):
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (application,) = config.applications
    assert application.import_path == "deployments.app:build_app"
    RolloutAppConfig.model_validate(application.args)


def test_build_app_takes_no_arguments_or_a_dict():
    assert build_app() is not None
    assert build_app({"num_worker_replicas": 1, "limits": {"max_inference_steps": 10}}) is not None


def test_bad_config_names_the_field():
    with pytest.raises(ValidationError, match="num_worker_replicas"):
        RolloutAppConfig.model_validate({"num_worker_replicas": 0})
    with pytest.raises(ValidationError, match="unknown_option"):
        RolloutAppConfig.model_validate({"unknown_option": 1})


@pytest.mark.parametrize(
    "model, default, by_size",
    [
        ({}, 8, {}),
        ({"micro_batch_size": 4}, 4, {}),
        # Sizes not listed keep the model's own micro-batch, not the largest listed one.
        ({"micro_batch_sizes": {"1024x1024": 2, "512x512": 16}}, 8, {(1024, 1024): 2, (512, 512): 16}),
        ({"micro_batch_size": 4, "micro_batch_sizes": {"1024x1024": 2}}, 4, {(1024, 1024): 2}),
    ],
)
def test_micro_batches_by_size_fall_back_to_the_configured_else_the_models_default(model, default, by_size):
    micro_batching = ModelConfig.model_validate(model).micro_batching(model_default=8)
    assert micro_batching.default == default and dict(micro_batching.by_size) == by_size
