"""Where the daemon serves Prometheus text, and who may read ``/metrics``.

``[daemon] metrics_listen`` (off unless set)::

    [daemon]
    metrics_listen = "0.0.0.0:9464"    # host:port, [v6]:port or a host name's; off if unset

Set, the daemon serves ``GET /metrics`` there (``observe/``): its own metrics (its
workers, its peers' liveness, the plan, drains, the secret's rotation) and those of
every worker but the router (a pipeline stage, a prefill or decode node, a tensor
rank), which serves its own on the OpenAI port. Off by default: a daemon opens no
TCP port it was not asked for, and several daemons share one host in tests and demos.
9464 is the port OpenTelemetry's Prometheus exporters use; 0.0.0.0 lets a Prometheus
on another host scrape it, as the guide's default for what people reach. A host name
binds the first address it resolves to (``localhost``: 127.0.0.1).

``[serve] metrics_require_key`` (default true): with an API key (``[serve]
api_key_file``), ``/metrics`` needs it, on the router's OpenAI port and on
``metrics_listen`` alike; false opens both to anyone who reaches them (Prometheus
scrapers often hold no key: then bind ``metrics_listen`` to a private address).
Without an API key ``/metrics`` is open either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.wire.address import HostPort, parse_address

LISTEN_KEY: Final = "metrics_listen"
REQUIRE_KEY: Final = "metrics_require_key"
EXAMPLE: Final = "0.0.0.0:9464"


def metrics_listen(daemon: Mapping[str, Any], where: str) -> HostPort | None:
    """``[daemon] metrics_listen``: the address to serve ``/metrics`` on; None: off (unset,
    or the empty string). Port 0 lets the system choose (tests read it in the log)."""
    value = daemon.get(LISTEN_KEY)
    if value is None or value == "":
        return None
    what = f"{where}: 'daemon.{LISTEN_KEY}'"
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be a string host:port, not {value!r}",
                          hint=f'for example {LISTEN_KEY} = "{EXAMPLE}"; "" or no key: off')
    try:
        return parse_address(value, port_zero=True)
    except ValueError as exc:
        raise ConfigError(f"{what}: {value!r} {exc}",
                          hint=f'for example {LISTEN_KEY} = "{EXAMPLE}", or "[::]:9464" for '
                          "IPv6") from None


def metrics_require_key(serve: Mapping[str, Any], where: str) -> bool:
    """``[serve] metrics_require_key``: whether ``/metrics`` needs the API key (when there
    is one); true unless set false."""
    value = serve.get(REQUIRE_KEY, True)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: 'serve.{REQUIRE_KEY}' must be true or false, not "
                          f"{value!r}", hint=f"write it as {REQUIRE_KEY} = false to let "
                          "scrapers without the API key read /metrics")
    return value
