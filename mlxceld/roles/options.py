"""Each role's options as a typed spec: built by the daemon, read by the worker.

The daemon builds them (``config.serve.router_options``,
``cluster.clusterfile.placement.stage_options`` and ``pipeline_options``, and
``[workers.NAME] options`` as the config file is loaded); ``WorkerSpec`` carries
them, ``options_json`` writes them on the worker's bootstrap pipe, and the
worker runtime reads them back once, on entry, with ``parse_options``. There a
missing, unknown or ill-typed field is a ``ConfigError`` naming it
(``options.layers``, or ``workers.NAME.options.KEY`` for the config file), and
the worker exits with ``EXIT_CONFIG``; nothing after that entry checks a type.

Imports nothing heavy (no mlx): the daemon imports this module too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Final

from mlxceld.errors import ConfigError
from mlxceld.roles import ECHO, ROUTER, STAGE, STAGE_TP, TP
from mlxceld.roles.parsing import InvalidOption, object_json, parse_kind
from mlxceld.types import DEFAULT_SILENCE_S, HANDOFF_SIDES, PREFILL_ROLE
from mlxceld.wire.address import parse_address

MAX_TP_SIZE: Final = 16  # models/tensor.py's bound (this module imports nothing of models/)
EXIT_CONFIG: Final = 2  # a worker whose options are refused exits so (as mlxceld does)
KV_BITS: Final = (4, 8)  # [serve] kv_bits: what a quantized KV cache stores per element
KV_GROUP_SIZES: Final = (32, 64, 128)  # mlx's quantization group sizes
DEFAULT_KV_GROUP_SIZE: Final = 64  # mlx-lm's
DEFAULT_DRAFT_TOKENS: Final = 4  # [serve] num_draft_tokens: k, the draft's proposals a pass
MAX_DRAFT_TOKENS: Final = 32
# [serve] reasoning_field and unknown_fields (api/reasoning.py, api/ignoring.py), default first.
REASONING_FIELDS: Final = ("reasoning_content", "reasoning", "both")
UNKNOWN_FIELDS: Final = ("refuse", "warn")


def _check(ok: bool, key: str, rule: str, value: object) -> None:
    if not ok:
        raise InvalidOption(key, rule, value)


def _check_layers(key: str, layers: tuple[int, int]) -> None:
    _check(0 <= layers[0] < layers[1], key, "be [start, end) with 0 <= start < end", layers)


def _check_port(key: str, port: int) -> None:
    _check(1 <= port <= 65535, key, "be a port in 1-65535", port)


def _check_tp_hosts(key: str, hosts: tuple[str, ...], size: int) -> None:
    """A tensor-parallel group's ring: one distinct ``host:port`` per rank, rank 0 first."""
    _check(len(hosts) == size, key, f"name one host:port per rank ({size})", hosts)
    for host in hosts:
        _check_address(key, host)
    _check(len(set(hosts)) == len(hosts), key, "name each host:port once", hosts)


def _check_address(key: str, address: str | None) -> None:
    if address is None:
        return
    try:
        parse_address(address)
    except ValueError as exc:
        raise InvalidOption(key, f"be host:port (it {exc})", address) from None


@dataclass(frozen=True)
class EchoOptions:
    """The ``echo`` role (``workers/echo.py``): a test worker that can misbehave on cue."""

    role: ClassVar[str] = ECHO

    interval_s: float = 1.0  # tick period
    ready_after_s: float = 0.0  # a slow start: ready only after this long
    crash_after_s: float | None = None  # raise RuntimeError after this long
    exit_after_s: float | None = None  # exit with exit_code after this long
    exit_code: int = 0
    ignore_term: bool = False  # a stuck worker: the supervisor must SIGKILL it
    freeze_after_s: float | None = None  # block the whole process after this long
    hog_mib: int = 0  # once ready, fill this much memory (an out-of-memory kill under a limit)
    busy: bool = False  # report having work (its ticks are its steps): the watchdog watches
    stall_after_s: float | None = None  # stop ticking after this long, channel still answering
    drain_s: float = 0.0  # told to stop, go on answering (stopping) this long
    teardown_s: float = 0.0  # its role returned, take this long to exit (a slow teardown)

    def __post_init__(self) -> None:
        _check(self.interval_s > 0, "interval_s", "be > 0", self.interval_s)
        _check(0 <= self.hog_mib <= 1 << 20, "hog_mib", "be in 0-1048576", self.hog_mib)
        for key in ("ready_after_s", "crash_after_s", "exit_after_s", "freeze_after_s",
                    "stall_after_s", "drain_s", "teardown_s"):
            value = getattr(self, key)
            _check(value is None or value >= 0, key, "be >= 0", value)
        _check(0 <= self.exit_code <= 255, "exit_code", "be in 0-255", self.exit_code)

    @property
    def timed(self) -> bool:
        """Whether something is due at a time (then it ticks finely to catch it)."""
        return any(t is not None for t in (self.crash_after_s, self.exit_after_s,
                                           self.freeze_after_s, self.stall_after_s))


