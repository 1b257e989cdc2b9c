"""The records of `rollout.testing.families`, which every parametrised test, benchmark and the GPU
check iterate over: a family the registry serves without a record would go untested."""

import pytest
import torch

from rollout.models.registry import available_models
from rollout.testing import builders, published
from rollout.testing.families import IMAGE_FAMILIES, TINY_FAMILIES


def test_every_model_the_registry_serves_has_a_record():
    assert {record.model for record in TINY_FAMILIES.values()} == set(available_models())


def test_each_record_names_a_builder_that_exists():
    for record in TINY_FAMILIES.values():
        assert record.embedded or callable(getattr(builders, record.builder, None)), record.name
        if record.gpu_check is not None:
            assert callable(getattr(published, record.gpu_check.published, None)), record.name


def test_each_model_has_a_record_for_the_property_tests_and_at_most_one_for_the_gpu_check():
    drawn = {record.model for record in TINY_FAMILIES.values() if record.requests is not None}
    assert sorted(drawn) == available_models()
    checked = [record.model for record in TINY_FAMILIES.values() if record.gpu_check is not None]
    assert len(checked) == len(set(checked))


def test_each_image_family_says_what_its_transformer_takes():
    """`tests/test_real_families.py` holds each image family's denoising env and time input to its record."""
    assert all(TINY_FAMILIES[name].inputs is not None for name in IMAGE_FAMILIES)


@pytest.mark.parametrize("name", [name for name, record in TINY_FAMILIES.items() if record.gpu_check])
def test_each_published_model_the_gpu_check_builds_is_made_of_real_components(tiny_family_dirs, tiny_conditioned_dirs, name):
    """Built on the meta device (shapes, no memory, no time): the published configurations construct,
    and the GPU check's family takes the pipeline, before any GPU is lent."""
    record = TINY_FAMILIES[name]
    if record.video:
        pytest.skip("the video family's published model is Wan2.1's, checked by tests/test_gpu_check_script.py")
    directory = (tiny_conditioned_dirs if record.condition_images else tiny_family_dirs)[name]
    tiny = record.family.from_pretrained(directory)
    with torch.device("meta"):
        pipe = record.gpu_check.build(tiny.pipe)
    family = record.family(pipe)
    assert family.name == record.model and next(family.transformer.parameters()).device.type == "meta"
