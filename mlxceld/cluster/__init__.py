"""Cluster membership: for now, where the node's cluster secret comes from."""

from mlxceld.cluster.secret_sources import (
    ENV_FILE,
    ENV_VALUE,
    ResolvedSecret,
    TomlSecretFile,
    read_secret_file,
    resolve_secret,
)

__all__ = ["ENV_FILE", "ENV_VALUE", "ResolvedSecret", "TomlSecretFile",
           "read_secret_file", "resolve_secret"]
