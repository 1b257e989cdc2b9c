"""The records of `rollout.testing.families`, which every parametrised test, benchmark and the GPU
check iterate over: a family the registry serves without a record would go untested."""

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


def test_each_model_has_one_record_for_the_property_tests_and_at_most_one_for_the_gpu_check():
    drawn = [record.model for record in TINY_FAMILIES.values() if record.requests is not None]
    assert sorted(drawn) == available_models()
    checked = [record.model for record in TINY_FAMILIES.values() if record.gpu_check is not None]
    assert len(checked) == len(set(checked))


def test_each_image_family_says_what_its_transformer_takes():
    """`tests/test_real_families.py` holds each image family's denoising env and time input to its record."""
    assert all(TINY_FAMILIES[name].inputs is not None for name in IMAGE_FAMILIES)
