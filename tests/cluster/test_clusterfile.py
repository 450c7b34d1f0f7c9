"""The cluster TOML: good files round-trip through dump and load; each bad one is refused
with a message naming the file, the node and the field."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlxceld.cluster.clusterfile.load import (
    dump_cluster,
    load_cluster,
    needs_secret,
    select_node,
    validate_layers,
    write_cluster,
)
from mlxceld.cluster.clusterfile.model import NodeConfig
from mlxceld.config.secrets import TomlSecretFile
from mlxceld.errors import ConfigError

Data = dict[str, Any]


def toml(data: Data) -> str:
    """Our test data as TOML text, written independently of ``dump_cluster``."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=False)  # JSON's escapes are TOML's
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return str(v)

    def table(t: Data) -> list[str]:
        return [f"{k} = {value(v)}" for k, v in t.items() if not isinstance(v, dict)]

    lines = [f"{k} = {value(v)}" for k, v in data.items() if k not in ("cluster", "nodes")]
    if "cluster" in data:
        lines += ["[cluster]", *table(data["cluster"])]
    nodes = data.get("nodes")
    if isinstance(nodes, list) and all(isinstance(n, dict) for n in nodes):
        for node in nodes:
            lines += ["[[nodes]]", *table(node)]
            for k, v in node.items():
                if isinstance(v, dict):
                    lines += [f"[nodes.{k}]", *table(v)]
    elif "nodes" in data:
        lines.insert(0, f"nodes = {value(data['nodes'])}")
    return "\n".join(lines) + "\n"


def two_stages() -> Data:
    return {
        "cluster": {"name": "lab", "pipeline_parallel_size": 2, "secret_file": "secret",
                    "model": "models/qwen3"},
        "nodes": [
            {"id": "coordinator", "address": "127.0.0.1:19000", "role": "coordinator"},
            {"id": "stage-0", "address": "127.0.0.2:19100", "role": "pipeline_stage",
             "rank": 0, "layers": [0, 14], "resources": {"memory_bytes": 68719476736}},
            {"id": "stage-1", "address": "127.0.0.3:19100", "role": "pipeline_stage",
             "rank": 1, "layers": [14, 28]},
        ],
    }


def three_stages() -> Data:
    """Nodes out of rank order, IPv6 and hostname addresses, no optional keys."""
    return {
        "cluster": {"pipeline_parallel_size": 3},
        "nodes": [
            {"id": "s2", "address": "[fd00::3]:7000", "role": "pipeline_stage", "rank": 2,
             "layers": [20, 36]},
            {"id": "front", "address": "router.lan:19000", "role": "coordinator"},
            {"id": "s0", "address": "mac-mini-1.local:7000", "role": "pipeline_stage",
             "rank": 0, "layers": [0, 10]},
            {"id": "s1", "address": "[fd00::2]:7000", "role": "pipeline_stage", "rank": 1,
             "layers": [10, 20]},
        ],
    }


