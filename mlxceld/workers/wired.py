"""mlx's wired memory limit in the workers that hold weights (router and stage).

On a Mac, Metal may page out memory that is not wired, and a model's weights
paged out make every step slow. mlx-lm's own ``generate`` and ``server`` raise
mlx's wired limit to the device's recommended working set
(``mlx_lm.utils.maybe_set_recommended_wired_limit``); our router and stage
workers do the same before they load weights. Elsewhere (mlx's CPU or CUDA
backend) the device reports no recommended size and nothing is changed.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def set_wired_limit() -> None:
    """Wire up to the recommended working set where the device has one (module docstring)."""
    import mlx.core as mx
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    try:
        previous = maybe_set_recommended_wired_limit()
    except (RuntimeError, ValueError) as exc:  # mlx refused the size: run with its default
        log.warning("mlx's wired memory limit was left as it is: %s", exc)
        return
    if previous is not None:
        size = mx.device_info().get("max_recommended_working_set_size")
        log.info("mlx's wired memory limit: %s bytes (the recommended working set), was %d",
                 size, previous)
