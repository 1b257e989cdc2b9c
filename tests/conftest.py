import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from rollout.models.digits import DigitFlowPipeline, DigitPromptEncoder, tiny_transformer

SCHEDULER_CONFIG = {"shift": 3.0}


@pytest.fixture(scope="session")
def random_pipeline() -> DigitFlowPipeline:
    """An untrained pipeline of the embedded architecture: fast, and its outputs are arbitrary
    enough that any mix-up between samples or steps shows."""
    torch.manual_seed(0)
    encoder = DigitPromptEncoder()
    transformer = tiny_transformer(encoder)
    return DigitFlowPipeline(
        transformer, encoder, FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), micro_batch_size=4
    )


@pytest.fixture(scope="session")
def embedded_pipeline() -> DigitFlowPipeline:
    return DigitFlowPipeline.from_pretrained()
