"""``[serve] draft_model`` and ``num_draft_tokens`` and their flags (config/speculative.py):
parsed, carried to the router's options, and refused by name: k out of range or without
a draft, a draft of another tokenizer, and every place speculative decoding is not built
(a pipeline's stage host, a node role but hybrid); a tensor group takes one (its rank 0
drafts), and so does kv_bits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from mlxceld.cli import app, overrides
from mlxceld.config.daemon import Config, build_config
from mlxceld.config.serve import router_options
from mlxceld.errors import ConfigError
from mlxceld.models.fixtures import agreeing_pair, preset, write_fixture
from mlxceld.roles.options import options_json, parse_options


def config(tmp_path: Path, args: list[str], serve: dict[str, object] | None = None
           ) -> Config:
    command = typer.main.get_command(app)
    with command.make_context("mlxceld", args) as ctx:
        flags = overrides(ctx.params)
    data = {"daemon": {"state_dir": str(tmp_path / "s")}, "serve": serve or {}}
    return build_config(data, tmp_path / "m.toml", flags)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("drafts")
    # heads of 64 elements: a quantized KV cache fits (kv_bits with a draft is taken)
    target, draft = agreeing_pair(preset("tiny", family="llama", layers=2, hidden=128,
                                         heads=2, kv_heads=2))
    write_fixture(root / "target", target)
    write_fixture(root / "draft", draft)
    write_fixture(root / "v600", preset("tiny", family="llama", layers=1, vocab=600))
    write_fixture(root / "tok300", preset("tiny", family="llama", layers=1,
                                          tokenizer_vocab=300))
    return root


def test_keys_and_flags_set_it_and_the_router_gets_it(tmp_path: Path, models: Path) -> None:
    plain = config(tmp_path, [])
    assert plain.serve.draft_model is None and plain.serve.num_draft_tokens == 4
    target, draft = str(models / "target"), str(models / "draft")
    cfg = config(tmp_path, ["--model", target, "--draft-model", draft,
                            "--num-draft-tokens", "6"])
    assert (cfg.serve.draft_model, cfg.serve.num_draft_tokens) == (draft, 6)
    file = config(tmp_path, [], {"model": target, "draft_model": draft})
    assert (file.serve.draft_model, file.serve.num_draft_tokens) == (draft, 4)
    group = config(tmp_path, ["--model", target, "--draft-model", draft, "--tp-size", "2"])
    assert (group.serve.draft_model, group.serve.tp_size) == (draft, 2)
    options = router_options(cfg.serve)
    assert (options.draft_model, options.num_draft_tokens) == (draft, 6)
    assert parse_options("router", json.loads(json.dumps(options_json(options)))) == options
    with pytest.raises(ConfigError, match=r"options\.num_draft_tokens' must be in 1-32"):
        parse_options("router", {**options_json(options), "num_draft_tokens": 0})


@pytest.mark.parametrize(("args", "serve", "named"), [
    (["--num-draft-tokens", "0"], {}, r"--num-draft-tokens must be a number of tokens in "
     r"1-32, not 0"),
    ([], {"num_draft_tokens": 33}, r"'serve\.num_draft_tokens' must be a number"),
    ([], {"num_draft_tokens": True}, r"'serve\.num_draft_tokens' must be a number"),
    (["--num-draft-tokens", "3"], {}, r"--num-draft-tokens means nothing without "
     r"draft_model"),
    ([], {"draft_model": 5}, r"'serve\.draft_model' must be a string"),
    (["--draft-model", "DRAFT", "--pp-peer"], {}, r"--draft-model with pp_peer "
     r"\(--pp-peer\): a pipeline's draft is the cluster TOML's \[cluster\] draft_model"),
    ([], {"draft_model": "DRAFT", "node_role": "router", "replicas": ["10.0.0.2"]},
     r"'serve\.draft_model' with node_role router"),
    (["--draft-model", "V600"], {}, r"--draft-model: draft model .*v600 has a vocabulary "
     r"of 600 tokens, the target .* 512"),
    (["--draft-model", "TOK300"], {}, r"--draft-model: draft model .*tok300's tokenizer "
     r"\(tokenizer\.json\) is not the target's"),
])
def test_refused_by_name(tmp_path: Path, models: Path, args: list[str],
                         serve: dict[str, object], named: str) -> None:
    names = {"DRAFT": str(models / "draft"), "V600": str(models / "v600"),
             "TOK300": str(models / "tok300")}
    args = [names.get(a, a) for a in args]
    serve = {k: names.get(v, v) if isinstance(v, str) else v for k, v in serve.items()}
    with pytest.raises(ConfigError, match=named):
        config(tmp_path, ["--model", str(models / "target"), *args], serve)


def test_a_quantized_kv_cache_with_a_draft_is_taken(tmp_path: Path, models: Path) -> None:
    """The local engine's and a --pp-auto coordinator's (its stages speculate over
    quantized caches: pipeline/speculating.py)."""
    target, draft = str(models / "target"), str(models / "draft")
    local = config(tmp_path, ["--model", target, "--draft-model", draft, "--kv-bits", "4"])
    assert local.serve.draft_model == draft and local.serve.kv_quant is not None
    options = router_options(local.serve)
    assert options.draft_model == draft and options.kv_quant == local.serve.kv_quant
    auto = config(tmp_path, ["--pp-auto", "2"], {"model": target, "draft_model": draft,
                                                 "kv_bits": 8})
    assert auto.serve.draft_model == draft and auto.serve.kv_quant is not None


def test_a_pp_auto_coordinator_s_draft_travels_in_its_plans(tmp_path: Path,
                                                            models: Path) -> None:
    """Accepted on a --pp-auto coordinator: its router holds no draft (the pipeline's last
    stage does), and each plan's cluster TOML names it for the stages."""
    from mlxceld.cluster.clusterfile.load import dump_cluster, parse_cluster_text
    from mlxceld.cluster.clusterfile.model import StageEntry, pipeline_cluster
    from mlxceld.cluster.plan.candidates import Proposal, drafted
    from mlxceld.roles.options import PipelineOptions, PipelineStage

    draft = str(models / "draft")
    cfg = config(tmp_path, ["--model", str(models / "target"), "--draft-model", draft,
                            "--num-draft-tokens", "5", "--pp-auto", "2"])
    stages = PipelineOptions(stages=(PipelineStage("s0", "127.0.0.2:7000", 0, (0, 2)),),
                             coordinator="127.0.0.1:19000", model_identity="ab" * 32,
                             cluster="c")
    assert router_options(cfg.serve, pipeline=stages).draft_model is None
    toml = dump_cluster(pipeline_cluster(
        "c", models / "target", ("coordinator", "127.0.0.1:19000"),
        [StageEntry("s0", "127.0.0.2:7000", (0, 1)), StageEntry("s1", "127.0.0.3:7000",
                                                                (1, 2))],
        path=tmp_path / "c.toml"))
    proposal = Proposal(None, "ab" * 32, toml, "", ())  # type: ignore[arg-type]
    assert drafted(proposal, (None, 4)) is proposal
    planned = parse_cluster_text(drafted(proposal, (draft, 5)).toml, tmp_path / "c.toml")
    assert (planned.draft_model, planned.num_draft_tokens) == (draft, 5)
