"""Where ``mlxctl`` starts: the fast path for a plain ``status``, ``workers`` or ``logs``,
typer's full command tree (``mlxctl.app``) for everything else."""

from __future__ import annotations

import os
import sys

from mlxctl import fastpath


def main() -> None:
    plain = fastpath.streams_are_plain()
    invocation = fastpath.parse(sys.argv[1:], os.environ) if plain else None
    if invocation is not None:
        fastpath.run(invocation)
        return
    from mlxctl.app import app

    app()
