"""GenerateRequest.messages: one of the three prompt fields, roles and sizes checked before tokenizing."""

from __future__ import annotations

import pytest

from router.validate import MAX_MESSAGES, Limits, parse, parse_prompt
from specdec.core.params import InvalidParams
from specdec.rpc import generate_pb2
from specdec.rpc.client import build_request

LIMITS = Limits.for_model(max_context=64, max_prompt_bytes=100)


def _field(req) -> str:
    with pytest.raises(InvalidParams) as err:
        parse(req, LIMITS)
    return err.value.field


def test_a_conversation_is_parsed_in_order_and_templated():
    turns = [("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello."), ("user", "Bye")]
    parsed = parse(build_request(messages=turns), LIMITS)
    assert parsed.messages == turns and parsed.chat and parsed.prompt is None and parsed.prompt_ids is None
    dicts = [{"role": r, "content": c} for r, c in turns]
    assert (
        parse_prompt(generate_pb2.TokenizeRequest(messages=build_request(messages=dicts).messages), LIMITS).messages
        == turns
    )


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"messages": [("user", "hi")], "prompt": "x"}, "messages"),
        ({"messages": [("user", "hi")], "prompt_token_ids": [1]}, "messages"),
        ({"messages": [("user", "hi"), ("tool", "x")]}, "messages[1].role"),
        ({"messages": [("user", "a" * 60), ("user", "b" * 41)]}, "messages[1].content"),
        ({"messages": [("user", "é" * 51)]}, "messages[0].content"),  # 102 bytes in 51 characters
        ({"messages": [("user", "x")] * (MAX_MESSAGES + 1)}, "messages"),
    ],
)
def test_bad_conversations_name_the_field(kwargs, field):
    assert _field(build_request(**kwargs)) == field


def test_the_byte_bound_is_inclusive():
    assert parse(build_request(messages=[("user", "a" * 60), ("user", "b" * 40)]), LIMITS).messages
