"""The `ray job submit` entrypoint, submitted to the session's local cluster."""

import sys
import time
from pathlib import Path

import pytest
import torch
from ray.job_submission import JobStatus, JobSubmissionClient

from deployments import job
from rollout.dataset import load_rollouts

REPO = Path(__file__).resolve().parents[2]


def test_job_writes_a_dataset_that_reloads(ray_cluster, serve_app, app_config, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a handwritten 1\n7\n\nthree\nthe digit 0\nnine\n")
    output = tmp_path / "rollouts"
    client = JobSubmissionClient(f"http://{ray_cluster.dashboard_url}")
    job_id = client.submit_job(
        entrypoint=(
            f"{sys.executable} -m deployments.job --prompts {prompts} --output {output} "
            f"--app-name {app_config['app_name']} --num-outputs-per-prompt 2 --num-inference-steps 4 "
            "--prompts-per-request 2 --seed 10"
        ),
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    deadline = time.monotonic() + 180
    while (status := client.get_job_status(job_id)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, "the job did not finish in time"
        time.sleep(0.5)
    logs = client.get_job_logs(job_id)
    assert status == JobStatus.SUCCEEDED, logs
    assert "wrote 10 samples in 3 shards" in logs
    assert "rollouts: 100%" in logs  # the progress bar ran to the end

    index, batches = load_rollouts(output)
    assert [len(b.samples) for b in batches] == [4, 4, 2]
    samples = [s for b in batches for s in b.samples]
    assert [s.prompt for s in samples] == [p for p in ["a handwritten 1", "7", "three", "the digit 0", "nine"] for _ in "ab"]
    assert [s.seed for s in samples] == list(range(10, 20))
    assert [r["prompt_index"] for r in index["samples"]] == [i for i in range(5) for _ in "ab"]
    assert {r["weight_version"] for r in index["samples"]} == {"test-v1"}
    for batch in batches:
        assert batch.options.num_inference_steps == 4
        assert batch.schedule.sigmas.shape == (5,) and batch.schedule.sigmas[-1] == 0
        assert all(s.schedule is batch.schedule for s in batch.samples)
        for s in batch.samples:
            assert s.log_probs.shape == (4,) and s.latents.shape == (5, 1, 16, 16)
            assert torch.equal(s.latents[-1], s.final_latents)


def test_without_the_application_the_job_stops_at_once_naming_the_running_ones(serve_app, app_config, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("7\n")
    with pytest.raises(SystemExit) as stopped:
        job.main(["--prompts", str(prompts), "--output", str(tmp_path / "out"), "--app-name", "rollout"])
    message = str(stopped.value)
    assert "no Serve application 'rollout'" in message and repr(app_config["app_name"]) in message
    assert "serve run --name rollout deployments.app:build_app" in message
    assert not (tmp_path / "out").exists()
