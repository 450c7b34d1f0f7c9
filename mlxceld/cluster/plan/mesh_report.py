"""The mesh chosen, for a person (``render_mesh``) and for a program (``mesh_json``).

What ``mlxctl cluster plan --mesh MODE`` prints below the plan's table: every mesh
considered (P stages x T ranks), whether it fits, its predicted time per token where the
candidates reported compute units (``mesh.predicted_ms``), why one that does not fit was
left, and the mesh chosen with the reason. In ``--json`` it is the plan's ``mesh``.
"""

from __future__ import annotations

from typing import Literal, TypedDict

from mlxceld.cluster.plan.mesh import LINK_COSTS, MeshChoice
from mlxceld.cluster.plan.report import ms

MESH_HEADERS = ("MESH", "STAGES", "TP", "FITS", "MS/TOKEN", "")


class MeshOptionJSON(TypedDict):
    stages: int  # P
    tp_size: int  # T
    fits: bool
    ms_per_token: float | None  # predicted (mesh.predicted_ms); None: no compute units
    why_not: str | None  # why it does not fit (or is not built for this model)
    chosen: bool


class MeshJSON(TypedDict):
    mode: Literal["pp", "tp", "2d", "auto"]  # as asked (--mesh)
    hosts: int  # N = P x T
    stages: int  # the chosen mesh's P
    tp_size: int  # and its T
    why: str
    link: Literal["tcp", "rdma"]  # the link the all-reduces were priced over
    ring_step_ms: float  # assumed: mesh.LINK_COSTS
    hop_ms: float
    considered: list[MeshOptionJSON]


def mesh_json(choice: MeshChoice) -> MeshJSON:
    cost = LINK_COSTS[choice.link]
    return {"mode": choice.mode, "hosts": choice.hosts, "stages": choice.chosen.stages,
            "tp_size": choice.chosen.tp_size, "why": choice.why, "link": choice.link,
            "ring_step_ms": cost.ring_step_ms, "hop_ms": cost.hop_ms,
            "considered": [{"stages": o.stages, "tp_size": o.tp_size, "fits": o.fits,
                            "ms_per_token": o.ms_per_token, "why_not": o.why_not,
                            "chosen": o is choice.chosen} for o in choice.considered]}


def render_mesh(choice: MeshChoice) -> str:
    """A table of the meshes considered, then the one chosen and why."""
    rows = [(o.name, str(o.stages), str(o.tp_size), "yes" if o.fits else "no",
             ms(o.ms_per_token), "chosen" if o is choice.chosen else _short(o.why_not))
            for o in choice.considered]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(MESH_HEADERS)]
    lines = [f"meshes of {choice.hosts} host(s) considered (--mesh {choice.mode}):"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
              for row in (MESH_HEADERS, *rows)]
    lines.append(f"mesh: {choice.chosen.stages} stage(s) x tp {choice.chosen.tp_size}: "
                 f"{choice.why}")
    return "\n".join(lines)


def _short(why_not: str | None, most: int = 60) -> str:
    """A refusal's first clause, cut to ``most`` characters (--json has it whole)."""
    if not why_not:
        return ""
    text = why_not.removeprefix("plan refused: ")
    return text if len(text) <= most else text[:most - 3].rstrip() + "..."
