"""Network addresses taken out of text that leaves the router: a member's error in the
redacted ``/router/stats``, and every error a client is told.

A member's own address (its host and its ``host:port``) is replaced wherever it
appears, and so is anything shaped like an address: an IPv4 address (with or
without a port), an IPv6 address (bracketed, or bare with at least two colons),
and ``name:port``. Each becomes ``<address>``. It errs on the side of removing:
a clock time such as ``12:30:05`` reads as an IPv6 address and goes too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Final

REDACTED: Final = "<address>"

_PATTERNS: Final = re.compile("|".join([
    r"\[[0-9A-Fa-f:.%A-Za-z]*\](?::\d{1,5})?",  # [fd00::1]:19000, [::1]
    r"\b(?:\d{1,3}\.){3}\d{1,3}(?::\d{1,5})?\b",  # 10.0.0.2:19000, 10.0.0.2
    r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])",  # fd00::1
    r"\b[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*:\d{1,5}\b",  # host:1
]))


def scrub(text: str, addresses: Iterable[str] = ()) -> str:
    """``text`` with each of ``addresses`` (``host:port``; its host too) and anything
    shaped like an address replaced by ``<address>``."""
    known: set[str] = set()
    for address in addresses:
        if not address:
            continue
        known.add(address)
        host = address.rsplit(":", 1)[0] if ":" in address else address
        host = host.strip("[]")
        if len(host) >= 3:  # a one- or two-letter host would eat ordinary words
            known.add(host)
    for item in sorted(known, key=len, reverse=True):
        text = text.replace(item, REDACTED)
    return _PATTERNS.sub(REDACTED, text)
