"""Weight updates on a real local Ray cluster with 2 worker replicas: every replica, all or nothing."""

import collections
import concurrent.futures
import copy
import json
import math
import os
import shutil
import struct
import time
from types import SimpleNamespace

import msgpack
import pytest
import ray
import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from ray import serve
from ray.util.state import list_actors
from safetensors.torch import save_file

from deployments.app import build_app
from deployments.memory import MemoryReleasedError
from deployments.weights import ObjectStoreTensors
from rollout.codec import TensorEncoder, from_msgpack
from rollout.errors import InvalidRequestError, WeightUpdateError
from rollout.models.digits import DEFAULT_WEIGHTS
from rollout.models.registry import load_pipeline
from rollout.replay import replay_log_probs, transition_log_probs
from rollout.client import RolloutClient
from rollout.weight_sync import SharedMemorySender, WeightSender, handle_server, spec_lists, specs_of
from rollout.weights import apply_update, tensor_update, weights_checksum
from tests.ports import free_port

APP_NAME = "rollout-weights"
UNREADABLE = "cannot be read as a checkpoint"  # the one refusal of every checkpoint that cannot be read


@pytest.fixture(scope="module")
def app(serve_app, app_config, tmp_path_factory):
    """A 2-replica application of its own (these tests change its weights); checkpoints may only
    be read from `root`, which holds a copy of the packaged weights to reset to."""
    root = tmp_path_factory.mktemp("checkpoints")
    shutil.copytree(DEFAULT_WEIGHTS, root / "base")
    config = {
        **app_config,
        "app_name": APP_NAME,
        "weight_version": "base",
        "allowed_weight_paths": [str(root)],
        "weight_update_timeout_s": 60,
        # The GRPO example's rewards (the embedded model's scorers).
        "scorers": {name: {"kind": name, "num_cpus": 0.1} for name in ("ink", "digits")},
    }
    handle = serve.run(build_app(config), name=APP_NAME, route_prefix="/weights-app")
    yield SimpleNamespace(handle=handle, url=f"{serve_app[1]}/weights-app", root=root)
    serve.delete(APP_NAME)


@pytest.fixture
def base(app):
    """Every test starts from the packaged weights, served as version "base"."""
    app.handle.update_weights_from_disk.remote(str(app.root / "base"), weight_version="base").result()
    return load_pipeline()


def with_update(pipeline, state_dict):
    updated = copy.deepcopy(pipeline)
    apply_update(updated.weight_modules, tensor_update(state_dict))
    return updated


def perturbed(pipeline, seed):
    generator = torch.Generator().manual_seed(seed)
    state_dict = pipeline.transformer.state_dict()
    return {k: v + 1e-2 * torch.randn(v.shape, generator=generator) for k, v in state_dict.items()}


def served(app):
    """Per replica: (weight version, transformer checksum)."""
    # Checksums first: every replica answers them after catching up, so the versions read next
    # are at least as new as the weights checksummed.
    checksums = app.handle.get_weights_checksum.remote(["transformer"]).result()
    versions = app.handle.info.remote().result()["replica_weight_versions"]
    return {replica: (versions[replica], checksums[replica]["transformer"]) for replica in checksums}


def rollout(app, body):
    result = app.handle.generate.remote({"rollout_return_dit_trajectory": True, **body}).result()
    return result.fetch().parts, result.batch()


def assert_replays_exactly(pipeline, batch):
    replayed = replay_log_probs(pipeline, batch.schedule, batch.options, batch.samples)
    assert torch.equal(replayed.log_probs, torch.stack([s.log_probs for s in batch.samples]))


def test_an_update_reaches_every_replica_and_every_sample_names_its_weights(app, base):
    assert set(served(app).values()) == {("base", weights_checksum(base.transformer))}
    updated = with_update(base, perturbed(base, seed=1))

    result = app.handle.update_weights_from_tensor.remote(
        ObjectStoreTensors(ray.put(perturbed(base, seed=1))), weight_version="v1"
    ).result()

    assert result.success and result.weight_version == "v1"
    now = served(app)
    assert len(now) == 2 and set(now.values()) == {("v1", weights_checksum(updated.transformer))}
    parts, batch = rollout(app, {"prompt": ["3", "9"], "num_outputs_per_prompt": 4, "num_inference_steps": 4})
    assert len({part.replica for part in parts}) == 2
    assert {s.weight_version for s in batch.samples} == {"v1"}
    assert_replays_exactly(updated, batch)