def write(tmp_path: Path, data: Data | str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(data if isinstance(data, str) else toml(data), encoding="utf-8")
    return path


def refused(tmp_path: Path, data: Data | str, pattern: str) -> ConfigError:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as err:
        load_cluster(path)
    message = str(err.value)
    assert message.startswith((f"{path}: ", f"cluster file {path} ")), message
    assert err.value.hint, message
    assert_matches(pattern, message)
    return err.value


def assert_matches(pattern: str, message: str) -> None:
    assert re.search(pattern, message), f"{pattern!r} not in {message!r}"


# --- good files ---------------------------------------------------------------------------


@pytest.mark.parametrize("make", [two_stages, three_stages])
def test_round_trip(tmp_path: Path, make: Callable[[], Data]) -> None:
    cfg = load_cluster(write(tmp_path, make()))
    text = dump_cluster(cfg)
    again = tmp_path / "again.toml"
    write_cluster(cfg, again)
    assert again.read_text() == text
    reloaded = load_cluster(again)
    assert reloaded == dataclasses.replace(cfg, path=again)
    assert dump_cluster(reloaded) == text


def test_two_stages_read(tmp_path: Path) -> None:
    path = write(tmp_path, two_stages())
    cfg = load_cluster(path)
    assert cfg.name == "lab" and cfg.pipeline_parallel_size == 2 and cfg.path == path
    assert cfg.secret_file == "secret" and cfg.model == "models/qwen3"
    assert cfg.model_path() == tmp_path / "models/qwen3"
    assert cfg.secret_source() == TomlSecretFile("secret", path)
    assert cfg.coordinator == NodeConfig("coordinator", "127.0.0.1:19000", "127.0.0.1", 19000,
                                         "coordinator")
    assert cfg.stages[0] == NodeConfig("stage-0", "127.0.0.2:19100", "127.0.0.2", 19100,
                                       "pipeline_stage", 0, (0, 14), 68719476736)
    assert [n.id for n in cfg.stages] == ["stage-0", "stage-1"]
    assert needs_secret(cfg)


def test_three_stages_in_rank_order(tmp_path: Path) -> None:
    cfg = load_cluster(write(tmp_path, three_stages()))
    assert cfg.name == "mlxcel-cluster"
    assert cfg.secret_file is None and cfg.model is None and cfg.model_path() is None
    assert cfg.secret_source() is None
    assert [n.id for n in cfg.stages] == ["s0", "s1", "s2"]
    assert cfg.node("s2") == cfg.nodes[0] and cfg.nodes[0].host == "fd00::3"
    assert cfg.node("nope") is None
    flow = ["front", "s0", "s1", "s2"]
    for before, after in itertools.pairwise(flow):
        assert getattr(cfg.downstream_of(before), "id", None) == after
        assert getattr(cfg.upstream_of(after), "id", None) == before
    assert cfg.upstream_of("front") is None and cfg.downstream_of("s2") is None


def test_absolute_and_home_paths(tmp_path: Path) -> None:
    data = two_stages()
    data["cluster"]["model"] = "/srv/models/qwen3"
    data["cluster"]["secret_file"] = "~/secret"
    cfg = load_cluster(write(tmp_path, data))
    assert cfg.model_path() == Path("/srv/models/qwen3")
    source = cfg.secret_source()
    assert source is not None and source.resolve() == Path("~/secret").expanduser()


def test_select_node(tmp_path: Path) -> None:
    path = write(tmp_path, two_stages())
    cfg = load_cluster(path)
    assert select_node(cfg, "stage-1") is cfg.nodes[2]
    with pytest.raises(ConfigError) as err:
        select_node(cfg, "stage-9")
    assert str(err.value) == (f"{path}: no node has id 'stage-9'; the ids are: "
                              "'coordinator', 'stage-0', 'stage-1'")
    assert "--node-id" in err.value.hint
    with pytest.raises(ConfigError, match="no node has id 'x'"):
        cfg.upstream_of("x")


def test_needs_secret(tmp_path: Path) -> None:
    data = two_stages()
    data["cluster"]["pipeline_parallel_size"] = 1
    del data["nodes"][2]
    data["nodes"][1]["layers"] = [0, 28]
    assert needs_secret(load_cluster(write(tmp_path, data)))  # two hosts: 127.0.0.1 and .2
    data["nodes"][1]["address"] = "127.0.0.1:19100"
    assert not needs_secret(load_cluster(write(tmp_path, data)))  # one stage on one host
    three = load_cluster(write(tmp_path, three_stages()))
    assert needs_secret(three)


def test_odd_strings_round_trip(tmp_path: Path) -> None:
    """Quotes, backslashes, control characters in paths, non-ASCII ids: escaped on the way out."""
    cfg = load_cluster(write(tmp_path, two_stages()))
    odd = dataclasses.replace(
        cfg, name='lab "\u03b1" \\ 🙂', model='dir with "quotes"\\and\ttab\nnewline\x7f\x01',
        secret_file="sécret # not a comment",
        nodes=(dataclasses.replace(cfg.nodes[0], id="coordinatör ]]"), *cfg.nodes[1:]))
    path = tmp_path / "odd.toml"
    write_cluster(odd, path)
    assert load_cluster(path) == dataclasses.replace(odd, path=path)


def test_write_cluster_checks_before_writing(tmp_path: Path) -> None:
    cfg = load_cluster(write(tmp_path, two_stages()))
    bad = dataclasses.replace(cfg, nodes=cfg.nodes[:2])  # pipeline_parallel_size is 2
    path = tmp_path / "bad.toml"
    with pytest.raises(ConfigError, match=rf"^{path}: 'cluster.pipeline_parallel_size' is 2"):
        write_cluster(bad, path)
    assert not path.exists() and list(tmp_path.iterdir()) == [tmp_path / "cluster.toml"]
    with pytest.raises(ConfigError, match=r"cannot be written"):
        write_cluster(cfg, tmp_path / "missing-dir" / "c.toml")


def test_identity_addresses_are_what_the_wire_accepts(tmp_path: Path) -> None:
    from mlxceld.wire.hello import parse_identity

    for cfg in (load_cluster(write(tmp_path, d())) for d in (two_stages, three_stages)):
        for n in cfg.nodes:
            assert parse_identity(n.address.encode()) == (n.host, n.port)


def test_model_layers_against_a_fixture(fixture_dir: Path, tmp_path: Path) -> None:
    from mlxceld.models import layer_count, model_identity, read_model_config

    data = two_stages()
    data["cluster"]["model"] = str(fixture_dir / "qwen3")
    data["nodes"][1]["layers"], data["nodes"][2]["layers"] = [0, 1], [1, 2]
    cfg = load_cluster(write(tmp_path, data))
    model = cfg.model_path()
    assert model is not None and model_identity(model)
    validate_layers(cfg, layer_count(read_model_config(model)))


def test_importing_the_cluster_package_does_not_import_mlx() -> None:
    code = ("import sys, mlxceld.cluster; "
            "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')))")
    root = str(Path(__file__).parents[2])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "PYTHONPATH": root})
    assert out.stdout.strip() == "[]"


