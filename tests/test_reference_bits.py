"""Same seeds, same bits through the library: the fixed rollouts of `reference_bits.py`, for the
embedded model and each tiny real family, against the committed digests.

The rollouts run in a subprocess held to AVX2 (`reference_bits.AVX2_HOLD`), the kernel set the
digests are recorded in, so that every machine with AVX2 checks them, whatever more it has."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.reference_bits import AVX2_HOLD, LIBRARY_FAMILIES, LIBRARY_RUNS, REFERENCE, cpu_has_avx2

REPOSITORY = Path(__file__).resolve().parents[1]
# Only a hang takes this long: the subprocess's imports, tiny families and 12 rollouts took 6 s on 2 cores.
LIBRARY_DIGESTS_TIMEOUT_S = 600


@pytest.fixture(scope="module")
def held_to_avx2(tmp_path_factory) -> dict:
    """The library's digests by key, and the kernel set they were computed in (`current_kernel_set`)."""
    if not cpu_has_avx2():
        pytest.skip("the reference digests are recorded on AVX2, and this CPU lacks it")
    out = tmp_path_factory.mktemp("reference-bits") / "digests.json"
    result = subprocess.run(
        [sys.executable, "-m", "tests.reference_bits", str(out)],
        cwd=REPOSITORY,
        env={**os.environ, **AVX2_HOLD},
        capture_output=True,
        text=True,
        timeout=LIBRARY_DIGESTS_TIMEOUT_S,
    )
    assert result.returncode == 0, f"computing the library's digests failed:\n{result.stderr[-4000:]}"
    computed = json.loads(out.read_text())
    assert computed["kernel_set"].startswith("AVX2 "), f"held to AVX2, torch ran {computed['kernel_set']}"
    return computed


@pytest.mark.parametrize("run", sorted(LIBRARY_RUNS))
@pytest.mark.parametrize("family", LIBRARY_FAMILIES)
def test_library_rollouts_keep_their_bits(family, run, held_to_avx2):
    key = f"library:{family}:{run}"
    REFERENCE.check(key, held_to_avx2["digests"][key], held_to_avx2["kernel_set"])
