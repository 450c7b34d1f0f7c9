"""The one exception tree of mlxceld, drawn whole: every exception class the package
defines, under its base, with the module of each one defined elsewhere.

    Exception
    ├── MlxceldError                root: everything we raise on purpose
    │   ├── BadRequest              a control API request is malformed (names the parameter
    │   │   │                       or body field; the caller's to fix)
    │   │   └── RequestTooLarge     its body is larger than the control API takes
    │   ├── UnknownNode             `mlxctl drain` names a node this daemon does not know
    │   ├── DrainRefused            `mlxctl drain` of a node only another daemon can drain
    │   │                           (a stage host: names its coordinator)
    │   ├── ConfigError             a flag, config file or spec is wrong (the user's to fix)
    │   │   ├── SecretSourceError   no usable cluster secret where the sources point
    │   │   ├── PlanRefused         no pipeline plan fits the nodes (names each shortfall)
    │   │   ├── ModelRefused        `mlxctl serve` names a model this daemon cannot serve
    │   │   ├── UnsupportedFamily   a model family mlxceld cannot split into pipeline stages
    │   │   │                       (names it and the families it splits)
    │   │   └── UnserveRefused      `mlxctl unserve` would not last, or the router is a
    │   │                           cluster's
    │   ├── StateError              the SQLite state could not be read or written
    │   │   └── DamagedState        the state database is damaged (exit 2; --reset-state
    │   │                           moves it aside)
    │   ├── KeyringError            a cluster secret cannot be installed, used or removed
    │   │   ├── UnknownKey          no installed secret has that key id
    │   │   ├── PrimaryKeyRemoval   the primary secret cannot be removed
    │   │   ├── RotationRefused     `mlxctl secret rotate` cannot start (names each member
    │   │   │                       unreachable, or the rotation already running)
    │   │   └── RotationFailed      a member failed a rotation's step (names every one)
    │   ├── DaemonError             the daemon cannot start or run as asked
    │   │   ├── AlreadyRunning      another daemon holds the state dir lock
    │   │   ├── SocketError         the control socket cannot be created
    │   │   ├── BringUpInProgress   a pipeline bring-up runs already (names its plan)
    │   │   ├── NoActivePlan        `mlxctl cluster deactivate` with no plan to end
    │   │   └── ShuttingDown        the daemon is stopping and admits no new work
    │   ├── WorkerError             a worker cannot be spawned, reached or stopped
    │   │   ├── UnknownWorker       no worker has that name
    │   │   └── ChannelError        a worker's control channel failed or timed out
    │   ├── ControlError            the control API answered with an error (client side)
    │   │   ├── DaemonNotRunning    nothing listens on the control socket
    │   │   └── PermissionDenied    the socket or the daemon refused us
    │   ├── NetError                net/errors.py: the MXCL network shell failed
    │   │   ├── AskFailed           net/errors.py: one question to an agent got no answer
    │   │   │                       (its kind: the step that failed)
    │   │   ├── ConnectionClosed    net/errors.py: the stream is over (the peer's reason)
    │   │   ├── HandshakeFailed     net/errors.py: a handshake made no connection
    │   │   ├── LinkTestFailed      net/errors.py: `mlxctl cluster link-test` did not finish
    │   │   │                       (its kind: the step that failed)
    │   │   └── ResolveError        net/resolve.py: a peer's host name did not resolve
    │   ├── ServingNotFound         discovery/serving.py: no serving listener to dial at a
    │   │                           replica (which of the reasons, said)
    │   ├── InventoryError          discovery/inventory.py: an inventory answer out of bounds
    │   └── PlanNotFound            cluster/front.py: the coordinator serves no plan to follow
    ├── EngineError                 engine/base.py: the engine could not serve a request
    │   │                           (the server's fault; answered as an HTTP error)
    │   ├── EngineUnavailable       engine/base.py: a part (a stage) is unreachable: 503
    │   │   ├── StageLost           pipeline/links.py: a stage's connection ended or fell
    │   │   │                       silent (a heal may bring a working plan: replay.py)
    │   │   └── StageDraining       pipeline/links.py: a stage stopping refused a new
    │   │                           sequence (held and replayed as StageLost's)
    │   ├── GroupBroken             pipeline/protocol.py: a tensor stage's group broke
    │   │                           (its owners told; replayed as a lost stage's)
    │   ├── HandoffUnsupported      engine/handoff.py: this model's cache cannot be handed off
    │   └── HandoffError            engine/handoff.py: a handed-off cache that does not fit
    ├── WireError                   wire/errors.py: the sans-IO core's root (it imports
    │   │                           nothing of ours, this module included)
    │   ├── LocalProtocolError      wire/errors.py: we used the connection wrongly (our bug)
    │   └── RemoteProtocolError     wire/errors.py: the peer broke the protocol; close
    │       ├── EnvelopeError       wire/errors.py: a payload that breaks the envelope rules
    │       │   └── MessageError    wire/messages.py: a message whose field is wrong (names
    │       │                       it; a ValueError too)
    │       └── BeaconError         wire/errors.py: a discovery record to ignore
    ├── ApiError                    api/errors.py: a request the router refuses (HTTP status
    │                               and OpenAI's error fields)
    ├── ChatTemplateError           api/codec.py: the chat template refused the messages (400)
    ├── ProtocolViolation           pipeline/protocol.py: breaks the stage protocol (its
    │                               code is sent to the peer)
    ├── OpenFailed                  pipeline/attaching.py: a stage's stream not opened or
    │                               attached (the failure, and the client's words)
    ├── MemberFailed                cluster/rotation.py: a member did not do as asked
    ├── RoundError                  cluster/rotation_round.py: the shell broke the round's
    │                               rules (our bug)
    ├── Stopped                     workers/runtime.py: a worker told to stop while it waited
    ├── LinkFailed                  replicas/attaching.py: one attempt at a node's link failed
    ├── JoinRefused                 daemon/tensor_rank.py: a rank host refuses rank 0's question
    │                               (answered with error, the reason named)
    ├── _BodyDone                   tasks.py: a cancelling_group's body ended (never escapes)
    └── _Continue                   replicas/pool.py: a member went down midway; the request
                                    goes on on another (never escapes the pool)
    ValueError
    ├── ConstraintError             engine/constraints.py: a constraint llguidance cannot
    │   │                           honour (the client's: 400)
    │   ├── EndlessSchema           engine/constraints.py: a JSON schema no finite value
    │   │                           matches (400 naming the schema's field)
    │   └── RequestRefused          replicas/answers.py: a node refused a request as the
    │                               client's (400)
    ├── TensorParallelRefused       models/tensor.py: the model cannot be split over the ranks
    ├── InvalidOption               roles/parsing.py: a worker option that breaks its rule
    ├── OpError                     supervisor/ops.py: a worker control request that is not
    │                               one (names the field, never a secret)
    └── SecretError                 wire/secret.py: a secret is unusable (never in the message)

The classes outside ``MlxceldError`` keep their base because each is caught at one seam
and turned into something else there (an engine's failure into an HTTP answer, a wire
error into a close with a reason, a ``ValueError`` of a value's rule into the caller's
own error), or never leaves its module. ``tests/test_errors_tree.py`` checks that this
drawing names every class and its real base.

Every error carries a message that says what failed, on which object, and a
hint that says what to do next. Foreign exceptions (sqlite3.Error, OSError,
json errors) are translated once, at the seam, with ``raise X(...) from exc``.
"""

