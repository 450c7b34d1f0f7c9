"""The control API's view (``control.view.DaemonView``) over one flat fake of the daemon:
each part's names read from the fake's own (``workers()`` for the supervisor's
``snapshot()``, ...), looked up at each call, so that a fake may leave out what a test
does not ask (asked anyway, it fails as an attribute error would)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxceld.control.view import DaemonView, Lifetime


@dataclass(frozen=True)
class Answer:
    """A fake's typed answer (``control/answers.py`` and the records it names): only what
    it writes, ``json``, which is all the endpoints read of one."""

    json: Any

    def to_json(self) -> Any:
        return self.json


def answer(json: Any) -> Answer | None:
    """``json`` as a typed answer; None stays None (no rotation yet, nothing served)."""
    return None if json is None else Answer(json)


class Part:
    """One part of the view: its ``names`` (a part's name: the fake's) read from ``fake``."""

    def __init__(self, fake: object, **names: str) -> None:
        self._fake = fake
        self._names = names

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fake, self._names.get(name, name))


def view_of(fake: Any) -> DaemonView:
    """The parts the control API and /metrics are handed, all of them ``fake``."""
    return DaemonView(
        events=getattr(fake, "events", None),  # type: ignore[arg-type]
        daemon=Lifetime(stopping=lambda: bool(fake.stopping), status=lambda: fake.status(),
                        request_stop=lambda: fake.request_stop(), reload=lambda: fake.reload()),
        workers=Part(fake, snapshot="workers", stats="worker_stats", restart="restart_worker"),
        cluster=Part(fake, nodes="cluster_nodes", plan="plan_cluster",
                     activate="activate_cluster", deactivate="deactivate_cluster",
                     rotate="rotate_secret"),
        secrets=Part(fake, list="secrets"),
        serving=Part(fake),
        drains=Part(fake, list="drains"),
        links=Part(fake))
