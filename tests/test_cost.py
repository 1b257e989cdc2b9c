"""What a request costs (`rollout.cost`): in token-steps before it is sampled, by the model's facts
(tests/test_real_families.py and tests/test_video_families.py hold them to the rows and tokens
each family's transformer runs); and what it cost the transformer, its rows against the documented
per-node formula and against what the sampler computed, the unbranched figure, and the
attribution of calls shared by several requests' work."""

from dataclasses import replace

import pytest

from rollout.cost import CostFacts, RequestCost, TransformerCost, transformer_cost
from rollout.kernels import BatchInvariance
from rollout.micro_batching import MicroBatching
from rollout.models.base import ConditionImageRule, NegativeBranchRule
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import micro_batch_size, resolve_options, sample_tree
from rollout.tree import Branching, TreeRoot

STEPS = 6
OPTIONS = SamplingOptions(num_inference_steps=STEPS)
TWO_LEVELS = Branching(steps=(2, 4), factors=(3, 2))  # 6 leaves a root


@pytest.fixture(scope="module")
def kernels_pipeline():
    return load_pipeline(micro_batching=MicroBatching(8, invariance="kernels"))


def steps_and_nodes_by_depth(branching: Branching, num_steps: int) -> list[tuple[int, int]]:
    """`rollout.tree`'s cost, node by node: a root runs steps 0 .. s_1, a child created at s_d runs
    s_d + 1 .. s_{d+1} (the last ones up to T - 1). (steps each node runs, nodes) per depth."""
    starts = [0, *(step + 1 for step in branching.steps)]
    ends = [*branching.steps, num_steps - 1]
    nodes = [1]
    for factor in branching.factors:
        nodes.append(nodes[-1] * factor)
    return [(end - start + 1, count) for start, end, count in zip(starts, ends, nodes)]


