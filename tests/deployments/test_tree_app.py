"""Tree rollouts served (`rollout_branch_steps`, `rollout_branch_factors`): rows per leaf with their
paths and seeds, HTTP and handle bit for bit, the library's bits, sampled together with unbranched
requests, what each request cost the transformer (`rollout.cost`), and every bad combination of
fields a 400 naming it."""

import pytest
import torch

from rollout.client import RolloutClient
from rollout.codec import encode_tensor
from rollout.cost import TransformerCost
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import micro_batch_size, resolve_options, sample_tree
from rollout.testing.batches import assert_same_batch
from rollout.tree import Branching, TreeRoot
from tests.deployments.replicas import held_samplers
from tests.deployments.test_http import post
from tests.test_cost import steps_and_nodes_by_depth

ENCODINGS = ("application/msgpack", "application/json")

TREE = {
    "prompt": ["3", "8"],
    "num_outputs_per_prompt": 8,
    "num_inference_steps": 6,
    "seed": 500,
    "rollout_sde_step_indices": [2, 3, 4],
    "rollout_branch_steps": [2, 4],
    "rollout_branch_factors": [2, 2],
    "rollout_return_dit_trajectory": True,
}
BRANCHING = Branching((2, 4), (2, 2))


def test_rows_are_leaves_with_their_paths_and_seeds_and_http_the_client_and_handle_agree(http, base_url, handle):
    rows = post(http, base_url, TREE)
    batch = handle.generate.remote(TREE).result().batch()
    received = RolloutClient(base_url).generate(TREE)
    assert_same_batch(batch, received)
    assert [(node.path, node.leaves) for node in received.tree()] == [(node.path, node.leaves) for node in batch.tree()]
    assert len(rows) == len(batch.samples) == 16
    # Per prompt, 2 roots of 4 leaves; sample seeds stay seed + i, as unbranched.
    assert [row["sample_seed"] for row in rows] == list(range(500, 516))
    assert [row["branch_path"] for row in rows[:4]] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert rows[4]["branch_path"] == [0, 0] and rows[4]["branch_seeds"] == [504, 504, 504]
    assert rows[3]["branch_seeds"] == [500, 502, 503]  # a new generator at each depth
    first = rows[0]["dit_trajectory"]
    for row, leaf in zip(rows, batch.samples):
        assert tuple(row["branch_path"]) == leaf.branch_path and row["sample_seed"] == leaf.seed
        for key in ("sigmas", "scheduler_timesteps", "model_timesteps"):  # whole, the same in every row
            assert torch.equal(row["dit_trajectory"][key], first[key])
        assert torch.equal(row["dit_trajectory"]["latents"], leaf.latents)
        assert torch.equal(row["rollout_log_probs"], leaf.log_probs)
        assert torch.equal(row["generated_output"], leaf.image)
    # Siblings share their prefix: the first root's leaves, x_0 .. x_2; the two at step 4, x_3 .. x_4.
    latents = [row["dit_trajectory"]["latents"] for row in rows[:4]]
    assert all(torch.equal(leaf[:3], latents[0][:3]) for leaf in latents)
    assert torch.equal(latents[0][:5], latents[1][:5]) and not torch.equal(latents[0][5], latents[1][5])
    assert not torch.equal(latents[0][3], latents[2][3])


def test_a_leaf_regenerated_alone_from_its_row_equals_its_row(http, base_url):
    """What a row carries is enough: its prompt, its path, its root's seed (`branch_seeds[0]`) and
    the request's branching grow that leaf alone, with no sibling, to the row's bits."""
    rows = post(http, base_url, TREE)
    library = load_pipeline(micro_batching=MicroBatching(16))  # the served model's
    options = SamplingOptions(num_inference_steps=6, sde_step_indices=(2, 3, 4))
    for row in (rows[0], rows[7], rows[14]):
        root = TreeRoot(row["prompt"], "", row["branch_seeds"][0], BRANCHING, paths=(tuple(row["branch_path"]),))
        (leaf,) = sample_tree(library, [root], options).batch.samples
        assert leaf.seed == row["sample_seed"]
        assert torch.equal(leaf.latents, row["dit_trajectory"]["latents"])
        assert torch.equal(leaf.log_probs, row["rollout_log_probs"])
        assert torch.equal(leaf.image, row["generated_output"])


