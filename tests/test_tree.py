"""Tree rollouts in the library (`rollout.tree`, `rollout.sampler.sample_tree`): shared prefixes,
children that differ from their branch step on, the noise derivation, the cost, and every
guarantee of unbranched sampling."""

import dataclasses
import json
import math
import pickle
import re

import numpy as np
import pytest
import torch

from rollout.codec import encode_tensor
from rollout.errors import InvalidRequestError
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.plan import RequestLimits, checked_against_model, plan_rollout
import rollout.replay as replay_module
from rollout.replay import node_transition_log_probs, replay_log_probs
from rollout.sampler import micro_batch_size, resolve_options, sample, sample_tree
from rollout.schema import parse_request
from rollout.tree import Branching, TreeRoot
from rollout.transitions import TransitionKind
from tests.test_transitions import assert_mean_close, dance_grpo_flux_step, reference_log_prob, reference_step

STEPS = 6
OPTIONS = SamplingOptions(num_inference_steps=STEPS, debug=True)
TWO_LEVELS = Branching(steps=(2, 4), factors=(3, 2))  # 6 leaves a root


def grow(pipeline, roots, options=OPTIONS):
    return sample_tree(pipeline, roots, options)


def assert_same_leaf(a, b):
    for name, tensor in a.tensors().items():
        assert torch.equal(tensor, b.tensors()[name]), name
    assert (a.seed, a.branch_path, a.branching) == (b.seed, b.branch_path, b.branching)


def test_leaves_share_their_nodes_prefix_and_differ_from_each_branch_step_on(random_pipeline):
    roots = [TreeRoot("7", "", 100, TWO_LEVELS), TreeRoot("7", "", 106, TWO_LEVELS)]
    leaves = grow(random_pipeline, roots).batch.samples
    assert [leaf.branch_path for leaf in leaves[:6]] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [leaf.seed for leaf in leaves] == list(range(100, 112))
    first, second = leaves[:6], leaves[6:]
    for tree in (first, second):
        for leaf in tree:
            # Up to the first branch step everything is the root's: latents x_0 .. x_2, log-probs 0, 1.
            assert torch.equal(leaf.latents[:3], tree[0].latents[:3])
            assert torch.equal(leaf.log_probs[:2], tree[0].log_probs[:2])
            assert torch.equal(leaf.debug.model_outputs[:3], tree[0].debug.model_outputs[:3])  # v at step 2: once
        for a, b in ((0, 2), (0, 4), (2, 4)):  # children of the root: different from x_3 on
            assert not torch.equal(tree[a].latents[3], tree[b].latents[3])
            assert not torch.equal(tree[a].log_probs[2], tree[b].log_probs[2])
        for a in (0, 2, 4):  # siblings at step 4 share x_3 .. x_4 and differ from x_5 on
            assert torch.equal(tree[a].latents[:5], tree[a + 1].latents[:5])
            assert not torch.equal(tree[a].latents[5], tree[a + 1].latents[5])
            assert not torch.equal(tree[a].image, tree[a + 1].image)
    # Roots have their own initial noise.
    assert not torch.equal(first[0].latents[0], second[0].latents[0])


def test_every_leafs_log_probs_follow_the_flow_grpo_formula_from_its_own_latents(random_pipeline):
    (root_leaves) = grow(random_pipeline, [TreeRoot("3", "", 5, TWO_LEVELS)]).batch
    sigmas = root_leaves.schedule.sigmas.double().numpy()
    for leaf in root_leaves.samples:
        latents = leaf.latents.double().numpy()
        velocities = leaf.debug.model_outputs.double().numpy()
        for step in range(STEPS):
            mean, noise_std, _ = reference_step(
                "sde", latents[step], velocities[step], sigmas[step], sigmas[step + 1], 0.7, sigmas[1], 0
            )
            expected = reference_log_prob(latents[step + 1][None], mean[None], noise_std, "gaussian")[0]
            assert math.isclose(leaf.log_probs[step].item(), expected, rel_tol=1e-4, abs_tol=1e-4), (leaf.branch_path, step)


def test_no_branch_steps_is_todays_sampling_bit_for_bit(random_pipeline):
    today = sample(random_pipeline, ["7", "7", "2"], [40, 41, 42], OPTIONS).samples
    roots = [TreeRoot(p, "", s) for p, s in (("7", 40), ("7", 41), ("2", 42))]
    for a, b in zip(today, grow(random_pipeline, roots).batch.samples):
        assert_same_leaf(a, b)


def test_the_same_tree_twice_gives_the_same_bits_and_a_leaf_grown_alone_equals_its_tree_leaf(random_pipeline):
    roots = [TreeRoot("5", "", 900, TWO_LEVELS)]
    first, again = grow(random_pipeline, roots).batch.samples, grow(random_pipeline, roots).batch.samples
    for a, b in zip(first, again):
        assert_same_leaf(a, b)
    for leaf in (first[0], first[3], first[5]):  # child 0 all the way; a fresh generator at each depth
        (alone,) = grow(random_pipeline, [TreeRoot.of_leaf(leaf)]).batch.samples
        assert_same_leaf(alone, leaf)


