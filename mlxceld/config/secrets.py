"""Where this node's cluster secret comes from (PROTOCOL.md section 1).

Highest precedence first:

1. ``--cluster-secret-file PATH``
2. ``MLXCEL_CLUSTER_SECRET_FILE`` (a path)
3. ``MLXCEL_CLUSTER_SECRET`` (the value itself; setting both variables is an
   error, whatever else is given: the stricter reading)
4. ``[daemon] cluster_secret_file`` in the daemon's config file, relative to
   that file's dir (below the variables, as a config file is below the
   environment everywhere else)
5. ``[cluster] secret_file`` in the cluster TOML, relative to the TOML's dir
6. the daemon's keyring (its primary)

A file's content is trimmed (one trailing CRLF or LF) and must then hold at
least 16 bytes; an environment value is taken as is. A variable that is set
but empty counts as set (and then fails) rather than being skipped. Every
error names every source and which one was used; no message ever carries the
secret. A secret file readable by group or others draws a logged warning
naming the file.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from mlxceld.errors import SecretSourceError
from mlxceld.wire.secret import MIN_SECRET_BYTES, Keyring, trim_secret_file

log = logging.getLogger(__name__)

ENV_FILE = "MLXCEL_CLUSTER_SECRET_FILE"
ENV_VALUE = "MLXCEL_CLUSTER_SECRET"
FLAG = "--cluster-secret-file"
CONFIG_KEY = "[daemon] cluster_secret_file"


@dataclass(frozen=True)
class TomlSecretFile:
    """``secret_file`` under ``[cluster]`` as written, and the TOML it was written in."""

    value: str
    toml_path: Path

    def resolve(self) -> Path:
        p = Path(self.value).expanduser()
        return p if p.is_absolute() else self.toml_path.parent / p


@dataclass(frozen=True)
class ResolvedSecret:
    secret: bytes = field(repr=False)
    source: str  # e.g. "--cluster-secret-file /etc/mlxcel/secret", "MLXCEL_CLUSTER_SECRET"
    from_keyring: bool = False


@dataclass
class _Sources:
    """The six sources, each with what was found there, for error messages."""

    flag_file: Path | None
    env_file: str | None
    env_value: str | None
    config_file: Path | None
    toml: TomlSecretFile | None
    keyring: Keyring | None
    keyring_where: str

    def describe(self, used: str | None) -> str:
        rows = [
            (FLAG, str(self.flag_file) if self.flag_file else None),
            (ENV_FILE, self.env_file),
            (ENV_VALUE, "set" if self.env_value is not None else None),
            (CONFIG_KEY, str(self.config_file) if self.config_file else None),
            ("[cluster] secret_file", str(self.toml.resolve()) if self.toml else None),
            (f"the keyring in {self.keyring_where}",
             f"{len(self.keyring)} key(s)" if self.keyring else None),
        ]
        parts = []
        for name, found in rows:
            if found is None:
                parts.append(f"{name}: not set")
            elif name == ENV_VALUE:
                parts.append(f"{name}: set" + (" (used)" if used == name else ""))
            else:
                parts.append(f"{name}: {found}" + (" (used)" if used == name else ""))
        return "sources, highest precedence first: " + "; ".join(parts)


def resolve_secret(
    *,
    flag_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
    toml: TomlSecretFile | None = None,
    keyring: Keyring | None = None,
    keyring_where: str = "the state dir",
) -> ResolvedSecret | None:
    """The node's secret by precedence, or None if no source has one (no cluster use yet)."""
    env = os.environ if environ is None else environ
    src = _Sources(flag_file, env.get(ENV_FILE), env.get(ENV_VALUE), config_file, toml,
                   keyring, keyring_where)
    if src.env_file is not None and src.env_value is not None:
        raise SecretSourceError(
            f"both {ENV_FILE} and {ENV_VALUE} are set; {src.describe(None)}",
            hint=f"unset one of them (prefer {ENV_FILE}: a value in the environment is easier "
            "to leak)",
        )
    if flag_file is not None:
        return _from_file(flag_file, f"{FLAG} {flag_file}", FLAG, src)
    if src.env_file is not None:
        if not src.env_file:
            raise SecretSourceError(f"{ENV_FILE} is set but empty; {src.describe(ENV_FILE)}",
                                    hint="set it to the secret file's path, or unset it")
        path = Path(src.env_file).expanduser()
        return _from_file(path, f"{ENV_FILE}={path}", ENV_FILE, src)
    if src.env_value is not None:
        secret = os.fsencode(src.env_value)
        _check_length(secret, ENV_VALUE, ENV_VALUE, src)
        return ResolvedSecret(secret, ENV_VALUE)
    if config_file is not None:
        return _from_file(config_file, f"{CONFIG_KEY} {config_file}", CONFIG_KEY, src)
    if toml is not None:
        path = toml.resolve()
        return _from_file(path, f"[cluster] secret_file {path} (in {toml.toml_path})",
                          "[cluster] secret_file", src)
    if keyring:
        assert keyring.primary_id is not None
        return ResolvedSecret(keyring.primary,
                              f"keyring in {keyring_where} (key id {keyring.primary_id.hex()})",
                              from_keyring=True)
    return None


def read_secret_file(path: Path) -> bytes:
    """A secret file's secret (trimmed), warning when group or others may read it.

    OSError is left to the caller, which knows what the file was for.
    """
    with path.open("rb") as f:
        mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        content = f.read()
    if mode & 0o077:
        log.warning("cluster secret file %s is readable by group or others (mode %04o); "
                    "run: chmod 600 %s", path, mode, path)
    return trim_secret_file(content)


def _from_file(path: Path, description: str, name: str, src: _Sources) -> ResolvedSecret:
    try:
        secret = read_secret_file(path)
    except OSError as exc:
        raise SecretSourceError(
            f"cluster secret file {path} (from {name}) cannot be read: "
            f"{exc.strerror or exc}; {src.describe(name)}",
            hint="check the path and its permissions; `mlxctl secret generate FILE` makes one",
        ) from exc
    _check_length(secret, name, f"cluster secret file {path} (from {name})", src)
    return ResolvedSecret(secret, description)


def _check_length(secret: bytes, name: str, what: str, src: _Sources) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretSourceError(
            f"{what} holds {len(secret)} byte(s) after trimming one trailing newline; at least "
            f"{MIN_SECRET_BYTES} are needed; {src.describe(name)}",
            hint="use a longer secret: `mlxctl secret generate FILE` writes 32 random bytes "
            "as hex",
        )
