"""The replicas' queue (`deployments/batching.py`), without Ray: which works share a sampler call."""

import asyncio
import time
from dataclasses import replace

import pytest

from deployments.batching import BatchingQueue
from rollout.options import SamplingOptions
from deployments.work import SamplingWork

FOUR_STEPS, SIX_STEPS = SamplingOptions(num_inference_steps=4), SamplingOptions(num_inference_steps=6)


def work(samples: int = 1, options: SamplingOptions = FOUR_STEPS, companions: int | None = None) -> SamplingWork:
    seeds = tuple(range(samples))
    return SamplingWork(("1",) * samples, ("",) * samples, seeds, options, companions_in_flight=companions)


class Sampler:
    """Records each call's works; takes `seconds` per call; fails calls with `fail_steps` steps."""

    def __init__(self, seconds: float = 0.05, fail_steps: int | None = None):
        self.calls: list[list[SamplingWork]] = []
        self.seconds = seconds
        self.fail_steps = fail_steps

    async def __call__(self, works, abandoned):
        self.calls.append(works)
        await asyncio.sleep(self.seconds)
        if works[0].options.num_inference_steps == self.fail_steps:
            raise RuntimeError("sampler failed")
        return [f"result of {id(w)}" for w in works]

    def sizes(self) -> list[int]:
        return [sum(len(w) for w in works) for works in self.calls]


def sampling_queue(sampler: Sampler, max_samples: int, wait_s: float, lone_wait_s: float) -> BatchingQueue:
    """A worker's queue, with micro-batches of 4 samples."""
    return BatchingQueue(sampler, max_samples, lambda w: w.options, lambda options: 4, wait_s, lone_wait_s)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=30))


def test_requests_sent_together_share_one_call():
    async def scenario():
        sampler = Sampler()
        queue = sampling_queue(sampler, max_samples=32, wait_s=0.05, lone_wait_s=0.0)
        works = [work() for _ in range(16)]
        results = await asyncio.gather(*(queue.submit(w) for w in works))
        assert results == [f"result of {id(w)}" for w in works]  # each request gets its own
        return sampler.sizes()

    assert run(scenario()) == [16]


def test_a_busy_sampler_takes_everything_that_waits_when_it_frees_up():
    async def scenario():
        sampler = Sampler(seconds=0.2)
        queue = sampling_queue(sampler, max_samples=32, wait_s=0.0, lone_wait_s=0.0)
        first = asyncio.create_task(queue.submit(work()))
        await asyncio.sleep(0.05)  # the first call is running
        later = []
        for _ in range(12):  # arriving over 0.12 s, longer than any batching timer
            later.append(asyncio.create_task(queue.submit(work())))
            await asyncio.sleep(0.01)
        await asyncio.gather(first, *later)
        return sampler.sizes()

    assert run(scenario()) == [1, 12]


def test_calls_keep_to_the_limit_and_to_equal_options_oldest_first():
    async def scenario():
        sampler = Sampler()
        queue = sampling_queue(sampler, max_samples=8, wait_s=0.05, lone_wait_s=0.0)
        works = [work(3), work(1, SIX_STEPS), work(3), work(3), work(2, SIX_STEPS)]
        await asyncio.gather(*(queue.submit(w) for w in works))
        positions = {id(w): i for i, w in enumerate(works)}
        return [[positions[id(w)] for w in call] for call in sampler.calls]

    assert run(scenario()) == [[0, 2], [1, 4], [3]]


def test_a_failed_call_fails_its_requests_only_and_the_queue_goes_on():
    async def scenario():
        sampler = Sampler(fail_steps=6)
        queue = sampling_queue(sampler, max_samples=8, wait_s=0.05, lone_wait_s=0.0)
        results = await asyncio.gather(
            queue.submit(work(1, SIX_STEPS)), queue.submit(work(1)), return_exceptions=True
        )
        assert isinstance(results[0], RuntimeError) and results[1].startswith("result of")
        assert (await queue.submit(work(1))).startswith("result of")

    run(scenario())


def test_a_cancelled_request_is_not_sampled():
    async def scenario():
        sampler = Sampler(seconds=0.1)
        queue = sampling_queue(sampler, max_samples=8, wait_s=0.0, lone_wait_s=0.0)
        running = asyncio.create_task(queue.submit(work(1)))
        await asyncio.sleep(0.03)
        cancelled = asyncio.create_task(queue.submit(work(2)))
        kept = asyncio.create_task(queue.submit(work(3)))
        await asyncio.sleep(0.01)
        cancelled.cancel()
        await asyncio.gather(running, kept)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        return sampler.sizes()

    assert run(scenario()) == [1, 3]


