"""The daemon's configuration: one typed ``Config``, built at the edge from the
config file and the flags that override it, then passed down.

File format (TOML, every table and key optional)::

    [daemon]
    state_dir = "/var/lib/mlxceld"     # relative paths resolve against the file's dir
    socket = "/run/mlxceld/mlxceld.sock"
    socket_group = "mlxceld"           # members may use the socket: 0660, its dir 0750
    log_level = "info"                 # debug | info | warning | error
    log_file = "/var/log/mlxceld.log"  # default: stderr
    log_max_bytes = 10485760           # the log file is rotated (copied to .1, truncated)
    log_backups = 3                    # at this size, this many kept; 0 bytes: never
    log_format = "text"                # text | json: one object a line, the daemon's
                                       # and its workers' (mlxceld/logformat.py)
    agent_addr = "0.0.0.0:19000"       # MXCL agent listener (with a cluster secret)
    distributed_config = "cluster.toml"  # a cluster TOML, mlxcel-cluster.toml(5) ...
    node_id = "stage-0"                # ... and which node of it this daemon is
    cluster_name = "mlxcel-cluster"    # 1-128 characters, no control characters
    cluster_peers = ["192.168.1.11:19000", "[fd00::12]:19000"]  # peer agent addresses
    cluster_discovery = "static"       # static | mdns (see mlxceld/config/cluster.py)
    cluster_secret_file = "secret"     # the cluster secret (below the variables, see
                                       # mlxceld/config/secrets.py)
    pp_peer = false                    # take a stage from a coordinator
    pp_auto = 2                        # coordinate: plan and push N stages at start
    mesh = "pp"                        # pp_auto's N hosts as: pp | tp | 2d | auto
                                       # (mlxceld/cluster/plan/mesh.py)
    cluster_config_out = "pushed.toml" # where a pushed plan is written as a cluster TOML
    stage_ports = "19100-19199"        # stage listener ports: one port or a range
                                       # (mlxceld/config/stage_ports.py); default ephemeral
    peer_ping_interval_s = 1.0         # the failure detector: ping each peer this often,
    peer_suspect_after_s = 3.0         # suspect it after this long without an answer,
    peer_dead_after_s = 10.0           # dead after this long (mlxceld/config/liveness.py)
    heal_after_s = 60.0                # a plan's peer dead this long: plan again around
                                       # it; 0: off (mlxceld/config/healing.py)
    metrics_listen = "0.0.0.0:9464"    # serve the daemon's and its workers' /metrics
                                       # here; off unless set (mlxceld/config/metrics.py)
    compute_units = 0                  # this host's speed for plans; 0: measured at
                                       # start (mlxceld/config/compute.py)
    cluster_interface = "bridge0"      # the link peers reach this host on: its address
                                       # is announced (mlxceld/config/interface.py)

    [supervisor]                       # defaults for every worker
    backoff_initial_s = 1.0            # any RestartPolicy field
    health_interval_s = 5.0
    log_max_bytes = 10485760
    log_backups = 3

    [workers.NAME]                     # one table per supervised worker (workers.py)
    role = "echo"
    options = { interval_s = 1.0 }     # the role's (mlxceld/roles/options.py), checked here
    stop_timeout_s = 20.0              # any RestartPolicy field overrides [supervisor]

    [serve]                            # the model server (the router worker):
    model = "~/models/tiny"            # see mlxceld/config/serve.py for every key

Every flag of ``mlxceld`` has a key here (``FLAG_KEYS``) except those of
``FLAG_ONLY``: ``--config`` (it names this file), ``--dry-run``, ``--reset-state`` and
``--check-config`` (one-shot commands, not service settings: ``dry_run``,
``reset_state`` or ``check_config`` in the file is refused, naming the flag) and
``--version``.
``tests/config/test_flag_keys.py`` holds the two lists to the CLI.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxceld.config.cluster import KEYS, cluster_settings
from mlxceld.config.compute import KEY as UNITS_KEY
from mlxceld.config.compute import compute_units
from mlxceld.config.healing import KEY as HEAL_KEY
from mlxceld.config.healing import heal_after
from mlxceld.config.interface import KEY as INTERFACE_KEY
from mlxceld.config.interface import cluster_interface
from mlxceld.config.kvquant import check_kv_model, check_kv_setting, kv_origin
from mlxceld.config.liveness import KEYS as LIVENESS_KEYS
from mlxceld.config.liveness import LivenessConfig, liveness_settings
from mlxceld.config.mesh import KEY as MESH_KEY
from mlxceld.config.mesh import mesh_setting
from mlxceld.config.metrics import LISTEN_KEY as METRICS_KEY
from mlxceld.config.metrics import metrics_listen
from mlxceld.config.replicas import check_discoverable, check_no_pipeline
from mlxceld.config.secrets import FLAG as SECRET_FLAG
from mlxceld.config.serve import ServeConfig, parse_serve
from mlxceld.config.speculative import check_draft_setting, draft_origin
from mlxceld.config.stage_ports import StagePorts, parse_stage_ports
from mlxceld.config.tables import check_keys, number, path_of, read_toml, string, table_of
from mlxceld.config.tensor import (
    PEERS_FLAG,
    check_tp_model,
    check_tp_peers,
    check_tp_setting,
    tp_origin,
)
from mlxceld.config.tensor_modes import check_tp_modes, check_tp_modes_model, mode_names
from mlxceld.config.workers import POLICY_FIELDS, WorkerConfig, restart_policy, worker_configs
from mlxceld.control.access import OperatorGroup
from mlxceld.errors import ConfigError
from mlxceld.logformat import LOG_FORMATS, LogFormat
from mlxceld.models.tensor_modes import Part
from mlxceld.paths import default_config_file, default_socket, default_state_dir
from mlxceld.supervisor.states import RestartPolicy
from mlxceld.types import DEFAULT_MESH, MAX_PIPELINE_STAGES, MeshMode
from mlxceld.wire.address import HostPort, parse_address
from mlxceld.wire.names import DEFAULT_CLUSTER_NAME

DEFAULT_AGENT_ADDR = "0.0.0.0:19000"
LOG_LEVELS = ("debug", "info", "warning", "error")
# Each flag of `mlxceld` and its key in the config file ...
FLAG_KEYS: dict[str, str] = {
    "--state-dir": "daemon.state_dir", "--socket": "daemon.socket",
    "--socket-group": "daemon.socket_group",
    "--log-level": "daemon.log_level", "--log-file": "daemon.log_file",
    "--log-format": "daemon.log_format",
    "--model": "serve.model", "--model-name": "serve.model_name", "--host": "serve.host",
    "--port": "serve.port", "--api-key-file": "serve.api_key_file",
    "--max-tokens": "serve.max_tokens", "--context-length": "serve.context_length",
    "--serving-port": "serve.serving_port",
    "--allowed-origins": "serve.allowed_origins", "--generation-config": "serve.generation_config",
    "--cluster-secret-file": "daemon.cluster_secret_file",
    "--agent-addr": "daemon.agent_addr", "--distributed-config": "daemon.distributed_config",
    "--node-id": "daemon.node_id", "--cluster-name": "daemon.cluster_name",
    "--cluster-peers": "daemon.cluster_peers", "--cluster-discovery": "daemon.cluster_discovery",
    "--pp-auto": "daemon.pp_auto", "--pp-peer": "daemon.pp_peer", "--mesh": "daemon.mesh",
    "--cluster-config-out": "daemon.cluster_config_out", "--stage-ports": "daemon.stage_ports",
    "--node-role": "serve.node_role", "--replicas": "serve.replicas",
    "--pipeline-coordinator": "serve.pipeline_coordinator", "--standby": "serve.standby",
    "--prefill-peers": "serve.prefill_peers", "--decode-peers": "serve.decode_peers",
    "--kv-compression": "serve.kv_compression", "--tp-size": "serve.tp_size",
    "--tp-moe-mode": "serve.tp_moe_mode", "--tp-embedding-mode": "serve.tp_embedding_mode",
    "--tp-lm-head-mode": "serve.tp_lm_head_mode",
    "--tp-peers": "serve.tp_peers",
    "--kv-bits": "serve.kv_bits", "--kv-group-size": "serve.kv_group_size",
    "--quantized-kv-start": "serve.quantized_kv_start",
    "--draft-model": "serve.draft_model", "--num-draft-tokens": "serve.num_draft_tokens",
}
# ... and the flags that have none, with the reason.
FLAG_ONLY: dict[str, str] = {
    "--config": "it names the config file itself",
    "--dry-run": "it is a one-shot command (plan, print, exit), not a service setting",
    "--reset-state": "it is a one-shot repair (a damaged state database moved aside), not a "
    "service setting",
    "--version": "it prints the version and exits",
    "--check-config": "it is a one-shot command (check, print, exit), not a service setting",
}


@dataclass(frozen=True)
class Config:
    state_dir: Path
    socket: Path
    config_file: Path | None = None
    socket_group: OperatorGroup | None = None  # whose members may use the socket too
    log_level: str = "info"
    log_file: Path | None = None
    log_format: LogFormat = "text"  # the daemon's and its workers' lines (logformat.py)
    log_file_max_bytes: int = 10 * 1024 * 1024  # [daemon] log_max_bytes; 0: never rotated
    log_file_backups: int = 3  # [daemon] log_backups
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    health_interval_s: float = 5.0
    log_max_bytes: int = 10 * 1024 * 1024
    log_backups: int = 3
    workers: tuple[WorkerConfig, ...] = ()
    serve: ServeConfig = field(default_factory=ServeConfig)
    agent_addr: str = DEFAULT_AGENT_ADDR  # MXCL agent listener, when there is a secret
    distributed_config: Path | None = None  # a cluster TOML (mlxcel-cluster.toml(5))
    node_id: str | None = None  # which of its nodes this daemon is
    pp_auto: int | None = None  # plan (and with --dry-run only plan) N pipeline stages
    mesh: MeshMode = DEFAULT_MESH  # pp_auto's N hosts as stages and tensor groups (mesh.py)
    dry_run: bool = False
    reset_state: bool = False  # move a damaged state database aside (state/db.py)
    cluster_config_out: Path | None = None  # where a plan is written as a cluster TOML
    pp_peer: bool = False  # take stage assignments from a --pp-auto coordinator
    cluster_secret_file: Path | None = None  # the flag's, else the [daemon] key's
    cluster_secret_origin: str | None = None  # which: SECRET_FLAG, or "FILE: 'daemon.KEY'"
    stage_ports: StagePorts | None = None  # stage listener ports; None: ephemeral
    cluster_name: str = DEFAULT_CLUSTER_NAME
    cluster_peers: tuple[str, ...] = ()  # normalized peer agent addresses
    cluster_discovery: str = "static"  # static | mdns
    liveness: LivenessConfig = field(default_factory=LivenessConfig)  # failure detector
    heal_after_s: float = 60.0  # a plan's peer dead this long is healed around; 0: off
    metrics_listen: HostPort | None = None  # where /metrics is served (observe/); None: off
    compute_units: float | None = None  # declared (config/compute.py); None: measured
    cluster_interface: str | None = None  # the link to announce (config/interface.py)


@dataclass(frozen=True)
class Overrides:
    """What the command line says; ``None`` means 'not given, use the file'."""

    config_file: Path | None = None
    state_dir: Path | None = None
    socket: Path | None = None
    socket_group: str | None = None
    log_level: str | None = None
    log_file: Path | None = None
    log_format: str | None = None
    model: str | None = None
    model_name: str | None = None
    host: str | None = None
    port: int | None = None
    api_key_file: Path | None = None
    max_tokens: int | None = None
    context_length: int | None = None
    serving_port: int | None = None
    cluster_secret_file: Path | None = None  # read at start only (mlxceld.cluster)
    agent_addr: str | None = None
    distributed_config: Path | None = None
    node_id: str | None = None
    pp_auto: int | None = None
    mesh: str | None = None  # as given (cluster/plan/mesh.py)
    dry_run: bool = False
    reset_state: bool = False
    cluster_config_out: Path | None = None
    pp_peer: bool = False
    cluster_name: str | None = None
    cluster_peers: str | None = None  # comma-separated, as given
    cluster_discovery: str | None = None
    stage_ports: str | None = None  # as given
    node_role: str | None = None  # as given (config/replicas.py)
    replicas: str | None = None  # comma-separated, as given
    pipeline_coordinator: str | None = None  # as given (config/front.py)
    standby: bool = False  # config/front.py
    prefill_peers: str | None = None  # comma-separated, as given (config/disagg.py)
    decode_peers: str | None = None  # ditto
    kv_compression: str | None = None  # as given
    tp_size: int | None = None  # config/tensor.py
    tp_moe_mode: str | None = None  # config/tensor_modes.py, as given
    tp_embedding_mode: str | None = None
    tp_lm_head_mode: str | None = None
    tp_peers: str | None = None  # comma-separated, as given (config/tensor.py)
    kv_bits: int | None = None  # config/kvquant.py
    kv_group_size: int | None = None
    quantized_kv_start: int | None = None
    draft_model: str | None = None  # config/speculative.py, as given
    num_draft_tokens: int | None = None
    allowed_origins: str | None = None  # comma-separated, as given (config/clients.py)
    generation_config: str | None = None  # as given

    @property
    def tp_modes(self) -> dict[Part, str | None]:
        """``--tp-moe-mode`` and its two siblings, by the part each names."""
        return {"moe": self.tp_moe_mode, "embedding": self.tp_embedding_mode,
                "lm_head": self.tp_lm_head_mode}


def _cluster_choice(daemon: Mapping[str, Any], flags: Overrides, base: Path,
                    where: str) -> dict[str, Any]:
    """``--distributed-config`` and ``--node-id`` (or their [daemon] keys): both or neither."""
    path = flags.distributed_config or path_of(daemon, "distributed_config", base, where)
    node = flags.node_id or string(daemon, "node_id", where, "daemon.")
    if (path is None) != (node is None):
        given, missing = (("--distributed-config", "--node-id") if node is None
                          else ("--node-id", "--distributed-config"))
        raise ConfigError(f"{given} needs {missing} too",
                          hint="name the cluster TOML and which of its nodes this daemon is "
                          "(or set [daemon] distributed_config and node_id)")
    return {"distributed_config": path.expanduser().absolute() if path else None,
            "node_id": node}


def _pp_auto_choice(daemon: Mapping[str, Any], flags: Overrides, cluster: Mapping[str, Any],
                    base: Path, where: str) -> dict[str, Any]:
    """``--pp-auto N [--dry-run] [--cluster-config-out FILE]`` (or ``[daemon] pp_auto`` and
    ``cluster_config_out``; ``--dry-run`` is a flag only), checked against the rest."""
    n, what = flags.pp_auto, "--pp-auto"
    if n is None and "pp_auto" in daemon:
        n, what = daemon["pp_auto"], f"{where}: 'daemon.pp_auto'"
        if type(n) is not int:
            raise ConfigError(f"{what} must be a whole number of stages, not {n!r}",
                              hint="for example pp_auto = 2")
    if flags.dry_run and n is None:
        raise ConfigError("--dry-run is for --pp-auto N only",
                          hint="mlxceld --pp-auto 2 --dry-run --model DIR prints a plan")
    if n is not None:
        if not 1 <= n <= MAX_PIPELINE_STAGES:
            raise ConfigError(f"{what} {n}: the number of stages must be 1-{MAX_PIPELINE_STAGES}",
                              hint="for example --pp-auto 2 (or pp_auto = 2 under [daemon])")
        if cluster.get("distributed_config") is not None:
            raise ConfigError("pp_auto (--pp-auto) and distributed_config "
                              "(--distributed-config) exclude each other",
                              hint="--pp-auto plans the cluster itself; --distributed-config "
                              "runs a written one: drop one from the flags or the config file")
    out = flags.cluster_config_out or path_of(daemon, "cluster_config_out", base, where)
    return {"pp_auto": n, "dry_run": flags.dry_run,
            "mesh": mesh_setting(daemon, flags.mesh, n, where),
            "cluster_config_out": out.expanduser().absolute() if out else None}


def _pp_peer(daemon: Mapping[str, Any], flags: Overrides, cluster: Mapping[str, Any],
             where: str) -> bool:
    """``--pp-peer`` / ``[daemon] pp_peer``: take stage assignments (two-phase, channel 2)."""
    value = daemon.get("pp_peer", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: 'daemon.pp_peer' must be true or false",
                          hint="write it as pp_peer = true")
    peer = flags.pp_peer or value
    if peer and (cluster.get("pp_auto") is not None
                 or cluster.get("distributed_config") is not None):
        raise ConfigError("pp_peer (--pp-peer) excludes pp_auto (--pp-auto) and "
                          "distributed_config (--distributed-config)",
                          hint="a peer takes its stage from a coordinator: drop one from the "
                          "flags or the config file")
    return peer


def _secret_and_ports(daemon: Mapping[str, Any], flags: Overrides, base: Path,
                      where: str) -> dict[str, Any]:
    """``--cluster-secret-file`` / ``[daemon] cluster_secret_file`` (the flag wins over the
    secret variables, the key does not: ``secrets``) and ``--stage-ports`` /
    ``[daemon] stage_ports``."""
    secret, origin = flags.cluster_secret_file, SECRET_FLAG
    if secret is None:
        secret = path_of(daemon, "cluster_secret_file", base, where)
        origin = f"{where}: 'daemon.cluster_secret_file'"
    if flags.stage_ports is not None:
        ports = parse_stage_ports(flags.stage_ports, "--stage-ports")
    elif "stage_ports" in daemon:
        ports = parse_stage_ports(daemon["stage_ports"], f"{where}: 'daemon.stage_ports'")
    else:
        ports = None
    return {"cluster_secret_file": secret.expanduser().absolute() if secret else None,
            "cluster_secret_origin": origin if secret else None, "stage_ports": ports}


def _refuse_flag_only(daemon: Mapping[str, Any], where: str) -> None:
    for flag, why in FLAG_ONLY.items():
        key = flag.removeprefix("--").replace("-", "_")
        if key in daemon:
            raise ConfigError(f"{where}: 'daemon.{key}' cannot be set in the config file: "
                              f"{flag} is a flag only, as {why}",
                              hint=f"remove {key} from [daemon]; pass {flag} on the command "
                              "line when you mean it")


def load_config(flags: Overrides) -> Config:
    """Read the config file (the given one must exist; the default one may not) and apply flags."""
    path = flags.config_file
    data: dict[str, Any] = {}
    if path is not None:
        data = read_toml(path, required=True)
    else:
        default = default_config_file()
        if default.exists():
            path = default
            data = read_toml(default, required=False)
    return build_config(data, path, flags)


def build_config(data: Mapping[str, Any], path: Path | None, flags: Overrides) -> Config:
    where = str(path) if path else "config"
    check_keys(data, {"daemon", "supervisor", "workers", "serve"}, where, "")
    base = path.parent if path else Path.cwd()
    daemon = table_of(data, "daemon", where)
    _refuse_flag_only(daemon, where)
    check_keys(daemon, {"state_dir", "socket", "socket_group", "log_level", "log_file",
                         "log_format", "log_max_bytes", "log_backups",
                         "agent_addr", "distributed_config", "node_id", "pp_peer", "pp_auto",
                         MESH_KEY, "cluster_config_out", "cluster_secret_file", "stage_ports",
                         *KEYS, *LIVENESS_KEYS, HEAL_KEY, METRICS_KEY, UNITS_KEY,
                         INTERFACE_KEY},
                where, "daemon.")
    sup = table_of(data, "supervisor", where)
    check_keys(
        sup, {*POLICY_FIELDS, "health_interval_s", "log_max_bytes", "log_backups"}, where,
        "supervisor.",
    )

    state_dir = flags.state_dir or path_of(daemon, "state_dir", base, where) or default_state_dir()
    state_dir = state_dir.expanduser().absolute()
    socket = flags.socket or path_of(daemon, "socket", base, where) or default_socket(state_dir)
    log_level = flags.log_level or string(daemon, "log_level", where, "daemon.") or "info"
    if log_level not in LOG_LEVELS:
        raise ConfigError(
            f"{where}: log level {log_level!r} is not one of {', '.join(LOG_LEVELS)}",
            hint="set --log-level or [daemon] log_level to one of those",
        )
    log_format = flags.log_format or string(daemon, "log_format", where, "daemon.") or "text"
    if log_format not in LOG_FORMATS:
        raise ConfigError(
            f"{where}: log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}",
            hint="set --log-format or [daemon] log_format to one of those",
        )
    policy = restart_policy(sup, RestartPolicy(), where, "supervisor.")
    workers = worker_configs(table_of(data, "workers", where), policy, where)
    serve = parse_serve(table_of(data, "serve", where), flags, base, where)
    socket = socket.expanduser().absolute()
    config = Config(
        state_dir=state_dir,
        socket=socket,
        socket_group=_socket_group(daemon, flags, socket, state_dir, where),
        config_file=path,
        reset_state=flags.reset_state,
        log_level=log_level,
        log_file=flags.log_file or path_of(daemon, "log_file", base, where),
        log_format="json" if log_format == "json" else "text",
        log_file_max_bytes=int(number(daemon, "log_max_bytes", where, "daemon.",
                                      10 * 1024 * 1024, allow_zero=True)),
        log_file_backups=int(number(daemon, "log_backups", where, "daemon.", 3,
                                    allow_zero=True)),
        agent_addr=(agent_addr := _agent_addr(daemon, flags, where)),
        cluster_interface=cluster_interface(daemon, agent_addr, where),
        **(choice := _cluster_choice(daemon, flags, base, where)),
        **(auto := _pp_auto_choice(daemon, flags, choice, base, where)),
        pp_peer=_pp_peer(daemon, flags, {**choice, **auto}, where),
        **_secret_and_ports(daemon, flags, base, where),
        **cluster_settings(daemon, where, name=flags.cluster_name, peers=flags.cluster_peers,
                           discovery=flags.cluster_discovery),
        liveness=liveness_settings(daemon, where),
        heal_after_s=heal_after(daemon, where),
        metrics_listen=metrics_listen(daemon, where),
        compute_units=compute_units(daemon, where),
        policy=policy,
        health_interval_s=number(sup, "health_interval_s", where, "supervisor.", 5.0),
        log_max_bytes=int(number(sup, "log_max_bytes", where, "supervisor.", 10 * 1024 * 1024)),
        log_backups=int(number(sup, "log_backups", where, "supervisor.", 3, allow_zero=True)),
        workers=workers,
        serve=serve,
    )
    pipeline = ("pp_auto (--pp-auto)" if config.pp_auto is not None
                else "pp_peer (--pp-peer)" if config.pp_peer else None)
    check_no_pipeline(serve.node_role, pipeline or (
        "distributed_config (--distributed-config)"
        if config.distributed_config is not None else None))
    check_tp_setting(serve.tp_size, tp_origin(flags.tp_size, where),
                     node_role=serve.node_role, pipeline=pipeline, peers=serve.tp_peers)
    check_tp_peers(serve.tp_size, tp_origin(flags.tp_size, where), serve.tp_peers,
                   PEERS_FLAG if flags.tp_peers is not None else f"{where}: 'serve.tp_peers'",
                   node_role=serve.node_role, model=serve.model)
    check_tp_model(serve.model, serve.tp_size,
                   "--model" if flags.model else f"{where}: 'serve.model'")
    mode_said = mode_names(flags.tp_modes, where)
    check_tp_modes(serve.tp_modes, serve.tp_size, mode_said)
    check_tp_modes_model(serve.model, serve.tp_modes, mode_said,
                         "--model" if flags.model else f"{where}: 'serve.model'")
    kv_said = kv_origin(flags.kv_bits, where)
    check_kv_setting(serve.kv_quant, kv_said, node_role=serve.node_role)
    check_kv_model(serve.model, serve.kv_quant, kv_said)
    check_draft_setting(serve.draft_model, draft_origin(flags.draft_model, where),
                        model=serve.model, node_role=serve.node_role, pipeline=pipeline or (
                            "distributed_config (--distributed-config)"
                            if config.distributed_config is not None else None))
    check_discoverable(serve.node_role, "--node-role" if flags.node_role is not None
                       else f"{where}: 'serve.node_role'", serve.replicas,
                       pools=bool(serve.prefill_peers and serve.decode_peers),
                       cluster_peers=config.cluster_peers,
                       discovery=config.cluster_discovery,
                       front=serve.pipeline_coordinator is not None)
    return config


def _socket_group(daemon: Mapping[str, Any], flags: Overrides, socket: Path, state_dir: Path,
                  where: str) -> OperatorGroup | None:
    """``--socket-group`` / ``[daemon] socket_group``: a group that exists here, for a
    socket in a directory of its own (the state dir stays 0700)."""
    name = flags.socket_group
    source = f"--socket-group {name}"
    if name is None:
        name = string(daemon, "socket_group", where, "daemon.")
        source = f"{where}: 'daemon.socket_group' = {name!r}"
    if name is None:
        return None
    try:
        group = OperatorGroup.named(name)
    except KeyError:
        raise ConfigError(f"{source}: there is no group named {name!r} on this host",
                          hint="create it (groupadd, or systemd-sysusers with "
                          "contrib/systemd/mlxceld.sysusers), or name another") from None
    if socket.parent == state_dir:
        raise ConfigError(f"{source}: the control socket {socket} is in the state dir, "
                          "which stays private to the daemon",
                          hint="give the socket a directory of its own, e.g. --socket "
                          "/run/mlxceld/mlxceld.sock")
    return group


def _agent_addr(daemon: Mapping[str, Any], flags: Overrides, where: str) -> str:
    """``--agent-addr`` / ``[daemon] agent_addr``: ``host:port``, ``[v6]:port``, a wildcard
    (every interface) or a host name (the addresses it resolves to); port 0 lets the
    system choose (tests). Checked here, before the daemon takes its lock and socket."""
    value = flags.agent_addr or string(daemon, "agent_addr", where, "daemon.")
    if value is None:
        return DEFAULT_AGENT_ADDR
    what = "--agent-addr" if flags.agent_addr else f"{where}: 'daemon.agent_addr'"
    try:
        parse_address(value, port_zero=True)
    except ValueError as exc:
        raise ConfigError(f"{what}: {value!r} {exc}",
                          hint=f"for example {DEFAULT_AGENT_ADDR}, or [::]:19000 for IPv6"
                          ) from None
    return value
