"""`rollout.client.RolloutClient` against a served application: the handle's batch bit for bit (a
plain request with debug tensors and conditioning, as msgpack and JSON), the request's own fields
and stage times, and refusals raised as typed errors naming the field. Trees, rewards and video
are checked beside their own applications (tests/deployments/test_tree_app.py,
test_rewards_app.py, test_video_app.py)."""

import pytest

from rollout.client import RequestRefusedError, RolloutClient
from rollout.errors import InvalidRequestError
from rollout.testing.batches import assert_same_batch

REQUEST = {
    "prompt": ["2", "9"],
    "num_outputs_per_prompt": 3,
    "num_inference_steps": 5,
    "seed": 31,
    "rollout_sde_step_indices": [1, 2, 3],
    "rollout_return_step_indices": [1, 2, 3, 4],
    "rollout_return_denoising_env": True,
}


@pytest.mark.parametrize("encoding", ["msgpack", "json"])
def test_the_client_gets_the_handles_batch_bit_for_bit(handle, base_url, encoding):
    answer = RolloutClient(base_url, encoding=encoding).generate_answer(REQUEST)
    assert_same_batch(handle.generate.remote(REQUEST).result().batch(), answer.batch)
    assert all(sample.schedule is answer.batch.schedule for sample in answer.batch.samples)
    assert answer.request_id and answer.inference_time_s > 0 and answer.attempts == 1
    assert answer.transformer_rows == answer.transformer_rows_unbranched > 0
    assert {"read_ms", "sample_ms"} <= answer.stages_ms.keys()


def test_a_refused_request_is_a_typed_error_naming_the_field_and_the_client_keeps_working(base_url):
    client = RolloutClient(base_url)
    with pytest.raises(RequestRefusedError, match="num_inference_steps") as refused:
        client.generate({**REQUEST, "num_inference_steps": 10_000})
    assert isinstance(refused.value, InvalidRequestError)  # what the handle raises
    assert (refused.value.status, refused.value.field) == (400, "num_inference_steps")
    with pytest.raises(RequestRefusedError) as refused:
        client.generate({**REQUEST, "num_outputs_per_prompt": "three"})
    assert refused.value.status == 422 and refused.value.field == "num_outputs_per_prompt"
    assert len(client.generate(REQUEST).samples) == 6
    assert client.info()["model"]
