"""A worker's keyring at runtime: the control channel's ``keyring`` op, both sides.

A worker that speaks MXCL (router over a pipeline, stage) starts with the daemon's
keyring on its bootstrap pipe (``secret_hex``: the primary, ``accepted_hex``: the
others). When the daemon's keyring changes (`mlxctl secret install|use|remove`, a
rotation), the daemon sends the new one over the worker's control channel (a 0600
Unix socket in the 0700 state dir, as private as the bootstrap pipe), a
``ops.KeyringUpdate``::

    {"op": "keyring", "primary_hex": HEX, "accepted_hex": [HEX, ...]}

and the worker swaps it in place: new handshakes dial with the new primary and accept
every key listed; streams made under a key no longer listed are ended, so that their
owners re-dial under the primary. The answer and every ``health`` answer carry the
worker's ``keys`` (``types.WorkerKeys``: key ids only), which the supervisor compares
with what it last sent: a worker that differs (one adopted after a restart, one that
missed an update while starting) is sent its keyring again at the next health probe.
A worker whose primary changed hands its outgoing streams over to the new one
(``WorkerContext.rekeyed``). The ``streams`` op (``ops.StreamsUnder``)::

    {"op": "streams", "kid": HEX}   ->   {"ok": true, "streams": N}

counts the worker's open streams under a key id: a rotation removes the old key once
no worker has one left (``Supervisor.streams_under``), so removing it cuts nothing.

The OpenAI port's API key (``[serve] api_key_file``) goes the same way: on the bootstrap
pipe (``api_key``), then, when a reload read a new one, an ``ops.ApiKeyUpdate``::

    {"op": "api_key", "api_key": KEY}        (null: no key asked of clients)

which the worker swaps in at once (the next request is checked against it; a request
already let in runs on). A worker that asks the key of its clients (the router) reports
in every ``health`` answer ``api_key``: a random salt of its own and the HMAC-SHA256 of
its key under it (``api_key_tag``), never the key; the supervisor compares that with its
spec's key under the same salt and sends the key again where they differ (a router
adopted after the daemon's restart, one that started while a reload changed the key).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

from mlxceld.types import WorkerKeys
from mlxceld.wire.secret import key_id


def keys_of(primary: bytes, accepted: Sequence[bytes]) -> WorkerKeys:
    """What a worker holding these secrets reports (key ids, sorted)."""
    return {"primary": key_id(primary).hex(),
            "ids": sorted({key_id(s).hex() for s in (primary, *accepted)})}


def reported_keys(reply: Mapping[str, object]) -> WorkerKeys | None:
    """The ``keys`` of a health answer, if it has well-formed ones."""
    keys = reply.get("keys")
    if not isinstance(keys, dict):
        return None
    primary, ids = keys.get("primary"), keys.get("ids")
    if not isinstance(primary, str) or not isinstance(ids, list) \
            or not all(isinstance(i, str) for i in ids):
        return None
    return {"primary": primary, "ids": sorted(ids)}


def api_key_tag(key: str | None, salt: bytes) -> str:
    """What a worker holding ``key`` (None: no key) reports of it under ``salt``."""
    held = b"none" if key is None else b"key:" + key.encode()
    return hmac.new(salt, held, hashlib.sha256).hexdigest()


def reported_api_key(reply: Mapping[str, object]) -> tuple[bytes, str] | None:
    """The salt and tag of a health answer's ``api_key``; None where it has none (a
    worker that asks no key of clients) or a malformed one."""
    held = reply.get("api_key")
    if not isinstance(held, dict):
        return None
    salt, tag = held.get("salt"), held.get("tag")
    if not isinstance(salt, str) or not isinstance(tag, str):
        return None
    try:
        return bytes.fromhex(salt), tag
    except ValueError:
        return None
