"""The layering as a contract: `pyproject.toml`'s `[tool.importlinter]` contracts hold on this
checkout, and each of them breaks on a planted import that goes against it (so the check can fail).

The contracts read every import statement, those inside functions included (a lazy import is
still an import): only imports under `if TYPE_CHECKING:` are left out."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"

LIBRARY_ALONE = "the library runs without Ray and without the serving layer"
INGRESS_LIGHT = "the ingress and the weight coordinator load no model code"
LIBRARY_LAYERS = "the library's layers"
SERVING_LAYERS = "the serving layer's layers"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the packages under `root`, with `root`'s pyproject.toml."""
    environment = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=environment, capture_output=True, text=True, timeout=120
    )


def broken_contracts(report: str) -> list[str]:
    """Which of the contracts named above `lint-imports`' summary reports broken. The summary
    lists each contract's name and then KEPT or BROKEN, a long name wrapped over lines."""
    # The summary: after the "Analyzed N files" line and its underline, up to "Contracts: N kept".
    summary = " ".join(report.split("Analyzed", 1)[1].split("\n", 2)[2].split("Contracts:", 1)[0].split())
    verdicts = re.findall(r"(.+?) (KEPT|BROKEN)", summary)
    assert len(verdicts) == 4, report
    return [contract for contract in (LIBRARY_ALONE, INGRESS_LIGHT, LIBRARY_LAYERS, SERVING_LAYERS)
            for name, verdict in verdicts if name.strip().startswith(contract) and verdict == "BROKEN"]


def test_the_checkout_keeps_every_contract():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 4 kept, 0 broken." in result.stdout


# (file, the line planted at its end, the contract it breaks)
PLANTED = [
    ("rollout/schedule.py", "import deployments.dispatch", LIBRARY_ALONE),
    ("rollout/transitions.py", "import ray", LIBRARY_ALONE),
    ("deployments/routes/generate.py", "import rollout.models.sd3", INGRESS_LIGHT),
    ("deployments/weights.py", "from transformers import CLIPModel", INGRESS_LIGHT),
    ("rollout/trajectory.py", "import rollout.sampler", LIBRARY_LAYERS),
    ("rollout/options.py", "from rollout.plan import plan_rollout", LIBRARY_LAYERS),
    ("deployments/dispatch.py", "from deployments.routes import generate", SERVING_LAYERS),
    ("deployments/config.py", "import deployments.app", SERVING_LAYERS),
]


@pytest.fixture
def copy_of_the_packages(tmp_path) -> Path:
    """The two packages' Python files and the contracts, copied (model weights left behind)."""
    for package in ("rollout", "deployments"):
        shutil.copytree(REPO / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "weights"))
        # Checkpoint code lives in modules named weights.py: only the weights *folders* stay behind.
        for module in (REPO / package).rglob("weights.py"):
            target = tmp_path / module.relative_to(REPO)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(module, target)
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


@pytest.mark.parametrize("module, planted, contract", PLANTED, ids=[f"{m}:{p}" for m, p, _ in PLANTED])
def test_a_planted_import_breaks_its_contract(copy_of_the_packages, module, planted, contract):
    with open(copy_of_the_packages / module, "a") as source:
        source.write(f"\n{planted}  # planted\n")
    result = lint_imports(copy_of_the_packages)
    assert result.returncode != 0, result.stdout
    assert contract in broken_contracts(result.stdout), result.stdout


def test_a_module_outside_every_layer_breaks_the_layers(copy_of_the_packages):
    (copy_of_the_packages / "rollout" / "newcomer.py").write_text('"""Placed in no layer yet."""\n')
    result = lint_imports(copy_of_the_packages)
    assert broken_contracts(result.stdout) == [LIBRARY_LAYERS], result.stdout
    assert "rollout.newcomer" in result.stdout
