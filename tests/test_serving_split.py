"""The serving window's tensor-parallel checks (``serving.ServingWindow``): a model the flags or
files name is refused at start, one `mlxctl serve` chose is only warned of there, and a
reload whose ``tp_size`` would not split what is served is refused."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlite_utils

from mlxceld.cluster.clusterfile.placement import Placement
from mlxceld.config.daemon import Config, Overrides
from mlxceld.config.serve import ServeConfig
from mlxceld.daemon.serving import ServingParts, ServingWindow
from mlxceld.errors import ConfigError
from mlxceld.models import model_config, preset
from mlxceld.state import EventLog, Settings
from mlxceld.supervisor.process import WorkerSpec


@dataclass
class Roster:
    """The roster's inputs that ``ServingWindow`` reads and sets."""

    placement: Placement | None = None
    serve: ServeConfig = field(default_factory=ServeConfig)

    @property
    def config(self) -> Config:
        raise AssertionError("not asked by these checks")

    async def reconcile(self) -> list[WorkerSpec]:
        raise AssertionError("not asked by these checks")


@dataclass
class Host:
    """The parts ``ServingWindow`` is handed (its ``ServingParts``), over a real state db."""

    settings: Settings
    events: EventLog
    placement: Placement | None = None

    def parts(self) -> ServingParts:
        return ServingParts(roster=Roster(self.placement),  # type: ignore[arg-type]
                            supervisor=None,  # type: ignore[arg-type]  # not asked
                            settings=self.settings, events=self.events, flags=Overrides())


@pytest.fixture
def llama(tmp_path: Path) -> Path:
    """The tiny llama's config.json alone (heads 4, KV heads 2)."""
    root = tmp_path / "llama"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(model_config(preset("tiny"), [1])))
    return root


def test_a_configured_model_is_refused_and_a_chosen_one_warned_of(
        db: sqlite_utils.Database, llama: Path) -> None:
    host = Host(Settings(db), EventLog(db))
    configured = ServeConfig(model=str(llama), tp_size=4)
    with pytest.raises(ConfigError, match="does not divide num_key_value_heads 2"):
        ServingWindow(host.parts(), configured).check_split(str(llama))
    host.settings.put("serve", {"model": str(llama), "model_name": None})
    chosen = ServingWindow(host.parts(), ServeConfig(tp_size=4))
    assert chosen.serve.model == str(llama)
    chosen.check_split(None)  # what mlxctl serve chose: warned of, the daemon starts
    (event,) = [e for e in host.events.since(0, 10) if e.kind == "serve.unsplittable"]
    assert "tp_size 4 does not divide num_key_value_heads 2" in event.message
    ServingWindow(host.parts(), ServeConfig(tp_size=2)).check_split(None)


def test_a_reload_that_would_not_split_what_is_served_is_refused(
        db: sqlite_utils.Database, llama: Path) -> None:
    host = Host(Settings(db), EventLog(db))
    host.settings.put("serve", {"model": str(llama), "model_name": None})
    serving = ServingWindow(host.parts(), ServeConfig())
    with pytest.raises(ConfigError, match=rf"the model {llama} \(with tp_size 4\)"):
        serving.check_reload(ServeConfig(tp_size=4))
    serving.check_reload(ServeConfig(tp_size=2))
    serving.check_reload(ServeConfig())