from __future__ import annotations

from pathlib import Path


class MlxceldError(Exception):
    """Root of the tree. ``hint`` tells the user what to do next."""

    code = "error"

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class BadRequest(MlxceldError):
    """A control API request the daemon cannot read: ``field`` names the query parameter or
    body field at fault (``"body"`` when the body as a whole is not a JSON object)."""

    code = "bad_request"

    def __init__(self, field: str, message: str, *, hint: str = "") -> None:
        super().__init__(message, hint=hint)
        self.field = field


class RequestTooLarge(BadRequest):
    code = "request_too_large"


class UnknownNode(MlxceldError):
    """`mlxctl drain` or `undrain` names a node that is neither this one nor a peer it
    knows (nor, for undrain, one it drains)."""

    code = "unknown_node"


class DrainRefused(MlxceldError):
    """`mlxctl drain` of a node whose work comes from a daemon this one cannot tell (a
    stage host's own daemon: its coordinator re-plans around it); nothing is recorded."""

    code = "drain_refused"


class ConfigError(MlxceldError):
    code = "config"


class SecretSourceError(ConfigError):
    """The cluster secret's sources conflict or point at nothing usable; names every source."""

    code = "secret_source"


class PlanRefused(ConfigError):
    """No split of the model over the candidate nodes fits, or there are too few of them.

    ``shortfalls`` holds, JSON-ready, one entry per stage that does not fit in the
    closest plan: ``stage``, ``node_id``, ``address``, ``needed_bytes``,
    ``usable_bytes``, ``short_bytes``; it is empty when nodes or layers are too few.
    """

    code = "plan_refused"

    def __init__(self, message: str, *, hint: str = "",
                 shortfalls: tuple[dict[str, str | int], ...] = ()) -> None:
        super().__init__(message, hint=hint)
        self.shortfalls = shortfalls


