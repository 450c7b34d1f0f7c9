"""What the daemon serves: the router worker, from ``[serve]``, flags, or ``mlxctl serve``.

``[serve]`` in the config file (every key optional; flags win)::

    [serve]
    model = "~/models/qwen3-0.6b"   # a local mlx-lm directory, or a Hugging Face repo id
    model_name = "qwen3"            # the id clients see in /v1/models (default: dir name);
                                    # "a,b" or ["a", "b"]: aliases (config/clients.py)
    allowed_origins = ["http://localhost:3000"]   # CORS (default: none; config/clients.py)
    generation_config = "auto"      # the model's sampling defaults, or none (ditto)
    host = "127.0.0.1"              # the OpenAI port's address (0.0.0.0 only when asked)
    port = 8080
    api_key_file = "/etc/mlxceld/api-key"   # or MLXCEL_API_KEY_FILE; 0600, one line
    metrics_require_key = true      # /metrics needs that key (here and on the daemon's
                                    # metrics_listen); false: open (config/metrics.py)
    max_batch = 8                   # sequences decoded together
    max_queued = 64                 # requests waiting beyond that; more get 503
    max_tokens = 4096               # the most tokens one completion generates (default:
                                    # none but the model's context)
    context_length = 32768          # cap the model's context (prompt + completion) to this
                                    # (default: the model's own)
    prompt_cache_bytes = 2147483648 # the engine's prompt (prefix) cache, in bytes; 0: off
    max_connections = 1024          # open connections; past it the longest idle goes
    header_timeout_s = 10.0         # a request's head must be whole this soon
    body_timeout_s = 60.0           # and its body this soon after the head
    write_timeout_s = 20.0          # a client that takes nothing of its answer this long
                                    # is cut: its sequence ends, its connection closes
    stage_silence_s = 3.0           # a pipeline stage that sends nothing (not even a
                                    # pong to our heartbeat) this long is silent
    serving_port = 0                # with a cluster secret: the serving listener's port
                                    # (0: ephemeral), on the agent listener's host
    node_role = "hybrid"            # hybrid | router | prefill | decode |
                                    # tensor_parallel_rank: see mlxceld/config/replicas.py,
                                    # disagg.py and tensor.py
    replicas = ["studio-2.local"]   # a router's replicas, by agent address (ditto)
    pipeline_coordinator = "studio-1.local"  # a router in front of that coordinator's
                                    # pipeline, by agent address: config/front.py
    prefill_peers = ["10.0.0.21"]   # a router's (or decode node's) prefill nodes (disagg.py)
    decode_peers = ["10.0.0.22"]    # a router's decode nodes (disagg.py)
    kv_compression = "none"         # a router's KV handoff: none|int8|int4, +lz4 (disagg.py)
    tp_size = 1                     # ranks splitting each layer on this host, 1-16
                                    # (mlxceld/config/tensor.py)
    tp_moe_mode = "shard"           # with tp_size > 1: experts, embedding and head
    tp_embedding_mode = "replicate" # replicated or sharded, as mlx-lm splits them
    tp_lm_head_mode = "replicate"   # (mlxceld/config/tensor_modes.py)
    tp_peers = ["10.0.0.11"]        # ranks 1.. on these hosts' agents, in rank order
                                    # (each --node-role tensor_parallel_rank; tensor.py)
    kv_bits = 8                     # a quantized KV cache: 4 or 8 bits (default: none,
                                    # full precision; mlxceld/config/kvquant.py)
    kv_group_size = 64              # elements per scale and bias: 32, 64, 128
    quantized_kv_start = 0          # tokens a layer holds before it is quantized
    draft_model = "~/models/q-0.6b" # speculative decoding: a draft with the model's
    num_draft_tokens = 4            # tokenizer, k a pass (mlxceld/config/speculative.py)
    reasoning_field = "reasoning_content"  # a chat answer's reasoning under this key:
                                    # reasoning_content | reasoning | both
    unknown_fields = "refuse"       # a request's unknown fields: refuse (400) | warn
                                    # (ignored, logged once per name, named in a header)

The connection bounds (``mlxceld/guard/connections.py`` has the whole story):
past ``max_connections`` the connection that has waited longest for a request of
its own is closed (a request in progress never is); the cap is lowered to keep
128 descriptors of the router's file limit free, and 128 more for the connections
accepted in one go (the router raises its soft limit to the hard one; mlx-lm sets
the hard one to 4096 as it is imported). The kernel queues 1024 connections not yet
accepted (``workers/router.py``'s ``BACKLOG``). A head not
whole ``header_timeout_s`` after the connection opened (or after the previous
response on it), or a body not whole ``body_timeout_s`` after its head, is answered
408 and closed. A client that takes nothing of its answer for ``write_timeout_s`` (the
router's buffers for it full: it stopped reading) has its connection closed; a stream's
sequence never waits for its client: it ends (its slot freed) as soon as its client lags
a bounded buffer behind (``mlxceld/api/outbox.py``), and what was buffered is still
written until this deadline.

``max_tokens`` (also ``--max-tokens``): a request that leaves ``max_tokens`` (and
``max_completion_tokens``) out gets what is left of the model's context, as OpenAI
does, or this many if fewer; one asking for more than this is refused (400 naming the
field), as one asking for more than the context is. Unset, only the context bounds a
completion.

``context_length`` (also ``--context-length``): the most tokens a sequence holds, prompt
and completion together, at most the model's own context (its config's
``max_position_embeddings``; ``models/context.py``). A prompt of more is refused (400
naming ``messages`` or ``prompt``), and a request that leaves ``max_tokens`` out gets what
is left of this, so a model of a 128k context cannot be asked to grow a KV cache past a
Mac's memory by default. ``/v1/models`` (``context_length``), ``/metrics``
(``mlxceld_model_info``) and ``mlxctl status`` show the context served. A cap above the
model's own is taken, with a warning, as the model's: it is a ceiling, and one config file
(or ``mlxctl serve``) serves models of several contexts. A router node (``node_role =
"router"``) bounds its requests by its own setting; each replica, prefill or decode node by
its own.

``prompt_cache_bytes``: the KV caches a single-host engine (a hybrid, prefill or decode
node's; a tensor-parallel group's ranks 1/N each, of their slices) keeps after a sequence ends
(a prefill node: after it prefills), by their tokens, so that a prompt sharing a prefix
with one (a chat's earlier turns, a repeated system prompt) prefills only the rest;
at most 16 caches and this many bytes, the least recently used dropped first (default
2 GiB; 0 keeps none). ``/metrics`` and ``mlxctl status`` show its hits and tokens reused
(``engine/prompt_cache.py``). On a pipeline's coordinator it bounds each stage's prompt
cache instead (``pipeline/kvstore.py``: every stage keeps the KV of its layers, as the
router decides, ``pipeline/prefixes.py``); unset, each stage takes a quarter of the memory
its host has available once its weights are loaded; 0: no stage keeps any.

``reasoning_field``: the key a chat answer's reasoning goes under, whole
(``choices[0].message``) and streamed (``delta``): ``reasoning_content`` (the default: what
DeepSeek, mlx-lm's server and vLLM before 0.10 send, and what the clients that show
reasoning read), ``reasoning`` (vLLM's newer key, OpenRouter's) or ``both``
(``mlxceld/api/reasoning.py``). Either is read back from an assistant message in history.

``unknown_fields``: a request field the router does not know is refused (``refuse``, the
default: 400 naming it, so that a typo is never silently ignored), or, with ``warn``,
ignored: logged once per field name, and named in the answer's
``x-mlxceld-ignored-fields`` header (``mlxceld/api/ignoring.py``). Fields it knows are
honoured or refused as docs/api-fields.md says, either way.

``stage_silence_s`` (``mlxceld/net/liveness.py``): over a pipeline, every stage link
has a heartbeat, and a stage that sends nothing for this long (its host sleeps or
lost its network: no RST ever comes) is *silent*: requests on it end with a 503 naming
it, new ones get 503 with ``Retry-After`` at once, ``/ready`` is 503, ``mlxctl status``
says since when, and it is re-attached by itself when it answers again. It bounds the
stage workers' links to each other too (set it alike on every node). Below a second it
takes a short hiccup (a busy host, a Wi-Fi roam) for a lost host. On a router node
(``node_role = "router"``, ``config/replicas.py``) it bounds each replica's link the same
way: a replica silent this long is down, and requests go to the others.

``serving_port`` (also ``--serving-port``): when the daemon holds the cluster secret, its
router serves its engine to the cluster's routers too (``mlxceld/replicas/service.py``:
a replica; the sequences are batched with the OpenAI port's own) on the *serving
listener*, MXCL channel 1 at the agent listener's host and this port (0: an ephemeral
one; ``mlxctl status`` shows the address bound, as the router's ``serving``). A router
that sends nothing for ``stage_silence_s`` has its connection dropped and its sequences
cancelled. Without a secret there is no serving listener.
"""

