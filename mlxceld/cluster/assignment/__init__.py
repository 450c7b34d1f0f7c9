"""The two-phase stage assignment on MXCL channel 2: the sans-IO rounds of each side
(``coordinator_round``, ``peer_round``: transition tables), offers and how a peer
judges one (``offers``), the messages and the coordinator's push (``push``), the
peer's asyncio shell (``peer``) over its daemon's stage worker (``stagehost``), and
ending a plan (``deactivation``)."""
