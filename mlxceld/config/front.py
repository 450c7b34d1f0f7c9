"""A router in front of a pipeline: ``--pipeline-coordinator`` ([serve] key).

``[serve]`` in the config file (the flag wins)::

    [serve]
    node_role = "router"
    pipeline_coordinator = "studio-1.local:19000"   # the coordinator's agent address

A daemon with the cluster secret, ``--node-role router`` and ``pipeline_coordinator``
is a second front of the pipeline that coordinator serves: it asks the coordinator's
agent for the plan its router serves (``cluster/front.py``: the stages' addresses, the
plan's epoch and model identity), loads only the tokenizer of ``[serve] model`` (the same
files as the coordinator's), dials the stages as a router of its own (its agent address
is its identity, ``pipeline/protocol.py``'s authorization) and serves the OpenAI port.
It follows the plan as it changes (a heal, a drain's re-plan, an activate), and keeps
serving the plan it last learnt while the coordinator cannot be reached
(``daemon/following.py``).

The address: ``host:port``, a host alone meaning the default agent port 19000, an IPv6
address in brackets, as ``--replicas``. Rules (exit 2 at start): it needs ``--node-role
router``, and excludes ``replicas``, ``prefill_peers`` and ``decode_peers`` (one router
serves one kind of backend).

``--standby`` / ``[serve] standby = true`` makes such a router a standby coordinator
(``daemon/standby.py``): it takes over the plan's healing and drains once the coordinator
stays unreachable while the plan's stage hosts answer. Only with ``pipeline_coordinator``
(refused by name elsewhere, exit 2).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlxceld.config.peers import agent_peers
from mlxceld.errors import ConfigError
from mlxceld.types import ROUTER_ROLE, NodeRole

# Between two asks of the coordinator's plan by such a router (daemon/following.py); here,
# below the daemon's modules that time things by it (following.py, standby.py, roster.py).
FOLLOW_S: Final = 1.0
HINT: Final = ("name the coordinator's agent address: host:port, or a host alone for port "
               "19000, e.g. studio-1.local or 192.168.1.11:19000")


def parse_pipeline_coordinator(flag: str | None, table: Mapping[str, Any],
                               where: str) -> tuple[str | None, str]:
    """The coordinator's normalized agent address (None: not a pipeline's router) and
    where it was said."""
    if flag is not None:
        value: object = flag
        what = "--pipeline-coordinator"
    else:
        value = table.get("pipeline_coordinator")
        what = f"{where}: 'serve.pipeline_coordinator'"
        if value is None:
            return None, what
    if not isinstance(value, str) or not value.strip() or "," in value:
        raise ConfigError(f"{what} must name one agent address, not {value!r}", hint=HINT)
    (address,) = agent_peers(value, what, hint=HINT)
    return address, what


def check_front(coordinator: str | None, what: str, role: NodeRole,
                backends: tuple[str, ...]) -> None:
    """The rules of the module docstring; ``backends``: the replicas and pools listed."""
    if coordinator is None:
        return
    if role != ROUTER_ROLE:
        raise ConfigError(f"{what} is for --node-role router ([serve] node_role = "
                          f"\"router\") only; this node's role is {role}",
                          hint="add --node-role router: this daemon then loads the "
                          "tokenizer only and drives the coordinator's stages")
    if backends:
        raise ConfigError(f"{what} excludes --replicas, --prefill-peers and "
                          "--decode-peers: a router serves one pipeline, or replicas",
                          hint="run one router per kind of backend")


def parse_standby(flag: bool, table: Mapping[str, Any], where: str,
                  coordinator: str | None) -> bool:
    """``--standby`` / ``[serve] standby``: only on a router in front of a pipeline."""
    value = table.get("standby", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: 'serve.standby' must be true or false",
                          hint="write it as standby = true")
    standby = flag or value
    if standby and coordinator is None:
        what = "--standby" if flag else f"{where}: 'serve.standby'"
        raise ConfigError(f"{what} is for a router in front of a pipeline only "
                          "(--node-role router --pipeline-coordinator HOST:PORT)",
                          hint="name the coordinator it stands by for with "
                          "--pipeline-coordinator, or drop --standby")
    return standby
