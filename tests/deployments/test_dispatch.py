"""A request's life between the ingress and the workers (`deployments/dispatch.py`), without Ray
or Serve: chunks, its cost and admission by cost with fair shares, retries of lost parts, one
timeout for the whole fetch, cancellation, deadlines and stopping, through the async and the sync
API alike."""

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import ray
import torch

from deployments.config import RolloutAppConfig
from deployments.dispatch import (
    Dispatcher,
    FetchTimeoutError,
    OverloadedError,
    RolloutResult,
    StoppingError,
    UnscoredResults,
    WorkerLostError,
)
from deployments.ray_private import object_store_bytes
from deployments.scoring import RequestScoring
from deployments.work import DeadlineExceededError, cut_into_work
from rollout.codec import encode_tensor
from rollout.cost import CostFacts, RequestCost, TransformerCost
from rollout.errors import InvalidRequestError
from rollout.models.digits import DigitFlowPipeline
from rollout.plan import RequestLimits, plan_rollout
from rollout.schema import parse_request


def plan(samples: int = 4, max_batch_size: int | None = None, **fields):
    request = parse_request({"prompt": "7", "num_outputs_per_prompt": samples, "seed": 0, **fields})
    return plan_rollout(request, RequestLimits(), max_batch_size=max_batch_size)


COST_FACTS = CostFacts.of(DigitFlowPipeline.from_pretrained())
SAMPLE_COST = 2624  # an embedded model's sample at the defaults: (64 tokens x 2 branches x 20 steps) + 64 decoded


class Part:
    """A part that resolves to its work's result after `delay_s`, or raises `error`; awaitable in any
    loop. The worker has answered it `delay_s` after it was sent, or once it is cancelled."""

    def __init__(self, work, delay_s: float = 0.0, error: BaseException | None = None):
        self.work, self.delay_s, self.error = work, delay_s, error
        self.answered_at = time.monotonic() + delay_s

    async def _resolve(self):
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return SimpleNamespace(work=self.work)

    def __await__(self):
        return self._resolve().__await__()


class Workers:
    """Records what was sent and cancelled; `parts(work, attempt)` makes each part."""

    def __init__(self, parts=lambda work, attempt: Part(work)):
        self.sent, self.cancelled, self._parts = [], [], parts

    async def send(self, work):
        await asyncio.sleep(0)  # a replica accepts a part a round trip later: other requests run meanwhile
        self.sent.append(work)
        return self._parts(work, sum(w is work for w in self.sent))

    def cancel(self, part):
        self.cancelled.append(part)
        part.answered_at = time.monotonic()

    async def answered(self, parts):
        while any(part.answered_at > time.monotonic() for part in parts):
            await asyncio.sleep(0.01)

    async def cost_facts(self):
        return COST_FACTS


def dispatcher(workers, queued=0, **config) -> Dispatcher:
    fields = {"num_worker_replicas": 2, "max_batch_size": 32, **config}
    return Dispatcher(workers, RolloutAppConfig(**fields), lambda: queued)


def test_a_request_is_cut_so_every_replica_gets_a_share_and_no_chunk_passes_a_batch():
    def chunk_sizes(samples, num_worker_replicas, max_batch_size):
        return [len(work) for work in cut_into_work(plan(samples), num_worker_replicas, max_batch_size)]

    assert chunk_sizes(16, 2, 32) == [8, 8] and chunk_sizes(3, 2, 32) == [2, 1] and chunk_sizes(40, 2, 16) == [16, 16, 8]
    workers = Workers()
    result = asyncio.run(dispatcher(workers).dispatch(plan(3), deadline=1e12))
    assert [work.seeds for work in workers.sent] == [(0, 1), (2,)]
    assert [r.work for r in asyncio.run(result.fetch_async()).parts] == workers.sent


def test_a_tree_request_is_cut_into_whole_roots_and_a_root_larger_than_a_batch_is_refused():
    tree = {"rollout_branch_steps": [2], "rollout_branch_factors": [4], "num_inference_steps": 4}
    workers = Workers()
    asyncio.run(dispatcher(workers, max_batch_size=6).dispatch(plan(12, **tree), deadline=1e12))
    # Chunks of 6 would cut a root of 4 leaves: chunks of 4, each one root with its branching.
    assert [work.seeds for work in workers.sent] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11)]
    assert {work.branching.factors for work in workers.sent} == {(4,)}
    with pytest.raises(InvalidRequestError) as caught:  # refused by the plan, before anything is sent
        plan(4, max_batch_size=3, **tree)
    assert caught.value.field == "rollout_branch_factors" and "at most the server's max_batch_size (3)" in caught.value.reason


