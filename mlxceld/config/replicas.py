"""A node's role in front of replicas: ``--node-role`` and ``--replicas`` ([serve] keys).

``[serve]`` in the config file (flags win)::

    [serve]
    node_role = "router"            # hybrid (default) | router
    replicas = ["studio-2.local", "192.168.1.12:19000", "[fd00::13]"]

- ``hybrid`` (the default, today's behaviour): this daemon's router worker runs the
  model itself (or a pipeline's stages) and serves the OpenAI port.
- ``router``: a model-free router. Its router worker loads only the tokenizer and
  config of ``[serve] model`` (the same files as on every replica) and spreads requests
  over the hybrid nodes ``replicas`` names, each by its **agent address**
  (``--agent-addr`` of that node's daemon): ``host:port``, a host name or IPv4 address
  alone meaning the default agent port 19000, an IPv6 address in brackets. Names are
  resolved when dialed. The replica's serving port is asked of its agent before every
  dial (``discovery/serving.py``).

- ``prefill`` and ``decode``: prefill/decode disaggregation's nodes
  (``config/disagg.py``: their keys and rules).

Rules, checked here (exit 2 at start, naming both sides): ``router`` without
``replicas`` (and without ``prefill_peers`` and ``decode_peers``) finds its replicas by
discovery, so it needs something to discover: ``--cluster-peers`` or
``--cluster-discovery mdns`` (``check_discoverable``); ``replicas`` needs
``router``; a router (or prefill or decode node) takes no pipeline of its own
(``--pp-auto``, ``--pp-peer``, ``--distributed-config``; a cluster TOML of routers
and replicas places a router instead of these flags: ``clusterfile/placement.py``'s
``placed_config``, checked against them there). The router role needs the
cluster secret too, checked once the daemon has read every source of it
(``cluster/keyring.py``: ``KeyringService.require``).

Replicas found by discovery (a router with no ``replicas``): every peer in the daemon's
candidate table (``--cluster-peers``, or mDNS) whose last poll was answered and whose
agent says it is a hybrid node serving the router's model (``discovery/serving.py``);
``workers/replica_router.py``'s ``Discovered`` says how often each is asked.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from mlxceld.config.peers import agent_peers
from mlxceld.errors import ConfigError
from mlxceld.types import DECODE_ROLE, HYBRID, NODE_ROLES, PREFILL_ROLE, ROUTER_ROLE, NodeRole

SECRET_ROLES: Final = (ROUTER_ROLE, PREFILL_ROLE, DECODE_ROLE)  # fail closed without it
REPLICAS_HINT: Final = ("name each replica by its agent address, separated by commas: "
                        "host:port, or a host alone for port 19000, e.g. "
                        "studio-2.local,192.168.1.12:19001,[fd00::13]")
DISCOVER_HINT: Final = ("list the replicas (--replicas studio-2.local,studio-3.local), or "
                        "let the router find them: --cluster-peers naming the hybrid nodes' "
                        "agents, or --cluster-discovery mdns")


def parse_role(flag: str | None, table: Mapping[str, Any],
               where: str) -> tuple[NodeRole, str]:
    """The node role and where it was said (``--node-role`` or the file's key)."""
    if flag is not None:
        value: object = flag
        what = "--node-role"
    else:
        value = table.get("node_role", HYBRID)
        what = f"{where}: 'serve.node_role'"
    for role in NODE_ROLES:
        if value == role:
            return role, what
    raise ConfigError(f"{what}: {value!r} is not a node role; the roles are "
                      f"{', '.join(NODE_ROLES)}",
                      hint="hybrid (the default) runs the model here; router spreads "
                      "requests over --replicas (or --prefill-peers and --decode-peers); "
                      "prefill and decode serve a router's disaggregation; "
                      "tensor_parallel_rank is a rank of another host's --tp-peers group")


def parse_replica_list(flag: str | None, table: Mapping[str, Any],
                       where: str) -> tuple[tuple[str, ...], str]:
    """The replicas' normalized agent addresses and where they were said."""
    value: object
    if flag is not None:
        value, what = flag, "--replicas"
    else:
        value, what = table.get("replicas", []), f"{where}: 'serve.replicas'"
        if not isinstance(value, list):
            raise ConfigError(f"{what} must be a list of agent addresses, not {value!r}",
                              hint='for example replicas = ["studio-2.local", '
                              '"192.168.1.12:19001"]')
    assert isinstance(value, str | Sequence)
    return agent_peers(value, what, hint=REPLICAS_HINT, entry="replica "), what


def check_role(role: NodeRole, role_from: str, replicas: tuple[str, ...],
               replicas_from: str) -> None:
    """``replicas`` only on a router (the second rule of the module docstring)."""
    if replicas and role != ROUTER_ROLE:
        raise ConfigError(f"{replicas_from} is for --node-role router ([serve] node_role = "
                          f"\"router\") only; this node's role is {role}",
                          hint="add --node-role router, or drop --replicas ([serve] "
                          "replicas) to run the model here")


def discovers(role: NodeRole, replicas: tuple[str, ...], *, pools: bool,
              front: bool = False) -> bool:
    """Whether this router finds its replicas by discovery (none listed, no pools, not in
    front of a pipeline: ``front``, ``config/front.py``)."""
    return role == ROUTER_ROLE and not replicas and not pools and not front


def check_discoverable(role: NodeRole, role_from: str, replicas: tuple[str, ...], *,
                       pools: bool, cluster_peers: tuple[str, ...], discovery: str,
                       front: bool = False) -> None:
    """A router finding its replicas by discovery has something to discover (the first
    rule of the module docstring)."""
    if (discovers(role, replicas, pools=pools, front=front) and not cluster_peers
            and discovery != "mdns"):
        raise ConfigError(f"{role_from} router without --replicas ([serve] replicas) finds "
                          "its replicas by discovery, and this daemon discovers nothing "
                          "(--cluster-discovery static with no --cluster-peers)",
                          hint=DISCOVER_HINT)


def check_no_pipeline(role: NodeRole, pipeline: str | None) -> None:
    """A router takes no pipeline: ``pipeline`` names the pipeline setting in force
    (``--pp-auto`` ...), if any."""
    if role != HYBRID and pipeline is not None:
        who = "router over replicas" if role == ROUTER_ROLE else f"{role} node"
        raise ConfigError(f"node_role {role} (--node-role) excludes {pipeline}: a {who} "
                          "runs no pipeline of its own",
                          hint="drop one of them; a replica may itself be a pipeline's "
                          "coordinator")
