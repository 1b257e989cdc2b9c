"""A request's rewards (`deployments/scoring.py`), without Ray or Serve: each part scored as soon
as it is fetched, group-aware scorers given whole groups, lost scorer replicas asked again with
the same samples, failures named or nulled as the request says, advantages as Flow-GRPO's."""

import asyncio
import pickle
import re
import time
from dataclasses import replace

import pytest
import ray
import torch

from deployments.config import RolloutAppConfig
from deployments.dispatch import Dispatcher
from deployments.scorer import ScorerReplica
from deployments.scoring import scoring_samples
from deployments.work import WorkerResult
from rollout.advantages import group_advantages
from rollout.cost import CostFacts
from rollout.errors import InvalidRequestError, ScorerError
from rollout.models.registry import load_pipeline
from rollout.plan import RequestLimits, plan_rollout
from rollout.sampler import sample
from rollout.schema import parse_request
from rollout.scorers.base import ScoringSample
from rollout.scorers.registry import build_scorer
from tests.deployments.scorer_plugins import FailingScorer

SCORERS = {
    "ink": {"kind": "ink"},
    "digits": {"kind": "digits"},
    "pref": {"kind": "pairwise", "options": {"scorer": "ink"}},
    "broken": {"kind": "ink", "timeout_s": 0.3, "retry_attempts": 2},
}


@pytest.fixture(scope="module")
def pipeline():
    return load_pipeline(device="cpu")


def plan(prompts=("3", "5"), per_prompt=3, **fields):
    body = {"prompt": list(prompts), "num_outputs_per_prompt": per_prompt, "num_inference_steps": 4, "seed": 0, **fields}
    return plan_rollout(parse_request(body), RequestLimits(), scorers=SCORERS.keys())


class Part:
    """A worker's answer after `delay_s`, sampled for real (the rewards are checked against its images)."""

    def __init__(self, pipeline, work, delay_s, log):
        self.pipeline, self.work, self.delay_s, self.log = pipeline, work, delay_s, log

    async def _resolve(self):
        await asyncio.sleep(self.delay_s)
        batch = sample(self.pipeline, self.work.prompts, self.work.seeds, self.work.options)
        self.log.append(("fetched", self.work.seeds[0], time.perf_counter()))
        return WorkerResult(batch, len(self.work), 0, 0.0, None, "replica", "node")

    def __await__(self):
        return self._resolve().__await__()


class Workers:
    def __init__(self, pipeline, delays, log):
        self.pipeline, self.delays, self.log, self.sent = pipeline, list(delays), log, []

    async def send(self, work):
        self.sent.append(work)
        return Part(self.pipeline, work, self.delays[len(self.sent) - 1], self.log)

    def cancel(self, part):
        pass

    async def answered(self, parts):
        pass  # these parts are sampled when fetched: nothing waits on the workers

    async def cost_facts(self):
        return CostFacts.of(self.pipeline)


class Scorers:
    """The library's scorers in this process; `failures[name]` says what each call does instead."""

    def __init__(self, log, failures=None):
        self.built = {name: build_scorer(spec["kind"], spec.get("options")) for name, spec in SCORERS.items()}
        self.log, self.failures, self.calls = log, failures or {}, []

    async def group_aware(self, scorer):
        return self.built[scorer].group_aware

    async def score(self, scorer, samples):
        self.calls.append((scorer, [s.metadata["sample_index"] for s in samples]))
        self.log.append(("scored", scorer, time.perf_counter()))
        failure = self.failures.get(scorer)
        if failure is not None:
            return await failure(len(self.calls))
        return self.built[scorer].score(samples)


def rollout(pipeline, request_plan, scorers, delays=(0.0, 0.0), log=None):
    log = [] if log is None else log
    workers = Workers(pipeline, delays, log)
    config = RolloutAppConfig(num_worker_replicas=len(delays), scorers=SCORERS)
    ingress = Dispatcher(workers, config, lambda: 0, scorers)
    result = asyncio.run(ingress.dispatch(request_plan, 1e12))
    return result, log


