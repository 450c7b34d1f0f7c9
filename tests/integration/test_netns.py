"""Each daemon in its own Linux network namespace, a host of its own: nothing shares
127.0.0.1, every daemon keeps the literal defaults (agent 0.0.0.0:19000, router
127.0.0.1:8080), and peers are named by host names from each namespace's /etc/hosts
(`ip netns exec` mounts /etc/netns/NS/hosts over it). Needs root and iproute2; skips
with the reason elsewhere."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.cluster import activate
from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.models import PROMPT, expected

SUBNET = "10.213.77"
DOMAIN = "mlx.test"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Lan:
    """Namespaces on one bridge (itself in a namespace of its own), each with an address
    in SUBNET and /etc/hosts naming every one of them."""

    tag: str
    names: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        return f"{self.tag}-{host}"

    def add_switch(self) -> None:
        _ip("netns", "add", self.ns("sw"))
        self.names.append(self.ns("sw"))
        _ip("-n", self.ns("sw"), "link", "add", "br0", "type", "bridge")
        _ip("-n", self.ns("sw"), "link", "set", "br0", "up")

    def add_host(self, host: str, octet: int) -> None:
        ns = self.ns(host)
        _ip("netns", "add", ns)
        self.names.append(ns)
        veth = f"{self.tag}{octet}"
        _ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        _ip("link", "set", veth, "netns", ns)
        _ip("link", "set", f"{veth}p", "netns", self.ns("sw"))
        _ip("-n", self.ns("sw"), "link", "set", f"{veth}p", "master", "br0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.{octet}/24", "dev", veth)
        _ip("-n", ns, "link", "set", veth, "up")

    def write_hosts(self, hosts: dict[str, int]) -> None:
        lines = ["127.0.0.1 localhost"] + [f"{SUBNET}.{octet} {h}.{DOMAIN}"
                                           for h, octet in hosts.items()]
        for h in hosts:
            etc = Path("/etc/netns") / self.ns(h)
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text("\n".join(lines) + "\n")

    def remove(self) -> None:
        for ns in reversed(self.names):
            with contextlib.suppress(subprocess.SubprocessError):
                _ip("netns", "del", ns)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)


@pytest.fixture
def lan() -> Iterator[Lan]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip)")
    net = Lan(f"mx{secrets.token_hex(2)}")
    hosts = {"coord": 1, "node-1": 2, "node-2": 3}
    try:
        net.add_switch()
        for host, octet in hosts.items():
            net.add_host(host, octet)
        net.write_hosts(hosts)
    except (subprocess.SubprocessError, OSError) as exc:
        net.remove()
        pytest.skip(f"cannot make network namespaces here: {exc}")
    try:
        yield net
    finally:
        net.remove()


def complete_in(ns: str, model: str) -> str:
    """A completion from inside the coordinator's host (its router is on 127.0.0.1)."""
    code = ("import openai, sys; c = openai.OpenAI(base_url='http://127.0.0.1:8080/v1', "
            "api_key='none', max_retries=0, timeout=60); sys.stdout.write(c.completions."
            f"create(model={model!r}, prompt={PROMPT!r}, max_tokens=8, temperature=0)"
            ".choices[0].text)")
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_cluster_of_namespaces_on_every_default(lan: Lan, daemons: Daemons,
                                                  split_fixture_dir: Path) -> None:
    model = split_fixture_dir / "llama"
    secret = secrets.token_hex(16).encode()
    peers = [Host(daemons, f"n{i}", secret=secret, daemon={"pp_peer": True},
                  serve={"model": str(model)}, netns=lan.ns(f"node-{i}")).start()
             for i in (1, 2)]
    names = [f"node-{i}.{DOMAIN}:19000" for i in (1, 2)]
    coord = Host(daemons, "co", secret=secret, daemon={"cluster_peers": names},
                 netns=lan.ns("coord")).start()
    assert coord.d.status()["agent"]["address"] == "0.0.0.0:19000"
    activate(coord.d, model, 2)
    for i, p in enumerate(peers, start=1):
        stage = p.d.wait_worker("stage", timeout=READY_S, state="running")
        daemons.pids.add(stage["pid"])
        assert stage["stats"]["address"].startswith(f"node-{i}.{DOMAIN}:"), stage
    daemons.pids.add(coord.d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    assert complete_in(lan.ns("coord"), "llama") == expected(model, PROMPT, 8)