# --- validate_layers ----------------------------------------------------------------------


def test_validate_layers(tmp_path: Path) -> None:
    path = write(tmp_path, two_stages())
    cfg = load_cluster(path)
    validate_layers(cfg, 28)
    with pytest.raises(ConfigError) as err:
        validate_layers(cfg, 30)
    assert str(err.value) == (
        f"{path}: layers 28..29 are on no stage: the model has 30 layers and the last "
        "stage, node 'stage-1' (rank 1, layers [14, 28]), ends at 28")
    assert "layers = [14, 30]" in err.value.hint
    with pytest.raises(ConfigError, match=r"layer 28 is on no stage: the model has 29 layers"):
        validate_layers(cfg, 29)
    with pytest.raises(ConfigError) as err:
        validate_layers(cfg, 20)
    assert str(err.value) == (
        f"{path}: node 'stage-1' (rank 1, layers [14, 28]) reaches layer 27, but the model "
        "has only 20 layers (0..19)")
    with pytest.raises(ConfigError, match=r"node 'stage-0' \(rank 0, layers \[0, 14\]\) "
                       r"reaches layer 13, but the model has only 10 layers"):
        validate_layers(cfg, 10)


# --- refused files ------------------------------------------------------------------------


def node(data: Data, i: int) -> Data:
    n: Data = data["nodes"][i]
    return n


