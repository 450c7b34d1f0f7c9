"""The planner prices the KV reserve at ``[serve] kv_bits``'s width (``Reserve.kv_quant``):
``bits / 8`` bytes a key or value element plus a scale and a bias in the model's dtype per
group, as mlx-lm's ``QuantizedKVCache`` holds them; the table and the JSON say the width."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxceld.cluster.plan.candidates import make_plan
from mlxceld.cluster.plan.solver import (
    PlanNode,
    PlanRefused,
    Reserve,
    plan_json,
    plan_stages,
    render_plan_table,
)
from mlxceld.models import layer_profile
from mlxceld.models.kvquant import kv_bytes
from mlxceld.models.profile import LayerProfile
from mlxceld.roles.options import KVQuant
from mlxceld.state.peers import PeerRow

MIB, GIB = 1 << 20, 1 << 30


def profile(layers: int = 32, kv: int = 4096) -> LayerProfile:
    """bfloat16 (2 bytes), ``kv`` bytes a token and layer: 2048 key and value elements."""
    return LayerProfile(layer_bytes=(100 * MIB,) * layers, embed_bytes=0, head_bytes=0,
                        norm_bytes=0, other_bytes=0, tied=False, dtype_bytes=2,
                        hidden_size=1024, kv_bytes_per_token=kv)


def test_a_token_is_priced_at_the_quantized_width() -> None:
    p = profile()
    assert Reserve().token_bytes(p) == 4096
    eight = Reserve(kv_quant=KVQuant(8)).token_bytes(p)
    assert eight == 2048 + 2 * (2048 // 64) * 2 == 2176  # 0.53 of 16 bits
    assert Reserve(kv_quant=KVQuant(4, 32)).token_bytes(p) == 1024 + 2 * 64 * 2
    assert Reserve(context_tokens=1000, kv_quant=KVQuant(8)).layer_bytes(p) == 1000 * 2176
    assert kv_bytes(2048, 4, None) == 8192 and kv_bytes(2048, 4, KVQuant(8)) == 2048 + 256


def test_a_plan_that_does_not_fit_at_full_precision_fits_at_8_bits() -> None:
    """32 layers of 100 MiB on two 2.5 GiB nodes: with 8192 tokens of 4 KiB a layer the KV
    reserve is 32 MiB a layer, and 16 layers with it do not fit (1600 + 512 + 512 MiB
    activations); at 8 bits it is 17 MiB a layer, and they do. The table and JSON say
    which width."""
    nodes = [PlanNode(f"n{i}", f"10.0.0.{i}:19000", 2560 * MIB, 19100) for i in (1, 2)]
    with pytest.raises(PlanRefused):
        plan_stages(profile(), 2, nodes)
    eight = plan_stages(profile(), 2, nodes, reserve=Reserve(kv_quant=KVQuant(8)))
    assert eight.fits
    for s in eight.stages:
        layers = s.layers[1] - s.layers[0]
        assert s.reserve_bytes == layers * 8192 * 2176 + Reserve().activation_bytes
    assert ("KV cache for 8192 tokens at 8 bits (kv_bits; groups of 64) + 512.0 MiB "
            "activations") in render_plan_table(eight).splitlines()[-1]
    full = plan_stages(profile(), 2, [PlanNode(n.node_id, n.address, 3 * GIB, 19100)
                                      for n in nodes])
    assert "at full precision" in render_plan_table(full)
    body = json.loads(json.dumps(plan_json(eight)))
    assert (body["reserve"]["kv_bits"], body["reserve"]["kv_group_size"]) == (8, 64)
    assert plan_json(full)["reserve"]["kv_bits"] is None


def test_make_plan_prices_a_real_checkpoint_at_the_width(kv_fixture_dir: Path) -> None:
    model = kv_fixture_dir / "llama"
    peers = [PeerRow(address=f"127.0.0.{i}:19000", source="static", state="reachable",
                     updated_at=1.0, node_id=f"p{i}", memory_total=64 * GIB,
                     memory_available=32 * GIB, inventory={"ports": [19100], "model": None})
             for i in (2, 3)]
    p = layer_profile(model)
    kv = KVQuant(4, 64)
    proposal = make_plan(peers, model, 2, cluster="lab", coordinator="127.0.0.1:19000",
                         kv_quant=kv)
    assert proposal.plan.reserve.kv_quant == kv
    elements = p.kv_bytes_per_token // p.dtype_bytes  # 2 * 2 KV heads * 64, float32
    for s in proposal.plan.stages:
        layers = s.layers[1] - s.layers[0]
        assert s.reserve_bytes == layers * 8192 * (elements // 2 + 2 * (elements // 64) * 4) \
            + Reserve().activation_bytes
    assert "at 4 bits (kv_bits; groups of 64)" in proposal.table