@dataclass(frozen=True)
class KVQuant:
    """A quantized KV cache (``[serve] kv_bits``, ``kv_group_size``, ``quantized_kv_start``;
    ``config/serve.py`` says what each means): each key and value row stored as ``bits``-bit
    integers with a scale and a bias per ``group_size`` elements, in every layer that holds
    at least ``start`` tokens (``engine/kvquant.py``)."""

    bits: int
    group_size: int = DEFAULT_KV_GROUP_SIZE
    start: int = 0

    def __post_init__(self) -> None:
        _check(self.bits in KV_BITS, "bits", f"be one of {', '.join(map(str, KV_BITS))}",
               self.bits)
        _check(self.group_size in KV_GROUP_SIZES, "group_size",
               f"be one of {', '.join(map(str, KV_GROUP_SIZES))}", self.group_size)
        _check(self.start >= 0, "start", "be >= 0", self.start)

    def __str__(self) -> str:
        return (f"quantized KV cache: {self.bits} bits, groups of {self.group_size}, from "
                f"token {self.start}")


@dataclass(frozen=True)
class PipelineStage:
    """One stage the pipeline engine drives: its node id, listener, rank and layers."""

    node_id: str
    address: str  # host:port of its MXCL listener
    rank: int
    layers: tuple[int, int]  # [start, end)

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "rank", "be >= 0", self.rank)
        _check_layers("layers", self.layers)
        _check_address("address", self.address)


@dataclass(frozen=True)
class PipelineOptions:
    """The router's ``pipeline``: the stages to drive, and who we are to them."""

    stages: tuple[PipelineStage, ...]
    coordinator: str  # our address, the identity the stages bind
    model_identity: str
    cluster: str

    def __post_init__(self) -> None:
        _check(len(self.stages) >= 1, "stages", "name at least one stage", self.stages)
        _check_address("coordinator", self.coordinator)
        ranks = [s.rank for s in self.stages]
        _check(ranks == list(range(len(ranks))), "stages", "be in rank order 0, 1, ...", ranks)


@dataclass(frozen=True)
class ReplicasOptions:
    """The router's ``replicas`` (``--node-role router``): the hybrid nodes to route over,
    by agent address, and who we are to them."""

    agents: tuple[str, ...]  # each replica's agent address (config/replicas.py)
    origin: str  # our agent listener's address: the identity we dial with
    cluster: str
    # Prefill/decode disaggregation (config/disagg.py): both pools or neither.
    prefill_agents: tuple[str, ...] = ()
    decode_agents: tuple[str, ...] = ()
    kv_compression: str = "none"
    # No agents: the replicas are found by discovery (the daemon tells the worker its
    # candidates: daemon/replica_peers.py).
    discover: bool = False

    def __post_init__(self) -> None:
        _check(len(self.agents) >= 1 or bool(self.prefill_agents and self.decode_agents)
               or self.discover, "agents",
               "name at least one replica (or prefill and decode nodes, or discover)",
               self.agents)
        _check(not (self.discover and (self.agents or self.prefill_agents)), "discover",
               "be without agents and pools", self.discover)
        _check(bool(self.prefill_agents) == bool(self.decode_agents), "decode_agents",
               "be given with prefill_agents", self.decode_agents)
        for name in ("agents", "prefill_agents", "decode_agents"):
            for agent in getattr(self, name):
                _check_address(name, agent)
        _check_address("origin", self.origin)


@dataclass(frozen=True)
class HandoffOptions:
    """A prefill or decode node's router worker (``--node-role prefill|decode``): no
    OpenAI port, its engine on the serving listener only (``workers/handoff_node.py``)."""

    role: str  # "prefill" or "decode"
    origin: str  # our agent listener's address: the identity we ask agents with
    prefill_agents: tuple[str, ...] = ()  # a decode node's prefill peers, by agent address

    def __post_init__(self) -> None:
        _check(self.role in HANDOFF_SIDES, "role", "be prefill or decode", self.role)
        _check(self.role == PREFILL_ROLE or len(self.prefill_agents) >= 1, "prefill_agents",
               "name at least one prefill peer", self.prefill_agents)
        for agent in self.prefill_agents:
            _check_address("prefill_agents", agent)
        _check_address("origin", self.origin)


