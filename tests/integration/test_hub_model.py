"""A model named by its Hugging Face repo id over a 2-stage pipeline of real daemons, each
host with its own Hugging Face cache (HF_HUB_CACHE) read by huggingface_hub's own code
with HF_HUB_OFFLINE=1 (no network in tests): every cache holds the config, index and
tokenizer, a stage host's only its stage's shards, the coordinator's none. The pipeline
serves mlx-lm's greedy tokens through the real `openai` client; a stage host that lacks
one of its shards fails its stage naming the file and how to fetch it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mlxceld.models import preset, read_model_config, write_fixture
from mlxceld.models.shards import read_index, stage_files

from helpers.cluster import ACTIVATE_S, POLL_WAIT_S, agent, settled, start
from helpers.daemons import READY_S, Daemons
from helpers.deploy import Host
from helpers.hub import hub_cache, snapshot_dir
from helpers.models import expected
from helpers.pipeline import write_cluster
from helpers.ports import free_port
from helpers.router import client
from helpers.waiting import wait_for

REPO = "owner/tiny-llama"
LAYERS = 4
SPLITS = [(0, 2), (2, 4)]
PROMPT = "The quick brown fox"
TOKEN = "hf_test_token_never_in_an_environment"
SHAPED = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 17}},
    "required": ["n"], "additionalProperties": False}}}


@dataclass(frozen=True)
class Repo:
    """The repo's files (a local directory), its shards, and the shards of each split."""

    path: Path
    files: frozenset[str]
    needs: list[list[str]]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Repo:
    path = write_fixture(tmp_path_factory.mktemp("hubrepo") / "repo",
                         preset("tiny", family="llama", layers=LAYERS, shard_bytes=64 * 1024))
    index = read_index(path)
    assert index is not None
    needs = [sorted(stage_files(index, read_model_config(path), a, b, LAYERS))
             for a, b in SPLITS]
    return Repo(path, index.files, needs)


def check_serves(port: int, repo: Repo) -> None:
    """The router on ``port`` gives mlx-lm's greedy text of the repo's model, and, under a
    constraint, JSON that follows it: the engine that samples (a pipeline's last stage, or
    the one host) read the tokenizer from its snapshot."""
    with client(f"http://127.0.0.1:{port}/v1") as c:
        out = c.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12,
                                   temperature=0)
        shaped = c.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=100,
                                      temperature=0, extra_body={"response_format": SHAPED})
    assert out.choices[0].text == expected(repo.path, PROMPT, 12)
    assert shaped.choices[0].finish_reason == "stop", shaped.choices[0].text
    assert 3 <= json.loads(shaped.choices[0].text)["n"] <= 17


