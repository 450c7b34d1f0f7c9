"""The checks on a browsed mDNS service (records.check_service), one refusal at a time."""

from __future__ import annotations

import pytest

from mlxceld.discovery.records import check_service, instance_name
from mlxceld.wire import BeaconError, build_record

from helpers.keys import keyring

SECRET = b"a cluster secret of 32 bytes...."
NOW = 1_767_225_600


def txt(secret: bytes = SECRET, **changes: str) -> dict[bytes, bytes | None]:
    fields = {"version": "1", "package_version": "0.1.0", "cluster": "lab", "node": "host-b",
              "addr": "10.0.0.2:19000", "ts": NOW}
    fields.update(changes)
    record = build_record(secret, nonce=bytes(16), **fields)  # type: ignore[arg-type]
    return {k.encode(): v.encode() for k, v in record.items()}


def check(properties: dict[bytes, bytes | None], *, name: str = instance_name("host-b"),
          addresses: tuple[str, ...] = ("10.0.0.2",), port: int | None = 19000,
          now: float = NOW, cluster: str = "lab") -> tuple[dict[str, str], str]:
    return check_service(name, list(addresses), port, properties, keyring(SECRET), version="1",
                         package_version="0.1.0", cluster=cluster, now=now)


def test_a_good_service_gives_its_record_and_address() -> None:
    record, address = check(txt())
    assert record["node"] == "host-b" and address == "10.0.0.2:19000"
    record, address = check(txt(addr="[fd00::2]:19000"), addresses=("fd00:0::2%eth0",))
    assert address == "[fd00::2]:19000"


@pytest.mark.parametrize(("properties", "kwargs", "words"), [
    ({**txt(), b"mac": b"0" * 64}, {}, "MAC does not verify"),
    (txt(b"another secret of 32 bytes......"), {}, "key id this node does not hold"),
    ({**txt(), b"node": b"host-c"}, {}, "MAC does not verify"),
    (txt(version="2"), {}, "another protocol or package version"),
    (txt(package_version="0.2.0"), {}, "another protocol or package version"),
    (txt(), {"cluster": "prod"}, "another cluster"),
    (txt(), {"now": NOW + 61}, "stale"),
    (txt(ts=NOW + 61), {}, "stale"),
    (txt(), {"name": instance_name("host-c")}, "node other than its service instance"),
    (txt(), {"addresses": ("10.0.0.3",)}, "not an address the service resolved to"),
    (txt(), {"addresses": ()}, "not an address the service resolved to"),
    (txt(), {"port": 19001}, "not the service's SRV port"),
    (txt(addr="host-b.local:19000"), {}, "a hostname, not an IP address"),
    (txt(addr="10.0.0.2"), {}, "not host:port"),
    ({**txt(), b"x": None}, {}, "TXT key without a value"),
    ({**txt(), b"x": b"\xff"}, {}, "not UTF-8"),
    ({**txt(), b"x": b"1"}, {}, "exactly the MXCL v1 keys"),
])
def test_refusals(properties: dict[bytes, bytes | None], kwargs: dict[str, object],
                  words: str) -> None:
    with pytest.raises(BeaconError, match=words):
        check(properties, **kwargs)  # type: ignore[arg-type]