def test_the_transformer_runs_once_per_node_and_step(random_pipeline):
    # A root runs steps 0..2; 3 children run 3..4; 6 grandchildren run 5: 3 + 3 x 2 + 6 x 1 = 15 rows,
    # not 6 leaves x 6 steps = 36. With padding, each step's rows are whole micro-batches.
    call = grow(random_pipeline, [TreeRoot("1", "", 0, TWO_LEVELS)])
    size = micro_batch_size(random_pipeline, resolve_options(random_pipeline, OPTIONS))  # samples a call
    assert call.transformer_rows == sum(steps * math.ceil(rows / size) * size for steps, rows in ((3, 1), (2, 3), (1, 6)))
    kernels = MicroBatching(8, invariance="kernels")
    with_kernels = load_pipeline(micro_batching=kernels)
    assert sample_tree(with_kernels, [TreeRoot("1", "", 0, TWO_LEVELS)], OPTIONS).transformer_rows == 3 + 3 * 2 + 6
    one_branch = Branching(steps=(4,), factors=(16,))  # issue 19's figure at 10 steps: 5 + 16 x 5 = 85
    options = SamplingOptions(num_inference_steps=10, sde_step_indices=(4, 5))
    assert sample_tree(with_kernels, [TreeRoot("1", "", 0, one_branch)], options).transformer_rows == 85


def test_branched_and_unbranched_roots_sampled_together_keep_their_bits(random_pipeline):
    roots = [TreeRoot("4", "", 10, TWO_LEVELS), TreeRoot("9", "", 30), TreeRoot("4", "", 50, Branching((3,), (2,)))]
    together = grow(random_pipeline, roots).batch.samples
    alone = [leaf for root in roots for leaf in grow(random_pipeline, [root]).batch.samples]
    assert len(together) == len(alone) == 6 + 1 + 2
    for a, b in zip(together, alone):
        assert_same_leaf(a, b)


