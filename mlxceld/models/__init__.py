"""Models: fixtures now; model identity, layer slicing and cost profiles later."""

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

__all__ = ["CACHE_ENV", "PRESETS", "FixtureReport", "FixtureSpec", "cache_root",
           "fixture_cache", "model_config", "preset", "run_cli", "write_fixture",
           "write_fixture_report"]
