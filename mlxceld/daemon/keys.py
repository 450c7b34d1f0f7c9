"""The daemon's keyring window: `mlxctl secret list|install|use|remove` (and a rotation's
key ops from other members, ``cluster/rotation.py``'s ``KeyOps``), each change pushed to
the workers at once.

A change of the keyring ends this process's streams under a removed key (their owners
re-dial under the primary), tells the cluster member (``keyring_changed``), and every
worker holding the cluster secret takes the new keyring without a restart
(``supervisor/keys.py``); what each worker failed is in the answer, by name, and logged
as the event ``secret.worker_failed``.

It lives in the daemon room beside ``root.py`` (the composition root, its only user),
which hands it the parts it uses, never the daemon.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from mlxceld.cluster.keyring import KeyringService
from mlxceld.control.answers import KeyChange
from mlxceld.net import retire_streams
from mlxceld.state import EventLog, KeyInfo
from mlxceld.supervisor.service import Supervisor

log = logging.getLogger(__name__)


class KeyWindow:
    def __init__(self, keys: KeyringService, supervisor: Supervisor, events: EventLog,
                 keyring_changed: Callable[[], None]) -> None:
        self._keys = keys
        self._supervisor = supervisor
        self._events = events
        self._keyring_changed = keyring_changed  # the cluster member's

    def list(self) -> list[KeyInfo]:
        return self._keys.list()

    async def install_secret(self, secret: bytes, primary: bool, source: str) -> KeyChange:
        key = self._keys.install(secret, primary, source)
        return KeyChange(key, await self.push_keyring())

    async def use_secret(self, kid: str) -> KeyChange:
        key = self._keys.use(kid)
        return KeyChange(key, await self.push_keyring())

    async def remove_secret(self, kid: str) -> KeyChange:
        key = self._keys.remove(kid)
        return KeyChange(key, await self.push_keyring())

    async def streams_under(self, kid: str) -> dict[str, int]:
        """Workers with open MXCL streams under key id ``kid``: how many (a rotation
        removes the old key once there are none, ``cluster/rotation.py``)."""
        return await self._supervisor.streams_under(kid)

    async def push_keyring(self) -> dict[str, str] | None:
        """The keyring changed: see the module docstring. What each worker failed, by name
        ({} when all took it); None: the keyring is empty, nothing is pushed."""
        ring = self._keys.keyring
        retire_streams(ring)
        self._keyring_changed()
        if not len(ring):
            return None
        failed = await self._supervisor.push_keyring(ring.primary, ring.others())
        for name, why in failed.items():
            log.warning("%s", why)
            self._events.append("secret.worker_failed", name, why)
        return failed