@pytest.mark.parametrize("family", [None, "sd3", "flux"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_of_leaves_is_exact(tiny_family_dirs, family, dtype):
    path = None if family is None else tiny_family_dirs[family]
    pipeline = load_pipeline(family, path, device="cpu", dtype=getattr(torch, dtype), micro_batching=MicroBatching(2))
    size = {} if family is None else {"height": 32, "width": 32}
    options = SamplingOptions(num_inference_steps=4, sde_step_indices=(1, 2), return_denoising_env=True, **size)
    prompt = "7" if family is None else "a cat"
    batch = sample_tree(pipeline, [TreeRoot(prompt, "", 3, Branching((1, 2), (2, 2)))], options).batch
    replayed = replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([leaf.log_probs for leaf in batch.samples]))


@pytest.mark.parametrize(
    "branching, options, field, reason",
    [
        (Branching((9,), (2,)), OPTIONS, "rollout_branch_steps", "out of range [0, 5]"),
        (Branching((1,), (2,)), SamplingOptions(num_inference_steps=6, sde_step_indices=(2, 3)), "rollout_branch_steps", "deterministic (ode) step"),
        (Branching((1,), (2,)), SamplingOptions(num_inference_steps=6, sde_type=TransitionKind.ODE), "rollout_branch_steps", "deterministic (ode) step"),
        (Branching((1,), (2,)), SamplingOptions(num_inference_steps=6, noise_level=0.0), "rollout_branch_steps", "standard deviation of 0"),
        (Branching((5,), (2,)), SamplingOptions(num_inference_steps=6, sde_type="cps"), "rollout_branch_steps", "standard deviation of 0"),
    ],
)
def test_branches_at_steps_that_draw_no_noise_are_refused(random_pipeline, branching, options, field, reason):
    with pytest.raises(InvalidRequestError) as caught:
        grow(random_pipeline, [TreeRoot("1", "", 0, branching)], options)
    assert caught.value.field == field and reason in caught.value.reason


@pytest.mark.parametrize(
    "arguments, field, reason",
    [
        ({"steps": (2,), "factors": (2, 2)}, "rollout_branch_factors", "one factor per branch step: 2 factors for 1 steps"),
        ({"steps": (2, 2), "factors": (2, 2)}, "rollout_branch_steps", "strictly increasing"),
        ({"steps": (3, 2), "factors": (2, 2)}, "rollout_branch_steps", "strictly increasing"),
        ({"steps": (-1,), "factors": (2,)}, "rollout_branch_steps", "strictly increasing steps >= 0"),
        ({"steps": (2,), "factors": (1,)}, "rollout_branch_factors", "each must be >= 2"),
        ({"steps": (2,), "factors": (2.5,)}, "rollout_branch_factors", "must contain integers"),
        ({"steps": "2", "factors": (2,)}, "rollout_branch_steps", "must be a list of integers"),
    ],
)
def test_inconsistent_branchings_name_the_field(arguments, field, reason):
    with pytest.raises(InvalidRequestError) as caught:
        Branching(**arguments)
    assert caught.value.field == field and reason in caught.value.reason


def test_paths_offsets_and_seeds_are_the_documented_ones():
    branching = Branching((2, 4), (3, 2))
    assert [branching.path_of(offset) for offset in range(6)] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(branching.offset(branching.path_of(offset)) == offset for offset in range(6))
    # The root's generator, then each node's: a child 0 keeps its parent's (the same seed again).
    assert branching.branch_seeds(100, (0, 0)) == (100, 100, 100)
    assert branching.branch_seeds(100, (2, 1)) == (100, 104, 105)
    assert branching.branch_seeds(100, (1, 0)) == (100, 102, 102)
    assert np.prod(branching.factors) == branching.leaves_per_root == 6


def test_a_tree_crosses_processes_as_its_nodes_once_and_its_leaves_come_back_whole(random_pipeline):
    roots = [TreeRoot("8", "", 70, TWO_LEVELS), TreeRoot("2", "", 90)]
    batch = grow(random_pipeline, roots).batch
    nodes = batch.tree()
    # Two roots, 3 children, 6 grandchildren for the first; the second is a root of one leaf.
    assert [(node.root, node.path) for node in nodes][:4] == [(0, ()), (0, (0,)), (0, (0, 0)), (0, (0, 1))]
    assert len(nodes) == 1 + 3 + 6 + 1 and nodes[-1].leaves == (6,) and nodes[0].leaves == tuple(range(6))
    root, child = nodes[0], nodes[1]
    assert list(root.steps) == [0, 1] and root.latent_step_indices.tolist() == [0, 1, 2]
    assert list(child.steps) == [2, 3] and child.latent_step_indices.tolist() == [3, 4]
    assert torch.equal(root.tensors["latents"], batch.samples[5].latents[:3])
    unpickled = pickle.loads(pickle.dumps(batch))
    for a, b in zip(batch.samples, unpickled.samples):
        assert_same_leaf(a, b)
    assert all(leaf.schedule is unpickled.schedule for leaf in unpickled.samples)
    # The shared prefix travels once: the pickled tree is smaller than its leaves pickled apart.
    apart = sum(len(pickle.dumps(batch.subset([i]))) for i in range(len(batch.samples)))
    assert len(pickle.dumps(batch)) < 0.8 * apart


def test_the_tree_gives_a_trainer_node_rewards_and_sibling_groups_in_a_few_lines(random_pipeline):
    batch = grow(random_pipeline, [TreeRoot("6", "", 20, TWO_LEVELS)]).batch
    nodes = batch.tree()
    reward = torch.stack([leaf.image.mean() for leaf in batch.samples])
    node_reward = [reward[list(node.leaves)].mean() for node in nodes]  # BranchGRPO's backup
    assert torch.equal(node_reward[0], reward.mean()) and torch.equal(node_reward[-1], reward[5])
    assert nodes[0].children == (1, 4, 7) and nodes[1].children == (2, 3) and nodes[2].children == ()
    assert [nodes[c].path for c in nodes[4].children] == [(1, 0), (1, 1)]
    for node in nodes:  # TempFlow-GRPO: each branch's children against each other
        if node.children:
            values = torch.stack([node_reward[c] for c in node.children])
            advantages = values - values.mean()
            assert advantages.shape == (len(node.children),) and abs(advantages.sum().item()) < 1e-6


# Issue 44: an epoch starting at a branch at step 0 also kept x_0, so every leaf held T + 2 latents
# for T + 1 step indices, and its x_1 was a buffer nobody wrote.
@pytest.mark.parametrize(
    "branching",
    [Branching((0,), (2,)), Branching((0, 3), (2, 2)), Branching((0, 5), (2, 2)), Branching((0, 1), (2, 2))],
    ids=["0", "0-3", "0-5", "0-1"],
)
@pytest.mark.parametrize("kind", ["sde", "cps"])
@pytest.mark.parametrize("num_roots", [1, 2])
def test_a_branch_at_step_0_keeps_one_latent_per_step_each_the_one_sampled(random_pipeline, branching, kind, num_roots):
    steps = 7  # cps's last step draws no noise, so 5 is a branch step only before it
    options = SamplingOptions(num_inference_steps=steps, debug=True, sde_type=kind)
    roots = [TreeRoot(str(r), "", 50 + 10 * r, branching) for r in range(num_roots)]
    batch = grow(random_pipeline, roots, options).batch
    for leaf in [*batch.samples, *pickle.loads(pickle.dumps(batch)).samples]:
        assert leaf.latents.shape[0] == leaf.latent_step_indices.numel() == steps + 1
        assert torch.equal(leaf.latents[-1], leaf.final_latents)
        assert torch.isfinite(leaf.latents).all()
        debug = leaf.debug
        for step in range(steps):  # each x_(s+1) is the one its transition drew
            taken = debug.prev_sample_means[step] + debug.noise_std_devs[step] * debug.variance_noises[step]
            assert torch.equal(leaf.latents[step + 1], taken), (leaf.branch_path, step)
    last = branching.steps[-1]
    for a, b in zip(batch.samples[0::2], batch.samples[1::2]):  # siblings at the last branch step
        assert torch.equal(a.latents[: last + 1], b.latents[: last + 1])
        assert not torch.equal(a.latents[last + 1], b.latents[last + 1])
    for leaf in (batch.samples[0], batch.samples[-1]):
        (alone,) = grow(random_pipeline, [TreeRoot.of_leaf(leaf)], options).batch.samples
        assert_same_leaf(alone, leaf)


@pytest.mark.parametrize("log_prob_std", ["nominal", "scaled"])
def test_branchgrpos_split_noise_with_the_chosen_std_in_the_log_prob(random_pipeline, log_prob_std):
    """BranchGRPO's `flux_step_with_split` (DanceGRPO's step; at a split each child draws
    `randn * split_noise_scale` and its log-prob keeps the step's own std) against the server's leaves,
    in float64: x_{s+1} from the debug tensors, the scaled noise at split steps, the log-prob with
    the nominal std, or with the scaled one where the request asks for it; replay exact either way."""
    steps, eta, splits = 10, 0.3, (0, 3, 6)  # its 8-GPU script: splits at 0, 3, 6, 9 of 20, factor 2, scale 4
    options = SamplingOptions(num_inference_steps=steps, sde_type=TransitionKind.DANCE, noise_level=eta, debug=True)
    scaled = grow(random_pipeline, [TreeRoot("7", "", 40, Branching(splits, (2, 2, 2), (4, 4, 4), log_prob_std))], options).batch
    unscaled = grow(random_pipeline, [TreeRoot("7", "", 40, Branching(splits, (2, 2, 2)))], options).batch
    sigmas = scaled.schedule.sigmas.double().numpy()
    for leaf, twin in zip(scaled.samples, unscaled.samples):
        debug = leaf.debug
        for step in range(steps):
            scale = 4.0 if step in splits else 1.0
            # The same draws, times the scale at a split: a child's noise is its own, only larger.
            assert torch.equal(debug.variance_noises[step], scale * twin.debug.variance_noises[step])
            x, x_next = leaf.latents[step].double().numpy()[None], leaf.latents[step + 1].double().numpy()[None]
            v = debug.model_outputs[step].double().numpy()[None]
            mean, std, log_prob = dance_grpo_flux_step(v, x, eta, sigmas, step, x_next)
            assert_mean_close("dance", debug.prev_sample_means[step].numpy()[None], mean, x, v, sigmas[step], sigmas[step + 1], eta)
            assert debug.noise_std_devs[step].item() == pytest.approx(std, rel=1e-6)  # the nominal std
            drawn = debug.variance_noises[step].double().numpy()[None]  # randn * split_noise_scale
            assert_mean_close("dance", x_next, mean + drawn * std, x, v, sigmas[step], sigmas[step + 1], eta)
            if log_prob_std == "scaled":
                log_prob = reference_log_prob(x_next, mean, std * scale, "gaussian")
            np.testing.assert_allclose(leaf.log_probs[step].item(), log_prob[0], rtol=1e-4, atol=1e-4)
    replayed = replay_log_probs(random_pipeline, scaled.schedule, scaled.options, scaled.samples)
    assert torch.equal(replayed.log_probs, torch.stack([leaf.log_probs for leaf in scaled.samples]))


@pytest.mark.parametrize(
    "arguments, field, reason",
    [
        ({"noise_scales": (4.0, 4.0)}, "rollout_branch_noise_scales", "one scale per branch step: 2 scales for 1 steps"),
        ({"noise_scales": (0.0,)}, "rollout_branch_noise_scales", "each must be a number in (0, 100.0]"),
        ({"noise_scales": (float("nan"),)}, "rollout_branch_noise_scales", "each must be a number in (0, 100.0]"),
        ({"noise_scales": (1e9,)}, "rollout_branch_noise_scales", "each must be a number in (0, 100.0]"),
        ({"noise_scales": "4"}, "rollout_branch_noise_scales", "must be a list of numbers"),
        ({"noise_scales": (4.0,), "log_prob_std": "wide"}, "rollout_branch_log_prob_std", "must be one of ['scaled', 'nominal']"),
    ],
)
def test_bad_noise_scales_name_the_field(arguments, field, reason):
    with pytest.raises(InvalidRequestError) as caught:
        Branching((2,), (2,), **arguments)
    assert caught.value.field == field and reason in caught.value.reason


@pytest.mark.parametrize("field, value", [("rollout_branch_noise_scales", [4.0]), ("rollout_branch_log_prob_std", "nominal")])
def test_noise_fields_without_branch_steps_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError, match="needs rollout_branch_steps") as caught:
        plan_rollout(parse_request({"prompt": "3", field: value}), RequestLimits())
    assert caught.value.field == field
    request = {"prompt": "3", "num_outputs_per_prompt": 2, "rollout_branch_steps": [1], "rollout_branch_factors": [2], field: value}
    branching = plan_rollout(parse_request(request), RequestLimits()).branching
    assert branching.noise_scale_at(1) == (4.0 if field == "rollout_branch_noise_scales" else 1.0)


