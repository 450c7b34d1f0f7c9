"""How fast this host runs a model's decode: its compute units, measured.

A **compute unit** is one GB/s (10**9 bytes per second) of weights streamed through a
decode-shaped matrix product: ``ROWS`` activation rows (a few sequences decoding at
once) times a ``SIZE`` x ``SIZE`` weight matrix in the model's dtype, on mlx's default
device. Decoding one token reads every weight of the model once and does little else
with it (two floating-point operations per weight and row), so a stage's time per
token is about its weight bytes divided by its host's compute units times 10**9: the
number the planner balances (``cluster/plan/solver.py``) and ``mlxctl cluster plan``
shows as milliseconds. A declared value (``[daemon] compute_units``, a cluster TOML's
``[nodes.resources] compute_units``) is in the same unit; only the ratios between hosts
change a split, so any consistent scale works there.

``measure_units`` is bounded: it makes its operands, then multiplies for ``budget_s``
(at least one product, each of ``SIZE * SIZE`` weights: about 8 MiB in bfloat16, a few
milliseconds on one CPU core) and returns the rate of the products it timed. It blocks:
the daemon runs it in a thread, under a deadline of its own (``discovery/speed.py``).
``speed_key`` names what a measurement depends on (mlx's version, the machine, the
dtype): a cached one with another key is measured again.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Final

from mlxceld.errors import ConfigError

SIZE: Final = 2048  # the weight matrix's side: 4 Mi weights, beyond most L2 caches
ROWS: Final = 4  # activation rows: a few sequences decoding at once
BUDGET_S: Final = 0.2  # how long the products are timed
DTYPES: Final = ("bfloat16", "float16", "float32")
DEFAULT_DTYPE: Final = "bfloat16"  # what most checkpoints hold, and the default without one
MAX_UNITS: Final = 1e6  # 1 PB/s: far above any host; a larger measurement is refused


def model_dtype(model: str | None) -> str:
    """The floating dtype of ``model``'s config.json (``torch_dtype``, or ``dtype``) when it
    is a local directory that names one of ``DTYPES``; else ``DEFAULT_DTYPE`` (no model, a
    repo id not fetched yet, a quantized checkpoint's other names)."""
    if model is None:
        return DEFAULT_DTYPE
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return DEFAULT_DTYPE
    for key in ("torch_dtype", "dtype"):
        value = config.get(key) if isinstance(config, dict) else None
        if value in DTYPES:
            return str(value)
    return DEFAULT_DTYPE


def speed_key(dtype: str) -> str:
    """The cache key of a measurement in ``dtype`` on this host with this mlx."""
    try:
        mlx = version("mlx")
    except PackageNotFoundError:
        mlx = "none"
    machine = f"{platform.system()}/{platform.machine()}/{platform.node()}/{os.cpu_count()}"
    return f"compute_units/{mlx}/{machine}/{dtype}"


def measure_units(dtype: str = DEFAULT_DTYPE, budget_s: float = BUDGET_S, *,
                  clock: Callable[[], float] = time.perf_counter) -> float:
    """This host's compute units in ``dtype`` (the module docstring); ``ConfigError`` for a
    dtype not in ``DTYPES``, or when mlx cannot run the product."""
    if dtype not in DTYPES:
        raise ConfigError(f"cannot measure compute units in {dtype!r}",
                          hint=f"measure in one of {', '.join(DTYPES)}")
    try:
        import mlx.core as mx  # here: the daemon imports mlx only to measure
        kind = getattr(mx, dtype)
        weights = mx.random.normal((SIZE, SIZE)).astype(kind)
        rows = mx.random.normal((ROWS, SIZE)).astype(kind)
        mx.eval(weights, rows, rows @ weights.T)  # made, and the first product warmed up
        done, started = 0, clock()
        while True:
            mx.eval(rows @ weights.T)
            done += 1
            took = clock() - started
            if took >= budget_s:
                break
    except (ImportError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot measure compute units in {dtype}: {exc}",
                          hint="declare them: [daemon] compute_units = N (GB/s of weights)"
                          ) from exc
    rate = done * SIZE * SIZE * weights.itemsize / max(took, 1e-9) / 1e9
    return min(round(rate, 3), MAX_UNITS) or 0.001
