"""engine/transport.py: the ring or JACCL, a function of what each host reports (every
branch), and the probe of this host (a real report: on Linux, no RDMA)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from mlxceld.engine.transport import (
    LINUX_RDMA,
    HostReport,
    choose_transport,
    parse_ibv_devices,
    probe_host,
    probe_in_child,
    rdma_devices,
    report_from_json,
    report_json,
)

MAC = HostReport(host="studio-1", system="darwin", macos=(26, 2), jaccl=True,
                 rdma_devices=("rdma_en3", "rdma_en4"))
MAC2 = replace(MAC, host="studio-2")
LINKED = [frozenset(("studio-1", "studio-2"))]
IBV = """    device                 node GUID
    ------              ----------------
    rdma_en2            8464c7fffe0d3a39
    rdma_en3            8464c7fffe0d3a3a
"""


def test_every_host_able_and_every_pair_linked_is_jaccl() -> None:
    choice = choose_transport([MAC, MAC2], LINKED)
    assert (choice.backend, choice.reason) == (
        "jaccl", "RDMA over Thunderbolt between all 2 hosts")
    three = [MAC, MAC2, replace(MAC, host="studio-3", macos=(27, 0))]
    mesh = [frozenset(p) for p in (("studio-1", "studio-2"), ("studio-1", "studio-3"),
                                   ("studio-2", "studio-3"))]
    assert choose_transport(three, mesh).backend == "jaccl"
    two_ranks_each = [MAC, MAC, MAC2, MAC2]  # two ranks a host: still one pair to link
    assert choose_transport(two_ranks_each, LINKED).backend == "jaccl"


@pytest.mark.parametrize(("reports", "links", "reason"), [
    ([], LINKED, "no hosts reported"),
    ([MAC, replace(MAC2, system="linux", macos=None)], LINKED,
     "studio-2 is not macOS (linux); RDMA over Thunderbolt is a Mac's"),
    ([replace(MAC, macos=(26, 1)), MAC2], LINKED,
     "studio-1 runs macOS 26.1; RDMA over Thunderbolt needs 26.2 or later"),
    ([MAC, replace(MAC2, macos=None)], LINKED,
     "studio-2 runs macOS an unknown version; RDMA over Thunderbolt needs 26.2 or later"),
    ([MAC, replace(MAC2, jaccl=False)], LINKED, "mlx on studio-2 was built without JACCL"),
    ([MAC, replace(MAC2, rdma_devices=())], LINKED,
     "no RDMA device on studio-2 (enable it in macOS Recovery: rdma_ctl enable)"),
    ([MAC, MAC2], [], "studio-1 and studio-2 are not linked over Thunderbolt"),
    ([MAC, MAC2, replace(MAC, host="studio-3")], LINKED,
     "studio-1 and studio-3 are not linked over Thunderbolt"),
    ([MAC, MAC], (), "all 2 ranks on one host; JACCL joins separate Macs"),
    ([replace(MAC, rdma_devices=())] * 2, (),
     "no RDMA device on this host (enable it in macOS Recovery: rdma_ctl enable)"),
    ([replace(MAC, system="linux", macos=None)] * 3, (),
     "this host is not macOS (linux); RDMA over Thunderbolt is a Mac's"),
])
def test_anything_missing_falls_back_to_the_ring_naming_it(
        reports: list[HostReport], links: list[frozenset[str]], reason: str) -> None:
    choice = choose_transport(reports, links)
    assert (choice.backend, choice.reason) == ("ring", reason)
    assert choice.line() == f"ring ({reason})"


def test_the_first_host_lacking_something_is_named_in_rank_order() -> None:
    reports = [MAC, replace(MAC2, jaccl=False), replace(MAC, host="s3", system="linux")]
    assert choose_transport(reports).reason == "mlx on studio-2 was built without JACCL"


def test_ibv_devices_table_is_read() -> None:
    assert parse_ibv_devices(IBV) == ("rdma_en2", "rdma_en3")
    assert parse_ibv_devices("") == ()
    assert parse_ibv_devices("    device                 node GUID\n    ------  ----\n") == ()


def test_this_host_is_probed() -> None:
    report = probe_host("here")
    assert (report.host, report.system) == ("here", sys.platform)
    if sys.platform != "darwin":
        assert report.macos is None
        assert report.rdma_devices == (tuple(sorted(os.listdir(LINUX_RDMA)))
                                       if LINUX_RDMA.is_dir() else ())
        choice = choose_transport([report, report])
        assert choice.backend == "ring"
        assert choice.reason.startswith(f"this host is not macOS ({sys.platform})")
    import mlx.core as mx

    assert report.jaccl == mx.distributed.is_available(backend="jaccl")


def fake_ibv(tmp_path: Path, body: str) -> dict[str, str]:
    """A PATH whose ``ibv_devices`` is a script of ours (none is installed here)."""
    tool = tmp_path / "bin" / "ibv_devices"
    tool.parent.mkdir()
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)
    return {"PATH": f"{tool.parent}:{os.environ.get('PATH', '')}"}


def test_a_macs_devices_come_from_ibv_devices_and_a_hung_one_is_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The darwin branch run here with a stand-in ibv_devices (a real process).
    monkeypatch.setenv("PATH", fake_ibv(tmp_path, f"cat <<'EOF'\n{IBV}EOF")["PATH"])
    assert rdma_devices("darwin", 5.0) == ("rdma_en2", "rdma_en3")
    (tmp_path / "bin" / "ibv_devices").write_text("#!/bin/sh\nexit 1\n")
    assert rdma_devices("darwin", 5.0) == ()  # failed: none
    (tmp_path / "bin" / "ibv_devices").write_text("#!/bin/sh\nexec sleep 30\n")
    assert rdma_devices("darwin", 0.5) == ()  # past its bound: killed, none
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert rdma_devices("darwin", 5.0) == ()  # no tool: none


def test_importing_it_imports_no_mlx() -> None:
    code = ("import sys, mlxceld.engine.transport; "
            "sys.exit(any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_a_probe_in_a_child_reports_as_the_probe_here_and_goes_over_the_wire() -> None:
    here = probe_host("h")
    child = probe_in_child("10.0.0.7")
    assert child == replace(here, host="10.0.0.7")
    said = report_json(child)
    assert set(said) == {"system", "macos", "jaccl", "devices"}
    assert report_from_json("10.0.0.7", said) == child
    mac = {"system": "darwin", "macos": [26, 2], "jaccl": True, "devices": ["rdma_en3"]}
    assert report_from_json("m", mac) == HostReport("m", "darwin", (26, 2), True, ("rdma_en3",))


@pytest.mark.parametrize(("bad", "field"), [
    ("darwin", "system, macos"), ({"system": "darwin"}, "system, macos"),
    ({"system": "", "macos": None, "jaccl": False, "devices": []}, "'system'"),
    ({"system": "darwin", "macos": "26.2", "jaccl": False, "devices": []}, "'macos'"),
    ({"system": "darwin", "macos": [26, True], "jaccl": False, "devices": []}, "'macos'"),
    ({"system": "darwin", "macos": None, "jaccl": 1, "devices": []}, "'jaccl'"),
    ({"system": "darwin", "macos": None, "jaccl": True, "devices": ["x"] * 33}, "'devices'"),
])
def test_a_malformed_host_report_is_refused_naming_the_field(bad: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        report_from_json("h", bad)


def test_a_child_that_fails_reports_no_rdma(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")
    assert probe_in_child("h") == HostReport("h", sys.platform, None if sys.platform !=
                                             "darwin" else probe_host("h").macos, False, ())