def test_roots_of_different_sizes_resumed_below_a_branch_step_are_cut_whole():
    """A comb's spine node at step 3 has 2 leaves below it, a child of step 0 one: each prompt's
    roots are its node's leaves, and no piece cuts one."""
    latent = encode_tensor(torch.zeros(4, 8, 8), binary=False)
    comb = {"prompt": ["7", "1", "4"], "num_outputs_per_prompt": 2, "num_inference_steps": 6, "seed": 0,
            "rollout_branch_shape": "comb", "rollout_branch_steps": [0, 2, 4], "rollout_branch_factors": [2, 3, 1],
            "rollout_resume_step": 3, "rollout_resume_latents": [latent] * 3, "rollout_resume_branch_paths": [[2], [0, 0], [1]]}  # fmt: skip
    resumed = plan_rollout(parse_request(comb), RequestLimits())
    assert [len(root.leaf_paths()) for root in resumed.roots()] == [1, 1, 2, 1, 1]
    assert [len(work) for work in cut_into_work(resumed, 2, 3)] == [2, 3, 1]  # at most 3, whole roots
    assert sum((work.roots() for work in cut_into_work(resumed, 2, 3)), []) == resumed.roots()


def test_each_part_says_how_many_other_samples_the_ingress_had_in_flight_when_it_was_sent():
    def stamps_of(*plans):
        workers = Workers()
        # The router's count: sent and not answered (nothing is fetched here).
        ingress = Dispatcher(workers, RolloutAppConfig(num_worker_replicas=2), lambda: sum(map(len, workers.sent)))

        async def concurrently():
            await asyncio.gather(*(ingress.dispatch(p, 1e12) for p in plans))

        asyncio.run(concurrently())
        return [(len(work), work.companions_in_flight) for work in workers.sent]

    assert stamps_of(plan(1)) == [(1, 0)]  # a lone request: nothing else can reach its worker
    assert stamps_of(plan(3)) == [(2, 1), (1, 2)]  # a request's chunks are each other's companions
    # Of two requests sent together, the first sees nothing in flight; the second sees the first.
    assert stamps_of(plan(1), plan(1)) == [(1, 0), (1, 1)]


def test_a_request_over_its_cost_limit_is_refused_naming_what_drives_it_before_anything_is_sent():
    workers = Workers()
    limits = {"max_outputs_per_prompt": 512, "max_samples_per_request": 512, "max_request_cost": 4 * SAMPLE_COST - 1}
    with pytest.raises(InvalidRequestError) as caught:
        asyncio.run(dispatcher(workers, limits=limits).dispatch(plan(4), 1e12))
    assert caught.value.field == "num_outputs_per_prompt, height, width, num_inference_steps"
    assert caught.value.reason.startswith(f"this request costs {4 * SAMPLE_COST:,} token-steps, over limits.max_request_cost")
    assert workers.sent == []
    result = asyncio.run(dispatcher(workers, limits={**limits, "max_request_cost": 4 * SAMPLE_COST}).dispatch(plan(4), 1e12))
    assert result.request_cost.token_steps == 4 * SAMPLE_COST


def test_admission_counts_cost_in_flight_and_refuses_beyond_the_budget():
    workers = Workers(lambda work, attempt: Part(work, delay_s=30))
    ingress = dispatcher(workers, max_queued_cost=6 * SAMPLE_COST)

    async def scenario():
        await ingress.dispatch(plan(4), 1e12)
        assert ingress.cost_in_flight == {"handle": 4 * SAMPLE_COST}
        with pytest.raises(OverloadedError) as caught:
            await ingress.dispatch(plan(4), 1e12)
        assert str(caught.value).startswith(
            f"this ingress has {4 * SAMPLE_COST:,} token-steps in flight and this request costs {4 * SAMPLE_COST:,}, "
            f"over max_queued_cost ({6 * SAMPLE_COST:,}), and over this client's fair share of it"
        )
        await ingress.dispatch(plan(2), 1e12)  # within the budget
        assert ingress.cost_in_flight == {"handle": 6 * SAMPLE_COST}

    asyncio.run(scenario())
    assert len(workers.sent) == 4
    # A request larger than the budget is still admitted to an empty queue.
    asyncio.run(dispatcher(Workers(), max_queued_cost=1).dispatch(plan(4), 1e12))
    stopped = dispatcher(workers)
    stopped.stop()
    with pytest.raises(StoppingError):
        asyncio.run(stopped.dispatch(plan(1), 1e12))


