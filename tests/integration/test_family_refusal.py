"""A model mlxceld cannot split is refused where the user can act, and a stage that cannot
load is failed once with its reason, not restarted in a loop; with real daemons.

A family not split (a tiny llama fixture whose config.json says ``mamba``) is refused by
`mlxctl cluster plan` and `activate`, `--pp-auto --dry-run` and `--distributed-config`,
each naming the family and the supported ones, and no stage worker starts anywhere. A stage
whose checkpoint mlx-lm cannot load (its config.json no longer fits its weights) exits
once, is failed with the reason, and `mlxctl status` says so; in a bring-up, `mlxctl
cluster activate` fails at once naming the peer and that reason, well within the
``PREPARE_S`` a peer would otherwise wait for its stage to load.
"""

from __future__ import annotations

import json
import secrets
import shutil
import textwrap
import time
from pathlib import Path
from typing import Any

from mlxceld.cluster.assignment.peer import PREPARE_S
from mlxceld.models.families import SUPPORTED

from helpers.cluster import ACTIVATE_S, agent, by_address, start
from helpers.daemons import FAST_POLICY, READY_S, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.ports import free_port
from helpers.waiting import wait_for

REFUSED_S = 60.0  # a daemon start refused at its edge; generous on a loaded machine
LOOP_S = 3.0  # under FAST_POLICY (0.2 s backoff) a restart loop would start it again by far


def edited(source: Path, target: Path, **config: Any) -> Path:
    """A copy of checkpoint ``source`` at ``target``, its config.json changed by ``config``."""
    shutil.copytree(source, target)
    path = target / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return target


def one_stage_toml(root: Path, model: Path, secret: bytes) -> Path:
    """A cluster of one stage (all 4 layers) and its coordinator, both on 127.0.0.1."""
    path = root / "cluster.toml"
    path.write_text(textwrap.dedent(f"""
        [cluster]
        name = "fam"
        pipeline_parallel_size = 1
        model = "{model}"
        secret_file = "{secret_file(root, secret)}"

        [[nodes]]
        id = "coordinator"
        address = "127.0.0.1:{free_port('127.0.0.1')}"
        role = "coordinator"

        [[nodes]]
        id = "stage-0"
        address = "127.0.0.1:{free_port('127.0.0.1')}"
        role = "pipeline_stage"
        rank = 0
        layers = [0, 4]
        """))
    return path


def names_the_family(text: str) -> bool:
    return "model_type 'mamba'" in text and all(f in text for f in SUPPORTED)


def stage_starts(d: DaemonProc) -> int:
    return len([e for e in d.events(400) if e["kind"] == "worker.spawned"
                and e["subject"] == "stage"])


def test_an_unsupported_family_is_refused_before_any_stage_starts(
        daemons: Daemons, split_fixture_dir: Path, tmp_path: Path) -> None:
    mamba = edited(split_fixture_dir / "llama", tmp_path / "mamba", model_type="mamba")
    secret = secrets.token_hex(16).encode()
    peer = start(daemons, "127.0.0.2", secret, "--pp-peer", "--model", str(mamba), name="p")
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers", agent(peer), name="c")

    plan = coord.ctl("cluster", "plan", "--model", str(mamba), "--stages", "1", timeout=60)
    assert plan.returncode == 1 and names_the_family(plan.stderr), plan.stderr
    assert "hint: " in plan.stderr and "mlxctl serve" in plan.stderr
    as_json = coord.ctl("cluster", "plan", "--model", str(mamba), "--stages", "1", "--json",
                        timeout=60)
    assert json.loads(as_json.stdout)["error"]["code"] == "unsupported_family", as_json
    activate = coord.ctl("cluster", "activate", "--model", str(mamba), "--stages", "1",
                         timeout=60)
    assert activate.returncode == 1 and names_the_family(activate.stderr), activate.stderr
    assert (coord.status().get("bringup") or {}).get("state") != "pushing"
    for d in (peer, coord):
        assert not [w for w in d.status()["workers"] if w["name"] == "stage"], d.status()
        assert stage_starts(d) == 0
    assert peer.status()["assignment"] is None  # no offer reached it

    dry = daemons.make(name="dry")
    dry.start("--cluster-secret-file", str(secret_file(dry.root, secret)), "--cluster-peers",
              agent(peer), "--model", str(mamba), "--pp-auto", "1", "--dry-run", wait=False)
    assert dry.proc is not None and dry.proc.wait(REFUSED_S) == 2, dry.stderr()
    assert names_the_family(dry.stderr()) and "--pp-auto --model" in dry.stderr()

    toml = one_stage_toml(tmp_path, mamba, secret)
    placed = daemons.make(name="dc")
    placed.start("--distributed-config", str(toml), "--node-id", "stage-0", wait=False)
    assert placed.proc is not None and placed.proc.wait(REFUSED_S) == 2, placed.stderr()
    assert names_the_family(placed.stderr()) and str(toml) in placed.stderr()
    assert not placed.recorded_pids()


