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
    """Name -> the tiny random-weight copy of each real image family (`rollout.testing.families`),
    saved as a diffusers directory."""
    from rollout.testing.families import IMAGE_FAMILIES  # imports the families: only for the tests that need them

    return _build(tmp_path_factory.mktemp("families"), IMAGE_FAMILIES)


@pytest.fixture(scope="session")
def tiny_conditioned_dirs(tmp_path_factory) -> dict:
    """Name -> the tiny random-weight copy of each image-conditioned family (`rollout.testing.families`),
    saved as a diffusers directory."""
    from rollout.testing.families import CONDITIONED_FAMILIES

    return _build(tmp_path_factory.mktemp("conditioned_families"), CONDITIONED_FAMILIES)


@pytest.fixture(scope="session")
def tiny_video_dirs(tmp_path_factory) -> dict:
    """Name -> the tiny random-weight copy of each video family or layout (`rollout.testing.families`),
    saved as a diffusers directory."""
    from rollout.testing.families import VIDEO_FAMILIES

    return _build(tmp_path_factory.mktemp("video_families"), VIDEO_FAMILIES)


def _build(root, names: list[str]) -> dict:
    from rollout.testing.families import TINY_FAMILIES

    return {name: TINY_FAMILIES[name].build(root / name) for name in names}


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