def test_one_clients_backlog_refuses_it_but_not_a_newcomer_and_shares_bound_the_overcommit():
    workers = Workers(lambda work, attempt: Part(work, delay_s=30))
    ingress = dispatcher(workers, max_queued_cost=8 * SAMPLE_COST)

    async def scenario():
        for _ in range(2):  # A fills the budget
            await ingress.dispatch(plan(4), 1e12, "http 10.0.0.1")
        with pytest.raises(OverloadedError, match=r"fair share of it \(20,992: 1/1"):
            await ingress.dispatch(plan(1), 1e12, "http 10.0.0.1")
        # B gets in: within its share, half the budget with two clients in flight.
        await ingress.dispatch(plan(4), 1e12, "http 10.0.0.2")
        with pytest.raises(OverloadedError, match=r"1/2, with 2 clients' work in flight\), of which it has 10,496"):
            await ingress.dispatch(plan(1), 1e12, "http 10.0.0.2")
        with pytest.raises(OverloadedError, match="1/2"):  # A, still over its share
            await ingress.dispatch(plan(1), 1e12, "http 10.0.0.1")
        # C's share is a third; twice the budget is the most the shares admit.
        await ingress.dispatch(plan(2), 1e12, "http 10.0.0.3")
        assert sum(ingress.cost_in_flight.values()) == 14 * SAMPLE_COST
        await ingress.dispatch(plan(2), 1e12, "handle")
        with pytest.raises(OverloadedError, match=r"over twice it \(41,984\)"):
            await ingress.dispatch(plan(1), 1e12, "handle 2")
        shares = {"http 10.0.0.1": 8, "http 10.0.0.2": 4, "http 10.0.0.3": 2, "handle": 2}
        assert ingress.cost_in_flight == {client: samples * SAMPLE_COST for client, samples in shares.items()}

    asyncio.run(scenario())


def test_a_requests_cost_counts_until_every_part_is_answered_on_every_path():
    quick = lambda work, attempt: Part(work, delay_s=0.05)  # noqa: E731
    slow = lambda work, attempt: Part(work, delay_s=30)  # noqa: E731
    failing = lambda work, attempt: Part(work, delay_s=0.05, error=RuntimeError("the sampler failed"))  # noqa: E731

    async def drained(ingress) -> bool:
        """Whether the ingress stops counting every request within 5 s, its event loop still running."""
        for _ in range(500):
            if not ingress.cost_in_flight:
                return True
            await asyncio.sleep(0.01)
        return False

    async def handle_path(ingress):  # answered on the workers, never fetched
        await ingress.dispatch(plan(4), 1e12)
        assert ingress.cost_in_flight == {"handle": 4 * SAMPLE_COST}
        return await drained(ingress)

    async def http_path(ingress):
        await ingress.sampled(plan(4), "http 10.0.0.1")
        # Fetched, every part is answered: released at once, before the workers' answers are seen,
        # so that the client's next request does not meet its own cost.
        return not ingress.cost_in_flight

    def seen_late(work, attempt):  # fetched at once; its answer seen by the ingress only after 30 s
        part = Part(work)
        part.answered_at += 30
        return part

    async def client_went_away(ingress):  # Serve cancels the request: its parts are cancelled
        request = asyncio.create_task(ingress.sampled(plan(4), "http 10.0.0.1"))
        await asyncio.sleep(0.1)
        assert ingress.cost_in_flight == {"http 10.0.0.1": 4 * SAMPLE_COST}
        request.cancel()
        return await drained(ingress)

    async def failed(ingress):
        with pytest.raises(RuntimeError, match="the sampler failed"):
            await ingress.sampled(plan(4), "http 10.0.0.1")
        return await drained(ingress)

    async def past_its_deadline(ingress):
        with pytest.raises(DeadlineExceededError):
            await ingress.sampled(plan(4, rollout_timeout_s=0.2), "http 10.0.0.1")
        return await drained(ingress)

    class SendFails(Workers):  # the second part's replica cannot be reached: the first is cancelled
        async def send(self, work):
            if self.sent:
                raise RuntimeError("no replica")
            return await super().send(work)

    async def not_all_sent(ingress):
        with pytest.raises(RuntimeError, match="no replica"):
            await ingress.dispatch(plan(4), 1e12)
        assert len(ingress.workers.cancelled) == 1
        return await drained(ingress)

    cases = [
        (Workers(quick), handle_path),
        (Workers(seen_late), http_path),
        (Workers(slow), client_went_away),
        (Workers(failing), failed),
        (Workers(slow), past_its_deadline),
        (SendFails(slow), not_all_sent),
    ]
    for workers, path in cases:
        assert asyncio.run(path(dispatcher(workers))), path.__name__
    refused = dispatcher(Workers(slow), max_queued_cost=1)
    refused.cost_in_flight["handle"] = 1
    with pytest.raises(OverloadedError):  # refused: never counted
        asyncio.run(refused.dispatch(plan(4), 1e12))
    assert refused.cost_in_flight == {"handle": 1}


