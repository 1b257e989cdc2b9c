import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never reach a model hub, even by mistake; set before imports read it

import pytest  # noqa: E402
import torch  # noqa: E402
from diffusers import FlowMatchEulerDiscreteScheduler  # noqa: E402

from rollout.models.digits import (  # noqa: E402
    DigitFlowPipeline,
    DigitPromptEncoder,
    tiny_transformer,
)

SCHEDULER_CONFIG = {"shift": 3.0}


@pytest.fixture(scope="session")
def random_pipeline() -> DigitFlowPipeline:
    """An untrained pipeline of the embedded architecture: fast, and its outputs are arbitrary
    enough that any mix-up between samples or steps shows."""
    torch.manual_seed(0)
    encoder = DigitPromptEncoder()
    transformer = tiny_transformer(encoder)
    return DigitFlowPipeline(
        transformer, encoder, FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), micro_batch_size=8
    )


@pytest.fixture(scope="session")
def embedded_pipeline() -> DigitFlowPipeline:
    return DigitFlowPipeline.from_pretrained()


@pytest.fixture(scope="session")
def tiny_family_dirs(tmp_path_factory) -> dict:
    """Family name -> a tiny random-weight copy of SD3, FLUX.1-dev or Qwen-Image, saved as a
    diffusers directory (`rollout/tiny_families.py`)."""
    from rollout.tiny_families import (
        FAMILY_BUILDERS,  # imports transformers: only for the tests that need it
    )

    root = tmp_path_factory.mktemp("families")
    return {name: build(root / name) for name, build in FAMILY_BUILDERS.items()}


@pytest.fixture(scope="session")
def tiny_video_dirs(tmp_path_factory) -> dict:
    """Layout name -> a tiny random-weight Wan2.1-T2V, Wan2.2-T2V-A14B or Wan2.2-TI2V-5B copy,
    saved as a diffusers directory (`rollout/tiny_families.py`)."""
    from rollout.tiny_families import VIDEO_BUILDERS

    root = tmp_path_factory.mktemp("video_families")
    return {name: build(root / name) for name, build in VIDEO_BUILDERS.items()}


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test. The guarantees hold at any thread count; with one, the many
    small model calls of the property tests run several times faster on this project's 2-core
    machine, where two threads wait on each other (measured: 0.5 s against 8 s a case while another
    process held a core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(items):
    """The README test first: it runs the commands of the README and the docs pages against `make
    serve` as on a reader's machine, with the only Ray cluster there is (two local clusters share
    Ray's fixed dashboard-agent port, so the second one's jobs API cannot submit, and Ray's CLI
    asks which cluster to use)."""
    items.sort(key=lambda item: item.path.name != "test_readme.py")