@dataclass(frozen=True)
class ServingOptions:
    """The router's ``serving``: its engine served to the cluster's routers on an MXCL
    listener (``replicas/service.py``), when the daemon holds the cluster secret."""

    address: str  # where to listen: the agent listener's host, [serve] serving_port (0 ok)
    node_id: str  # this node's id, in ``attached`` and the log
    cluster: str  # the cluster's name: a router's ``attach`` must name it

    def __post_init__(self) -> None:
        try:
            parse_address(self.address, port_zero=True)
        except ValueError as exc:
            raise InvalidOption("address", f"be host:port (it {exc})", self.address) from None


@dataclass(frozen=True)
class RouterOptions:
    """The ``router`` role: the OpenAI port, over a local model or a ``pipeline``."""

    role: ClassVar[str] = ROUTER

    model: str  # a local directory or a Hugging Face repo id
    model_name: str  # the id clients see
    host: str
    port: int
    max_batch: int
    max_queued: int
    pipeline: PipelineOptions | None = None  # None: the model runs in this process
    # With --node-role router: the replicas to spread requests over (no model here).
    replicas: ReplicasOptions | None = None
    # With --node-role prefill|decode: no OpenAI port; the engine on the serving listener.
    handoff: HandoffOptions | None = None
    # The OpenAI port's connections (guard/connections.py says what each bounds).
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 20.0
    # How long a pipeline stage may send nothing before it is silent (net/liveness.py).
    stage_silence_s: float = DEFAULT_SILENCE_S
    # The most tokens one completion generates (None: what is left of the context).
    max_tokens: int | None = None
    # How long a pipeline sequence whose stage is lost is held for a working plan and then
    # replayed (pipeline/replay.py); 0: it fails at once. The coordinator's daemon sets it
    # to its heal's bound (``replay.hold_for``) for a plan it heals.
    replay_hold_s: float = 0.0
    serving: ServingOptions | None = None  # None: no serving listener (no cluster secret)
    # Replica groups past the first (``pipeline`` is replica 0): each a whole pipeline;
    # the router pools them (replicas/groups.py). Empty: one pipeline, as before.
    replica_pipelines: tuple[PipelineOptions, ...] = ()
    # Tensor parallelism (issue 20): this router is rank 0 of a group of ``tp_size`` ranks
    # on this host (the others: the ``tp`` workers, TensorOptions), meeting in an
    # mlx.distributed ring at ``tp_hosts`` (host:port per rank, rank 0 first; empty when
    # tp_size is 1). Only with the model here: no pipeline, replicas or handoff.
    tp_size: int = 1
    tp_hosts: tuple[str, ...] = ()
    # The OpenAI port is shared (SO_REUSEPORT) with the daemon's stand-in of a group across
    # hosts (daemon/tensor_standin.py), which lets it go once this router runs: no client
    # is refused while the router starts.
    share_port: bool = False
    # A cap on the model's context (``[serve] context_length``): the engine serves the
    # lesser of the two (``models/context.py``). None: the model's own.
    context_length: int | None = None
    # The byte bound of each engine's prompt (prefix) cache (``[serve] prompt_cache_bytes``):
    # the local engine's (``engine/prompt_cache.py``), a pipeline stage's. 0: no cache;
    # None: the default (``prompt_cache.DEFAULT_BYTES``).
    prompt_cache_bytes: int | None = None
    # A quantized KV cache (issue 28) for the local engine, every tensor-parallel rank (rank
    # 0's setup op carries it) and every pipeline stage (each ``prepare`` carries it);
    # None: full precision, as the model computes it.
    kv_quant: KVQuant | None = None
    # Speculative decoding (issue 33; ``config/speculative.py``): a draft model with the
    # target's tokenizer (a local directory or a repo id) proposing ``num_draft_tokens`` at
    # a time, in the local engine only (``engine/speculative.py``; the worker refuses it
    # in any other mode: ``workers/engines.py``). None: no draft.
    draft_model: str | None = None
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    # The model's other names: a request may name it by any (``[serve] model_name``).
    model_aliases: tuple[str, ...] = ()
    # CORS on the OpenAI port (``api/edge/cors.py``): exact origins, or ("*",); (): none.
    allowed_origins: tuple[str, ...] = ()
    # "auto": sampling defaults from the model's generation_config.json; "none": OpenAI's.
    generation_config: str = "auto"
    # The key of a chat answer's reasoning (``[serve] reasoning_field``, api/reasoning.py).
    reasoning_field: str = REASONING_FIELDS[0]
    # A request's unknown fields: refused, or ignored and named (``[serve] unknown_fields``).
    unknown_fields: str = UNKNOWN_FIELDS[0]
    # ``GET /metrics`` open to callers without the API key (``[serve] metrics_require_key``
    # false); without a key it is open anyway.
    metrics_open: bool = False

    def __post_init__(self) -> None:
        _check_port("port", self.port)
        _check(self.generation_config in ("auto", "none"), "generation_config",
               "be auto or none", self.generation_config)
        _check(self.reasoning_field in REASONING_FIELDS, "reasoning_field",
               f"be one of {', '.join(REASONING_FIELDS)}", self.reasoning_field)
        _check(self.unknown_fields in UNKNOWN_FIELDS, "unknown_fields",
               f"be one of {', '.join(UNKNOWN_FIELDS)}", self.unknown_fields)
        _check(1 <= self.tp_size <= MAX_TP_SIZE, "tp_size", f"be in 1-{MAX_TP_SIZE}",
               self.tp_size)
        # Empty with tp_size > 1 until the roster picks the ring's ports (the router
        # worker refuses it so, and tp with a pipeline, replicas or handoff).
        if self.tp_size > 1 and self.tp_hosts:
            _check_tp_hosts("tp_hosts", self.tp_hosts, self.tp_size)
        _check(self.tp_size > 1 or not self.tp_hosts, "tp_hosts", "be empty with tp_size 1",
               self.tp_hosts)
        _check(not self.replica_pipelines or self.pipeline is not None, "replica_pipelines",
               "come with a pipeline (replica 0)", self.replica_pipelines)
        _check(self.pipeline is None or self.replicas is None, "replicas",
               "be null with a pipeline", self.replicas)
        _check(self.handoff is None or (self.pipeline is None and self.replicas is None
                                        and self.serving is not None), "handoff",
               "come with serving, and without a pipeline or replicas", self.handoff)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "be >= 1",
               self.max_tokens)
        _check(self.max_batch >= 1, "max_batch", "be >= 1", self.max_batch)
        _check(self.max_queued >= 1, "max_queued", "be >= 1", self.max_queued)
        _check(self.context_length is None or self.context_length >= 1, "context_length",
               "be >= 1", self.context_length)
        _check(self.prompt_cache_bytes is None or self.prompt_cache_bytes >= 0,
               "prompt_cache_bytes", "be >= 0", self.prompt_cache_bytes)
        _check(self.max_connections >= 1, "max_connections", "be >= 1", self.max_connections)
        _check(1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS, "num_draft_tokens",
               f"be in 1-{MAX_DRAFT_TOKENS}", self.num_draft_tokens)
        _check(self.replay_hold_s >= 0, "replay_hold_s", "be >= 0", self.replay_hold_s)
        for key in ("header_timeout_s", "body_timeout_s", "write_timeout_s",
                    "stage_silence_s"):
            _check(getattr(self, key) > 0, key, "be > 0", getattr(self, key))


