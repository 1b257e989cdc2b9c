"""The benchmark suite: every serving figure in one run, written to docs/benchmarks.md.

    .venv/bin/python -m benchmarks               # about 27 minutes on 2 cores
    .venv/bin/python -m benchmarks --rounds 3    # quicker, noisier
    .venv/bin/python -m benchmarks --only rewards trees   # these sections, merged into the file

Starts a local Ray cluster with three applications (one worker replica; two; the default
configuration), takes turns between the paths it compares, and reports each comparison per
round as min / median / max. Not part of the test suite: speed is measured here, never asserted.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import tempfile
from pathlib import Path

import diffusers
import ray
import requests
import torch
from ray import serve

from benchmarks import codec, conditioning, rewards, schedule_exactness, throughput, trees
from benchmarks.serving import (
    InProcessSampler,
    Spread,
    concurrent_clients,
    msgpack_body,
    own_tensors,
    pickle_round_trip,
    post_msgpack,
    speed_ratios,
    stored_bytes,
    take_turns,
    tensor_bytes,
)
from deployments.app import build_app
from rollout.codec import to_json, to_msgpack
from rollout.kernels import BatchInvariance
from rollout.models.registry import load_pipeline
from rollout.plan import RequestLimits, plan_rollout
from rollout.rows import response_rows
from rollout.sampler import sample
from rollout.schema import RolloutRequest

STEPS = 20
LIGHT = {"num_inference_steps": STEPS, "rollout_debug_mode": False}
HEAVY = {**LIGHT, "rollout_debug_mode": True, "rollout_return_dit_trajectory": True}
# Room for a 128-leaf tree request beside work still finishing from the section before it (the
# default admits 4 batches, 128 samples, in all): 512 of the embedded model's samples, each 64
# tokens x 2 guided branches x STEPS and 64 decoded (rollout/cost.py).
ONE_REPLICA = {
    "num_worker_replicas": 1, "worker_num_cpus": 1, "worker_torch_threads": 1, "max_batch_size": 32,
    "max_queued_cost": 512 * (64 * 2 * STEPS + 64), "scorers": {},
}  # fmt: skip
# Parts of 8 samples: the first is scored while the other seven are sampled.
REWARDS_APP = {**ONE_REPLICA, "max_batch_size": 8}
TWO_REPLICAS = {**ONE_REPLICA, "num_worker_replicas": 2, "worker_num_cpus": 0.5}


def request(samples: int, prompts: int = 8, **fields) -> dict:
    per_prompt = samples // prompts
    return {**fields, "prompt": [str(d % 10) for d in range(prompts)], "num_outputs_per_prompt": per_prompt, "seed": 0}


class Suite:
    def __init__(self, rounds: int, port: int, only: list[str] | None = None):
        self.rounds = rounds
        self.only = only  # the sections run, merged into the existing results; None: all
        self.base = f"http://127.0.0.1:{port}"
        self.session = requests.Session()
        self.lines: list[str] = []
        self.targets: list[tuple[str, str, str]] = []  # figure, measured, target

    def section(self, title: str, *lines: str) -> None:
        self.lines += ["", f"## {title}", "", *lines]
        print(f"\n## {title}\n" + "\n".join(lines), flush=True)

    def deploy(self, name: str, config: dict):
        return serve.run(build_app({**config, "app_name": name}), name=name, route_prefix=f"/{name}")

    def url(self, app: str) -> str:
        return f"{self.base}/{app}/rollout/generate"

    # -----------------------------------------------------------------------------------------

    def served_against_in_process(self, one) -> None:
        sampler = InProcessSampler(threads=1)
        rows = ["| work | path | samples/s (median) | speed / in-process, per round |", "|---|---|---|---|"]
        try:
            for label, fields in (("light", LIGHT), ("heavy: all latents + debug", HEAVY)):
                body = request(64, **fields)
                times = take_turns(
                    {
                        "in-process": lambda: sampler.run(body, ONE_REPLICA["max_batch_size"]),
                        "handle": lambda: one.generate.remote(body).result().batch(),
                        "HTTP msgpack": lambda: post_msgpack(self.session, self.url("one"), body),
                    },
                    self.rounds,
                )
                ratios = speed_ratios(times, "in-process")
                for path, series in times.items():
                    rate = 64 / Spread(tuple(series)).median
                    rows.append(f"| {label} | {path} | {rate:.2f} | {ratios[path] if path in ratios else ''} |")
                kind = label.split(":")[0]
                self.targets.append((f"handle / in-process, {kind}", f"{ratios['handle']}", ">= 0.97" if kind == "light" else ">= 0.95"))
                self.targets.append((f"HTTP msgpack / in-process, {kind}", f"{ratios['HTTP msgpack']}", ">= 0.97" if kind == "light" else ">= 0.93"))
        finally:
            sampler.close()
        self.section(
            "Served paths against the library alone",
            f"64 samples (8 prompts x 8), {STEPS} SDE steps, one worker replica with 1 torch thread and batches "
            "of 32; the library alone runs the same plan in a separate process with 1 torch thread. Light: "
            "images and log-probs; heavy: also all 21 latents and the debug tensors. The handle path ends "
            "with `RolloutResult.batch()` in this process, the HTTP path with the decoded msgpack body.",
            "",
            *rows,
        )

    def worker_results(self, one) -> None:
        body = request(16, **LIGHT)
        fetched = one.generate.remote(body).result().fetch()
        stored = stored_bytes(fetched.parts) / 16
        sent = len(msgpack_body(self.session, self.url("one"), body)) / 16
        handle_tensors = tensor_bytes(fetched.batch()) / 16
        self.targets.append(
            ("worker result bytes per sample, light request", f"{stored / 1e3:.2f} KB (HTTP body {sent / 1e3:.2f} KB)",
             "what the response uses, +10%")
        )
        self.section(
            "Worker results of a light request",
            "A 16-sample request with no trajectory and no debug tensors. Stored: what Ray keeps for the worker's "
            "answer (pickle plus out-of-band buffers). The handle's answer is the `RolloutBatch` itself, whose "
            "tensors are the image, `final_latents`, the log-probs and an empty trajectory; the HTTP body "
            "leaves out `final_latents`.",
            "",
            "| per sample | bytes |",
            "|---|---|",
            f"| stored worker result | {stored:.0f} |",
            f"| tensors of the handle's `RolloutBatch` | {handle_tensors:.0f} |",
            f"| HTTP msgpack body | {sent:.0f} |",
        )

    def batch_transport(self, one) -> None:
        body = request(256, prompts=32, **LIGHT, rollout_return_dit_trajectory=True)
        result = one.generate.remote(body).result()
        batch = result.batch()
        size = tensor_bytes(batch)
        tensors = own_tensors(batch)
        times = take_turns({"batch()": result.batch, "per-tensor pickling": lambda: pickle_round_trip(tensors)}, self.rounds)
        speedup = speed_ratios(times, "per-tensor pickling")["batch()"]
        rate = Spread(tuple(size / t / 1e9 for t in times["batch()"]))
        old = Spread(tuple(size / t / 1e9 for t in times["per-tensor pickling"]))
        self.targets.append(("`.batch()` of 256 samples with full trajectories", f"{rate} GB/s, {speedup}x per-tensor pickling", ">= 4x faster, no copies"))
        self.section(
            "`RolloutResult.batch()` with full trajectories",
            f"256 samples with all {STEPS + 1} latents ({size / 1e6:.1f} MB of tensors) from one worker replica: "
            "`batch()` fetches the worker results from the object store and joins them. Each field crosses as one "
            "stacked numpy buffer that Ray maps without a copy. For comparison, the same tensors pickled one at a "
            "time (how batches crossed before).",
            "",
            "| path | GB/s |",
            "|---|---|",
            f"| `batch()` | {rate} |",
            f"| per-tensor pickling round trip | {old} |",
            f"| `batch()` speed / per-tensor pickling | {speedup} |",
        )

    def replicas(self, one, two) -> None:
        body = request(64, **LIGHT)
        times = take_turns(
            {"1 replica": lambda: one.generate.remote(body).result().batch(),
             "2 replicas": lambda: two.generate.remote(body).result().batch()},
            self.rounds,
        )
        ratio = speed_ratios(times, "1 replica")["2 replicas"]
        self.section(
            "One worker replica against two",
            f"A light 64-sample request through the handle, each replica with 1 torch thread, on {os.cpu_count()} cores.",
            "",
            "| replicas | samples/s (median) |",
            "|---|---|",
            *(f"| {name} | {64 / Spread(tuple(t)).median:.2f} |" for name, t in times.items()),
            f"| speed of 2 / speed of 1 | {ratio} |",
        )

    def burst(self, default) -> None:
        calls: list[list[int]] = []

        def one_request():
            default.generate.remote({**LIGHT, "prompt": "3", "num_outputs_per_prompt": 16}).result().batch()

        def sixteen_requests():
            responses = [default.generate.remote({**LIGHT, "prompt": "3", "seed": i}) for i in range(16)]
            parts = [part for r in responses for part in r.result().fetch().parts]
            calls.append(sorted(part.sampler_batch_size for part in parts))

        times = take_turns({"one 16-sample request": one_request, "16 one-sample requests": sixteen_requests}, self.rounds)
        ratio = speed_ratios(times, "one 16-sample request")["16 one-sample requests"]
        self.targets.append(("16 concurrent one-sample requests / one 16-sample request (default app)", f"{ratio}", ">= 0.90"))
        sizes = ", ".join("/".join(map(str, sorted(set(c)))) for c in calls[1:])
        self.section(
            "A burst of one-sample requests against one request",
            "The default application (2 worker replicas). 16 one-sample requests sent at once through the handle "
            "against the same 16 samples as one request. The burst's first request finds nothing else in flight; "
            "its worker waits `batch_lone_wait_s` (0.05 s) after the last arrival, so the rest of the burst joins it.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| speed of the burst / speed of one request | {ratio} |",
            f"| sampler call sizes the burst's samples saw, per round | {sizes} |",
        )

    def clients(self) -> None:
        rows = ["| clients | requests | samples/s | p50 latency (s) | p99 latency (s) |", "|---|---|---|---|---|"]
        body = {**LIGHT, "prompt": "3"}
        for clients in (1, 4, 16, 64):
            per_client = max(2, 8 // clients)
            load = concurrent_clients(self.url("default"), body, clients, per_client)
            rows.append(f"| {clients} | {clients * per_client} | {load.samples_per_s:.2f} | {load.p50_s:.3f} | {load.p99_s:.3f} |")
        self.section(
            "Concurrent HTTP clients",
            "Each client sends one-sample light requests back to back (as SGLang clients send), msgpack "
            "responses, against the default application. A request sent while nothing else is in flight "
            "waits `batch_lone_wait_s` (0.05 s) on an idle worker; one sent while others are in flight, "
            "and that would leave rows of the micro-batch empty, waits up to `batch_wait_timeout_s` (0.25 s).",
            "",
            *rows,
        )

    def payload_bytes(self) -> None:
        pipeline = load_pipeline()
        variants = {
            "light": request(8, **LIGHT),
            f"full trajectory ({STEPS + 1} latents)": request(8, **LIGHT, rollout_return_dit_trajectory=True),
            "SDE window: 2 of 10 steps, 3 latents": request(
                8, **{**LIGHT, "num_inference_steps": 10}, rollout_sde_step_indices=[3, 4], rollout_return_step_indices=[3, 4, 5]
            ),
            "debug": request(8, **{**LIGHT, "rollout_debug_mode": True}),
        }
        rows = ["| response | msgpack bytes/sample | JSON bytes/sample |", "|---|---|---|"]
        for label, body in variants.items():
            plan = plan_rollout(RolloutRequest(**body), RequestLimits())
            batch = sample(pipeline, plan.prompts, plan.seeds, plan.options, plan.negative_prompts)
            answer = response_rows(plan, batch, inference_time_s=0.0)
            rows.append(f"| {label} | {len(to_msgpack(answer)) / 8:.0f} | {len(to_json(answer)) / 8:.0f} |")
        self.section(
            "Response bytes per sample",
            f"8 samples of the embedded model (16x16 images, 1x16x16 latents), {STEPS} steps unless stated.",
            "",
            *rows,
        )

    def codec(self) -> None:
        rows = [
            "| body | MB | `to_msgpack` / copy | decode / copy | encode ms | decode ms |",
            "|---|---|---|---|---|---|",
        ]
        bodies = (
            ("real-size: 8 samples, 512x512, 11 latents + 10-step debug of 16x64x64", codec.real_size_rows(), codec.from_msgpack, "<= 4x each way"),
            ("digits: 16 samples, trajectory + debug + env", codec.digits_rows(), codec.from_msgpack, "<= 40x each way"),
            ("digits batch answer: the same samples, read back to a RolloutBatch", codec.digits_batch_answer(), codec.batch_of_answer, None),
        )
        for label, body, decoder, target in bodies:
            per_round = [codec.ratios(body, repeat=3, decode=decoder) for _ in range(self.rounds)]
            encode = Spread(tuple(r["encode_over_copy"] for r in per_round))
            decode = Spread(tuple(r["decode_over_copy"] for r in per_round))
            encode_ms = Spread(tuple(1e3 * r["encode_s"] for r in per_round))
            decode_ms = Spread(tuple(1e3 * r["decode_s"] for r in per_round))
            rows.append(f"| {label} | {per_round[0]['bytes'] / 1e6:.2f} | {encode:.1f} | {decode:.1f} | {encode_ms:.1f} | {decode_ms:.1f} |")
            if target is not None:
                self.targets.append((f"codec, {label.split(':')[0]}: encode / decode over a copy", f"{encode:.1f} / {decode:.1f}", target))
        self.section(
            "Wire codec against a plain copy",
            "Each round: the best of 3 timings of encoding (decoding) the body, over the best time of "
            "`torch.clone` of a uint8 tensor as large as the body, and in milliseconds. The rows are "
            "decoded with `from_msgpack`; the batch answer (`rollout.client`'s) with `from_msgpack` and "
            "`RolloutBatch.from_wire`, into the batch itself.",
            "",
            *rows,
        )

    def schedule(self, png: Path) -> None:
        rows, figures = schedule_exactness.measure()
        schedule_exactness.plot(figures, png)
        self.section(
            "Schedule exactness: `timesteps / 1000` against the returned sigmas",
            *schedule_exactness.table(rows),
            "",
            f"![fraction of steps whose rebuilt sigma differs]({png.name})",
        )

    def against_the_diffusers_pipeline(self) -> None:
        """Issue 18's comparison: the rollout against the family's own diffusers pipeline, at the
        micro-batch sizes a worker replica measures at start-up, against the pipeline decoding nothing (issue 18's
        baseline) and decoding its images too (equal work)."""
        loads = [(1, False), (16, False), (64, False), (16, True), (64, True)]
        pipeline_outputs = ("latent", "pt")
        # The B=64 calls take seconds: half the rounds of the other sections, the smaller loads all of them.
        rounds, small_load_rounds = max(3, self.rounds // 2), max(3, self.rounds)
        single_thread = torch.get_num_threads()
        torch.set_num_threads(os.cpu_count())  # as a trainer sampling in-process would run
        try:
            with tempfile.TemporaryDirectory() as root:
                families = throughput.build_families(Path(root))
                cells, calibrations = throughput.measure(
                    families, [], loads, rounds, calibrated=True, invariances=list(BatchInvariance),
                    pipeline_outputs=pipeline_outputs, small_load_rounds=small_load_rounds,
                )  # fmt: skip
                memory = throughput.peak_memory(families, **throughput.MEMORY_LOAD)
        finally:
            torch.set_num_threads(single_thread)

        def worst(selected) -> str:
            figures = []
            for output in pipeline_outputs:
                cell = max((c for c in selected if c.pipeline_output == output), key=lambda cell: cell.ratio.median)
                load = f"{cell.family}, B={cell.batch_size}{' with CFG' if cell.cfg else ''}"
                figures.append(f"{cell.ratio} ({load}) against `{output}`")
            return "; ".join(figures)

        for invariance in BatchInvariance:
            mode = [c for c in cells if c.invariance is invariance]
            self.targets += [
                (
                    f"rollout / diffusers pipeline time at B=16 and 64, every family, with and without CFG, batch "
                    f"invariance by {invariance.value} (worst cell)",
                    worst([c for c in mode if c.batch_size >= 16]),
                    "<= 1.05",
                ),
                (
                    f"rollout / diffusers pipeline time at B=1, batch invariance by {invariance.value} (worst family)",
                    worst([c for c in mode if c.batch_size == 1]),
                    "<= 1.3 (stretch)",
                ),
            ]
        closest = max(memory, key=lambda row: row.rollout / row.target)
        self.targets.append(
            (
                "peak memory, B=64, T=50, 256 px: rollout (target: 1.3 x latents kept + pipeline's peak), family closest to its target",
                f"{closest.family}: {closest.rollout / 1e6:.0f} MB (target {closest.target / 1e6:.0f} MB)",
                "<= target",
            )
        )
        self.section(
            "The rollout against the diffusers pipeline it wraps",
            f"`benchmarks/throughput.py` (details, other micro-batch sizes, and the runs before issue 18: "
            f"docs/throughput.md): tiny SD3, FLUX.1 and Qwen-Image copies widened to width 128, 128 x 128 px, ODE, "
            f"every latent and log-prob kept, batch invariance by padding and by batch-invariant kernels, "
            f"{os.cpu_count()} torch threads, each family at the transformer's and the VAE's micro-batch sizes a "
            f"worker replica measures for it at start-up by default (`rollout.calibration.calibrate_at_start`: the "
            f"model's default guidance, batches of 16; under the kernels the VAE decodes an image a call):",
            "",
            *(f"- {report}" for report in calibrations),
            "",
            f"Rollout time over `pipeline(...)` time, median (min - max) of {small_load_rounds} rounds at B=1 and 16, "
            f"{rounds} at B=64, against the pipeline "
            f"with `output_type=\"latent\"` (it decodes nothing, the rollout decodes its images: issue 18's "
            f"baseline) and `\"pt\"` (it decodes them too: equal work), both in the same rounds.",
            "",
            *throughput.table(cells, loads),
            "",
            *throughput.memory_table(memory, **throughput.MEMORY_LOAD),
        )

    def tree_rollouts(self, one) -> None:
        """Issue 19: a tree's transformer rows and wall time against the same request unbranched."""
        runs, rows = trees.library_runs()
        figures = trees.measure(runs, rows, self.rounds)

        def served(branching):
            parts = one.generate.remote(trees.request_fields(branching)).result().fetch().parts
            return sum(part.transformer_rows for part in parts)  # one call a part: chunks of a whole batch

        served_rows = {name: served(branching) for name, branching in trees.TREES.items()}
        served_runs = {
            name: (lambda b=branching: one.generate.remote(trees.request_fields(b)).result().batch())
            for name, branching in trees.TREES.items()
        }
        served_figures = trees.measure(served_runs, served_rows, self.rounds)
        for path, results in (("library", figures), ("handle", served_figures)):
            for f in results[1:]:
                self.targets.append(
                    (
                        f"tree rollout, {f.name}, {path}: wall time / unbranched (row ratio {f.row_ratio:.3f})",
                        f"{f.time_ratio}",
                        f"within 15% of {f.row_ratio:.3f}",
                    )
                )
        self.section(
            "Tree rollouts against the same request unbranched",
            f"`benchmarks/trees.py`: {trees.PROMPTS} prompts x {trees.OUTPUTS} outputs of the embedded model, "
            f"{trees.STEPS} steps, SDE window {list(trees.WINDOW)}, latents x_4 .. x_6 kept; the library in this "
            f"process (1 torch thread, micro-batch 8) and the handle to the one-replica application (batches of "
            f"{ONE_REPLICA['max_batch_size']}, whole roots), the trees taking turns, median (min - max) of "
            f"{self.rounds} rounds.",
            "",
            *trees.table(figures, "library"),
            *trees.table(served_figures, "handle")[2:],
        )

    def conditioning(self) -> None:
        """Issue 47: an editing request's input image against text-to-image, and encoding it once a
        prompt against once a sample."""
        family = "qwenimage_edit"  # an editing model whose text encoder reads the image too: the dearest to condition
        self.section(
            "What an input image costs",
            *conditioning.run(family, self.rounds),
            "",
            "Taking turns, median (min - max) of the rounds, in this process on 1 torch thread. The tiny copy "
            "resizes the input image to the published model's megapixel, so its condition outnumbers the noise "
            "tokens here; at the published 1024x1024 the two are about equal.",
        )

    def rewards(self) -> None:
        """Issue 21: a CPU-bound scorer costing a third of the rollout, as each part is sampled
        against after the whole rollout."""
        calibration = self.deploy("rewards", REWARDS_APP)
        plain = rewards.body()
        rollout_s = Spread(tuple(take_turns({"rollout": lambda: calibration.generate.remote(plain).result().batch()}, 3)["rollout"])).median
        app = self.deploy("rewards", {**REWARDS_APP, "scorers": {"busy": rewards.scorer_config(rollout_s)}})
        times, reward_times = rewards.measure(app, "rewards", self.rounds)
        overlapped = Spread(tuple(t / a for t, a in zip(times["scored as sampled"], times["rollout alone"])))
        self.targets.append(("rewards scored as sampled: end to end / rollout alone", f"{overlapped:.3f}", "<= 1.1"))
        self.section(
            "Rewards in the rollout",
            f"`benchmarks/rewards.py`: {rewards.PROMPTS} prompts x {rewards.OUTPUTS} outputs, {rewards.STEPS} SDE steps, "
            f"one worker replica (1 torch thread) taking parts of {REWARDS_APP['max_batch_size']}; a CPU-bound scorer "
            f"(`BusyInk`, its own replica on its own core) set to a third of the rollout's {rollout_s:.2f} s. Through the "
            "handle: the rollout alone; the same request with `rollout_reward_models` (each part scored as soon as it is "
            "fetched); the rollout, then the same scorer deployment on the whole batch. Taking turns, median (min - max) "
            f"of {self.rounds} rounds.",
            "",
            *rewards.table(times, reward_times),
        )
        serve.delete("rewards")

    def write(self, path: Path, elapsed_s: float) -> None:
        machine = f"{platform.machine()}, {os.cpu_count()} cores"
        versions = f"Python {platform.python_version()}, torch {torch.__version__}, diffusers {diffusers.__version__}, ray {ray.__version__}"
        head = [
            "# Benchmarks",
            "",
            f"Command: `.venv/bin/python -m benchmarks --rounds {self.rounds}` ({elapsed_s / 60:.1f} min).  ",
            f"Machine: {machine}; {versions}.  ",
            f"Date: {datetime.date.today().isoformat()}. Figures are median (min - max) over {self.rounds} rounds "
            "taken in turns after a warm-up.",
            "",
            "## Summary",
            "",
            "| figure | measured | target |",
            "|---|---|---|",
            *(f"| {figure} | {measured} | {target} |" for figure, measured, target in self.targets),
        ]
        if self.only:
            head, self.lines = self._merged_into(path, head)
        path.write_text("\n".join(head + self.lines) + "\n")

    def _merged_into(self, path: Path, head: list[str]) -> tuple[list[str], list[str]]:
        """`path`'s figures, with this run's sections and summary rows in place of theirs (`--only`)."""
        old = path.read_text().rstrip("\n").split("\n")
        summary = old.index("## Summary")
        first_section = next(i for i in range(summary + 1, len(old)) if old[i].startswith("## "))
        mine = {figure for figure, _, _ in self.targets}
        rows = [row for row in old[summary + 4 : first_section] if row.startswith("| ") and row[2:].split(" | ")[0] not in mine]
        rows += [f"| {figure} | {measured} | {target} |" for figure, measured, target in self.targets]
        sections = _sections(old[first_section:])
        mine_sections = _sections(self.lines)
        sections.update(mine_sections)
        titles = ", ".join(f'"{title[3:]}"' for title in mine_sections)
        note = f"Re-measured {datetime.date.today().isoformat()} with `--only {' '.join(self.only)}` ({head[2].split('(')[-1][:-4]}): {titles}.  "
        head = [*old[: summary - 1], note, "", *head[head.index("## Summary") : head.index("|---|---|---|") + 1], *rows]
        return head, [line for lines in sections.values() for line in lines]


