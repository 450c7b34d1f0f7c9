"""Which model families mlxceld splits into pipeline stages, and the one check of it.

``SUPPORTED`` is the list: the ``model_type`` values of config.json whose models
``slicing.StageModel`` can cut into stages (``slicing`` reads it from here). It is
the one home of that list; nothing copies it. ``ALIASES`` are the model types
mlx-lm loads with one of those families' classes (Kimi K2's ``kimi_k2`` is
DeepSeek-V3's), split as that family.

``require_splittable(path)`` reads the checkpoint's config.json (no weight file is
opened) and raises ``UnsupportedFamily`` naming the family, the supported list and
what to do when the family is not one of them. Everything that would start a
stage calls it before anything loads: ``mlxctl cluster plan`` and ``activate``,
``--pp-auto N`` (and ``--dry-run``), ``--distributed-config`` (placing a node),
the peer's offer judge (``family_refusal``, with the family its own checkpoint
has) and ``slicing.load_stage`` itself, the last line.

Importing this module does not import mlx: the daemon calls it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from mlxceld.errors import UnsupportedFamily
from mlxceld.models.identity import CONFIG, read_model_config

# The model_type values slicing.StageModel cuts into stages, each with its hooks there
# (slicing.FAMILIES: the same names, in this order; tests/models/test_families.py holds
# the two to each other). mistral loads with llama's classes.
SUPPORTED: Final[tuple[str, ...]] = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "glm4_moe", "phi3",
    "gemma3_text", "gemma3", "deepseek_v3", "gpt_oss")
# model_type values that mlx-lm loads with the classes of a family in SUPPORTED (its
# MODEL_REMAPPING, for those families: tests/models/test_families.py holds the two to
# each other): Kimi K2 is DeepSeek-V3's architecture, and is split as it.
ALIASES: Final[dict[str, str]] = {
    "kimi_k2": "deepseek_v3", "joyai_llm_flash": "deepseek_v3",
    "iquestcoder": "llama", "xverse": "llama"}


def split_as(family: str) -> str:
    """The family in SUPPORTED whose hooks split ``family`` (itself, or what it aliases)."""
    return ALIASES.get(family, family)


def model_family(config: Mapping[str, Any]) -> str | None:
    """The checkpoint's family: config.json's ``model_type`` (None: absent or not text)."""
    family = config.get("model_type")
    return family if isinstance(family, str) else None


def family_problem(family: str | None, source: str) -> str | None:
    """Why a checkpoint of ``family`` (``source`` names its config.json) cannot be split
    into pipeline stages, or None when it can."""
    if family is not None and split_as(family) in SUPPORTED:
        return None
    what = (f"model_type {family!r}" if family is not None
            else "no 'model_type' (or one that is not a string)")
    also = ", ".join(f"{a} as {t}" for a, t in ALIASES.items())
    return (f"{source} says {what}, a model family mlxceld cannot split into pipeline "
            f"stages (it splits: {', '.join(SUPPORTED)}; and {also})")


def hint() -> str:
    """What to do about a family that is not split."""
    return (f"use a checkpoint of one of {', '.join(SUPPORTED)}, or serve this one whole "
            "on a single host: mlxctl serve DIR (no pipeline)")


def check_family(config: Mapping[str, Any], source: str) -> str:
    """``config`` (config.json of the checkpoint ``source`` names) as a family mlxceld
    splits: its ``model_type``; else ``UnsupportedFamily``."""
    family = model_family(config)
    problem = family_problem(family, source)
    if problem is not None:
        raise UnsupportedFamily(problem, hint=hint(), family=family, supported=SUPPORTED)
    assert family is not None
    return family


def require_splittable(path: Path, what: str = "") -> str:
    """The family of the checkpoint in directory ``path``, which mlxceld splits into
    pipeline stages; else ``UnsupportedFamily`` (``ConfigError`` when config.json cannot
    be read). ``what`` (a flag, a file) opens the message: where the model was named."""
    source = str(Path(path) / CONFIG)
    family = check_family(read_model_config(Path(path)),
                          f"{what}: {source}" if what else source)
    return family
