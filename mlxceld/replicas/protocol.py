"""The replica protocol: MXCL messages on channel 1 between a router and a serving node.

A serving node (a hybrid: its own OpenAI port and model, ``service.py``) serves its
engine to the routers of its cluster on a listener of its own, the *serving
listener*. A router (``remote.py``: ``RemoteEngine``) dials it as the identity of its
own agent listener (``connect_as``), attaches, and sends its sequences over that one
connection; the node answers on that same connection. The cluster secret is the
gate: any member of the cluster may dial and attach.

Messages (the envelope of PROTOCOL.md section 4; ``seq`` is 1 to 64 characters of
``[A-Za-z0-9_.-]``, the router's name for the sequence, unique on its connection):

========== ================ ===================================================
type       direction        fields, tensors, answer
========== ================ ===================================================
attach     router → node    ``model`` (identity hex), ``cluster``; answered by
                            ``attached`` {``node``, ``role``, ``model``,
                            ``context_length``, ``max_batch``} or ``error``
                            code ``model_mismatch`` / ``cluster_mismatch``
                            (then the node closes the connection)
generate   router → node    ``seq``, ``params`` (``pipeline/protocol.py``'s
                            ``params_to_wire``: the sampling parameters, and
                            ``constraint`` {kind, text} when the output must
                            match one); tensor ``prompt`` i32 ``[1, n]``,
                            1 ≤ n ≤ ``MAX_PROMPT_TOKENS`` and at most the
                            node's ``context_length``; answered by a stream
                            of ``token`` and at most one ``error`` for the
                            ``seq``
token      node → router    ``seq``; tensor ``tokens`` i32 ``[1]``; with
                            ``params.logprobs``: ``logprob`` and ``top``
                            [[id, logprob], ...] as the pipeline's ``token``;
                            ``finish_reason`` ("stop" / "length") on the
                            sequence's last one; ``cached`` (an int, 0 to
                            ``MAX_PROMPT_TOKENS``) on its first where the
                            node's engine says how many prompt tokens its
                            prompt cache gave (usage's ``cached_tokens``)
cancel     router → node    ``seq``: the node stops the sequence and frees it;
                            no answer (an unknown ``seq`` is ignored)
load       node → router    ``sequences`` (all its engine runs: its own OpenAI
                            clients' and every router's), ``max_batch``; sent
                            once attached, then every ``LOAD_EVERY_S`` while it
                            changed; no answer
adopt      router → node    ``seq``, sent over another connection of the
                            same identity as the one the sequence was sent
                            over (a handover to a new key): the node answers
                            ``adopted`` {``seq``} over the connection the
                            sequence used so far, after all it sent there,
                            and sends it everything from then on over this
                            one (the sequence belongs to this connection
                            now: its ``cancel`` comes here, and it ends with
                            this connection, not the old one); an unknown
                            ``seq``, or one already on this connection, is
                            ignored
error      node → router    ``code``, ``message``, and ``seq`` when it concerns
                            one (it ends that sequence)
========== ================ ===================================================

Error codes: ``busy`` (the node holds its bound of sequences: the router tries
another node), ``unavailable`` (a part of the node's engine is down, e.g. a stage
of its own pipeline), ``bad_request`` (the request cannot be served as asked, e.g.
a constraint the node cannot use, a prompt over its context: the client's, HTTP
400), ``draining`` (the node is stopping: no new sequence), ``internal`` (the
node's engine failed), ``bad_message`` (not this protocol; the sequence, if named,
is not started), ``model_mismatch`` and ``cluster_mismatch`` (answers to
``attach``).

Bounds: ``MAX_PROMPT_TOKENS`` per prompt (and the node's context length);
``MAX_SEQUENCES`` sequences in flight per connection (the service's
``max_sequences`` may lower it), beyond that ``busy`` (a sequence adopted from another
connection counts on the one that adopted it, and is never refused for it). Every
tensor's dtype and shape is checked against these specs before any blob is copied.

Authorization (the identity is the handshake's, never a field): any identity that
completed the handshake under the cluster secret may attach. A sequence belongs to
the connection that sent its ``generate`` until another connection of the same identity
adopts it (``adopt``): its ``token``s and its ``error`` go over the connection it
belongs to only, a ``cancel`` for it from any other connection is ignored, and the node
forgets it (cancelled in its engine) when that connection ends. An ``adopt`` from
another identity changes nothing.

The messages are typed: ``attach``, ``token`` and ``error`` are the words this protocol
shares with the stages' (``wire/transport_messages.py``), ``adopt`` and ``adopted`` the
stages' own (``pipeline/messages.py``), the others are ``messages.py``'s.

The result-frame rule, on the router's side: a node's ``token`` frames are read only
from the connections the router dialed to that node, and each is delivered only to a
sequence that was sent over that same connection, or that the router moved there
(``adopt``, once the node said ``adopted`` over the old one; what the new connection
brings for it before that is held back, so its tokens stay in order). So a sequence's
tokens can only come from the node it was sent to; a ``token`` for a ``seq`` not in
flight on that connection is dropped.

Prefill/decode disaggregation (``handoffs.py``: the nodes' side; ``disagg.py``: the
router's ``DisaggEngine``). A prefill node runs prompts and hands their KV cache to a
decode node, which decodes on and streams the tokens to the router:

========== ================ ===================================================
type       direction        fields, tensors, answer
========== ================ ===================================================
expect     router → decode  ``seq``, ``params``, ``prefill`` (the prefill node's
                            serving address: the identity its ``handoff`` must
                            come from); tensor ``prompt`` as ``generate``'s; the
                            decode node waits ``HANDOFF_TIMEOUT_S`` for the
                            handoff, then answers as for ``generate`` (``token``s
                            and at most one ``error``) on this connection
prefill    router → prefill ``seq``, ``params``, ``decode_target`` (the decode
                            node's serving address, from the router's registry),
                            ``compression`` (``engine/handoff.py``'s ``Mode``:
                            "none", "int8", "int4", each with "+lz4"); tensor
                            ``prompt``; answered by ``prefilled`` {``seq``,
                            ``bytes``, ``encode_ms``, ``send_ms``} once the
                            cache is sent, or ``error``
handoff    prefill → decode ``seq``, ``part``, ``parts`` (the cache's layers in
                            ``parts`` frames, each under ``HANDOFF_FRAME_BYTES``);
                            part 0 also ``first`` {``token``, ``logprob``,
                            ``top``, ``finish_reason``, and ``cached``: the
                            prompt tokens the prefill node's prompt cache
                            gave, when it says} and ``cache`` (the
                            header of ``encode_cache``); tensors: the cache's
                            blobs (``u8``), never JSON numbers; no answer
========== ================ ===================================================

Error codes of disaggregation: ``unsupported`` (this model's cache cannot be handed
off, ``check_handoff``: the router answers HTTP 500 naming the family: serve it on
hybrid nodes), ``forbidden`` (``decode_target`` is outside the prefill node's
``MLXCEL_DECODE_ALLOWLIST``: nothing was prefilled or sent), ``bad_handoff`` (the
decode node read a cache that does not fit its model, or none came within
``HANDOFF_TIMEOUT_S``: to the router, for the expected ``seq``).

Trust: a prefill node dials the decode node as its own serving address (``connect_as``:
the identity is the handshake's); the decode node takes a ``handoff`` only from an
identity among its configured prefill peers that is the ``prefill`` of a pending
``expect`` for that ``seq``; anything else is dropped with a rate-limited warning
(``net/securitylog.py``, class ``router_drop``) and changes nothing. The result-frame
rule above stays: the router reads tokens only from the connection it dialed to the
decode node, never from the prefill node's.
"""

