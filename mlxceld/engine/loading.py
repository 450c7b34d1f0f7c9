"""Building a local engine: a checkpoint loaded with mlx-lm (its weights read layer by layer,
with progress), checked for what it is asked to keep (a quantized KV cache), and the
``LocalEngine`` over it with its context, prompt cache and constrained decoding."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxceld.engine.constraints import ConstraintError, ConstraintTokenizer
from mlxceld.engine.kvquant import kv_refusal
from mlxceld.engine.local import LocalEngine
from mlxceld.engine.speculative import Draft, Speculation
from mlxceld.engine.tensor import Mirror
from mlxceld.errors import ConfigError
from mlxceld.models.context import served_context
from mlxceld.models.drafts import check_draft
from mlxceld.models.kvquant import KV_HINT, check_kv_quant
from mlxceld.models.reading import Progress, model_layers, read_weights
from mlxceld.roles.options import DEFAULT_DRAFT_TOKENS, KVQuant

log = logging.getLogger(__name__)


def load_local_engine(path: str, *, model_id: str | None = None, max_batch: int = 8,
                      on_failure: Callable[[BaseException], None] | None = None,
                      progress: Progress | None = None, context_length: int | None = None,
                      prompt_cache_bytes: int | None = None,
                      kv_quant: KVQuant | None = None, draft_model: str | None = None,
                      num_draft_tokens: int = DEFAULT_DRAFT_TOKENS
                      ) -> tuple[LocalEngine, Any]:
    """Load a checkpoint with mlx-lm; return the engine and mlx-lm's TokenizerWrapper.
    mlx-lm builds the model lazily; its weights are then read layer by layer, each step
    told to ``progress(done, total)`` in parameter bytes (``models/reading.py``).
    ``context_length``: a cap on the model's context (``models/context.py``);
    ``prompt_cache_bytes``: the prompt cache's bound (``LocalEngine``). A model that cannot
    keep ``kv_quant``'s cache is refused before its weights are read. ``draft_model``: a
    local directory of a model with the same tokenizer (checked first: ``models/drafts.py``),
    which proposes ``num_draft_tokens`` at a time (``engine/speculative.py``)."""
    from mlx_lm import load

    loaded: Any = load(path, lazy=True, return_config=True)
    model, tokenizer, config = loaded
    check_kv(model, config, kv_quant, str(Path(path) / "config.json"))
    draft = None if draft_model is None \
        else load_draft(path, model, config, draft_model, num_draft_tokens)
    read_weights(model_layers(model), model, progress)
    return engine_for(model, tokenizer, config, model_id=model_id or Path(path).name,
                      max_batch=max_batch, on_failure=on_failure,
                      context_length=context_length, prompt_cache_bytes=prompt_cache_bytes,
                      kv_quant=kv_quant, draft=draft), tokenizer


def load_draft(path: str, model: Any, config: dict[str, Any], draft_model: str,
               num_draft_tokens: int) -> Draft:
    """The draft at ``draft_model`` for the model at ``path`` (``model``, its ``config``):
    its tokenizer checked first (``models/drafts.py``), then that both models' caches
    trim back to the accepted tokens (``ConfigError`` naming ``serve.draft_model``)."""
    from mlx_lm import load

    check_draft(Path(path), Path(draft_model), "serve.draft_model")
    draft = Draft(load(draft_model)[0], num_draft_tokens)
    if not Speculation.trimmable(model, draft):
        family = config.get("model_type") or getattr(model, "model_type", "?")
        raise ConfigError(f"serve.draft_model: model family {family!r} (or the draft's) "
                          "keeps a KV cache that cannot be trimmed back to the accepted "
                          "tokens (a sliding window's), which speculative decoding needs",
                          hint="leave draft_model out for this model")
    return draft


def engine_for(model: Any, tokenizer: Any, config: dict[str, Any], *, model_id: str,
               max_batch: int, on_failure: Callable[[BaseException], None] | None = None,
               mirror: Mirror | None = None, context_length: int | None = None,
               prompt_cache_bytes: int | None = None,
               kv_quant: KVQuant | None = None, draft: Draft | None = None) -> LocalEngine:
    """The engine over a loaded ``model`` (its weights read), with mlx-lm's tokenizer and
    the model's config; its context the model's, capped at ``context_length``; with
    ``kv_quant``, the model was checked for it (``check_kv``)."""
    context = served_context(config, context_length, model_id)
    vocab = int(config.get("vocab_size") or model.args.vocab_size)
    eos = set(tokenizer.eos_token_ids)
    return LocalEngine(model, model_id=model_id, context_length=context,
                       eos_token_ids=eos, vocab_size=vocab, max_batch=max_batch,
                       on_failure=on_failure, mirror=mirror, kv_quant=kv_quant,
                       constraints=constraint_tokenizer(tokenizer, vocab, eos),
                       prompt_cache_bytes=prompt_cache_bytes, draft=draft)


def constraint_tokenizer(tokenizer: Any, vocab_size: int, eos_token_ids: set[int]
                         ) -> ConstraintTokenizer | ConstraintError:
    """llguidance's tokenizer from mlx-lm's ``TokenizerWrapper`` (its Hugging Face tokenizer),
    or why there is none (logged once: constrained requests are then refused)."""
    try:
        return ConstraintTokenizer(tokenizer._tokenizer, vocab_size=vocab_size,
                                   eos_token_ids=eos_token_ids)
    except ConstraintError as exc:
        log.warning("%s; requests with a response_format will be refused", exc)
        return exc


def check_kv(model: Any, config: dict[str, Any], kv_quant: KVQuant | None,
             source: str) -> None:
    """Refuse (``ConfigError`` naming ``serve.kv_bits`` and the family) a quantized KV cache
    that ``model`` (its config.json: ``config``; ``source`` names it) cannot keep: from
    config.json (``models/kvquant.py``), then the loaded model itself (``kv_refusal``)."""
    if kv_quant is None:
        return
    check_kv_quant(config, kv_quant, source=source)
    why = kv_refusal(model, kv_quant)
    if why is not None:
        family = config.get("model_type") or getattr(model, "model_type", "?")
        raise ConfigError(f"serve.kv_bits = {kv_quant.bits}: {source}: model family "
                          f"{family!r} cannot keep a quantized KV cache: {why}", hint=KV_HINT)
