"""A coordinator's ``--kv-bits`` prices its plans' KV reserve at that width (``--pp-auto
--dry-run`` and `mlxctl cluster plan` print it), and a family that cannot keep a quantized
cache is refused by name before any peer is asked. Real daemons."""

from __future__ import annotations

import secrets
from pathlib import Path

from mlxceld.models import preset, write_fixture

from helpers.cluster import agent, start
from helpers.daemons import Daemons
from helpers.keys import secret_file


def test_pp_auto_dry_run_prices_the_kv_at_kv_bits(daemons: Daemons, kv_fixture_dir: Path,
                                                  tmp_path: Path) -> None:
    secret = secrets.token_hex(16).encode()
    peer = start(daemons, "127.0.0.2", secret, name="p2")
    coord = daemons.make(name="dry")
    coord.start("--cluster-secret-file", str(secret_file(coord.root, secret)),
                "--cluster-peers", agent(peer), "--model", str(kv_fixture_dir / "llama"),
                "--kv-bits", "8", "--pp-auto", "1", "--dry-run", "--agent-addr",
                "127.0.0.1:0", wait=False)
    assert coord.proc is not None
    assert coord.proc.wait(60) == 0, coord.stderr()
    assert "KV cache for 8192 tokens at 8 bits (kv_bits; groups of 64)" in coord.stderr()

    gemma = write_fixture(tmp_path / "gemma", preset("tiny", family="gemma3_text",
                                                     head_dim=64))
    refused = daemons.make(name="gem")
    refused.start("--cluster-secret-file", str(secret_file(refused.root, secret)),
                  "--cluster-peers", agent(peer), "--model", str(gemma), "--kv-bits", "4",
                  "--pp-auto", "1", "--dry-run", "--agent-addr", "127.0.0.1:0", wait=False)
    assert refused.proc is not None
    assert refused.proc.wait(60) == 2, refused.stderr()
    assert "--kv-bits = 4" in refused.stderr() and "'gemma3_text'" in refused.stderr()
