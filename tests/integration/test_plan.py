"""`mlxctl cluster plan` on real daemons: the peers' inventory, the planner, the TOML it
writes, and a pipeline started from that TOML unchanged."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from mlxceld.cluster.clusterfile.load import load_cluster, validate_layers
from mlxceld.models import layer_count, read_model_config

from helpers.cluster import agent, by_address, start
from helpers.daemons import FAST_POLICY, READY_S, Daemons
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import complete
from helpers.waiting import wait_for


@pytest.mark.slow
def test_plan_then_run_the_planned_pipeline(daemons: Daemons, split_fixture_dir: Path,
                                            tmp_path: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, name=f"p{i}") for i in (2, 3)]
    addrs = [agent(p) for p in peers]
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers", ",".join(addrs), name="c")
    wait_for(lambda: all(by_address(coord).get(a, {}).get("state") == "reachable"
                         for a in addrs), 30, "both peers reachable")

    out = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "2",
                    "--cluster-config-out", str(tmp_path / "cluster.toml"), "--json",
                    timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    body = json.loads(out.stdout)
    assert body["schema"] == "mlxctl.cluster_plan/1"
    stages = body["plan"]["stages"]
    assert [s["stage"] for s in stages] == ["stage-0", "stage-1"]
    cfg = load_cluster(tmp_path / "cluster.toml")
    validate_layers(cfg, layer_count(read_model_config(model)))
    assert [s.address.split(":")[0] for s in cfg.stages] == ["127.0.0.2", "127.0.0.3"]
    table = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "2", timeout=60)
    assert table.returncode == 0 and "stage-1" in table.stdout and "HEADROOM" in table.stdout

    too_many = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "3", timeout=60)
    assert too_many.returncode == 1 and "3" in too_many.stderr, too_many.stderr

    # The TOML runs as written (plus the secret every node already holds).
    toml = tmp_path / "cluster.toml"
    toml.write_text(toml.read_text().replace("[cluster]\n", "[cluster]\nsecret_file = "
                                             f"\"{secret_file(tmp_path, secret)}\"\n", 1))
    for d in (*peers, coord):
        assert d.ctl("stop").returncode == 0 and d.proc is not None and d.proc.wait(20) == 0
    port = free_port("127.0.0.1")
    nodes = [("stage-0", "127.0.0.2"), ("stage-1", "127.0.0.3"), ("coordinator", "127.0.0.1")]
    started = []
    for node, ip in nodes:
        d = daemons.make(FAST_POLICY, name=node[:2])
        d.start("--distributed-config", str(toml), "--node-id", node, "--agent-addr", f"{ip}:0",
                *(("--port", str(port)) if node == "coordinator" else ()))
        started.append(d)
    for d, (node, _) in zip(started, nodes, strict=True):
        w = d.wait_worker("router" if node == "coordinator" else "stage", timeout=READY_S,
                          state="running")
        daemons.pids.add(w["pid"])
    text = complete(port, "llama")
    assert text == expected(model, PROMPT, 8)


def test_pp_auto_dry_run_prints_the_plan_and_writes_the_toml(
        daemons: Daemons, split_fixture_dir: Path, tmp_path: Path) -> None:
    model = split_fixture_dir / "qwen3"
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, name=f"p{i}") for i in (2, 3)]
    coord = daemons.make(name="dry")
    out_toml = tmp_path / "planned.toml"
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--cluster-peers", ",".join(agent(p) for p in peers), "--model", str(model),
                "--pp-auto", "2", "--dry-run", "--cluster-config-out", str(out_toml),
                "--agent-addr", "127.0.0.1:0", wait=False)
    assert coord.proc is not None
    assert coord.proc.wait(60) == 0, coord.stderr()
    assert "HEADROOM" in coord.stderr() and "stage-1" in coord.stderr()  # the table
    cfg = load_cluster(out_toml)
    validate_layers(cfg, layer_count(read_model_config(model)))
    assert [s.id for s in cfg.stages] == ["stage-0", "stage-1"]
    assert not any(w for w in coord.recorded_pids())  # no worker was started