def test_a_repo_id_served_by_hosts_holding_only_their_shards(
        daemons: Daemons, repo: Repo) -> None:
    needs = repo.needs
    port = free_port("127.0.0.1")
    coord = Host(daemons, "co", secret=None, serve={"port": port})
    toml = write_cluster(coord.d.root, Path(REPO), SPLITS)  # model = "owner/tiny-llama"
    coord.daemon_keys.update(distributed_config=str(toml), node_id="coordinator")
    coord.write()
    hosts = [Host(daemons, f"s{rank}", secret=None,
                  daemon={"distributed_config": str(toml), "node_id": f"stage-{rank}"})
             for rank in range(len(SPLITS))]
    caches = [h.d.root / "hf" for h in [coord, *hosts]]
    hub_cache(caches[0], REPO, repo.path)  # the coordinator: config, index, tokenizer
    for cache, files in zip(caches[1:], needs, strict=True):
        held = hub_cache(cache, REPO, repo.path, files)
        assert 0 < len(list(held.glob("*.safetensors"))) < len(repo.files)

    def env(cache: Path) -> dict[str, str]:
        return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache),
                "HF_TOKEN": TOKEN}

    for h, cache in zip(hosts, caches[1:], strict=True):
        h.d.start_service(env=env(cache))
    coord.d.start_service(env=env(caches[0]))
    for h in hosts:
        stage = h.d.wait_worker("stage", timeout=READY_S, state="running")["pid"]
        daemons.pids.add(stage)
        # the token reaches the stage on its stdin, never in its environment
        assert TOKEN.encode() not in Path(f"/proc/{stage}/environ").read_bytes()
    daemons.pids.add(coord.d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    with client(f"http://127.0.0.1:{port}/v1") as c:
        assert [m.id for m in c.models.list().data] == ["tiny-llama"]  # the repo's name
    check_serves(port, repo)

    # A stage host that lacks one of its shards, offline: its stage fails, naming it.
    last = hosts[1]
    assert last.d.terminate() == 0, last.d.stderr()[-3000:]
    lost = needs[1][0]
    (snapshot_dir(caches[2], REPO) / lost).unlink()
    last.d.start_service(env=env(caches[2]))
    failed = last.d.wait_worker("stage", timeout=READY_S, state="failed")
    reason = failed["reason"]
    assert f"stage stage-1 failed to load layers [2, 4): stage layers [2, 4) of {REPO} " \
           f"need 1 file(s)" in reason, reason
    assert lost in reason and "HF_HUB_OFFLINE is set" in reason, reason
    for h in [coord, *hosts]:
        logs = [p.read_text(errors="replace") for p in (h.d.state_dir / "logs").glob("*.log")]
        assert logs and not any(TOKEN in text for text in logs)


def test_a_repo_id_not_in_the_cache_offline_is_refused_at_start(daemons: Daemons,
                                                                 tmp_path: Path) -> None:
    """The operator's flag names a repo the (offline) cache does not hold: exit 2, naming
    the repo and the command that fetches it, before anything starts; the token is not
    echoed."""
    d = daemons.make()
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "HF_TOKEN": "hf_do_not_show_me"}
    out = subprocess.run([sys.executable, "-m", "mlxceld", "--config", str(d.config),
                          "--state-dir", str(d.state_dir), "--socket", str(d.socket),
                          "--model", "owner/absent"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "model 'owner/absent' is not a local directory, and this host's Hugging Face " \
           "cache does not hold it" in out.stderr, out.stderr[-2000:]
    assert "hf download owner/absent" in out.stderr
    assert "hf_do_not_show_me" not in out.stderr


def test_a_repo_id_activated_over_peers_holding_only_their_shards(
        daemons: Daemons, repo: Repo, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The zero-config way: peers started with `--pp-peer --model owner/name`, the plan
    made and pushed by `mlxctl cluster activate --model owner/name` on the coordinator
    (whose cache holds the whole repo: it prices every layer), each peer's cache only the
    shards of the layers it is given (the 2 peers have the same memory: an even split,
    ranked by address)."""
    needs = repo.needs
    secret = b"6d" * 16
    roots = [tmp_path_factory.mktemp(f"hf{i}") for i in range(3)]
    hub_cache(roots[0], REPO, repo.path, repo.files)  # the coordinator: everything
    for cache, files in zip(roots[1:], needs, strict=True):
        hub_cache(cache, REPO, repo.path, files)

    def env(cache: Path) -> dict[str, str]:
        return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache)}

    peers = [start(daemons, f"127.0.0.{i + 2}", secret, "--pp-peer", "--model", REPO,
                   name=f"p{i}", env=env(roots[i + 1])) for i in range(2)]
    port = free_port("127.0.0.1")
    coord = start(daemons, "127.0.0.1", secret, "--cluster-peers",
                  ",".join(agent(p) for p in peers), "--port", str(port), name="c",
                  env=env(roots[0]))
    want = {agent(p): "reachable" for p in peers}
    wait_for(lambda: settled(coord, want), POLL_WAIT_S, f"peers {want}", every=0.2)
    plan = coord.ctl("cluster", "plan", "--model", REPO, "--stages", "2", "--json",
                     timeout=60)
    assert plan.returncode == 0, plan.stderr
    assert [tuple(s["layers"]) for s in json.loads(plan.stdout)["plan"]["stages"]] == SPLITS
    out = coord.ctl("cluster", "activate", "--model", REPO, "--stages", "2",
                    timeout=ACTIVATE_S)
    assert out.returncode == 0, (out.stdout, out.stderr, coord.stderr()[-3000:])
    for p in peers:
        daemons.pids.add(p.wait_worker("stage", timeout=READY_S, state="running")["pid"])
    daemons.pids.add(coord.wait_worker("router", timeout=READY_S, state="running")["pid"])
    with client(f"http://127.0.0.1:{port}/v1") as c:
        done = c.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=12,
                                    temperature=0)
    assert done.choices[0].text == expected(repo.path, PROMPT, 12)


def test_a_repo_id_served_whole_on_one_host(daemons: Daemons, repo: Repo,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """`mlxceld --model owner/name` on one host: the router takes the weights from the
    Hugging Face cache (fetching what it lacks; offline here, so it holds them all) and
    serves mlx-lm's greedy text; a cache lacking a shard, offline, fails the router at
    once naming the file (not restarted: a restart cannot fetch it either)."""
    cache = tmp_path_factory.mktemp("hf")
    snap = hub_cache(cache, REPO, repo.path, repo.files)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HOME": str(cache)}
    port = free_port("127.0.0.1")
    d = daemons.make(name="one")
    d.start("--model", REPO, "--port", str(port), env=env)
    daemons.pids.add(d.wait_worker("router", timeout=READY_S, state="running")["pid"])
    check_serves(port, repo)

    assert d.ctl("stop").returncode == 0 and d.proc is not None and d.proc.wait(30) == 0
    lost = sorted(repo.files)[-1]
    (snap / lost).unlink()
    d.start("--model", REPO, "--port", str(port), env=env)
    failed = d.wait_worker("router", timeout=READY_S, state="failed")
    assert f"model {REPO} needs 1 file(s)" in failed["reason"], failed
    assert lost in failed["reason"] and failed["restarts"] == 0, failed