class ModelRefused(ConfigError):
    """`mlxctl serve`: the model cannot be found or read, or this daemon serves a cluster's."""

    code = "bad_model"


class UnsupportedFamily(ConfigError):
    """The checkpoint's ``model_type`` (``family``; None when config.json has none) is not
    one of the families mlxceld splits into pipeline stages (``supported``:
    ``models.families.SUPPORTED``). Refused before any weight is read."""

    code = "unsupported_family"

    def __init__(self, message: str, *, hint: str = "", family: str | None = None,
                 supported: tuple[str, ...] = ()) -> None:
        super().__init__(message, hint=hint)
        self.family = family
        self.supported = supported


class UnserveRefused(ConfigError):
    """`mlxctl unserve` changes nothing: a restart would serve the configured model again, or
    the router is a cluster's. Its code stays its parent's, as `mlxctl unserve --json` says."""


class StateError(MlxceldError):
    code = "state"


class DamagedState(StateError):
    """The state database is not a sound SQLite file (corrupt pages, not a database, zero
    bytes long): refused at start, never repaired or replaced behind the user's back."""

    code = "state_damaged"


class KeyringError(MlxceldError):
    """A cluster secret problem; the message names the key id, never the secret."""

    code = "keyring"


class UnknownKey(KeyringError):
    code = "unknown_key"


class PrimaryKeyRemoval(KeyringError):
    code = "key_is_primary"


class RotationRefused(KeyringError):
    code = "rotation_refused"


class RotationFailed(KeyringError):
    code = "rotation_failed"


class DaemonError(MlxceldError):
    code = "daemon"


class AlreadyRunning(DaemonError):
    """Another daemon holds the state dir's lock: its ``pid`` and control ``socket`` as its
    lock file says (None where it does not)."""

    code = "already_running"

    def __init__(self, message: str, *, hint: str = "", pid: int | None = None,
                 socket: Path | None = None) -> None:
        super().__init__(message, hint=hint)
        self.pid = pid
        self.socket = socket


class SocketError(DaemonError):
    code = "socket"


class BringUpInProgress(DaemonError):
    """A second bring-up was asked for while one plans or pushes."""

    code = "bringup_in_progress"


class NoActivePlan(DaemonError):
    """`mlxctl cluster deactivate` with no plan committed or active (or deactivated) here."""

    code = "nothing_to_end"


class ShuttingDown(DaemonError):
    """A request for new work (a restart, a bring-up, a serve) while the daemon stops."""

    code = "stopping"


class WorkerError(MlxceldError):
    code = "worker"


class UnknownWorker(WorkerError):
    code = "unknown_worker"


class ChannelError(WorkerError):
    code = "channel"


class ControlError(MlxceldError):
    """An error answered by the daemon's control API, or reaching it failed."""

    code = "control"

    def __init__(self, message: str, *, hint: str = "", code: str = "", status: int = 0) -> None:
        super().__init__(message, hint=hint)
        if code:
            self.code = code
        self.status = status


class DaemonNotRunning(ControlError):
    code = "not_running"


class PermissionDenied(ControlError):
    code = "permission_denied"
