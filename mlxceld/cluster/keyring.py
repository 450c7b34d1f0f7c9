"""The cluster secret on this node: adopted at start, required where a pipeline runs,
changed by `mlxctl secret install|use|remove` (PROTOCOL.md section 1).

``KeyStore`` (``state/keys.py``) keeps the secrets (0600 files) and their ids (the
``keys`` table); ``resolve_secret`` (``config/secrets.py``) says where a configured
secret comes from. ``KeyringService`` is what the daemon does with both: each change is
logged as an event (subject ``keyring``), and ``on_install`` is called after every
install: the daemon starts its agent listener on the first secret.

A secret from --cluster-secret-file, MLXCEL_CLUSTER_SECRET_FILE, MLXCEL_CLUSTER_SECRET
or a TOML is installed as the primary and so persisted: a restart without the flag or
variable keeps it. Unless a rotation retired it: a configured secret whose key id was
removed from this keyring (``KeyStore.retired_at``) while the keyring has a primary is
stale, and the keyring wins, with a warning and the event ``secret.stale_file`` naming
the source and telling the operator to update it (a node restarted with its old
``--cluster-secret-file`` after `mlxctl secret rotate` stays on the cluster's key).
MLXCEL_CLUSTER_SECRET is dropped from ``os.environ`` once read, so
that nothing we start inherits it; but no process can erase its initial environment,
which the kernel keeps (``/proc/PID/environ`` on Linux, ``ps -E`` on macOS) readable to
root and to the daemon's user while it runs: the daemon warns at start where it was set,
and the file (``--cluster-secret-file``, ``[daemon] cluster_secret_file``,
``MLXCEL_CLUSTER_SECRET_FILE``) is the way to give a secret.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.config.daemon import Config
from mlxceld.config.secrets import ENV_VALUE, ResolvedSecret, TomlSecretFile, resolve_secret
from mlxceld.config.secrets import FLAG as SECRET_FLAG
from mlxceld.errors import ConfigError
from mlxceld.state import EventLog, KeyInfo, KeyStore, parse_key_id
from mlxceld.wire.secret import Keyring, SecretError, key_id

log = logging.getLogger(__name__)


class KeyringService:
    """This node's keyring operations over its ``KeyStore``, each with its event."""

    def __init__(self, store: KeyStore, events: EventLog, *,
                 on_install: Callable[[], None] = lambda: None) -> None:
        self._store = store
        self._events = events
        self._on_install = on_install

    @property
    def keyring(self) -> Keyring:
        """The secrets in memory: what the agent listener, discovery and workers use."""
        return self._store.keyring

    @property
    def dir(self) -> Path:
        return self._store.dir

    # -- at start ---------------------------------------------------------------------------

    def adopt(self, config: Config, placement: Placement | None,
              toml: TomlSecretFile | None = None) -> None:
        """Resolve the cluster secret; one from a flag, variable or file becomes the primary
        (``toml``: a serving cluster file's ``secret_file``, which has no placement)."""
        resolved = configured_secret(config, placement, toml, self.keyring, self.dir)
        if os.environ.pop(ENV_VALUE, None) is not None:
            log.warning("%s is set: its value stays readable to root and to this user in "
                        "this daemon's initial environment (/proc/%d/environ on Linux) for as "
                        "long as it runs; give the secret as a 0600 file instead "
                        "(--cluster-secret-file, [daemon] cluster_secret_file or "
                        "MLXCEL_CLUSTER_SECRET_FILE)", ENV_VALUE, os.getpid())
        if resolved is None:
            log.info("no cluster secret yet (see mlxctl secret --help); single-node use only")
            return
        if resolved.from_keyring:
            log.info("cluster secret: %s", resolved.source)
            return
        if self._stale(resolved.secret, resolved.source):
            return
        info = self._store.install(resolved.secret, source=resolved.source, primary=True)
        self._events.append("secret.adopted", "keyring",
                            f"cluster secret {info.key_id} from {resolved.source} is the "
                            "primary", key_id=info.key_id)
        log.info("cluster secret %s from %s is the primary (kept in %s)", info.key_id,
                 resolved.source, self.dir)

    def _stale(self, secret: bytes, source: str) -> bool:
        """A configured secret whose key id was removed from this keyring (a rotation
        retired it) while the keyring holds a primary: the keyring wins, and the operator
        is told (a warning and the event ``secret.stale_file``) to update the file."""
        try:
            kid = key_id(secret)
        except SecretError:
            return False  # too short: install's own error says so
        primary = self.keyring.primary_id
        when = self._store.retired_at(kid)
        if when is None or primary is None or kid in self.keyring:
            return False
        what = (f"cluster secret {kid.hex()} from {source} was retired from this keyring "
                f"at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(when))} (a secret "
                f"rotation); the keyring's primary {primary.hex()} stays in use: update the "
                "file to the current secret (or drop the setting: the keyring is kept "
                "across restarts)")
        log.warning("%s", what)
        self._events.append("secret.stale_file", "keyring", what, key_id=kid.hex(),
                            primary=primary.hex())
        return True

    def require(self, *, pp_auto: bool, placement: Placement | None,
                router: bool = False, handoff_side: str | None = None,
                served: str | None = None, tensor: str | None = None) -> None:
        """Fail closed: --pp-auto, --node-role router, prefill or decode
        (``handoff_side``), a node of a serving cluster's TOML (``served``: "FILE: node
        'ID' (ROLE)"), or a cluster config of two or more stages (or hosts), never runs
        without the cluster secret."""
        require_secret(bool(len(self.keyring)), self.dir, pp_auto=pp_auto,
                       placement=placement, router=router, handoff_side=handoff_side,
                       served=served, tensor=tensor)

    # -- mlxctl secret ----------------------------------------------------------------------

    def list(self) -> list[KeyInfo]:
        return self._store.list()

    def install(self, secret: bytes, primary: bool, source: str) -> KeyInfo:
        info = self._store.install(secret, source=source, primary=primary)
        self._events.append("secret.installed", "keyring",
                            f"cluster secret {info.key_id} installed ({info.state})",
                            key_id=info.key_id)
        self._on_install()
        return info

    def use(self, kid: str) -> KeyInfo:
        info = self._store.set_primary(parse_key_id(kid))
        self._events.append("secret.primary", "keyring",
                            f"cluster secret {info.key_id} is now the primary",
                            key_id=info.key_id)
        return info

    def remove(self, kid: str) -> KeyInfo:
        info = self._store.remove(parse_key_id(kid))
        self._events.append("secret.removed", "keyring",
                            f"cluster secret {info.key_id} removed", key_id=info.key_id)
        return info


