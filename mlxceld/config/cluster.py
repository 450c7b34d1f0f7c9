"""The cluster and discovery settings: ``--cluster-name``, ``--cluster-peers`` and
``--cluster-discovery`` (or the [daemon] keys ``cluster_name``, ``cluster_peers``,
``cluster_discovery``); a flag wins over its key.

- cluster name: 1-128 characters without control characters (the cluster TOML's
  rule) and at most ``MAX_NAME_BYTES`` bytes of UTF-8, so that ``cluster=NAME``
  fits one mDNS TXT string; default ``mlxcel-cluster``.
- peers: see ``peers.py``; in the config file a list of strings.
- discovery: ``static`` (only the listed peers; the default) or ``mdns`` (the
  listed peers and whatever the signed mDNS records of PROTOCOL.md section 5 find).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from mlxceld.config.peers import PEERS_HINT, parse_peers
from mlxceld.errors import ConfigError
from mlxceld.wire.names import DEFAULT_CLUSTER_NAME, MAX_NAME, name_problem

DISCOVERY_MODES: Final = ("static", "mdns")
MAX_NAME_BYTES: Final = 240  # "cluster=" + name within a TXT string's 255 bytes
KEYS: Final = ("cluster_name", "cluster_peers", "cluster_discovery")


def parse_cluster_name(value: object, what: str) -> str:
    problem = name_problem(value)
    if problem is None and isinstance(value, str):
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            size, problem = 0, "is not valid Unicode text"
        if size > MAX_NAME_BYTES:
            problem = f"is {size} bytes of UTF-8; at most {MAX_NAME_BYTES} fit a discovery record"
    if problem is not None or not isinstance(value, str):
        raise ConfigError(f"{what}: cluster name {value!r} {problem}",
                          hint=f"use 1-{MAX_NAME} printable characters, e.g. "
                          f"{DEFAULT_CLUSTER_NAME}")
    return value


def parse_discovery(value: object, what: str) -> str:
    if value not in DISCOVERY_MODES:
        raise ConfigError(f"{what}: discovery {value!r} is not one of "
                          f"{', '.join(DISCOVERY_MODES)}",
                          hint="static: only --cluster-peers; mdns: also signed mDNS records "
                          "on the local network")
    return str(value)


def cluster_settings(daemon: Mapping[str, Any], where: str, *, name: str | None,
                     peers: str | None, discovery: str | None) -> dict[str, Any]:
    """Config fields ``cluster_name``, ``cluster_peers``, ``cluster_discovery``: flags first."""
    if name is not None:
        cluster_name = parse_cluster_name(name, "--cluster-name")
    else:
        cluster_name = parse_cluster_name(daemon.get("cluster_name", DEFAULT_CLUSTER_NAME),
                                          f"{where}: 'daemon.cluster_name'")
    if peers is not None:
        cluster_peers = parse_peers(peers, "--cluster-peers")
    else:
        raw = daemon.get("cluster_peers", [])
        key = f"{where}: 'daemon.cluster_peers'"
        if not isinstance(raw, Sequence) or isinstance(raw, str):
            raise ConfigError(f"{key} must be a list of strings, not {raw!r}",
                              hint='for example cluster_peers = ["192.168.1.11:19000"]; '
                              + PEERS_HINT)
        cluster_peers = parse_peers(raw, key)
    if discovery is not None:
        mode = parse_discovery(discovery, "--cluster-discovery")
    else:
        mode = parse_discovery(daemon.get("cluster_discovery", "static"),
                               f"{where}: 'daemon.cluster_discovery'")
    return {"cluster_name": cluster_name, "cluster_peers": cluster_peers,
            "cluster_discovery": mode}
