"""The ingress's routes, one module per concern, each a mixin of `RolloutIngress` (as Ray Serve LLM
composes its ingress from mixins): `generate`, `weights`, `memory`, `discovery`, `health`. A
mixin's HTTP routes and handle methods sit together; what it needs from the ingress (`config`,
`dispatcher`, `coordinator`, `worker`, ...) is named in its docstring.

A route is declared on its method with `route`, and `mount` puts every declared route of the
mixins on the ingress's FastAPI app. `serve.ingress` rewrites each route's signature so that
FastAPI passes the replica's instance as `self`, and Serve pickles the app to the replica with
the rewritten signature: `mount` therefore mounts a wrapper of each method, which travels by
value. A mixin's own method would travel by reference, be imported afresh in the replica, and
take `self` for a query parameter (every route answered 422).

No `from __future__ import annotations` in these modules: FastAPI reads the routes' parameter
types, and `serve.ingress` rebuilds the routes where string annotations no longer resolve.
"""

import functools
from collections.abc import Callable

from fastapi import FastAPI


def route(method: str, path: str, operator: bool = False) -> Callable:
    """Declares the decorated mixin method as the HTTP route `method path`; `operator`: it changes or
    reads what every replica serves (weights, memory), so without a token only this machine may
    call it (`deployments/auth.py`)."""

    def declare(endpoint: Callable) -> Callable:
        endpoint.http_route = (method, path)
        endpoint.operator_route = operator
        return endpoint

    return declare


def operator_paths(mixins: list[type]) -> frozenset[str]:
    """The paths of the operator routes the mixins declare."""
    return frozenset(
        endpoint.http_route[1]
        for mixin in mixins
        for endpoint in vars(mixin).values()
        if getattr(endpoint, "operator_route", False)
    )


def mount(app: FastAPI, mixins: list[type]) -> None:
    """Adds every route the mixins declare to `app`."""
    for mixin in mixins:
        for endpoint in vars(mixin).values():
            if hasattr(endpoint, "http_route"):
                method, path = endpoint.http_route
                app.add_api_route(path, _travelling(endpoint), methods=[method])


def _travelling(endpoint: Callable) -> Callable:
    @functools.wraps(endpoint)
    async def call(self, *args, **kwargs):
        return await endpoint(self, *args, **kwargs)

    return call
