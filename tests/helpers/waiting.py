"""Waiting for a condition with a deadline that fails the test naming what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll until ``predicate`` returns something truthy; fail the test naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every)
    pytest.fail(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
