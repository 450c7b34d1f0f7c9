"""Workers take keyring changes without a restart (issue 16, secret rotation): a real
2-stage pipeline (coordinator on 127.0.0.1, stages on .2 and .3), a second secret
installed, made primary and the first removed on every daemon with `mlxctl secret`;
the router and stage workers keep their pids, accept both keys during the overlap, and
hand their links over to the new primary as soon as it is made primary (router ->
stage-0 and stage-1, stage-0 -> stage-1, stage-1 -> stage-0), so that removing the old key
then ends no stream."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from mlxceld.net import HandshakeFailed, connect
from mlxceld.wire.secret import key_id

from helpers import keys
from helpers.daemons import DaemonProc, Daemons
from helpers.models import PROMPT, expected
from helpers.pipeline import SECRET, start_pipeline
from helpers.router import client
from helpers.waiting import wait_for

NEW = b"fedcba9876543210fedcba9876543210"
OLD_ID, NEW_ID = key_id(SECRET.encode()).hex(), key_id(NEW).hex()
SETTLE_S = 20.0  # generous: a loaded machine; the push itself is one channel call per worker


def dial(address: str, secret: bytes) -> str:
    """Handshake with a stage's listener holding only ``secret``: "ok" or the refusal kind."""
    host, port = address.rsplit(":", 1)

    async def go() -> str:
        try:
            stream = await connect(host, int(port), keyring=keys.keyring(secret),
                                   identity="127.0.0.5:4000", channel=1,
                                   local_addr=("127.0.0.5", 0), budget_s=5.0)
        except HandshakeFailed as exc:
            return exc.kind
        await stream.close()
        return "ok"

    return asyncio.run(go())


def worker_keys(d: DaemonProc, name: str) -> object:
    return d.worker(name).get("keys")


def everywhere(daemons: list[DaemonProc], *args: str) -> None:
    for d in daemons:
        done = d.ctl("secret", *args)
        assert done.returncode == 0, done.stderr


@pytest.mark.timeout(240)
def test_workers_take_a_new_key_without_a_restart(daemons: Daemons, split_fixture_dir: Path,
                                                  tmp_path: Path) -> None:
    model = split_fixture_dir / "qwen3"
    pipe = start_pipeline(daemons, model, [(0, 2), (2, 4)])
    all_ = [pipe.coordinator, *pipe.stages]
    workers = [(pipe.coordinator, "router"), *((d, "stage") for d in pipe.stages)]
    pids = {d.worker(n)["pid"] for d, n in workers}
    stage = [line.split('"')[1] for line in pipe.toml.read_text().splitlines()
             if line.startswith("address")][1]

    def answer() -> str | None:
        with client(pipe.url) as c:
            return c.completions.create(model="qwen3", prompt=PROMPT, max_tokens=6,
                                        temperature=0).choices[0].text

    want = expected(model, PROMPT, 6)
    assert answer() == want
    assert dial(stage, NEW) == "unknown_key_id"

    everywhere(all_, "install", str(keys.secret_file(tmp_path, NEW)))
    overlap = {"primary": OLD_ID, "ids": sorted([OLD_ID, NEW_ID])}
    for d, n in workers:
        wait_for(lambda d=d, n=n: worker_keys(d, n) == overlap, SETTLE_S, f"{n} in overlap")
    assert dial(stage, NEW) == "ok" and dial(stage, SECRET.encode()) == "ok"

    everywhere(all_, "use", NEW_ID)
    assert answer() == want
    logs = [(d.state_dir / "logs" / f"{n}.log") for d, n in workers]
    handed = [f"handed over to key {NEW_ID}", f"handed the next stage over to a stream under "
              f"key {NEW_ID}", f"handed the first stage over to a stream under key {NEW_ID}"]
    for log, words in zip(logs, handed, strict=True):
        wait_for(lambda log=log, w=words: log.read_text().count(w) >= (2 if log == logs[0]
                                                                        else 1),
                 SETTLE_S, f"{log.parent.parent.parent.name}: {words}")

    everywhere(all_, "remove", OLD_ID)
    only_new = {"primary": NEW_ID, "ids": [NEW_ID]}
    for d, n in workers:
        wait_for(lambda d=d, n=n: worker_keys(d, n) == only_new, SETTLE_S, f"{n} on the new key")
    assert dial(stage, SECRET.encode()) == "unknown_key_id"
    ready = pipe.url.removesuffix("/v1") + "/ready"
    wait_for(lambda: httpx.get(ready, timeout=10).status_code == 200, SETTLE_S,
             "the router re-linked under the new key")
    assert answer() == want
    assert {d.worker(n)["pid"] for d, n in workers} == pids  # no worker restarted
    ended = [int(m) for log in logs for m in re.findall(
        r"(\d+) stream\(s\) under a removed key ended", log.read_text())]
    assert sum(ended) == 0, ended  # every link had been handed over: none was cut
    for d in all_:  # key ids only: no secret in any log
        for log in (d.state_dir / "logs").glob("*.log"):
            text = log.read_text()
            assert NEW.hex() not in text and SECRET.encode().hex() not in text