def test_a_trainer_replays_each_edge_of_a_tree_once_to_the_bit(random_pipeline, monkeypatch):
    """`node_transition_log_probs`: each node's own transitions, computed once for the whole tree
    (BranchGRPO trains every parent-to-child edge once), equal to the rollout's; optionally only
    the steps a trainer trains."""
    roots = [TreeRoot("8", "", 70, TWO_LEVELS), TreeRoot("2", "", 90, TWO_LEVELS)]
    batch = grow(random_pipeline, roots).batch
    nodes = batch.tree()
    replayed_steps = []
    original = replay_module.transition_log_probs

    def counted(pipeline, schedule, options, samples, steps):
        replayed_steps.append(len(samples) * len(steps))
        return original(pipeline, schedule, options, samples, steps)

    monkeypatch.setattr(replay_module, "transition_log_probs", counted)
    per_node = node_transition_log_probs(random_pipeline, batch, nodes)
    for node, log_probs in zip(nodes, per_node):
        assert torch.equal(log_probs, node.tensors["log_probs"])
    # 2 roots x (2 steps + 3 children x 2 + 6 grandchildren x 2) = 40 transitions, not 12 leaves x 6 = 72.
    assert sum(replayed_steps) == sum(len(node.steps) for node in nodes) == 40
    window = node_transition_log_probs(random_pipeline, batch, nodes, steps=[2, 3])
    assert [len(log_probs) for log_probs in window] == [0 if not node.path else 2 if len(node.path) == 1 else 0 for node in nodes]


# Combs (TempFlow-GRPO): an ODE spine, and at each branch step children one stochastic step off it ---------