@dataclass(frozen=True)
class StageOptions:
    """The ``stage`` role: one pipeline stage (``workers/stage.py`` says what each is)."""

    role: ClassVar[str] = STAGE

    model: str
    layers: tuple[int, int]  # [start, end)
    node_id: str
    rank: int
    address: str  # our listener, also the identity we dial the next stage with
    coordinator: str
    upstream: str | None
    downstream: str | None
    first: str | None  # on the last of 2+ stages: where decoding continues
    last: str | None  # on the first of 2+ stages: who sends ``next``
    model_identity: str
    cluster: str
    standby: bool = False  # loaded and listening; serves once activated
    # The heartbeat's bound on its links to the next and the first stage, and on the
    # connections it accepts (net/liveness.py).
    silence_s: float = DEFAULT_SILENCE_S
    # A tensor-parallel stage ([serve] tp_size on the stage host): this worker is rank 0 of
    # ``tp_size`` ranks on this host (the others: the ``stage_tp`` workers,
    # StageTensorOptions), meeting in an mlx.distributed ring at ``tp_hosts`` (host:port
    # per rank, rank 0 first; empty with tp_size 1, or when the daemon could bind no port:
    # the worker refuses that, naming it).
    tp_size: int = 1
    tp_hosts: tuple[str, ...] = ()
    # The last stage's draft model (a local directory or a repo id; the cluster TOML's
    # [cluster] draft_model) and its k: its sequences speculate (pipeline/speculating.py).
    draft_model: str | None = None
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS

    def __post_init__(self) -> None:
        _check(self.rank >= 0, "rank", "be >= 0", self.rank)
        _check(1 <= self.num_draft_tokens <= MAX_DRAFT_TOKENS, "num_draft_tokens",
               f"be in 1-{MAX_DRAFT_TOKENS}", self.num_draft_tokens)
        _check(self.draft_model is None or self.downstream is None, "draft_model",
               "be the last stage's only", self.draft_model)
        _check(self.silence_s > 0, "silence_s", "be > 0", self.silence_s)
        _check_layers("layers", self.layers)
        _check(1 <= self.tp_size <= MAX_TP_SIZE, "tp_size", f"be in 1-{MAX_TP_SIZE}",
               self.tp_size)
        if self.tp_size > 1 and self.tp_hosts:
            _check_tp_hosts("tp_hosts", self.tp_hosts, self.tp_size)
        _check(self.tp_size > 1 or not self.tp_hosts, "tp_hosts", "be empty with tp_size 1",
               self.tp_hosts)
        for key in ("address", "coordinator", "upstream", "downstream", "first", "last"):
            _check_address(key, getattr(self, key))


