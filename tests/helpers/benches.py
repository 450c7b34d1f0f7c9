"""A benchmark of ``bench/`` loaded as a module, for its smoke test: by file (``bench/`` is
no package), with ``bench/`` on ``sys.path`` for its own imports (``loopback``, ``mlxlm``,
``streams``, ...) while it is used."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).parents[2] / "bench"


@contextlib.contextmanager
def bench_module(name: str) -> Iterator[ModuleType]:
    """``bench/NAME.py`` as the module ``bench_NAME``."""
    sys.path.insert(0, str(BENCH))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH))
