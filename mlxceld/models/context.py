"""A model's context length, and the one a router serves under ``[serve] context_length``.

The model's own is its config's ``max_position_embeddings`` (``max_seq_len`` in some
families; under ``text_config`` in multimodal checkpoints). The served one
(``served_context``) is the lesser of that and the operator's cap. A cap above the model's
own changes nothing (a warning says so): it is a ceiling, and one config file, or
``mlxctl serve``, serves models of several contexts. A config that states no context
serves the cap, else ``DEFAULT_CONTEXT``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

log = logging.getLogger(__name__)

DEFAULT_CONTEXT: Final = 4096  # a model whose config states no context, without a cap
_KEYS: Final = ("max_position_embeddings", "max_seq_len")


def model_context(config: Mapping[str, Any]) -> int | None:
    """The context ``config`` (a model's config.json) states, or None."""
    for table in (config, config.get("text_config")):
        if not isinstance(table, Mapping):
            continue
        for key in _KEYS:
            value = table.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                return value
    return None


def served_context(config: Mapping[str, Any], cap: int | None, model: str = "the model"
                   ) -> int:
    """The context a router serves ``model`` with (``config``: its config.json) under
    ``cap`` (``[serve] context_length``; None: no cap)."""
    own = model_context(config)
    if own is None:
        return cap or DEFAULT_CONTEXT
    if cap is None or cap >= own:
        if cap is not None and cap > own:
            log.warning("[serve] context_length %d is above %s's own context of %d tokens: "
                        "serving %d", cap, model, own, own)
        return own
    return cap
