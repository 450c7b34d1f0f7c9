"""Cluster membership: the cluster secret's sources, the cluster TOML, the pipeline planner.

Importing this package never imports mlx.
"""

from mlxceld.cluster.nodes import COORDINATOR, PIPELINE_STAGE, ClusterConfig, NodeConfig
from mlxceld.cluster.plan import Plan, PlannedStage, PlanNode, Reserve, usable_memory
from mlxceld.cluster.plan_report import plan_json, render_plan_table
from mlxceld.cluster.planner import plan_stages
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
           "NodeConfig", "Plan", "PlanNode", "PlannedStage", "Reserve", "ResolvedSecret",
           "TomlSecretFile", "dump_cluster", "load_cluster", "needs_secret",
           "parse_cluster_text", "plan_json", "plan_stages", "read_secret_file",
           "render_plan_table", "resolve_secret", "select_node", "usable_memory",
           "validate_layers", "write_cluster"]
