"""One real daemon serving a fixture model, as the endpoint tests start it.

``tools_model``: the tiny Qwen3-style fixture with the tools chat template (json tool
calls, ``<think>`` reasoning), the model the chat, Responses and Messages tests ask.
``serving_daemon``: a daemon serving it with ``--model`` and ``--port`` (and, given a
key, ``--api-key-file``), yielding ``http://127.0.0.1:PORT``; every process it made is
ended by pid when the block ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from mlxceld.models import preset, write_fixture

from helpers.daemons import READY_S, Daemons
from helpers.ports import free_port


def tools_model(tmp_path_factory: pytest.TempPathFactory, name: str = "qwen3") -> Path:
    """The tools fixture (4 layers, so a 2-stage pipeline can split it) as ``name``."""
    return write_fixture(tmp_path_factory.mktemp("tools-fixture") / name,
                         preset("tiny", layers=4, chat_template="tools"))


@contextmanager
def serving_daemon(model: Path, *, api_key: str | None = None) -> Iterator[str]:
    """A daemon serving ``model`` (its router running); yields its base URL (no ``/v1``).
    ``api_key``: the key it requires, from a 0600 file as an operator keeps it."""
    daemons = Daemons()
    try:
        extra: list[str] = []
        if api_key is not None:
            key_file = Path(daemons.make(name="keyed").root) / "api-key"
            key_file.write_text(api_key + "\n")
            key_file.chmod(0o600)
            extra = ["--api-key-file", str(key_file)]
        port = free_port()
        d = daemons.make().start("--model", str(model), "--port", str(port), *extra)
        daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
        yield f"http://127.0.0.1:{port}"
    finally:
        daemons.cleanup()