COMB = Branching(steps=(0, 2, 4), factors=(2, 3, 1), shape="comb")  # 1 + 2 + 3 + 1 = 7 leaves a root


def test_comb_paths_offsets_and_seeds_are_the_documented_ones():
    paths = [COMB.path_of(offset) for offset in range(COMB.leaves_per_root)]
    assert COMB.leaves_per_root == 7
    assert paths == [(0, 0, 0), (1,), (2,), (0, 1), (0, 2), (0, 3), (0, 0, 1)]  # the spine, then step by step
    assert [COMB.offset(path) for path in paths] == list(range(7))
    assert COMB.branch_seeds(100, (0, 0, 0)) == (100, 100, 100, 100)  # the spine keeps the root's generator
    assert COMB.branch_seeds(100, (0, 2)) == (100, 100, 104)  # a child starts one of its own
    # The spine owns its steps between branch steps; a child its stochastic step and its whole ODE tail.
    assert [COMB.owned_steps(path, STEPS) for path in [(), (0,), (0, 0), (0, 0, 0), (2,), (0, 3)]] == [
        range(0, 0), range(0, 2), range(2, 4), range(4, 6), range(0, 6), range(2, 6)
    ]  # fmt: skip
    for bad in [(0,), (0, 0), (3,), (0, 4), (1, 0), (0, 0, 0, 0), (True,)]:
        with pytest.raises(InvalidRequestError, match="must be a comb's leaf") as caught:
            COMB.check_path(bad)
        assert caught.value.field == "branch_path"


def test_a_comb_is_tempflow_grpos_rollout_its_spine_computed_once(random_pipeline):
    """Against TempFlow-GRPO's rollout, written here in float64: the spine runs every step by ODE
    (the plain sample of its seed with no stochastic step, bit for bit); at each branch step every
    child takes Flow-GRPO's SDE step (`sde_step_with_logprob`, TempFlow-GRPO's) from the spine's
    x_s with the spine's velocity there, then finishes by ODE; the transformer computes the spine
    once: T rows, and T - 1 - s rows a child of step s."""
    call = grow(random_pipeline, [TreeRoot("7", "", 100, COMB)])
    leaves = call.batch.samples
    sigmas = call.batch.schedule.sigmas.double().numpy()
    spine = leaves[0]
    plain = sample(random_pipeline, ["7"], [100], SamplingOptions(num_inference_steps=STEPS, debug=True, sde_step_indices=()))
    assert torch.equal(spine.latents, plain.samples[0].latents) and torch.equal(spine.log_probs, torch.zeros(STEPS))
    for leaf in leaves[1:]:
        step = COMB.steps[len(leaf.branch_path) - 1]
        debug = leaf.debug
        assert leaf.seed == 100 + COMB.offset(leaf.branch_path)
        assert torch.equal(leaf.latents[: step + 1], spine.latents[: step + 1])
        assert torch.equal(debug.model_outputs[: step + 1], spine.debug.model_outputs[: step + 1])  # the spine's velocity
        x, v = leaf.latents[step].double().numpy(), debug.model_outputs[step].double().numpy()
        eps = debug.variance_noises[step].double().numpy()
        mean, std, x_next = reference_step("sde", x, v, sigmas[step], sigmas[step + 1], 0.7, sigmas[1], eps)
        assert_mean_close("sde", leaf.latents[step + 1].double().numpy(), x_next, x, v, sigmas[step], sigmas[step + 1], 0.7)
        assert debug.noise_std_devs[step].item() == pytest.approx(std, rel=1e-6)
        log_prob = reference_log_prob(leaf.latents[step + 1].double().numpy()[None], mean[None], std, "gaussian")[0]
        assert leaf.log_probs[step].item() == pytest.approx(log_prob, rel=1e-4, abs=1e-4)
        for tail in range(step + 1, STEPS):  # the ODE tail: no noise, log-prob 0, an Euler step
            assert leaf.log_probs[tail] == 0 and not debug.variance_noises[tail].any()
            x, v = leaf.latents[tail].double().numpy(), debug.model_outputs[tail].double().numpy()
            euler, _, _ = reference_step("ode", x, v, sigmas[tail], sigmas[tail + 1], 0.7, sigmas[1], 0)
            assert_mean_close("ode", leaf.latents[tail + 1].double().numpy(), euler, x, v, sigmas[tail], sigmas[tail + 1], 0.7)
        assert not torch.equal(leaf.image, spine.image)
        # G2RPO rewards the x0 its last ODE step predicts (`run_ode_sample_step`'s pred_original):
        # at its granularity 1, the leaf's final latent, bit for bit.
        last_sigma = call.batch.schedule.sigmas[STEPS - 1]
        assert torch.equal(leaf.latents[STEPS], leaf.latents[STEPS - 1] - last_sigma * debug.model_outputs[STEPS - 1])
    kernels = load_pipeline(micro_batching=MicroBatching(8, invariance="kernels"))
    rows = sample_tree(kernels, [TreeRoot("7", "", 100, COMB)], OPTIONS).transformer_rows
    assert rows == STEPS + 2 * (STEPS - 1 - 0) + 3 * (STEPS - 1 - 2) + 1 * (STEPS - 1 - 4) == 26
    # A request per branch step, as without combs, computes the spine up to it each time: 29 rows.
    assert rows < sum(step + 1 + factor * (STEPS - 1 - step) for step, factor in zip(COMB.steps, COMB.factors)) == 29


