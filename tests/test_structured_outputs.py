"""Structured outputs on the default model: sampled outputs under a JSON schema, a regex or a
choice always meet it; a constraint the greedy output already meets changes nothing; the
constraint holds with n > 1, seeds, chunked prefill and preemption, and stop strings still
end it; a bad
schema, regex or grammar is a ValueError naming it."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxpaged import SamplingParams
from jaxpaged.sample.structured_outputs import StructuredOutputsParams

from conftest import DEFAULT_MODEL_LIMITS

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
QUESTION = [{"role": "user", "content": "Describe a user of a website as a JSON object."}]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    from jaxpaged import LLM

    return LLM(default_model_dir, precompile=False, **DEFAULT_MODEL_LIMITS)


def constrained(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


def test_sampled_outputs_meet_a_nested_schema(llm):
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=256,
                             structured_outputs=constrained(json=SCHEMA)) for i in range(8)]
    outputs = llm.chat([QUESTION] * 8, params, use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert len({o.outputs[0].text for o in outputs}) > 6  # sampled, not one answer


def test_regex_and_choice(llm):
    regex = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}"
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=32,
                             structured_outputs=constrained(regex=regex)) for i in range(8)]
    for out in llm.generate(["A name and a phone number:"] * 8, params, use_tqdm=False):
        assert re.fullmatch(regex, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    choices = ["red", "green", "blue", "light blue"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8,
                             structured_outputs=constrained(choice=choices)) for i in range(8)]
    texts = [o.outputs[0].text for o in llm.generate(["My favourite colour is"] * 8, params,
                                                     use_tqdm=False)]
    assert set(texts) <= set(choices) and len(set(texts)) > 1, texts


def test_greedy_output_that_meets_the_schema_is_unchanged(llm):
    """SmolLM2's greedy answer here is already `{"city": "Paris", "country": "FRANCE"}` and
    then EOS: under the schema it is the same tokens, ending when the object closes."""
    messages = [{"role": "user", "content": 'Give the capital of France as JSON: {"city": ..., '
                 '"country": ...}. No other text.'}]
    schema = {"type": "object", "properties": {"city": {"type": "string"},
                                                "country": {"type": "string"}},
              "required": ["city", "country"]}
    free = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40),
                    use_tqdm=False)[0].outputs[0]
    json.loads(free.text)  # the premise: unconstrained, it already meets the schema
    bound = llm.chat(messages, SamplingParams(temperature=0, max_tokens=40,
                                              structured_outputs=constrained(json=schema)),
                     use_tqdm=False)[0].outputs[0]
    assert bound.text == free.text
    assert bound.token_ids == free.token_ids[:len(bound.token_ids)]
    assert len(bound.token_ids) >= len(free.token_ids) - 1  # at most the EOS less


def test_stop_strings_end_a_constrained_output(llm):
    """A stop string ends the output where it appears, as without a constraint (inside a JSON
    value too: a stop string can cut JSON short, as in vLLM)."""
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=8, stop=[" "],
                             structured_outputs=constrained(choice=["red apple", "green pear"]))
              for i in range(4)]
    for out in llm.generate(["I would like a"] * 4, params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.text in ("red", "green") and completion.stop_reason == " "


def test_with_n_seeds_chunks_and_preemption(llm, make_llm, default_model_dir):
    """n = 3 under a schema on an engine that chunks prompts (16-token steps) and preempts
    (a pool of 16 blocks of 16 tokens for three completions of a 57-token prompt): every
    completion meets it, and the same seeds give the same completions as on the module's
    engine, with room for all."""
    question = [{"role": "user", "content": "Describe a user of a website as a JSON object. "
                 "Use short names and keep it brief, please, as this is a test."}]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=160,
                            structured_outputs=constrained(json=SCHEMA))
    tight = make_llm(default_model_dir, max_model_len=256, num_kv_blocks=16,
                     max_num_batched_tokens=16, long_prefill_token_threshold=16)
    want = llm.chat([question], params, use_tqdm=False)
    got = tight.chat([question], params, use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    for w, g in zip(want, got):
        for a, b in zip(w.outputs, g.outputs):
            jsonschema.validate(json.loads(b.text), SCHEMA)
            assert a.text == b.text


@pytest.mark.parametrize("kw, message", [
    (dict(json={"type": "bogus"}), r"(?s)structured_outputs\.json is invalid: .*bogus"),
    (dict(json="{not json"), r"structured_outputs\.json is invalid"),
    (dict(regex="a(b"), r"(?s)structured_outputs\.regex is invalid: .*unclosed group"),
    (dict(grammar="start: undefined_rule"), r"structured_outputs\.grammar is invalid"),
])
def test_a_bad_constraint_is_a_value_error_naming_it(llm, kw, message):
    with pytest.raises(ValueError, match=message) as info:
        llm.generate("x", SamplingParams(structured_outputs=constrained(**kw)), use_tqdm=False)
    assert info.value.param == "structured_outputs"
    assert llm.stats()["num_waiting"] == llm.stats()["num_running"] == 0


def test_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, "
                       r"json_object; got \['regex', 'choice'\]"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()


# -- over HTTP -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llm):
    from server_utils import ServerThread

    with ServerThread(llm, "smollm2") as server:
        yield server


def test_openai_parse_helper_returns_a_parsed_object(server):
    """The SDK's `chat.completions.parse(response_format=<pydantic model>)` sends a strict
    json_schema and parses the answer."""
    import openai
    import pydantic

    class Capital(pydantic.BaseModel):
        city: str
        country: str
        population_millions: int

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", timeout=300)
    for seed in range(3):
        reply = client.chat.completions.parse(
            model="smollm2", response_format=Capital, temperature=1.0, seed=seed,
            max_tokens=96,
            messages=[{"role": "user", "content": "What is the capital of France?"}])
        parsed = reply.choices[0].message.parsed
        assert isinstance(parsed, Capital), reply.choices[0].message.content


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"structured_outputs": {"regex": "[a-z]{1,8} [0-9]{2}"}},
    {"guided_regex": "[a-z]{1,8} [0-9]{2}"},
    {"guided_choice": ["yes", "no"]},
    {"guided_json": {"type": "object",
                     "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                     "required": ["n"], "additionalProperties": False}},
])
def test_each_request_field_constrains(server, extra):
    import httpx

    body = {"model": "smollm2", "prompt": "Answer:", "max_tokens": 128, "temperature": 1.0,
            "seed": 3, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["text"]
    assert response.json()["choices"][0]["finish_reason"] == "stop", text
    if "response_format" in extra:
        assert isinstance(json.loads(text), dict)
    elif "guided_json" in extra:
        assert isinstance(json.loads(text)["n"], int)
    elif "guided_choice" in extra:
        assert text in ("yes", "no")
    else:
        assert re.fullmatch("[a-z]{1,8} [0-9]{2}", text), text


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"guided_grammar": "start: missing"}, "guided_grammar"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_a_bad_constraint_is_a_400_and_the_server_keeps_serving(server, extra, param):
    import httpx

    body = {"model": "smollm2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, **extra}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
        "model": "smollm2", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert ok.status_code == 200
