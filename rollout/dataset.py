"""Rollouts on disk: one safetensors shard per batch plus a small JSON index.

A shard holds per-sample tensors stacked along a leading sample axis (``image``,
``final_latents``, ``log_probs``, ``latents``, ``latent_step_indices``) and its batch's schedule
once (``schedule.sigmas``, ``schedule.timesteps``). ``index.json`` lists the shards, each with its
sampling options, and one record per sample (shard, row, prompt, seed, request).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot
from rollout.trajectory import RolloutBatch, SampleTrajectory

INDEX_FILE = "index.json"
FORMAT_VERSION = 1
# `SampleTrajectory` fields stored per sample, under their own names.
PER_SAMPLE_TENSORS = ("image", "final_latents", "log_probs", "latents", "latent_step_indices")


def _options_to_json(options: SamplingOptions) -> dict[str, Any]:
    fields = dataclasses.asdict(options)
    fields["sde_type"] = options.sde_type.value
    return fields


class RolloutDatasetWriter:
    """Writes batches as shards into `directory`; `close()` (or leaving the `with`) writes the index."""

    def __init__(self, directory: str | Path, metadata: dict[str, Any] | None = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.metadata = metadata or {}
        self.shards: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []

    def write(self, batch: RolloutBatch, sample_records: list[dict[str, Any]] | None = None) -> Path:
        """Writes one batch as the next shard; `sample_records` add fields to each sample's record."""
        shard = len(self.shards)
        path = self.directory / f"shard-{shard:05d}.safetensors"
        samples = batch.samples
        tensors = {name: torch.stack([getattr(s, name) for s in samples]) for name in PER_SAMPLE_TENSORS}
        tensors["schedule.sigmas"] = batch.schedule.sigmas
        tensors["schedule.timesteps"] = batch.schedule.timesteps
        save_file({name: t.contiguous() for name, t in tensors.items()}, path)
        self.shards.append({"file": path.name, "num_samples": len(samples), "options": _options_to_json(batch.options)})
        records = sample_records or [{} for _ in samples]
        for row, (sample, extra) in enumerate(zip(samples, records)):
            record = {"shard": shard, "row": row, "prompt": sample.prompt, "negative_prompt": sample.negative_prompt}
            self.samples.append({**record, "seed": sample.seed, "weight_version": sample.weight_version, **extra})
        return path

    def close(self) -> Path:
        index = {"format": FORMAT_VERSION, **self.metadata, "shards": self.shards, "samples": self.samples}
        path = self.directory / INDEX_FILE
        path.write_text(json.dumps(index, indent=1) + "\n")
        return path

    def __enter__(self) -> "RolloutDatasetWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is None:
            self.close()


def load_rollouts(directory: str | Path) -> tuple[dict[str, Any], list[RolloutBatch]]:
    """The index and one `RolloutBatch` per shard, as written by `RolloutDatasetWriter`."""
    directory = Path(directory)
    index = json.loads((directory / INDEX_FILE).read_text())
    if index.get("format") != FORMAT_VERSION:
        raise ValueError(f"{directory}: unknown rollout dataset format {index.get('format')!r}")
    records_by_shard: dict[int, list[dict[str, Any]]] = {}
    for record in index["samples"]:
        records_by_shard.setdefault(record["shard"], []).append(record)
    batches = []
    for shard, info in enumerate(index["shards"]):
        tensors = load_file(directory / info["file"])
        schedule = ScheduleSnapshot(sigmas=tensors["schedule.sigmas"], timesteps=tensors["schedule.timesteps"])
        records = sorted(records_by_shard.get(shard, []), key=lambda r: r["row"])
        samples = [
            SampleTrajectory(
                schedule=schedule,
                prompt=record["prompt"],
                negative_prompt=record["negative_prompt"],
                seed=record["seed"],
                weight_version=record.get("weight_version"),
                **{name: tensors[name][row].clone() for name in PER_SAMPLE_TENSORS},
            )
            for row, record in enumerate(records)
        ]
        batches.append(RolloutBatch(schedule, SamplingOptions(**info["options"]), samples))
    return index, batches