CASES: dict[str, tuple[Callable[[Data], object], str]] = {
    # ids and names
    "duplicate id": (lambda d: node(d, 2).update(id="stage-0"),
                     r"nodes\[1\] and nodes\[2\] both have id 'stage-0'"),
    "missing id": (lambda d: node(d, 1).pop("id"), r": nodes\[1\]: 'id' is missing"),
    "empty id": (lambda d: node(d, 1).update(id=""), r": nodes\[1\]: 'id' must not be empty"),
    "id not a string": (lambda d: node(d, 1).update(id=7),
                        r": nodes\[1\]: 'id' must be a string, not 7"),
    "long id": (lambda d: node(d, 2).update(id="x" * 129),
                r": nodes\[2\]: 'id' is 129 characters long; at most 128 are allowed"),
    "control character in id": (lambda d: node(d, 0).update(id="coord\x07inator"),
                                r": nodes\[0\]: 'id' contains the control character U\+0007"),
    "C1 control character in id": (lambda d: node(d, 0).update(id="a\x85b"),
                                   r"'id' contains the control character U\+0085"),
    "control character in name": (lambda d: d["cluster"].update(name="lab\t2"),
                                  r": 'cluster.name' contains the control character U\+0009"),
    "long name": (lambda d: d["cluster"].update(name="n" * 129),
                  r"'cluster.name' is 129 characters long"),
    "empty name": (lambda d: d["cluster"].update(name=""), r"'cluster.name' must not be empty"),
    # addresses
    "duplicate address": (lambda d: node(d, 2).update(address="127.0.0.2:19100"),
                          r"node 'stage-0' and node 'stage-1' have the same address "
                          r"\(127\.0\.0\.2:19100\)"),
    "duplicate address, IPv4-mapped": (
        lambda d: node(d, 2).update(address="[::ffff:127.0.0.2]:19100"),
        r"node 'stage-0' and node 'stage-1' have the same address \(127\.0\.0\.2:19100 and "
        r"\[::ffff:127\.0\.0\.2\]:19100 are the same\)"),
    "duplicate address, IPv6 spellings": (
        lambda d: (node(d, 1).update(address="[fd00::1]:7000"),
                   node(d, 2).update(address="[FD00:0:0:0:0:0:0:1]:7000")),
        r"have the same address \(\[fd00::1\]:7000 and \[FD00:0:0:0:0:0:0:1\]:7000 are"),
    "duplicate address, hostname case": (
        lambda d: (node(d, 1).update(address="Mini.local:7000"),
                   node(d, 2).update(address="mini.LOCAL.:7000")),
        r"node 'stage-0' and node 'stage-1' have the same address"),
    "missing address": (lambda d: node(d, 1).pop("address"),
                        r"node 'stage-0': 'address' is missing"),
    "address not a string": (lambda d: node(d, 1).update(address=19100),
                             r"node 'stage-0': 'address' must be a string, not 19100"),
    "address without port": (lambda d: node(d, 1).update(address="127.0.0.2"),
                             r"node 'stage-0': 'address' '127\.0\.0\.2' has no ':port'"),
    "bare IPv6": (lambda d: node(d, 1).update(address="fd00::1:19100"),
                  r"'address' 'fd00::1:19100' is not host:port \(write an IPv6 address in "
                  r"brackets"),
    "bracketed non-IPv6": (lambda d: node(d, 1).update(address="[nothex]:1"),
                           r"has '\[nothex\]' in brackets, which is not an IPv6 address"),
    "bad IPv4": (lambda d: node(d, 1).update(address="300.1.1.1:5"),
                 r"has host '300\.1\.1\.1', which is not an IPv4 address"),
    "bad hostname": (lambda d: node(d, 1).update(address="my host:5"),
                     r"has host 'my host', which is neither an IP address nor a hostname"),
    "hostname label with a leading hyphen": (lambda d: node(d, 1).update(address="-a.lan:5"),
                                             r"which is neither an IP address nor a hostname"),
    "no host": (lambda d: node(d, 1).update(address=":19100"), r"':19100' has no host"),
    "port 0": (lambda d: node(d, 1).update(address="127.0.0.2:0"),
               r"'address' '127\.0\.0\.2:0' has port 0, outside 1-65535"),
    "port too big": (lambda d: node(d, 1).update(address="127.0.0.2:65536"),
                     r"has port 65536, outside 1-65535"),
    "port not a number": (lambda d: node(d, 1).update(address="127.0.0.2:http"),
                          r"has port 'http', not a number"),
    "port empty": (lambda d: node(d, 1).update(address="127.0.0.2:"),
                   r"has port '', not a number"),
    "port with a leading zero": (lambda d: node(d, 1).update(address="127.0.0.2:019100"),
                                 r"has port '019100' with a leading zero"),
    "wildcard stage": (lambda d: node(d, 1).update(address="0.0.0.0:19100"),
                       r"node 'stage-0': 'address' '0\.0\.0\.0:19100' is a wildcard"),
    "identity too long": (lambda d: node(d, 1).update(address=("a" * 60 + ".") * 5 + "b:1"),
                          r"is longer than 255 bytes"),
    # roles
    "a 2D role in a pipeline's file": (
        lambda d: node(d, 1).update(role="pp_tp"),
        r"'cluster.tensor_parallel_size' is missing: the file has pipeline_tensor_parallel "
        r"nodes"),
    "a tensor-parallel rank in a pipeline": (
        lambda d: node(d, 1).update(role="tp"),
        r"'cluster.pipeline_parallel_size' is 2 in a file of tensor_parallel_rank nodes, "
        r"which are one group of the whole model"),
    "unknown role": (lambda d: node(d, 1).update(role="worker"),
                     r"node 'stage-0': 'role' 'worker' is not one of coordinator, "
                     r"pipeline_stage, router, hybrid, prefill, decode, tensor_parallel_rank, "
                     r"pipeline_tensor_parallel"),
    "missing role": (lambda d: node(d, 1).pop("role"), r"node 'stage-0': 'role' is missing"),
    "two coordinators": (
        lambda d: node(d, 2).update(role="coordinator", rank=None, layers=None) and None,
        r"2 nodes have role 'coordinator' \('coordinator', 'stage-1'\); a cluster has exactly "
        r"one"),
    "no coordinator": (lambda d: d["nodes"].pop(0), r": no node has role 'coordinator'"),
    "no stage": (lambda d: (d["nodes"].pop(), d["nodes"].pop()),
                 r": no node has role 'pipeline_stage'"),
    "coordinator with layers": (lambda d: node(d, 0).update(layers=[0, 1]),
                                r"node 'coordinator': a coordinator has no 'layers'"),
    "coordinator with rank": (lambda d: node(d, 0).update(rank=0),
                              r"node 'coordinator': a coordinator has no 'rank'"),
    # ranks and the pipeline size
    "stage without rank": (lambda d: node(d, 2).pop("rank"),
                           r"node 'stage-1': 'rank' is missing \(every pipeline_stage has one\)"),
    "stage without layers": (lambda d: node(d, 2).pop("layers"),
                             r"node 'stage-1': 'layers' is missing"),
    "bool rank": (lambda d: node(d, 1).update(rank=True),
                  r"node 'stage-0': 'rank' must be an integer, not true"),
    "string rank": (lambda d: node(d, 1).update(rank="0"),
                    r"node 'stage-0': 'rank' must be an integer, not '0'"),
    "negative rank": (lambda d: node(d, 1).update(rank=-1),
                      r"node 'stage-0': 'rank' must be at least 0, not -1"),
    "rank gap": (lambda d: node(d, 2).update(rank=2),
                 r": no stage has rank 1: the ranks of 2 stages are 0 to 1, not 0, 2"),
    "duplicate rank": (lambda d: node(d, 2).update(rank=0),
                       r"node 'stage-0' and node 'stage-1' both have rank 0"),
    "pipeline size mismatch": (
        lambda d: d["cluster"].update(pipeline_parallel_size=3),
        r": 'cluster.pipeline_parallel_size' is 3, but 2 node\(s\) have role 'pipeline_stage' "
        r"\('stage-0', 'stage-1'\)"),
    "pipeline size missing": (lambda d: d["cluster"].pop("pipeline_parallel_size"),
                              r"'cluster.pipeline_parallel_size' is missing"),
    "pipeline size 0": (lambda d: d["cluster"].update(pipeline_parallel_size=0),
                        r"'cluster.pipeline_parallel_size' must be at least 1, not 0"),
    "bool pipeline size": (lambda d: d["cluster"].update(pipeline_parallel_size=True),
                           r"'cluster.pipeline_parallel_size' must be an integer, not true"),
    # layers
    "gap between ranges": (
        lambda d: node(d, 2).update(layers=[16, 28]),
        r": layers 14\.\.15 are on no stage: node 'stage-0' \(rank 0, layers \[0, 14\]\) ends "
        r"at 14 and node 'stage-1' \(rank 1, layers \[16, 28\]\) starts at 16"),
    "one-layer gap": (lambda d: node(d, 2).update(layers=[15, 28]),
                      r": layer 14 is on no stage"),
    "rank 0 not at layer 0": (
        lambda d: node(d, 1).update(layers=[2, 14]),
        r": layers 0\.\.1 are on no stage: node 'stage-0' \(rank 0, layers \[2, 14\]\) is the "
        r"first stage and starts at 2"),
    "overlap": (
        lambda d: node(d, 2).update(layers=[12, 28]),
        r": layers 12\.\.13 are on both node 'stage-0' \(rank 0, layers \[0, 14\]\) and "
        r"node 'stage-1' \(rank 1, layers \[12, 28\]\)"),
    "overlap inside": (lambda d: node(d, 2).update(layers=[3, 5]),
                       r": layers 3\.\.4 are on both node 'stage-0'"),
    "empty layers": (lambda d: node(d, 2).update(layers=[14, 14]),
                     r"node 'stage-1': 'layers' \[14, 14\] holds no layer"),
    "reversed layers": (lambda d: node(d, 2).update(layers=[28, 14]),
                        r"node 'stage-1': 'layers' \[28, 14\] holds no layer"),
    "negative layers": (lambda d: node(d, 1).update(layers=[-1, 14]),
                        r"node 'stage-0': 'layers' \[-1, 14\] starts below 0"),
    "three layers": (lambda d: node(d, 1).update(layers=[0, 7, 14]),
                     r"'layers' must be \[start, end\] with two integers, not \[0, 7, 14\]"),
    "bool layers": (lambda d: node(d, 1).update(layers=[0, True]),
                    r"'layers' must be \[start, end\] with two integers, not \[0, True\]"),
    "layers not an array": (lambda d: node(d, 1).update(layers="0-14"),
                            r"'layers' must be \[start, end\] with two integers, not '0-14'"),
    # keys and tables
    "unknown cluster key": (lambda d: d["cluster"].update(data_parallel_size=1),
                            r": unknown key 'cluster.data_parallel_size'"),
    "unknown node key": (lambda d: node(d, 1).update(weight=2),
                         r"node 'stage-0': unknown key 'weight'"),
    "unknown key on a bad id": (lambda d: node(d, 1).update(id="", weight=2),
                                r": nodes\[1\]: unknown key 'weight'"),
    "unknown resources key": (lambda d: node(d, 1)["resources"].update(cpu_cores=8),
                              r"node 'stage-0': unknown key 'resources.cpu_cores'"),
    "unknown top-level key": (lambda d: d.update(extra=1), r": unknown key 'extra'"),
    "bool memory": (lambda d: node(d, 1)["resources"].update(memory_bytes=True),
                    r"node 'stage-0': 'resources.memory_bytes' must be an integer, not true"),
    "zero memory": (lambda d: node(d, 1)["resources"].update(memory_bytes=0),
                    r"'resources.memory_bytes' must be at least 1, not 0"),
    "resources not a table": (lambda d: node(d, 2).update(resources=[1]),
                              r"node 'stage-1': 'resources' must be a table"),
    "no cluster table": (lambda d: d.pop("cluster"), r": there is no \[cluster\] table"),
    "no nodes": (lambda d: d.pop("nodes"), r": there are no \[\[nodes\]\]"),
    "nodes not tables": (lambda d: d.update(nodes=[1, 2]), r": 'nodes' must be an array of tables"),
    "empty secret_file": (lambda d: d["cluster"].update(secret_file=""),
                          r"'cluster.secret_file' must be a non-empty path, not ''"),
    "model not a string": (lambda d: d["cluster"].update(model=3),
                           r"'cluster.model' must be a non-empty path or Hugging Face "
                           r"repo id, not 3"),
}


