"""The request space as a property test, in the library (`benchmarks/properties.py`): every kept
counterexample, then generated valid requests on the embedded model and each tiny family, each
checked for every guarantee against formulas written in the checker. The budget (the model's
record's, `rollout.testing.families`) and Hypothesis's seed are in each test's id; `python -m
benchmarks.properties --examples N` runs a large budget."""

import pytest
from hypothesis import HealthCheck, given, seed, settings

from benchmarks.properties import COPIES, OPEN_COUNTEREXAMPLES, REGRESSIONS, Case, PropertyViolation, cases, check_case

SEED = 44


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("case", REGRESSIONS, ids=[f"{case.copy}-{i}" for i, case in enumerate(REGRESSIONS)])
def test_every_counterexample_ever_found_keeps_every_guarantee(case: Case):
    check_case(case)


@pytest.mark.xfail(strict=True, raises=PropertyViolation, reason="an open defect: benchmarks.properties.OPEN_COUNTEREXAMPLES")
@pytest.mark.parametrize("case", OPEN_COUNTEREXAMPLES, ids=[f"{case.copy}-{i}" for i, case in enumerate(OPEN_COUNTEREXAMPLES)])
def test_open_counterexamples_still_break_a_guarantee(case: Case):
    check_case(case)


@pytest.mark.parametrize("name", list(COPIES), ids=[f"{name}-budget{r.requests.budget}-seed{SEED}" for name, r in COPIES.items()])
def test_generated_requests_keep_every_guarantee(name: str):
    budget = COPIES[name].requests.budget
    print(f"{budget} generated requests on {name}, Hypothesis seed {SEED}")

    @seed(SEED)
    @settings(max_examples=budget, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases((name,)))
    def every_guarantee_holds(case: Case) -> None:
        check_case(case)

    every_guarantee_holds()
