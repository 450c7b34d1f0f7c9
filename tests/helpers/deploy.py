"""Daemons started the way users deploy them, for the bring-up, pipeline and service tests.

What a test gets here is what a user gets from `brew services`, launchd or systemd:
``mlxceld --config FILE`` and no other flag; the file keeps the defaults except
what a user must change when several "hosts" share this machine (the agent's
port, the router's port, the state dir and socket); the agent listens on the
default wildcard host (``0.0.0.0``); peers are named by host name
(``localhost``) or by the address another host reaches them on; the cluster
secret file is named in the config file (``cluster_secret_file``), never in
argv; a restart is SIGTERM and the same start again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from helpers.daemons import FAST_POLICY, DaemonProc, Daemons
from helpers.keys import secret_file
from helpers.ports import free_port

Value = str | int | float | bool | Sequence[str]
DEFAULT_AGENT_PORT = 19000


def toml_value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return "[" + ", ".join(toml_value(v) for v in value) + "]"


def table(name: str, keys: Mapping[str, Value]) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in keys.items())


class Host:
    """One daemon as one host of a deployment: its config file and its agent port."""

    def __init__(self, daemons: Daemons, name: str, *, secret: bytes | None,
                 daemon: Mapping[str, Value] | None = None,
                 serve: Mapping[str, Value] | None = None, netns: str | None = None) -> None:
        """``netns``: run in that Linux network namespace, a host of its own, where the
        agent keeps its default address too (0.0.0.0:19000)."""
        self.d: DaemonProc = daemons.make(FAST_POLICY, name=name)
        self.netns = netns
        self.agent_port = DEFAULT_AGENT_PORT if netns else free_port()
        self.daemon_keys: dict[str, Value] = {
            "state_dir": str(self.d.state_dir), "socket": str(self.d.socket),
            **({} if netns else {"agent_addr": f"0.0.0.0:{self.agent_port}"})}
        if secret is not None:
            self.daemon_keys["cluster_secret_file"] = str(secret_file(self.d.root, secret))
        self.daemon_keys.update(daemon or {})
        self.serve_keys: dict[str, Value] = dict(serve or {})
        self.write()

    def write(self) -> None:
        text = FAST_POLICY + "\n" + table("daemon", self.daemon_keys)
        if self.serve_keys:
            text += "\n" + table("serve", self.serve_keys)
        self.d.config.write_text(text)

    def address(self, host: str = "localhost") -> str:
        """How another host names this one's agent."""
        return f"{host}:{self.agent_port}"

    def start(self) -> Host:
        prefix = ("ip", "netns", "exec", self.netns) if self.netns else ()
        self.d.start_service(prefix=prefix)
        return self

    def restart(self) -> Host:
        """SIGTERM and the same start again (a service manager's restart)."""
        assert self.d.terminate() == 0, self.d.stderr()[-3000:]
        return self.start()