from __future__ import annotations

from typing import Final

from mlxceld.pipeline.protocol import ProtocolViolation
from mlxceld.wire import MessageSpec, TensorSpec

MAX_PROMPT_TOKENS: Final = 1 << 20  # tokens one ``generate`` may carry (and the context)
MAX_SEQUENCES: Final = 256  # sequences in flight on one connection
LOAD_EVERY_S: Final = 1.0  # how often a node says its load (when it changed)
HANDOFF_TIMEOUT_S: Final = 330.0  # an ``expect`` waits this long for its ``handoff`` (past
# the router's own bound on a prefill, ``disagg.PREFILL_TIMEOUT_S``: the router ends it first)
HANDOFF_FRAME_BYTES: Final = 64 << 20  # a ``handoff`` frame's blobs, at most (MXCL: 256 MiB)

ERR_BUSY: Final = "busy"
ERR_UNAVAILABLE: Final = "unavailable"
ERR_BAD_REQUEST: Final = "bad_request"
ERR_DRAINING: Final = "draining"
ERR_INTERNAL: Final = "internal"
ERR_BAD_MESSAGE: Final = "bad_message"
ERR_MODEL_MISMATCH: Final = "model_mismatch"
ERR_CLUSTER_MISMATCH: Final = "cluster_mismatch"
ERR_UNSUPPORTED: Final = "unsupported"
ERR_FORBIDDEN: Final = "forbidden"
ERR_BAD_HANDOFF: Final = "bad_handoff"


# What a node accepts from a router.
NODE_SPECS: Final = {
    "attach": MessageSpec(),
    "generate": MessageSpec({"prompt": TensorSpec(frozenset({"i32"}),
                                                  ((1, 1), (1, MAX_PROMPT_TOKENS)))}),
    "cancel": MessageSpec(),
    "adopt": MessageSpec(),
    "expect": MessageSpec({"prompt": TensorSpec(frozenset({"i32"}),
                                                ((1, 1), (1, MAX_PROMPT_TOKENS)))}),
    "prefill": MessageSpec({"prompt": TensorSpec(frozenset({"i32"}),
                                                 ((1, 1), (1, MAX_PROMPT_TOKENS)))}),
}

# What a router accepts from a node.
ROUTER_SPECS: Final = {
    "adopted": MessageSpec(),
    "attached": MessageSpec(),
    "error": MessageSpec(),
    "load": MessageSpec(),
    "prefilled": MessageSpec(),
    "token": MessageSpec({"tokens": TensorSpec(frozenset({"i32"}), ((1, 1),))}),
}

__all__ = ["ERR_BAD_HANDOFF", "ERR_BAD_MESSAGE", "ERR_BAD_REQUEST", "ERR_BUSY",
           "ERR_CLUSTER_MISMATCH", "ERR_DRAINING", "ERR_FORBIDDEN", "ERR_INTERNAL",
           "ERR_MODEL_MISMATCH", "ERR_UNAVAILABLE", "ERR_UNSUPPORTED", "HANDOFF_FRAME_BYTES",
           "HANDOFF_TIMEOUT_S", "LOAD_EVERY_S", "MAX_PROMPT_TOKENS", "MAX_SEQUENCES",
           "NODE_SPECS", "ROUTER_SPECS", "ProtocolViolation"]

