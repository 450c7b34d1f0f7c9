"""Models: fixtures, and a pipeline stage's slice of a model; identity and cost profiles later.

``mlxceld.models.slicing`` (``load_stage``, ``StageModel``) imports mlx and
mlx-lm, so it is not imported here: import it where a stage runs.
"""

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
