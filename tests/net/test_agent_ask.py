"""``net.agent.ask``: one question to an agent, one answer, one failure type whose kind
says at which step it failed. Real agents on 127.0.0.1, real MXCL."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from mlxceld.net import MxclStream
from mlxceld.net.agent import AgentService, ask
from mlxceld.net.errors import AskFailed
from mlxceld.wire import Envelope, MessageSpec, encode_envelope

from helpers import keys
from helpers.mxcl import CLIENT_ID, OTHER_SECRET, SECRET, run, running
from helpers.ports import free_port

ANSWERS = {"echo": MessageSpec()}


@dataclass(frozen=True)
class Raw:
    """A message of any type, as its header."""

    header: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        return self.header


async def asked(question: dict[str, object], *, ring: object = None, answer_s: float = 2.0,
                stall: bool = False) -> object:
    agent = AgentService(("127.0.0.1", 0), keys.keyring(SECRET))

    async def echo(stream: MxclStream, message: Envelope) -> None:
        if stall:
            await asyncio.sleep(10)
        await stream.send(encode_envelope({"t": "echo", "got": message.header.get("n")}))

    agent.add_handler(3, "question", echo)
    async with running(agent):
        return await ask(CLIENT_ID, agent.address, Raw(question),
                         keyring=ring or keys.keyring(SECRET), channel=3, answers=ANSWERS,
                         connect_s=0.5, answer_s=answer_s)


def test_one_question_gets_its_answer_and_the_key_it_came_under() -> None:
    answer = run(asked({"t": "question", "n": 7}))
    assert answer.type == "echo" and answer.header == {"t": "echo", "got": 7}
    assert answer.key_id == keys.keyring(SECRET).primary_id


@pytest.mark.parametrize(("kwargs", "kind"), [
    ({"question": {"t": "unserved"}}, "error"),
    ({"question": {"t": "question"}, "ring": keys.keyring(OTHER_SECRET)}, "connect"),
    ({"question": {"t": "question"}, "stall": True, "answer_s": 0.2}, "timeout"),
])
def test_each_failure_is_one_type_whose_kind_names_the_step(kwargs: dict[str, object],
                                                            kind: str) -> None:
    with pytest.raises(AskFailed) as err:
        run(asked(**kwargs))  # type: ignore[arg-type]
    assert err.value.kind == kind, err.value.message
    if kind == "timeout":
        assert err.value.message == "no answer within 0.2 s"
    if kind == "error":
        assert "unserved" in err.value.detail


def test_nobody_listening_or_no_address_fails_before_any_answer() -> None:
    nobody = f"127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(AskFailed) as err:
        run(ask(CLIENT_ID, nobody, Raw({"t": "question"}), keyring=keys.keyring(SECRET),
                channel=3, answers=ANSWERS, connect_s=0.3, answer_s=1.0))
    assert err.value.kind == "connect"  # unreachable (or refused, should another take it)
    with pytest.raises(AskFailed) as err:
        run(ask(CLIENT_ID, "no port", Raw({"t": "question"}), keyring=keys.keyring(SECRET),
                channel=3, answers=ANSWERS, connect_s=0.3, answer_s=1.0))
    assert err.value.kind == "address"
