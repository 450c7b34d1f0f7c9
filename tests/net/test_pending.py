"""The pending pool's decisions, without sockets: who is admitted, who is closed to make room.

A socket that has sent its ClientHello is a real server ``Connection`` fed a real hello.
"""

from __future__ import annotations

import os

from mlxceld.net.pending import Pending, PendingPool
from mlxceld.wire import Channel, Connection, ConnectionRole

from helpers.keys import keyring
from helpers.mxcl import SECRET


def entry(source: str, n: int, *, hello: bool = False) -> Pending:
    """A pending socket from ``source`` (its ``n``th); ``hello``: its ClientHello arrived."""
    e = Pending(source, f"{source}:{40000 + n}", writer=None)  # type: ignore[arg-type]
    if hello:
        client = Connection(ConnectionRole.CLIENT, keyring=keyring(SECRET), random=os.urandom,
                            now=0.0,
                            channel=Channel.TRANSPORT, identity=f"{source}:19100")
        e.conn = Connection(ConnectionRole.SERVER, keyring=keyring(SECRET), random=os.urandom,
                            now=0.0,
                            peer_ip=source, hello_timeout=1.0)
        e.conn.receive_data(client.data_to_send(), 0.0)
        assert not e.conn.awaiting_hello
    return e


def test_a_full_pool_closes_the_busiest_sources_oldest_silent_socket() -> None:
    pool = PendingPool(max_total=6, max_per_source=3)
    a = [entry("10.0.0.1", i) for i in range(3)]
    b = [entry("10.0.0.2", i) for i in range(2)]
    c = entry("10.0.0.3", 0)
    for e in (a[0], b[0], a[1], c, b[1], a[2]):
        assert pool.admit(e).admitted
    assert len(pool) == 6
    keyed = entry("10.0.0.9", 0)
    got = pool.admit(keyed)
    assert got.admitted and got.evicted is a[0]  # 10.0.0.1 holds the most: its oldest goes
    assert (len(pool), pool.count("10.0.0.1"), pool.count("10.0.0.9")) == (6, 2, 1)
    got = pool.admit(entry("10.0.0.4", 0))
    assert got.evicted is b[0]  # a tie (2 and 2): the older socket of the two sources
    pool.release(b[0])  # evicted already: releasing again changes nothing
    assert len(pool) == 6 and pool.count("10.0.0.2") == 1


def test_a_source_at_its_bound_gives_up_its_own_oldest_silent_socket() -> None:
    pool = PendingPool(max_total=64, max_per_source=2)
    first, second = entry("10.0.0.1", 0), entry("10.0.0.1", 1)
    assert pool.admit(first).admitted and pool.admit(second).admitted
    got = pool.admit(entry("10.0.0.1", 2))
    assert got.admitted and got.evicted is first
    assert pool.count("10.0.0.1") == 2 and len(pool) == 2


def test_a_source_at_its_bound_with_only_stalled_hellos_gives_up_its_oldest() -> None:
    pool = PendingPool(max_total=64, max_per_source=3)
    stalled = [entry("10.0.0.1", i, hello=True) for i in range(3)]
    peer = entry("10.0.0.9", 0, hello=True)
    for e in (stalled[0], peer, stalled[1], stalled[2]):
        assert pool.admit(e).admitted
    got = pool.admit(entry("10.0.0.1", 3, hello=True))
    assert got.admitted and got.evicted is stalled[0]  # its own, though it sent a hello
    silent = entry("10.0.0.1", 4)
    assert pool.admit(silent).evicted is stalled[1]
    got = pool.admit(entry("10.0.0.1", 5, hello=True))
    assert got.evicted is silent  # silent before stalled, within the source
    assert pool.count("10.0.0.1") == 3 and pool.count("10.0.0.9") == 1 and len(pool) == 4


def test_a_pool_full_of_stalled_hellos_closes_the_busiest_sources_oldest() -> None:
    pool = PendingPool(max_total=6, max_per_source=3)
    a = [entry("10.0.0.1", i, hello=True) for i in range(3)]
    b = [entry("10.0.0.2", i, hello=True) for i in range(2)]
    peer = entry("10.0.0.9", 0, hello=True)  # the oldest socket, mid-handshake
    for e in (peer, b[0], a[0], a[1], b[1], a[2]):
        assert pool.admit(e).admitted
    got = pool.admit(entry("10.0.0.3", 0, hello=True))
    assert got.admitted and got.evicted is a[0]  # 10.0.0.1 holds the most
    got = pool.admit(entry("10.0.0.2", 2, hello=True))  # a flooder refilling: 2 + 1 < 3
    assert got.evicted is b[0]  # a tie (2 and 2): the source holding the older socket
    for n in range(3):  # more refills: each falls on a source holding 2, never on the peer
        got = pool.admit(entry("10.0.0.4", n, hello=True))
        assert got.admitted and got.evicted is not peer
    assert pool.count("10.0.0.9") == 1 and len(pool) == 6


def test_within_the_busiest_source_a_silent_socket_goes_before_a_stalled_hello() -> None:
    pool = PendingPool(max_total=4, max_per_source=4)
    stalled, silent = entry("10.0.0.1", 0, hello=True), entry("10.0.0.1", 1)
    lone_silent = entry("10.0.0.2", 0)
    for e in (stalled, silent, lone_silent, entry("10.0.0.1", 2, hello=True)):
        assert pool.admit(e).admitted
    got = pool.admit(entry("10.0.0.3", 0))
    assert got.evicted is silent  # the busiest source's silent one, not the lone source's


def test_a_newcomers_own_lone_socket_is_never_closed_for_it() -> None:
    pool = PendingPool(max_total=2, max_per_source=8)
    first, other = entry("10.0.0.1", 0, hello=True), entry("10.0.0.2", 0, hello=True)
    assert pool.admit(first).admitted and pool.admit(other).admitted
    got = pool.admit(entry("10.0.0.1", 1, hello=True))  # a peer's second dial
    assert got.admitted and got.evicted is other  # not its first, though that is older
    assert pool.count("10.0.0.1") == 2
    tight = PendingPool(max_total=64, max_per_source=1)
    lone = entry("10.0.0.1", 0)
    assert tight.admit(lone).admitted
    refused = tight.admit(entry("10.0.0.1", 1))
    assert not refused.admitted and refused.evicted is None
    assert refused.refusal == "pending pool full for source 10.0.0.1 (1)"
    assert tight.count("10.0.0.1") == 1
    solo = PendingPool(max_total=1, max_per_source=8)
    assert solo.admit(entry("10.0.0.1", 0)).admitted
    refused = solo.admit(entry("10.0.0.1", 1))
    assert not refused.admitted and refused.refusal == "pending pool full (1)"
