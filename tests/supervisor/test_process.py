"""What a worker is handed: its spec, its bootstrap and its environment, never the secret twice."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mlxceld.roles.options import EchoOptions, RouterOptions, StageOptions
from mlxceld.supervisor.process import WorkerSpec, child_environment

SECRET = b"x" * 32
ECHO = EchoOptions(interval_s=0.5)


def test_describe_and_repr_do_not_carry_the_secret(tmp_path: Path) -> None:
    spec = WorkerSpec("w1", tmp_path, ECHO, secret=SECRET)
    described = json.dumps(spec.describe())
    for text in (described, repr(spec)):
        assert SECRET.decode() not in text
        assert SECRET.hex() not in text
        assert repr(SECRET) not in text
    assert spec.describe() == {"name": "w1", "role": "echo",
                               "options": {"interval_s": 0.5, "ready_after_s": 0.0,
                                           "crash_after_s": None, "exit_after_s": None,
                                           "exit_code": 0, "ignore_term": False,
                                           "freeze_after_s": None, "hog_mib": 0,
                                           "busy": False, "stall_after_s": None,
                                           "drain_s": 0.0, "teardown_s": 0.0},
                               "has_secret": True, "has_api_key": False, "group": None}


def test_the_api_key_travels_on_the_bootstrap_only(tmp_path: Path) -> None:
    key = "sk-test-0123456789"
    options = RouterOptions(model="/m", model_name="m", host="127.0.0.1", port=8080,
                            max_batch=1, max_queued=1)
    spec = WorkerSpec("router", tmp_path, options, api_key=key)
    assert key not in json.dumps(spec.describe()) and key not in repr(spec)
    assert spec.describe()["has_api_key"] is True
    assert spec.bootstrap()["api_key"] == key


def test_bootstrap_is_the_only_place_for_the_secret(tmp_path: Path) -> None:
    spec = WorkerSpec("w1", tmp_path, ECHO, secret=SECRET)
    boot = spec.bootstrap()
    assert bytes.fromhex(boot["secret_hex"]) == SECRET
    assert boot["control_socket"] == str(tmp_path / "workers" / "w1.sock")
    assert boot["exit_record"] == str(tmp_path / "workers" / "w1.exit")
    assert boot["state_dir"] == str(tmp_path)
    assert spec.log_path == tmp_path / "logs" / "w1.log"


def test_no_secret_no_secret_hex(tmp_path: Path) -> None:
    spec = WorkerSpec("w1", tmp_path, ECHO)
    assert "secret_hex" not in spec.bootstrap()
    assert spec.describe()["has_secret"] is False


def test_child_environment_drops_secrets_and_keeps_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCEL_CLUSTER_SECRET", "s3")
    monkeypatch.setenv("FOO_API_KEY", "k")
    monkeypatch.setenv("GITHUB_TOKEN", "t")
    monkeypatch.setenv("my_token_file", "t")
    monkeypatch.setenv("DB_PASSWORD", "p")
    monkeypatch.setenv("MLXCELD_HARMLESS", "yes")
    env = child_environment()
    for name in ("MLXCEL_CLUSTER_SECRET", "FOO_API_KEY", "GITHUB_TOKEN", "my_token_file",
                 "DB_PASSWORD"):
        assert name not in env
    assert env["PATH"] == os.environ["PATH"]
    assert env["MLXCELD_HARMLESS"] == "yes"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert "MLXCEL_CLUSTER_SECRET" in os.environ  # the daemon's own environment is untouched


def test_the_hugging_face_token_reaches_only_the_workers_that_download(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """In their bootstrap (stdin), as the cluster secret; never in any child's environment
    nor in what is stored of a spec."""
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("GITHUB_TOKEN", "t")
    env = child_environment()
    assert "HF_TOKEN" not in env and "GITHUB_TOKEN" not in env
    router = RouterOptions(model="org/m", model_name="m", host="127.0.0.1", port=8080,
                           max_batch=1, max_queued=1)
    stage = StageOptions(
        model="org/m", layers=(2, 4), node_id="stage-1", rank=1, address="127.0.0.1:1",
        coordinator="127.0.0.1:2", upstream="127.0.0.2:1", downstream=None,
        first="127.0.0.2:1", last=None, model_identity="0" * 64, cluster="test")
    for options, gets in ((stage, True), (router, True), (ECHO, False)):
        spec = WorkerSpec(options.role, tmp_path, options)
        assert (spec.bootstrap().get("hf_token") == "hf_secret") is gets
        assert "hf_secret" not in json.dumps(spec.describe()) + repr(spec)
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", "hf_old")
    assert WorkerSpec("stage", tmp_path, stage).bootstrap()["hf_token"] == "hf_old"