from __future__ import annotations

import logging
import math
import stat
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from mlxceld import roles
from mlxceld.config.clients import (
    GenerationConfig,
    parse_generation_config,
    parse_model_names,
    parse_origins,
)
from mlxceld.config.disagg import check_pools, parse_compression, parse_peer_list
from mlxceld.config.front import check_front, parse_pipeline_coordinator, parse_standby
from mlxceld.config.kvquant import parse_kv_quant
from mlxceld.config.metrics import metrics_require_key
from mlxceld.config.replicas import check_role, parse_replica_list, parse_role
from mlxceld.config.speculative import parse_draft_tokens
from mlxceld.config.tensor import parse_tp_peers, parse_tp_size
from mlxceld.config.tensor_modes import parse_tp_modes
from mlxceld.errors import ConfigError
from mlxceld.models.fetch import is_repo_id, model_name
from mlxceld.models.tensor_modes import Mode, TensorModes
from mlxceld.roles.options import (
    DEFAULT_DRAFT_TOKENS,
    REASONING_FIELDS,
    UNKNOWN_FIELDS,
    HandoffOptions,
    KVQuant,
    PipelineOptions,
    ReplicasOptions,
    RouterOptions,
    ServingOptions,
)
from mlxceld.types import DEFAULT_SILENCE_S, HYBRID, NodeRole

