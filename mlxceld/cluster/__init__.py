"""Cluster membership: where the node's cluster secret comes from, and the cluster TOML.

Importing this package never imports mlx.
"""

from mlxceld.cluster.nodes import COORDINATOR, PIPELINE_STAGE, ClusterConfig, NodeConfig
from mlxceld.cluster.secret_sources import (
    ENV_FILE,
    ENV_VALUE,
    ResolvedSecret,
    TomlSecretFile,
    read_secret_file,
    resolve_secret,
)
from mlxceld.cluster.topology import (
    dump_cluster,
    load_cluster,
    needs_secret,
    parse_cluster_text,
    select_node,
    validate_layers,
    write_cluster,
)

__all__ = ["COORDINATOR", "ENV_FILE", "ENV_VALUE", "PIPELINE_STAGE", "ClusterConfig",
           "NodeConfig", "ResolvedSecret", "TomlSecretFile", "dump_cluster", "load_cluster",
           "needs_secret", "parse_cluster_text", "read_secret_file", "resolve_secret",
           "select_node", "validate_layers", "write_cluster"]
