"""The request space served: generated valid requests (`benchmarks.properties.rollout_bodies`, the
embedded model) sent over HTTP as msgpack and as JSON and through the handle, each answer equal bit
for bit to the library's samples of the same request, which `tests/test_request_properties.py`
holds to every guarantee. The budget and Hypothesis's seed are in the test's id."""

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings

from benchmarks.properties import COPIES, LIMITS, REGRESSIONS, rollout_bodies
from rollout.micro_batching import MicroBatching
from rollout.models.choice import EMBEDDED_MODEL
from rollout.models.registry import load_pipeline
from rollout.plan import plan_rollout
from rollout.rows import schedule_of_row
from rollout.sampler import resolve_options, sample_tree
from rollout.schema import parse_request
from tests.deployments.test_http import post

SEED = 44
BUDGET = 12
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def library():
    return load_pipeline(micro_batching=MicroBatching(16))  # the served model's


def library_samples(library, body):
    plan = plan_rollout(parse_request(body), LIMITS)
    roots = plan.roots()
    return sample_tree(library, roots, resolve_options(library, plan.options)).batch


def same(a, b) -> bool:
    """Rows' values equal, tensors bit for bit, in nested maps and lists."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


# Fields that differ between two sends of one request by design.
PER_SEND = ("request_id", "inference_time_s", "peak_memory_mb")


def check_served(http, base_url, handle, library, body):
    msgpack_rows, json_rows = post(http, base_url, body), post(http, base_url, body, accept="application/json")
    batch = handle.generate.remote(body).result().batch()
    expected = library_samples(library, body)
    assert len(msgpack_rows) == len(json_rows) == len(batch.samples) == len(expected.samples)
    for row, json_row, served, leaf in zip(msgpack_rows, json_rows, batch.samples, expected.samples):
        for key in row.keys() - set(PER_SEND):
            assert same(row[key], json_row[key]), f"msgpack and JSON differ in {key}"
        assert (row["sample_seed"], tuple(row["branch_path"])) == (leaf.seed, leaf.branch_path)
        for name, tensor in leaf.tensors().items():
            assert torch.equal(served.tensors()[name], tensor), f"the handle's {name} differs from the library's"
        assert torch.equal(row["generated_output"], leaf.image)
        if body.get("rollout", True):
            assert torch.equal(row["rollout_log_probs"], leaf.log_probs)
        if row["dit_trajectory"] is not None:
            assert torch.equal(row["dit_trajectory"]["latents"], leaf.latents)
            assert schedule_of_row(row).equals(expected.schedule)
        if leaf.debug is not None:
            assert torch.equal(row["rollout_debug_tensors"]["rollout_variance_noises"], leaf.debug.variance_noises)
            assert torch.equal(row["rollout_debug_tensors"]["rollout_model_outputs"], leaf.debug.model_outputs)


@pytest.mark.parametrize("case", [c for c in REGRESSIONS if c.model == EMBEDDED_MODEL], ids=lambda c: str(c.body["rollout_branch_steps"]))
def test_every_counterexample_ever_found_is_served_as_the_library_samples_it(http, base_url, handle, library, case):
    check_served(http, base_url, handle, library, case.body)


@pytest.mark.parametrize("budget", [BUDGET], ids=[f"budget{BUDGET}-seed{SEED}"])
def test_generated_requests_are_the_same_bits_over_msgpack_json_and_the_handle(http, base_url, handle, library, budget):
    print(f"{budget} generated requests served, Hypothesis seed {SEED}")

    @seed(SEED)
    @settings(max_examples=budget, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(rollout_bodies(COPIES[EMBEDDED_MODEL].requests))
    def served_as_sampled(body):
        check_served(http, base_url, handle, library, body)

    served_as_sampled()
