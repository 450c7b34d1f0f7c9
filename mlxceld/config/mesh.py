"""``--mesh`` / ``[daemon] mesh``: how ``pp_auto``'s N hosts run the model
(``mlxceld/cluster/plan/mesh.py``): ``pp`` (a pipeline of N stages, the default), ``tp``
(one tensor group of N ranks), ``2d`` (stages of tensor groups) or ``auto`` (the least
predicted time per token). It is ``pp_auto``'s alone, so it is refused without it; a
value that is not one of those is refused naming the flag or the key."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from mlxceld.errors import ConfigError
from mlxceld.types import DEFAULT_MESH, MeshMode, parse_mesh

KEY: Final = "mesh"


def mesh_setting(daemon: Mapping[str, Any], flag: str | None, pp_auto: int | None,
                 where: str) -> MeshMode:
    """The Config field ``mesh``: ``flag`` (``--mesh``), else [daemon] ``mesh``, else pp."""
    value, what = flag, "--mesh"
    if value is None and KEY in daemon:
        value, what = daemon[KEY], f"{where}: 'daemon.{KEY}'"
    if value is None:
        return DEFAULT_MESH
    try:
        mode = parse_mesh(value, what)
    except ValueError as exc:
        raise ConfigError(str(exc), hint="for example --mesh auto (or mesh = \"auto\" under "
                          "[daemon]); pp, the default, plans a pipeline") from exc
    if pp_auto is None:
        raise ConfigError(f"{what} is for pp_auto (--pp-auto N) only",
                          hint="give --pp-auto N with it; `mlxctl cluster plan|activate "
                          "--mesh` takes it per plan")
    return mode
