"""``MLXCEL_DECODE_ALLOWLIST`` as a prefill node reads it (replicas/handoffs.py,
``decode_allowlist``): as mlxceld(8) documents it, a host name or malformed entry is
skipped with a warning, and unset, empty or every entry skipped allows any decode target
with one warning, rather than a list that refuses every target."""

from __future__ import annotations

import logging

import pytest

from mlxceld.replicas.handoffs import ALLOWLIST_ENV, decode_allowlist

LOGGER = "mlxceld.replicas.handoffs"


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_every_entry_invalid_allows_any_target_with_one_warning_naming_them(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert decode_allowlist("decode.example:7000, junk, 10.0.0.2") is None
    [said] = warnings(caplog)
    assert said.startswith(f"{ALLOWLIST_ENV} holds no usable entry")
    for entry in ("'decode.example:7000'", "'junk'", "'10.0.0.2'"):
        assert entry in said
    assert "any decode target" in said


def test_some_entries_valid_keep_the_list_and_warn_of_each_skipped_one(
        caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert decode_allowlist("10.0.0.2:7000, decode.example:7000, junk,") == \
            frozenset({"10.0.0.2:7000"})
    said = warnings(caplog)
    assert len(said) == 2
    assert "'decode.example:7000'" in said[0] and "'junk'" in said[1]


@pytest.mark.parametrize("value", [None, "", "  ", ", ,"])
def test_unset_or_empty_allows_any_target_with_one_warning(
        value: str | None, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert decode_allowlist(value) is None
    assert len(warnings(caplog)) == 1