if TYPE_CHECKING:
    from mlxceld.config.daemon import Overrides

log = logging.getLogger(__name__)

ROUTER: Final = roles.ROUTER  # the worker's name and role
SERVE_KEYS = {"model", "model_name", "host", "port", "api_key_file", "max_batch", "max_queued",
              "max_connections", "header_timeout_s", "body_timeout_s", "write_timeout_s",
              "stage_silence_s",
              "max_tokens", "serving_port", "node_role", "replicas", "prefill_peers",
              "pipeline_coordinator", "standby",
              "decode_peers", "kv_compression", "tp_size", "tp_peers", "context_length",
              "tp_moe_mode", "tp_embedding_mode", "tp_lm_head_mode",
              "prompt_cache_bytes", "kv_bits", "kv_group_size", "quantized_kv_start",
              "draft_model", "num_draft_tokens",
              "allowed_origins", "generation_config", "reasoning_field",
              "unknown_fields", "metrics_require_key"}


@dataclass(frozen=True)
class ServeConfig:
    model: str | None = None  # absolute local path or a Hugging Face repo id; None: idle
    model_name: str | None = None  # the names, the primary first, joined by commas
    host: str = "127.0.0.1"
    port: int = 8080
    api_key_file: Path | None = None
    max_batch: int = 8
    max_queued: int = 64
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    write_timeout_s: float = 20.0
    stage_silence_s: float = DEFAULT_SILENCE_S
    max_tokens: int | None = None  # None: a completion is bounded by the context only
    serving_port: int = 0  # the serving listener's port, with a secret (0: ephemeral)
    node_role: NodeRole = HYBRID  # config/replicas.py
    replicas: tuple[str, ...] = ()  # a router's replicas' agent addresses, normalized
    pipeline_coordinator: str | None = None  # config/front.py: a pipeline's second router
    standby: bool = False  # config/front.py: ... and a standby coordinator (daemon/standby.py)
    prefill_peers: tuple[str, ...] = ()  # config/disagg.py: agent addresses, normalized
    decode_peers: tuple[str, ...] = ()
    kv_compression: str = "none"
    tp_size: int = 1  # tensor-parallel ranks on this host (models/tensor.py); 1: none
    # config/tensor_modes.py: as said (None: not said); each what mlx-lm's split does
    tp_moe_mode: Mode | None = None
    tp_embedding_mode: Mode | None = None
    tp_lm_head_mode: Mode | None = None
    tp_peers: tuple[str, ...] = ()  # config/tensor.py: ranks 1.. on these hosts' agents
    context_length: int | None = None  # a cap on the model's context; None: the model's
    prompt_cache_bytes: int | None = None  # the engine's prompt cache; None: its default
    kv_quant: KVQuant | None = None  # kv_bits & co (config/kvquant.py); None: full precision
    draft_model: str | None = None  # config/speculative.py: the draft; None: none
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    metrics_require_key: bool = True  # /metrics needs the API key, when there is one
    reasoning_field: str = REASONING_FIELDS[0]  # api/reasoning.py
    unknown_fields: str = UNKNOWN_FIELDS[0]  # api/ignoring.py
    allowed_origins: tuple[str, ...] = ()  # CORS (config/clients.py); (): none
    generation_config: GenerationConfig = "auto"

    @property
    def tp_modes(self) -> TensorModes:
        return TensorModes(self.tp_moe_mode, self.tp_embedding_mode, self.tp_lm_head_mode)

    @property
    def served_names(self) -> tuple[str, ...]:
        """The model's names: the id clients see, then its aliases."""
        assert self.model is not None
        names = tuple(n for n in (self.model_name or "").split(",") if n)
        # A repo id's (or its cache snapshot's) name, else the directory's.
        return names or (model_name(Path(self.model.rstrip("/"))).split("/")[-1],)

    @property
    def served_name(self) -> str:
        return self.served_names[0]

    def with_model(self, model: str, name: str | None = None) -> ServeConfig:
        return replace(self, model=model, model_name=name)


