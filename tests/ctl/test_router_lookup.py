"""Where ``mlxctl chat`` finds the router and its key (``mlxctl/routerapi.py``): from a
daemon's status body, a wildcard listen address reached on loopback, the key read from
the file the daemon names or the one given, and a clear refusal when neither works."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxctl.routerapi import RouterError, from_status, loopback

KEY = "sk-lookup-0123456789"


@pytest.mark.parametrize(("url", "reached"), [
    ("http://127.0.0.1:8080/v1", "http://127.0.0.1:8080/v1"),
    ("http://0.0.0.0:8080/v1", "http://127.0.0.1:8080/v1"),
    ("http://:::8080/v1", "http://[::1]:8080/v1"),
    ("http://[::]:8080/v1", "http://[::1]:8080/v1"),
    ("http://fe80::1:8080/v1", "http://[fe80::1]:8080/v1"),
    ("http://studio.local:8080/v1", "http://studio.local:8080/v1"),
])
def test_a_wildcard_address_is_reached_on_loopback(url: str, reached: str) -> None:
    assert loopback(url) == reached


def serving(**more: object) -> dict[str, object]:
    return {"serving": {"model": "/m/llama", "model_name": "llama",
                        "url": "http://0.0.0.0:8080/v1", "api_key": False, **more}}


def key_file(tmp_path: Path, name: str = "key", mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_text(KEY + "\n")
    path.chmod(mode)
    return path


def test_the_router_and_its_key_come_from_the_status(tmp_path: Path) -> None:
    plain = from_status(serving(), None)
    assert (plain.url, plain.model, plain.key) == ("http://127.0.0.1:8080/v1", "llama", None)
    keyed = from_status(serving(api_key=True, api_key_file=str(key_file(tmp_path))), None)
    assert keyed.key == KEY and KEY not in repr(keyed)
    given = key_file(tmp_path, "mine")
    assert from_status(serving(), given).key == KEY  # --api-key-file beats the daemon's


def test_what_cannot_be_found_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(RouterError, match="serves no model") as nothing:
        from_status({"serving": None}, None)
    assert "mlxctl serve" in nothing.value.hint and nothing.value.dead
    missing = tmp_path / "absent"
    with pytest.raises(RouterError, match=f"the daemon's .serve. api_key_file: API key file "
                                          f"{missing} cannot be read") as unreadable:
        from_status(serving(api_key=True, api_key_file=str(missing)), None)
    assert "--api-key-file" in unreadable.value.hint
    with pytest.raises(RouterError, match="wants an API key"):
        from_status(serving(api_key=True), None)
