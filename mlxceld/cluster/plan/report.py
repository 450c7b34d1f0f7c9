"""A plan for a person (``render_plan_table``) and for a program (``plan_json``).

What ``mlxctl cluster plan --model M --stages N [--json]`` and
``mlxceld --pp-auto N --dry-run`` print. The table is plain text (mlxctl may
colour it); the JSON is ``mlxctl.plan/1``, all sizes in bytes. Where the nodes reported
compute units (``models/speed.py``), each stage shows them and its predicted time per
token (its weights over its units: ``PlannedStage.ms_per_token``), and a line says which
rule split the layers (``solver.py``: by memory, or by speed). A plan whose stages are
tensor groups across hosts (``mesh.py``) names each stage's other ranks (``TP``), and its
sizes are each rank's; the mesh chosen and why is ``mesh_report.py``'s.
"""

from __future__ import annotations

from typing import Final, Literal, NotRequired, TypedDict

from mlxceld.cluster.plan.model import Plan, PlanNode, Reserve

SCHEMA: Final = "mlxctl.plan/1"
HEADERS: Final = ("STAGE", "NODE", "ADDRESS", "LAYERS", "BYTES", "RESERVE", "USABLE",
                  "HEADROOM")
SPEED_HEADERS: Final = ("UNITS", "MS/TOKEN")  # when some node reported compute units
RULES: Final = {
    "memory": "by memory (each stage's load in proportion to its node's usable memory)",
    "speed": "by speed (each stage's time per token balanced: its weights over its node's "
             "compute units, within its memory)",
}


class PlanStageJSON(TypedDict):
    stage: str  # "stage-0": the node id in the cluster TOML
    rank: int
    node_id: str  # the peer's own node id
    node_address: str  # the peer's agent address (canonical host:port)
    address: str  # the stage listener, as in the cluster TOML
    layers: list[int]  # [start, end)
    weight_bytes: int
    reserve_bytes: int
    usable_bytes: int
    headroom_bytes: int
    compute_units: float | None  # its node's (models/speed.py); None: not reported
    ms_per_token: float | None  # predicted: weight_bytes / (compute_units * 1e6)
    split_rule: Literal["memory", "speed"]  # how its group's layers were split
    replica: NotRequired[int]  # its replica group; only in a plan of 2 replicas or more
    tp_nodes: NotRequired[list[TensorRankJSON]]  # ranks 1..T-1; only with tp_size > 1


class TensorRankJSON(TypedDict):
    """A stage's rank past 0 in its tensor group across hosts (rank order)."""

    rank: int
    node_id: str
    node_address: str  # its agent address (canonical host:port)
    usable_bytes: int
    compute_units: float | None


class SpareNodeJSON(TypedDict):
    node_id: str
    node_address: str
    usable_bytes: int
    compute_units: float | None


class ReserveJSON(TypedDict):
    context_tokens: int
    activation_bytes: int
    kv_bits: int | None  # the KV cache priced at [serve] kv_bits; None: the model's dtype
    kv_group_size: int | None


class PlanJSON(TypedDict):
    schema: Literal["mlxctl.plan/1"]
    num_layers: int
    layer_bytes: list[int]  # each layer's weights, as priced from the safetensors headers
    reserve: ReserveJSON
    stages: list[PlanStageJSON]
    spare: list[SpareNodeJSON]
    replicas: NotRequired[int]  # only in a plan of 2 replicas or more
    tp_size: NotRequired[int]  # each stage's tensor group; only when 2 or more


def human_bytes(n: int) -> str:
    """``512 B``, ``12 KiB``, ``1.5 GiB``, ``-4.1 GiB`` (as mlxctl writes sizes, and TiB)."""
    value = float(abs(n))
    sign = "-" if n < 0 else ""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.0f}" if unit in ("B", "KiB") else f"{value:.1f}"
            return f"{sign}{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render_plan_table(plan: Plan) -> str:
    """One row per stage (with 2 replicas or more, each row's replica group first), then
    a line on the layers' sizes, one on the reserve and one on any spare nodes."""
    groups, tp = plan.replicas > 1, plan.tp_size > 1
    speeds = any(n.compute_units for s in plan.stages for n in s.ranks)
    headers = ((("REPLICA",) if groups else ()) + HEADERS[:2] + (("TP",) if tp else ())
               + HEADERS[2:] + (SPEED_HEADERS if speeds else ()))
    rows = [((str(s.replica),) if groups else ()) + (s.stage_id, s.node.node_id)
            + ((",".join(n.node_id for n in s.tp_nodes),) if tp else ()) + (
             s.address, f"[{s.layers[0]}, {s.layers[1]})",
             human_bytes(s.weight_bytes), human_bytes(s.reserve_bytes),
             human_bytes(s.usable_bytes), human_bytes(s.headroom_bytes))
            + ((units(s.compute_units), ms(s.ms_per_token)) if speeds else ())
            for s in plan.stages]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in (headers, *rows)]
    if plan.layer_bytes:
        lines.append("layer weights: " + layer_runs(plan.layer_bytes))
    lines.append(split_line(plan))
    r = plan.reserve
    if groups:
        lines.append(f"{plan.replicas} replicas of {plan.stages_per_replica} stage(s), each "
                     "a whole copy of the model")
    if tp:
        lines.append(f"each stage a tensor group of {plan.tp_size} ranks across hosts (TP: "
                     "ranks 1 on); bytes, usable and headroom are each rank's (the "
                     "tightest), layers and KV cache divided among the ranks")
    lines.append(f"{len(plan.stages)} stage(s), {plan.num_layers} layers; reserve per stage: "
                 f"KV cache for {r.context_tokens} tokens {kv_width(r)} + "
                 f"{human_bytes(r.activation_bytes)} activations")
    if plan.spare:
        lines.append("not used: " + ", ".join(_spare(n) for n in plan.spare))
    return "\n".join(lines)


