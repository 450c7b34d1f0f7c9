"""The model directories a speculative-decoding test serves: a target and its drafts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlxceld.models.fixtures import agreeing_pair, preset, unrelated_draft, write_fixture


def write_pairs(root: Path, layers: int, **changes: Any) -> Path:
    """Under ``root``: ``target/`` (llama, its output projections zeroed) and its agreeing
    ``draft/`` (acceptance 1.0), an unrelated ``other/``, and ``plain/``: a random target
    whose greedy tokens depend on the whole context, ``other/`` usable as its draft too;
    ``changes`` to the ``tiny`` preset (``head_dim=64``: a quantized KV cache fits)."""
    target, draft = agreeing_pair(preset("tiny", family="llama", layers=layers, **changes))
    write_fixture(root / "target", target)
    write_fixture(root / "draft", draft)
    write_fixture(root / "other", unrelated_draft(target))
    write_fixture(root / "plain", preset("tiny", family="llama", layers=layers, **changes))
    return root