def test_comb_leaves_replay_exactly_alone_in_company_and_edge_by_edge(random_pipeline):
    roots = [TreeRoot("4", "", 10, COMB), TreeRoot("9", "", 30, TWO_LEVELS), TreeRoot("2", "", 50)]
    batch = grow(random_pipeline, roots).batch
    alone = [leaf for root in roots for leaf in grow(random_pipeline, [root]).batch.samples]
    for a, b in zip(batch.samples, alone, strict=True):
        assert_same_leaf(a, b)
    for leaf in batch.samples[:7]:
        (regrown,) = grow(random_pipeline, [TreeRoot.of_leaf(leaf)]).batch.samples
        assert_same_leaf(regrown, leaf)
    replayed = replay_log_probs(random_pipeline, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([leaf.log_probs for leaf in batch.samples]))
    nodes = batch.tree()
    for node, log_probs in zip(nodes, node_transition_log_probs(random_pipeline, batch, nodes)):
        assert torch.equal(log_probs, node.tensors["log_probs"])
    spine_node = next(node for node in nodes if node.root == 0 and node.path == (0,))
    # TempFlow-GRPO's groups: the spine node at step 2 has the spine's next node and step 2's 3 children.
    assert [nodes[k].path for k in spine_node.children] == [(0, 0), (0, 1), (0, 2), (0, 3)]
    back = pickle.loads(pickle.dumps(batch))
    for a, b in zip(batch.samples, back.samples):
        assert_same_leaf(a, b)


@pytest.mark.parametrize(
    "fields, field, reason",
    [
        ({"rollout_branch_shape": "ring"}, "rollout_branch_shape", "must be one of ['tree', 'comb']"),
        ({"rollout_branch_shape": "comb", "rollout_branch_factors": [0]}, "rollout_branch_factors",
         "a comb's children of each branch step must be >= 1"),
        ({"rollout_branch_shape": "comb", "num_outputs_per_prompt": 4}, "num_outputs_per_prompt",
         "must be a multiple of 1 + the sum of rollout_branch_factors, a comb's spine and children (3)"),
        ({"rollout_branch_shape": "comb", "rollout_sde_step_indices": [3]}, "rollout_branch_steps",
         "step 1 is a deterministic (ode) step of this request"),
    ],
)  # fmt: skip
def test_bad_comb_fields_are_refused_by_name(fields, field, reason):
    request = {"prompt": "3", "num_outputs_per_prompt": 3, "rollout_branch_steps": [1], "rollout_branch_factors": [2], **fields}
    with pytest.raises(InvalidRequestError) as caught:
        plan_rollout(parse_request(request), RequestLimits())
    assert caught.value.field == field and reason in caught.value.reason
    with pytest.raises(InvalidRequestError, match="needs rollout_branch_steps") as caught:
        plan_rollout(parse_request({"prompt": "3", "rollout_branch_shape": "comb"}), RequestLimits())
    assert caught.value.field == "rollout_branch_shape"


# Resuming from a returned node (TurningPoint-GRPO, G2RPO): a request that starts at a step from its latent --


def resumed(pipeline, leaf, step, options=OPTIONS):
    """`leaf` grown again from its latent at `step`, with its request's options resumed there; and
    the call."""
    call = grow(pipeline, [TreeRoot.resumed_from(leaf, step)], dataclasses.replace(options, resume_step=step))
    return call.batch.samples[0], call


@pytest.mark.parametrize("step", [0, 2, 3, STEPS - 1])
def test_a_leaf_resumed_from_its_node_with_its_own_tail_is_the_same_leaf_from_there(random_pipeline, step):
    roots = [TreeRoot("6", "", 20, TWO_LEVELS), TreeRoot("3", "", 40, COMB), TreeRoot("8", "", 60)]
    leaves = grow(random_pipeline, roots).batch.samples
    kernels = load_pipeline(micro_batching=MicroBatching(8, invariance="kernels"))
    for leaf in leaves:
        again, call = resumed(random_pipeline, leaf, step)
        assert torch.equal(again.latents, leaf.latents[step:]) and torch.equal(again.image, leaf.image)
        assert torch.equal(again.log_probs[step:], leaf.log_probs[step:]) and not again.log_probs[:step].any()
        for name in ("model_outputs", "prev_sample_means", "variance_noises", "noise_std_devs"):
            assert torch.equal(getattr(again.debug, name)[step:], getattr(leaf.debug, name)[step:]), name
            assert not getattr(again.debug, name)[:step].any(), name  # steps it did not take
        assert again.latent_step_indices.tolist() == list(range(step, STEPS + 1))
        replayed = replay_log_probs(random_pipeline, again.schedule, call.batch.options, [again])
        assert torch.equal(replayed.log_probs[0], again.log_probs[step:])
    # The transformer runs the steps from the resume step only: a plain sample's T - s.
    _, call = resumed(kernels, grow(kernels, roots[2:]).batch.samples[0], step)
    assert call.transformer_rows == STEPS - step


