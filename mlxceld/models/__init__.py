"""Models: fixtures, model identity, per-layer cost profile, and a pipeline stage's slice.

Importing this package does not import mlx: the fixture generator (which does)
is loaded on first use of one of its names, and ``mlxceld.models.slicing``
(``load_stage``, ``StageModel``) is imported only where a stage runs. The
daemon computes model identities without loading any model runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mlxceld.models.identity import layer_count, model_identity, read_model_config
from mlxceld.models.profile import LayerProfile, layer_profile

if TYPE_CHECKING:
    from mlxceld.models.fixtures import (
        CACHE_ENV,
        PRESETS,
        FixtureReport,
        FixtureSpec,
        cache_root,
        fixture_cache,
        model_config,
        preset,
        run_cli,
        write_fixture,
        write_fixture_report,
    )

_FIXTURE_NAMES = frozenset({
    "CACHE_ENV", "PRESETS", "FixtureReport", "FixtureSpec", "cache_root", "fixture_cache",
    "model_config", "preset", "run_cli", "write_fixture", "write_fixture_report"})


def __getattr__(name: str) -> Any:
    if name in _FIXTURE_NAMES:
        return getattr(importlib.import_module("mlxceld.models.fixtures"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CACHE_ENV", "PRESETS", "FixtureReport", "FixtureSpec", "LayerProfile",
           "cache_root", "fixture_cache", "layer_count", "layer_profile", "model_config",
           "model_identity", "preset", "read_model_config", "run_cli", "write_fixture",
           "write_fixture_report"]