def test_a_tree_shares_a_sampler_call_with_an_unbranched_request_and_keeps_the_librarys_bits(kernels_app):
    """On one worker replica (the kernels app), both queue behind a held call, then meet in the next."""
    tree = {**TREE, "prompt": "8", "num_outputs_per_prompt": 4}
    unbranched = {key: value for key, value in TREE.items() if not key.startswith("rollout_branch")}
    unbranched.update(prompt="5", num_outputs_per_prompt=1, seed=40)
    with held_samplers(kernels_app.name):
        # Other options: sampled alone, first, while the two requests arrive.
        kernels_app.handle.generate.remote({"prompt": "1", "num_inference_steps": 2}).result()
        results = [kernels_app.handle.generate.remote(body).result() for body in (tree, unbranched)]
    parts = [part for result in results for part in result.fetch().parts]
    assert [part.sampler_batch_size for part in parts] == [5, 5]
    # Nothing padded under the kernels: a root runs steps 0 .. 2, 2 children 3 .. 4, 4 leaves 5;
    # the unbranched sample all 6.
    assert parts[0].transformer_rows == 3 + 2 * 2 + 4 + 6
    # Each request is charged its own rows (the call's rows, split: nothing padded to share), and
    # the rows its leaves would have cost unbranched.
    assert [result.transformer_cost() for result in results] == [TransformerCost(11, 4 * 6), TransformerCost(6, 6)]
    assert [part.cost for part in parts] == [result.transformer_cost() for result in results]
    library = load_pipeline(micro_batching=MicroBatching(16, invariance="kernels"), attention_backend="math")  # the served model's
    batch = results[0].batch()
    roots = [TreeRoot("8", "", 500, BRANCHING), TreeRoot("5", "", 40)]
    alone = [leaf for root in roots for leaf in sample_tree(library, [root], batch.options).batch.samples]
    for leaf, expected in zip([*batch.samples, *results[1].batch().samples], alone):
        for name, tensor in expected.tensors().items():
            assert torch.equal(leaf.tensors()[name], tensor), name