def resolve_model(value: str, base: Path, what: str) -> str:
    """A local directory becomes an absolute path; ``org/name`` that is not a local path is
    taken as a Hugging Face repo id (mlx-lm's loader); anything else is an error naming it."""
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base / path
    if path.is_dir():
        return str(path.resolve())
    if path.exists():
        raise ConfigError(f"{what}: model {value!r} is a file, not a model directory",
                          hint="point it at the directory holding config.json")
    if is_repo_id(value):  # fetched as models/fetch.py says
        return value
    raise ConfigError(f"{what}: model directory {path} does not exist",
                      hint="give a local mlx-lm model directory (python -m "
                      "mlxceld.models.fixtures DIR writes a test model)")


def parse_serve(table: Mapping[str, Any], flags: Overrides, base: Path,
                where: str) -> ServeConfig:
    for key in table:
        if key not in SERVE_KEYS:
            raise ConfigError(f"{where}: unknown key 'serve.{key}'",
                              hint=f"known keys here: {', '.join(sorted(SERVE_KEYS))}")
    modes = parse_tp_modes(flags.tp_modes, table, where)
    cfg = ServeConfig(
        host=_typed(table, "host", str, where) or "127.0.0.1",
        port=_port(_typed(table, "port", int, where) or 8080, f"{where}: 'serve.port'"),
        model_name=parse_model_names(table.get("model_name"), f"{where}: 'serve.model_name'"),
        allowed_origins=parse_origins(flags.allowed_origins, table, where),
        generation_config=parse_generation_config(flags.generation_config, table, where),
        max_batch=_positive(table, "max_batch", 8, where),
        max_queued=_positive(table, "max_queued", 64, where),
        max_connections=_positive(table, "max_connections", 1024, where),
        header_timeout_s=_seconds(table, "header_timeout_s", 10.0, where),
        body_timeout_s=_seconds(table, "body_timeout_s", 60.0, where),
        write_timeout_s=_seconds(table, "write_timeout_s", 20.0, where),
        stage_silence_s=_seconds(table, "stage_silence_s", DEFAULT_SILENCE_S, where),
        max_tokens=_max_tokens(flags.max_tokens, table, where),
        context_length=_context_length(flags.context_length, table, where),
        prompt_cache_bytes=_prompt_cache_bytes(table, where),
        serving_port=_serving_port(flags.serving_port, table, where),
        metrics_require_key=metrics_require_key(table, where),
        tp_size=parse_tp_size(flags.tp_size, table, where),
        tp_moe_mode=modes.moe, tp_embedding_mode=modes.embedding,
        tp_lm_head_mode=modes.lm_head,
        kv_quant=parse_kv_quant({"kv_bits": flags.kv_bits,
                                 "kv_group_size": flags.kv_group_size,
                                 "quantized_kv_start": flags.quantized_kv_start}, table, where),
        reasoning_field=_choice(table, "reasoning_field", REASONING_FIELDS, where),
        unknown_fields=_choice(table, "unknown_fields", UNKNOWN_FIELDS, where),
    )
    role, role_from = parse_role(flags.node_role, table, where)
    replicas, replicas_from = parse_replica_list(flags.replicas, table, where)
    prefill, prefill_from = parse_peer_list("prefill_peers", flags.prefill_peers, table, where)
    decode, decode_from = parse_peer_list("decode_peers", flags.decode_peers, table, where)
    check_pools(role, role_from, prefill, prefill_from, decode, decode_from, replicas)
    check_role(role, role_from, replicas, replicas_from)
    front, front_from = parse_pipeline_coordinator(flags.pipeline_coordinator, table, where)
    check_front(front, front_from, role, replicas + prefill + decode)
    tp_peers, _ = parse_tp_peers(flags.tp_peers, table, where)
    cfg = replace(cfg, node_role=role, replicas=replicas, prefill_peers=prefill, tp_peers=tp_peers,
                  pipeline_coordinator=front,
                  standby=parse_standby(flags.standby, table, where, front),
                  decode_peers=decode,
                  kv_compression=parse_compression(flags.kv_compression, table, where))
    model = flags.model or _typed(table, "model", str, where)
    if model:
        origin = "--model" if flags.model else f"{where}: 'serve.model'"
        cfg = replace(cfg, model=resolve_model(model, Path.cwd() if flags.model else base,
                                               origin))
    draft = flags.draft_model or _typed(table, "draft_model", str, where)
    if draft:
        origin = "--draft-model" if flags.draft_model else f"{where}: 'serve.draft_model'"
        cfg = replace(cfg, draft_model=resolve_model(draft, Path.cwd() if flags.draft_model
                                                     else base, origin))
    cfg = replace(cfg, num_draft_tokens=parse_draft_tokens(flags.num_draft_tokens, table,
                                                           where, cfg.draft_model))
    key_file = flags.api_key_file or _typed(table, "api_key_file", str, where)
    if key_file:
        p = Path(key_file).expanduser()
        cfg = replace(cfg, api_key_file=p if p.is_absolute() or flags.api_key_file
                      else base / p)
    if flags.model_name:
        cfg = replace(cfg, model_name=parse_model_names(flags.model_name, "--model-name"))
    if flags.host:
        cfg = replace(cfg, host=flags.host)
    if flags.port is not None:
        cfg = replace(cfg, port=_port(flags.port, "--port"))
    return cfg


