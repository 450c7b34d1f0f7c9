"""A pipeline of real daemons on 127.0.0.1 (coordinator), .2, .3, ... (stages), each with its
own state dir, each started as a service would start it (helpers/deploy.py): `--config FILE`
only, naming the cluster TOML and its node there, its agent on the default wildcard host."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from mlxceld.cluster.clusterfile.load import dump_cluster
from mlxceld.cluster.clusterfile.model import StageEntry, pipeline_cluster

from helpers.daemons import READY_S, DaemonProc, Daemons
from helpers.deploy import Host, Value
from helpers.ports import free_port

SECRET = "0123456789abcdef0123456789abcdef"


@dataclass
class Pipeline:
    coordinator: DaemonProc
    stages: list[DaemonProc]
    url: str
    toml: Path
    hosts: list[Host]  # the stages' (restart: SIGTERM, then start again)


def write_cluster(root: Path, model: Path, splits: list[tuple[int, int]],
                  secret: bool = True, draft: tuple[Path, int] | None = None) -> Path:
    """``draft``: ``[cluster] draft_model`` and ``num_draft_tokens``."""
    hosts = [f"127.0.0.{2 + rank}" for rank in range(len(splits))]
    stages = [StageEntry(f"stage-{rank}", f"{host}:{free_port(host)}", layers)
              for rank, (host, layers) in enumerate(zip(hosts, splits, strict=True))]
    if secret:
        (root / "secret").write_text(SECRET + "\n")
        os.chmod(root / "secret", 0o600)
    toml = root / "cluster.toml"
    cfg = pipeline_cluster(
        "test-cluster", model, ("coordinator", f"127.0.0.1:{free_port('127.0.0.1')}"), stages,
        secret_file="secret" if secret else None, path=toml)
    if draft is not None:
        cfg = dataclasses.replace(cfg, draft_model=str(draft[0]), num_draft_tokens=draft[1])
    toml.write_text(dump_cluster(cfg))
    return toml


def start_pipeline(daemons: Daemons, model: Path, splits: list[tuple[int, int]],
                   coordinator_serve: dict[str, Value] | None = None, *,
                   stage_models: dict[int, Path] | None = None,
                   stage_daemon: dict[int, dict[str, Value]] | None = None,
                   draft: tuple[Path, int] | None = None) -> Pipeline:
    """The cluster TOML's daemons, each from its config file (``coordinator_serve``: more
    [serve] keys for the coordinator's; ``stage_models``: by rank, the model directory that
    stage's host has instead of ``model`` (its [serve] model), whose stage worker is not
    waited for: it may fail to load; ``stage_daemon``: by rank, more [daemon] keys;
    ``draft``: the last stage's draft and k, in the TOML)."""
    port = free_port("127.0.0.1")
    coord = Host(daemons, "co", secret=None, serve={"port": port, **(coordinator_serve or {})})
    toml = write_cluster(coord.d.root, model, splits, draft=draft)
    coord.daemon_keys.update(distributed_config=str(toml), node_id="coordinator")
    coord.write()
    own = stage_models or {}
    hosts = [Host(daemons, f"s{rank}", secret=None,
                  daemon={"distributed_config": str(toml), "node_id": f"stage-{rank}",
                          **(stage_daemon or {}).get(rank, {})},
                  serve={"model": str(own[rank])} if rank in own else None).start()
             for rank in range(len(splits))]
    coord.start()
    stages = [h.d for h in hosts]
    for rank, d in enumerate(stages):
        if rank in own:
            continue
        daemons.pids.add(d.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    daemons.pids.add(coord.d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    return Pipeline(coord.d, stages, f"http://127.0.0.1:{port}/v1", toml, hosts)
