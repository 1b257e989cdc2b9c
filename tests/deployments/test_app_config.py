"""The app builder and the Serve config files validate through one path."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.app import build_app
from deployments.config import AppConfigError, ModelConfig, RolloutAppConfig
from rollout.kernels import BatchInvariance
from rollout.models.digits import DEFAULT_WEIGHTS as EMBEDDED_WEIGHTS

REPOSITORY = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPOSITORY / "deployments").glob("serve_config*.yaml"))


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
        ({"model": {"decode_batch_sizes": {"64": 2}}}, "model.decode_batch_sizes", "keys look like '512x512', got '64'"),
        ({"model": {"decode_batch_size": 0}}, "model.decode_batch_size", "greater than or equal to 1"),
        ({"model": {"name": "flux"}}, "model.path", "loads from a local diffusers directory"),
        ({"model": {"max_sequence_length": 77}}, "model.max_sequence_length", "the embedded model has no text encoder"),
        ({"model": {"vae_tiling": True}}, "model.vae_tiling", "the embedded model has no VAE"),
        ({"model": {"batch_invariance": "fast"}}, "model.batch_invariance", "Input should be 'padding' or 'kernels'"),
        ({"model": {"calibration_sizes": ["1024"]}}, "model.calibration_sizes", "sizes look like '512x512', got '1024'"),
        ({"model": {"calibration_budget_s": -1}}, "model.calibration_budget_s", "greater than or equal to 0"),
        ({"weight_version": "first weights"}, "weight_version", "1 to 128 characters of letters, digits"),
        # An empty root would refuse every request with an image (as a server error) at its first.
        ({"allowed_image_paths": [""]}, "allowed_image_paths.0", "at least 1 character"),
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
    assert micro_batching.invariance is BatchInvariance.PADDING


def test_the_vae_decodes_in_calls_of_its_configured_size_else_the_transformers():
    model = ModelConfig.model_validate({"micro_batch_sizes": {"128x128": 16}, "decode_batch_sizes": {"128x128": 4}})
    micro_batching = model.micro_batching(model_default=8)
    assert [micro_batching.decode_size_for(128, 128), micro_batching.size_for(128, 128)] == [4, 16]
    assert micro_batching.decode_size_for(64, 64) == 8
    everywhere = ModelConfig.model_validate({"decode_batch_size": 2}).micro_batching(model_default=8)
    assert [everywhere.decode_size_for(64, 64), everywhere.size_for(64, 64)] == [2, 8]


@pytest.mark.parametrize(
    "model, sizes",
    [
        ({}, [(64, 64)]),
        ({"calibration_sizes": ["1024x1024", "64x64"]}, [(64, 64), (1024, 1024)]),
        # A size the configuration gives is not measured; a size for every size, or no budget: none is.
        ({"calibration_sizes": ["1024x1024"], "micro_batch_sizes": {"64x64": 2}}, [(1024, 1024)]),
        ({"calibration_sizes": ["1024x1024"], "micro_batch_size": 2}, []),
        ({"calibration_sizes": ["1024x1024"], "calibration_budget_s": 0}, []),
    ],
)
def test_a_replica_calibrates_the_sizes_it_serves_that_the_configuration_leaves_out(model, sizes):
    assert ModelConfig.model_validate(model).sizes_to_calibrate((64, 64)) == sizes


def test_the_configured_batch_invariance_reaches_the_micro_batching():
    model = ModelConfig.model_validate({"batch_invariance": "kernels"})
    assert model.micro_batching(model_default=8).invariance is BatchInvariance.KERNELS


def _diffusers_dir(root: Path, class_name: str = "StableDiffusion3Pipeline", **components) -> Path:
    """A directory that passes the checks that read no weights: model_index.json and no components."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": class_name, **components}))
    return root


def test_dotted_keys_set_nested_fields_as_serve_run_passes_them(tmp_path):
    model_dir = _diffusers_dir(tmp_path / "sd3")
    args = {
        "model.path": str(model_dir),
        "model.dtype": "bfloat16",
        "limits.max_inference_steps": "30",
        "num_worker_replicas": "1",
    }
    config = RolloutAppConfig.parse(args)
    assert (config.model.path, config.model.dtype) == (str(model_dir), "bfloat16")
    assert (config.limits.max_inference_steps, config.num_worker_replicas) == (30, 1)
    assert config.model.label() == "sd3"


def test_dotted_keys_merge_into_a_parent_given_whole_and_leave_it_unchanged(tmp_path):
    model = {"dtype": "float16"}
    config = RolloutAppConfig.parse({"model": model, "model.path": str(_diffusers_dir(tmp_path / "m"))})
    assert config.model.dtype == "float16" and config.model.path is not None
    assert model == {"dtype": "float16"}


