"""A real daemon, configured by its TOML file as an operator would: the model's aliases,
CORS for one origin, and the sampling defaults of the model's generation_config.json,
called by the real `openai` client with a base URL without ``/v1``."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai

from mlxceld.models import preset, write_fixture

from helpers.daemons import FAST_POLICY, READY_S, Daemons
from helpers.metrics import sample, scrape
from helpers.models import PROMPT, expected
from helpers.ports import free_port

ORIGIN = "http://localhost:3000"
CONFIG = FAST_POLICY + """
[serve]
model = "{model}"
model_name = ["llama", "gpt-4o-mini"]
port = {port}
allowed_origins = ["{origin}"]
"""


def greedy_by_default(root: Path) -> Path:
    """The tiny llama, its generation_config.json saying temperature 0 (greedy), as a
    model's authors would say 0.6."""
    model = root / "llama"
    write_fixture(model, preset("tiny", family="llama"))
    config = model / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "temperature": 0.0,
                                  "top_p": 0.9}))
    return model


def test_aliases_cors_and_the_models_defaults_from_the_config_file(daemons: Daemons,
                                                                    tmp_path: Path) -> None:
    model = greedy_by_default(tmp_path)
    port = free_port()
    d = daemons.make(CONFIG.format(model=model, port=port, origin=ORIGIN)).start()
    w = d.wait_worker("router", timeout=READY_S, state="running")
    daemons.pids.add(w["pid"])
    base = f"http://127.0.0.1:{port}"  # no /v1: the client's paths are /models, ...
    with openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=60) as c:
        assert [m.id for m in c.models.list().data] == ["llama", "gpt-4o-mini"]
        # No temperature: the model's 0, so mlx-lm's greedy text, under the alias asked.
        comp = c.completions.create(model="gpt-4o-mini", prompt=PROMPT, max_tokens=24)
        raw = c.chat.completions.with_raw_response.create(
            model="gpt-4o-mini", max_tokens=12, extra_headers={"x-request-id": "trace-7"},
            messages=[{"role": "user", "content": "Hello there"}])
        again = c.chat.completions.create(model="gpt-4o-mini", max_tokens=12,
                                          messages=[{"role": "user", "content": "Hello there"}])
    assert comp.model == "gpt-4o-mini"
    assert comp.choices[0].text == expected(model, PROMPT, 24)
    chat = raw.parse()
    assert raw.headers["x-request-id"] == "trace-7"
    assert chat.model == again.model == "gpt-4o-mini"
    assert chat.choices[0].message.content == again.choices[0].message.content
    with httpx.Client(base_url=base, timeout=30) as h:
        preflight = h.options("/v1/chat/completions", headers={
            "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        card = h.get("/v1/models/gpt-4o-mini", headers={"Origin": ORIGIN})
    assert preflight.status_code == 204, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"]
    assert card.headers["access-control-allow-origin"] == ORIGIN
    assert len(card.headers["x-request-id"]) == 32
    assert card.json()["max_model_len"] == card.json()["context_length"] > 0
    samples = scrape(base)
    for endpoint, count in (("/v1/models", 1), ("/v1/completions", 1),
                            ("/v1/chat/completions", 2)):
        assert sample(samples, "mlxceld_http_requests_total", endpoint=endpoint,
                      status="200") == count, endpoint
    log = (d.state_dir / "logs" / "router.log").read_text()
    assert "sampling defaults from llama's generation_config.json: temperature=0.0 " \
        "top_p=0.9" in log
