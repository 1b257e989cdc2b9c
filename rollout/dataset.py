"""Rollouts on disk: one safetensors shard per batch plus a small JSON index.

Format 3. A shard holds per-sample tensors stacked along a leading sample axis (``image``,
``final_latents``, ``log_probs``, ``latents``, ``latent_step_indices``) and its batch's whole
schedule once (``schedule.sigmas``, ``schedule.timesteps``, ``schedule.model_timesteps``).
``index.json`` lists the shards, each with its byte size and SHA-256, the model that sampled it,
the weight versions of its samples and its sampling options, and one record per sample (shard, row,
prompt, seed, weight version, request; a tree rollout's leaf also its `branch_steps`,
`branch_factors` and `branch_path`, and where they are not the defaults its `branch_noise_scales`,
`branch_log_prob_std` and `branch_shape`; a scored sample its `rewards` and `advantages`; an
image-conditioned sample the digests of its prompt's `condition_images`, whose pixels the shard
holds once each as ``condition_image.<digest>``); ``complete`` says whether the writer was closed.

Nothing is ever half-written: each file is written under a temporary name, synced, then renamed,
and the index is rewritten after each shard, so a writer stopped at any moment (an exception, a
kill, a power cut) leaves a dataset that loads, holding the shards written so far. A shard that
is not the file its index entry describes (truncated, overwritten, partly zeroed) is named by a
`DamagedShardError` when it is loaded, or skipped with ``on_damaged="skip"``.

Format 2 is format 3 without sizes and checksums: it loads, but a shard damaged where its
safetensors header still parses loads unnoticed.

Format 1 stored no ``model_timesteps``, and its loader put ``timesteps`` in their place: right for
the embedded model and SD3, 1000x too large for FLUX.1 and Qwen-Image, whose transformers take
``timesteps / 1000``. It loads only where the time input is proven to be ``timesteps``: given the
pipeline that sampled it, whose schedule for each shard's options must be bit-identical to the
stored one and whose time input must be its ``timesteps``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from rollout.errors import RolloutError, clip, short_repr
from rollout.input_images import InputImage
from rollout.models.base import RolloutPipeline
from rollout.options import SamplingOptions
from rollout.schedule import ScheduleSnapshot
from rollout.trajectory import RolloutBatch, SampleTrajectory
from rollout.tree import Branching, BranchLogProbStd, BranchShape

INDEX_FILE = "index.json"
FORMAT_VERSION = 3
LOADABLE_FORMATS = (1, 2, FORMAT_VERSION)
# A file being written is named so until it is whole; no index lists it.
PARTIAL_SUFFIX = ".partial"
# `SampleTrajectory` fields stored per sample, under their own names.
PER_SAMPLE_TENSORS = ("image", "final_latents", "log_probs", "latents", "latent_step_indices")
# `ScheduleSnapshot` fields, each stored once per shard as `schedule.<name>`; the optional ones
# (a two-expert model's `model_experts`) where the schedule has them.
SCHEDULE_TENSORS = tuple(f.name for f in dataclasses.fields(ScheduleSnapshot))
OPTIONAL_SCHEDULE_TENSORS = ("model_experts",)
# A prompt's input images, each `(3, H, W)` uint8, stored once per shard as `condition_image.<digest>`.
CONDITION_IMAGE = "condition_image"
REGENERATE = "regenerate it with `python -m deployments.job` (which writes format 3)"
# A message quotes a path and an excerpt or two, as `rollout.errors`' reasons do.
MAX_MESSAGE_CHARS = 500


class DatasetFormatError(RolloutError, ValueError):
    """A rollout dataset that cannot be loaded as it is: an unreadable index or one of an unknown
    format, an index entry naming a file outside the dataset's directory, a damaged shard
    (`DamagedShardError`), or a format-1 dataset whose time input cannot be proven."""


class DamagedShardError(DatasetFormatError):
    """A shard that cannot be read, lacks a tensor, or is not the file its index entry describes.

    Attributes:
        path: the shard's file.
        reason: what is wrong with it.
    """

    def __init__(self, path: str | Path, reason: str):
        self.path = Path(path)
        self.reason = reason
        super().__init__(clip(f"{path}: {reason}", MAX_MESSAGE_CHARS))

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


class DatasetExistsError(RolloutError, FileExistsError):
    """The directory holds a dataset already; a writer continues it only when told to (`resume=True`)."""


class RolloutDatasetWriter:
    """Writes batches as shards into `directory`, and its index at once and after each shard.

    A directory that holds an index already is refused (`DatasetExistsError`) unless `resume`: then
    the shards its index lists are kept up to the first one that fails its check
    (`damaged_on_resume`), and the next shard is written after them. `close()` (or leaving the
    `with` without an exception) marks the dataset complete; a writer never closed still leaves a
    dataset that loads (see the module's docstring).
    """

    def __init__(self, directory: str | Path, metadata: dict[str, Any] | None = None, *, resume: bool = False):
        self.directory = Path(directory)
        self.metadata = metadata or {}
        self.shards: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.damaged_on_resume: DamagedShardError | None = None
        index_path = self.directory / INDEX_FILE
        if index_path.exists():
            if not resume:
                raise DatasetExistsError(
                    f"{clip(str(index_path))}: a dataset is there already; resume=True continues it"
                )
            self._keep_intact_shards(read_index(self.directory))
        self.directory.mkdir(parents=True, exist_ok=True)
        self._write_index(complete=False)

    def _keep_intact_shards(self, index: dict[str, Any]) -> None:
        if index["format"] != FORMAT_VERSION:
            raise DatasetFormatError(
                f"{clip(str(self.directory / INDEX_FILE))}: format {index['format']} records no checksums to check "
                f"its shards by; only format {FORMAT_VERSION} is resumed"
            )
        for info in index["shards"]:
            try:
                _check_shard(self.directory / info["file"], info)
            except DamagedShardError as error:
                self.damaged_on_resume = error
                break
            self.shards.append(info)
        self.samples = [record for record in index["samples"] if record["shard"] < len(self.shards)]

    def write(self, batch: RolloutBatch, sample_records: list[dict[str, Any]] | None = None) -> Path:
        """Writes one batch as the next shard; `sample_records` add fields to each sample's record."""
        shard = len(self.shards)
        path = self.directory / f"shard-{shard:05d}.safetensors"
        samples = batch.samples
        tensors = {name: torch.stack([getattr(s, name) for s in samples]) for name in PER_SAMPLE_TENSORS}
        schedule = {name: getattr(batch.schedule, name) for name in SCHEDULE_TENSORS}
        tensors.update({f"schedule.{name}": t for name, t in schedule.items() if t is not None})
        # A prompt's input images, once per shard whatever number of its samples it holds.
        tensors.update({f"{CONDITION_IMAGE}.{i.digest}": i.pixels for s in samples for i in s.condition_images})
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        # Cloned: safetensors refuses tensors that share memory (a schedule's may).
        save_file({name: t.contiguous().clone() for name, t in tensors.items()}, partial)
        size, sha256 = partial.stat().st_size, _sha256(partial)
        _publish(partial, path)
        versions = list(dict.fromkeys(s.weight_version for s in samples))
        self.shards.append(
            {
                "file": path.name,
                "bytes": size,
                "sha256": sha256,
                "num_samples": len(samples),
                "model": batch.model,
                "weight_versions": versions,
                "options": batch.options.to_plain(),
            }
        )
        records = sample_records or [{} for _ in samples]
        for row, (sample, extra) in enumerate(zip(samples, records)):
            record = {"shard": shard, "row": row, "prompt": sample.prompt, "negative_prompt": sample.negative_prompt}
            record.update(seed=sample.seed, weight_version=sample.weight_version)
            if sample.condition_images:
                record["condition_images"] = [image.digest for image in sample.condition_images]
            if sample.branching:  # a tree's leaf: its tree and its path (rollout/tree.py)
                branching = sample.branching
                record.update(
                    branch_steps=list(branching.steps), branch_factors=list(branching.factors), branch_path=list(sample.branch_path)
                )
                if branching.noise_scales:  # replay needs them where the log-prob takes the scaled std
                    record.update(branch_noise_scales=list(branching.noise_scales), branch_log_prob_std=branching.log_prob_std.value)
                if branching.is_comb:  # replay needs it: a comb's leaves take ODE steps where a tree's draw
                    record.update(branch_shape=branching.shape.value)
            for name in ("rewards", "advantages"):  # scored in the rollout (rollout/scorers)
                if getattr(sample, name) is not None:
                    record[name] = getattr(sample, name)
            self.samples.append({**record, **extra})
        self._write_index(complete=False)
        return path

    def close(self) -> Path:
        """Marks the dataset complete: every shard its producer meant to write is there."""
        return self._write_index(complete=True)

    def _write_index(self, complete: bool) -> Path:
        index = {
            "format": FORMAT_VERSION,
            **self.metadata,
            "complete": complete,
            "shards": self.shards,
            "samples": self.samples,
        }
        path = self.directory / INDEX_FILE
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        partial.write_text(json.dumps(index, indent=1) + "\n")
        _publish(partial, path)
        return path

    def __enter__(self) -> "RolloutDatasetWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        if exc_info[0] is None:
            self.close()


def _publish(partial: Path, path: Path) -> None:
    """Renames the whole file `partial` to `path`. Synced first, so that no crash, not even a power
    cut, leaves `path` naming fewer bytes than were written; then the directory, so the name stays."""
    with open(partial, "rb+") as file:
        os.fsync(file.fileno())
    os.replace(partial, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_index(directory: str | Path) -> dict[str, Any]:
    """`directory`'s index, of a known format, each shard's file a plain name inside `directory`.

    Raises `DatasetFormatError` naming the index and what is wrong with it.
    """
    directory = Path(directory)
    path = directory / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as error:  # ValueError: not UTF-8, or not JSON
        raise DatasetFormatError(clip(f"{path}: cannot be read ({error})", MAX_MESSAGE_CHARS)) from None
    if not isinstance(index, dict):
        raise DatasetFormatError(f"{clip(str(path))}: is not a JSON object")
    version = index.get("format")
    if version not in LOADABLE_FORMATS:
        raise DatasetFormatError(
            f"{clip(str(path))}: unknown rollout dataset format {short_repr(version)}; {REGENERATE}"
        )
    if not isinstance(index.get("shards"), list) or not isinstance(index.get("samples"), list):
        raise DatasetFormatError(f"{clip(str(path))}: lacks its list of shards or of samples")
    for number, info in enumerate(index["shards"]):
        name = info.get("file") if isinstance(info, dict) else None
        if not _is_file_name_inside(directory, name):
            raise DatasetFormatError(
                f"{clip(str(path))}: shard {number}'s file {short_repr(name)} is not a file name inside its directory"
            )
        if version == FORMAT_VERSION and not (
            isinstance(info.get("bytes"), int) and isinstance(info.get("sha256"), str)
        ):
            raise DatasetFormatError(f"{clip(str(path))}: shard {number} ({name}) lacks its size or SHA-256")
    return index


def _is_file_name_inside(directory: Path, name: Any) -> bool:
    """Whether `name` is a file's name, not a path: an index must not send a reader elsewhere, by
    `..`, an absolute path, or a link out of the directory."""
    if not isinstance(name, str) or not name or any(part in name for part in ("/", "\\", "..", "\0")):
        return False
    return (directory / name).resolve().parent == directory.resolve()


def _check_shard(path: Path, info: dict[str, Any]) -> None:
    """Raises `DamagedShardError` where `path` is not the file `info` describes (format 3 records its
    size and SHA-256; older formats, nothing to check)."""
    try:
        size = path.stat().st_size
    except OSError as error:
        raise DamagedShardError(path, f"cannot be read ({error.strerror})") from None
    if "bytes" in info and size != info["bytes"]:
        raise DamagedShardError(path, f"holds {size} bytes, not the {info['bytes']} its index records: cut short?")
    if "sha256" in info and _sha256(path) != info["sha256"]:
        raise DamagedShardError(path, "its SHA-256 is not the one its index records: its bytes changed")


OnDamaged = Literal["raise", "skip"]


def load_rollouts(
    directory: str | Path, pipeline: RolloutPipeline | None = None, *, on_damaged: OnDamaged = "raise"
) -> tuple[dict[str, Any], list[RolloutBatch]]:
    """The index and one `RolloutBatch` per shard, as written by `RolloutDatasetWriter`.

    Each shard is checked against its index entry (its size and SHA-256, from format 3) before it
    is read.

    Args:
        pipeline: only for a format-1 dataset: the model that sampled it, which proves its time
            input (see the module's docstring). Later formats hold their whole schedule.
        on_damaged: what a damaged shard (`DamagedShardError`: unreadable, lacking a tensor, or
            failing its check) does: ``"raise"``, or ``"skip"``: the intact shards are loaded, and
            the returned index lists only them under ``shards`` and their records under
            ``samples`` (each keeping its ``shard`` number on disk); ``skipped_shards`` holds
            ``{"shard", "file", "error"}`` for each shard left out.

    Raises `DatasetFormatError` naming the file and what is wrong with it. An index that cannot be
    read, is of an unknown format or names a file outside its directory is raised whatever
    `on_damaged` says.
    """
    if on_damaged not in ("raise", "skip"):
        raise ValueError(f"on_damaged: must be 'raise' or 'skip', not {short_repr(on_damaged)}")
    directory = Path(directory)
    index = read_index(directory)
    records_by_shard: dict[int, list[dict[str, Any]]] = {}
    for record in index["samples"]:
        records_by_shard.setdefault(record["shard"], []).append(record)
    batches, loaded, skipped = [], [], []
    for shard, info in enumerate(index["shards"]):
        records = sorted(records_by_shard.get(shard, []), key=lambda r: r["row"])
        try:
            batch = _load_shard(directory / info["file"], info, index["format"], records, pipeline)
        except DamagedShardError as error:
            if on_damaged == "raise":
                raise
            skipped.append({"shard": shard, "file": info["file"], "error": str(error)})
        else:
            batches.append(batch)
            loaded.append(shard)
    if on_damaged == "skip":
        kept = set(loaded)
        index = {
            **index,
            "shards": [index["shards"][shard] for shard in loaded],
            "samples": [record for record in index["samples"] if record["shard"] in kept],
            "skipped_shards": skipped,
        }
    return index, batches


def _load_shard(
    path: Path,
    info: dict[str, Any],
    version: int,
    records: list[dict[str, Any]],
    pipeline: RolloutPipeline | None,
) -> RolloutBatch:
    _check_shard(path, info)
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as error:
        raise DamagedShardError(path, f"is not a readable safetensors file ({clip(str(error))})") from None
    _check_tensors(path, tensors, PER_SAMPLE_TENSORS)
    options = SamplingOptions(**info["options"])
    if version == 1:
        schedule, model = _proven_format_1_schedule(path, tensors, options, pipeline)
    else:
        schedule, model = _stored_schedule(path, tensors), info["model"]
    condition_images = _condition_images(path, tensors, records)
    samples = [
        SampleTrajectory(
            schedule=schedule,
            prompt=record["prompt"],
            negative_prompt=record["negative_prompt"],
            condition_images=condition_images[row],
            seed=record["seed"],
            weight_version=record.get("weight_version"),
            rewards=record.get("rewards"),
            advantages=record.get("advantages"),
            **{name: tensors[name][row].clone() for name in PER_SAMPLE_TENSORS},
            **_branch_fields(record),
        )
        for row, record in enumerate(records)
    ]
    return RolloutBatch(schedule, options, model, samples)


def _condition_images(
    path: Path, tensors: dict[str, torch.Tensor], records: list[dict[str, Any]]
) -> list[tuple[InputImage, ...]]:
    """Each record's input images, from the shard's `condition_image.<digest>` tensors; a prompt's
    samples share one tuple. Raises `DamagedShardError` for an image missing or not its digest's."""
    images: dict[str, InputImage] = {}
    for digest in {digest for record in records for digest in record.get("condition_images", ())}:
        name = f"{CONDITION_IMAGE}.{digest}"
        _check_tensors(path, tensors, [name])
        try:
            image = InputImage(tensors[name])
        except ValueError as error:
            raise DamagedShardError(path, f"{name} is not an image: {error}") from None
        if image.digest != digest:
            raise DamagedShardError(path, f"{name} holds other pixels than its digest names")
        images[digest] = image
    shared: dict[tuple[str, ...], tuple[InputImage, ...]] = {}
    return [
        shared.setdefault(key, tuple(images[d] for d in key))
        for key in (tuple(record.get("condition_images", ())) for record in records)
    ]


def _branch_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A tree leaf's `branching` and `branch_path` from its record; nothing for an unbranched sample."""
    if "branch_path" not in record:
        return {}
    branching = Branching(
        tuple(record["branch_steps"]),
        tuple(record["branch_factors"]),
        tuple(record.get("branch_noise_scales", ())),
        record.get("branch_log_prob_std", BranchLogProbStd.SCALED),
        record.get("branch_shape", BranchShape.TREE),
    )
    return {"branching": branching, "branch_path": branching.check_path(record["branch_path"])}


def _check_tensors(path: Path, tensors: dict[str, torch.Tensor], names: Iterable[str]) -> None:
    missing = [name for name in names if name not in tensors]
    if missing:
        raise DamagedShardError(path, f"lacks {missing}; {REGENERATE}")


def _stored_schedule(path: Path, tensors: dict[str, torch.Tensor]) -> ScheduleSnapshot:
    required = [name for name in SCHEDULE_TENSORS if name not in OPTIONAL_SCHEDULE_TENSORS]
    _check_tensors(path, tensors, [f"schedule.{name}" for name in required])
    return ScheduleSnapshot(**{name: tensors[f"schedule.{name}"] for name in SCHEDULE_TENSORS if f"schedule.{name}" in tensors})


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
    own = pipeline.schedule(options.num_inference_steps, options.height, options.width, options.num_frames or 1)
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