def test_a_lost_part_is_sampled_again_with_the_same_work_until_the_attempts_run_out():
    lost = ray.exceptions.RayActorError()
    once = Workers(lambda work, attempt: Part(work, error=lost if attempt == 1 else None))
    result = asyncio.run(dispatcher(once, num_worker_replicas=1).dispatch(plan(2), 1e12))
    [fetched] = result.fetch().parts  # the sync API runs the same code
    assert fetched.work is once.sent[0] and once.sent == [once.sent[0]] * 2

    always = Workers(lambda work, attempt: Part(work, error=lost))
    result = asyncio.run(dispatcher(always, num_worker_replicas=1, worker_retry_attempts=3).dispatch(plan(2), 1e12))
    with pytest.raises(WorkerLostError, match="lost 3 times"):
        result.fetch()
    assert len(always.sent) == 3


def test_the_handles_transformer_cost_is_its_parts_sums():
    class Costed(Part):
        async def _resolve(self):
            return SimpleNamespace(work=self.work, cost=TransformerCost(len(self.work), 3 * len(self.work)))

    result = asyncio.run(dispatcher(Workers(lambda work, attempt: Costed(work))).dispatch(plan(3), 1e12))
    assert [len(work) for work in result.works] == [2, 1]
    assert result.transformer_cost() == asyncio.run(result.transformer_cost_async()) == TransformerCost(3, 9)


def test_a_fetched_requests_stage_times_are_its_slowest_parts_and_its_own_fetch():
    class Timed(Part):
        async def _resolve(self):
            await asyncio.sleep(0.05)
            return SimpleNamespace(work=self.work, queued_s=0.01 * len(self.work), sampler_call_s=0.1 * len(self.work))

    result = asyncio.run(dispatcher(Workers(lambda work, attempt: Timed(work))).dispatch(plan(3), 1e12))
    fetched = replace(result, plan_s=0.002).fetch()
    stages = fetched.stage_times()
    assert (stages.read, stages.plan, stages.score, stages.encode) == (0.0, 0.002, 0.0, 0.0)
    assert (stages.queue, stages.sample) == (pytest.approx(0.02), pytest.approx(0.2))  # the part of 2 samples
    assert stages.fetch == fetched.fetch_s and 0.05 <= stages.fetch < 5
    over_http = fetched.stage_times(read_s=0.001, plan_s=0.003, fetch_s=0.5, encode_s=0.004)
    assert (over_http.read, over_http.plan, over_http.fetch, over_http.encode) == (0.001, 0.003, 0.5, 0.004)
    assert over_http.milliseconds() == {
        "read_ms": 1.0, "plan_ms": 3.0, "fetch_ms": 500.0, "queue_ms": 20.0, "sample_ms": 200.0, "score_ms": 0.0, "encode_ms": 4.0,
    }  # fmt: skip


@pytest.mark.parametrize("api", ["sync", "async"])
def test_one_timeout_bounds_the_whole_fetch(api):
    # Three parts done 0.6 s apart: each comes within 1 s of the one before, the last 1.8 s in.
    delays = iter([0.6, 1.2, 1.8])
    workers = Workers(lambda work, attempt: Part(work, delay_s=next(delays)))
    result = asyncio.run(dispatcher(workers, num_worker_replicas=3).dispatch(plan(3), 1e12))
    with pytest.raises(FetchTimeoutError, match="within 1.0 s"):
        result.fetch(timeout_s=1.0) if api == "sync" else asyncio.run(result.fetch_async(1.0))


def test_past_its_deadline_a_request_fails_and_its_queued_parts_are_cancelled():
    workers = Workers(lambda work, attempt: Part(work, delay_s=30))
    with pytest.raises(DeadlineExceededError):
        asyncio.run(dispatcher(workers).sampled(plan(4, rollout_timeout_s=0.2), "http 10.0.0.1"))
    assert len(workers.cancelled) == 2  # both parts