@pytest.mark.parametrize("case", CASES)
def test_refused(tmp_path: Path, case: str) -> None:
    change, pattern = CASES[case]
    data = copy.deepcopy(two_stages())
    change(data)
    for n in data.get("nodes", []):  # None marks a key to drop
        if isinstance(n, dict):
            for k in [k for k, v in n.items() if v is None]:
                del n[k]
    refused(tmp_path, data, pattern)


def test_unknown_key_hint_lists_the_known_keys(tmp_path: Path) -> None:
    data = two_stages()
    node(data, 1)["resources"]["cpu_cores"] = 8
    err = refused(tmp_path, data, "cpu_cores")
    assert err.hint == "known keys here: resources.memory_bytes, resources.compute_units"
    data = two_stages()
    data["cluster"]["size"] = 2
    err = refused(tmp_path, data, "cluster.size")
    assert err.hint == ("known keys here: cluster.name, cluster.pipeline_parallel_size, "
                        "cluster.replicas, "
                        "cluster.secret_file, cluster.model, cluster.kv_compression, "
                        "cluster.tensor_parallel_size, cluster.draft_model, "
                        "cluster.num_draft_tokens")


def test_a_pipeline_s_draft_is_read_written_and_checked(tmp_path: Path) -> None:
    data = two_stages()
    data["cluster"] |= {"draft_model": "models/q-0.6b", "num_draft_tokens": 6}
    (tmp_path / "models" / "q-0.6b").mkdir(parents=True)
    cfg = load_cluster(write(tmp_path, data))
    assert (cfg.draft_model, cfg.num_draft_tokens) == ("models/q-0.6b", 6)
    assert cfg.draft_source() == str(tmp_path / "models" / "q-0.6b")
    assert load_cluster(write(tmp_path, dump_cluster(cfg))) == cfg
    for bad, pattern in (({"num_draft_tokens": 33}, "'cluster.num_draft_tokens' is 33"),
                         ({"num_draft_tokens": 0}, "'cluster.num_draft_tokens' must be at "
                          "least 1"),
                         ({"draft_model": ""}, "'cluster.draft_model' must be a non-empty"),
                         ({"draft_model": None, "num_draft_tokens": 3},
                          "'cluster.num_draft_tokens' means nothing without")):
        data = two_stages()
        data["cluster"] |= {"draft_model": "d", **bad}
        if data["cluster"]["draft_model"] is None:
            del data["cluster"]["draft_model"]
        refused(tmp_path, data, pattern)