def _sections(lines: list[str]) -> dict[str, list[str]]:
    """A document's "## " sections by title, in order, each with its blank line before."""
    sections: dict[str, list[str]] = {}
    title = None
    for line in lines:
        if line.startswith("## "):
            title = line
            sections[title] = [""]
        if title is not None:
            sections[title].append(line)
    return {title: _without_trailing_blanks(body) for title, body in sections.items()}


def _without_trailing_blanks(lines: list[str]) -> list[str]:
    while lines and not lines[-1]:
        lines = lines[:-1]
    return lines


SECTIONS = [
    "payload", "codec", "schedule", "pipeline", "conditioning", "served", "worker-results", "transport", "replicas",
    "trees", "rewards", "burst", "clients",
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--output", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument(
        "--only", nargs="+", choices=SECTIONS, help="run these sections and merge them into --output's other figures"
    )
    args = parser.parse_args()
    start = datetime.datetime.now()
    suite = Suite(args.rounds, args.port, args.only)
    run = set(args.only or SECTIONS)
    torch.set_num_threads(1)
    if "payload" in run:
        suite.payload_bytes()
    if "codec" in run:
        suite.codec()
    if "schedule" in run:
        suite.schedule(args.output.parent / "schedule_exactness.png")
    if "pipeline" in run:
        suite.against_the_diffusers_pipeline()
    if "conditioning" in run:
        suite.conditioning()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    try:
        apps = {}

        def app(name: str, config: dict):
            if name not in apps:
                apps[name] = suite.deploy(name, config)
            return apps[name]

        if "served" in run:
            suite.served_against_in_process(app("one", ONE_REPLICA))
        if "worker-results" in run:
            suite.worker_results(app("one", ONE_REPLICA))
        if "transport" in run:
            suite.batch_transport(app("one", ONE_REPLICA))
        if "replicas" in run:
            suite.replicas(app("one", ONE_REPLICA), app("two", TWO_REPLICAS))
        if "trees" in run:
            suite.tree_rollouts(app("one", ONE_REPLICA))
        if "rewards" in run:
            suite.rewards()
        if "burst" in run:
            suite.burst(app("default", {}))
        if "clients" in run:
            app("default", {})  # its HTTP route
            suite.clients()
    finally:
        serve.shutdown()
        ray.shutdown()
    suite.write(args.output, (datetime.datetime.now() - start).total_seconds())


if __name__ == "__main__":
    main()