def test_rewards_are_the_scorers_own_on_the_returned_images_and_advantages_flow_grpos(pipeline):
    log = []
    result, _ = rollout(pipeline, plan(rollout_reward_models=["ink", "digits"], rollout_advantages="group"), Scorers(log))
    batch = result.batch()
    direct = scoring_samples(batch, 0, 3)
    for name in ("ink", "digits"):
        rewards = [s.rewards[name] for s in batch.samples]
        assert rewards == build_scorer(name).score(direct)  # same bits
        assert [s.advantages[name] for s in batch.samples] == group_advantages(rewards, 3)
    ink = [s.rewards["ink"] for s in batch.samples]
    mean, std = sum(ink[:3]) / 3, (sum((r - sum(ink[:3]) / 3) ** 2 for r in ink[:3]) / 3) ** 0.5
    assert batch.samples[0].advantages["ink"] == pytest.approx((ink[0] - mean) / (std + 1e-4), rel=1e-12)


def test_a_part_is_scored_while_the_next_is_still_sampled(pipeline):
    log = []
    result, _ = rollout(pipeline, plan(rollout_reward_models=["ink"]), Scorers(log), delays=(0.0, 0.6), log=log)
    times = result.fetch().reward_times  # the request's, once
    events = [(kind, what) for kind, what, _ in sorted(log, key=lambda e: e[2])]
    # The first part (samples 0-2) is scored before the second (seed 3 on) is fetched.
    assert events.index(("scored", "ink")) < events.index(("fetched", 3))
    assert 0 < times.reward_wait_s < times.reward_time_s  # the first part's scoring hid behind sampling


def test_a_group_aware_scorer_gets_each_prompts_whole_group_across_parts(pipeline):
    scorers = Scorers([])
    # 2 prompts x 3 outputs over 2 replicas: parts of 3; over 4 parts of 2, a group spans two parts.
    result, _ = rollout(pipeline, plan(rollout_reward_models=["pref"]), scorers, delays=(0.0, 0.1, 0.2))
    batch = result.batch()
    assert sorted(indices for _, indices in scorers.calls) == [[0, 1, 2], [3, 4, 5]]
    for group in (slice(0, 3), slice(3, 6)):
        wins = [s.rewards["pref"] for s in batch.samples[group]]
        assert wins == build_scorer("pairwise", {"scorer": "ink"}).score(scoring_samples(batch, 0, 3)[group])
        assert sum(wins) == pytest.approx(1.5)  # n samples' win rates sum to n / 2


def test_a_lost_scorer_replica_is_asked_again_with_the_same_samples(pipeline):
    async def lost_once(call):
        if call == 1:
            raise ray.exceptions.RayActorError()
        return [0.5] * 3

    scorers = Scorers([], {"broken": lost_once})
    result, _ = rollout(pipeline, plan(prompts=("3",), rollout_reward_models=["broken"]), scorers, delays=(0.0,))
    batch = result.batch()
    assert [s.rewards["broken"] for s in batch.samples] == [0.5] * 3
    assert scorers.calls == [("broken", [0, 1, 2])] * 2


@pytest.mark.parametrize(
    "failure, reason",
    [
        ("raises", "replicas were lost 2 times"),
        ("hangs", "did not answer 3 samples within its timeout_s (0.3 s)"),
        ("miscounts", "answered 2 scores for 3 samples"),
        ("nan", "not a finite number"),
    ],
)
def test_a_failing_scorer_fails_the_request_naming_it_or_leaves_nulls(pipeline, failure, reason):
    async def fail(call):
        if failure == "raises":
            raise ray.exceptions.RayActorError()
        if failure == "hangs":
            await asyncio.sleep(30)
        return [1.0, 2.0] if failure == "miscounts" else [float("nan")] * 3

    asked = dict(prompts=("3",), rollout_reward_models=["broken", "ink"], rollout_advantages="group")
    result, _ = rollout(pipeline, plan(**asked), Scorers([], {"broken": fail}), delays=(0.0,))
    with pytest.raises(ScorerError) as caught:
        result.batch()
    assert caught.value.scorer == "broken" and reason in caught.value.reason
    # The same parts fetched again, nulls asked for this time.
    nulls = replace(result, scoring=replace(result.scoring, plan=replace(result.scoring.plan, nulls_on_error=True)))
    batch = nulls.batch()
    assert all(s.rewards["broken"] is None and s.advantages["broken"] is None for s in batch.samples)
    assert all(isinstance(s.rewards["ink"], float) and isinstance(s.advantages["ink"], float) for s in batch.samples)


