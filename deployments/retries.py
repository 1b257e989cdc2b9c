"""Asking again while the replica asked is lost: one loop for a worker's part (`dispatch.py`) and
a scorer's call (`scoring.py`). What is asked again is the same (seeded work, kept samples), so
the answer is the one the lost replica would have given."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger("ray.serve")
T = TypeVar("T")


async def asked_until_not_lost(
    attempt: Callable[[int], Awaitable[T]],
    lost: type[BaseException] | tuple[type[BaseException], ...],
    attempts: int,
    asker: str,
    gave_up: Callable[[int], Exception],
) -> T:
    """The result of `attempt(n)` for the first n in 1 .. `attempts` that does not raise `lost`;
    after `attempts` losses, `gave_up(attempts)`. Any other error is raised at once. `asker` names
    what asked, in the log line of each loss."""
    for n in range(1, attempts + 1):
        try:
            return await attempt(n)
        except lost as error:
            logger.warning(
                "%s: the replica asked was lost (%s), attempt %d of %d", asker, type(error).__name__, n, attempts
            )
    raise gave_up(attempts)
