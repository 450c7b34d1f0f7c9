"""How a tensor-parallel group treats a model's experts, embedding and head, and the check.

The reference design lets a user pick, for three parts of a model, whether every rank
keeps the whole part (``replicate``) or each rank keeps a slice (``shard``). We split a
model with mlx-lm's own ``Model.shard(group)`` and nothing else, so what each part gets
is what mlx-lm 0.32's ``shard`` methods do; a setting that asks for that is honoured
(it is what happens), one that asks for the other is refused, naming why:

``moe`` (``--tp-moe-mode``)
    ``shard``: mlx-lm cuts every expert's MLP across the ranks, like a dense MLP, and
    keeps the router that picks the experts whole on each rank. A dense model has no
    experts, and ``shard`` is then what its MLP gets too. ``replicate`` (each rank
    holding every expert whole) is not something mlx-lm's split can do: refused.
``embedding`` (``--tp-embedding-mode``)
    ``replicate``: no family's ``shard`` cuts the token embedding. ``shard``: refused.
``lm_head`` (``--tp-lm-head-mode``)
    ``replicate`` for most families. mlx-lm's qwen3.5 classes (``qwen3_5``,
    ``qwen3_5_moe``, ``prism_hadamard_qwen35``) cut an untied head by vocabulary and
    gather the logits, and ``muse_spark`` always does: ``shard`` for those. A model
    whose head is its embedding (``tie_word_embeddings``) keeps it whole. The other
    value is refused for the model at hand (``check_modes``: it needs config.json).

``TensorModes`` is what was said (None: not said, mlx-lm's own); ``check_modes`` judges it
against a model. Importing this module does not import mlx.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from mlxceld.models.tensor import TensorParallelRefused

Mode = Literal["replicate", "shard"]
MODES: Final[tuple[Mode, ...]] = ("replicate", "shard")
Part = Literal["moe", "embedding", "lm_head"]
PARTS: Final[tuple[Part, ...]] = ("moe", "embedding", "lm_head")

# What mlx-lm's split does to a part whatever the model (None: it depends on the model).
FIXED: Final[dict[Part, Mode]] = {"moe": "shard", "embedding": "replicate"}
# Why the other value cannot be had, by part.
WHY_NOT: Final[dict[Part, str]] = {
    "moe": "mlx-lm's tensor-parallel split cuts every expert's weights across the ranks "
           "(the router stays whole); keeping all experts whole on each rank is not built",
    "embedding": "mlx-lm's tensor-parallel split keeps the token embedding whole on every "
                 "rank; a split embedding is not built",
}
# The model_type values whose mlx-lm shard() cuts the head by vocabulary: when it is its
# own (not tied to the embedding), and always.
HEAD_SHARDED_UNTIED: Final = frozenset({"qwen3_5", "qwen3_5_moe", "prism_hadamard_qwen35"})
HEAD_SHARDED_ALWAYS: Final = frozenset({"muse_spark"})


@dataclass(frozen=True)
class TensorModes:
    """The modes said for each part (``--tp-moe-mode`` ...); None: not said."""

    moe: Mode | None = None
    embedding: Mode | None = None
    lm_head: Mode | None = None

    def said(self) -> dict[Part, Mode]:
        """The parts a mode was said for, and the mode."""
        found: dict[Part, Mode | None] = {"moe": self.moe, "embedding": self.embedding,
                                          "lm_head": self.lm_head}
        return {part: mode for part, mode in found.items() if mode is not None}


def fixed_refusal(part: Part, mode: Mode) -> str | None:
    """Why ``mode`` for ``part`` is refused whatever the model, or None."""
    fixed = FIXED.get(part)
    return WHY_NOT[part] if fixed is not None and mode != fixed else None


def head_mode(config: Mapping[str, Any]) -> Mode:
    """What mlx-lm's split does to the head of the model whose config.json is ``config``."""
    family = config.get("model_type")
    if family in HEAD_SHARDED_ALWAYS:
        return "shard"
    if family in HEAD_SHARDED_UNTIED:
        text = config.get("text_config")
        args = text if isinstance(text, Mapping) else config
        return "replicate" if args.get("tie_word_embeddings", False) is True else "shard"
    return "replicate"


def check_modes(config: Mapping[str, Any], modes: TensorModes, *, source: str,
                names: Mapping[Part, str]) -> None:
    """Refuse (``TensorParallelRefused``) a mode that mlx-lm's split of this model (its
    config.json ``config``, named ``source``) does not give; ``names`` names each part's
    setting (``--tp-lm-head-mode``, or the file's key) for the message."""
    for part, mode in modes.said().items():
        why = fixed_refusal(part, mode)
        if why is None and part == "lm_head":
            done = head_mode(config)
            if mode != done:
                why = (f"mlx-lm's tensor-parallel split of model_type "
                       f"{config.get('model_type')!r} "
                       + ("cuts its head by vocabulary across the ranks" if done == "shard"
                          else "keeps its head whole on every rank"))
        if why is not None:
            raise TensorParallelRefused(
                f"{source}: {names[part]} {mode}: {why}; leave it out (or give "
                f"{names[part]} {FIXED.get(part) or head_mode(config)})")
