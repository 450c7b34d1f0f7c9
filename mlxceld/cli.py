"""``mlxceld``: flags and the config file become one typed Config; then the daemon runs.

It stays in the foreground and logs to stderr (or --log-file); launchd,
systemd or ``brew services`` supervise it.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer

from mlxceld import __version__
from mlxceld.config.daemon import LOG_LEVELS, Overrides, load_config
from mlxceld.errors import ConfigError, DamagedState, MlxceldError
from mlxceld.logformat import LogFormat, formatter, stderr_is_journal
from mlxceld.supervisor.logfiles import RotatingLog

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _version(value: bool) -> None:
    if value:
        typer.echo(f"mlxceld {__version__}")
        raise typer.Exit()


@app.command()
def run(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Config file (TOML). Default: mlxceld.toml in the platform's "
        "config dir, if it exists.")] = None,
    state_dir: Annotated[Path | None, typer.Option(
        "--state-dir", help="Where the daemon keeps everything (database, logs, sockets).")
    ] = None,
    socket: Annotated[Path | None, typer.Option(
        "--socket", help="Control socket path. Default: $XDG_RUNTIME_DIR/mlxceld/mlxceld.sock, "
        "else <state-dir>/mlxceld.sock.")] = None,
    socket_group: Annotated[str | None, typer.Option(
        "--socket-group", help="Let this group's members use the control socket (0660, its "
        "directory 0750, both of the group). Default: only root and the daemon's user.")
    ] = None,
    log_level: Annotated[str | None, typer.Option(
        "--log-level", help=f"One of {', '.join(LOG_LEVELS)}. Default: info.")] = None,
    log_file: Annotated[Path | None, typer.Option(
        "--log-file", help="Log here instead of stderr; reopened on SIGHUP.")] = None,
    log_format: Annotated[str | None, typer.Option(
        "--log-format", help="text, or json: one object a line (time, level, logger, "
        "message and the access log's fields), for the daemon and its workers. Default: "
        "text.")] = None,
    model: Annotated[str | None, typer.Option(
        "--model", help="Serve this model: a local mlx-lm directory or a Hugging Face repo id "
        "(overrides [serve] model).")] = None,
    model_name: Annotated[str | None, typer.Option(
        "--model-name", help="The model id clients see (default: the directory name); "
        "a,b,...: the first is the id, the others aliases a request may name it by.")
    ] = None,
    host: Annotated[str | None, typer.Option(
        "--host", help="Address of the OpenAI-compatible port. Default: 127.0.0.1.")] = None,
    port: Annotated[int | None, typer.Option(
        "--port", help="The OpenAI-compatible port. Default: 8080.")] = None,
    api_key_file: Annotated[Path | None, typer.Option(
        "--api-key-file", envvar="MLXCEL_API_KEY_FILE", show_envvar=True,
        help="Require this API key (Authorization: Bearer) on the OpenAI port.")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="The most tokens one completion generates; a request without "
        "max_tokens gets this many or what is left of the context, one asking for more is "
        "refused. Default: no bound but the context.")] = None,
    context_length: Annotated[int | None, typer.Option(
        "--context-length", help="Cap the model's context (prompt and completion tokens "
        "together) to this; a cap above the model's own serves the model's. Default: the "
        "model's own.")] = None,
    cluster_secret_file: Annotated[Path | None, typer.Option(
        "--cluster-secret-file", help="The cluster secret (at least 16 bytes; one trailing "
        "newline is trimmed). Wins over MLXCEL_CLUSTER_SECRET_FILE, MLXCEL_CLUSTER_SECRET and "
        "the keyring; installed into the keyring as its primary.")] = None,
    agent_addr: Annotated[str | None, typer.Option(
        "--agent-addr", help="MXCL agent listener (channels assignment and agent), started "
        "whenever the daemon has a cluster secret. Default: 0.0.0.0:19000.")] = None,
    distributed_config: Annotated[Path | None, typer.Option(
        "--distributed-config", help="A cluster TOML (see mlxcel-cluster.toml(5)): this daemon "
        "runs its node's role, the router of a pipeline or one stage. Needs --node-id.")
    ] = None,
    node_id: Annotated[str | None, typer.Option(
        "--node-id", help="Which node of the --distributed-config this daemon is.")] = None,
    cluster_name: Annotated[str | None, typer.Option(
        "--cluster-name", help="The cluster this daemon belongs to (1-128 characters). "
        "Default: mlxcel-cluster.")] = None,
    cluster_peers: Annotated[str | None, typer.Option(
        "--cluster-peers", help="Peer agent addresses, host:port,... ([v6]:port for IPv6), "
        "polled for their inventory; see `mlxctl cluster nodes`.")] = None,
    cluster_discovery: Annotated[str | None, typer.Option(
        "--cluster-discovery", help="static (only --cluster-peers) or mdns (also signed "
        "mDNS records on the local network). Default: static.")] = None,
    pp_auto: Annotated[int | None, typer.Option(
        "--pp-auto", help="Plan an N-stage pipeline of --model over the peers discovery finds "
        "and assign it to them (two-phase; with --dry-run: print the plan and exit).")] = None,
    mesh: Annotated[str | None, typer.Option(
        "--mesh", help="With --pp-auto N: run the N hosts as pp (a pipeline of N stages, "
        "the default), tp (one tensor group of N ranks), 2d (stages of tensor groups) or "
        "auto (the least predicted time per token).")] = None,
    pp_peer: Annotated[bool, typer.Option(
        "--pp-peer", help="Take a pipeline stage of --model from a --pp-auto coordinator "
        "(otherwise offers are refused).")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="With --pp-auto: plan, print the table, write --cluster-config-out, "
        "exit without assigning.")] = False,
    reset_state: Annotated[bool, typer.Option(
        "--reset-state", help="If the state database is damaged, move it aside (to "
        "state.db.damaged-TIME, never deleted) and start as a new node; a sound one is kept. "
        "Otherwise a damaged database stops the start (exit 2).")] = False,
    cluster_config_out: Annotated[Path | None, typer.Option(
        "--cluster-config-out", help="Write the plan as a cluster TOML here "
        "(--distributed-config accepts it unchanged).")] = None,
    stage_ports: Annotated[str | None, typer.Option(
        "--stage-ports", help="Ports for assigned stage listeners: PORT or FIRST-LAST "
        "(inclusive), proposed to coordinators and required of offers. Default: ephemeral "
        "ports.")] = None,
    serving_port: Annotated[int | None, typer.Option(
        "--serving-port", help="With a cluster secret: the port of the serving listener, where "
        "the cluster's routers send this node sequences (MXCL, on the agent listener's "
        "host). Default: 0, an ephemeral port.")] = None,
    node_role: Annotated[str | None, typer.Option(
        "--node-role", help="hybrid (run the model here), router (model-free: spread "
        "requests over --replicas, or --prefill-peers and --decode-peers), prefill or decode "
        "(serve a router's disaggregation on the serving listener only), "
        "tensor_parallel_rank (a rank of another host's --tp-peers group). All but hybrid "
        "need the cluster secret. Default: hybrid.")] = None,
    replicas: Annotated[str | None, typer.Option(
        "--replicas", help="With --node-role router: the replicas' agent addresses, "
        "host:port,... (a host alone: port 19000; [v6] for IPv6); none: found by "
        "discovery (--cluster-peers or mdns).")] = None,
    pipeline_coordinator: Annotated[str | None, typer.Option(
        "--pipeline-coordinator", help="With --node-role router: serve the pipeline that "
        "coordinator serves (its agent address, host:port or a host alone for port 19000), "
        "as a second front; the plan is asked of it and followed.")] = None,
    standby: Annotated[bool, typer.Option(
        "--standby", help="With --pipeline-coordinator: a standby coordinator, which takes "
        "over the plan's healing and drains when the coordinator stays unreachable while "
        "the plan's stage hosts answer (mlxceld(8) STANDBY).")] = False,
    prefill_peers: Annotated[str | None, typer.Option(
        "--prefill-peers", help="With --node-role router or decode: the prefill nodes' "
        "agent addresses, as --replicas (numeric addresses).")] = None,
    decode_peers: Annotated[str | None, typer.Option(
        "--decode-peers", help="With --node-role router: the decode nodes' agent "
        "addresses, as --replicas (numeric addresses).")] = None,
    kv_compression: Annotated[str | None, typer.Option(
        "--kv-compression", help="With --node-role router and --prefill-peers: how KV caches "
        "travel from prefill to decode nodes: none, int8 or int4, each optionally +lz4. "
        "Default: none.")] = None,
    tp_size: Annotated[int | None, typer.Option(
        "--tp-size", help="Split the model over N processes of this host (tensor "
        "parallelism, 1-16): the router is rank 0, workers tp-1 .. tp-N-1 the others, "
        "restarted together. The model's family must have mlx-lm shard support and N "
        "must divide its heads and KV heads. Default: 1.")] = None,
    tp_moe_mode: Annotated[str | None, typer.Option(
        "--tp-moe-mode", help="With --tp-size: shard (each expert cut across the ranks, as "
        "mlx-lm splits it); replicate is refused. Default: shard.")] = None,
    tp_embedding_mode: Annotated[str | None, typer.Option(
        "--tp-embedding-mode", help="With --tp-size: replicate (the token embedding whole "
        "on every rank, as mlx-lm splits it); shard is refused. Default: replicate.")] = None,
    tp_lm_head_mode: Annotated[str | None, typer.Option(
        "--tp-lm-head-mode", help="With --tp-size: the head as mlx-lm splits the model's "
        "family: replicate for most, shard for qwen3.5's untied head; the other value is "
        "refused. Default: the family's.")] = None,
    tp_peers: Annotated[str | None, typer.Option(
        "--tp-peers", help="With --tp-size N: run ranks 1 .. N-1 on other hosts, named by "
        "their agent addresses in rank order (host:port,...; a host alone: port 19000), "
        "each started with --node-role tensor_parallel_rank and the same model; needs the "
        "cluster secret.")] = None,
    kv_bits: Annotated[int | None, typer.Option(
        "--kv-bits", help="Quantize the KV cache to 4 or 8 bits (about 0.28 or 0.53 of a "
        "16-bit cache's memory), on the local engine, tensor-parallel ranks and pipeline "
        "stages. Default: none (full precision).")] = None,
    kv_group_size: Annotated[int | None, typer.Option(
        "--kv-group-size", help="With --kv-bits: elements per scale and bias, 32, 64 or "
        "128. Default: 64.")] = None,
    quantized_kv_start: Annotated[int | None, typer.Option(
        "--quantized-kv-start", help="With --kv-bits: a layer's cache is quantized once it "
        "holds this many tokens (mlx-lm's meaning). Default: 0, from the first token.")
    ] = None,
    draft_model: Annotated[str | None, typer.Option(
        "--draft-model", help="Speculative decoding: a draft model (a directory or a "
        "Hugging Face repo id) with the model's tokenizer, which proposes tokens the model "
        "checks in one pass, for a sequence running alone on the local engine. Default: "
        "none.")] = None,
    num_draft_tokens: Annotated[int | None, typer.Option(
        "--num-draft-tokens", help="With --draft-model: tokens proposed a pass, 1-32. "
        "Default: 4.")] = None,
    allowed_origins: Annotated[str | None, typer.Option(
        "--allowed-origins", help="CORS on the OpenAI port: the origins whose pages may call "
        "it, scheme://host[:port],... or * for any. Default: none (no CORS headers).")
    ] = None,
    generation_config: Annotated[str | None, typer.Option(
        "--generation-config", help="auto: sampling fields a request leaves out take the "
        "model's generation_config.json values (as vLLM does); none: OpenAI's defaults. "
        "Default: auto.")] = None,
    check_config: Annotated[bool, typer.Option(
        "--check-config", help="Check the config file and the flags as a start would "
        "(keys, values, files, the model, the secret's source) and exit: 0 and \"config OK\", "
        "or 2 and the first error. Starts nothing, writes nothing.")] = False,
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run the mlxceld daemon in the foreground."""
    flags = overrides(ctx.params)
    if check_config:
        check(flags)
    try:
        cfg = load_config(flags)
        setup_logging(cfg.log_level, cfg.log_file, cfg.log_format,
                      cfg.log_file_max_bytes, cfg.log_file_backups)
        from mlxceld.daemon import serve  # after logging: importing it pulls uvicorn in

        code = asyncio.run(serve(cfg, flags, Terminal()))
    except (ConfigError, DamagedState) as exc:  # starting again as is cannot help
        fail(exc, 2)
    except MlxceldError as exc:
        fail(exc, 1)
    raise typer.Exit(code)


