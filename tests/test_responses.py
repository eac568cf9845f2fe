"""`/v1/responses` through the official `openai` client (`client.responses.create`), streamed
and not: text, instructions, a function tool call and its output sent back, a JSON schema,
`previous_response_id` over the in-memory store, and a 400 naming the field for each bad
value, the engine unharmed."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from conftest import DEFAULT_MODEL_LIMITS
from server_utils import ServerThread

from jaxpaged import LLM

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_model_dir):
    llm = LLM(default_model_dir, precompile=False, **DEFAULT_MODEL_LIMITS)
    with ServerThread(llm, "smollm2") as server:
        yield server
    # nothing leaked
    assert llm.llm_engine.block_manager.num_free_blocks == DEFAULT_MODEL_LIMITS["num_kv_blocks"]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=300, max_retries=0)


def test_text_streamed_and_not(client, server):
    kw = dict(model="smollm2", input="What is the capital of France?", temperature=0,
              instructions="Answer in one short sentence.", max_output_tokens=24)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status in ("completed", "incomplete")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert "Paris" in r.output_text
    assert r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == kw["instructions"] and r.max_output_tokens == 24
    # Instructions are the system message: longer ones make a longer prompt.
    longer = client.responses.create(**{**kw, "instructions": kw["instructions"] * 3})
    assert longer.usage.input_tokens > r.usage.input_tokens
    # max_output_tokens cut the answer: incomplete, with the reason
    short = client.responses.create(**{**kw, "max_output_tokens": 2})
    assert short.status == "incomplete"
    assert short.incomplete_details.reason == "max_output_tokens"

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done",
                          "response.completed" if r.status == "completed"
                          else "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text  # greedy: the stream says what the whole answer said
    final = events[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_function_call_and_its_output(client):
    """A named function tool: the output is one function_call item whose arguments meet the
    schema, streamed as argument deltas; its output sent back as an input item continues."""
    kw = dict(model="smollm2", input="What's the weather like in Paris today?",
              tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              temperature=0, max_output_tokens=60)
    r = client.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert r.tools[0].name == "get_weather"

    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    arguments = "".join(e.delta for e in events
                        if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments == events[-3].arguments
    assert events[-1].response.output[0].arguments == call.arguments

    # The call and its output go back as input items: the model answers in text.
    follow = client.responses.create(
        model="smollm2", temperature=0, max_output_tokens=30, tools=[WEATHER],
        tool_choice="none",
        input=[{"role": "user", "content": "What's the weather like in Paris today?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature": 21, "unit": "celsius"})}])
    assert follow.output[0].type == "message" and follow.output_text
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_json_schema(client):
    kw = dict(model="smollm2", input="Invent a person: give a name and an age.",
              temperature=0, max_output_tokens=60,
              text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                               "strict": True}})
    r = client.responses.create(**kw)
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema"
    streamed = "".join(e.delta for e in client.responses.create(**kw, stream=True)
                       if e.type == "response.output_text.delta")
    assert streamed == r.output_text


def test_previous_response_id_and_store(client, server):
    first = client.responses.create(model="smollm2", input="My name is Ada. Say hello.",
                                    temperature=0, max_output_tokens=12)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="smollm2", input="What is my name?",
                                     previous_response_id=first.id, temperature=0,
                                     max_output_tokens=12)
    # The conversation so far (the first input and answer) is in the second prompt.
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    streamed = list(client.responses.create(model="smollm2", input="What is my name?",
                                            previous_response_id=first.id, temperature=0,
                                            max_output_tokens=12, stream=True))
    assert streamed[-1].response.output_text == second.output_text
    # store false keeps nothing; a deleted response is gone
    gone = client.responses.create(model="smollm2", input="Hi", store=False,
                                   max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(gone.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    r = httpx.post(f"{server.url}/v1/responses", json={
        "model": "smollm2", "input": "What is my name?", "previous_response_id": first.id})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "top_p": 0}, "top_p"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "hi", "temperature": "1"}, "temperature"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                         "schema": {"type": "nonsense"}}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "metadata": {"k": "v" * 600}}, "metadata"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input"),
])
def test_bad_fields_are_400_naming_them(server, client, body, param):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "smollm2", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    # the engine is unharmed
    assert client.responses.create(model="smollm2", input="Hi", max_output_tokens=2).output


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server.url}/v1/responses", json={"model": "gpt-9", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_cut_off_call_is_incomplete_and_left_out_of_the_history(client):
    """max_output_tokens cuts a named call's arguments: the item is "incomplete", and the
    stored conversation leaves the call out, so a continuation still renders."""
    r = client.responses.create(model="smollm2", input="What's the weather like in Paris?",
                                tools=[WEATHER], max_output_tokens=3, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "incomplete" and r.output[0].status == "incomplete"
    events = list(client.responses.create(
        model="smollm2", input="What's the weather like in Paris?", tools=[WEATHER],
        max_output_tokens=3, temperature=0, stream=True,
        tool_choice={"type": "function", "name": "get_weather"}))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output[0].status == "incomplete"
    follow = client.responses.create(model="smollm2", input="Never mind.", temperature=0,
                                     previous_response_id=r.id, max_output_tokens=4)
    alone = client.responses.create(model="smollm2", input="Never mind.", temperature=0,
                                    max_output_tokens=4)
    # The continuation rendered the earlier turn (its question) before the new input.
    assert follow.status in ("completed", "incomplete") and follow.output
    assert follow.usage.input_tokens > alone.usage.input_tokens + 5
