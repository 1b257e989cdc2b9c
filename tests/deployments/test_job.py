"""The `ray job submit` entrypoint, submitted to the session's local cluster."""

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ray.job_submission import JobStatus, JobSubmissionClient

from deployments import job
from deployments.dispatch import OverloadedError
from rollout.dataset import PER_SAMPLE_TENSORS, load_rollouts

REPO = Path(__file__).resolve().parents[2]


def test_job_writes_a_dataset_that_reloads(ray_cluster, serve_app, app_config, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a handwritten 1\n7\n\nthree\nthe digit 0\nnine\n")
    output = tmp_path / "rollouts"
    client = JobSubmissionClient(f"http://{ray_cluster.dashboard_url}")
    job_id = client.submit_job(
        entrypoint=(
            f"{sys.executable} -m deployments job --prompts {prompts} --output {output} "
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
    assert [s.prompt for s in samples] == [
        p for p in ["a handwritten 1", "7", "three", "the digit 0", "nine"] for _ in "ab"
    ]
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


class RefusedFrom:
    """The application's handle, except that it refuses every request from the `first_refused`-th on
    as an overloaded server does."""

    def __init__(self, handle, first_refused: int):
        self.handle, self.first_refused, self.sent = handle, first_refused, 0
        self.generate = SimpleNamespace(remote=self.remote)

    def remote(self, request):
        self.sent += 1
        if self.sent > self.first_refused:
            return SimpleNamespace(result=self.refuse)
        return self.handle.generate.remote(request)

    @staticmethod
    def refuse():
        raise OverloadedError("admitting 3,328 token-steps would pass max_queued_cost")


def job_arguments(prompts, output, app_name, *extra, seed=5):
    return [
        *("--prompts", str(prompts), "--output", str(output), "--app-name", app_name, "--seed", str(seed)),
        *("--num-outputs-per-prompt", "2", "--num-inference-steps", "3", "--prompts-per-request", "2", *extra),
    ]


def test_an_interrupted_job_resumed_writes_what_an_uninterrupted_one_does(
    serve_app, app_config, tmp_path, monkeypatch, capsys
):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1\n2\nthree\n4\n5\n")
    interrupted, uninterrupted = tmp_path / "interrupted", tmp_path / "uninterrupted"
    app_name = app_config["app_name"]
    monkeypatch.setattr(job, "running_app", lambda name: RefusedFrom(serve_app[0], first_refused=1))
    with pytest.raises(SystemExit) as stopped:
        job.main(job_arguments(prompts, interrupted, app_name))
    message = str(stopped.value)
    assert message.startswith("request 1 failed: OverloadedError: admitting 3,328 token-steps")
    assert "holds 1 of 3 shards (4 samples), a dataset that loads: run the job again with --resume" in message
    index, batches = load_rollouts(interrupted)
    assert len(batches) == 1 and not index["complete"]

    with pytest.raises(SystemExit, match="holds a dataset already: pass --resume to continue it"):
        job.main(job_arguments(prompts, interrupted, app_name))
    with pytest.raises(SystemExit, match=r"records other requests \(--seed 6, not 5\)"):
        job.main(job_arguments(prompts, interrupted, app_name, "--resume", seed=6))
    monkeypatch.undo()
    capsys.readouterr()
    job.main(job_arguments(prompts, interrupted, app_name, "--resume"))
    assert "wrote 6 samples in 2 shards" in capsys.readouterr().out
    job.main(job_arguments(prompts, uninterrupted, app_name))

    resumed, resumed_batches = load_rollouts(interrupted)
    whole, whole_batches = load_rollouts(uninterrupted)
    assert resumed["complete"] and whole["complete"]
    assert resumed["shards"] == whole["shards"]  # sizes and SHA-256s: the same bytes
    without_ids = [[{k: v for k, v in r.items() if k != "request_id"} for r in i["samples"]] for i in (resumed, whole)]
    assert without_ids[0] == without_ids[1] and len(without_ids[0]) == 10
    for a, b in zip(resumed_batches, whole_batches, strict=True):
        assert a.schedule.equals(b.schedule)
        for x, y in zip(a.samples, b.samples, strict=True):
            assert all(torch.equal(getattr(x, name), getattr(y, name)) for name in PER_SAMPLE_TENSORS)
