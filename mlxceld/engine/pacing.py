"""When a speculating sequence proposes and when it decodes plainly: speculation backs off
where it does not pay (sans-IO: fed each pass's tokens and seconds, it says the next k).

A draft that agrees pays (k+1 tokens for about a pass's time); one that does not costs k
draft steps and a wider pass for one token. Which it is depends on the draft, the text
and the machine, so it is measured, per sequence: the tokens per second of passes with
proposals (k as configured) and of plain ones (k = 0: the model's own token, the draft
left behind and caught up on its next proposal), each over its latest phase:

- ``probe``: ``PROBE`` passes with proposals, then ``PROBE`` plain ones (the first time,
  or when a phase's rate is older than the other's);
- then the faster goes on: speculating for ``SPECULATE`` passes (then the plain rate is
  measured again: ``PROBE`` plain passes), or plain for a run that starts at ``FIRST_RUN``
  passes and doubles, up to ``MAX_RUN``, each time a probe of proposals loses again (a
  draft that never pays costs ``PROBE`` slow passes per run: a few percent of the run).

Greedy tokens and the sampled distribution are the same whichever passes run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PROBE = 2  # passes that measure a mode
SPECULATE = 64  # passes with proposals before the plain rate is measured again
FIRST_RUN = 32  # plain passes after a probe of proposals lost; doubled each time it loses
MAX_RUN = 512

Mode = Literal["propose", "plain"]


@dataclass
class Pacing:
    """``k()`` for the next pass; ``record`` what it gave."""

    k_max: int
    mode: Mode = "propose"
    left: int = PROBE  # passes of the current phase still to run
    probing: bool = True  # this phase measures its mode for a decision at its end
    run: int = FIRST_RUN
    tokens: int = 0  # of the current phase
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.rates: dict[Mode, float | None] = {"propose": None, "plain": None}

    def k(self) -> int:
        return self.k_max if self.mode == "propose" else 0

    def record(self, tokens: int, seconds: float) -> None:
        """The pass just run (in ``mode``) gave ``tokens`` in ``seconds``."""
        self.tokens += tokens
        self.seconds += max(seconds, 1e-9)
        self.left -= 1
        if self.left > 0:
            return
        self.rates[self.mode] = self.tokens / self.seconds
        self.tokens, self.seconds = 0, 0.0
        other = _other(self.mode)
        propose, plain = self.rates["propose"], self.rates["plain"]
        if propose is None or plain is None or not self.probing:  # measure the other now
            self._phase(other, PROBE, probing=True)
        elif propose >= plain:
            self.run = FIRST_RUN
            self._phase("propose", SPECULATE, probing=False)
        else:  # plain is faster: a longer plain run each time it is found so
            self._phase("plain", self.run, probing=False)
            self.run = min(self.run * 2, MAX_RUN)

    def _phase(self, mode: Mode, passes: int, *, probing: bool) -> None:
        self.mode, self.left, self.probing = mode, passes, probing


def _other(mode: Mode) -> Mode:
    return "plain" if mode == "propose" else "propose"
