"""Plans that weigh speed on real daemons: a daemon measures its compute units once and
keeps them across a restart; peers of unequal speed are split by speed, and the plan
table says so."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

import pytest

from helpers.cluster import agent, by_address, start
from helpers.daemons import DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.waiting import wait_for

MEASURE = {"MLXCELD_TEST_COMPUTE_UNITS": ""}  # unset: the daemon runs the real benchmark


def speed(d: DaemonProc) -> dict[str, Any]:
    shown: dict[str, Any] = d.status()["daemon"]["compute_units"]
    return shown


@pytest.mark.slow
def test_measured_once_and_kept_across_a_restart(daemons: Daemons) -> None:
    secret = secrets.token_hex(16).encode()
    d = start(daemons, "127.0.0.4", secret, name="m", env=MEASURE)
    wait_for(lambda: speed(d)["source"] == "measured", 30, "the compute units measured")
    first = speed(d)
    assert first["units"] > 0 and first["dtype"] == "bfloat16" and first["error"] is None
    out = d.ctl("status")
    assert out.returncode == 0
    assert f"compute units: {first['units']:g} (measured in bfloat16)" in out.stdout
    assert d.ctl("stop").returncode == 0 and d.proc is not None and d.proc.wait(20) == 0
    d.start("--cluster-secret-file", str(secret_file(d.root, secret)),
            "--agent-addr", "127.0.0.4:0", env=MEASURE)
    again = speed(d)  # the cache, at once: a new measurement would differ in its digits
    assert again == first


@pytest.mark.slow
def test_peers_of_unequal_speed_are_split_by_speed(daemons: Daemons,
                                                   split_fixture_dir: Path) -> None:
    """127.0.0.2 declares 1 compute unit ([daemon] compute_units), 127.0.0.3 reports 3:
    with the same memory, the faster peer takes more layers than the slower one."""
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    slow = start(daemons, "127.0.0.2", secret, name="slow",
                 config="[daemon]\ncompute_units = 1\n")
    fast = start(daemons, "127.0.0.3", secret, name="fast",
                 env={"MLXCELD_TEST_COMPUTE_UNITS": "3"})
    assert speed(slow)["source"] == "declared" and speed(slow)["units"] == 1.0
    addrs = [agent(p) for p in (slow, fast)]
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers", ",".join(addrs), name="c")
    wait_for(lambda: all(by_address(coord).get(a, {}).get("state") == "reachable"
                         for a in addrs), 30, "both peers reachable")
    out = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "2", "--json",
                    timeout=60)
    assert out.returncode == 0, out.stderr + out.stdout
    stages = json.loads(out.stdout)["plan"]["stages"]
    assert [(s["node_address"], s["compute_units"], s["split_rule"]) for s in stages] == [
        (addrs[0], 1.0, "speed"), (addrs[1], 3.0, "speed")]
    sizes = [s["layers"][1] - s["layers"][0] for s in stages]
    assert sizes[1] > sizes[0], stages
    assert all(s["ms_per_token"] > 0 for s in stages)
    table = coord.ctl("cluster", "plan", "--model", str(model), "--stages", "2", timeout=60)
    assert table.returncode == 0
    assert "MS/TOKEN" in table.stdout and "layers split by speed" in table.stdout
