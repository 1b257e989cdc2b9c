"""The embedded model ships trained: it loads offline and meets the quality bar."""

import socket

import pytest

from rollout.errors import UnknownPromptError
from rollout.models.base import RolloutPipeline
from rollout.models.digit_classifier import DigitClassifier
from rollout.models.digits import (
    DEFAULT_WEIGHTS,
    UNCONDITIONAL_CLASS,
    DigitFlowPipeline,
    parse_digit_prompt,
)
from rollout.options import SamplingOptions
from training.evaluate_digit_quality import prompted_accuracy


def test_weights_ship_with_the_package_and_are_small():
    files = [p for p in DEFAULT_WEIGHTS.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    assert sum(p.stat().st_size for p in files) < 5 * 2**20


def test_loads_without_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("loading the embedded model tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    pipeline = DigitFlowPipeline.from_pretrained()
    classifier = DigitClassifier.from_pretrained()
    assert pipeline.transformer.config.in_channels == 1
    assert classifier.head.out_features == 10


def test_implements_the_pipeline_protocol(embedded_pipeline):
    assert isinstance(embedded_pipeline, RolloutPipeline)
    assert embedded_pipeline.micro_batching.default >= 1


def test_classifier_held_out_accuracy():
    from training.digits_data import load_digit_splits
    from training.train_digit_classifier import accuracy

    _, (images, labels) = load_digit_splits()
    assert accuracy(DigitClassifier.from_pretrained(), images, labels) >= 0.95


def test_ode_samples_are_the_prompted_digit(embedded_pipeline):
    accuracy, per_digit = prompted_accuracy(
        embedded_pipeline, DigitClassifier.from_pretrained(), 10, SamplingOptions(num_inference_steps=20, sde_type="ode")
    )
    assert accuracy >= 0.90, per_digit
    assert per_digit.min() >= 0.5, per_digit


@pytest.mark.parametrize(
    "prompt,digit",
    [("7", 7), ("seven", 7), ("a handwritten 7", 7), ("The digit 0", 0), ("  A  Handwritten   3 ", 3), ("", UNCONDITIONAL_CLASS)],
)
def test_prompts(prompt, digit):
    assert parse_digit_prompt(prompt) == digit


@pytest.mark.parametrize("prompt", ["a cat", "10", "7 8", "handwritten", 7, None])
def test_unknown_prompts(prompt):
    with pytest.raises(UnknownPromptError) as info:
        parse_digit_prompt(prompt)
    assert info.value.field == "prompt"