@pytest.mark.parametrize(
    "args, field, reason",
    [
        ({"model.pth": "/x"}, "model.pth", "Extra inputs are not permitted"),
        ({"no_such.field": "1"}, "no_such", "Extra inputs are not permitted"),
        ({"model": {"path": "/a"}, "model.path": "/b"}, "model.path", "set twice"),
        ({"num_worker_replicas": "1", "num_worker_replicas.x": "2"}, "num_worker_replicas", "set both whole and by"),
        # `make serve ARGS='model={"path":...}'`: make drops the quotes, and Serve passes strings.
        ({"model": "{path:/x}"}, "model", "set its fields by dotted keys: model.<field>=<value>"),
    ],
)
def test_a_bad_dotted_key_names_the_field(args, field, reason):
    with pytest.raises(AppConfigError) as caught:
        RolloutAppConfig.parse(args)
    assert caught.value.field == field and reason in caught.value.reason


BAD_MODELS = {
    "a path that does not exist": (
        lambda root: {"path": str(root / "missing")},
        "model.path",
        "is not a directory: it does not exist; give a local model directory",
    ),
    "a file": (lambda root: {"path": str(_diffusers_dir(root) / "model_index.json")}, "model.path", "is a file"),
    "a directory that is not a model": (
        lambda root: {"path": str(root)},
        "model.path",
        "has no model_index.json: give a diffusers pipeline directory",
    ),
    # deployments/serve_config.yaml with its `# path:` uncommented and `name` kept.
    "the embedded model's name with a diffusers path": (
        lambda root: {"name": "embedded-digits", "path": str(_diffusers_dir(root))},
        "model.name",
        "is a diffusers directory, not the embedded-digits model's: leave model.name out",
    ),
    "the embedded model's name with a directory of neither": (
        lambda root: {"name": "embedded-digits", "path": str(root)},
        "model.path",
        "has no pipeline.json",
    ),
    "a family's name with another family's directory": (
        lambda root: {"name": "flux", "path": str(_diffusers_dir(root))},
        "model.name",
        "holds a StableDiffusion3Pipeline, not the FluxPipeline of model 'flux'",
    ),
    "an unknown name": (
        lambda root: {"name": "sdxl", "path": str(_diffusers_dir(root))},
        "model.name",
        "unknown model 'sdxl'",
    ),
    "a pipeline no family serves": (
        lambda root: {"path": str(_diffusers_dir(root, "StableDiffusionXLPipeline"))},
        "model.path",
        "holds a StableDiffusionXLPipeline; this server serves",
    ),
    "a component folder missing": (
        lambda root: {"path": str(_diffusers_dir(root, transformer=["diffusers", "SD3Transformer2DModel"]))},
        "model.path",
        "lacks the component folder(s) ['transformer']",
    ),
    "the embedded model's directory without its name": (
        lambda root: {"path": str(EMBEDDED_WEIGHTS)},
        "model.name",
        "holds the embedded model: set model.name to 'embedded-digits'",
    ),
}


@pytest.mark.parametrize("model, field, reason", BAD_MODELS.values(), ids=BAD_MODELS.keys())
def test_a_model_that_cannot_load_fails_the_build_naming_the_field_and_the_fix(tmp_path, model, field, reason):
    with pytest.raises(AppConfigError) as caught:
        build_app({"model": model(tmp_path)})
    assert caught.value.field == field and reason in caught.value.reason
    assert "\n" not in str(caught.value)


def test_the_embedded_model_loads_from_a_directory_of_its_own():
    config = RolloutAppConfig.parse({"model.name": "embedded-digits", "model.path": str(EMBEDDED_WEIGHTS)})
    assert config.model.label() == "embedded-digits"


def test_a_path_only_the_worker_nodes_have_is_left_to_them():
    config = RolloutAppConfig.parse({"model.path": "/only/on/gpu/nodes", "model.check_path_at_build": "false"})
    assert config.model.path == "/only/on/gpu/nodes"


def test_the_ingress_and_the_weight_coordinator_import_no_model_libraries():
    """Their replicas import their modules and the app config. diffusers (with the transformers
    and scipy it pulls in) is the workers' alone: it took an ingress replica's imports from 5 s to
    10 s here, and 200 MB more."""
    code = "import sys, deployments.ingress, deployments.weights; print(sorted({'diffusers', 'transformers', 'scipy'} & set(sys.modules)))"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPOSITORY, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
