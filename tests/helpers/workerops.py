"""A worker control-channel request of any op, without fields (an unknown one included),
for tests that drive a worker by the op's name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Op:
    name: str

    @property
    def OP(self) -> str:
        return self.name

    def to_wire(self) -> dict[str, Any]:
        return {"op": self.name}
