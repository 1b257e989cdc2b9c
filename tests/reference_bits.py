"""Same seeds, same bits: digests of a fixed set of rollouts, kept in `reference_digests.json`.

A refactor of the request path (planning, dispatch, transport, rows) must not change one bit of
what a request returns. The tests that own each path (`test_reference_bits.py` for the library,
`deployments/test_http.py` and `deployments/test_handle.py` for the embedded model served,
`deployments/test_real_families_app.py` for the real families served) run the requests below and
compare their digests with the committed ones, field by field, so a failure names the tensor
that changed.

The digests are those of one kernel set, stored under its name (`current_kernel_set`): the CPU
capability torch reports and the CPU's vendor, e.g. "AVX2 AuthenticAMD". Matmul bits differ by
ISA, and MKL's kernels (its vector math too) by vendor at the same ISA: held to AVX2, a
GenuineIntel Xeon (AVX512, AMX) gave the same code's library rollouts other bits than the
AuthenticAMD digests, in 3 to 7 fields each, down to the SDE's noise standard deviations (scalar
math, 1 ULP), where an AMD EPYC with AVX512 held to AVX2 matched every one (2026-12-04). Recorded:
"AVX2 AuthenticAMD" (every test's), "AVX2 GenuineIntel" (the library's) and "AVX512 AuthenticAMD"
(the served tests', on an AMD machine with AVX512 not held to AVX2: 2026-12-07, after the AVX2
digests, held to AVX2 there, had shown the code's bits unchanged but for `request_cost`, which a
change of the cost model had moved, and FLUX.1's app, whose sizes its fixture had changed). A test
whose kernel set has no digest for its key skips, naming the kernel sets that have one.

A CPU with more than AVX2 runs the AVX2 kernels when torch, MKL and oneDNN are held to it
(`AVX2_HOLD`; `ATEN_CPU_CAPABILITY` alone does not do: MKL's matmuls keep AVX512); not one
without AVX2: torch would then run instructions it lacks. `test_reference_bits.py` runs the
library's rollouts so, in a subprocess (`python -m tests.reference_bits OUT.json`), on every
machine with AVX2. The served tests compare in the kernel set of the pytest process and its Ray
workers; to hold them to AVX2:

    ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 \
        .venv/bin/python -m pytest tests/deployments/test_handle.py tests/deployments/test_http.py \
        tests/deployments/test_real_families_app.py -k "bits or digest or reference"

    ROLLOUT_WRITE_REFERENCE_DIGESTS=1 .venv/bin/python -m pytest tests -k reference_bits

records them anew in the kernel set each test runs in (only after a change that is meant to
change bits, said in its commit).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from rollout.testing.families import TINY_FAMILIES

DIGESTS_FILE = Path(__file__).with_name("reference_digests.json")
WRITE = os.environ.get("ROLLOUT_WRITE_REFERENCE_DIGESTS") == "1"
# What holds torch's own kernels, MKL's and oneDNN's to AVX2 on a CPU that has more.
AVX2_HOLD = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
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

def family_requests(family: str) -> dict[str, dict[str, Any]]:
    """Requests to a tiny real family, served (over HTTP and the handle)."""
    common = {"height": 32, "width": 32, "num_inference_steps": 3}
    return {
        "sde-guided-trajectory": {
            **common,
            **TINY_FAMILIES[family].guided,
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
LIBRARY_FAMILIES = tuple(name for name, record in TINY_FAMILIES.items() if not record.video)


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


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo; empty where there is none (not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {}
    for line in text.split("\n\n")[0].splitlines():
        name, _, value = line.partition(":")
        fields[name.strip()] = value.strip()
    return fields


def cpu_has_avx2() -> bool:
    flags = _cpuinfo().get("flags")
    if flags is None:  # no /proc/cpuinfo: what torch found (capped by ATEN_CPU_CAPABILITY if set)
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    return "avx2" in flags.split()


def current_kernel_set() -> str:
    """The kernels this process runs: torch's CPU capability and the CPU's vendor, e.g. "AVX2 AuthenticAMD"."""
    return f"{torch.backends.cpu.get_cpu_capability()} {_cpuinfo().get('vendor_id') or platform.machine()}"


def library_digests() -> dict[str, dict[str, str]]:
    """The digests of every library rollout (`LIBRARY_RUNS` on each of `LIBRARY_FAMILIES`) by key,
    run here: `test_reference_bits.py` runs it in a subprocess held to AVX2."""
    from rollout.micro_batching import MicroBatching
    from rollout.models.digits import DigitFlowPipeline
    from rollout.models.registry import load_pipeline
    from rollout.options import SamplingOptions
    from rollout.sampler import sample

    pipelines = {}
    digests = {}
    with tempfile.TemporaryDirectory() as root:
        for family in LIBRARY_FAMILIES:
            record = TINY_FAMILIES[family]
            if record.embedded:
                pipelines[family] = DigitFlowPipeline.from_pretrained()
            else:
                # Two guided samples a transformer call (SD3's takes both branches: 4 rows), two images a VAE call.
                micro_batching = MicroBatching(2 * record.rows_per_guided_sample, decode_default=2)
                directory = record.build(Path(root) / family)
                pipelines[family] = load_pipeline(record.model, directory, device="cpu", micro_batching=micro_batching)
        torch.set_num_threads(1)  # the served digests come from workers with one torch thread; the library's the same
        for family, pipeline in pipelines.items():
            embedded = TINY_FAMILIES[family].embedded
            for run, (prompts, seeds, fields, negatives) in sorted(LIBRARY_RUNS.items()):
                if embedded:
                    prompts = [str(len(p) % 10) for p in prompts]  # digits' own prompts
                    fields = {**fields, "height": None, "width": None}
                else:
                    fields = {**fields, "height": 32, "width": 32}
                negatives = None if negatives is None or embedded else negatives * len(prompts)
                batch = sample(pipeline, prompts, seeds, SamplingOptions(**fields), negatives, weight_version="v")
                digests[f"library:{family}:{run}"] = field_digests(batch_records(batch))
    return digests


class ReferenceDigests:
    """The committed digests by kernel set; `check` compares (or, with ROLLOUT_WRITE_REFERENCE_DIGESTS=1, records)."""

    def __init__(self):
        self.kernel_set = current_kernel_set()
        self.stored = json.loads(DIGESTS_FILE.read_text()) if DIGESTS_FILE.exists() else {}

    def check(self, key: str, digests: dict[str, str], kernel_set: str | None = None) -> None:
        """Compares `digests` with those recorded for `key` in `kernel_set` (this process's if None)."""
        kernel_set = kernel_set or self.kernel_set
        if WRITE:
            # Re-read: several test modules record into the one file.
            stored = json.loads(DIGESTS_FILE.read_text()) if DIGESTS_FILE.exists() else {}
            stored.setdefault(kernel_set, {})[key] = digests
            stored = {name: dict(sorted(recorded.items())) for name, recorded in sorted(stored.items())}
            DIGESTS_FILE.write_text(json.dumps(stored, indent=1) + "\n")
            return
        recorded_in = sorted(name for name, recorded in self.stored.items() if key in recorded)
        assert recorded_in, f"no reference digests for {key!r}; record them (see tests/reference_bits.py)"
        if kernel_set not in recorded_in:
            pytest.skip(f"reference digests of {key} are for kernel sets {recorded_in}, this is {kernel_set}")
        expected = self.stored[kernel_set][key]
        changed = sorted(path for path in expected.keys() | digests.keys() if expected.get(path) != digests.get(path))
        assert not changed, f"{key} ({kernel_set}): these fields changed bits: {changed}"


REFERENCE = ReferenceDigests()

if __name__ == "__main__":  # python -m tests.reference_bits OUT.json: the library's digests and their kernel set
    Path(sys.argv[1]).write_text(json.dumps({"kernel_set": current_kernel_set(), "digests": library_digests()}))