def test_a_node_resumed_with_an_ode_tail_is_turningpoint_grpos_continuation(random_pipeline):
    """TurningPoint-GRPO scores each node of an SDE trajectory by its ODE continuation: the same
    request resumed at the node with no stochastic step from there on."""
    (leaf,) = grow(random_pipeline, [TreeRoot("5", "", 7)]).batch.samples
    sigmas = leaf.schedule.sigmas.double().numpy()
    for step in (1, 3):
        ode_tail = dataclasses.replace(OPTIONS, sde_step_indices=tuple(range(step)))  # the window before it, as sampled
        tail, _ = resumed(random_pipeline, leaf, step, ode_tail)
        assert torch.equal(tail.latents[0], leaf.latents[step]) and not tail.log_probs.any()
        assert not torch.equal(tail.image, leaf.image)  # the SDE's draws are gone
        for k, at in enumerate(range(step, STEPS)):
            x, v = tail.latents[k].double().numpy(), tail.debug.model_outputs[at].double().numpy()
            euler, _, _ = reference_step("ode", x, v, sigmas[at], sigmas[at + 1], 0.7, sigmas[1], 0)
            assert_mean_close("ode", tail.latents[k + 1].double().numpy(), euler, x, v, sigmas[at], sigmas[at + 1], 0.7)


def test_roots_resumed_from_one_node_with_their_own_seeds_explore_from_it(random_pipeline):
    """G2RPO-style: one node, several tails; each root's generator is its own seed's, advanced as
    the request's steps before the node draw."""
    (leaf,) = grow(random_pipeline, [TreeRoot("2", "", 300)]).batch.samples
    request = {"prompt": "2", "num_outputs_per_prompt": 3, "num_inference_steps": STEPS, "seed": 300, "rollout_debug_mode": True,
               "rollout_return_dit_trajectory": True,
               "rollout_resume_step": 3, "rollout_resume_latents": [encode_tensor(leaf.latents[3], binary=False)]}  # fmt: skip
    plan = plan_rollout(parse_request(json.loads(json.dumps(request))), RequestLimits())
    tails = grow(random_pipeline, plan.roots(), plan.options).batch.samples
    assert torch.equal(tails[0].latents, leaf.latents[3:])  # seed 300's tail is the leaf's own
    assert all(torch.equal(tail.latents[0], leaf.latents[3]) for tail in tails)
    assert not torch.equal(tails[1].latents[1], tails[2].latents[1])


@pytest.mark.parametrize(
    "fields, field, reason",
    [
        ({"rollout_resume_step": 2}, "rollout_resume_latents", "needed with rollout_resume_step"),
        ({"rollout_resume_latents": ["LATENT"]}, "rollout_resume_step", "needed with rollout_resume_latents"),
        ({"rollout_resume_step": 6, "rollout_resume_latents": ["LATENT"]}, "rollout_resume_step", "must be a step in [0, 5], got 6"),
        ({"rollout_resume_step": 2, "rollout_resume_latents": ["LATENT", "LATENT"]}, "rollout_resume_latents",
         "needs one latent a prompt: 2 for 1 prompts"),
        ({"rollout_resume_step": 2, "rollout_resume_latents": [{"__tensor__": True, "data": "%%"}]}, "rollout_resume_latents[0]",
         "not valid base64"),
        ({"rollout_resume_step": 2, "rollout_resume_latents": [3]}, "rollout_resume_latents[0]", "must be a tensor envelope or a tensor"),
        ({"rollout_resume_step": 2, "rollout_resume_latents": ["LATENT"], "rollout_return_step_indices": [1, 4]},
         "rollout_return_step_indices", "steps [1] are before rollout_resume_step 2"),
    ],
)  # fmt: skip
def test_bad_resume_fields_are_refused_by_name(fields, field, reason):
    latent = encode_tensor(torch.zeros(4, 8, 8), binary=False)
    fields = {name: [latent if v == "LATENT" else v for v in value] if isinstance(value, list) and name.endswith("latents") else value
              for name, value in fields.items()}  # fmt: skip
    request = {"prompt": "3", "num_inference_steps": STEPS, "rollout_return_dit_trajectory": True, **fields}
    with pytest.raises(InvalidRequestError) as caught:
        plan_rollout(parse_request(request), RequestLimits())
    assert caught.value.field == field and reason in caught.value.reason


def test_latents_the_model_cannot_resume_from_are_refused_before_sampling(random_pipeline):
    (leaf,) = grow(random_pipeline, [TreeRoot("2", "", 5)]).batch.samples
    options = resolve_options(random_pipeline, dataclasses.replace(OPTIONS, resume_step=2))
    latent_shape = random_pipeline.latent_shape(options.height, options.width)
    for latent, reason in (
        (torch.zeros(3, 8, 8), f"must be float32 latents of shape {list(latent_shape)} for this size, got [3, 8, 8]"),
        (leaf.latents[2].double(), "torch.float64"),
        (torch.full(latent_shape, float("nan")), "must be finite"),
    ):
        with pytest.raises(InvalidRequestError, match=re.escape(reason)) as caught:
            checked_against_model(random_pipeline, options, ["2"], [""], 1, RequestLimits(), resume_latents=[latent])
        assert caught.value.field == "rollout_resume_latents"
        with pytest.raises(InvalidRequestError, match=re.escape(reason)):
            grow(random_pipeline, [dataclasses.replace(TreeRoot("2", "", 5), resume_latents=latent)], options)
    with pytest.raises(InvalidRequestError, match="these part before it") as caught:  # leaves of two nodes at step 5
        grow(random_pipeline, [TreeRoot("1", "", 0, TWO_LEVELS, paths=((0, 0), (1, 0)), resume_latents=leaf.latents[2])],
             dataclasses.replace(OPTIONS, resume_step=5))  # fmt: skip
    assert caught.value.field == "branch_path"


# Resuming a node below a branch step by request (`rollout_resume_branch_paths`): its leaves, with their seeds --