def configured_secret(config: Config, placement: Placement | None,
                      toml: TomlSecretFile | None, keyring: Keyring | None,
                      keys_dir: Path) -> ResolvedSecret | None:
    """The secret the flags, variables and files name (``resolve_secret``; a placement's
    cluster TOML is the ``[cluster] secret_file`` source), else ``keyring``'s primary."""
    if placement is not None:
        toml = placement.cluster.secret_source()
    from_flag = config.cluster_secret_origin == SECRET_FLAG
    return resolve_secret(flag_file=config.cluster_secret_file if from_flag else None,
                          config_file=None if from_flag else config.cluster_secret_file,
                          toml=toml, keyring=keyring, keyring_where=str(keys_dir))


def require_secret(has_secret: bool, keys_dir: Path, *, pp_auto: bool,
                   placement: Placement | None, router: bool = False,
                   handoff_side: str | None = None, served: str | None = None,
                   tensor: str | None = None) -> None:
    """``KeyringService.require``'s rule, for a node whose keyring (in ``keys_dir``) holds a
    secret or not (``has_secret``); `mlxceld --check-config` asks it too. ``tensor``: the
    setting that makes this daemon part of a tensor-parallel group across hosts."""
    if has_secret:
        return

    def where(first: str | None = None, last: str | None = None) -> str:
        """Every place a secret is looked for, in order (``first``, ``last``: the
        places of a cluster TOML, where one names the secret)."""
        places = ["--cluster-secret-file", "MLXCEL_CLUSTER_SECRET_FILE",
                  "MLXCEL_CLUSTER_SECRET", "[daemon] cluster_secret_file"]
        places = [p for p in (first, *places, last) if p is not None]
        return f"none was found in {', '.join(places)} or the keyring in {keys_dir}"

    everyone = ("mlxctl secret generate FILE, copy FILE (chmod 600) to each host, then "
                "pass --cluster-secret-file FILE")
    ring = "the ring's ports and ranks travel over the authenticated agent connection"
    if served is not None:  # a hybrid placed by it too, a tensor-parallel group's rank
        why = ring if tensor is not None else ("its routers reach it only over the "
                                               "authenticated wire")
        raise ConfigError(
            f"{served} needs the cluster secret: {why}; "
            + where(first="the file's secret_file"),
            hint="set secret_file under [cluster] (mlxctl secret generate FILE, chmod "
            "600, the same on every host) or pass --cluster-secret-file FILE")
    if tensor is not None:
        raise ConfigError(
            f"{tensor} needs the cluster secret: {ring}; {where()}",
            hint=f"give rank 0's host and every rank host the same secret: {everyone}")
    if handoff_side is not None:
        raise ConfigError(
            f"--node-role {handoff_side} needs the cluster secret to serve a router and "
            f"hand KV caches over; {where()}",
            hint=f"give the router and every prefill and decode node the same secret: "
            f"{everyone}")
    if router:
        raise ConfigError(
            f"--node-role router needs the cluster secret to reach its replicas; {where()}",
            hint=f"give the router and every replica the same secret: {everyone}")
    if pp_auto:
        raise ConfigError(
            f"--pp-auto needs the cluster secret to reach its peers; {where()}",
            hint="give every node the same secret file with --cluster-secret-file")
    p = placement
    if p is None or not p.needs_secret:
        return
    raise ConfigError(
        f"cluster config {p.cluster.path} has {len(p.cluster.stages)} stages and needs the "
        f"cluster secret; {where(last='[cluster] secret_file')}",
        hint=f"give every node the same secret: {everyone}")
