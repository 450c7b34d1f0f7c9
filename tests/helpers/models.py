"""Models for the tests: tiny checkpoints from our fixture generator, and what mlx-lm itself
generates from one (the text a daemon must serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx_lm

from mlxceld.models import preset, write_fixture

FAMILIES = ("llama", "qwen3")
PROMPT = "The quick brown fox"


def write_tiny_checkpoints(root: Path, **changes: Any) -> Path:
    """The ``tiny`` preset of each family under ``root`` (``root/llama``, ``root/qwen3``),
    with ``changes`` to the preset (``layers=4``)."""
    for family in FAMILIES:
        write_fixture(root / family, preset("tiny", family=family, **changes))
    return root


def expected(model: Path, prompt: str, n: int) -> str:
    """mlx-lm's greedy text for ``prompt``, ``n`` tokens at most."""
    m, tok = mlx_lm.load(str(model))
    text: str = mlx_lm.generate(m, tok, prompt, max_tokens=n)
    return text
