"""What a reload says of a rewritten API key file (config/changes.py): the change named,
never the key."""

from __future__ import annotations

from mlxceld.config.changes import HIDDEN, api_key_change


def test_a_reload_names_a_changed_api_key_without_showing_it() -> None:
    assert api_key_change("sk-same-123456", "sk-same-123456") == []
    assert api_key_change("sk-old-1234567", "sk-new-1234567") == [
        {"key": "serve.api_key", "old": HIDDEN, "new": HIDDEN}]
    assert api_key_change(None, "sk-new-1234567") == [
        {"key": "serve.api_key", "old": None, "new": HIDDEN}]
    assert api_key_change("sk-old-1234567", None) == [
        {"key": "serve.api_key", "old": HIDDEN, "new": None}]