@dataclass(frozen=True)
class TensorOptions:
    """The ``tp`` role (``workers/tensor_rank.py``): rank ``rank`` >= 1 of the router's
    tensor-parallel group; it loads its slice of ``model`` and follows rank 0's steps
    over the ring at ``tp_hosts``. No port of its own besides its ring's."""

    role: ClassVar[str] = TP

    model: str  # as the router's: a local directory or a Hugging Face repo id
    model_name: str  # the id clients see (its log lines name it)
    rank: int
    tp_hosts: tuple[str, ...]  # the ring: host:port per rank, rank 0 (the router) first
    max_batch: int  # the router's: both sides of the ring must be given the same

    def __post_init__(self) -> None:
        _check(2 <= len(self.tp_hosts) <= MAX_TP_SIZE, "tp_hosts",
               f"name 2-{MAX_TP_SIZE} ranks' host:port", self.tp_hosts)
        _check_tp_hosts("tp_hosts", self.tp_hosts, len(self.tp_hosts))
        _check(1 <= self.rank < len(self.tp_hosts), "rank",
               f"be in 1-{len(self.tp_hosts) - 1} (rank 0 is the router)", self.rank)
        _check(self.max_batch >= 1, "max_batch", "be >= 1", self.max_batch)


@dataclass(frozen=True)
class StageTensorOptions:
    """The ``stage_tp`` role (``workers/stage_tensor.py``): rank ``rank`` >= 1 of a
    tensor-parallel pipeline stage (``StageOptions.tp_hosts``); it loads its slice of the
    stage's ``layers`` of ``model`` and follows rank 0's (the ``stage`` worker's) steps
    over the ring at ``tp_hosts``. No port of its own besides its ring's, no secret."""

    role: ClassVar[str] = STAGE_TP

    model: str  # as the stage's: a local directory or a Hugging Face repo id
    layers: tuple[int, int]  # the stage's [start, end)
    node_id: str  # the stage's node (its log lines name it)
    rank: int
    tp_hosts: tuple[str, ...]  # the ring: host:port per rank, rank 0 (the stage) first

    def __post_init__(self) -> None:
        _check_layers("layers", self.layers)
        _check(2 <= len(self.tp_hosts) <= MAX_TP_SIZE, "tp_hosts",
               f"name 2-{MAX_TP_SIZE} ranks' host:port", self.tp_hosts)
        _check_tp_hosts("tp_hosts", self.tp_hosts, len(self.tp_hosts))
        _check(1 <= self.rank < len(self.tp_hosts), "rank",
               f"be in 1-{len(self.tp_hosts) - 1} (rank 0 is the stage)", self.rank)


WorkerOptions = (EchoOptions | RouterOptions | StageOptions | TensorOptions
                 | StageTensorOptions)
OPTIONS: Final[dict[str, type[WorkerOptions]]] = {
    c.role: c for c in (EchoOptions, RouterOptions, StageOptions, TensorOptions,
                        StageTensorOptions)}

def options_json(options: WorkerOptions) -> dict[str, object]:
    """``options`` as the JSON object it travels as (tuples as lists)."""
    return object_json(options)


def parse_options(role: str, raw: object, where: str = "options") -> WorkerOptions:
    """``raw`` (JSON, or a TOML table) as ``role``'s options; ``ConfigError`` naming the
    first field that is missing, unknown, of the wrong type or out of its range, as
    ``where.KEY``."""
    kind = OPTIONS.get(role)
    if kind is None:
        raise ConfigError(f"no worker role {role!r}",
                          hint=f"roles: {', '.join(sorted(OPTIONS))}")
    return parse_kind(kind, raw, where)
