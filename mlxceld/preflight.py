"""`mlxceld --check-config`: what a start would refuse, found without starting anything.

It asks the start-up's own checks, in the start-up's order, and only those that change
nothing: the config file and the flags (``load_config``, every key and value, the model
directory, ports and addresses, the socket group), a serving cluster file's node
(``serving_config``), the control socket's path length, an existing state dir (ours, a
directory), the log file's directory, a pipeline's cluster TOML (``place``), the cluster
secret's source (read, its length and mode: a group- or world-readable file is warned of),
the API key file, the model (fetched if a repo id, split over ``tp_size``, splittable
into --pp-auto stages) and whether the role needs a cluster secret that nothing gives.

No socket is bound, no lock taken, the state dir is neither created nor written, no
worker starts. What it cannot know without opening the state database: whether the
keyring holds a secret; a ``<state-dir>/keys`` directory with a key file in it counts as
one (what a start would adopt).
"""

from __future__ import annotations

import os
from pathlib import Path

from mlxceld.cluster.clusterfile.placement import (
    place,
    served_node,
    serving_cluster,
    serving_config,
)
from mlxceld.cluster.keyring import configured_secret, require_secret
from mlxceld.config.daemon import Config, Overrides, load_config
from mlxceld.config.serve import read_api_key
from mlxceld.config.tensor import across_hosts
from mlxceld.control.server import check_socket_path
from mlxceld.daemon.serving import check_planned, split_check
from mlxceld.errors import ConfigError, DaemonError
from mlxceld.models.fetch import local_model, names_a_repo
from mlxceld.state.lock import check_state_dir
from mlxceld.types import HANDOFF_SIDES, ROUTER_ROLE


def check_config(flags: Overrides) -> Config:
    """The config a start with ``flags`` would run, checked; the first error raised
    (``ConfigError``, or ``DaemonError`` for a state dir or socket path)."""
    config = serving_config(load_config(flags), flags)
    check_socket_path(config.socket)
    if config.state_dir.exists():
        try:
            check_state_dir(config.state_dir)
        except OSError as exc:
            raise DaemonError(f"state dir {config.state_dir} cannot be used: {exc.strerror}",
                              hint="check the path and its permissions, or pick another "
                              "--state-dir") from exc
    if config.log_file is not None:
        _check_log_file(config.log_file)
    served = serving_cluster(config)
    placement = (place(config.distributed_config, config.node_id or "", config.serve.model)
                 if config.distributed_config and served is None else None)
    keys_dir = config.state_dir / "keys"
    resolved = configured_secret(config, placement, served.secret_source() if served else None,
                                 None, keys_dir)
    if config.serve.api_key_file:
        read_api_key(config.serve.api_key_file)
    serve = (config.serve.with_model(str(placement.model), config.serve.model_name)
             if placement is not None else config.serve)
    if serve.model is not None and names_a_repo(serve.model):
        local_model(serve.model)
    split_check(serve)
    check_planned(config, serve.model)
    role = config.serve.node_role
    require_secret(resolved is not None or _keyring_holds(keys_dir), keys_dir,
                   pp_auto=config.pp_auto is not None, placement=placement,
                   router=role == ROUTER_ROLE,
                   handoff_side=role if role in HANDOFF_SIDES else None,
                   tensor=across_hosts(role, config.serve.tp_peers),
                   served=served_node(served, config.node_id or "")
                   if served is not None else None)
    return config


def _check_log_file(path: Path) -> None:
    """The log file can be opened for appending: the file writable, or its directory
    (where it is not there yet). The start opens it; this only looks."""
    target = path if path.exists() else path.parent
    if not os.access(target, os.W_OK) or (target == path.parent and not target.is_dir()):
        raise ConfigError(f"log file {path} cannot be opened: "
                          f"{target} {'is not writable' if target.exists() else 'does not exist'}",
                          hint="create its directory (writable by this user), or change "
                          "--log-file / [daemon] log_file")


def _keyring_holds(keys_dir: Path) -> bool:
    try:
        return any(p.is_file() for p in keys_dir.iterdir())
    except OSError:
        return False