def test_a_running_call_is_told_which_of_its_works_no_one_waits_for_any_more():
    seen, asked = [], []

    async def sampler(works, abandoned):
        asked.append(abandoned)
        seen.append(sorted(abandoned()))
        while len(seen) < 50 and len(seen[-1]) < 2:
            await asyncio.sleep(0.01)
            seen.append(sorted(abandoned()))
        return ["sampled"] * len(works)

    async def scenario():
        queue = BatchingQueue(sampler, 8)
        cancelled = asyncio.create_task(queue.submit(work(1)))
        kept = asyncio.create_task(queue.submit(work(1)))
        expiring = asyncio.create_task(queue.submit(replace(work(1), deadline=time.time() + 0.1)))
        await asyncio.sleep(0.03)
        cancelled.cancel()
        assert await expiring == "sampled"  # what an abandoned work answers is the sampler's to say
        assert await kept == "sampled"
        queue.stop()
        return sorted(asked[0]())

    abandoned_after_stop = run(scenario())
    assert seen[0] == [] and [0] in seen and seen[-1] == [0, 2]  # cancelled, then past its deadline too
    assert abandoned_after_stop == [0, 1, 2]  # the replica stopping: every work


def test_clients_take_turns_so_a_backlog_delays_another_client_by_one_call():
    async def scenario():
        sampler = Sampler(seconds=0.05)
        queue = sampling_queue(sampler, max_samples=8, wait_s=0.0, lone_wait_s=0.0)
        flood = [asyncio.create_task(queue.submit(replace(work(8), client="a"))) for _ in range(3)]
        flood += [asyncio.create_task(queue.submit(replace(work(8), client="b"))) for _ in range(3)]
        await asyncio.sleep(0.02)  # a's first call runs
        modest = asyncio.create_task(queue.submit(replace(work(1), client="c")))
        await asyncio.gather(*flood, modest)
        return [[w.client for w in works] for works in sampler.calls]

    # c's work came last and waits one call: then every client has been served once, and a and b
    # alternate. First come, first served, it would have waited for all six of theirs.
    assert run(scenario()) == [["a"], ["b"], ["c"], ["a"], ["b"], ["a"], ["b"]]


def test_an_idle_sampler_waits_to_fill_its_micro_batch_not_longer():
    async def scenario():
        sampler = Sampler()
        # A wait far longer than `run`'s 30 s: the test ends only if a full micro-batch starts at once.
        queue = sampling_queue(sampler, max_samples=32, wait_s=600, lone_wait_s=0.0)
        tasks = [asyncio.create_task(queue.submit(work())) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert sampler.calls == []  # 3 of a micro-batch of 4: still waiting
        tasks.append(asyncio.create_task(queue.submit(work())))
        await asyncio.gather(*tasks)  # the 4th filled it
        await queue.submit(work(4))  # and a full micro-batch does not wait at all
        return sampler.sizes()

    assert run(scenario()) == [4, 4]


def test_an_idle_sampler_waits_only_briefly_when_every_work_its_ingress_had_in_flight_is_here():
    async def scenario():
        sampler = Sampler()
        queue = sampling_queue(sampler, max_samples=32, wait_s=600, lone_wait_s=0.2)
        loop = asyncio.get_running_loop()
        start = loop.time()
        await queue.submit(work(companions=0))  # 1 of a micro-batch of 4, and nothing else was in flight
        assert loop.time() - start < 5  # lone_wait_s, not wait_s
        # A burst of two from an idle ingress: the first says nothing else was in flight, the second
        # counts the first. It joins within lone_wait_s; then all that was announced is here.
        start = loop.time()
        burst = [asyncio.create_task(queue.submit(work(companions=0)))]
        await asyncio.sleep(0.05)
        burst.append(asyncio.create_task(queue.submit(work(companions=1))))
        await asyncio.gather(*burst)
        assert loop.time() - start < 5
        # Work whose ingress had 3 more samples in flight is waited for, until they fill the micro-batch.
        tasks = [asyncio.create_task(queue.submit(work(companions=3)))]
        await asyncio.sleep(0.3)  # past lone_wait_s
        assert sampler.sizes() == [1, 2]
        tasks += [asyncio.create_task(queue.submit(work(companions=3))) for _ in range(3)]
        await asyncio.gather(*tasks)
        return sampler.sizes()

    assert run(scenario()) == [1, 2, 4]


def test_a_scorers_queue_takes_everything_that_waits_at_once_or_one_group_a_call():
    async def scenario(max_samples):
        scorer = Sampler(seconds=0.05)  # the queue runs whatever calls it is given
        queue = BatchingQueue(scorer, max_samples)  # no groups, no waiting: a scorer replica's
        first = asyncio.create_task(queue.submit(work(3)))
        await asyncio.sleep(0.01)  # a lone part is scored at once
        await asyncio.gather(first, *(queue.submit(work(3)) for _ in range(3)))
        return scorer.sizes()

    assert run(scenario(max_samples=8)) == [3, 6, 3]  # per-sample: what waits, up to the limit
    assert run(scenario(max_samples=0)) == [3, 3, 3, 3]  # group-aware: one group a call