def padded(pipeline, rows: int, options=OPTIONS) -> int:
    """Whole calls of the request's samples a call under padding; the rows there are under the kernels."""
    if pipeline.micro_batching.invariance is BatchInvariance.KERNELS:
        return rows
    size = micro_batch_size(pipeline, resolve_options(pipeline, options))
    return -(-rows // size) * size


def test_a_trees_rows_are_the_per_node_formula_and_fewer_than_unbranched(kernels_pipeline):
    roots = [TreeRoot("1", "", 0, TWO_LEVELS), TreeRoot("2", "", 6, TWO_LEVELS)]
    cost = transformer_cost(kernels_pipeline, roots, OPTIONS)
    # 3 + 3 x 2 + 6 x 1 = 15 rows a root under the kernels (nothing padded), against 6 leaves x 6 steps.
    assert steps_and_nodes_by_depth(TWO_LEVELS, STEPS) == [(3, 1), (2, 3), (1, 6)]
    assert cost == TransformerCost(2 * 15, 2 * 6 * STEPS)
    one_branch = Branching(steps=(4,), factors=(16,))  # rollout/tree.py's example: 85 rows instead of 160
    options = SamplingOptions(num_inference_steps=10, sde_step_indices=(4, 5))
    assert transformer_cost(kernels_pipeline, [TreeRoot("1", "", 0, one_branch)], options) == TransformerCost(85, 160)


def test_with_padding_each_depths_rows_are_whole_calls(random_pipeline):
    roots = [TreeRoot("1", "", 0, TWO_LEVELS), TreeRoot("2", "", 6, TWO_LEVELS)]
    cost = transformer_cost(random_pipeline, roots, OPTIONS)
    expected = sum(steps * padded(random_pipeline, 2 * nodes) for steps, nodes in steps_and_nodes_by_depth(TWO_LEVELS, STEPS))
    assert cost.transformer_rows == expected
    assert cost.transformer_rows_unbranched == STEPS * padded(random_pipeline, 12)
    assert cost.transformer_rows < cost.transformer_rows_unbranched


@pytest.mark.parametrize("samples", [1, 3, 4, 8])
def test_unbranched_samples_cost_their_unbranched_figure(random_pipeline, kernels_pipeline, samples):
    roots = [TreeRoot(str(i), "", 10 + i) for i in range(samples)]
    for pipeline in (kernels_pipeline, random_pipeline):
        cost = transformer_cost(pipeline, roots, OPTIONS)
        assert cost.transformer_rows == cost.transformer_rows_unbranched == STEPS * padded(pipeline, samples)
    # Without padding (the kernels, or whole calls): the steps times the samples.
    assert transformer_cost(kernels_pipeline, roots, OPTIONS).transformer_rows == STEPS * samples


CALLS = {
    "one tree": [TreeRoot("1", "", 0, TWO_LEVELS)],
    "two trees": [TreeRoot("1", "", 0, TWO_LEVELS), TreeRoot("2", "", 6, TWO_LEVELS)],
    "unbranched": [TreeRoot(str(i), "", i) for i in range(5)],
    "trees of two branchings and a plain sample": [
        TreeRoot("4", "", 10, TWO_LEVELS),
        TreeRoot("9", "", 30),
        TreeRoot("4", "", 50, Branching((3,), (2,))),
    ],
    "a branch at step 0": [TreeRoot("5", "", 0, Branching((0,), (4,)))],
    "one leaf grown alone": [TreeRoot("1", "", 0, TWO_LEVELS, paths=((2, 1),))],
    "some leaves of a root": [TreeRoot("1", "", 0, TWO_LEVELS, paths=((0, 1), (2, 0), (2, 1)))],
}


@pytest.mark.parametrize("name", sorted(CALLS))
@pytest.mark.parametrize("invariance", ["padding", "kernels"])
def test_roots_sampled_alone_cost_what_the_sampler_computed(random_pipeline, kernels_pipeline, name, invariance):
    pipeline = random_pipeline if invariance == "padding" else kernels_pipeline
    roots = CALLS[name]
    options = SamplingOptions(num_inference_steps=STEPS, sde_step_indices=None, return_step_indices=())
    assert transformer_cost(pipeline, roots, options).transformer_rows == sample_tree(pipeline, roots, options).transformer_rows


def test_work_sharing_a_call_is_charged_its_own_rows_and_the_call_computes_no_more(random_pipeline, kernels_pipeline):
    """Two requests' parts in one call: each is charged its rows as if alone, whatever it met."""
    tree, plain = [TreeRoot("1", "", 0, TWO_LEVELS)], [TreeRoot("5", "", 40), TreeRoot("6", "", 41)]
    for pipeline in (kernels_pipeline, random_pipeline):
        parts = [transformer_cost(pipeline, roots, OPTIONS) for roots in (tree, plain)]
        call = sample_tree(pipeline, [*tree, *plain], OPTIONS).transformer_rows
        if pipeline is kernels_pipeline:  # nothing padded: the call's rows are the parts' own, summed
            assert call == TransformerCost.total(parts).transformer_rows == 15 + 2 * STEPS
        else:  # the parts share the call's padding
            assert call < TransformerCost.total(parts).transformer_rows


def test_costs_add_up():
    assert TransformerCost(3, 4) + TransformerCost(5, 6) == TransformerCost(8, 10)
    assert TransformerCost.total([]) == TransformerCost(0, 0)
    assert TransformerCost.total([TransformerCost(1, 2)] * 3) == TransformerCost(3, 6)


def test_a_requests_token_steps_count_tokens_branches_steps_a_trees_nodes_and_the_decode(embedded_pipeline):
    facts = CostFacts.of(embedded_pipeline)
    assert facts == CostFacts(
        16, 16, 1, 2.0, 2, 1, NegativeBranchRule("cfg_scale", also_below_one=True), ConditionImageRule(),
        embedded_pipeline.image_size_limits, "embedded-digits",
    )  # fmt: skip
    plain = [TreeRoot(str(i), "", i) for i in range(3)]
    # 64 tokens (16x16 pixels, 2 a side of a token) x 2 branches (the default guidance, 2.0) x the
    # steps, and the decode: 64 a sample.
    assert facts.request_cost(plain, OPTIONS) == RequestCost(3 * (64 * 2 * STEPS + 64))
    unguided = replace(OPTIONS, guidance_scale=1.0)
    assert facts.request_cost(plain, unguided) == RequestCost(3 * (64 * STEPS + 64))
    # A tree: its live nodes at each step (3 + 3 x 2 + 6 x 1 = 15 rows), its 6 leaves decoded.
    assert facts.request_cost([TreeRoot("1", "", 0, TWO_LEVELS)], unguided) == RequestCost(15 * 64 + 6 * 64)
    assert facts.sample_cost(20) == RequestCost(64 * 2 * 20 + 64)  # the unit of the app's default queue budget


def test_a_videos_tokens_are_its_latent_frames_token_grid():
    wan = CostFacts(480, 832, 81, 5.0, 16, 4, NegativeBranchRule("guidance_scale"))  # Wan2.1's published VAE and patch
    assert wan.tokens_per_sample(480, 832, 81) == 21 * 30 * 52 == 32_760  # rollout/models/wan.py's figure


@pytest.mark.parametrize(
    "rule,options,runs",
    [
        (NegativeBranchRule("cfg_scale"), {"guidance_scale": 7.0}, True),  # SD3
        (NegativeBranchRule("cfg_scale"), {"guidance_scale": 7.0, "true_cfg_scale": 1.0}, False),
        (NegativeBranchRule("cfg_scale"), {"guidance_scale": 1.0}, False),
        (NegativeBranchRule("true_cfg_scale"), {"guidance_scale": 3.5}, False),  # FLUX.1, Qwen-Image
        (NegativeBranchRule("true_cfg_scale"), {"guidance_scale": 3.5, "true_cfg_scale": 4.0}, True),
        (NegativeBranchRule("guidance_scale"), {"guidance_scale": 5.0, "true_cfg_scale": 1.0}, True),  # Wan, LTX-Video
        (NegativeBranchRule("cfg_scale", also_below_one=True), {"guidance_scale": 0.5}, True),  # the embedded model
        (NegativeBranchRule("cfg_scale", also_below_one=True), {"guidance_scale": 1.0}, False),
    ],
)
def test_the_negative_branch_runs_by_the_familys_rule(rule, options, runs):
    assert rule.runs(SamplingOptions(**options)) is runs