def read_api_key(path: Path) -> str:
    """The key is the file's content less one trailing newline; never logged or echoed."""
    try:
        st = path.stat()
        raw = path.read_text()
    except OSError as exc:
        raise ConfigError(f"API key file {path} cannot be read: {exc.strerror}",
                          hint="check --api-key-file / MLXCEL_API_KEY_FILE") from exc
    if stat.S_IMODE(st.st_mode) & 0o077:
        log.warning("API key file %s is readable by group or others; chmod 600 it", path)
    key = raw[:-2] if raw.endswith("\r\n") else raw[:-1] if raw.endswith("\n") else raw
    if len(key) < 8 or any(c.isspace() for c in key):
        raise ConfigError(f"API key file {path} must hold one key of at least 8 characters "
                          "without spaces", hint="write the key on one line, then chmod 600")
    return key


_KINDS: dict[type, str] = {int: "an integer", float: "a number", str: "a string"}


def _typed(table: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) or value == "":
        raise ConfigError(f"{where}: 'serve.{key}' must be {_KINDS.get(kind, kind.__name__)}, "
                          f"not {value!r}",
                          hint=f"see the [serve] example in {__name__.replace('.', '/')}.py")
    return value


def _choice(table: Mapping[str, Any], key: str, choices: tuple[str, ...], where: str) -> str:
    """One of ``choices`` (the first when absent)."""
    value = _typed(table, key, str, where)
    if value is None:
        return choices[0]
    if value not in choices:
        raise ConfigError(f"{where}: 'serve.{key}' must be one of {', '.join(choices)}, not "
                          f"{value!r}", hint=f"for example {key} = {choices[0]!r}")
    return str(value)


