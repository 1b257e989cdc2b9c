"""Rewards in the rollout, served: scorer deployments beside the workers, rows with `rewards` and
`advantages`, HTTP and handle alike, a failing scorer named (or nulled) while the server keeps
serving, and a scorer replica killed under load losing no request."""

import concurrent.futures
import os
import signal

import pytest
import requests
from ray import serve

from rollout.advantages import group_advantages
from rollout.client import RolloutClient
from rollout.scorers.base import ScoringSample
from rollout.scorers.registry import build_scorer
from rollout.testing.batches import assert_same_batch
from tests.deployments.apps import deploy_ingress
from tests.deployments.replicas import on_replicas
from tests.deployments.scorer_plugins import FailingScorer
from tests.deployments.test_http import post
from tests.deployments.waiting import wait_until

# Four replicas in all (each a process that imports torch): `digits` and `ink` are
# tests/deployments/test_scoring.py's, and `slow` scores ink, a little slowly.
SCORERS = {
    "slow": {"kind": "tests.deployments.scorer_plugins:SlowInk", "num_cpus": 0.1, "num_replicas": 2},
    "pref": {"kind": "pairwise", "options": {"scorer": "ink"}, "num_cpus": 0.1},
    "down": {"kind": "tests.deployments.scorer_plugins:FailingScorer", "num_cpus": 0.1},
}
BODY = {
    "prompt": ["3", "8"],
    "num_outputs_per_prompt": 4,
    "num_inference_steps": 6,
    "seed": 7,
    "rollout_reward_models": ["slow", "pref"],
    "rollout_advantages": "group",
}


@pytest.fixture(scope="module")
def rewards_app(serve_app):
    app = deploy_ingress(serve_app, "rewards-test", scorers=SCORERS)
    yield app
    serve.delete(app.name)


def direct(rows, kind, options=None):
    samples = [ScoringSample(row["generated_output"], row["prompt"]) for row in rows]
    return build_scorer(kind, options).score(samples)


def test_rows_carry_the_scorers_own_rewards_and_group_advantages_and_http_the_client_and_handle_agree(http, rewards_app):
    rows = post(http, rewards_app.url, BODY)
    rewards = [row["rewards"]["slow"] for row in rows]
    assert rewards == direct(rows, "ink")  # same bits as the scorer on the returned images
    assert [row["advantages"]["slow"] for row in rows] == group_advantages(rewards, 4)
    for group in (rows[:4], rows[4:]):  # a group-aware scorer: each prompt's 4 samples at once
        assert [row["rewards"]["pref"] for row in group] == direct(group, "pairwise", {"scorer": "ink"})
    batch = rewards_app.handle.generate.remote(BODY).result().batch()
    assert [s.rewards for s in batch.samples] == [row["rewards"] for row in rows]
    assert [s.advantages for s in batch.samples] == [row["advantages"] for row in rows]
    answer = RolloutClient(rewards_app.url).generate_answer(BODY)
    assert_same_batch(batch, answer.batch)
    assert answer.reward_time_s >= answer.reward_wait_s >= 0


def test_a_failing_scorer_is_named_or_nulled_and_the_server_keeps_serving(http, rewards_app):
    failing = {**BODY, "rollout_reward_models": ["down", "slow"]}
    answer = http.post(f"{rewards_app.url}/rollout/generate", json=failing, headers={"Accept": "application/json"})
    assert answer.status_code == 502
    error = answer.json()["error"]
    assert error["field"] == "rollout_reward_models" and "scorer 'down': RuntimeError (error id" in error["message"]
    assert FailingScorer.message not in answer.text  # the server log has it, under the error's id
    rows = post(http, rewards_app.url, {**failing, "rollout_reward_on_error": "null"})
    assert all(row["rewards"]["down"] is None and row["advantages"]["down"] is None for row in rows)
    assert all(isinstance(row["rewards"]["slow"], float) for row in rows)
    assert len(post(http, rewards_app.url, {**BODY, "rollout_reward_models": ["slow"]})) == 8
    unknown = http.post(f"{rewards_app.url}/rollout/generate", json={**BODY, "rollout_reward_models": ["ocr"]})
    assert unknown.status_code == 400 and unknown.json()["error"]["field"] == "rollout_reward_models"
    # What a request may name is discoverable.
    assert http.get(f"{rewards_app.url}/rollout/info").json()["scorers"] == {name: s["kind"] for name, s in SCORERS.items()}


def test_a_scorer_replica_killed_under_load_loses_no_request(http, rewards_app):
    """The module's last test: the surviving replica keeps its counting scorer."""
    body = {**BODY, "rollout_reward_models": ["slow"], "rollout_advantages": None}

    def count_calls_running(replica):  # nested: Ray pickles it by value into the replica
        score = replica.scorer.score

        def counted(samples):
            counted.running += 1
            try:
                return score(samples)
            finally:
                counted.running -= 1

        counted.running = 0
        replica.scorer.score = counted

    def a_replica_scoring() -> int | None:
        running = on_replicas(rewards_app.name, "Scorer-slow", lambda replica: (os.getpid(), replica.scorer.score.running))
        return next((pid for pid, calls in running if calls), None)

    on_replicas(rewards_app.name, "Scorer-slow", count_calls_running)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = [pool.submit(post, requests.Session(), rewards_app.url, {**body, "seed": 100 * i}) for i in range(6)]
        os.kill(wait_until(a_replica_scoring, "a replica of the slow scorer scoring"), signal.SIGKILL)
        rows = [answer.result(timeout=120) for answer in answers]
    for request in rows:
        assert [row["rewards"]["slow"] for row in request] == direct(request, "ink")