def test_an_http_request_whose_scoring_failed_is_scored_again_from_its_kept_samples(pipeline):
    async def fails_first(call):
        return [float("nan")] * 3 if call == 1 else [0.25] * 3

    log = []
    workers = Workers(pipeline, [0.0] * 3, log)
    config = RolloutAppConfig(num_worker_replicas=1, scorers=SCORERS, keep_unscored_s=60)
    ingress = Dispatcher(workers, config, lambda: 0, Scorers(log, {"broken": fails_first}))
    asked = dict(prompts=("3",), rollout_reward_models=["broken"])
    with pytest.raises(ScorerError, match="the samples are kept 60 s"):
        asyncio.run(ingress.sampled(plan(**asked), "http 10.0.0.1"))
    # The same request again, nulls now acceptable: scored from the kept samples, none sampled.
    (part,) = asyncio.run(ingress.sampled(plan(**asked, rollout_reward_on_error="null"), "http 10.0.0.1")).parts
    assert len(workers.sent) == 1 and [s.rewards["broken"] for s in part.batch.samples] == [0.25] * 3
    # Kept once: sent a third time, or with another seed, the request is sampled.
    asyncio.run(ingress.sampled(plan(**asked), "http 10.0.0.1"))
    assert len(workers.sent) == 2


@pytest.mark.parametrize(
    "fields, field, reason",
    [
        ({"rollout_reward_models": ["ocr"]}, "rollout_reward_models", "'ocr' is not a scorer of this server"),
        ({"rollout_reward_models": ["ink", "ink"]}, "rollout_reward_models", "names a scorer twice"),
        ({"rollout_advantages": "group"}, "rollout_advantages", "needs rollout_reward_models"),
        ({"rollout_reward_models": ["ink"], "rollout_advantages": "batch"}, "rollout_advantages", "must be 'group'"),
        ({"rollout_reward_models": ["ink"], "rollout_reward_on_error": "skip"}, "rollout_reward_on_error", "'fail' or 'null'"),
    ],
)
def test_bad_reward_fields_are_refused_naming_the_field(fields, field, reason):
    with pytest.raises(InvalidRequestError) as caught:
        plan(**fields)
    assert caught.value.field == field and reason in caught.value.reason


def test_a_scoring_samples_image_crosses_processes_out_of_band():
    """Ray keeps protocol-5 buffers out of band: a scorer replica maps a video's frames, uncopied."""
    video = torch.rand(2, 3, 5, 16, 16)[1]  # a row of a stacked buffer, as a batch's samples are
    buffers = []
    inline = pickle.dumps(ScoringSample(video, "a cat", {"seed": 3}), protocol=5, buffer_callback=buffers.append)
    assert [buffer.raw().nbytes for buffer in buffers] == [video.nbytes] and len(inline) < 300
    back = pickle.loads(inline, buffers=buffers)
    assert torch.equal(back.image, video) and back.prompt == "a cat" and back.metadata == {"seed": 3}


def test_a_scorers_exception_reaches_the_client_as_its_type_and_an_id_the_log_has(pipeline, serve_log):
    secret = "/home/alice/models/reward.bin (pid 4242)"

    async def fail(call):
        raise OSError(f"cannot open {secret}")

    asked = dict(prompts=("3",), rollout_reward_models=["broken"])
    result, _ = rollout(pipeline, plan(**asked), Scorers([], {"broken": fail}), delays=(0.0,))
    with pytest.raises(ScorerError) as caught:
        result.batch()
    error_id = re.search(r"error id ([0-9a-f]+)", str(caught.value)).group(1)
    assert caught.value.scorer == "broken" and "OSError" in caught.value.reason and secret not in str(caught.value)
    logged = [r for r in serve_log.records if error_id in r.getMessage()]
    assert logged and secret in str(logged[0].exc_info[1])


def test_a_scorer_replica_tells_its_scorers_exception_by_type_and_id_and_logs_its_text(serve_log):
    config = {"kind": "tests.deployments.scorer_plugins:FailingScorer", "options": {}, "max_batch_size": 8}
    replica = ScorerReplica.func_or_class("down", config)
    with pytest.raises(ScorerError) as caught:
        replica._scored([])
    error_id = re.search(r"error id ([0-9a-f]+)", caught.value.reason).group(1)
    assert caught.value.scorer == "down" and caught.value.reason.startswith("RuntimeError")
    assert FailingScorer.message not in str(caught.value)
    logged = [r for r in serve_log.records if error_id in r.getMessage()]
    assert logged and str(logged[0].exc_info[1]) == FailingScorer.message
