"""Ports for the servers the tests start, chosen where nothing else on the machine takes one.

A port the kernel hands out for `bind(("127.0.0.1", 0))` comes from the ephemeral range
(32768-60999 on Linux), where every outgoing connection also takes its local port. Between the
moment a test finds such a port free and the moment its server binds it (seconds later, inside a
replica that Ray is still starting), any new connection on the machine may take it, and the server
then fails to start (the likeliest cause of an ingress that failed to start in CI, whose replica
logs CI does not keep). Ports between Ray's worker ports (10002-19999) and the ephemeral range are
taken only by servers asked for them by number.
"""

import random
import socket
from contextlib import ExitStack

UNCLAIMED_PORTS = range(20000, 32768)
_ATTEMPTS = 256  # ports already bound by another test's server are skipped, boundedly


def free_ports(count: int) -> list[int]:
    """`count` different ports that are free on 127.0.0.1 now, at random from `UNCLAIMED_PORTS`."""
    chooser = random.SystemRandom()  # unaffected by the seeds tests set, and different per process
    found: list[int] = []
    with ExitStack() as stack:  # each found port stays bound until all are found, so they differ
        for port in chooser.sample(UNCLAIMED_PORTS, _ATTEMPTS):
            held = stack.enter_context(socket.socket())
            try:
                held.bind(("127.0.0.1", port))
            except OSError:
                continue
            found.append(port)
            if len(found) == count:
                return found
    raise RuntimeError(f"found {len(found)} of {count} free ports in {_ATTEMPTS} tries within {UNCLAIMED_PORTS}")


def free_port() -> int:
    return free_ports(1)[0]
