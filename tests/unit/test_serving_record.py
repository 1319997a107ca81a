"""An agent episode's record (token in, token out across HTTP) and the chat helpers it compares with."""

from __future__ import annotations

import json

import pytest

from rlfleet.serving.chat import ChatMessage, message_json, read_messages, read_tools, reply_message
from rlfleet.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from rlfleet.serving.record import EpisodeRecord, Turn

CALC = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluates",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def user(text: str) -> ChatMessage:
    return ChatMessage("user", text)


def test_an_extending_turn_appends_the_observation_then_the_sample() -> None:
    record = EpisodeRecord(seed=1)
    first = Turn([1, 2, 3], None, (user("q"),), None)
    record.commit(first, [10, 11], [-0.1, -0.2], True, ChatMessage("assistant", "a"))
    new = record.extends((user("q"), ChatMessage("assistant", "a"), user("again")), None)
    assert new == (user("again"),)
    second = Turn(
        [1, 2, 3, 10, 11, 7, 8], [7, 8], (user("q"), ChatMessage("assistant", "a"), user("again")), None
    )
    record.commit(second, [12], [-0.3], False, ChatMessage("assistant", "b"))
    (segment,) = record.segments
    assert segment.prompt_ids == [1, 2, 3]
    assert segment.token_ids == [10, 11, 7, 8, 12]
    assert segment.mask == [1, 1, 0, 0, 1]
    assert segment.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert record.requests == 2 and record.history_edits == 0 and record.dropped_tokens == 0
    assert not record.last_finished
    assert record.conversation[-1] == {"role": "assistant", "content": "b"}


@pytest.mark.parametrize(
    "messages",
    [
        (user("q2"), ChatMessage("assistant", "a"), user("again")),  # an earlier message edited
        (user("q"), ChatMessage("assistant", "not what was sampled"), user("again")),  # the reply edited
        (user("q"), ChatMessage("assistant", "a")),  # nothing new after the reply
        (user("again"),),  # the history dropped
    ],
)
def test_a_history_that_does_not_extend_the_last_turn_starts_a_segment(
    messages: tuple[ChatMessage, ...],
) -> None:
    record = EpisodeRecord(seed=1)
    record.commit(
        Turn([1, 2], None, (user("q"),), None), [10, 11], [-0.1, -0.2], True, ChatMessage("assistant", "a")
    )
    assert record.extends(messages, None) is None
    record.commit(Turn([5, 6], None, messages, None), [12], [-0.3], True, ChatMessage("assistant", "c"))
    assert len(record.segments) == 2 and record.history_edits == 1
    assert record.current is not None and record.current.context() == [5, 6, 12]
    assert record.dropped_tokens == 2  # the first segment's samples are not trained


def test_changed_tools_start_a_segment() -> None:
    record = EpisodeRecord(seed=1)
    record.commit(Turn([1], None, (user("q"),), "tools-a"), [10], [-0.1], True, ChatMessage("assistant", "a"))
    history = (user("q"), ChatMessage("assistant", "a"), user("more"))
    assert record.extends(history, "tools-a") == (user("more"),)
    assert record.extends(history, "tools-b") is None


def test_completion_turns_extend_by_token_prefix() -> None:
    record = EpisodeRecord(seed=1)
    first = record.token_turn([1, 2])
    assert first.observation is None
    record.commit(first, [3], [-0.5], True, None)
    extending = record.token_turn([1, 2, 3, 4])
    assert extending.observation == [4]
    record.commit(extending, [5], [-0.6], True, None)
    assert record.segments[0].mask == [1, 0, 1]
    assert record.token_turn([1, 2, 9]).observation is None  # diverges: a new segment
    assert record.token_turn([1, 2, 3, 4, 5]).observation == []  # the same context again: nothing new


def test_a_chat_turn_after_a_completion_turn_starts_a_segment() -> None:
    record = EpisodeRecord(seed=1)
    record.commit(record.token_turn([1]), [2], [-0.1], True, None)
    assert record.extends((user("q"),), None) is None


# ------------------------------------------------------------------------------------------ messages


def test_messages_are_read_as_the_template_renders_them() -> None:
    raw = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2*3?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": '{"expression":  "2*3"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "6"},
    ]
    system, question, call, result = read_messages(raw)
    assert system == ChatMessage("system", "be brief")
    assert question.content == "What is 2*3?"
    assert call.tool_calls == (("calculator", '{"expression": "2*3"}'),)
    rendered = call.for_template()["content"]
    assert rendered.startswith("<tool_call>\n") and rendered.endswith("\n</tool_call>")
    assert json.loads(rendered.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {
        "name": "calculator",
        "arguments": {"expression": "2*3"},
    }
    assert result == ChatMessage("tool", "6")


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "only text content"),
        ([{"role": "user", "content": 5}], "content must be a string"),
        ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], "not JSON"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "function.name"),
    ],
)
def test_malformed_messages_are_400_errors(raw: list[dict], words: str) -> None:
    with pytest.raises(APIError, match=words) as caught:
        read_messages(raw)
    assert caught.value.status == 400 and caught.value.body()["error"]["param"] == "messages"


def test_a_reply_with_calls_of_the_requests_tools_comes_back_as_tool_calls() -> None:
    tools = read_tools(CALC)
    call = '{"name": "calculator", "arguments": {"expression": "12*3"}}'
    text = f"Let me compute.<tool_call>\n{call}\n</tool_call>"
    reply = reply_message(text, tools)
    assert reply.content == "Let me compute." and reply.tool_calls == (
        ("calculator", '{"expression": "12*3"}'),
    )
    body = message_json(reply)
    assert body["tool_calls"][0]["function"] == {"name": "calculator", "arguments": '{"expression": "12*3"}'}
    assert body["tool_calls"][0]["id"].startswith("call_") and body["tool_calls"][0]["type"] == "function"
    # sent back in the history, the message compares equal to the reply (its ids and JSON spacing aside)
    assert read_messages([body])[0] == reply


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',  # not one of the request's tools
        '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',  # a required argument missing
        "<tool_call>not json</tool_call>",
        "#### 36",
    ],
)
def test_a_reply_without_well_formed_calls_is_plain_text(text: str) -> None:
    reply = reply_message(text, read_tools(CALC))
    assert reply == ChatMessage("assistant", text)
    assert message_json(reply) == {"role": "assistant", "content": text}


def test_malformed_tools_are_400_errors() -> None:
    with pytest.raises(APIError, match="function tool"):
        read_tools([{"type": "retrieval"}])


# ------------------------------------------------------------------------------------------ requests


def test_requests_refuse_what_the_server_cannot_honour() -> None:
    base = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    for extra, param in [({"stream": True}, "stream"), ({"top_logprobs": 2}, "top_logprobs")]:
        with pytest.raises(APIError) as caught:
            ChatCompletionRequest.model_validate({**base, **extra}).refuse_unsupported()
        assert caught.value.param == param
    with pytest.raises(APIError, match="stop"):
        ChatCompletionRequest.model_validate({**base, "stop": ["a", ""]}).stop_strings()
    # fields an OpenAI client sends that change nothing here are accepted
    ChatCompletionRequest.model_validate({**base, "user": "u1", "presence_penalty": 0}).refuse_unsupported()
    with pytest.raises(APIError, match="echo"):
        CompletionRequest.model_validate(
            {"model": "policy", "prompt": "x", "echo": True}
        ).refuse_unsupported()
    assert CompletionRequest.model_validate({"model": "policy", "prompt": "x"}).token_limit() == 16