BELOW_A_BRANCH = {"tree": (TWO_LEVELS, 3, [[1], [2]]), "comb": (COMB, 3, [[0, 0], [2]])}  # a root's nodes at step 3


def planned(fields, prompts=("6", "3")):
    """The plan of a request for `prompts` with `fields`, after a trip through JSON."""
    request = {"prompt": list(prompts), "num_inference_steps": STEPS, "seed": 500, "rollout_debug_mode": True,
               "rollout_return_dit_trajectory": True, **fields}  # fmt: skip
    return plan_rollout(parse_request(json.loads(json.dumps(request))), RequestLimits())


@pytest.mark.parametrize("shape", BELOW_A_BRANCH)
def test_nodes_below_a_branch_step_resumed_by_request_give_their_leaves_bits(random_pipeline, shape):
    """A request names, per prompt, the node its latent belongs to: its samples are the leaves
    below it, with the seeds they had (root r of a request is seeded `seed + r * leaves_per_root`),
    so the request's seed and fields give the same leaves from the node on; more samples than the
    node's leaves are roots of their own that explore from it."""
    branching, step, nodes = BELOW_A_BRANCH[shape]
    branch_fields = {"rollout_branch_steps": list(branching.steps), "rollout_branch_factors": list(branching.factors),
                     "rollout_branch_shape": branching.shape.value}  # fmt: skip
    per_root = branching.leaves_per_root
    original = planned({**branch_fields, "num_outputs_per_prompt": per_root})
    leaves = grow(random_pipeline, original.roots(), original.options).batch.samples
    chosen = [[leaf for leaf in leaves[k * per_root : (k + 1) * per_root] if leaf.branch_path[: len(node)] == tuple(node)]
              for k, node in enumerate(nodes)]  # fmt: skip
    envelopes = [encode_tensor(below[0].latents[step], binary=False) for below in chosen]
    resume = {**branch_fields, "rollout_resume_step": step, "rollout_resume_latents": envelopes, "rollout_resume_branch_paths": nodes}
    outputs = max(len(below) for below in chosen)  # one root a prompt where the node has the most leaves
    plan = planned({**resume, "num_outputs_per_prompt": outputs})
    resumed_leaves = grow(random_pipeline, plan.roots(), plan.options).batch.samples
    for k, below in enumerate(chosen):
        rows = resumed_leaves[k * outputs : (k + 1) * outputs]
        assert [row.branch_path for row in rows] == [leaf.branch_path for leaf in below] * (outputs // len(below))
        for leaf, again in zip(below, rows):  # the prompt's first root: the original's, from the node on
            assert (again.seed, again.root_seed) == (leaf.seed, leaf.root_seed)
            assert torch.equal(again.latents, leaf.latents[step:]) and torch.equal(again.image, leaf.image)
            assert torch.equal(again.log_probs[step:], leaf.log_probs[step:]) and not again.log_probs[:step].any()
    assert len(set(plan.seeds)) == len(plan.seeds)
    explore = planned({**resume, "num_outputs_per_prompt": 2 * len(chosen[0]), "rollout_resume_latents": envelopes[:1],
                       "rollout_resume_branch_paths": nodes[:1]}, prompts=["6"])  # fmt: skip
    first, explorer = grow(random_pipeline, explore.roots(), explore.options).batch.samples[:: len(chosen[0])]
    assert explorer.root_seed == first.root_seed + per_root and torch.equal(explorer.latents[0], first.latents[0])
    kinds = {branching.transition_at(plan.options, at, explorer.branch_path) for at in range(step, STEPS)}
    assert torch.equal(explorer.image, first.image) == (kinds == {TransitionKind.ODE})  # only an ODE tail draws nothing


@pytest.mark.parametrize(
    "fields, field, reason",
    [
        ({"rollout_resume_step": None}, "rollout_resume_branch_paths", "needs rollout_resume_step"),
        ({"rollout_resume_branch_paths": [[1]]}, "rollout_resume_branch_paths", "needs one path a prompt: 1 for 2 prompts"),
        ({"rollout_resume_branch_paths": [[1], [3]]}, "rollout_resume_branch_paths[1]", "must be the path of a node at step 3"),
        ({"rollout_resume_branch_paths": [[1], [1, 0]]}, "rollout_resume_branch_paths[1]", "for each of the 1 branch steps"),
        ({"rollout_resume_branch_paths": [[1], "1"]}, "rollout_resume_branch_paths.1", "valid list"),
        ({"num_outputs_per_prompt": 3}, "num_outputs_per_prompt", "multiple of the 2 leaves below the node rollout_resume_branch_paths[0]"),
        ({"rollout_branch_factors": [300, 2]}, "rollout_branch_factors", "must be at most max_outputs_per_prompt (64)"),
    ],
)  # fmt: skip
def test_bad_nodes_to_resume_are_refused_by_name(fields, field, reason):
    request = {"prompt": ["6", "3"], "num_inference_steps": STEPS, "num_outputs_per_prompt": 2, "rollout_branch_steps": [2, 4],
               "rollout_branch_factors": [3, 2], "rollout_resume_step": 3, "rollout_resume_branch_paths": [[1], [2]],
               "rollout_resume_latents": [encode_tensor(torch.zeros(4, 8, 8), binary=False)] * 2}  # fmt: skip
    request = {name: value for name, value in {**request, **fields}.items() if value is not None}
    with pytest.raises(InvalidRequestError) as caught:
        plan_rollout(parse_request(request), RequestLimits())
    assert caught.value.field == field and reason in caught.value.reason
