"""A model's ``generation_config.json`` as the sampling defaults of a request
(``models/generation.py``): what it gives, what it gives wrong (skipped, warned), none."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mlxceld.models.generation import SamplingDefaults, read_sampling_defaults


def write(tmp_path: Path, body: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(body))
    return tmp_path


def test_qwen3s_defaults(tmp_path: Path) -> None:
    model = write(tmp_path, {"bos_token_id": 1, "do_sample": True, "temperature": 0.6,
                             "top_p": 0.95, "top_k": 20, "min_p": 0, "max_new_tokens": 99,
                             "repetition_penalty": 1.05})
    defaults = read_sampling_defaults(model)
    assert defaults == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0,
                                        repetition_penalty=1.05)
    assert defaults.changed() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                  "repetition_penalty": 1.05}


def test_none_without_the_file(tmp_path: Path) -> None:
    assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    assert SamplingDefaults().changed() == {}


def test_a_value_out_of_range_is_skipped_and_named(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    model = write(tmp_path, {"temperature": 3.0, "top_p": 0, "top_k": -1, "min_p": "0.1",
                             "repetition_penalty": 1.2})
    with caplog.at_level(logging.WARNING):
        defaults = read_sampling_defaults(model)
    assert defaults == SamplingDefaults(repetition_penalty=1.2)  # top_k -1: off, as 0
    said = caplog.text
    assert "temperature = 3.0" in said and "top_p = 0" in said and "min_p = '0.1'" in said
    assert str(model / "generation_config.json") in said


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_a_file_that_is_not_an_object_gives_openais(tmp_path: Path, text: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "generation_config.json").write_text(text)
    with caplog.at_level(logging.WARNING):
        assert read_sampling_defaults(tmp_path) == SamplingDefaults()
    assert "OpenAI's sampling defaults apply" in caplog.text
