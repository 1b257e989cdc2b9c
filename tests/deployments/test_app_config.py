"""The app builder and the Serve config files validate through one path."""

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app
from deployments.config import AppConfigError, ModelConfig, RolloutAppConfig

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "deployments").glob("serve_config*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_serve_config_files_are_valid(path):
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (application,) = config.applications
    assert application.import_path == "deployments.app:build_app"
    RolloutAppConfig.parse(application.args)


def test_build_app_takes_no_arguments_or_a_dict():
    assert build_app() is not None
    limits = {"max_inference_steps": 10, "default_inference_steps": 10}
    assert build_app({"num_worker_replicas": 1, "limits": limits}) is not None


@pytest.mark.parametrize(
    "args, field, reason",
    [
        ({"num_worker_replicas": 0}, "num_worker_replicas", "greater than or equal to 1, got 0"),
        ({"unknown_option": 1}, "unknown_option", "Extra inputs are not permitted"),
        # Rules across fields, which would otherwise fail every request or every worker at start:
        ({"limits": {"max_inference_steps": 10}}, "limits.default_inference_steps", "at most max_inference_steps (10), got 20"),
        ({"model": {"micro_batch_sizes": {"1024": 2}}}, "model.micro_batch_sizes", "keys look like '512x512', got '1024'"),
        ({"model": {"micro_batch_sizes": {"64x64": 0}}}, "model.micro_batch_sizes", "64x64: must be an integer >= 1"),
        ({"model": {"name": "flux"}}, "model.path", "loads from a local diffusers directory"),
        ({"model": {"max_sequence_length": 77}}, "model.max_sequence_length", "the embedded model has no text encoder"),
    ],
)
def test_a_bad_config_fails_build_app_naming_the_field(args, field, reason):
    with pytest.raises(AppConfigError) as caught:
        build_app(args)
    assert caught.value.field == field and reason in caught.value.reason


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
