"""A model's own sampling defaults, from its ``generation_config.json``.

Model authors write there the sampling their model is meant to run with (Qwen3:
temperature 0.6, top_p 0.95, top_k 20). vLLM's ``--generation-config auto`` (its
default) makes them the defaults of a request that leaves them out, and so does the
router (``[serve] generation_config = "auto"``; ``"none"`` keeps OpenAI's). Read:
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``. Not read, as
vLLM does not: ``do_sample`` (a ``temperature`` of 0 is how a request asks for greedy
decoding here), ``max_new_tokens`` (``[serve] max_tokens`` is the operator's bound).
A value out of the range a request may give is skipped with a warning naming the file
and the key, and so is a file that is not JSON: the model still serves, with OpenAI's
default for what was skipped.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Final

log = logging.getLogger(__name__)

GENERATION_CONFIG: Final = "generation_config.json"
MAX_REPETITION_PENALTY: Final = 10.0  # as a request's (api/requests.py)


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request's left-out sampling fields are: OpenAI's, unless the model says."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1: off

    def changed(self) -> dict[str, float]:
        """The defaults that differ from OpenAI's, by name (for the log)."""
        plain = SamplingDefaults()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(plain, f.name)}


def _in_range(key: str, value: float) -> bool:
    if key == "temperature":
        return 0.0 <= value <= 2.0
    if key == "top_p":
        return 0.0 < value <= 1.0
    if key == "min_p":
        return 0.0 <= value <= 1.0
    return 0.0 < value <= MAX_REPETITION_PENALTY  # repetition_penalty


def read_sampling_defaults(model_dir: Path) -> SamplingDefaults:
    """The defaults ``model_dir``'s ``generation_config.json`` gives (OpenAI's where it
    gives none, has none, or gives one out of range: warned)."""
    path = model_dir / GENERATION_CONFIG
    try:
        raw: Any = json.loads(path.read_text())
    except FileNotFoundError:
        return SamplingDefaults()
    except (OSError, ValueError) as exc:
        log.warning("%s cannot be read (%s): OpenAI's sampling defaults apply", path, exc)
        return SamplingDefaults()
    if not isinstance(raw, dict):
        log.warning("%s is not a JSON object: OpenAI's sampling defaults apply", path)
        return SamplingDefaults()
    found: dict[str, Any] = {}
    for key in ("temperature", "top_p", "min_p", "repetition_penalty", "top_k"):
        value = raw.get(key)
        if value is None:
            continue
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if key == "top_k" and number and float(value).is_integer():
            found[key] = max(int(value), 0)  # HF's 0 and vLLM's -1 both mean off
        elif key != "top_k" and number and math.isfinite(value) and _in_range(key, value):
            found[key] = float(value)
        else:
            log.warning("%s: %s = %r is not a default a request could give; skipped",
                        path, key, value)
    return replace(SamplingDefaults(), **found)
