"""`mlxctl cluster plan --mesh` and `mlxceld --pp-auto N --mesh M --dry-run` on real
daemons: the meshes considered, the one chosen and why, the 2D cluster TOML (a mesh
pushed: tests/integration/test_mesh_push.py), a coordinator's draft in it (its tensor
stage's rank 0 drafts)."""

from __future__ import annotations

import json
import secrets
import tomllib
from pathlib import Path

from helpers.cluster import agent, coordinator, start
from helpers.daemons import Daemons
from helpers.keys import secret_file


def test_plan_and_dry_run_show_the_mesh(daemons: Daemons, split_fixture_dir: Path,
                                        tmp_path: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = [start(daemons, f"127.0.0.{i}", secret, name=f"p{i}") for i in (2, 3)]
    addrs = [agent(p) for p in peers]
    coord, _, _ = coordinator(daemons, secret, peers)  # each peer reachable

    out = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "2", "--mesh",
                    "tp", "--cluster-config-out", str(tmp_path / "tp.toml"), "--json",
                    timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    body = json.loads(out.stdout)
    assert body["plan"]["tp_size"] == 2 and len(body["plan"]["stages"]) == 1
    (stage,) = body["plan"]["stages"]
    assert [stage["node_address"], *(r["node_address"] for r in stage["tp_nodes"])] == addrs
    assert (body["mesh"]["mode"], body["mesh"]["stages"], body["mesh"]["tp_size"]) == (
        "tp", 1, 2)
    written = tomllib.loads((tmp_path / "tp.toml").read_text())
    assert written["cluster"]["tensor_parallel_size"] == 2
    assert [n["role"] for n in written["nodes"]] == ["coordinator",
                                                     *["pipeline_tensor_parallel"] * 2]

    text = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "2", "--mesh",
                     "auto", timeout=60)
    assert text.returncode == 0, text.stderr
    assert "meshes of 2 host(s) considered (--mesh auto)" in text.stdout
    assert "2 x 1" in text.stdout and "1 x 2" in text.stdout and "mesh: " in text.stdout

    dry = daemons.make(name="dry")
    dry.start("--cluster-secret-file", str(secret_file(dry.root, secret)),
              "--cluster-peers", ",".join(addrs), "--model", str(model), "--pp-auto", "2",
              "--mesh", "2d", "--dry-run", "--agent-addr", "127.0.0.1:0", wait=False)
    assert dry.proc is not None
    assert dry.proc.wait(60) == 2, dry.stderr()
    assert "a 2d mesh of 2 host(s) needs P x T = 2" in dry.stderr()
    dry = daemons.make(name="dry2")
    dry.start("--cluster-secret-file", str(secret_file(dry.root, secret)),
              "--cluster-peers", ",".join(addrs), "--model", str(model), "--pp-auto", "2",
              "--mesh", "tp", "--dry-run", "--agent-addr", "127.0.0.1:0",
              # the model as its own draft: the tensor stage's rank 0 drafts with it
              "--draft-model", str(model), "--num-draft-tokens", "3",
              "--cluster-config-out", str(tmp_path / "drafted.toml"), wait=False)
    assert dry.proc is not None
    assert dry.proc.wait(60) == 0, dry.stderr()
    assert "meshes of 2 host(s) considered (--mesh tp)" in dry.stderr()
    assert "each stage a tensor group of 2 ranks" in dry.stderr()
    drafted = tomllib.loads((tmp_path / "drafted.toml").read_text())
    assert (drafted["cluster"]["draft_model"], drafted["cluster"]["num_draft_tokens"]) == (
        str(model), 3)
    assert drafted["cluster"]["tensor_parallel_size"] == 2
