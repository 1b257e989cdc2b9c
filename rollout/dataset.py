"""Rollouts on disk: one safetensors shard per batch plus a small JSON index.

Format 2. A shard holds per-sample tensors stacked along a leading sample axis (``image``,
``final_latents``, ``log_probs``, ``latents``, ``latent_step_indices``) and its batch's whole
schedule once (``schedule.sigmas``, ``schedule.timesteps``, ``schedule.model_timesteps``).
``index.json`` lists the shards, each with the model that sampled it, the weight versions of its
samples and its sampling options, and one record per sample (shard, row, prompt, seed, weight
version, request).

Format 1 stored no ``model_timesteps``, and its loader put ``timesteps`` in their place: right for
the embedded model and SD3, 1000x too large for FLUX.1 and Qwen-Image, whose transformers take
``timesteps / 1000``. It loads only where the time input is proven to be ``timesteps``: given the
pipeline that sampled it, whose schedule for each shard's options must be bit-identical to the
stored one and whose time input must be its ``timesteps``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from rollout.errors import RolloutError
from rollout.models.base import RolloutPipeline
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot
from rollout.trajectory import RolloutBatch, SampleTrajectory

INDEX_FILE = "index.json"
FORMAT_VERSION = 2
# `SampleTrajectory` fields stored per sample, under their own names.
PER_SAMPLE_TENSORS = ("image", "final_latents", "log_probs", "latents", "latent_step_indices")
# `ScheduleSnapshot` fields, each stored once per shard as `schedule.<name>`.
SCHEDULE_TENSORS = tuple(f.name for f in dataclasses.fields(ScheduleSnapshot))
REGENERATE = "regenerate it with `python -m deployments.job` (which writes format 2)"


class DatasetFormatError(RolloutError, ValueError):
    """A rollout dataset that cannot be loaded as it is: an unknown format, a missing tensor, or a
    format-1 dataset whose time input cannot be proven."""


def _options_to_json(options: SamplingOptions) -> dict[str, Any]:
    fields = dataclasses.asdict(options)
    fields["sde_type"] = options.sde_type.value
    fields["log_prob_form"] = options.log_prob_form.value
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
        tensors.update({f"schedule.{name}": getattr(batch.schedule, name) for name in SCHEDULE_TENSORS})
        # Cloned: safetensors refuses tensors that share memory (a schedule's may).
        save_file({name: t.contiguous().clone() for name, t in tensors.items()}, path)
        versions = list(dict.fromkeys(s.weight_version for s in samples))
        self.shards.append(
            {
                "file": path.name,
                "num_samples": len(samples),
                "model": batch.model,
                "weight_versions": versions,
                "options": _options_to_json(batch.options),
            }
        )
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


def load_rollouts(
    directory: str | Path, pipeline: RolloutPipeline | None = None
) -> tuple[dict[str, Any], list[RolloutBatch]]:
    """The index and one `RolloutBatch` per shard, as written by `RolloutDatasetWriter`.

    Args:
        pipeline: only for a format-1 dataset: the model that sampled it, which proves its time
            input (see the module's docstring). A format-2 dataset holds its whole schedule.

    Raises `DatasetFormatError` naming the file and what is wrong with it.
    """
    directory = Path(directory)
    index = json.loads((directory / INDEX_FILE).read_text())
    version = index.get("format")
    if version not in (1, FORMAT_VERSION):
        raise DatasetFormatError(f"{directory / INDEX_FILE}: unknown rollout dataset format {version!r}; {REGENERATE}")
    records_by_shard: dict[int, list[dict[str, Any]]] = {}
    for record in index["samples"]:
        records_by_shard.setdefault(record["shard"], []).append(record)
    batches = []
    for shard, info in enumerate(index["shards"]):
        path = directory / info["file"]
        tensors = load_file(path)
        options = SamplingOptions(**info["options"])
        if version == 1:
            schedule, model = _proven_format_1_schedule(path, tensors, options, pipeline)
        else:
            schedule, model = _stored_schedule(path, tensors), info["model"]
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
        batches.append(RolloutBatch(schedule, options, model, samples))
    return index, batches


def _stored_schedule(path: Path, tensors: dict[str, torch.Tensor]) -> ScheduleSnapshot:
    missing = [f"schedule.{name}" for name in SCHEDULE_TENSORS if f"schedule.{name}" not in tensors]
    if missing:
        raise DatasetFormatError(f"{path}: lacks {missing}; {REGENERATE}")
    return ScheduleSnapshot(**{name: tensors[f"schedule.{name}"] for name in SCHEDULE_TENSORS})


def _proven_format_1_schedule(
    path: Path, tensors: dict[str, torch.Tensor], options: SamplingOptions, pipeline: RolloutPipeline | None
) -> tuple[ScheduleSnapshot, str]:
    """A format-1 shard's schedule, with `pipeline`'s time input where it provably is `timesteps`."""
    unproven = (
        f"{path.parent / INDEX_FILE} is rollout dataset format 1, which did not store the transformer's time "
        "input (model_timesteps)"
    )
    if pipeline is None:
        raise DatasetFormatError(
            f"{unproven}; {REGENERATE}, or pass the pipeline that sampled it, if its transformer takes the "
            "scheduler's timesteps as they are (the embedded model, SD3): load_rollouts(path, pipeline)"
        )
    own = pipeline.schedule(options.num_inference_steps, options.height, options.width)
    same_schedule = torch.equal(own.sigmas, tensors["schedule.sigmas"]) and torch.equal(
        own.timesteps, tensors["schedule.timesteps"]
    )
    if not same_schedule:
        raise DatasetFormatError(f"{unproven}, and {pipeline.name!r} does not give its schedule; {REGENERATE}")
    if not torch.equal(own.model_timesteps, own.timesteps.float()):
        raise DatasetFormatError(
            f"{unproven}, and {pipeline.name!r} does not take the scheduler's timesteps as they are; {REGENERATE}"
        )
    return own, pipeline.name
