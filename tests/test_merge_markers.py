"""No file of the repository keeps a merge's conflict markers (one did land once, in
ARCHITECTURE.md): every file git tracks is read, and a line that opens, parts or closes
a conflict fails the test, naming the file and line."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                         check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_keeps_conflict_markers() -> None:
    found = []
    for path in tracked():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or removed in the work tree
        found += [f"{path.relative_to(ROOT)}:{n}" for n, line in
                  enumerate(text.splitlines(), 1) if MARKER.match(line)]
    assert not found, f"conflict markers left: {found}"
