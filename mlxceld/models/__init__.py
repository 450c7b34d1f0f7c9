"""Models: fixtures and model identity now; layer slicing and cost profiles later."""

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
from mlxceld.models.identity import layer_count, model_identity, read_model_config

__all__ = ["CACHE_ENV", "PRESETS", "FixtureReport", "FixtureSpec", "cache_root",
           "fixture_cache", "layer_count", "model_config", "model_identity", "preset",
           "read_model_config", "run_cli", "write_fixture", "write_fixture_report"]
