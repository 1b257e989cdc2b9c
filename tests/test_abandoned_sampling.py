"""Sampler calls that drop the roots no one waits for (`sample_tree`'s `abandoned`, issue 46):
every other leaf keeps its bits, the dropped ones cost no transformer row after the step they were
dropped at, and a call whose every root is dropped stops before its next step."""

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.errors import SamplingAbandoned
from rollout.micro_batching import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import micro_batch_size, resolve_options, sample_tree
from rollout.transitions import TransitionKind
from rollout.tree import Branching, TreeRoot
from tests.test_tree import assert_same_leaf

STEPS = 5
BRANCHINGS = [Branching(), Branching((0,), (2,)), Branching((2,), (2,)), Branching((1, 3), (2, 2)), Branching((3,), (3,))]


class DroppedAt:
    """`abandoned` for a call: root r is abandoned from the check before step `drop_steps[r]` on
    (`STEPS`: the check before decoding; None: never). Counts the checks."""

    def __init__(self, drop_steps: list[int | None]):
        self.drop_steps = drop_steps
        self.checks = 0

    def __call__(self) -> set[int]:
        step = self.checks
        self.checks += 1
        return {r for r, drop in enumerate(self.drop_steps) if drop is not None and drop <= step}


@st.composite
def calls(draw, max_roots: int = 4):
    num_roots = draw(st.integers(1, max_roots))
    roots = [
        TreeRoot(draw(st.sampled_from("0123456789")), "", draw(st.integers(0, 1000)) * 16, draw(st.sampled_from(BRANCHINGS)))
        for _ in range(num_roots)
    ]
    drop_steps = draw(st.lists(st.none() | st.integers(0, STEPS), min_size=num_roots, max_size=num_roots))
    options = SamplingOptions(
        num_inference_steps=STEPS,
        sde_type=draw(st.sampled_from([TransitionKind.SDE, TransitionKind.CPS])),
        debug=draw(st.booleans()),
        return_denoising_env=draw(st.booleans()),
    )
    return roots, drop_steps, options


@pytest.fixture(scope="module", params=["padding", "kernels"])
def digits(request):
    return load_pipeline(micro_batching=MicroBatching(2, invariance=request.param))


# Prompts of different text lengths fall in conditioning buckets of their own. At Qwen-Image's
# default 1024 px both of these pad to one 32-token bucket; at 64 px buckets are 8 tokens, and
# they fall apart (checked by the fixture). 64 px also decodes in milliseconds, not seconds.
WORDED_PROMPTS = ("a cat", "a red cat on a long wall at dusk")
QWENIMAGE_SIZE = 64


@pytest.fixture(scope="module")
def qwenimage(tiny_family_dirs):
    pipeline = load_pipeline("qwenimage", tiny_family_dirs["qwenimage"], device="cpu", micro_batching=MicroBatching(2))
    options = resolve_options(pipeline, SamplingOptions(height=QWENIMAGE_SIZE, width=QWENIMAGE_SIZE))
    conditioning = pipeline.encode_prompts(list(WORDED_PROMPTS), ["", ""], options, [(), ()])
    assert len(conditioning.buckets) == 2, "the prompts must fall in text buckets of their own"
    return pipeline


def rows_with_drops(pipeline, roots, drop_steps, options) -> int:
    """The transformer rows of `roots` sampled together when each root leaves the batch before its
    drop step: at each step, the live nodes of the roots still in it, padded (`rollout.cost`'s rule)."""
    samples_per_call = micro_batch_size(pipeline, resolve_options(pipeline, options))

    def live_nodes(root, step):  # one per distinct path through the branch steps before `step`
        depth = sum(branch_step < step for branch_step in root.branching.steps)
        return len({path[:depth] for path in root.leaf_paths()})

    return sum(
        pipeline.micro_batching.padded_rows(
            sum(live_nodes(root, step) for root, drop in zip(roots, drop_steps) if drop is None or drop > step),
            samples_per_call,
        )
        for step in range(STEPS)
    )


def check_dropping(pipeline, roots, drop_steps, options, one_bucket=True):
    """Samples `roots` dropping each at its step, and checks the call against each kept root
    sampled alone, and its transformer rows against the rows of the nodes left at each step."""
    abandoned = DroppedAt(drop_steps)
    kept = [r for r, drop in enumerate(drop_steps) if drop is None]
    if not kept:
        with pytest.raises(SamplingAbandoned):
            sample_tree(pipeline, roots, options, abandoned=abandoned)
        # It stopped at the check where the last root was dropped: no step after it ran.
        assert abandoned.checks == max(drop_steps) + 1
        return
    call = sample_tree(pipeline, roots, options, abandoned=abandoned)
    assert call.abandoned_roots == frozenset(range(len(roots))) - set(kept)
    alone = [leaf for r in kept for leaf in sample_tree(pipeline, [roots[r]], options).batch.samples]
    assert len(call.batch.samples) == len(alone)
    for leaf, reference in zip(call.batch.samples, alone):
        assert_same_leaf(leaf, reference)
        assert leaf.prompt == reference.prompt
    assert all(leaf.schedule is call.batch.schedule for leaf in call.batch.samples)
    if one_bucket:
        assert call.transformer_rows == rows_with_drops(pipeline, roots, drop_steps, options)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls())
def test_dropped_roots_leave_every_other_leafs_bits_as_they_were(digits, one_torch_thread, call):
    check_dropping(digits, *call)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(calls(max_roots=2))
def test_dropped_roots_leave_every_other_leafs_bits_as_they_were_on_a_family_with_text_buckets(
    qwenimage, one_torch_thread, call
):
    roots, drop_steps, options = call
    worded = [TreeRoot(WORDED_PROMPTS[i % 2], "", root.seed, root.branching) for i, root in enumerate(roots)]
    sized = dataclasses.replace(options, height=QWENIMAGE_SIZE, width=QWENIMAGE_SIZE)
    check_dropping(qwenimage, worded, drop_steps, sized, one_bucket=False)


def test_a_call_whose_every_root_is_dropped_runs_no_transformer_step_after_the_check(random_pipeline):
    transformer_calls = []
    predict = random_pipeline.predict_velocity

    def counted(*args, **kwargs):
        transformer_calls.append(1)
        return predict(*args, **kwargs)

    random_pipeline.predict_velocity = counted
    try:
        with pytest.raises(SamplingAbandoned):
            sample_tree(random_pipeline, [TreeRoot("3", "", 0)], SamplingOptions(num_inference_steps=20), abandoned=DroppedAt([3]))
    finally:
        del random_pipeline.predict_velocity
    assert len(transformer_calls) == 3  # steps 0, 1 and 2 of 20, one micro-batch each
