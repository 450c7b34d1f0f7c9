"""The TCP ports a peer's stage listeners may use: ``--stage-ports`` / ``[daemon] stage_ports``.

A single port (``19100`` or ``"19100"``) or an inclusive range ``"19100-19199"``,
each port in 1-65535 and the first not above the last. With a range set, the
inventory proposes only free ports from it (``inventory.free_ports``) and the
offer judge refuses an offered port outside it (``offers.judge``), so that a
firewall can be opened for the range ahead of any plan. Without one, stage
ports are ephemeral ports the system picks.

It governs assigned stages only (``--pp-peer``); a written cluster TOML
(``--distributed-config``) places its stages where it says.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from mlxceld.errors import ConfigError

HINT = 'write a port or an inclusive range, for example stage_ports = "19100-19199"'


@dataclass(frozen=True)
class StagePorts:
    first: int
    last: int

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.first, self.last + 1))

    def __len__(self) -> int:
        return self.last - self.first + 1

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


def parse_stage_ports(value: object, what: str) -> StagePorts:
    """``value`` (an int, ``"A"`` or ``"A-B"``) as a range; ``ConfigError`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(f"{what}: {value!r} is not a port or a range of ports", hint=HINT)
    text = str(value).strip()
    first, sep, last = text.partition("-")
    parts = (first, last) if sep else (first, first)
    if not all(p.strip().isascii() and p.strip().isdigit() for p in parts):
        raise ConfigError(f"{what}: {value!r} is not a port or a range of ports", hint=HINT)
    low, high = (int(p) for p in parts)
    for port in (low, high):
        if not 1 <= port <= 65535:
            raise ConfigError(f"{what}: port {port} is outside 1-65535", hint=HINT)
    if low > high:
        raise ConfigError(f"{what}: range {text!r} starts above its end ({low} > {high})",
                          hint=HINT)
    return StagePorts(low, high)