def test_boundaries_accepted(tmp_path: Path) -> None:
    data = two_stages()
    node(data, 1)["id"] = "x" * 128
    data["cluster"]["name"] = "ü" * 128
    node(data, 0)["address"] = "0.0.0.0:1"  # a coordinator may dial from a wildcard identity
    node(data, 2)["address"] = "[fe80::1%eth0]:65535"
    cfg = load_cluster(write(tmp_path, data))
    assert cfg.stages[1].host == "fe80::1%eth0" and cfg.stages[1].port == 65535


def test_file_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^cluster file {missing} does not exist"):
        load_cluster(missing)
    refused(tmp_path, "[cluster\n", r"is not valid TOML")
    path = tmp_path / "cluster.toml"
    path.write_bytes(b"[cluster]\nname = \"\xff\"\n")
    with pytest.raises(ConfigError, match=r"is not UTF-8"):
        load_cluster(path)


def test_the_man_page_documents_every_key() -> None:
    from mlxceld.cluster.clusterfile.fields import CLUSTER_KEYS, NODE_KEYS, RESOURCE_KEYS

    page = (Path(__file__).parents[2] / "man" / "mlxcel-cluster.toml.5").read_text()
    for key in (*CLUSTER_KEYS, *NODE_KEYS, *RESOURCE_KEYS):
        if key != "resources":
            assert re.search(rf"^\.BR? {key}\b", page, re.MULTILINE), key
    assert "[nodes.resources]" in page and "mlxceld model identity v1" in page
