"""Each refusal of a stage offer, end to end: a coordinator (127.0.0.1, --pp-auto 2) whose
offers fail one of the peer's checks, and its bring-up error naming the peer and the reason.

Two --pp-peer daemons (127.0.0.2, .3) serve every case: a refused offer loads nothing and
leaves a peer ready for the next. A coordinator is started per case, its offers bent by a
fault point (``mlxceld.failpoints``) where no honest coordinator could send them: the model
identity covers the layer count, so only a lying coordinator reaches the layer-range check.
The model refusal (a peer without the model) is in test_bringup.py.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxceld import __version__

from helpers.cluster import agent, start
from helpers.daemons import DaemonProc, Daemons
from helpers.ports import free_port
from helpers.waiting import wait_for

PUSH_END_S = 90.0  # plan and push; a refused offer loads nothing


@dataclass
class Peers:
    secret: bytes
    model: Path
    daemons: list[DaemonProc]


@pytest.fixture(scope="module")
def peers(split_fixture_dir: Path) -> Iterator[Peers]:
    owner = Daemons()
    try:
        secret = secrets.token_hex(16).encode()
        model = split_fixture_dir / "llama"
        yield Peers(secret, model, [start(owner, f"127.0.0.{i}", secret, "--pp-peer",
                                          "--model", str(model), name=f"p{i}")
                                    for i in (2, 3)])
    finally:
        owner.cleanup()


CASES = [
    # (fault point or extra flags, refusal code, what the reason says)
    ({"MLXCELD_FAILPOINT": "offer-assignment-version"}, (), "assignment_version",
     "assignment protocol mismatch: the coordinator speaks version 0, this node 2"),
    ({"MLXCELD_FAILPOINT": "offer-package-version"}, (), "package_version",
     f"the coordinator runs mlxceld {__version__}+failpoint, this node {__version__}"),
    ({}, ("--cluster-name", "lab-x"), "cluster_name",
     "the offer is for cluster 'lab-x', this node is in cluster 'mlxcel-cluster'"),
    ({"MLXCELD_FAILPOINT": "offer-layer-count"}, (), "layer_range",
     "the offered split does not fit this node's checkpoint (4 layers)"),
    ({"MLXCELD_FAILPOINT": "offer-coordinator"}, (), "coordinator",
     "the offer names coordinator 127.0.0.254:19000"),
]


@pytest.mark.parametrize(("env", "flags", "code", "reason"), CASES,
                         ids=[c[2] for c in CASES])
def test_a_refusal_is_named_in_the_bring_up_error(peers: Peers, daemons: Daemons,
                                                   env: dict[str, str], flags: tuple[str, ...],
                                                   code: str, reason: str) -> None:
    coord = start(daemons, "127.0.0.1", peers.secret, "--cluster-peers",
                  ",".join(agent(p) for p in peers.daemons), "--pp-auto", "2", "--model",
                  str(peers.model), "--port", str(free_port("127.0.0.1")), *flags, name="c",
                  env=env)
    failed = wait_for(lambda: (b := coord.status().get("bringup") or {}).get("state")
                      == "failed" and b, PUSH_END_S, "the bring-up to fail")
    summary = failed["summary"]
    named = [p for p in peers.daemons if f"{agent(p)}: refused: {code}: {reason}" in summary]
    assert named, summary  # each peer refuses; the first refusal ends the push
    assert "bring-up failed" in coord.stderr()
    for p in named:
        row = p.status()["assignment"]
        assert row["state"] == "refused" and row["reason"].startswith(f"{code}: "), row
    for d in (*peers.daemons, coord):
        running = [w for w in d.status()["workers"] if w["name"] in ("stage", "router")
                   and w["state"] in ("starting", "running")]
        assert not running, running
