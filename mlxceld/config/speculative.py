"""Speculative decoding: ``--draft-model``, ``--num-draft-tokens``.

``[serve]`` in the config file (flags win)::

    [serve]
    draft_model = "~/models/qwen3-0.6b"  # a local mlx-lm directory or a Hugging Face
                                    # repo id, with the served model's tokenizer
    num_draft_tokens = 4            # k: tokens the draft proposes a pass, 1-32

With ``draft_model``, the local engine (alone, or rank 0 of a tensor-parallel group: it
runs the draft, ``mlxceld/engine/solo.py``) decodes a sequence that runs alone speculatively:
the draft proposes ``num_draft_tokens`` tokens, the model checks them in one pass and
keeps those it agrees with (greedy output is the model's own, token for token; above
temperature 0 the standard rejection rule keeps its distribution).
``mlxceld/engine/speculative.py`` says exactly when a sequence speculates and when it
decodes batched instead; ``/metrics`` and ``mlxctl status`` show the tokens proposed and
accepted, the acceptance rate and the tokens per pass. With ``kv_bits`` the model's cache
is quantized as without a draft (the draft's stays plain), greedy output unchanged.

Refused at start (exit 2, naming the key or flag), and on a SIGHUP reload:

- ``num_draft_tokens`` out of range, or without ``draft_model``;
- a draft whose vocabulary is not the model's (config.json's ``vocab_size`` and the
  tokenizer's tokens: ``mlxceld/models/drafts.py``), judged here for two local
  directories, by the router worker as it loads for a repo id (it exits naming
  ``serve.draft_model``);
- on a pipeline's stage host (``pp_peer``) or any daemon of a cluster TOML
  (``distributed_config``): a pipeline's draft is its cluster TOML's ``[cluster]
  draft_model`` and ``num_draft_tokens``, which each group's last stage runs
  (``mlxceld/pipeline/speculating.py``). On a ``pp_auto`` coordinator they are what
  its plans' TOML carry (``cluster/plan/candidates.py``'s ``drafted``): the draft must
  be at that path on the last stage's host, or a repo id each fetches;
- where it is not built yet: every ``node_role`` but hybrid (a router over replicas
  holds no model; prefill and decode nodes hand caches over);
- by the router worker as it loads them: a model or draft with sliding-window layers
  (gemma3, gpt_oss), whose caches cannot be trimmed back to the accepted tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.models.drafts import check_draft
from mlxceld.roles.options import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS
from mlxceld.types import HYBRID

FLAGS: Final = {"draft_model": "--draft-model", "num_draft_tokens": "--num-draft-tokens"}
HINT: Final = "see mlxceld/config/speculative.py: speculative decoding runs in the local engine"


def parse_draft_tokens(flag: int | None, table: Mapping[str, Any], where: str,
                       draft: str | None) -> int:
    """``--num-draft-tokens`` over ``serve.num_draft_tokens``: k, with a draft only."""
    value: object = flag if flag is not None else table.get("num_draft_tokens")
    what = FLAGS["num_draft_tokens"] if flag is not None \
        else f"{where}: 'serve.num_draft_tokens'"
    if value is None:
        return DEFAULT_DRAFT_TOKENS
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_DRAFT_TOKENS:
        raise ConfigError(f"{what} must be a number of tokens in 1-{MAX_DRAFT_TOKENS}, not "
                          f"{value!r}", hint=f"{DEFAULT_DRAFT_TOKENS} is the default")
    if draft is None:
        raise ConfigError(f"{what} means nothing without draft_model: nothing proposes "
                          "tokens", hint="set draft_model too (--draft-model), or leave "
                          "num_draft_tokens out")
    return value


def check_draft_setting(draft: str | None, origin: str, *, model: str | None,
                        node_role: str, pipeline: str | None) -> None:
    """A draft only where speculative decoding is built: the local engine, its model here
    alone; and for two local directories, the draft's tokenizer is the model's."""
    if draft is None:
        return
    why = (f"node_role {node_role} (--node-role): only a hybrid node runs the model with "
           "the local engine" if node_role != HYBRID
           else f"{pipeline}: a pipeline's draft is the cluster TOML's [cluster] "
           "draft_model (its last stage runs it: mlxceld/pipeline/speculating.py), or "
           "the --pp-auto coordinator's" if pipeline is not None and "pp_auto" not in pipeline
           else None)
    if why is not None:
        raise ConfigError(f"{origin} with {why}", hint=HINT)
    if model is not None and Path(model).is_dir() and Path(draft).is_dir():
        check_draft(Path(model), Path(draft), origin)


def draft_origin(flag: str | None, where: str) -> str:
    """Where ``draft_model`` was said, for messages: the flag, or the file's key."""
    return FLAGS["draft_model"] if flag is not None else f"{where}: 'serve.draft_model'"
