"""A tensor-parallel group across two "hosts" from ONE cluster TOML (issue 32), as a fleet
is deployed: ``[cluster] tensor_parallel_size = 2`` and two nodes of role
``tensor_parallel_rank`` (the second spelled ``tp``, mlxcel's alias), listed out of rank
order; each daemon started with only ``--distributed-config FILE --node-id ID`` beside its
own ports and state dir (the model and the secret come from the file). Rank 0 (node-0 on
127.0.0.2) runs as ``--tp-size 2 --tp-peers`` node-1's agent, node-1 as ``--node-role
tensor_parallel_rank``: the group forms over the authenticated agent connection and its
greedy completions are mlx-lm's on the whole model, for the llama fixture (node-1 on
127.0.0.3) and the qwen3 fixture (node-1 named by a hostname, ``localhost``). A file
whose ranks are wrong, or a rank with no secret, is refused at start with exit 2 naming
the file and the node. Every process is ended by pid."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.models import PROMPT, expected
from helpers.ports import free_port
from helpers.router import greedy
from helpers.waiting import wait_for

RANK0 = "127.0.0.2"
# The group serves within this of its daemons' start: two daemons, the formation (its
# backoff at most 8 s while the rank host is not up yet), two processes' imports, the
# ring, the loads, on a loaded 2-core machine. Not what is asserted about time.
FORM_S = 120.0
SECRET = b"the tensor group's secret from its file, 40"


@dataclass
class Group:
    path: Path  # the cluster TOML
    rank0: DaemonProc
    rank1: DaemonProc
    agents: dict[str, str]  # node id: its agent address, as the file says it
    url: str  # rank 0's OpenAI port, http://HOST:PORT

    def ready(self) -> bool:
        """``/ready`` 200 (polled as a load balancer does: answered all along, 503 by the
        daemon's stand-in while the group forms and its router starts, never refused), and
        the stand-in gone (it shares the port with the router for a moment once that
        runs)."""
        return (httpx.get(f"{self.url}/ready", timeout=10).status_code == 200
                and not self.rank0.status()["tensor"]["standin"])


def write_file(root: Path, model: Path, agents: dict[str, str]) -> Path:
    """The cluster TOML: node-1 first (rank order is the file's ranks, not its order)."""
    secret_file(root, SECRET)
    path = root / "tp.toml"
    path.write_text(f'[cluster]\nname = "tp-hosts"\nmodel = "{model}"\n'
                    'secret_file = "cluster.secret"\ntensor_parallel_size = 2\n'
                    "pipeline_parallel_size = 1\n\n"
                    f'[[nodes]]\nid = "node-1"\naddress = "{agents["node-1"]}"\n'
                    'role = "tp"\nrank = 1\n\n'
                    f'[[nodes]]\nid = "node-0"\naddress = "{agents["node-0"]}"\n'
                    'role = "tensor_parallel_rank"\nrank = 0\n')
    return path


def start_group(daemons: Daemons, root: Path, model: Path, rank1_host: str,
                rank1_ip: str) -> Group:
    """Both daemons from one file; node-1's agent named ``rank1_host`` there (a name or
    an IP) and bound on ``rank1_ip``."""
    port1 = free_port(rank1_ip)
    agents = {"node-0": f"{RANK0}:{free_port(RANK0)}", "node-1": f"{rank1_host}:{port1}"}
    path = write_file(root, model, agents)
    rank0, rank1 = (daemons.make(FAST_POLICY, name=n) for n in ("tt0", "tt1"))
    port = free_port(RANK0)
    # --agent-addr as the file says (where to bind): the test helper otherwise binds
    # 127.0.0.1:0; the file's own address is taken when it is left out (unit tests).
    rank0.start("--distributed-config", str(path), "--node-id", "node-0",
                "--agent-addr", agents["node-0"], "--host", RANK0, "--port", str(port))
    rank1.start("--distributed-config", str(path), "--node-id", "node-1",
                "--agent-addr", f"{rank1_ip}:{port1}")
    group = Group(path, rank0, rank1, agents, f"http://{RANK0}:{port}")
    wait_for(group.ready, FORM_S, "/ready 200 from the group", every=0.5)
    daemons.note(rank0)
    daemons.note(rank1)
    return group


def check_formed(g: Group) -> None:
    """``mlxctl status`` of each: the group of two on rank 0, over node-1's agent as the
    file names it; rank 1 on node-1, running its ``tp-1`` worker and no router."""
    tensor = g.rank0.status()["tensor"]
    assert tensor["state"] == "formed" and tensor["size"] == 2, tensor
    zero, one = tensor["ranks"]
    assert zero["rank"] == 0 and zero["ring"].startswith(f"{RANK0}:"), zero
    assert one["rank"] == 1 and one["agent"] == g.agents["node-1"], one
    assert one["state"] == "joined", one
    assert "router" in {w["name"] for w in g.rank0.status()["workers"]}
    mine = g.rank1.status()
    assert mine["tensor"]["rank"] == 1 and mine["tensor"]["ring"] == one["ring"], mine
    assert {w["name"] for w in mine["workers"]} == {"tp-1"}, mine["workers"]


def test_a_group_from_one_file_serves_mlx_lms_greedy_text(daemons: Daemons, fixture_dir: Path,
                                                         tmp_path: Path) -> None:
    model = fixture_dir / "llama"
    g = start_group(daemons, tmp_path, model, "127.0.0.3", "127.0.0.3")
    assert greedy(g.url, PROMPT, 8, model="llama") == expected(model, PROMPT, 8)
    check_formed(g)
    # Stopped as a service manager stops them: rank 0 forms the group no more once its
    # router stops (it used to retry the rank host for ever, its daemon never exiting).
    assert g.rank0.terminate() == 0, g.rank0.stderr()[-2000:]
    assert g.rank1.terminate() == 0, g.rank1.stderr()[-2000:]


def test_a_qwen3_group_with_a_rank_named_by_its_host_name(daemons: Daemons,
                                                          fixture_dir: Path,
                                                          tmp_path: Path) -> None:
    model = fixture_dir / "qwen3"
    g = start_group(daemons, tmp_path, model, "localhost", "127.0.0.1")
    assert greedy(g.url, PROMPT, 8, model="qwen3") == expected(model, PROMPT, 8)
    check_formed(g)


def refused(d: DaemonProc, *flags: str) -> str:
    """The stderr of ``d`` started with ``flags``, which exits 2 without a traceback."""
    seen = len(d.stderr())
    d.start(*flags, wait=False)
    assert d.proc is not None
    assert d.proc.wait(timeout=60) == 2, d.stderr()[seen:]
    out = d.stderr()[seen:]
    assert "Traceback" not in out, out
    return out


@pytest.mark.parametrize(("change", "said"), [
    (("rank = 1", "rank = 0"), "node 'node-1' and node 'node-0' both have rank 0"),
    (("tensor_parallel_size = 2", "tensor_parallel_size = 3"),
     "'cluster.tensor_parallel_size' is 3, but 2 node(s) have role 'tensor_parallel_rank'"),
    (('role = "tp"', 'role = "pp_tp"'),
     "node 'node-1': 'layers' is missing (every pipeline_tensor_parallel node has one)"),
])
def test_a_wrong_file_is_refused_at_start_naming_the_file(
        daemons: Daemons, fixture_dir: Path, tmp_path: Path, change: tuple[str, str],
        said: str) -> None:
    path = write_file(tmp_path, fixture_dir / "llama",
                      {"node-0": f"{RANK0}:19000", "node-1": "127.0.0.3:19000"})
    path.write_text(path.read_text().replace(*change))
    out = refused(daemons.make(name="tt"), "--distributed-config", str(path),
                  "--node-id", "node-0")
    assert f"{path}: {said}" in out, out


def test_a_rank_without_the_secret_is_refused_at_start(daemons: Daemons, fixture_dir: Path,
                                                       tmp_path: Path) -> None:
    path = write_file(tmp_path, fixture_dir / "llama",
                      {"node-0": f"{RANK0}:19000", "node-1": "127.0.0.3:19000"})
    path.write_text(path.read_text().replace('secret_file = "cluster.secret"\n', ""))
    out = refused(daemons.make(name="tt"), "--distributed-config", str(path),
                  "--node-id", "node-1")
    assert (f"{path}: node 'node-1' (tensor_parallel_rank, rank 1) needs the cluster "
            "secret: the ring's ports and ranks travel over the authenticated agent "
            "connection") in out, out
