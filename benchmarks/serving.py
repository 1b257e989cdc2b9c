"""Measurements of the served paths, for the suite (`python -m benchmarks`).

Every comparison takes turns run by run ("rounds"), so that drift on a shared machine hits all
paths alike, and is reported per round as a ratio.
"""

from __future__ import annotations

import multiprocessing
import pickle
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Callable

import requests
import torch

from deployments.work import cut_into_work
from rollout.codec import from_msgpack
from rollout.plan import RequestLimits, plan_rollout
from rollout.schema import RolloutRequest


@dataclass(frozen=True)
class Spread:
    """min / median / max of per-round figures."""

    values: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def __format__(self, spec: str) -> str:
        spec = spec or ".2f"
        return f"{self.median:{spec}} ({min(self.values):{spec}} - {max(self.values):{spec}})"


def take_turns(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Wall times of each named run, one of each per round, after one warm-up each."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def speed_ratios(times: dict[str, list[float]], baseline: str) -> dict[str, Spread]:
    """Per round, each run's speed over the baseline's (its time over theirs)."""
    return {
        name: Spread(tuple(b / t for b, t in zip(times[baseline], series)))
        for name, series in times.items()
        if name != baseline
    }


def _sample_in_child(connection, threads: int) -> None:
    from rollout.models.registry import load_pipeline
    from rollout.sampler import sample

    torch.set_num_threads(threads)
    pipeline = load_pipeline()
    while (works := connection.recv()) is not None:
        for work in works:
            sample(pipeline, work.prompts, work.seeds, work.options, work.negative_prompts)
        connection.send(True)


class InProcessSampler:
    """The library alone in a separate process (as a worker replica is), sampling a plan's work in
    chunks of the worker's batch size."""

    def __init__(self, threads: int):
        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_sample_in_child, args=(child, threads), daemon=True)
        self._process.start()

    def run(self, body: dict, batch_size: int) -> None:
        self._connection.send(cut_into_work(plan_rollout(RolloutRequest(**body), RequestLimits()), 1, batch_size))
        self._connection.recv()

    def close(self) -> None:
        self._connection.send(None)
        self._process.join(timeout=30)


def msgpack_body(session: requests.Session, url: str, body: dict) -> bytes:
    response = session.post(url, json=body, headers={"Accept": "application/msgpack"})
    response.raise_for_status()
    return response.content


def post_msgpack(session: requests.Session, url: str, body: dict) -> list[dict]:
    return from_msgpack(msgpack_body(session, url, body))


def stored_bytes(value: object) -> int:
    """What Ray stores for a value: its pickle (protocol 5) plus the buffers it keeps out of band."""
    buffers: list[pickle.PickleBuffer] = []
    inline = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
    return len(inline) + sum(buffer.raw().nbytes for buffer in buffers)


def tensor_bytes(batch) -> int:
    return sum(
        t.nbytes
        for s in batch.samples
        for t in (s.image, s.final_latents, s.log_probs, s.latents, s.latent_step_indices)
    )


def own_tensors(batch) -> list[list[torch.Tensor]]:
    """The samples' tensors, each in its own storage, as a batch's samples held them before batches
    crossed processes stacked."""
    return [[t.clone() for t in (s.image, s.final_latents, s.log_probs, s.latents, s.latent_step_indices)] for s in batch.samples]


def pickle_round_trip(value: object) -> None:
    pickle.loads(pickle.dumps(value))


@dataclass(frozen=True)
class ClientLoad:
    clients: int
    samples_per_s: float
    p50_s: float
    p99_s: float


def concurrent_clients(url: str, body: dict, clients: int, requests_per_client: int) -> ClientLoad:
    """`clients` threads, each sending one-sample requests back to back over HTTP."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        with requests.Session() as session:
            for i in range(requests_per_client):
                start = time.perf_counter()
                post_msgpack(session, url, {**body, "seed": 1000 * index + i})
                with lock:
                    latencies.append(time.perf_counter() - start)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return ClientLoad(clients, len(latencies) / elapsed, statistics.median(latencies), p99)
