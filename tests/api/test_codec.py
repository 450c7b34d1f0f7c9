"""MlxTextCodec over a real tokenizer: a tiny byte-level BPE trained here, in
transformers' fast wrapper, with a ChatML template, in mlx-lm's TokenizerWrapper."""

from __future__ import annotations

import functools
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    TokenizerWrapper,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from mlxceld.api import ChatMessage, ChatTemplateError, MlxTextCodec, TextCodec

CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}{{ raise_exception('no tool role here') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 20,
    "A router serves OpenAI clients; engines generate tokens, and stages pass tensors. " * 20,
    "Pack my box with five dozen liquor jugs! 0123456789 " * 20,
]
TEXTS = ["héllo wörld, the fox 🦊 jumps", "日本語のテキスト", "plain ascii over the lazy dog",
         "emoji 👩‍👩‍👧 and ñ and \n newlines\n\n"]


@functools.cache
def hf_tokenizer() -> Any:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>",
                                   chat_template=CHATML)


def codec(detokenizer: Any = BPEStreamingDetokenizer, template: bool = True) -> MlxTextCodec:
    hf = hf_tokenizer()
    if not template:
        hf = PreTrainedTokenizerFast(tokenizer_object=hf.backend_tokenizer,
                                     eos_token="<|im_end|>")
    return MlxTextCodec(TokenizerWrapper(hf, detokenizer))


def test_it_is_a_text_codec_with_the_eos_of_the_tokenizer() -> None:
    real: TextCodec = codec()
    assert real.eos_token_ids == frozenset({hf_tokenizer().convert_tokens_to_ids("<|im_end|>")})


@pytest.mark.parametrize("detokenizer", [BPEStreamingDetokenizer, NaiveStreamingDetokenizer])
@pytest.mark.parametrize("text", TEXTS)
def test_decoding_token_by_token_gives_the_text_in_whole_characters(detokenizer: Any,
                                                                    text: str) -> None:
    real = codec(detokenizer)
    ids = real.encode_prompt(text)
    assert len(ids) > 1
    decoder = real.decoder()
    pieces = [decoder.add(token) for token in ids] + [decoder.finish()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    # Every piece is whole UTF-8: it round-trips through bytes on its own.
    assert all(piece.encode().decode() == piece for piece in pieces)


def test_two_decoders_do_not_share_state() -> None:
    real = codec()
    first, second = real.decoder(), real.decoder()
    a, b = real.encode_prompt("the fox"), real.encode_prompt("lazy dog")
    assert "".join([*(first.add(t) for t in a), first.finish()]) == "the fox"
    assert "".join([*(second.add(t) for t in b), second.finish()]) == "lazy dog"


def test_the_chat_template_is_applied_with_a_generation_prompt() -> None:
    real = codec()
    ids = real.encode_chat([ChatMessage("system", "be brief"), ChatMessage("user", "hi")])
    text = hf_tokenizer().decode(ids)
    assert text == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_a_template_that_refuses_the_messages_is_a_chat_template_error() -> None:
    with pytest.raises(ChatTemplateError, match="no tool role here"):
        codec().encode_chat([ChatMessage("tool", "42")])


def test_without_a_template_a_plain_one_is_used() -> None:
    ids = codec(template=False).encode_chat([ChatMessage("user", "hi")])
    assert hf_tokenizer().decode(ids) == "user: hi\nassistant:"


def test_features_tools_and_template_kwargs_over_the_tools_fixture(tmp_path: Any) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxceld.api import CalledTool, ChatFeatures
    from mlxceld.models import preset, write_fixture

    directory = write_fixture(tmp_path / "tools", preset("tiny", chat_template="tools"))
    codec = MlxTextCodec(load_tokenizer(directory))
    features = codec.features
    assert features.tool_call == ("<tool_call>", "</tool_call>")
    assert features.think == ("<think>", "</think>")
    assert dict(features.marker_ids).keys() == {"<tool_call>", "</tool_call>", "<think>",
                                                "</think>"}
    assert features.parse_tool_call is not None
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    messages = [ChatMessage("user", "go"),
                ChatMessage("assistant", "", (CalledTool("call_1", "f", '{"x": 1}'),)),
                ChatMessage("tool", "42", tool_call_id="call_1")]
    ids = codec.encode_chat(messages, tools=tools)
    decoder = codec.decoder()
    text = "".join(decoder.add(t) for t in ids) + decoder.finish()
    assert '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>' in text
    assert '"name": "f"' in text.split("</tools>")[0]
    assert codec.opens_thinking(ids)
    closed = codec.encode_chat(messages[:1], template_kwargs={"enable_thinking": False})
    assert not codec.opens_thinking(closed)
    plain = MlxTextCodec(TokenizerWrapper(hf_tokenizer()))
    assert plain.features == ChatFeatures()  # a plain template: no tools, no thinking
