"""This daemon's compute units, as its inventory answer reports them to a planner.

The unit is ``models/speed.py``'s (GB/s of weights through a decode-shaped matrix
product). Where the number comes from, first found first:

1. declared: ``[daemon] compute_units`` above 0, else the ``[nodes.resources]
   compute_units`` above 0 of this daemon's node in its cluster TOML;
2. measured: the ``settings`` row keyed by ``models.speed.speed_key`` (mlx's version,
   the machine, the dtype of the model configured now): a measurement is made once per
   key and kept across restarts;
3. none yet (measuring, or the measurement failed): the answer carries no compute
   units, and a planner splits by memory.

``measure`` runs when the agent listener starts (at start with a cluster secret, or
with the first one), as a task of the daemon's task group: when nothing is
declared and nothing is cached for the model's dtype, the product runs in a child
process (``measure_in_child``, waited for in a thread: the event loop goes on
serving), its loop bounded by ``models.speed.BUDGET_S`` and the child by
``DEADLINE_S`` (mlx's import and the operands included), killed past it. The daemon
itself never imports mlx: mlx's threads, left running at its exit, would abort it.
Past the deadline the daemon says so in ``mlxctl status``. A model of another dtype
configured later is measured at the next start.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import Callable
from typing import Final

from mlxceld import failpoints
from mlxceld.errors import ConfigError, MlxceldError
from mlxceld.models.speed import model_dtype, speed_key
from mlxceld.state import Settings
from mlxceld.types import JSON

log = logging.getLogger(__name__)

DEADLINE_S: Final = 5.0  # the whole measurement: import mlx, make operands, time products


_CHILD: Final = ("import sys; from mlxceld.models.speed import measure_units; "
                 "print(measure_units(sys.argv[1]))")


def measure_in_child(dtype: str) -> float:
    """``measure_units`` in a child process, killed at ``DEADLINE_S``: mlx's threads never
    live in the daemon (left running at its exit, they abort it: exit -6 on a clean stop)."""
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, dtype], capture_output=True,
                              text=True, timeout=DEADLINE_S, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"measuring compute units took more than {DEADLINE_S:g} s",
                          hint="declare them: [daemon] compute_units = N") from None
    try:
        return float(done.stdout.strip())
    except ValueError:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise ConfigError(f"cannot measure compute units in {dtype}: {why}",
                          hint="declare them: [daemon] compute_units = N") from None


class NodeSpeed:
    """The compute units this daemon reports (the module docstring)."""

    def __init__(self, settings: Settings, *, declared: Callable[[], float | None],
                 model: Callable[[], str | None],
                 measure: Callable[[str], float] | None = None,
                 deadline_s: float = DEADLINE_S) -> None:
        forced = failpoints.COMPUTE_UNITS
        self._settings = settings
        self._declared = declared
        self._model = model
        self._measure: Callable[[str], float] = (
            measure if measure is not None
            else (lambda _dtype: forced) if forced is not None else measure_in_child)
        self._deadline_s = deadline_s
        self._measuring = False
        self._error: str | None = None

    def units(self) -> float | None:
        """The declared units, else the measured ones for the model's dtype, else None."""
        declared = self._declared()
        if declared:
            return declared
        return self._cached(model_dtype(self._model()))

    def describe(self) -> JSON:
        """``mlxctl status``'s ``daemon.compute_units``: the units (None: none yet), where
        they come from (declared, measured, measuring, unmeasured), the dtype, any error."""
        dtype = model_dtype(self._model())
        if self._declared():
            source = "declared"
        elif self._cached(dtype) is not None:
            source = "measured"
        else:
            source = "measuring" if self._measuring else "unmeasured"
        return {"units": self.units(), "source": source, "dtype": dtype,
                "error": self._error if source == "unmeasured" else None}

    async def measure(self) -> None:
        """Measure once for the model's dtype unless declared or cached (bounded by the
        deadline; a failure is logged and shown, and leaves the units unknown)."""
        dtype = model_dtype(self._model())
        if self._measuring or self._declared() or self._cached(dtype) is not None:
            return
        self._measuring = True
        try:
            async with asyncio.timeout(self._deadline_s):
                units = await asyncio.to_thread(self._measure, dtype)
        except TimeoutError:
            self._error = (f"the measurement took more than {self._deadline_s:g} s; declare "
                           "them: [daemon] compute_units = N")
        except MlxceldError as exc:
            self._error = exc.message
        else:
            self._settings.put(speed_key(dtype), {"units": units})
            log.info("compute units: %g (measured in %s)", units, dtype)
        finally:
            self._measuring = False
        if self._error is not None:
            log.warning("compute units not measured: %s (plans split by memory)", self._error)

    def _cached(self, dtype: str) -> float | None:
        row = self._settings.get(speed_key(dtype))
        value = row.get("units") if row is not None else None
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            return None
        return float(value)
