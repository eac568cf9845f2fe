"""Tool calling: the parsers read calls from text whole or streamed in any pieces alike; over
HTTP with the openai client and the default model, `tool_choice="required"` and a named
function return calls whose arguments validate against the function's schema (streamed or
not, the same for a seed), a follow-up turn with the tool's result answers, `"auto"` reads
the model's own calls only when the server has a parser, and bad tool definitions are 400s
that leave the server serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.server.tool_calls import (HermesParser, NamedFunction, RequiredCalls,
                                        ToolCallStream)

from conftest import DEFAULT_MODEL_LIMITS

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 20},
                          "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The weather in a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]

HERMES_TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
               '"Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {"timezone": "CET"}}\n</tool_call>')
REQUIRED_TEXT = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "unit": '
                 '"celsius"}}, {"name": "get_time", "parameters": {\n "timezone": "CET"\n}}]')


def read(parser, pieces: list[str]) -> ToolCallStream:
    """Feeds `pieces` one by one, joining the deltas as a client would; checks they add up."""
    stream, content, arguments = ToolCallStream(parser), "", {}
    for i, piece in enumerate(pieces):
        delta, calls = stream.feed(piece, final=i == len(pieces) - 1)
        content += delta
        for call in calls:
            if "id" in call:
                assert call["index"] == len(arguments) and call["function"]["name"]
            arguments[call["index"]] = arguments.get(call["index"], "") + \
                call["function"]["arguments"]
    assert content == stream.content
    assert [arguments[i] for i in range(len(arguments))] == [c.arguments for c in stream.calls]
    return stream


def test_hermes_parser_reads_calls_and_content():
    stream = read(HermesParser(), [HERMES_TEXT])
    assert stream.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    assert stream.finish_reason("stop") == "tool_calls"
    assert stream.finish_reason("length") == "length"
    # a block that is not a call is content; no calls, no "tool_calls"
    plain = read(HermesParser(), ["Hi <tool_call>not json</tool_call> there"])
    assert plain.content == "Hi <tool_call>not json</tool_call> there" and not plain.calls
    assert plain.finish_reason("stop") == "stop"
    # an unclosed last block is read when the text ends
    cut = read(HermesParser(), ['<tool_call>{"name": "get_time", "arguments": {}}'])
    assert [(c.name, c.arguments) for c in cut.calls] == [("get_time", "{}")]


def test_required_calls_parser_and_named_function():
    stream = read(RequiredCalls(), [REQUIRED_TEXT])
    assert [(c.name, json.loads(c.arguments)) for c in stream.calls] == [
        ("get_weather", {"city": 'Pa"ris}', "unit": "celsius"}),
        ("get_time", {"timezone": "CET"})]
    named = read(NamedFunction("get_time"), ['{"timezone": ', '"CET"}'])
    assert [(c.name, c.arguments) for c in named.calls] == [("get_time", '{"timezone": "CET"}')]
    assert read(HermesParser(), [HERMES_TEXT]).calls[0].id != stream.calls[0].id


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_split_into_pieces_reads_the_same(data):
    """A stream's deltas, joined, equal the whole text's content and calls."""
    parser, text = data.draw(st.sampled_from([(HermesParser, HERMES_TEXT),
                                              (RequiredCalls, REQUIRED_TEXT)]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    whole, split = read(parser(), [text]), read(parser(), pieces)
    assert split.content == whole.content
    assert [(c.name, c.arguments) for c in split.calls] == \
        [(c.name, c.arguments) for c in whole.calls]


def test_tools_reach_the_chat_template(default_model_dir):
    """Tools and earlier calls are handed to the template (this one prints them)."""
    from transformers import AutoTokenizer

    from jaxpaged.engine.input_processor import InputProcessor

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.chat_template = (
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} "
        "{{ c.function.arguments.city }}]{% endfor %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    processor = InputProcessor(tokenizer, 49152, 1024)
    messages = [{"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "21 C"}]
    text, _ = processor.chat_prompt(messages, add_generation_prompt=False, tools=TOOLS)
    assert text == "[tool get_weather][tool get_time][call get_weather Paris]assistant: \n" \
        "tool: 21 C\n"


# -- over HTTP -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(default_model_dir):
    from server_utils import ServerThread

    from jaxpaged import LLM

    llm = LLM(default_model_dir, precompile=False, **DEFAULT_MODEL_LIMITS)
    with ServerThread(llm, "smollm2", tool_call_parser="hermes") as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=300)


def check_calls(calls, max_calls: int | None = None) -> list[tuple[str, dict]]:
    """(name, arguments) of calls that each validate against their function's schema."""
    assert calls and (max_calls is None or len(calls) <= max_calls), calls
    assert len({c.id for c in calls}) == len(calls)
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def streamed_calls(client, **kw):
    """(message, finish reason) joined from a stream's deltas by the SDK's stream state."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(stream=True, **kw):
        state.handle_chunk(chunk)
    final = state.current_completion_snapshot.choices[0]
    return final.message, final.finish_reason


def test_required_tool_choice_streamed_and_not(client):
    """Sampled at temperature 1, SmolLM2 sometimes repeats calls until `max_tokens`: then all
    calls but the cut last one validate, and most seeds finish with "tool_calls"."""
    finished = 0
    for seed in range(4):
        kw = dict(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
                  temperature=1.0, seed=seed, max_tokens=160)
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason in ("tool_calls", "length")
        assert choice.message.content is None
        calls = choice.message.tool_calls
        if choice.finish_reason == "length":
            assert len(calls) > 1
            calls = calls[:-1]
        finished += choice.finish_reason == "tool_calls"
        message, finish_reason = streamed_calls(client, **kw)
        assert finish_reason == choice.finish_reason
        # the same seed, the same calls
        assert check_calls(message.tool_calls[:len(calls)]) == check_calls(calls)
    assert finished >= 3


def test_one_call_without_parallel_tool_calls_and_a_named_function(client):
    for seed in range(3):
        choice = client.chat.completions.create(
            model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=160).choices[0]
        check_calls(choice.message.tool_calls, max_calls=1)
        named = {"type": "function", "function": {"name": "get_time"}}
        kw = dict(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice=named,
                  temperature=1.0, seed=seed, max_tokens=160)
        choice = client.chat.completions.create(**kw).choices[0]
        [(name, _)] = check_calls(choice.message.tool_calls, max_calls=1)
        assert name == "get_time" and choice.finish_reason == "tool_calls"
        message, _ = streamed_calls(client, **kw)
        assert check_calls(message.tool_calls) == check_calls(choice.message.tool_calls)


def test_a_follow_up_turn_with_the_tool_result(client, server):
    first = client.chat.completions.create(
        model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=0, max_tokens=160).choices[0].message
    [call] = first.tool_calls
    messages = [*QUESTION, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "21 degrees, sunny"}]
    reply = client.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=24)
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert not choice.message.tool_calls
    # the tool's result is in the prompt the model saw
    tokens = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "21 degrees, sunny" in prompt
    assert reply.usage.prompt_tokens == len(tokens)


def test_auto_reads_the_models_own_calls_only_with_a_parser(client, server):
    """SmolLM2's template shows it no tools, so under "auto" it answers in text."""
    choice = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS,
                                            temperature=0, max_tokens=16).choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "length"

    from jaxpaged.server import protocol as api
    from jaxpaged.server.errors import APIError
    from jaxpaged.server.serving import OpenAIServing

    no_parser = OpenAIServing(server.engine, "smollm2")
    request = api.ChatCompletionRequest.model_validate({"messages": QUESTION, "tools": TOOLS})
    with pytest.raises(APIError, match="--tool-call-parser") as e:
        asyncio.run(no_parser._tool_calls(request))
    assert e.value.param == "tool_choice"


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
     "messages"),
])
def test_bad_tool_definitions_are_400s_and_the_server_keeps_serving(server, change, param):
    body = {"model": "smollm2", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 4, **change}
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                          json={k: v for k, v in body.items() if v is not None})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "messages": QUESTION, "max_tokens": 4})
    assert ok.status_code == 200
