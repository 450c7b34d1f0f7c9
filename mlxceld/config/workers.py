"""The daemon's own workers (``[workers.NAME]``: a role, its options, a restart policy)
and the restart policy every worker starts from (``[supervisor]``), read from the config
file. The names the daemon gives its own workers (the router, a stage, a tensor-parallel
rank) are refused here: those come from ``[serve]`` and a cluster TOML."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxceld.config.serve import ROUTER
from mlxceld.config.tables import check_keys, number, string
from mlxceld.errors import ConfigError
from mlxceld.roles import STAGE, STAGE_TP, TP, WORKER_ROLES
from mlxceld.roles.options import WorkerOptions, parse_options
from mlxceld.supervisor.states import RestartPolicy

WORKER_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
POLICY_FIELDS = {f.name: f.type for f in dataclasses.fields(RestartPolicy)}


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    options: WorkerOptions  # its role's, which say the role
    policy: RestartPolicy = field(default_factory=RestartPolicy)

    @property
    def role(self) -> str:
        return self.options.role


def restart_policy(
    table: Mapping[str, Any], base: RestartPolicy, where: str, prefix: str
) -> RestartPolicy:
    changes: dict[str, Any] = {}
    for key in POLICY_FIELDS:
        if key in table:
            value = number(table, key, where, prefix, getattr(base, key),
                           allow_zero=key == "backoff_jitter")  # 0: no jitter
            is_int = isinstance(getattr(base, key), int)
            if is_int and value != int(value):
                raise ConfigError(f"{where}: '{prefix}{key}' must be a whole number",
                                  hint=f"for example {key} = {getattr(base, key)}")
            changes[key] = int(value) if is_int else value
    try:
        return dataclasses.replace(base, **changes)
    except ValueError as exc:
        raise ConfigError(f"{where}: [{prefix.rstrip('.')}] {exc}",
                          hint="see mlxceld(8) for the allowed ranges") from exc


def worker_configs(
    table: Mapping[str, Any], policy: RestartPolicy, where: str
) -> tuple[WorkerConfig, ...]:
    workers = []
    for name, spec in table.items():
        prefix = f"workers.{name}."
        if not WORKER_NAME.match(name):
            raise ConfigError(
                f"{where}: worker name {name!r} is not allowed",
                hint="use 1-63 characters of a-z, 0-9, '.', '_' and '-', starting with a letter "
                "or digit",
            )
        if name == ROUTER:
            raise ConfigError(f"{where}: worker name {name!r} is reserved for the model server",
                              hint="configure it under [serve] instead")
        if name == STAGE:
            raise ConfigError(f"{where}: worker name {name!r} is reserved for a pipeline stage",
                              hint="stages come from a cluster TOML (--distributed-config)")
        if re.fullmatch(r"(stage-)?tp-[0-9]+", name):
            raise ConfigError(f"{where}: worker name {name!r} is reserved for a "
                              "tensor-parallel rank",
                              hint="ranks come from [serve] tp_size; name this worker "
                              "otherwise")
        if not isinstance(spec, Mapping):
            raise ConfigError(f"{where}: 'workers.{name}' must be a table",
                              hint=f"write it as [workers.{name}]")
        check_keys(spec, {"role", "options", *POLICY_FIELDS}, where, prefix)
        role = string(spec, "role", where, prefix)
        # The router comes from [serve] only (and its tensor-parallel ranks with it), a
        # stage from a cluster TOML only.
        roles = sorted(set(WORKER_ROLES) - {ROUTER, STAGE, TP, STAGE_TP})
        if role is None or role not in roles:
            raise ConfigError(
                f"{where}: '{prefix}role' must be one of {', '.join(roles)}, not {role!r}",
                hint=f'set role = "..." under [workers.{name}]',
            )
        options = spec.get("options", {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"{where}: '{prefix}options' must be a table",
                              hint="write it as options = { key = value }")
        try:
            parsed = parse_options(role, dict(options), f"{prefix}options")
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc.message}", hint=exc.hint) from None
        workers.append(WorkerConfig(name, parsed, restart_policy(spec, policy, where, prefix)))
    return tuple(workers)
