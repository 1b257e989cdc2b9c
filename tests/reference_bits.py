"""Same seeds, same bits: digests of a fixed set of rollouts, kept in `reference_digests.json`.

A refactor of the request path (planning, dispatch, transport, rows) must not change one bit of
what a request returns. The tests that own each path (`test_reference_bits.py` for the library,
`deployments/test_http.py` and `deployments/test_handle.py` for the embedded model served,
`deployments/test_real_families_app.py` for the real families served) run the requests below and
compare their digests with the committed ones, field by field, so a failure names the tensor
that changed.

The digests are those of one kernel set: the CPU capability torch reports is stored with them,
and on another the comparison is skipped (with a reason), since matmul bits differ by ISA.
An x86 machine above the recorded AVX2 can run (and record) them by holding torch, MKL and oneDNN
to AVX2 for the run:

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python -m pytest tests/test_reference_bits.py tests/deployments/test_handle.py \
        tests/deployments/test_http.py tests/deployments/test_real_families_app.py

On an AMD EPYC reporting AVX512 (2026-12-04) every digest recorded on an AVX2 machine matched this
way (the library's 12 tests, and the served ones: 14 passed with `-k "bits or digest or reference"`);
`ATEN_CPU_CAPABILITY` alone did not (MKL's matmuls kept AVX512). Not
on a processor without AVX2: torch then runs instructions it lacks.

    ROLLOUT_WRITE_REFERENCE_DIGESTS=1 .venv/bin/python -m pytest tests -k reference_bits

records them anew (only after a change that is meant to change bits, said in its commit).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

DIGESTS_FILE = Path(__file__).with_name("reference_digests.json")
WRITE = os.environ.get("ROLLOUT_WRITE_REFERENCE_DIGESTS") == "1"
# Row keys whose values differ between two runs of the same request by design, and the
# transformer's rows, which follow the server's micro-batches rather than the samples' bits
# (`rollout/cost.py`; tests/test_cost.py and tests/deployments/test_tree_app.py check them).
VOLATILE_ROW_KEYS = frozenset({"request_id", "inference_time_s", "transformer_rows", "transformer_rows_unbranched"})

# Requests to the embedded model (the session's application), over HTTP and the handle.
DIGITS_REQUESTS: dict[str, dict[str, Any]] = {
    "sde-trajectory-debug": {
        "prompt": ["3", "a handwritten 7"],
        "num_outputs_per_prompt": 2,
        "num_inference_steps": 6,
        "seed": 11,
        "rollout_return_dit_trajectory": True,
    },
    "cps-window-filter-no-const": {
        "prompt": "the digit 5",
        "num_outputs_per_prompt": 3,
        "num_inference_steps": 7,
        "seed": 400,
        "rollout_sde_type": "cps",
        "rollout_noise_level": 0.5,
        "rollout_sde_step_indices": [1, 2, 4],
        "rollout_return_step_indices": [0, 2, 3, 7],
        "rollout_log_prob_no_const": True,
    },
    "ode-env-guided": {
        "prompt": ["1", "8"],
        "negative_prompt": ["", "2"],
        "num_inference_steps": 5,
        "seed": 3,
        "guidance_scale": 3.0,
        "rollout_sde_type": "ode",
        "rollout_return_denoising_env": True,
        "rollout_debug_mode": False,
        "rollout_return_dit_trajectory": True,
    },
    "sde-true-cfg-form-empty-filter": {
        "prompt": "nine",
        "num_outputs_per_prompt": 2,
        "num_inference_steps": 4,
        "seed": 77,
        "true_cfg_scale": 1.5,
        "rollout_noise_level": 1.1,
        "rollout_log_prob_form": "gaussian_no_const",
        "rollout_return_step_indices": [],
    },
    "evaluation": {"prompt": ["0", "6"], "num_inference_steps": 5, "seed": 9, "rollout": False},
}

FAMILY_GUIDANCE = {"sd3": {"guidance_scale": 4.5}, "flux": {"true_cfg_scale": 2.5}, "qwenimage": {"true_cfg_scale": 4.0}}


def family_requests(family: str) -> dict[str, dict[str, Any]]:
    """Requests to a tiny real family, served (over HTTP and the handle)."""
    common = {"height": 32, "width": 32, "num_inference_steps": 3}
    return {
        "sde-guided-trajectory": {
            **common,
            **FAMILY_GUIDANCE[family],
            "prompt": ["a red cube", "a cat"],
            "negative_prompt": "blurry",
            "num_outputs_per_prompt": 2,
            "seed": 21,
            "rollout_return_dit_trajectory": True,
            "rollout_return_denoising_env": True,
        },
        "cps-window-filter": {
            **common,
            "width": 64,
            "prompt": "a dog in the garden",
            "num_outputs_per_prompt": 2,
            "seed": 5,
            "rollout_sde_type": "cps",
            "rollout_sde_step_indices": [1],
            "rollout_return_step_indices": [1, 2],
            "rollout_debug_mode": False,
        },
        "ode": {**common, "prompt": "a photo", "seed": 8, "rollout_sde_type": "ode", "rollout_return_dit_trajectory": True},
    }


# Rollouts run by the library itself: (prompts, seeds, `SamplingOptions` fields, negative prompts).
LIBRARY_RUNS: dict[str, tuple[list[str], list[int], dict[str, Any], list[str] | None]] = {
    "sde-all": (["a cat", "a dog", "a cat"], [0, 1, 2], {"num_inference_steps": 3, "debug": True}, None),
    "cps-window-filter": (
        ["a red chair"],
        [40],
        {"num_inference_steps": 4, "sde_type": "cps", "sde_step_indices": (1, 2), "return_step_indices": (0, 2, 3)},
        ["blurry"],
    ),
    "ode-env": (["a garden", "a photo"], [7, 8], {"num_inference_steps": 3, "sde_type": "ode", "return_denoising_env": True}, None),
}


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return f"{flat.dtype}{tuple(tensor.shape)}".encode() + flat.view(torch.uint8).numpy().tobytes()


def _leaves(value: Any, path: str = ""):
    """(path, leaf) pairs of nested maps, tensors and plain values, in key order."""
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _leaves(value[key], f"{path}.{key}" if path else str(key))
    else:
        yield path, value


def field_digests(records: list[dict[str, Any]]) -> dict[str, str]:
    """One SHA-256 per field path over all records, in order: `{"dit_trajectory.sigmas": ...}`."""
    hashers: dict[str, Any] = {}
    for i, record in enumerate(records):
        for path, leaf in _leaves({key: value for key, value in record.items() if key not in VOLATILE_ROW_KEYS}):
            hasher = hashers.setdefault(path, hashlib.sha256())
            hasher.update(f"[{i}]".encode())
            hasher.update(_tensor_bytes(leaf) if isinstance(leaf, torch.Tensor) else repr(leaf).encode())
    return {path: hasher.hexdigest()[:20] for path, hasher in sorted(hashers.items())}


def batch_records(batch) -> list[dict[str, Any]]:
    """A `RolloutBatch` as records: one for its per-request data, then one per sample."""
    options = {field.name: getattr(batch.options, field.name) for field in dataclasses.fields(batch.options)}
    options = {name: getattr(value, "value", value) for name, value in options.items()}  # enums by value
    schedule = {name: getattr(batch.schedule, name) for name in ("sigmas", "timesteps", "model_timesteps")}
    records = [{"schedule": schedule, "options": options}]
    for s in batch.samples:
        plain = {"prompt": s.prompt, "negative_prompt": s.negative_prompt, "seed": s.seed, "weight_version": s.weight_version}
        records.append({**plain, **s.tensors(), "denoising_env": s.denoising_env})
    return records


class ReferenceDigests:
    """The committed digests; `check` compares (or, with ROLLOUT_WRITE_REFERENCE_DIGESTS=1, records)."""

    def __init__(self):
        self.capability = torch.backends.cpu.get_cpu_capability()
        self.stored = json.loads(DIGESTS_FILE.read_text()) if DIGESTS_FILE.exists() else {}

    def check(self, key: str, digests: dict[str, str]) -> None:
        if WRITE:
            # Re-read: several test modules record into the one file.
            stored = json.loads(DIGESTS_FILE.read_text()) if DIGESTS_FILE.exists() else {}
            stored["cpu_capability"] = self.capability
            stored.setdefault("digests", {})[key] = digests
            stored["digests"] = dict(sorted(stored["digests"].items()))
            DIGESTS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
            return
        if self.stored.get("cpu_capability") != self.capability:
            pytest.skip(f"reference digests are for CPU capability {self.stored.get('cpu_capability')}, this is {self.capability}")
        expected = self.stored["digests"].get(key)
        assert expected is not None, f"no reference digests for {key!r}; record them (see tests/reference_bits.py)"
        changed = sorted(path for path in expected.keys() | digests.keys() if expected.get(path) != digests.get(path))
        assert not changed, f"{key}: these fields changed bits: {changed}"


REFERENCE = ReferenceDigests()
