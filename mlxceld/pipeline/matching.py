"""The last stage's constrained decoding: a matcher per constrained sequence
(``params.constraint``: a JSON schema or a grammar, ``engine.constraints``).

The model's tokenizer is read from its directory at the first constrained ``prepare``,
then kept (read again if another sequence names other end-of-sequence ids); reading it and
compiling a constraint run in a thread (a large grammar takes up to about a second). A
constraint that cannot be used, or a stage with no tokenizer to read, is refused with
``bad_constraint`` (``ProtocolViolation``), naming why.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxceld.engine.base import SamplingParams
from mlxceld.pipeline import protocol as p

if TYPE_CHECKING:  # llguidance and mlx: imported only once serving
    from mlxceld.engine.constraints import ConstraintTokenizer, Matching


class StageMatching:
    def __init__(self, node_id: str, tokenizer_path: Path | None, vocab_size: int) -> None:
        """``tokenizer_path``: the model's directory (None: every constraint is refused)."""
        self._node_id = node_id
        self._tokenizer_path = tokenizer_path
        self._vocab_size = vocab_size
        self._tokenizer: ConstraintTokenizer | None = None

    async def matcher(self, params: SamplingParams, eos: frozenset[int]) -> Matching | None:
        """The sequence's matcher, or None when its output is not constrained."""
        if params.constraint is None:
            return None
        from mlxceld.engine.constraints import ConstraintError

        try:
            if self._tokenizer is None or self._tokenizer.eos_token_ids != sorted(eos):
                self._tokenizer = await asyncio.to_thread(self._read_tokenizer, eos)
            return await asyncio.to_thread(self._tokenizer.matcher, params.constraint)
        except ConstraintError as exc:
            raise p.ProtocolViolation(p.ERR_BAD_CONSTRAINT, str(exc)) from None

    def _read_tokenizer(self, eos: frozenset[int]) -> ConstraintTokenizer:
        from mlxceld.engine.constraints import ConstraintError, ConstraintTokenizer

        if self._tokenizer_path is None:
            raise ConstraintError(f"stage {self._node_id} has no tokenizer to decode under a "
                                  "constraint")
        from mlx_lm.utils import load_tokenizer

        try:
            wrapper: Any = load_tokenizer(self._tokenizer_path)  # type: ignore[no-untyped-call]
        except (OSError, ValueError, KeyError, TypeError) as exc:  # transformers' words
            raise ConstraintError(f"stage {self._node_id} cannot read the model's tokenizer "
                                  f"in {self._tokenizer_path}: {exc}") from exc
        return ConstraintTokenizer(wrapper._tokenizer, vocab_size=self._vocab_size,
                                   eos_token_ids=eos)
