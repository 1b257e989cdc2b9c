"""Fuzzed bodies over every route (`benchmarks/fuzz.py`, which runs 2,000 of them): each is
answered with a 2xx or a 4xx, none hangs, and the server serves on."""

from ray import serve

from benchmarks.fuzz import RELEASE_ROUTE, RESUME_AFTER_RELEASE, VALID_BODIES, fuzz_cases, run_fuzz
from tests.deployments.apps import deploy_ingress

COUNT = 150
TOKEN = "fuzz-test-token-5b21c7"


def test_fuzzed_bodies_get_no_5xx_and_none_hangs(base_url, http):
    report = run_fuzz(base_url, COUNT, seed=16)
    assert not report.hung, [(case.number, case.path, case.mutation) for case in report.hung]
    assert not report.server_errors, [
        (case.number, case.path, case.mutation, text) for case, _, text in report.server_errors
    ]
    # Every route was reached, and most bodies of the routes that read them were refused.
    routes = {route for route, _ in report.statuses}
    assert routes == {case.path.split("?")[0] for case in fuzz_cases(COUNT, seed=16)}
    read = {status: answers for (route, status), answers in report.statuses.items() if route in VALID_BODIES}
    assert sum(answers for status, answers in read.items() if 400 <= status < 500) > sum(read.values()) / 2, read
    response = http.post(f"{base_url}/rollout/generate", json={"prompt": "7", "num_inference_steps": 2})
    assert response.status_code == 200


def test_with_a_token_the_fuzz_also_releases_memory_resuming_after_each_and_gets_no_5xx(serve_app, base_url, http):
    # An ingress of its own, with the token, in front of the session's workers: what it releases, it resumes.
    app = deploy_ingress(serve_app, "fuzz-token", auth_token=TOKEN)
    try:
        report = run_fuzz(app.url, 60, seed=17, token=TOKEN)
    finally:
        serve.delete(app.name)
    assert not report.hung and not report.server_errors, report.server_errors
    releases = report.statuses[(RELEASE_ROUTE[1], 200)]
    assert releases > 0 and report.statuses[(RESUME_AFTER_RELEASE, 200)] == releases, report.statuses
    assert sum(answers for (route, _), answers in report.statuses.items() if route == "/rollout/generate") > 0
    response = http.post(f"{base_url}/rollout/generate", json={"prompt": "7", "num_inference_steps": 2})
    assert response.status_code == 200