def test_a_stopping_server_answers_what_is_not_done_within_half_the_grace():
    workers = Workers(lambda work, attempt: Part(work, delay_s=30))
    stopping = dispatcher(workers, graceful_shutdown_timeout_s=0.4)

    async def scenario():
        request = asyncio.create_task(stopping.sampled(plan(2), "http 10.0.0.1"))
        await asyncio.sleep(0.1)
        stopping.stop()
        return await request

    with pytest.raises(StoppingError, match="stopped before this request was sampled"):
        asyncio.run(scenario())
    assert len(workers.cancelled) == 2


def test_through_the_handle_the_deadline_stops_sampling_and_loses_nothing_sampled_in_time():
    # A worker refuses work still queued past its deadline, as deployments/batching.py's queue does.
    def part(work, attempt):
        late = work.deadline < time.time() + 0.3
        return Part(work, delay_s=0.3, error=DeadlineExceededError("the request's deadline passed") if late else None)

    ingress = dispatcher(Workers(part))
    result = asyncio.run(ingress.dispatch(plan(4), time.time() + 60))
    time.sleep(0.5)  # the trainer fetches late: its parts were sampled in time
    assert [len(p.work) for p in result.fetch(timeout_s=10).parts] == [2, 2]
    late = asyncio.run(ingress.dispatch(plan(4), time.time() + 0.1))
    with pytest.raises(DeadlineExceededError, match="deadline passed"):
        late.fetch(timeout_s=10)
    with pytest.raises(DeadlineExceededError):  # sent after its deadline: refused at the ingress
        asyncio.run(ingress.dispatch(plan(4), deadline=0.0))




def unscored_request(seed: int, samples: int = 4):
    """A plan with a seed and rewards (so it can be kept), and a result of two parts of `samples // 2` each."""
    request = parse_request({"prompt": "7", "num_outputs_per_prompt": samples, "seed": seed, "rollout_reward_models": ["ink"]})
    kept_plan = plan_rollout(request, RequestLimits(), scorers=["ink"])
    works = cut_into_work(kept_plan, 2, 32, deadline=time.time() + 60)
    parts = tuple(f"{seed}-{i}" for i in range(len(works)))
    scoring = RequestScoring(kept_plan.rewards, samples, scorers=None, settings={})
    return kept_plan, RolloutResult(kept_plan.request_id, seed, samples, tuple(works), parts, Workers(), 1, RequestCost(0), scoring)


def test_the_resend_cache_is_bounded_in_bytes_oldest_first_counting_parts_not_there_yet_at_their_requests_rate():
    held: dict[str, int | None] = {}  # part -> bytes it holds in the object store; None: not there yet
    cache = UnscoredResults(keep_s=60, max_bytes=1_000, part_bytes=lambda parts: [held[part] for part in parts])
    first, second, third, large = (unscored_request(seed) for seed in range(4))
    held.update({"0-0": 200, "0-1": 200, "1-0": 300, "1-1": None, "2-0": None, "2-1": None})
    assert cache.keep(*first) and cache.keep(*second)  # 400 + 600 (its part not there yet at 300 too): 1,000
    assert cache.keep(*third)  # holds nothing yet: kept beside them
    held.update({"1-1": 300, "2-0": 150, "2-1": 150, "3-0": 1_000, "3-1": 1})
    assert not cache.keep(*large)  # larger alone than the bound: not kept, and drops none of the others
    assert [cache.take(plan) is not None for plan, _ in (first, second, third, large)] == [True, True, True, False]
    for request in (first, second, third):
        cache.keep(*request)  # the third's parts are there now: 400 + 600 + 300 > 1,000, the oldest goes
    assert [cache.take(plan) is not None for plan, _ in (first, second, third)] == [False, True, True]


def test_the_resend_cache_still_keeps_at_most_max_kept_requests():
    cache = UnscoredResults(keep_s=60, max_bytes=10**9, max_kept=2, part_bytes=lambda parts: [10] * len(parts))
    requests = [unscored_request(seed) for seed in range(3)]
    assert all(cache.keep(*request) for request in requests)
    assert [cache.take(plan) is not None for plan, _ in requests] == [False, True, True]


def test_object_store_bytes_are_unknown_for_what_is_not_an_object_reference():
    assert object_store_bytes(["a fake part", None]) == [None, None]
