"""Sampling and the penalties against their definitions, on a vocabulary small enough to
work out by hand: the expected numbers come from the formulas (OpenAI's penalties,
softmax at a temperature), never from the code under test.

- Temperature T samples from softmax(logits / T): on two tokens of probabilities 0.8
  and 0.2, T = 0.5 gives 0.64 / 0.68 = 0.941 for the first, T = 2 gives
  sqrt(0.8) / (sqrt(0.8) + sqrt(0.2)) = 2/3. Both are checked, so multiplying by T
  instead of dividing (0.667 and 0.941: the two swapped) fails.
- OpenAI's presence and frequency penalties: a token's logit loses ``presence`` once
  if it was generated and ``frequency`` once per time it was, over the tokens the
  completion generated, never the prompt's.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlxceld.engine import SamplingParams
from mlxceld.engine.processors import make_logits_processors
from mlxceld.engine.sampling import make_sampler

DRAWS = 8000


@pytest.mark.parametrize(("temperature", "first"), [
    (0.5, 0.8**2 / (0.8**2 + 0.2**2)),
    (2.0, math.sqrt(0.8) / (math.sqrt(0.8) + math.sqrt(0.2))),
])
def test_temperature_divides_the_logits(temperature: float, first: float) -> None:
    sample = make_sampler(SamplingParams(max_tokens=1, temperature=temperature, seed=7), 2)
    row = mx.log(mx.array([[0.8, 0.2]]))
    tokens = sample(mx.broadcast_to(row, (DRAWS, 2)))
    share = float((tokens == 0).sum().item()) / DRAWS
    # Binomial standard error at 8,000 draws is at most 0.0056: five of them.
    assert abs(share - first) < 0.028, (share, first)


def test_penalties_count_the_generated_tokens_not_the_prompts() -> None:
    presence, frequency = 0.5, 0.25
    params = SamplingParams(max_tokens=8, presence_penalty=presence,
                            frequency_penalty=frequency)
    processors = make_logits_processors(params, eos_token_ids=[9])
    prompt = [5, 5, 5, 2]
    generated: list[int] = []
    for step, token in enumerate([7, 7, 5, 3]):
        # As BatchGenerator calls them: the history is the prompt, then what was generated.
        logits = mx.zeros((1, 10))
        history = mx.array(prompt + generated, dtype=mx.int32)
        for processor in processors:
            logits = processor(history, logits)
        expected = [0.0] * 10
        for t in set(generated):
            expected[t] = -(presence + frequency * generated.count(t))
        assert logits[0].tolist() == pytest.approx(expected), (step, generated)
        generated.append(token)
