"""mDNS discovery with python-zeroconf: announce our signed record, browse the others'.

``MdnsDiscovery.run`` (one task, ended by cancellation):

- opens an ``AsyncZeroconf`` on the interface of the agent's host: an agent on
  a loopback address (127.0.0.0/8) uses ``interfaces=["127.0.0.1"]`` (loopback
  needs to be named; zeroconf's default skips it), an agent on a specific IP
  that IP, an agent on every interface (``0.0.0.0``) every IPv4 interface;
- browses ``_mlxcel._tcp.local.``: every Added/Updated service name is resolved
  (``AsyncServiceInfo.async_request``, ``RESOLVE_TIMEOUT_MS``) and checked
  (``records.check_service``); a record that passes is proposed to the
  candidate table, one that fails is ignored and its reason logged (once per
  service and reason);
- registers ``<node-id>._mlxcel._tcp.local.`` on the agent port with the signed
  TXT record (zeroconf probes the name first: about 2 s; ``REGISTER_TIMEOUT_S``
  bounds it), then re-announces a new record (new ``ts`` and ``nonce``) every
  ``ANNOUNCE_EVERY_S``: under the 20 s of ``REFRESH_S``, leaving room for timer
  drift. A name conflict (another daemon with our node id) or an interface
  zeroconf cannot use is reported in ``error`` and the log; browsing goes on
  where it can.

The advertised address: the agent's host when it is a specific IP; for an
agent on every interface, the first IPv4 address of ``[daemon] cluster_interface``
when it names one (the link peers should reach us on: a Thunderbolt bridge rather
than Wi-Fi; zeroconf then runs on that address only), else the IP the host would
use to reach the mDNS group (a UDP socket "connected" to 224.0.0.251, which sends
nothing), else 127.0.0.1. The interface is
looked at again at every announcement: one that has no IPv4 address yet (a bridge
whose cable is out) is reported in ``error`` while the default address is announced,
and its address is announced once it has one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Final

from zeroconf import Error as ZeroconfError
from zeroconf import InterfaceChoice, IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from mlxceld import __version__
from mlxceld.discovery.candidates import CandidateTable
from mlxceld.discovery.records import SERVICE_TYPE, check_service, host_name, instance_name
from mlxceld.net.resolve import resolve_blocking
from mlxceld.net.route import interface_ipv4, interfaces
from mlxceld.wire import BeaconError, Keyring, build_record
from mlxceld.wire.address import format_address, parse_address
from mlxceld.wire.beacon import REFRESH_S
from mlxceld.wire.hello import VERSION

log = logging.getLogger(__name__)

ANNOUNCE_EVERY_S: Final = REFRESH_S - 5.0
RESOLVE_TIMEOUT_MS: Final = 3000
REGISTER_TIMEOUT_S: Final = 15.0
MDNS_GROUP: Final = "224.0.0.251"


def advertised_ip(agent_host: str) -> str:
    ip = ipaddress.ip_address(agent_host)
    if not ip.is_unspecified:
        return str(ip)
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((MDNS_GROUP, 5353))
        return str(s.getsockname()[0])
    return "127.0.0.1"


def interfaces_for(agent_host: str) -> tuple[list[str] | InterfaceChoice, IPVersion]:
    ip = ipaddress.ip_address(agent_host)
    if ip.is_unspecified:
        return InterfaceChoice.All, IPVersion.V4Only
    if ip.is_loopback and ip.version == 4:
        return ["127.0.0.1"], IPVersion.V4Only
    return [str(ip)], IPVersion.V4Only if ip.version == 4 else IPVersion.V6Only


class MdnsDiscovery:
    def __init__(self, table: CandidateTable, keyring: Keyring, *, node_id: str, cluster: str,
                 agent_address: str, interface: str | None = None,
                 clock: Callable[[], float] = time.time,
                 random: Callable[[int], bytes] = os.urandom) -> None:
        agent = parse_address(agent_address, port_zero=True)
        ip = agent.ip
        if ip is None:  # an agent listening on a host name: the name's address
            ip = min(resolve_blocking(agent.host), key=lambda a: (a.version, int(a)))
        self._table = table
        self._keyring = keyring
        self._node_id = node_id
        self._cluster = cluster
        self._host = str(ip)
        self._port = agent.port
        self._interface = interface if ipaddress.ip_address(self._host).is_unspecified else None
        self._ip = advertised_ip(self._host)
        self._ip_problem: str | None = None
        self._choose_ip()
        self.error: str | None = self._ip_problem
        self._clock = clock
        self._random = random
        self._names: asyncio.Queue[str] = asyncio.Queue()
        self._ignored: dict[str, str] = {}  # service name -> the reason last logged

    @property
    def advertised(self) -> str:
        return format_address(self._ip, self._port)

    async def run(self) -> None:
        # On cluster_interface's address when it has one now: discovery on that link only.
        on = self._ip if self._interface and self._ip_problem is None else self._host
        interfaces, ip_version = interfaces_for(on)
        try:
            zc = AsyncZeroconf(interfaces=interfaces, ip_version=ip_version)
        except (OSError, ZeroconfError) as exc:
            self._fail(f"mDNS cannot start on {interfaces}: {exc}")
            return
        browser = AsyncServiceBrowser(zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._resolve_loop(zc))
                tg.create_task(self._announce_loop(zc))
        finally:
            await browser.async_cancel()
            await zc.async_close()

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            self._names.put_nowait(name)

    async def _resolve_loop(self, zc: AsyncZeroconf) -> None:
        while True:
            name = await self._names.get()
            if name == instance_name(self._node_id):
                continue
            info = AsyncServiceInfo(SERVICE_TYPE, name)
            if not await info.async_request(zc.zeroconf, RESOLVE_TIMEOUT_MS):
                log.debug("mDNS service %s did not resolve within %d ms", name,
                          RESOLVE_TIMEOUT_MS)
                continue
            try:
                record, address = check_service(
                    name, info.parsed_addresses(), info.port, info.properties, self._keyring,
                    version=str(VERSION), package_version=__version__, cluster=self._cluster,
                    now=self._clock())
            except BeaconError as exc:
                if self._ignored.get(name) != str(exc):
                    log.info("mDNS service %s ignored: %s", name[:100], exc)
                    self._ignored[name] = str(exc)
                continue
            self._ignored.pop(name, None)
            self._table.propose_record(record, address, self._clock())

    def _choose_ip(self) -> None:
        """The address to announce now: ``cluster_interface``'s IPv4 when it has one."""
        if self._interface is None:
            return
        table = interfaces()
        ip = interface_ipv4(self._interface, table)
        if ip is not None:
            if ip != self._ip:
                log.info("mDNS: announcing %s's address %s (daemon.cluster_interface)",
                         self._interface, ip)
            self._ip, self._ip_problem = ip, None
            return
        fallback = advertised_ip(self._host)
        having = sorted(n for n in table if interface_ipv4(n, table))
        problem = (f"daemon.cluster_interface {self._interface!r} has no IPv4 address now "
                   f"(interfaces with one: {', '.join(having) or 'none'}); announcing "
                   f"{fallback} until it has")
        if problem != self._ip_problem:
            log.warning("mDNS: %s", problem)
        self._ip, self._ip_problem = fallback, problem

    def _service(self) -> AsyncServiceInfo:
        self._choose_ip()
        record = build_record(self._keyring.primary, version=str(VERSION),
                              package_version=__version__, cluster=self._cluster,
                              node=self._node_id, addr=self.advertised,
                              ts=int(self._clock()), nonce=self._random(16))
        return AsyncServiceInfo(SERVICE_TYPE, instance_name(self._node_id), port=self._port,
                                properties=dict(record), server=host_name(self._node_id),
                                parsed_addresses=[self._ip])

    async def _announce_loop(self, zc: AsyncZeroconf) -> None:
        try:
            async with asyncio.timeout(REGISTER_TIMEOUT_S):
                await (await zc.async_register_service(self._service()))
        except (TimeoutError, ZeroconfError, ValueError) as exc:
            reason = "it did not finish in time" if isinstance(exc, TimeoutError) else (
                f"{type(exc).__name__} {exc}".strip())
            self._fail(f"mDNS registration of {instance_name(self._node_id)} failed: {reason}"
                       " (another daemon with this node id? a node id too long for a DNS "
                       "label?); browsing goes on")
            return
        self.error = self._ip_problem
        log.info("mDNS: announcing %s at %s", instance_name(self._node_id), self.advertised)
        while True:
            await asyncio.sleep(ANNOUNCE_EVERY_S)
            await (await zc.async_update_service(self._service()))
            self.error = self._ip_problem

    def _fail(self, message: str) -> None:
        self.error = message
        log.error("%s", message)