def _positive(table: Mapping[str, Any], key: str, default: int, where: str) -> int:
    value = _typed(table, key, int, where)
    if value is None:
        return default
    if value < 1:
        raise ConfigError(f"{where}: 'serve.{key}' must be at least 1, not {value}",
                          hint=f"for example {key} = {default}")
    return int(value)


def _max_tokens(flag: int | None, table: Mapping[str, Any], where: str) -> int | None:
    return _optional_positive(flag, table, "max_tokens", 4096, where,
                              "leave it out to bound a completion by the context only")


def _context_length(flag: int | None, table: Mapping[str, Any], where: str) -> int | None:
    return _optional_positive(flag, table, "context_length", 32768, where,
                              "leave it out to serve the model's own context")


def _optional_positive(flag: int | None, table: Mapping[str, Any], key: str, example: int,
                       where: str, unset: str) -> int | None:
    """``--KEY`` (winning) or ``serve.KEY``: an integer at least 1, or None when neither is
    given (``unset``: what leaving it out does, the flag's hint)."""
    if flag is not None:
        if flag < 1:
            raise ConfigError(f"--{key.replace('_', '-')} must be at least 1, not {flag}",
                              hint=unset)
        return flag
    if table.get(key) is None:
        return None
    return _positive(table, key, example, where)


def _prompt_cache_bytes(table: Mapping[str, Any], where: str) -> int | None:
    value = _typed(table, "prompt_cache_bytes", int, where)
    if value is None:
        return None
    if value < 0:
        raise ConfigError(f"{where}: 'serve.prompt_cache_bytes' must be 0 or more, not "
                          f"{value}", hint="a number of bytes, e.g. 2147483648 (2 GiB); "
                          "0 turns the prompt cache off")
    return int(value)


def _seconds(table: Mapping[str, Any], key: str, default: float, where: str) -> float:
    value = table.get(key)
    if value is None:
        return default
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value < math.inf:
        raise ConfigError(f"{where}: 'serve.{key}' must be a number of seconds above 0, not "
                          f"{value!r}", hint=f"for example {key} = {default}")
    return float(value)


def _serving_port(flag: int | None, table: Mapping[str, Any], where: str) -> int:
    port = flag if flag is not None else _typed(table, "serving_port", int, where) or 0
    what = "--serving-port" if flag is not None else f"{where}: 'serve.serving_port'"
    if not 0 <= port <= 65535:
        raise ConfigError(f"{what}: port {port} is out of range",
                          hint="use 1-65535, or 0 for an ephemeral port")
    return int(port)


def _port(port: int, what: str) -> int:
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what}: port {port} is out of range", hint="use 1-65535")
    return port


def router_options(cfg: ServeConfig, pipeline: PipelineOptions | None = None,
                   serving: ServingOptions | None = None,
                   replicas: ReplicasOptions | None = None,
                   handoff: HandoffOptions | None = None) -> RouterOptions:
    """The router worker's options: ``cfg``'s model, locally or over ``pipeline``, and its
    serving listener's (``serving``: None without a cluster secret); or, on a router node,
    over ``replicas``."""
    assert cfg.model is not None
    return RouterOptions(model=cfg.model, model_name=cfg.served_name,
                         model_aliases=cfg.served_names[1:], host=cfg.host,
                         port=cfg.port, max_batch=cfg.max_batch, max_queued=cfg.max_queued,
                         pipeline=pipeline, replicas=replicas, handoff=handoff,
                         max_connections=cfg.max_connections,
                         header_timeout_s=cfg.header_timeout_s,
                         body_timeout_s=cfg.body_timeout_s,
                         write_timeout_s=cfg.write_timeout_s,
                         stage_silence_s=cfg.stage_silence_s, max_tokens=cfg.max_tokens,
                         serving=serving, tp_size=cfg.tp_size,
                         context_length=cfg.context_length,
                         prompt_cache_bytes=cfg.prompt_cache_bytes, kv_quant=cfg.kv_quant,
                         # a pipeline's draft runs on its last stage (speculating.py)
                         draft_model=cfg.draft_model if pipeline is None else None,
                         num_draft_tokens=cfg.num_draft_tokens,
                         allowed_origins=cfg.allowed_origins,
                         generation_config=cfg.generation_config,
                         reasoning_field=cfg.reasoning_field,
                         unknown_fields=cfg.unknown_fields,
                         metrics_open=not cfg.metrics_require_key)