def expected_cost(result, branching: Branching, samples_per_call: int) -> TransformerCost:
    """`rollout.tree`'s per-node formula, each depth's nodes padded to whole calls, summed over the
    request's parts (each charged as if alone in its call); unbranched, its leaves for all 6 steps."""
    padded = lambda rows: -(-rows // samples_per_call) * samples_per_call  # noqa: E731
    rows = unbranched = 0
    for work in result.works:
        roots = len(work) // branching.leaves_per_root
        rows += sum(steps * padded(roots * nodes) for steps, nodes in steps_and_nodes_by_depth(branching, 6))
        unbranched += 6 * padded(len(work))
    return TransformerCost(rows, unbranched)


def test_a_trees_cost_is_its_nodes_rows_padded_and_below_its_unbranched_cost(http, base_url, handle, embedded_pipeline):
    branching = Branching((2, 3, 4), (2, 2, 2))
    body = {**TREE, "prompt": ["1", "2", "3", "4"], "rollout_return_dit_trajectory": False}
    body.update(rollout_branch_steps=list(branching.steps), rollout_branch_factors=list(branching.factors))
    result = handle.generate.remote(body).result()
    options = resolve_options(embedded_pipeline, SamplingOptions(num_inference_steps=6))
    samples_per_call = micro_batch_size(embedded_pipeline, options)  # the served model's, guided: 16 rows / 2
    assert samples_per_call == 8 and [len(work) for work in result.works] == [16, 16]  # 2 roots a part
    expected = expected_cost(result, branching, samples_per_call)
    # Per part: 2 roots (padded to 8) for 3 steps, 4 nodes (8) for 1, 8 (8) for 1, 16 leaves for 1.
    assert expected == TransformerCost(2 * (3 * 8 + 8 + 8 + 16), 2 * 6 * 16)
    assert result.transformer_cost() == result.fetch().cost() == expected
    for accept in ENCODINGS:
        rows = post(http, base_url, body, accept)
        assert len(rows) == 32
        assert {(row["transformer_rows"], row["transformer_rows_unbranched"]) for row in rows} == {(112, 192)}


def test_an_unbranched_request_without_padding_costs_its_unbranched_figure(http, base_url, handle):
    body = {"prompt": ["1", "2"], "num_outputs_per_prompt": 8, "num_inference_steps": 6, "seed": 3}
    result = handle.generate.remote(body).result()
    assert [len(work) for work in result.works] == [8, 8]  # whole calls of 8 guided samples: no padding
    assert result.transformer_cost() == TransformerCost(16 * 6, 16 * 6)
    for accept in ENCODINGS:
        rows = post(http, base_url, body, accept)
        assert {(row["transformer_rows"], row["transformer_rows_unbranched"]) for row in rows} == {(96, 96)}


def test_a_comb_is_served_as_the_library_grows_it(http, base_url, handle):
    comb = {"prompt": "5", "num_outputs_per_prompt": 4, "num_inference_steps": 6, "seed": 40, "rollout_branch_shape": "comb",
            "rollout_branch_steps": [1, 3], "rollout_branch_factors": [2, 1], "rollout_return_dit_trajectory": True}  # fmt: skip
    rows = post(http, base_url, comb)
    assert [row["branch_path"] for row in rows] == [[0, 0], [1], [2], [0, 1]]  # the spine, then step by step
    assert [row["branch_seeds"] for row in rows] == [[40, 40, 40], [40, 41], [40, 42], [40, 40, 43]]
    library = load_pipeline(micro_batching=MicroBatching(16))
    root = TreeRoot("5", "", 40, Branching((1, 3), (2, 1), shape="comb"))
    local = sample_tree(library, [root], SamplingOptions(num_inference_steps=6)).batch
    for row, leaf in zip(rows, local.samples, strict=True):
        assert torch.equal(row["dit_trajectory"]["latents"], leaf.latents)
        assert torch.equal(row["rollout_log_probs"], leaf.log_probs)
    assert not rows[0]["rollout_log_probs"].any()  # the spine runs by ODE
    served = handle.generate.remote(comb).result().batch()
    for leaf, local_leaf in zip(served.samples, local.samples, strict=True):
        assert leaf.branching == local_leaf.branching and leaf.branch_path == local_leaf.branch_path
        assert torch.equal(leaf.latents, local_leaf.latents) and torch.equal(leaf.log_probs, local_leaf.log_probs)


@pytest.mark.parametrize("accept", ENCODINGS)
def test_a_node_resumed_over_http_from_its_row_gives_its_rows_bits_from_there(http, base_url, accept):
    """The request that sampled a row, sent again from its latent at step 3 (a tensor envelope in
    the JSON body): the same bits from there on; with an ODE tail, TurningPoint-GRPO's continuation."""
    body = {"prompt": ["2", "9"], "num_inference_steps": 6, "seed": 80, "rollout_return_dit_trajectory": True}
    rows = post(http, base_url, body, accept)
    envelopes = [encode_tensor(row["dit_trajectory"]["latents"][3], binary=False) for row in rows]
    resumed = post(http, base_url, {**body, "rollout_resume_step": 3, "rollout_resume_latents": envelopes}, accept)
    for row, again in zip(rows, resumed, strict=True):
        assert torch.equal(again["dit_trajectory"]["latents"], row["dit_trajectory"]["latents"][3:])
        assert torch.equal(again["rollout_log_probs"][3:], row["rollout_log_probs"][3:])
        assert torch.equal(again["generated_output"], row["generated_output"])
        assert again["transformer_rows"] < row["transformer_rows"]  # the steps before it are not run
    ode_tail = {**body, "rollout_sde_step_indices": [0, 1, 2], "rollout_resume_step": 3, "rollout_resume_latents": envelopes}
    tails = post(http, base_url, ode_tail, accept)
    assert all(not tail["rollout_log_probs"].any() for tail in tails)
    response = http.post(f"{base_url}/rollout/generate", json={**body, "rollout_resume_step": 3, "rollout_resume_latents": envelopes[:1]})
    assert response.status_code == 400 and response.json()["error"]["field"] == "rollout_resume_latents"


def test_a_node_below_a_branch_step_resumed_over_http_gives_its_leaves_rows(http, base_url):
    """A row's node at step 3, below the branch at step 2, named by its path: the request that
    sampled it, from there, gives the rows of the leaves below it, bit for bit."""
    body = {**TREE, "prompt": "3", "num_outputs_per_prompt": 4}
    rows = post(http, base_url, body)
    below = [row for row in rows if row["branch_path"][0] == 1]
    latent = encode_tensor(below[0]["dit_trajectory"]["latents"][3], binary=False)
    resume = {**body, "num_outputs_per_prompt": 2, "seed": below[0]["branch_seeds"][0], "rollout_resume_step": 3,
              "rollout_resume_latents": [latent], "rollout_resume_branch_paths": [[1]]}  # fmt: skip
    resumed = post(http, base_url, resume)
    assert [row["branch_path"] for row in resumed] == [[1, 0], [1, 1]]
    for row, again in zip(below, resumed, strict=True):
        assert again["sample_seed"] == row["sample_seed"] and again["branch_seeds"] == row["branch_seeds"]
        assert torch.equal(again["dit_trajectory"]["latents"], row["dit_trajectory"]["latents"][3:])
        assert torch.equal(again["rollout_log_probs"][3:], row["rollout_log_probs"][3:])
        assert torch.equal(again["generated_output"], row["generated_output"])
    # A trainer's client sends the latent as it holds it, a tensor (msgpack carries it as one).
    latent = below[0]["dit_trajectory"]["latents"][3]
    by_client = RolloutClient(base_url).generate({**resume, "rollout_resume_latents": [latent]})
    for row, leaf in zip(resumed, by_client.samples, strict=True):
        assert leaf.branch_path == tuple(row["branch_path"]) and torch.equal(leaf.image, row["generated_output"])
    response = http.post(f"{base_url}/rollout/generate", json={**resume, "rollout_resume_branch_paths": [[2]]})
    assert response.status_code == 400 and response.json()["error"]["field"] == "rollout_resume_branch_paths[0]"


@pytest.mark.parametrize(
    "fields, field, reason",
    [
        ({"rollout_branch_factors": [2]}, "rollout_branch_steps", "needed with rollout_branch_factors"),
        ({"rollout_branch_steps": [2]}, "rollout_branch_factors", "needed with rollout_branch_steps"),
        ({"rollout_branch_steps": [2], "rollout_branch_factors": [2, 2]}, "rollout_branch_factors", "one factor per branch step"),
        ({"rollout_branch_steps": [3, 2], "rollout_branch_factors": [2, 2]}, "rollout_branch_steps", "strictly increasing"),
        ({"rollout_branch_steps": [2], "rollout_branch_factors": [1]}, "rollout_branch_factors", "each must be >= 2"),
        ({"rollout_branch_steps": [7], "rollout_branch_factors": [2]}, "rollout_branch_steps", "out of range [0, 5]"),
        ({"rollout_branch_steps": [1], "rollout_branch_factors": [2]}, "rollout_branch_steps", "deterministic (ode) step"),
        ({"rollout_branch_steps": [2], "rollout_branch_factors": [3]}, "num_outputs_per_prompt", "multiple of the product"),
        ({"rollout_branch_steps": [2], "rollout_branch_factors": [2], "rollout": False}, "rollout_branch_steps", "rollout: false"),
        ({"rollout_branch_steps": [2], "rollout_branch_factors": [2], "rollout_noise_level": 0.0}, "rollout_branch_steps", "standard deviation of 0"),
        ({"rollout_branch_steps": list(range(9)), "rollout_branch_factors": [2] * 9}, "rollout_branch_steps", "at most 6 entries"),
        ({"rollout_branch_steps": [2], "rollout_branch_factors": ["2"]}, "rollout_branch_factors.0", "Input should be a valid integer"),
    ],
)
def test_bad_tree_fields_are_400s_naming_the_field(http, base_url, fields, field, reason):
    body = {**TREE, "num_outputs_per_prompt": 4, **{k: v for k, v in fields.items()}}
    body = {key: value for key, value in body.items() if key not in {"rollout_branch_steps", "rollout_branch_factors"} or key in fields}
    response = http.post(f"{base_url}/rollout/generate", json=body)
    expected_status = 422 if field.endswith(".0") else 400
    assert response.status_code == expected_status, response.text
    error = response.json()["error"]
    assert error["field"] == field and reason in error["message"], error
