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


def test_sockets_that_sent_their_hello_are_never_closed_for_a_newcomer() -> None:
    pool = PendingPool(max_total=3, max_per_source=2)
    talking = [entry("10.0.0.1", 0, hello=True), entry("10.0.0.1", 1, hello=True)]
    silent = entry("10.0.0.2", 0)
    for e in (*talking, silent):
        assert pool.admit(e).admitted
    got = pool.admit(entry("10.0.0.3", 0, hello=True))  # its hello comes as it connects
    assert got.evicted is silent  # the only silent one, though its source holds fewer
    refused = pool.admit(entry("10.0.0.4", 0))
    assert not refused.admitted and refused.evicted is None
    assert refused.refusal == "pending pool full (3), none of them silent"
    same = pool.admit(entry("10.0.0.1", 2))
    assert not same.admitted and "for source 10.0.0.1 (2)" in same.refusal
    assert len(pool) == 3
    pool.release(talking[0])
    assert pool.admit(entry("10.0.0.5", 0)).admitted
