"""The fixtures every test room may ask for; the helpers behind them live in ``helpers/``."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlite_utils

from mlxceld.state import open_db

# Before the first import of a helper: its asserts then explain themselves as a test's do.
pytest.register_assert_rewrite("helpers")

from helpers.daemons import Daemons  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files with the most ``slow`` tests first, then the other integration tests, then
    the rest, each file's tests together and in their order: xdist (``--dist loadfile``)
    hands out whole files in this order, so a parallel run starts on its longest files and
    ends on short ones, instead of one worker running a long file while the others idle."""
    slow: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)

    def weight(item: pytest.Item) -> tuple[int, bool]:
        path = item.nodeid.split("::", 1)[0]
        return -slow[path], not path.startswith("tests/integration/")

    items.sort(key=weight)


@pytest.fixture
def daemons() -> Iterator[Daemons]:
    d = Daemons()
    try:
        yield d
    finally:
        d.cleanup()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[sqlite_utils.Database]:
    """A state database, ``state.db`` in the test's ``tmp_path``, closed after the test."""
    database = open_db(tmp_path / "state.db")
    try:
        yield database
    finally:
        database.conn.close()


@pytest.fixture
def state_dir() -> Iterator[Path]:
    """A state dir under /tmp with a short path (a Unix socket's path has a length limit),
    removed after the test."""
    root = Path(tempfile.mkdtemp(prefix="mx", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight checkpoints written by our generator: ``llama/`` and ``qwen3/``."""
    from helpers.models import write_tiny_checkpoints  # mlx, once a test asks for a model

    return write_tiny_checkpoints(tmp_path_factory.mktemp("fixtures"))


@pytest.fixture(scope="session")
def split_fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4-layer tiny checkpoints (``llama/``, ``qwen3/``) to split into pipeline stages."""
    from helpers.models import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path_factory.mktemp("split-fixtures"), layers=4)


@pytest.fixture(scope="session")
def kv_fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4-layer tiny checkpoints (``llama/``, ``qwen3/``) whose heads have 64 elements: what a
    quantized KV cache (``[serve] kv_bits``, groups of 64) needs."""
    from helpers.models import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path_factory.mktemp("kv-fixtures"), layers=4,
                                  head_dim=64)


@pytest.fixture(scope="session")
def bf16_split_fixture_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``split_fixture_dir``'s checkpoints in bfloat16: where rounding shows (a token that
    float32 keeps apart from the next best, bfloat16 may tie with it)."""
    from helpers.models import write_tiny_checkpoints

    return write_tiny_checkpoints(tmp_path_factory.mktemp("bf16-split-fixtures"), layers=4,
                                  dtype="bfloat16")


@pytest.fixture(scope="session")
def small_context(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama checkpoint of a small context (``helpers.models.SMALL_CONTEXT``): running
    to its end stays fast (~2 s)."""
    from mlxceld.models import preset, write_fixture

    from helpers.models import SMALL_CONTEXT

    path = tmp_path_factory.mktemp("small-context") / "llama"
    write_fixture(path, preset("tiny", family="llama", context=SMALL_CONTEXT))
    return path