def split_line(plan: Plan) -> str:
    """Which rule split the layers (each replica group's, where they differ)."""
    rules = [s.split_rule for s in plan.stages if s.rank == 0]
    if len(set(rules)) == 1:
        return f"layers split {RULES[rules[0]]}"
    return "layers split " + "; ".join(f"replica {i} {RULES[r].split(' (')[0]}"
                                       for i, r in enumerate(rules))


def units(value: float | None) -> str:
    """Compute units as the table shows them; ``-`` when not reported."""
    return "-" if not value else f"{value:.3g}"


def ms(value: float | None) -> str:
    """A predicted time per token in ms; ``-`` when unknown."""
    return "-" if value is None else f"{value:.3g}"


def kv_width(reserve: Reserve) -> str:
    """How the reserve prices the KV cache: at the model's dtype, or ``[serve] kv_bits``'s
    width."""
    kv = reserve.kv_quant
    if kv is None:
        return "at full precision"
    return f"at {kv.bits} bits (kv_bits; groups of {kv.group_size})"


def layer_runs(layer_bytes: tuple[int, ...], most: int = 6) -> str:
    """Each run of layers of one size, as the solver priced them: ``[0, 1) 1.2 MiB,
    [1, 48) 3.1 GiB each`` (a dense first layer, then MoE layers); past ``most`` runs,
    how many more."""
    runs: list[tuple[int, int, int]] = []  # start, end, bytes
    for i, size in enumerate(layer_bytes):
        if runs and runs[-1][2] == size:
            runs[-1] = (runs[-1][0], i + 1, size)
        else:
            runs.append((i, i + 1, size))
    parts = [f"[{a}, {b}) {human_bytes(n)}{' each' if b - a > 1 else ''}"
             for a, b, n in runs[:most]]
    if len(runs) > most:
        parts.append(f"and {len(runs) - most} more runs (--json has every layer)")
    return ", ".join(parts)


def plan_json(plan: Plan) -> PlanJSON:
    """The plan as ``mlxctl.plan/1`` (with ``replicas``, and each stage's
    ``replica``, when it has 2 replicas or more; with ``tp_size`` and each stage's
    ``tp_nodes`` when its stages are tensor groups)."""
    out = _plan_json(plan)
    if plan.replicas > 1:
        out["replicas"] = plan.replicas
        for row, s in zip(out["stages"], plan.stages, strict=True):
            row["replica"] = s.replica
    if plan.tp_size > 1:
        out["tp_size"] = plan.tp_size
        for row, s in zip(out["stages"], plan.stages, strict=True):
            row["tp_nodes"] = [{"rank": r, "node_id": n.node_id, "node_address": n.key,
                                "usable_bytes": n.memory_usable_bytes,
                                "compute_units": n.compute_units}
                               for r, n in enumerate(s.tp_nodes, start=1)]
    return out


def _plan_json(plan: Plan) -> PlanJSON:
    return {
        "schema": SCHEMA,
        "num_layers": plan.num_layers,
        "layer_bytes": list(plan.layer_bytes),
        "reserve": {"context_tokens": plan.reserve.context_tokens,
                    "activation_bytes": plan.reserve.activation_bytes,
                    "kv_bits": None if plan.reserve.kv_quant is None
                    else plan.reserve.kv_quant.bits,
                    "kv_group_size": None if plan.reserve.kv_quant is None
                    else plan.reserve.kv_quant.group_size},
        "stages": [{"stage": s.stage_id, "rank": s.rank, "node_id": s.node.node_id,
                    "node_address": s.node.key, "address": s.address,
                    "layers": list(s.layers), "weight_bytes": s.weight_bytes,
                    "reserve_bytes": s.reserve_bytes,
                    "usable_bytes": s.usable_bytes,
                    "headroom_bytes": s.headroom_bytes,
                    "compute_units": s.compute_units, "ms_per_token": s.ms_per_token,
                    "split_rule": s.split_rule} for s in plan.stages],
        "spare": [{"node_id": n.node_id, "node_address": n.key,
                   "usable_bytes": n.memory_usable_bytes,
                   "compute_units": n.compute_units} for n in plan.spare],
    }


def _spare(node: PlanNode) -> str:
    speed = f", {units(node.compute_units)} units" if node.compute_units else ""
    return (f"{node.node_id} ({node.key}, {human_bytes(node.memory_usable_bytes)} usable"
            f"{speed})")
