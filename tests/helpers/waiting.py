"""Waiting for a condition with a deadline that fails the test naming what it waited for:
``wait_for`` blocks (a daemon in another process), ``until`` awaits (a task in this loop)."""

from __future__ import annotations

import asyncio
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


async def until(predicate: Callable[[], Any], what: str, timeout: float = 5.0,
                every: float = 0.01) -> Any:
    """Poll ``predicate`` between turns of the event loop until it returns something truthy;
    fail the test naming ``what`` after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not (last := predicate()):
        if loop.time() >= deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what} (last: {last!r})")
        await asyncio.sleep(every)
    return last
