"""Waiting for a state of a running application: the fault tests poll the state itself, so that
they go on as soon as it holds, rather than sleep for a time that is too long here and too short
on a busy machine."""

import time


def wait_until(condition, what: str, timeout_s: float = 120.0, poll_s: float = 0.05):
    """`condition()`'s first true value, polled every `poll_s`; fails the test, naming `what`
    (the state waited for), if it is not reached within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"never reached within {timeout_s} s: {what}"
        time.sleep(poll_s)
    return value
