"""The samples this process has sent to worker replicas and not yet seen answered.

Kept apart from `deployments/routing.py` because Serve ships a custom router's module to the
processes that route by value (cloudpickle): a registry there would be a copy per router. This
module is imported by name, so the ingress and its routers share it.
"""

from __future__ import annotations

import weakref
from typing import Protocol


class _Counting(Protocol):
    outstanding_total: int


_routers: "weakref.WeakSet[_Counting]" = weakref.WeakSet()


def register(router: _Counting) -> None:
    _routers.add(router)


def outstanding_samples() -> int:
    """Summed over this process's routers (they run on another thread; each total is one int)."""
    return sum(router.outstanding_total for router in list(_routers))
