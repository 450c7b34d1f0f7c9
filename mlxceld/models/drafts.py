"""A draft model for speculative decoding (``[serve] draft_model``): the same tokenizer as
its target, judged from the two directories' files (no mlx import).

A draft proposes token ids the target checks, and the two compare distributions over
the same ids: so the draft must have the target's vocabulary size (config.json's
``vocab_size``, at the top or under ``text_config``) and the same tokens under the same
ids. The tokens are read from ``tokenizer.json`` (its model's vocabulary and its added
tokens: other fields, a normalizer's or a template's, may differ), else compared as the
bytes of ``tokenizer.model`` or ``vocab.json``, the first of them the target has.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxceld.errors import ConfigError
from mlxceld.models.identity import read_model_config

VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
HINT = ("a draft must share its target's tokenizer: a smaller model of the same family "
        "(e.g. Qwen3-0.6B for Qwen3-8B)")


def check_draft(target: Path, draft: Path, what: str) -> None:
    """Refuse (``ConfigError`` naming ``what``: the flag or key) a draft whose vocabulary is
    not ``target``'s."""
    sizes = [_vocab_size(read_model_config(p)) for p in (target, draft)]
    if sizes[0] != sizes[1]:
        raise ConfigError(f"{what}: draft model {draft} has a vocabulary of {sizes[1]} "
                          f"tokens, the target {target} {sizes[0]}", hint=HINT)
    for name in VOCAB_FILES:
        ours = target / name
        if not ours.is_file():
            continue
        theirs = draft / name
        if not theirs.is_file():
            raise ConfigError(f"{what}: draft model {draft} has no {name}; the target's "
                              "tokenizer is in one", hint=HINT)
        if _tokens(ours) != _tokens(theirs):
            raise ConfigError(f"{what}: draft model {draft}'s tokenizer ({name}) is not "
                              f"the target's ({ours})", hint=HINT)
        return
    raise ConfigError(f"{what}: the target {target} has none of {', '.join(VOCAB_FILES)} "
                      "to compare the draft's tokenizer with", hint=HINT)


def _vocab_size(config: dict[str, Any]) -> object:
    text = config.get("text_config")
    return config.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict)
                                        else None)


def _tokens(path: Path) -> object:
    """What of ``path`` names the tokens: tokenizer.json's vocabulary and added tokens,
    another file's bytes."""
    try:
        raw = path.read_bytes()
        if path.name != "tokenizer.json":
            return raw
        data = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"tokenizer file {path} cannot be read: {exc}",
                          hint="download the model again") from exc
    model = data.get("model") if isinstance(data, dict) else None
    added = data.get("added_tokens") if isinstance(data, dict) else None
    return (model.get("vocab") if isinstance(model, dict) else None,
            sorted((t.get("id"), t.get("content")) for t in added or ()
                   if isinstance(t, dict)))
