"""The asyncio shell around the MXCL v1 sans-IO core in ``mlxceld.wire``.

``Listener`` accepts and authenticates, ``connect`` dials with backoff,
``Redialer`` keeps one outgoing stream up (dialed on first use and again once it
broke); ``MxclStream`` is one established connection (``retire_streams`` ends those
made under a key the keyring no longer holds, ``streams_under`` counts those under
one key id, ``MxclStream.finish`` closes one without losing what is in flight, for a
handover to a stream under the new primary); ``SecurityLog`` rate-limits
the warnings they raise.
"""

from mlxceld.net.dialer import connect, connect_as
from mlxceld.net.errors import ConnectionClosed, HandshakeFailed, NetError
from mlxceld.net.listener import Listener, source_bucket
from mlxceld.net.redialer import Redialer
from mlxceld.net.securitylog import SecurityClass, SecurityLog, Verdict
from mlxceld.net.stream import MxclStream, retire_streams, streams_under

__all__ = [
    "ConnectionClosed", "HandshakeFailed", "Listener", "MxclStream", "NetError", "Redialer",
    "SecurityClass", "SecurityLog", "Verdict", "connect", "connect_as", "retire_streams",
    "source_bucket", "streams_under",
]
