"""Models: fixtures, model identity, and a pipeline stage's slice of a model.

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
from mlxceld.models.identity import layer_count, model_identity, read_model_config

__all__ = ["CACHE_ENV", "PRESETS", "FixtureReport", "FixtureSpec", "cache_root",
           "fixture_cache", "layer_count", "model_config", "model_identity", "preset",
           "read_model_config", "run_cli", "write_fixture", "write_fixture_report"]
