"""Damage done to a state database on purpose, as a failing disk or a bad copy would."""

from __future__ import annotations

import random
from pathlib import Path

PAGE = 4096  # SQLite's default page size, ours


def scribble_pages(path: Path, count: int = 2, seed: int = 7) -> list[int]:
    """Random bytes over ``count`` whole data pages of ``path`` (never page 1, the header
    and schema, whose damage SQLite reports at once); the page numbers, 1-based."""
    pages = path.stat().st_size // PAGE
    assert pages > count, f"{path} has {pages} pages: too few to damage {count} data pages"
    rng = random.Random(seed)
    chosen = sorted(rng.sample(range(2, pages + 1), count))
    with path.open("r+b") as f:
        for page in chosen:
            f.seek((page - 1) * PAGE)
            f.write(rng.randbytes(PAGE))
    return chosen