def overrides(params: Mapping[str, Any]) -> Overrides:
    """The parsed flags, by parameter name, as ``Overrides`` (``--config`` is ``config_file``;
    ``--version`` has exited before)."""
    values = {k: v for k, v in params.items()
              if k not in ("config", "version", "check_config")}
    return Overrides(config_file=params.get("config"), **values)


def check(flags: Overrides) -> None:
    """``--check-config``: the start-up's checks that change nothing (``preflight``); its
    warnings (a secret file others may read) on stderr. Exits 0 or 2."""
    setup_logging("warning", None)
    from mlxceld.preflight import check_config

    try:
        cfg = check_config(flags)
    except MlxceldError as exc:  # whatever a start would refuse, it refuses with exit 2
        fail(exc, 2)
    source = cfg.config_file or "no config file (flags and defaults)"
    typer.echo(f"config OK: {source}")
    raise typer.Exit(0)


class Terminal:
    """What the daemon says on the terminal that started it: text on stdout, errors (and
    their hints) on stderr."""

    def say(self, text: str) -> None:
        typer.echo(text)

    def error(self, exc: MlxceldError) -> None:
        typer.echo(f"mlxceld: error: {exc.message}", err=True)
        if exc.hint:
            typer.echo(f"  hint: {exc.hint}", err=True)


def fail(exc: MlxceldError, code: int) -> None:
    Terminal().error(exc)
    raise typer.Exit(code)


def setup_logging(level: str, log_file: Path | None, log_format: LogFormat = "text",
                  max_bytes: int = 0, backups: int = 0) -> None:
    """The daemon's one handler: ``log_file`` (rotated at ``max_bytes``, ``backups`` kept;
    ``supervisor/logfiles.py``) or stderr (the journal's format where it is the journal)."""
    try:
        handler: logging.Handler = (RotatingLog(log_file, max_bytes, backups) if log_file
                                    else logging.StreamHandler(sys.stderr))
    except OSError as exc:
        raise ConfigError(f"log file {log_file} cannot be opened: {exc.strerror}",
                          hint="create its directory (writable by this user), or change "
                          "--log-file / [daemon] log_file") from None
    handler.setFormatter(formatter(log_format, journal=log_file is None
                                   and stderr_is_journal(sys.stderr)))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main() -> None:
    app()
