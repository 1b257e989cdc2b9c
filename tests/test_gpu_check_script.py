"""The GPU check script runs end to end on the tiny copies, on the CPU: what can be checked of it
before it reaches a GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def findings_by_family(tmp_path_factory) -> dict[str, dict]:
    """Family -> the script's findings, from one run over both families (one process's imports)."""
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.json"
    completed = subprocess.run(
        [
            sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--tiny", "--families", "flux", "wan",
            "--weight-transfer-gib", "0.01", "--out", str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    findings = json.loads(out.read_text())
    assert not [found for found in findings if "error" in found or found.get("skipped")]
    return {found.get("family", found.get("section")): found for found in findings}


def test_the_gpu_check_moves_weights_every_way_with_their_bits(findings_by_family):
    """Release and resume, a colocated trainer's shared buckets copied out by another process, and
    a broadcast between two processes (gloo here; NCCL on two GPUs)."""
    found = findings_by_family["weight_transfer"]
    assert found["device"] == "cpu" and found["tensors"] == 1
    assert found["release_and_resume"]["bits_kept"]
    assert found["shared_buckets"]["bits_equal"] and found["broadcast"]["bits_equal"]
    assert found["broadcast"]["backend"] == "gloo"
    for path in ("release_and_resume", "shared_buckets", "broadcast"):
        assert all(rate > 0 for key, rate in found[path].items() if key.endswith("gib_per_s"))


def test_the_gpu_check_runs_on_the_tiny_copies(findings_by_family):
    findings = findings_by_family["flux"]
    assert findings["group"] == 8
    # The rates are the group over the fastest of the timed runs, as the findings record them.
    assert len(findings["rollout_seconds"]) == len(findings["pipeline_seconds"]) == 2
    assert findings["rollout_samples_per_s"] == 8 / min(findings["rollout_seconds"])
    assert findings["pipeline_samples_per_s"] == 8 / min(findings["pipeline_seconds"])
    assert findings["rollout_over_pipeline"] == findings["rollout_samples_per_s"] / findings["pipeline_samples_per_s"]
    assert findings["replay_max_abs_dlogp"] == 0.0 and findings["log_probs_finite"]
    assert findings["ode_vs_pipeline_max_abs_latent_diff"] < 0.1 * findings["latent_abs_max"]
    # In fp32 the ODE path is the pipeline's: bit for bit in a call of the pipeline's two samples.
    assert findings["fp32_ode_vs_pipeline_max_abs_latent_diff"] == 0.0 and findings["fp32_latent_abs_max"] > 1
    # The calibration it ran, and the throughput at each batch size with the size it chose.
    per_sample = {int(rows): seconds for rows, seconds in findings["micro_batch_denoising_seconds_per_sample"].items()}
    assert set(per_sample) == {1, 2} and findings["micro_batch_chosen"] in per_sample
    assert findings["decode_batch_chosen"] in per_sample
    for measured in ("decode_seconds_per_sample", "denoising_seconds_for_load", "decode_seconds_for_load"):
        assert set(findings[f"micro_batch_{measured}"]) == {str(rows) for rows in per_sample}
    assert findings["micro_batch_load"] == 16
    throughput = findings["throughput_by_batch_size"]
    assert set(throughput) == {"1", "8"}
    for rates in throughput.values():
        assert rates["rollout_over_pipeline"] == rates["rollout_samples_per_s"] / rates["pipeline_samples_per_s"] > 0
    # Batch-invariant kernels: checked on the device, then measured like padding.
    kernels = findings["batch_invariant_kernels"]
    assert kernels["velocity_difference"] == kernels["image_difference"] == 0.0
    assert kernels["replay_max_abs_dlogp"] == 0.0 and set(kernels["throughput_by_batch_size"]) == {"1", "8"}


def test_the_gpu_check_runs_wan_on_its_tiny_copy(findings_by_family):
    findings = findings_by_family["wan"]
    assert findings["num_frames"] == 5 and findings["videos"] == 2
    assert findings["rollout_videos_per_s"] == 2 / min(findings["rollout_seconds"])
    assert findings["rollout_over_pipeline"] == findings["rollout_videos_per_s"] / findings["pipeline_videos_per_s"]
    assert findings["replay_max_abs_dlogp"] == 0.0 and findings["log_probs_finite"]


def test_sections_that_would_overrun_the_budget_are_skipped_and_named(tmp_path):
    """The device machine is lent for minutes: past its budget the script names what it left out,
    after the group (its timings, replay and the ODE path), which always runs."""
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_check

    spent = gpu_check.Budget(0.0)
    tiny_dir = gpu_check.CHECKED["flux"].build(tmp_path / "flux")
    findings = gpu_check.check_family("flux", tiny_dir, True, "cpu", 64, 3, (1, 2), (1, 8), spent)
    assert findings["skipped"] == [
        "calibration (the batch sizes run in calls of the group)",
        "batch-invariant kernels",
        "batch size 1 and larger",
        "the fp32 path",
    ]
    assert findings["replay_max_abs_dlogp"] == 0.0 and findings["throughput_by_batch_size"] == {}


def test_the_speed_check_times_every_exact_way_against_the_pipeline_on_a_tiny_copy(tmp_path):
    out = tmp_path / "speed.json"
    command = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--tiny", "--speed", "--families", "sd3", "--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    (found,) = json.loads(out.read_text())
    assert (found["section"], found["size"], found["steps"]) == ("speed", 64, 3)
    # Where an attention kernel cannot run, it says why; the others are timed like padding.
    assert set(found["attention_unavailable"]) | {"flash"} == {"flash", "efficient", "cudnn"}
    for samples, timed in found["by_batch_size"].items():
        ways = [way for way in timed if isinstance(timed[way], dict)]
        assert {"padding", "kernels"} <= set(ways) and timed["pipeline_eager_ms_per_step"] > 0
        for way in ways:
            assert timed[way]["replay_max_abs_dlogp"] == 0.0
            assert timed[way]["speed_over_pipeline_eager"] == timed["pipeline_eager_ms_per_step"] / timed[way]["ms_per_step"]
    assert set(found["by_batch_size"]) == {"1", "2"} and len(found["skipped"]) == 2  # no compiled pipeline on the CPU
