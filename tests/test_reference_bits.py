"""Same seeds, same bits through the library: the fixed rollouts of `reference_bits.py`, for the
embedded model and each tiny real family, against the committed digests."""

import pytest
import torch

from rollout.models.base import MicroBatching
from rollout.models.registry import load_pipeline
from rollout.options import SamplingOptions
from rollout.sampler import sample
from tests.reference_bits import LIBRARY_RUNS, REFERENCE, batch_records, field_digests


@pytest.fixture(scope="module")
def pipelines(tiny_family_dirs, embedded_pipeline):
    loaded = {"embedded-digits": embedded_pipeline}
    for family in ("sd3", "flux", "qwenimage"):
        # Two guided samples a transformer call (SD3's takes both branches: 4 rows), two images a VAE call.
        micro_batching = MicroBatching(4 if family == "sd3" else 2, decode_default=2)
        loaded[family] = load_pipeline(family, tiny_family_dirs[family], device="cpu", micro_batching=micro_batching)
    return loaded


@pytest.fixture
def one_thread():
    # The served digests come from workers with one torch thread; the library's use the same.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("run", sorted(LIBRARY_RUNS))
@pytest.mark.parametrize("family", ["embedded-digits", "sd3", "flux", "qwenimage"])
def test_library_rollouts_keep_their_bits(family, run, pipelines, one_thread):
    prompts, seeds, fields, negatives = LIBRARY_RUNS[run]
    pipeline = pipelines[family]
    if family == "embedded-digits":
        prompts = [str(len(p) % 10) for p in prompts]  # digits' own prompts
        fields = {**fields, "height": None, "width": None}
    else:
        fields = {**fields, "height": 32, "width": 32}
    negatives = None if negatives is None or family == "embedded-digits" else negatives * len(prompts)
    batch = sample(pipeline, prompts, seeds, SamplingOptions(**fields), negatives, weight_version="v")
    REFERENCE.check(f"library:{family}:{run}", field_digests(batch_records(batch)))
