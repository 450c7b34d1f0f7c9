"""Boundary vocabulary: JSON shapes that cross a process or socket boundary."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Final, Literal, NotRequired, TypedDict

JSON = dict[str, Any]
# A peer that sends nothing (not even a pong) for this long is silent: net/liveness.py,
# [serve] stage_silence_s.
DEFAULT_SILENCE_S: Final = 3.0
MAX_PIPELINE_STAGES: Final = 64  # --pp-auto, [daemon] pp_auto, `mlxctl cluster plan|activate`
MAX_REPLICAS: Final = 8  # replica groups: `mlxctl cluster plan|activate --replicas`, TOML's
MAX_DRAIN_DEADLINE_S: Final = 7 * 24 * 3600.0  # the longest `mlxctl drain --deadline`
# `mlxctl cluster link-test`: the most round trips, and MiB each way (net/link.py; a peer
# sends at most wire/link_messages.py's MAX_PULL, 64 MiB)
MAX_LINK_PINGS: Final = 200
MAX_LINK_MIB: Final = 64

# How a plan runs N hosts (cluster/plan/mesh.py): a pipeline (the default), one tensor
# group, stages of tensor groups, or the least predicted time; `--mesh`, [daemon] mesh,
# `mlxctl cluster plan|activate --mesh`.
MeshMode = Literal["pp", "tp", "2d", "auto"]
MESH_MODES: Final[tuple[MeshMode, ...]] = ("pp", "tp", "2d", "auto")
DEFAULT_MESH: Final[MeshMode] = "pp"


def parse_mesh(value: object, what: str) -> MeshMode:
    """``value`` as a mesh mode; ``ValueError`` naming ``what`` (the flag, the key) if not."""
    for mode in MESH_MODES:
        if value == mode:
            return mode
    raise ValueError(f"{what} {value!r} is not a mesh: give one of {', '.join(MESH_MODES)}")


# A node's role in a serving cluster (``--node-role``, [serve] node_role, a cluster TOML's
# serving nodes; checked in config/replicas.py). The wire's copy: wire/agent_messages.py.
NodeRole = Literal["hybrid", "router", "prefill", "decode", "tensor_parallel_rank"]
HYBRID: Final = "hybrid"
ROUTER_ROLE: Final = "router"
PREFILL_ROLE: Final = "prefill"
DECODE_ROLE: Final = "decode"
# A rank >= 1 of a tensor-parallel group across hosts (config/tensor.py): no router here.
TENSOR_RANK_ROLE: Final = "tensor_parallel_rank"
NODE_ROLES: Final[tuple[NodeRole, ...]] = (HYBRID, ROUTER_ROLE, PREFILL_ROLE, DECODE_ROLE,
                                           TENSOR_RANK_ROLE)
# A prefill/decode handoff's two sides: the node roles that take part in one
# (replicas/handoffs.py); a node of either role is that side of each handoff.
HandoffSide = Literal["prefill", "decode"]
HANDOFF_SIDES: Final[tuple[HandoffSide, ...]] = (PREFILL_ROLE, DECODE_ROLE)


class WorkerState(StrEnum):
    """The supervisor's view of a worker (its lifecycle: ``supervisor.states``), as
    stored and as `mlxctl status` shows it."""

    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    STOPPING = "stopping"
    EXITED = "exited"
    FAILED = "failed"


class WorkerHealth(StrEnum):
    """A worker's own word on itself: ``state`` in its control channel's ``health`` answer.
    (The supervisor's view of a worker is ``WorkerState``.)"""

    STARTING = "starting"  # its role is getting ready (binding, loading a model)
    READY = "ready"  # it does its work
    STOPPING = "stopping"  # told to stop


class WorkerBootstrap(TypedDict):
    """What the daemon writes to a new worker's stdin (never argv or environment).

    Secrets, when a role needs one, travel only here.
    """

    name: str
    role: str
    options: dict[str, object]  # the role's options (workers/options.py), read once on entry
    control_socket: str
    exit_record: str
    state_dir: str
    secret_hex: NotRequired[str]  # the primary cluster secret: what the worker dials with
    accepted_hex: NotRequired[list[str]]  # the others it accepts (a rotation's overlap)
    api_key: NotRequired[str]
    # The daemon's Hugging Face token, for a worker that may download a model named by its
    # repo id (supervisor/process.py: DOWNLOADERS); set in its own process on entry.
    hf_token: NotRequired[str]
    log_format: NotRequired[str]  # "json": one JSON object a line (logformat.py); else text


class WorkerKeys(TypedDict):
    """A worker's keyring by key id (hex), in its ``health`` answer: never a secret."""

    primary: str
    ids: list[str]


class ExitRecord(TypedDict):
    """Written by a worker as it exits, so a daemon that adopted it learns why."""

    pid: int
    returncode: int
    kind: str
    summary: str


class WorkerProgress(TypedDict):
    """A worker's progress, in its ``health`` answer (``progress``) where its role does
    steps of work (the stage). The supervisor's watchdog restarts a worker that has work
    (``busy``) but has made no step for ``RestartPolicy.stall_timeout_s``."""

    steps: int  # steps done since the worker started
    last_step_at: float | None  # wall-clock time of the last step; None: none yet
    busy: bool  # it has work: something received and not yet done
    stalled_s: float  # how long it has had work without a step (0 when not busy)


class PromptCacheStats(TypedDict):
    """An engine's prompt (prefix) cache (``engine/prompt_cache.py``), in a router worker's
    ``stats`` (``prompt_cache``) for ``mlxctl status`` and on ``/metrics``: lookups that
    reused a prefix (``hits``) or none (``misses``), the prompt tokens not prefilled again
    (``tokens_reused``), since the engine started; the caches held now and their bytes."""

    hits: int
    misses: int
    tokens_reused: int
    entries: int
    bytes: int


class PipelineCacheStats(PromptCacheStats):
    """A pipeline router's prompt cache (``pipeline/prefixes.py`` over its stages' stores):
    ``entries`` those every stage holds, ``bytes`` the stages' all told; ``lost``: requests
    whose named prefix a stage no longer held (prefilled whole), ``pending``: entries not
    every stage has said it holds yet."""

    lost: int
    pending: int


class LoadProgress(TypedDict):
    """A stage loading its weights, in its ``stats`` (``loading``) until it has loaded them:
    parameter bytes read of those to read, since when (wall clock). The peer's assignment
    waits while ``done`` advances (``cluster/assignment/stagehost.py``). ``step`` is
    ``downloading`` while a stage of a model named by its Hugging Face repo id fetches
    its shards (bytes fetched of those to fetch, ``models/fetch.py``), then ``loading``
    (the default when absent)."""

    done: int
    total: int
    since: float
    step: NotRequired[str]


def load_progress(raw: Any) -> LoadProgress | None:
    """A worker's ``loading`` stat as it came over its control socket: None when it says
    none (not loading, or done) or is not one; its ``step`` kept when it downloads."""
    if not (isinstance(raw, dict) and all(type(raw.get(k)) in (int, float)
                                          for k in ("done", "total", "since"))):
        return None
    progress = LoadProgress(done=int(raw["done"]), total=int(raw["total"]),
                            since=float(raw["since"]))
    if raw.get("step") == "downloading":
        progress["step"] = "downloading"
    return progress


def loading_text(p: LoadProgress, now: float) -> str:
    """``loading 43% of 61.0 GiB, 12 s`` (or ``downloading ...``): what ``mlxctl status``
    and systemd's STATUS say."""
    pct = 100 * p["done"] // p["total"] if p["total"] > 0 else 0
    gib = p["total"] / 2**30
    amount = f"{gib:.1f} GiB" if gib >= 1 else f"{p['total'] / 2**20:.1f} MiB"
    step = p.get("step", "loading")
    return f"{step} {pct}% of {amount}, {max(0.0, now - p['since']):.0f} s"


class StageLinkView(TypedDict):
    """The router's link to one stage (``pipeline/links.py``: ``LinkState``)."""

    state: str  # attached, connecting, standby, disconnected, unreachable, refused, silent, ...
    since: float | None  # unix s: when it turned so
    address: str | None  # the stage's MXCL address (the operator's view; clients never see it)
    rtt_ms: float | None  # the latest heartbeat ping's round trip; None: none yet, or down
    error: str | None  # why it is not attached
    prompt_cache: StageCacheView | None  # what the stage's prompt cache holds; None: off


class StageCacheView(TypedDict):
    """A stage's prompt cache as it last told the router (``pipeline/kvstore.py``)."""

    bytes: int
    entries: int
    budget: int | None  # its bound in bytes; None: not said yet


class PeerView(TypedDict):
    """A peer as this coordinator's failure detector and discovery know it."""

    state: str | None  # alive, suspect, dead, unknown; None: not watched (yet)
    since: float | None
    reason: str | None
    last_answer: float | None  # its last pong (unix s)
    key_id: str | None  # its primary key id, as its inventory or mDNS record says
    key_stale: bool  # its primary is not ours: it missed a secret rotation


class ClusterPeer(PeerView):
    """A peer that holds no stage of the plan (a spare, a host of an older plan)."""

    address: str  # its agent address
    node_id: str | None


class PipelineStage(TypedDict):
    stage: str | None  # the stage's id in the cluster config ("stage-0")
    rank: int
    node_id: str | None  # the peer's own node id, where the plan knows it
    address: str | None  # the peer's agent address
    layers: list[int] | None  # [first, end)
    assignment: str | None  # the peer's step in the bring-up (active, unreachable, ...)
    link: StageLinkView | None  # None: no router over it (yet)
    peer: PeerView | None
    drain: JSON | None  # its drain (GET /v1/drains' row), if it is drained
    replica: NotRequired[int]  # its replica group, where the router serves 2 or more


class PipelineRouter(TypedDict):
    worker: str
    state: str  # WorkerState
    url: str | None  # the OpenAI port
    tokens: int | None  # generated since the router started
    tokens_per_s: float | None  # over the last 10 s; None: not measured yet
    throughput_of: str  # "pipeline": tokens as the router hands them to clients


class PipelineView(TypedDict):
    """The coordinator's cluster view (``control/clusterview.py``; ``mlxctl.status/1``'s
    ``pipeline``)."""

    epoch: int | None  # the plan's; None: a written cluster config (no plan)
    model: str | None
    state: str | None  # the bring-up's: planning, pushing, active, failed, deactivated
    router: PipelineRouter | None
    stages: list[PipelineStage]
    other_peers: list[ClusterPeer]  # every other peer the detector or discovery knows
    key_id: str | None  # this coordinator's primary key id
    drains: list[JSON]  # every drain in force (GET /v1/drains)
    healing: JSON | None  # self-healing's state
    rotation: JSON | None  # the latest secret rotation, with in_progress
