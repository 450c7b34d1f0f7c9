"""mlxceld(8)'s PORTS section names every listener the daemon and its workers open, each
with the flag or key that places it: the serving listener (a replica's, a prefill or
decode node's; ``replicas/service.py``) was missing from it."""

from __future__ import annotations

import re
from pathlib import Path

from mlxceld.config.daemon import FLAG_KEYS

PAGE = Path(__file__).resolve().parents[2] / "man" / "mlxceld.8"
# Each listener, and the flags its entry must name (each one the daemon has).
LISTENERS = {
    "the OpenAI-compatible port": ("--host", "--port"),
    "the metrics listener": (),
    "the serving listener": ("--serving-port",),
    "the agent listener": ("--agent-addr",),
    "stage listeners": ("--stage-ports",),
    "mDNS": ("--cluster-discovery",),
    "the control socket": ("--socket",),
    "tensor ring ends": ("--tp-peers",),
}


def plain(roff: str) -> str:
    """Roff as text: macro names, font changes, escaped hyphens and quotes undone."""
    text = re.sub(r"^\.[A-Z]{1,2} ?|\\f[BIRP]", "", roff, flags=re.M)
    return text.replace("\\-", "-").replace('"', "")


def ports_entries() -> dict[str, str]:
    """PORTS's ``.TP`` entries: each tag line's text, to its body's text."""
    text = PAGE.read_text().split(".SH PORTS", 1)[1].split("\n.SH ", 1)[0]
    entries: dict[str, str] = {}
    for chunk in text.split("\n.TP\n")[1:]:
        tag, _, body = chunk.partition("\n")
        entries[plain(tag)] = plain(body.split("\n.PP\n", 1)[0])
    return entries


def test_every_listener_has_its_entry_naming_its_flags() -> None:
    entries = ports_entries()
    assert set(entries) == set(LISTENERS)
    for name, flags in LISTENERS.items():
        for flag in flags:
            assert flag in FLAG_KEYS or flag == "--socket", flag  # a flag the daemon has
            assert flag in entries[name], (name, flag)
    serving = entries["the serving listener"]
    assert "serving_port" in serving and "MXCL channel 1" in serving
    assert "serving listener at HOST:PORT" in serving  # as mlxctl status shows it