def test_a_stage_that_cannot_load_fails_once_with_its_reason(
        daemons: Daemons, split_fixture_dir: Path, tmp_path: Path) -> None:
    llama = split_fixture_dir / "llama"
    size = json.loads((llama / "config.json").read_text())["intermediate_size"]
    bad = edited(llama, tmp_path / "bad", intermediate_size=size + 16)  # weights no longer fit
    secret = secrets.token_hex(16).encode()
    d = daemons.make(FAST_POLICY, name="st")
    d.start("--distributed-config", str(one_stage_toml(tmp_path, bad, secret)), "--node-id",
            "stage-0")

    failed = d.wait_worker("stage", timeout=READY_S, state="failed")
    reason = failed["reason"]
    assert "stage stage-0 failed to load layers [0, 4)" in reason, reason
    assert "mlx-lm cannot load it" in reason and "not restarted" in reason, reason
    time.sleep(LOOP_S)
    assert stage_starts(d) == 1 and d.worker("stage")["state"] == "failed"
    [record] = [e for e in d.events(400) if e["kind"] == "worker.failed"]
    assert record["data"]["cause"] == "config", record
    status = d.ctl("status")
    shown = status.stdout + status.stderr
    assert "worker stage failed: stage stage-0 failed to load" in shown, shown
    assert "mlxctl restart stage" in shown, shown  # what to do once it is fixed


def test_a_stage_that_cannot_load_fails_the_bring_up_naming_the_peer(
        daemons: Daemons, split_fixture_dir: Path, tmp_path: Path) -> None:
    llama = split_fixture_dir / "llama"
    size = json.loads((llama / "config.json").read_text())["intermediate_size"]
    bad = edited(llama, tmp_path / "bad", intermediate_size=size + 16)  # plans; cannot load
    secret = secrets.token_hex(16).encode()
    peer = start(daemons, "127.0.0.2", secret, "--pp-peer", "--model", str(bad), name="p")
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers", agent(peer), name="c")
    wait_for(lambda: by_address(coord).get(agent(peer), {}).get("state") == "reachable", 30,
             "the peer reachable")

    began = time.monotonic()
    out = coord.ctl("cluster", "activate", "--model", str(bad), "--stages", "1",
                    timeout=ACTIVATE_S)
    took = time.monotonic() - began
    assert out.returncode == 1, out.stdout + out.stderr
    line = next((x for x in out.stderr.splitlines() if x.startswith(f"  {agent(peer)} ")), "")
    assert "stage stage-0 failed to load layers [0, 4)" in line, out.stderr
    assert "mlx-lm cannot load it" in line, out.stderr
    assert took < PREPARE_S, took  # failed at its first exit, not at the load deadline
    assert stage_starts(peer) == 1
    assert not [w for w in peer.status()["workers"] if w["name"] == "stage"]
