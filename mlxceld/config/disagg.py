"""Prefill/decode disaggregation's keys: ``--prefill-peers``, ``--decode-peers`` and
``--kv-compression`` ([serve] keys; flags win), beside ``config/replicas.py``'s roles.

``[serve]`` in the config file::

    [serve]
    node_role = "router"                 # or "prefill", "decode" (config/replicas.py)
    prefill_peers = ["10.0.0.21"]        # agent addresses, as replicas
    decode_peers = ["10.0.0.22", "10.0.0.23"]
    kv_compression = "int8+lz4"          # none (default), int8, int4; +lz4 optional

- ``prefill`` and ``decode`` nodes load the model and serve it on their serving
  listener only (no OpenAI port); they need the cluster secret (fail closed).
- A router takes ``replicas``, or ``prefill_peers`` with ``decode_peers`` (both or
  neither), or all three: disaggregated while a prefill node and a decode node are
  up, else (or when the pair refuses a request before its first token) on a replica
  (``replicas/disagg.py``: ``DisaggOrReplicas``).
- A decode node's ``prefill_peers`` are the prefill nodes whose handoffs it takes
  (their serving addresses are asked of their agents, as a router does); it has no
  ``decode_peers`` or ``replicas``. A prefill node has none of the three: the router
  names each request's decode node, checked against ``MLXCEL_DECODE_ALLOWLIST``.
- ``kv_compression`` is a router's: carried in each ``prefill``.

A prefill node's handoff identity is its serving listener's IP and port (the
handshake binds IPs): a router resolves a prefill or decode peer's host name to an IP
(``discovery/serving.py``: ``ServingFinder``), and a decode node takes a handoff from
any IP its prefill peer's name resolves to (``workers/handoff_node.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from mlxceld.config.peers import DEFAULT_AGENT_PORT, parse_peers
from mlxceld.errors import ConfigError
from mlxceld.types import DECODE_ROLE, ROUTER_ROLE

QUANTS: Final = ("none", "int8", "int4")  # engine/handoff.py's (a room above this one)
PEERS_HINT: Final = ("name each node by its agent address, separated by commas: host:port, "
                     "or a host alone for port 19000, e.g. 10.0.0.21,10.0.0.22:19001")
COMPRESSION_HINT: Final = "one of none, int8, int4, each optionally with +lz4: e.g. int8+lz4"


def parse_peer_list(key: str, flag: str | None, table: Mapping[str, Any],
                    where: str) -> tuple[tuple[str, ...], str]:
    """``prefill_peers`` or ``decode_peers`` (``key``): normalized agent addresses, and
    where they were said."""
    value: object
    if flag is not None:
        value, what = flag, "--" + key.replace("_", "-")
    else:
        value, what = table.get(key, []), f"{where}: 'serve.{key}'"
        if not isinstance(value, list):
            raise ConfigError(f"{what} must be a list of agent addresses, not {value!r}",
                              hint=f'for example {key} = ["10.0.0.21", "10.0.0.22:19001"]')
    assert isinstance(value, str | Sequence)
    return parse_peers(value, what, default_port=DEFAULT_AGENT_PORT, hint=PEERS_HINT), what


def parse_compression(flag: str | None, table: Mapping[str, Any], where: str) -> str:
    """``kv_compression``: "none", "int8", "int4", each optionally "+lz4"."""
    value: object = flag if flag is not None else table.get("kv_compression", "none")
    what = "--kv-compression" if flag is not None else f"{where}: 'serve.kv_compression'"
    quant, plus, rest = value.partition("+") if isinstance(value, str) else ("", "", "")
    if quant not in QUANTS or (plus and rest != "lz4"):
        raise ConfigError(f"{what}: {value!r} is not a KV compression", hint=COMPRESSION_HINT)
    return str(value)


def check_pools(role: str, role_from: str, prefill: tuple[str, ...], prefill_from: str,
                decode: tuple[str, ...], decode_from: str, replicas: tuple[str, ...]) -> None:
    """The rules of the module docstring, each refusal naming the flags at fault."""
    if role == ROUTER_ROLE:
        if bool(prefill) != bool(decode):
            given, missing = ((prefill_from, "--decode-peers") if prefill
                              else (decode_from, "--prefill-peers"))
            raise ConfigError(f"{given} needs {missing} too: a router disaggregates over "
                              "both pools or neither",
                              hint="give --prefill-peers and --decode-peers, or --replicas "
                              "alone")
        return
    if role == DECODE_ROLE:
        if decode or replicas:
            raise ConfigError(f"{role_from} decode takes no --decode-peers or --replicas: a "
                              "decode node decodes what its --prefill-peers hand it",
                              hint="drop them; list the prefill nodes in --prefill-peers")
        if not prefill:
            raise ConfigError(f"{role_from} decode needs --prefill-peers ([serve] "
                              "prefill_peers): the prefill nodes whose KV caches it takes",
                              hint=PEERS_HINT)
        return
    if prefill or decode:
        given = prefill_from if prefill else decode_from
        raise ConfigError(f"{given} is for a router or a decode node; this node's role is "
                          f"{role}",
                          hint="a prefill node sends caches where each request's router "
                          "says, within MLXCEL_DECODE_ALLOWLIST")
