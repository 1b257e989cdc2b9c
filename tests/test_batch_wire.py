"""A rollout batch as it crosses HTTP (`RolloutBatch.to_wire` / `from_wire`, through msgpack and JSON):
every field back bit for bit, over generated batches (plain and tree, debug tensors, conditioning,
input images, rewards), the shared parts once, and a body that does not fit refused by name."""

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.codec import from_json, from_msgpack, to_json, to_msgpack
from rollout.errors import CodecError
from rollout.input_images import InputImage
from rollout.options import SamplingOptions
from rollout.sampler import sample_tree
from rollout.testing.batches import assert_same_batch
from rollout.transitions import LogProbForm, TransitionKind
from rollout.tree import Branching, TreeRoot
from rollout.trajectory import RolloutBatch

STEPS = 5


@st.composite
def batches(draw, pipeline):
    branching = draw(st.sampled_from([Branching(), Branching((1,), (2,)), Branching((0, 3), (2, 3))]))
    options = SamplingOptions(
        num_inference_steps=STEPS,
        sde_type=draw(st.sampled_from([k for k in TransitionKind if k.draws_noise])),
        log_prob_form=draw(st.sampled_from(list(LogProbForm))),
        debug=draw(st.booleans()),
        return_denoising_env=draw(st.booleans()),
        return_step_indices=draw(st.sampled_from([None, (0, 1, 2, STEPS), (STEPS,), ()])),
    )
    num_prompts = draw(st.integers(1, 3))
    roots = [TreeRoot(str(p), "", 10 * p, branching if draw(st.booleans()) else Branching()) for p in range(num_prompts)]
    batch = sample_tree(pipeline, roots, options, weight_version="v-1").batch
    # What a served batch carries besides: a prompt's input images (one tuple a prompt) and rewards.
    images = {root.prompt: (InputImage(torch.randint(0, 255, (3, 4, 6), dtype=torch.uint8)),) for root in roots}
    with_images = draw(st.booleans())
    samples = [
        dataclasses.replace(
            leaf,
            condition_images=images[leaf.prompt] if with_images else (),
            rewards={"ink": float(k) / 7, "failed": None},
            advantages={"ink": -float(k)},
        )
        for k, leaf in enumerate(batch.samples)
    ]
    return RolloutBatch(batch.schedule, batch.options, batch.model, samples)


@pytest.mark.parametrize("encode, decode", [(to_msgpack, from_msgpack), (to_json, from_json)], ids=["msgpack", "json"])
def test_a_batch_crosses_the_wire_bit_for_bit(random_pipeline, encode, decode):
    @settings(max_examples=12, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(batches(random_pipeline))
    def check(batch):
        received = RolloutBatch.from_wire(decode(encode(batch.to_wire())))
        assert_same_batch(batch, received)
        # What samples share crosses once and is shared again: a prompt's conditioning and images.
        by_prompt = {}
        for leaf in received.samples:
            first = by_prompt.setdefault(leaf.prompt, leaf)
            assert leaf.condition_images is first.condition_images
            assert leaf.denoising_env is first.denoising_env

    check()


def test_a_trees_shared_prefix_crosses_once(random_pipeline):
    roots = [TreeRoot("4", "", 3, Branching((1, 3), (3, 2)))]
    batch = sample_tree(random_pipeline, roots, SamplingOptions(num_inference_steps=STEPS, debug=True)).batch
    tree_bytes = len(to_msgpack(batch.to_wire()))
    apart = sum(len(to_msgpack(batch.subset([i]).to_wire())) for i in range(len(batch.samples)))
    assert tree_bytes < 0.8 * apart, (tree_bytes, apart)  # each leaf alone carries its whole path


@pytest.mark.parametrize(
    "change, named",
    [
        (lambda wire: {**wire, "format": "rollout-batch/0"}, "not a rollout batch of format 'rollout-batch/1'"),
        (lambda wire: {**wire, "options": {**wire["options"], "temperature": 1}}, r"options \['temperature'\]"),
        (lambda wire: {**wire, "samples": wire["samples"] + wire["samples"][:1]}, "does not fit its layout"),
        (lambda wire: {k: v for k, v in wire.items() if k != "schedule"}, "lacks the key 'schedule'"),
        (lambda wire: [wire], "got 'list'"),
    ],
)
def test_a_body_that_does_not_fit_the_layout_is_refused_by_name(random_pipeline, change, named):
    batch = sample_tree(random_pipeline, [TreeRoot("1", "", 0)], SamplingOptions(num_inference_steps=2)).batch
    with pytest.raises(CodecError, match=named):
        RolloutBatch.from_wire(from_msgpack(to_msgpack(change(batch.to_wire()))))
