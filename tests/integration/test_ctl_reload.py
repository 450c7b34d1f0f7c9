"""`mlxctl reload` against a real daemon: the config file re-read as SIGHUP re-reads it, what
changed said (text and --json), a broken file refused with the daemon's error while the old
config stays in effect."""

from __future__ import annotations

import json

from helpers.daemons import FAST_POLICY, Daemons

ONE_ECHO = FAST_POLICY + """
[daemon]
log_level = "info"

[workers.alpha]
role = "echo"
options = { interval_s = 0.2 }
"""


def test_reload_applies_the_file_and_says_what_changed(daemons: Daemons) -> None:
    d = daemons.make(ONE_ECHO).start()
    alpha = d.wait_worker("alpha", state="running")["pid"]
    daemons.note(d)
    assert d.status()["daemon"]["log_level"] == "info"

    same = d.ctl("reload")
    assert same.returncode == 0, same.stderr
    assert same.stdout.strip() == f"reloaded {d.config}: nothing changed"

    d.config.write_text(ONE_ECHO.replace('log_level = "info"', 'log_level = "debug"') + """
[workers.gamma]
role = "echo"
""")
    done = d.ctl("reload", "--json")
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["schema"] == "mlxctl.reload/1"
    assert body["config_file"] == str(d.config)
    assert {"key": "daemon.log_level", "old": "info", "new": "debug"} in body["changed"]
    assert {"key": "workers.gamma", "old": None, "new": "echo"} in body["changed"]
    assert body["at_next_start"] == []
    assert d.status()["daemon"]["log_level"] == "debug"
    d.wait_worker("gamma", state="running")
    daemons.note(d)
    assert d.worker("alpha")["pid"] == alpha  # never restarted by a reload
    reloaded = [e for e in d.events() if e["kind"] == "daemon.reloaded"]
    assert reloaded[-1]["data"]["trigger"] == "mlxctl reload"
    assert "daemon.log_level" in reloaded[-1]["message"]


def test_a_broken_file_is_refused_and_the_old_config_stays(daemons: Daemons) -> None:
    d = daemons.make(ONE_ECHO).start()
    d.wait_worker("alpha", state="running")
    daemons.note(d)
    d.config.write_text(ONE_ECHO.replace('log_level = "info"', 'log_level = "loud"'))
    bad = d.ctl("reload")
    assert bad.returncode == 1
    assert bad.stdout == ""
    assert f"mlxctl: {d.config}: log level 'loud' is not one of" in bad.stderr
    assert "hint: set --log-level or [daemon] log_level" in bad.stderr
    as_json = json.loads(d.ctl("reload", "--json").stdout)
    assert as_json["schema"] == "mlxctl.error/1" and as_json["error"]["code"] == "config"

    d.config.write_text("[daemon\n")
    broken = d.ctl("reload")
    assert broken.returncode == 1 and "is not valid TOML" in broken.stderr
    assert d.proc is not None and d.proc.poll() is None  # the daemon is still up ...
    status = d.status()
    assert status["daemon"]["log_level"] == "info"  # ... on the old config
    assert [w["name"] for w in status["workers"]] == ["alpha"]
    assert any(e["kind"] == "daemon.reload_failed" for e in d.events())
