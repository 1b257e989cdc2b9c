"""Scorers by name: the built-in ones, and a user's own by import path.

An app config (or a trainer) names a scorer's kind, a built-in name or `"package.module:Class"`,
and its keyword options; `build_scorer` imports the class and calls it with them. Import paths
come from the operator's config, never from a request: a request only names scorers the app
configured.
"""

from __future__ import annotations

import importlib
from typing import Any

from rollout.errors import ModelLoadError
from rollout.scorers.base import Scorer

BUILT_IN = {
    "digits": "rollout.scorers.digits:DigitProbability",
    "ink": "rollout.scorers.digits:Ink",
    "clip": "rollout.scorers.clip:ClipScorer",
    "http": "rollout.scorers.http:HttpScorer",
    "pairwise": "rollout.scorers.preference:PairwisePreference",
}


def scorer_class(kind: str) -> type:
    """The class of a built-in kind or of a `"package.module:Class"` import path."""
    import_path = BUILT_IN.get(kind, kind)
    module_name, _, class_name = import_path.partition(":")
    if not module_name or not class_name:
        raise ModelLoadError("kind", f"must be one of {sorted(BUILT_IN)} or an import path 'package.module:Class', got {kind!r}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ModelLoadError("kind", f"cannot import {import_path!r}: {error}") from None
    if not isinstance(getattr(cls, "group_aware", None), bool) or not callable(getattr(cls, "score", None)):
        raise ModelLoadError("kind", f"{import_path!r} is not a scorer: it needs a `score` method and a bool `group_aware`")
    return cls


def build_scorer(kind: str, options: dict[str, Any] | None = None) -> Scorer:
    """A scorer of `kind` made with keyword `options`."""
    cls = scorer_class(kind)
    try:
        return cls(**(options or {}))
    except TypeError as error:
        raise ModelLoadError("options", f"{kind!r} does not take these options: {error}") from None