def test_versions_change_exactly_at_the_update(app, base):
    """Samples sampled while an update lands say which weights made them, and those weights replay them."""
    pipelines = {"base": base, "v2": with_update(base, perturbed(base, seed=2))}
    bodies = [{"prompt": str(i % 10), "num_inference_steps": 6, "seed": 500 + i} for i in range(16)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        during = [pool.submit(rollout, app, body) for body in bodies]
        time.sleep(0.3)
        app.handle.update_weights_from_tensor.remote(
            ObjectStoreTensors(ray.put(perturbed(base, seed=2))), weight_version="v2"
        ).result()
        batches = [future.result()[1] for future in during]
    for batch in batches:
        (version,) = {s.weight_version for s in batch.samples}
        assert_replays_exactly(pipelines[version], batch)
    _, after = rollout(app, {"prompt": "4", "num_outputs_per_prompt": 4, "num_inference_steps": 3})
    assert {s.weight_version for s in after.samples} == {"v2"}


def partial_checkpoint(app):
    path = app.root / "partial.safetensors"
    save_file(load_pipeline().transformer.state_dict(), path)
    path.write_bytes(path.read_bytes()[:5000])
    return dict(model_path=str(path))


def fifo_checkpoint(app):
    path = app.root / "fifo.safetensors"
    os.mkfifo(path)  # opened for reading with blocking, it would wait for a writer, and hold the coordinator
    return dict(model_path=str(path))


def link_out_of_the_roots(app):
    path = app.root / "link.safetensors"
    path.symlink_to(DEFAULT_WEIGHTS / "prompt_encoder.safetensors")
    return dict(model_path=str(path), target_modules=["prompt_encoder"])


def with_one_value(state_dict, value, dtype=None):
    name = next(iter(state_dict))
    tensor = state_dict[name].to(dtype or state_dict[name].dtype).clone()
    tensor.view(-1)[0] = value
    return {**state_dict, name: tensor}


BAD_UPDATES = {
    # Every checkpoint that cannot be read gets one answer: only the server log says why.
    "partial file": (lambda app, base: ("disk", partial_checkpoint(app)), UNREADABLE),
    "outside the allowed roots": (lambda app, base: ("disk", dict(model_path=str(DEFAULT_WEIGHTS))), UNREADABLE),
    "a link out of the allowed roots": (lambda app, base: ("disk", link_out_of_the_roots(app)), UNREADABLE),
    "missing directory": (lambda app, base: ("disk", dict(model_path=str(app.root / "none"))), UNREADABLE),
    "a FIFO": (lambda app, base: ("disk", fifo_checkpoint(app)), UNREADABLE),
    "NaN": (lambda app, base: ("tensor", with_one_value(perturbed(base, 3), math.nan)), "NaN or infinite"),
    "float64 1e300": (
        lambda app, base: ("tensor", with_one_value(perturbed(base, 3), 1e300, torch.float64)),
        "NaN or infinite values, or values beyond the range of torch.float32",
    ),
    "wrong shape": (
        lambda app, base: ("tensor", {**perturbed(base, 3), "proj_out.weight": torch.zeros(3, 3)}),
        "shape",
    ),
    "missing weight": (lambda app, base: ("tensor", dict(list(perturbed(base, 3).items())[1:])), "missing"),
    "integer dtype": (
        lambda app, base: ("tensor", {k: v.to(torch.int64) for k, v in perturbed(base, 3).items()}),
        "torch.int64",
    ),
}


@pytest.mark.parametrize("name", list(BAD_UPDATES))
def test_a_bad_update_leaves_every_replica_on_the_old_weights(app, base, name):
    make, cause = BAD_UPDATES[name]
    before = served(app)
    kind, payload = make(app, base)
    with pytest.raises(WeightUpdateError, match=cause):
        if kind == "disk":
            app.handle.update_weights_from_disk.remote(**payload, weight_version="bad").result()
        else:
            tensors = ObjectStoreTensors(ray.put(payload))
            app.handle.update_weights_from_tensor.remote(tensors, weight_version="bad").result()
    assert served(app) == before
    _, batch = rollout(app, {"prompt": "1", "num_outputs_per_prompt": 4, "num_inference_steps": 3})
    assert {s.weight_version for s in batch.samples} == {"base"}


def _resident_mib(pids):
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/statm") as statm:
            total += int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return total / 2**20


def _process_io(pids):
    """Each of `/proc/<pid>/io`'s counters, summed over `pids`."""
    totals = collections.Counter()
    for pid in pids:
        with open(f"/proc/{pid}/io") as io:
            for line in io:
                key, value = line.split(":")
                totals[key] += int(value)
    return totals


def test_a_checkpoint_of_another_model_is_refused_from_its_header(app, base):
    """1 GiB of data under one unknown name: refused from the header, no process reads or keeps any of it."""
    path = app.root / "another-model.safetensors"
    header = json.dumps({"not_a_weight": {"dtype": "F32", "shape": [2**28], "data_offsets": [0, 2**30]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    os.truncate(path, path.stat().st_size + 2**30)  # a hole: the test writes nothing
    pids = [a.pid for a in list_actors(filters=[("state", "=", "ALIVE")]) if APP_NAME in (a.class_name or "")]
    resident, io = _resident_mib(pids), _process_io(pids)
    with pytest.raises(WeightUpdateError, match=r"1 unexpected \['not_a_weight'\]"):
        app.handle.update_weights_from_disk.remote(str(path), weight_version="another").result()
    # rchar counts every byte a read returns, holes and sockets included: reading the data would add 1 GiB.
    bytes_read, grown = _process_io(pids)["rchar"] - io["rchar"], _resident_mib(pids) - resident
    assert bytes_read < 2**26, f"the application's {len(pids)} processes read {bytes_read / 2**20:.0f} MiB"
    assert grown < 100, f"the application's {len(pids)} processes grew {grown:+.1f} MiB"  # reading the data held GBs


def test_a_non_finite_update_is_a_400_and_sampling_goes_on(app, base, http):
    named_tensors = with_one_value(perturbed(base, seed=9), math.nan)
    envelope = TensorEncoder().encode({"named_tensors": named_tensors, "weight_version": "nan"})
    response = http.post(
        f"{app.url}/update_weights_from_tensor",
        data=msgpack.packb(envelope),
        headers={"Content-Type": "application/msgpack"},
    )
    assert response.status_code == 400 and response.json()["success"] is False, response.text
    name = next(iter(named_tensors))
    assert f"transformer weights: {name} has NaN or infinite values" in response.json()["message"]
    assert len(response.json()["failed_replicas"]) == 2  # every replica refused it: nothing changed anywhere
    body = {"prompt": "6", "num_outputs_per_prompt": 2, "num_inference_steps": 3, "rollout_debug_mode": False}
    response = http.post(f"{app.url}/rollout/generate", json=body)
    assert response.status_code == 200 and {row["weight_version"] for row in from_msgpack(response.content)} == {"base"}


def test_an_update_from_the_object_store_touches_no_disk(app, base):
    pids = [a.pid for a in list_actors(filters=[("state", "=", "ALIVE")]) if APP_NAME in (a.class_name or "")]
    assert len(pids) >= 4  # the coordinator, the ingress and 2 workers
    state_dict = {k: v.double() for k, v in perturbed(base, seed=4).items()}  # 4.6 MB: any copy on disk would show
    tensors = ObjectStoreTensors(ray.put(state_dict))
    before = _process_io(pids)
    app.handle.update_weights_from_tensor.remote(tensors, weight_version="in-memory").result()
    after = _process_io(pids)
    size = sum(t.numel() * t.element_size() for t in state_dict.values())
    for key in ("read_bytes", "write_bytes"):  # a few log lines at most
        assert after[key] - before[key] < size // 10, (key, after[key] - before[key], size)


def test_lora_rollouts_replay_exactly_with_the_trainers_peft_model(app, base):
    trainer = copy.deepcopy(base)
    trainer.transformer.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    with torch.no_grad():
        for name, parameter in trainer.transformer.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    adapter = get_peft_model_state_dict(trainer.transformer)
    result = app.handle.update_weights_from_tensor.remote(
        ObjectStoreTensors(ray.put(adapter)), weight_version="lora-1", lora_rank=4, lora_alpha=8
    ).result()
    assert result.success
    assert {checksum for _, checksum in served(app).values()} == {weights_checksum(trainer.transformer)}

    body = {"prompt": ["2", "7"], "num_outputs_per_prompt": 4, "num_inference_steps": 5, "rollout_debug_mode": False}
    parts, batch = rollout(app, body)
    assert len({part.replica for part in parts}) == 2 and {s.weight_version for s in batch.samples} == {"lora-1"}
    rollout_log_probs = torch.stack([s.log_probs for s in batch.samples])
    replayed = replay_log_probs(trainer, batch.schedule, batch.options, batch.samples)
    assert (replayed.log_probs - rollout_log_probs).abs().max().item() == 0.0
    trainer.transformer.train()
    with_grad = transition_log_probs(trainer, batch.schedule, batch.options, batch.samples, list(range(5)))
    assert with_grad.requires_grad and torch.equal(with_grad.detach(), rollout_log_probs)


def test_a_request_can_require_a_version(app, base, http):
    body = {"prompt": "6", "num_inference_steps": 2, "rollout_debug_mode": False}
    assert http.post(f"{app.url}/rollout/generate", json={**body, "weight_version": "base"}).status_code == 200
    response = http.post(f"{app.url}/rollout/generate", json={**body, "weight_version": "v9"})
    assert response.status_code == 409
    assert response.json()["error"]["field"] == "weight_version"
    assert "'base'" in response.json()["error"]["message"] and "'v9'" in response.json()["error"]["message"]


def test_sglangs_weight_endpoints(app, base, http):
    updated = with_update(base, perturbed(base, seed=5))
    updated.save_pretrained(app.root / "step-5", weights_dtype=torch.float32)
    response = http.post(
        f"{app.url}/update_weights_from_disk", json={"model_path": str(app.root / "step-5"), "weight_version": "disk-5"}
    )
    assert response.status_code == 200 and response.json()["success"] is True, response.text
    checksum = http.post(f"{app.url}/get_weights_checksum", json={"module_names": ["transformer"]}).json()
    assert checksum["transformer"] == weights_checksum(updated.transformer)
    assert len(checksum["replicas"]) == 2
    assert http.get(f"{app.url}/rollout/info").json()["weight_version"] == "disk-5"

    # Named tensors in the tensor envelope, as msgpack.
    envelope = TensorEncoder().encode({"named_tensors": perturbed(base, seed=6), "weight_version": "http-6"})
    response = http.post(
        f"{app.url}/update_weights_from_tensor",
        data=msgpack.packb(envelope),
        headers={"Content-Type": "application/msgpack"},
    )
    answer = {"success": True, "message": "weights 'http-6' served by 2 replica(s)", "weight_version": "http-6"}
    assert response.json() == answer

    refused = [  # a body the server will not take: 400; one that does not fit the schema: 422
        ("/update_weights_from_tensor", {"serialized_named_tensors": ["gASV..."]}, 400, "never unpickles"),
        ("/update_weights_from_disk", {"flush_cache": True}, 422, "model_path: Field required"),
        ("/update_weights_from_disk", {"model_path": "/x", "flush": True}, 422, "flush: unknown field; did you mean 'flush_cache'?"),
        ("/update_weights_from_disk", {"model_path": str(app.root / "none")}, 400, UNREADABLE),
        ("/update_weights_from_disk", {"model_path": str(app.root / ("x" * 300_000))}, 400, UNREADABLE),
        ("/get_weights_checksum", {"module_names": ["transformer"] * 101}, 400, "module_names: at most 100 names"),
    ]
    for path, body, status, cause in refused:
        response = http.post(f"{app.url}{path}", json=body)
        assert response.status_code == status and response.json()["success"] is False, response.text
        assert cause in response.json()["message"]
        assert len(response.content) < 2000  # whatever the request holds
    assert http.get(f"{app.url}/rollout/info").json()["weight_version"] == "http-6"


def test_release_and_resume_memory_occupation(app, base, http):
    body = {"prompt": "5", "num_inference_steps": 2, "rollout_debug_mode": False}
    released = http.post(f"{app.url}/release_memory_occupation")
    assert released.status_code == 200 and released.json()["success"] is True
    assert http.post(f"{app.url}/release_memory_occupation").json()["message"] == "already released"
    assert http.post(f"{app.url}/rollout/generate", json=body).status_code == 503
    assert http.post(f"{app.url}/resume_memory_occupation").json()["success"] is True
    response = http.post(f"{app.url}/rollout/generate", json=body)
    assert response.status_code == 200 and from_msgpack(response.content)[0]["weight_version"] == "base"


def test_release_and_resume_memory_occupation_through_the_handle(app, base):
    request = {"prompt": "5", "num_inference_steps": 2, "rollout_debug_mode": False}
    released = app.handle.release_memory_occupation.remote().result()
    assert len(released) == 2 and all(message.startswith("released") for message in released.values()), released
    with pytest.raises(MemoryReleasedError):
        app.handle.generate.remote(request).result().batch()
    resumed = app.handle.resume_memory_occupation.remote().result()
    assert len(resumed) == 2 and all(message.startswith("resumed") for message in resumed.values()), resumed
    assert {s.weight_version for s in app.handle.generate.remote(request).result().batch().samples} == {"base"}


def test_a_weight_version_that_would_reach_every_row_is_refused_on_both_paths(app, http):
    """Every later row of every client carries the served version (issue 46: 1 MiB was accepted)."""
    response = http.post(f"{app.url}/update_weights_from_disk", json={"model_path": "/x", "weight_version": "v" * 129})
    assert response.status_code == 400 and "weight_version: 1 to 128 characters" in response.json()["message"]
    with pytest.raises(InvalidRequestError, match="1 to 128 characters"):
        app.handle.update_weights_from_disk.remote("/x", weight_version="a b").result()


def kill_a_worker() -> str:
    """Kills one of the app's worker replicas; its replica id."""
    workers = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if f"{APP_NAME}:RolloutWorker" in a.class_name]
    ray.kill(ray.get_actor(workers[0].name, namespace="serve"))
    return workers[0].name.split("#")[-1]


def served_after_replacing(app, killed: str) -> dict:
    """`served(app)` once Serve has replaced the killed replica (a dead replica is noticed and dropped)."""
    deadline = time.monotonic() + 120
    while True:
        now = served(app)
        if len(now) == 2 and killed not in now:
            return now
        assert time.monotonic() < deadline, now
        time.sleep(1)


def test_a_replica_that_restarts_catches_up(app, base):
    updated = with_update(base, perturbed(base, seed=7))
    app.handle.update_weights_from_tensor.remote(
        ObjectStoreTensors(ray.put(perturbed(base, seed=7))), weight_version="v7"
    ).result()
    killed = kill_a_worker()
    assert set(served_after_replacing(app, killed).values()) == {("v7", weights_checksum(updated.transformer))}


def test_the_grpo_example_trains_on_policy(app, base):
    """The example's loop in a short configuration: the ratio is exactly 1 at every first step
    (the server serves the weights the trainer holds), and training steps ran."""
    from examples.grpo_digits import GRPOConfig, train

    config = GRPOConfig(iterations=2, prompts=2, group_size=4, steps=4, sde_window=2, minibatch=4)
    history = train(app.handle, config, log=lambda line: None)
    assert [m["first_step_max_abs_dlogp"] for m in history] == [0.0, 0.0]
    assert all(m["optimizer_steps"] == 2 for m in history)
    assert [m["rollout_weight_version"] for m in history] == ["grpo-0", "grpo-1"]
    # Rewards came from the server's scorers; the scoring hidden behind sampling is part of it.
    assert all(0 <= m["reward"] <= 1 and 0 <= m["digit_probability"] <= 1 for m in history)
    assert all(0 <= m["reward_hidden_s"] <= m["reward_s"] for m in history)
    assert served(app).keys() and {version for version, _ in served(app).values()} == {"grpo-2"}


def test_the_grpo_example_trains_on_policy_from_tree_rollouts(app):
    """`--branch`: each prompt's group is one tree forked at the window's first step; the leaves'
    ratio is exactly 1 too."""
    from examples.grpo_digits import GRPOConfig, train

    config = GRPOConfig(iterations=1, prompts=2, group_size=4, steps=4, sde_window=2, window_start=1, branch=True, minibatch=4)
    history = train(app.handle, config, log=lambda line: None)
    assert [m["first_step_max_abs_dlogp"] for m in history] == [0.0] and history[0]["optimizer_steps"] == 2


def test_the_branchgrpo_recipe_trains_each_edge_once_on_policy(app):
    """`--algorithm branchgrpo`: DanceGRPO's SDE, split noise 4 with the nominal std, per-depth
    advantages, every edge of a tree trained once; the first replay is the rollout's to the bit."""
    from examples.grpo_digits import BRANCHGRPO_SPLITS, GRPOConfig, train

    config = GRPOConfig(iterations=2, prompts=2, group_size=8, steps=8, algorithm="branchgrpo", minibatch=8)
    history = train(app.handle, config, log=lambda line: None)
    assert [m["first_step_max_abs_dlogp"] for m in history] == [0.0, 0.0]
    assert all(m["optimizer_steps"] == 2 for m in history)  # a tree a step
    # Per tree: 2 children own steps 0..2, 4 own 3..5, 8 own 6..7: 6 + 12 + 16, not 8 leaves x 8 steps.
    assert BRANCHGRPO_SPLITS == [0, 3, 6] and all(m["transitions_trained"] == 2 * (6 + 12 + 16) for m in history)


def test_the_tempflow_recipe_trains_each_combs_children_on_policy(app):
    """`--algorithm tempflow`: one comb a prompt, a step's children a group, only their stochastic
    step trained; the first replay is the rollout's to the bit."""
    from examples.grpo_digits import GRPOConfig, train

    # Combs at steps 0 and 2 of 8, 3 children each: 7 leaves a prompt (the app takes 8 at most).
    config = GRPOConfig(iterations=2, prompts=2, group_size=3, steps=8, algorithm="tempflow", comb_branch_steps=2)
    history = train(app.handle, config, log=lambda line: None)
    assert [m["first_step_max_abs_dlogp"] for m in history] == [0.0, 0.0]
    assert all(m["optimizer_steps"] == 2 for m in history)  # a branch step a step
    assert all(m["transitions_trained"] == 2 * 3 * 2 for m in history)  # prompts x children x steps
    assert all(0 <= m["spine_reward"] <= 1 for m in history)


def test_replicas_follow_a_restarted_coordinator(app, base):
    """The coordinator's replica dies: Serve restarts it, the worker replicas register with the
    new one, and updates reach all of them again."""
    coordinator = next(
        a for a in list_actors(filters=[("state", "=", "ALIVE")]) if f"{APP_NAME}:WeightCoordinator" in a.class_name
    )
    ray.kill(ray.get_actor(coordinator.name, namespace="serve"))
    updated = with_update(base, perturbed(base, seed=8))
    tensors = ObjectStoreTensors(ray.put(perturbed(base, seed=8)))
    expected = {("after-restart", weights_checksum(updated.transformer))}
    deadline = time.monotonic() + 120
    while True:
        try:
            result = app.handle.update_weights_from_tensor.remote(tensors, weight_version="after-restart").result()
            if result.success and set(served(app).values()) == expected:
                break
        except Exception:  # the coordinator is not back yet
            pass
        assert time.monotonic() < deadline, "the replicas did not follow the restarted coordinator"
        time.sleep(1)
    assert len(served(app)) == 2


# Weight-update groups (rollout.weight_sync): the trainer is rank 0 of a gloo group the replicas join.


def group_sender(app, via: str = "http", timeout_s: float = 30.0, bucket_bytes: int = 2**20) -> WeightSender:
    server = RolloutClient(app.url).weight_route if via == "http" else handle_server(app.handle)
    return WeightSender(server, server_ranks=2, master_port=free_port(), timeout_s=timeout_s, bucket_bytes=bucket_bytes)


def test_a_state_dict_and_an_adapter_reach_every_replica_through_the_trainers_group(app, base):
    full = perturbed(base, seed=11)
    updated = with_update(base, full)
    sender = group_sender(app, bucket_bytes=64 * 2**10)  # the embedded transformer's 3 MB: dozens of buckets
    try:
        answer = sender.update(full, weight_version="group-1", checksum=weights_checksum(updated.transformer))
        assert answer["success"] and answer["weight_version"] == "group-1"
        assert set(answer["checksums"].values()) == {weights_checksum(updated.transformer)}
        assert set(served(app).values()) == {("group-1", weights_checksum(updated.transformer))}
        parts, batch = rollout(app, {"prompt": ["1", "8"], "num_outputs_per_prompt": 4, "num_inference_steps": 4})
        assert len({part.replica for part in parts}) == 2 and {s.weight_version for s in batch.samples} == {"group-1"}
        assert_replays_exactly(updated, batch)
    finally:
        sender.close()

    trainer = copy.deepcopy(updated)
    trainer.transformer.add_adapter(LoraConfig(r=2, lora_alpha=4, target_modules=["to_q", "to_v"]))
    with torch.no_grad():
        for name, parameter in trainer.transformer.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.05)
    sender = group_sender(app, via="handle")
    try:
        answer = sender.update(get_peft_model_state_dict(trainer.transformer), "group-lora", lora_rank=2, lora_alpha=4)
    finally:
        sender.close()
    assert set(answer["checksums"].values()) == {weights_checksum(trainer.transformer)}
    _, batch = rollout(app, {"prompt": "5", "num_outputs_per_prompt": 2, "num_inference_steps": 3})
    assert {s.weight_version for s in batch.samples} == {"group-lora"}
    assert_replays_exactly(trainer, batch)


def test_a_refused_group_update_leaves_every_replica_on_the_old_weights(app, base):
    before = served(app)
    sender = group_sender(app)
    try:
        # Received by every replica, then refused by each: the group stays up for the next update.
        with pytest.raises(WeightUpdateError, match=r"update refused by 2 replica\(s\), undone on the others: .*NaN or infinite"):
            sender.update(with_one_value(perturbed(base, seed=12), float("nan")), weight_version="nan")
        assert served(app) == before
        # Received and applied, but not what the trainer says it sent: undone everywhere.
        with pytest.raises(WeightUpdateError, match="serves checksum [0-9a-f]{64}, not the trainer's"):
            sender.update(perturbed(base, seed=13), weight_version="other", checksum=weights_checksum(base.transformer))
        assert served(app) == before
        assert sender.update(perturbed(base, seed=13), weight_version="after-nan")["success"]
        # Refused from its specs, before any replica allocates a byte: the broadcast is given up.
        started = time.monotonic()
        wrong = {**perturbed(base, seed=14), "proj_out.weight": torch.zeros(3, 3)}
        with pytest.raises(WeightUpdateError, match="names: transformer weights: proj_out.weight has shape .*closed"):
            sender.update(wrong, weight_version="wrong-shape")
        assert time.monotonic() - started < 10  # not the group's 30 s timeout
    finally:
        sender.group.close()
    assert {version for version, _ in served(app).values()} == {"after-nan"}


def test_a_trainer_gone_mid_update_times_out_closes_the_group_and_sampling_goes_on(app, base, http):
    sender = group_sender(app, timeout_s=2)
    state = perturbed(base, seed=15)
    body = {**spec_lists(specs_of(state)), "weight_version": "never"}
    sender.group.close()  # the trainer is gone: nothing is broadcast
    response = http.post(f"{app.url}/update_weights_from_distributed", json=body, timeout=60)
    assert response.status_code == 400
    assert "the broadcast of bucket 1 failed" in response.json()["message"] and "is closed" in response.json()["message"]
    assert {version for version, _ in served(app).values()} == {"base"}
    _, batch = rollout(app, {"prompt": "2", "num_inference_steps": 2})
    assert {s.weight_version for s in batch.samples} == {"base"}
    again = http.post(f"{app.url}/update_weights_from_distributed", json=body, timeout=60).json()
    assert not again["success"] and "no weight-update group 'rollout'" in again["message"]


def test_a_group_refuses_an_address_the_app_does_not_allow_and_a_world_of_another_size(app, http):
    body = {"master_address": "10.1.2.3", "master_port": free_port(), "rank_offset": 1, "world_size": 3}
    answer = http.post(f"{app.url}/init_weights_update_group", json=body).json()
    assert not answer["success"] and "master_address: '10.1.2.3' is not in the app's allowed_weight_sync_addresses" in answer["message"]
    answer = http.post(f"{app.url}/init_weights_update_group", json={**body, "master_address": "127.0.0.1", "world_size": 4}).json()
    assert not answer["success"] and "world_size: must be rank_offset + 2" in answer["message"]


def test_a_step_that_changes_few_weights_goes_as_a_delta_and_every_replica_serves_its_whole_bits(app, base):
    step_1 = perturbed(base, seed=17)
    step_2 = {name: t.clone() for name, t in step_1.items()}
    for tensor in list(step_2.values())[::3]:  # a step that changes a few elements of some tensors
        tensor.view(-1)[:5] += 1.0
    updated = with_update(base, step_2)
    sender = WeightSender(RolloutClient(app.url).weight_route, server_ranks=2, master_port=free_port(), timeout_s=30, deltas=True)
    try:
        first = sender.update(step_1, weight_version="delta-1")
        assert "made whole" not in first["message"]  # nothing to change from yet: sent whole
        second = sender.update(step_2, weight_version="delta-2", checksum=weights_checksum(updated.transformer))
    finally:
        sender.close()
    assert "made whole" in second["message"]  # each replica made the tensors whole from its own
    assert set(served(app).values()) == {("delta-2", weights_checksum(updated.transformer))}
    _, batch = rollout(app, {"prompt": "0", "num_outputs_per_prompt": 2, "num_inference_steps": 3})
    assert_replays_exactly(updated, batch)


def test_a_delta_from_weights_no_longer_served_is_refused_before_it_is_sent(app, base):
    sender = WeightSender(RolloutClient(app.url).weight_route, server_ranks=2, master_port=free_port(), timeout_s=30, deltas=True)
    sender.update(perturbed(base, seed=18), weight_version="delta-base")
    app.handle.update_weights_from_disk.remote(str(app.root / "base"), weight_version="base").result()
    changed = perturbed(base, seed=18)
    next(iter(changed.values())).view(-1)[0] += 1.0
    with pytest.raises(WeightUpdateError, match=r"delta_from: the replicas serve \['base'\], not 'delta-base': send it whole"):
        sender.update(changed, weight_version="delta-stale")
    sender.group.close()
    assert {version for version, _ in served(app).values()} == {"base"}


def test_a_replica_killed_during_a_broadcast_never_leaves_the_replicas_on_two_versions(app, base, http):
    """After a group update, the trainer waits while both replicas wait in the next update's
    broadcast, one of them is killed, and the trainer sends: the update fails or is served by the
    survivor alone, and the replica Serve starts in place of the dead one serves what the
    coordinator committed (the first update: caught up from the copy the coordinator keeps), as
    the survivor does."""
    sender = group_sender(app, timeout_s=5)
    sender.update(perturbed(base, seed=16), weight_version="group-16")
    state = perturbed(base, seed=19)
    body = {**spec_lists(specs_of(state)), "weight_version": "during-a-kill"}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: http.post(f"{app.url}/update_weights_from_distributed", json=body, timeout=120))
        time.sleep(1.0)  # both replicas wait in the broadcast
        killed = kill_a_worker()
        try:
            sender.group.send(state)
        except WeightUpdateError:
            pass  # the dead rank's end of the broadcast fails
        answered = answer.result().json()
    sender.group.close()
    now = served_after_replacing(app, killed)
    committed = (state, "during-a-kill") if answered["success"] else (perturbed(base, seed=16), "group-16")
    expected = {(committed[1], weights_checksum(with_update(base, committed[0]).transformer))}
    assert set(now.values()) == expected, (answered, now)


# A colocated trainer (rollout.weight_sync.SharedMemorySender): its buckets in shared memory the
# replicas on its machine copy out.


def test_a_colocated_trainers_shared_buckets_reach_every_replica_as_full_weights_and_as_deltas(app, base):
    step_1 = perturbed(base, seed=21)
    step_2 = {name: t.clone() for name, t in step_1.items()}
    for tensor in list(step_2.values())[::4]:
        tensor.view(-1)[:3] -= 0.5
    sender = SharedMemorySender(RolloutClient(app.url).weight_route, bucket_bytes=64 * 2**10, deltas=True)
    try:
        updated = with_update(base, step_1)
        first = sender.update(step_1, weight_version="shared-1", checksum=weights_checksum(updated.transformer))
        assert "copied out of the trainer's shared memory" in first["message"]
        assert set(first["checksums"].values()) == {weights_checksum(updated.transformer)}
        # The same memory, written again: a refused update leaves every replica on shared-1.
        with pytest.raises(WeightUpdateError, match=r"refused by 2 replica\(s\).*NaN or infinite"):
            sender.update(with_one_value(step_2, float("nan")), weight_version="shared-nan", whole=True)
        assert {version for version, _ in served(app).values()} == {"shared-1"}
        updated = with_update(base, step_2)
        second = sender.update(step_2, weight_version="shared-2", checksum=weights_checksum(updated.transformer))
    finally:
        sender.close()
    assert "made whole" in second["message"]  # sent as a delta of shared-1
    assert set(served(app).values()) == {("shared-2", weights_checksum(updated.transformer))}
    parts, batch = rollout(app, {"prompt": ["3", "6"], "num_outputs_per_prompt": 4, "num_inference_steps": 3})
    assert len({part.replica for part in parts}) == 2 and {s.weight_version for s in batch.samples} == {"shared-2"}
    assert_replays_exactly(updated, batch)


def test_shared_buckets_the_replicas_cannot_read_are_refused_naming_the_bucket(app, base, http):
    state = perturbed(base, seed=22)
    lists = spec_lists(specs_of(state))
    url = f"{app.url}/update_weights_from_shared_memory"
    missing = http.post(url, json={**lists, "buckets": [{"shm_name": "rollout_ws_gone_0"}]}, timeout=60).json()
    assert not missing["success"] and "buckets[0]: no shared memory 'rollout_ws_gone_0' on this replica's machine" in missing["message"]
    too_many = http.post(url, json={**lists, "bucket_bytes": 2**16, "buckets": [{"shm_name": "rollout_ws_a"}]}, timeout=60)
    assert too_many.status_code == 400 and "buckets: these tensors take" in too_many.json()["message"]
    outside = http.post(url, json={**lists, "buckets": [{"shm_name": "../etc/passwd"}]}, timeout=60)
    assert outside.status_code == 422 and "buckets.0: String should match pattern" in outside.text, outside.text
    both = http.post(url, json={**lists, "buckets": [{}]}, timeout=60)
    assert both.status_code == 400 and "buckets[0]: names its memory by exactly one of shm_name and cuda_ipc" in both.text
    uneven = http.post(url, json={**lists, "dtypes": lists["dtypes"][1:], "buckets": []}, timeout=60)
    assert uneven.status_code == 400 and "names: names, dtypes and shapes differ in length" in uneven.text
    assert {version for version, _ in served(app).values()} == {"base"}
