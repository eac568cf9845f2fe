"""Reasoning parsers (`--reasoning-parser`): the text between the think tags comes back as
`reasoning_content`, apart from the answer, in chat messages and stream deltas, through the
official `openai` client; `chat_template_kwargs` reach the template."""

from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import openai
import pytest
from server_utils import ServerThread

from jaxpaged import LLM, SamplingParams
from jaxpaged.reasoning import get_reasoning_parser
from jaxpaged.entrypoints import cli
from jaxpaged.sample.structured_outputs import (ReasoningGate, StructuredOutputsParams,
                                         allocate_bitmask, fill_bitmask)


CHAIN = "<think>Let me see.</think>Paris"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% endif %}{% endif %}")


@pytest.mark.parametrize("name, text, expected", [
    ("qwen3", "<think>abc</think>answer", ("abc", "answer")),
    ("qwen3", "no tags at all", (None, "no tags at all")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "abc</think>answer", (None, "abc</think>answer")),
    ("deepseek_r1", "abc</think>answer", ("abc", "answer")),
    ("deepseek_r1", "still thinking", ("still thinking", None)),
])
def test_split(name, text, expected):
    assert get_reasoning_parser(name).split(text) == expected


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_stream_equals_split_at_any_cut(name):
    """Fed in pieces of every size (tags cut anywhere), a stream sends what `split` finds."""
    parser = get_reasoning_parser(name)
    for text in ("<think>abc</think>answer", "abc</think>x", "plain answer", "<think>open"):
        for size in range(1, len(text) + 1):
            stream, reasoning, answer = parser.stream(), "", ""
            pieces = [text[i:i + size] for i in range(0, len(text), size)]
            for i, piece in enumerate(pieces):
                r, a = stream.feed(piece, final=i == len(pieces) - 1)
                reasoning, answer = reasoning + (r or ""), answer + (a or "")
            want = parser.split(text)
            assert (reasoning or None, answer or None) == want, (text, size)


def test_unknown_parser_is_named():
    with pytest.raises(ValueError, match="reasoning_parser 'o1'"):
        get_reasoning_parser("o1")


@pytest.fixture(scope="module")
def thinking_model_dir(tmp_path_factory, default_model_dir):
    """A tiny Qwen3 that answers any chat with CHAIN: its layers add nothing (zero output
    projections), so the logits read the current token's embedding, and the LM head maps each
    token of the generation prompt's last token + CHAIN to the next one, then to EOS. The
    default model's tokenizer, with the think tags added as single tokens."""
    import torch
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    tokenizer.add_tokens(["<think>", "</think>"])  # one token each, as in Qwen3's vocabulary
    chain = [tokenizer("\n").input_ids[-1], *tokenizer(CHAIN).input_ids,
             tokenizer.eos_token_id]
    assert len(set(chain)) == len(chain), "CHAIN's tokens must be distinct"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, tie_word_embeddings=False, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=tokenizer.eos_token_id)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb = model.model.embed_tokens.weight
        head = model.lm_head.weight
        head.mul_(0.01)
        for a, b in zip(chain, chain[1:]):
            head[b] = emb[a] / emb[a].norm() * 50
    path = tmp_path_factory.mktemp("tiny-qwen3-think")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_reasoning_content_apart_streamed_and_not(thinking_model_dir):
    llm = LLM(thinking_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False,
              reasoning_parser="qwen3")
    llm.get_tokenizer().chat_template = TEMPLATE
    messages = [{"role": "user", "content": "Capital of France?"}]
    [plain] = llm.chat(messages, use_tqdm=False)
    assert plain.outputs[0].text == CHAIN  # the model says its chain
    with ServerThread(llm, "tiny") as server:  # the engine's reasoning parser
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
        message = r.choices[0].message
        assert message.content == "Paris"
        assert message.model_extra["reasoning_content"] == "Let me see."
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(model="tiny", messages=messages,
                                                    temperature=0, stream=True):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None:
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
        assert (reasoning, content) == ("Let me see.", "Paris")
        # chat_template_kwargs reach the template: thinking off adds the empty think block
        on = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
        off = client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        assert off.usage.prompt_tokens > on.usage.prompt_tokens


def test_constraints_apply_after_reasoning(thinking_model_dir):
    """A structured output and a named tool call constrain the answer after `</think>`, not
    the reasoning: the model still thinks its own text, then answers within the constraint
    (it would say "Paris", which the choice leaves out)."""
    llm = LLM(thinking_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False,
              reasoning_parser="qwen3")
    llm.get_tokenizer().chat_template = TEMPLATE
    messages = [{"role": "user", "content": "Capital of France?"}]
    with ServerThread(llm, "tiny") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                           max_tokens=40,
                                           extra_body={"guided_choice": ["London", "Rome"]})
        message = r.choices[0].message
        assert message.model_extra["reasoning_content"] == "Let me see."
        assert message.content in ("London", "Rome") and r.choices[0].finish_reason == "stop"
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(
                model="tiny", messages=messages, temperature=0, max_tokens=40, stream=True,
                extra_body={"guided_choice": ["London", "Rome"]}):
            delta = chunk.choices[0].delta if chunk.choices else None
            if delta is not None:
                reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
                content += delta.content or ""
        assert (reasoning, content) == ("Let me see.", message.content)
        tool = {"type": "function", "function": {"name": "capital", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"], "additionalProperties": False}}}
        r = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=60, tools=[tool],
            tool_choice={"type": "function", "function": {"name": "capital"}})
        message = r.choices[0].message
        assert message.model_extra["reasoning_content"] == "Let me see."
        [call] = message.tool_calls
        assert call.function.name == "capital" and "city" in json.loads(call.function.arguments)
        # /v1/responses: the thinking is a reasoning item before the message, streamed too
        r = client.responses.create(model="tiny", input="Capital of France?", temperature=0)
        assert [item.type for item in r.output] == ["reasoning", "message"]
        assert r.output[0].content[0].text == "Let me see." and r.output_text == "Paris"
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = list(client.responses.create(model="tiny", input="Capital of France?",
                                              temperature=0, stream=True))
        assert "".join(e.delta for e in events
                       if e.type == "response.reasoning_text.delta") == "Let me see."
        assert "".join(e.delta for e in events
                       if e.type == "response.output_text.delta") == "Paris"
        assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    # qwen3: the first token is the grammar's or <think>; an output that does not open with
    # <think> is all answer, constrained from its first token. deepseek_r1: reasoning first.
    engine, (start, end) = llm.llm_engine, llm.llm_engine.think_token_ids
    london = engine.tokenizer("London", add_special_tokens=False).input_ids
    grammar = StructuredOutputsParams(choice=["London", "Rome"])

    def allowed(gate):
        bitmask = allocate_bitmask(1, engine.model_config.vocab_size)
        fill_bitmask(gate, bitmask, 0)
        bits = bitmask[0].view(np.uint32)
        return {t for t in (start, end, london[0], 7) if bits[t // 32] >> (t % 32) & 1}

    gate = ReasoningGate.for_prompt(engine.grammar_compiler.matcher(grammar), [5, 6],
                                    (start, end), starts_inside=False)
    assert allowed(gate) == {start, london[0]}
    for t in london:
        assert gate.consume_token(t)
    assert gate.ended and gate.is_stopped()
    gate = ReasoningGate.for_prompt(engine.grammar_compiler.matcher(grammar), [5, 6],
                                    (start, end), starts_inside=False)
    gate.consume_token(start)  # it thinks: everything allowed until </think>
    assert not gate.ended and allowed(gate) == {start, end, london[0], 7}
    gate.consume_token(end)
    assert gate.ended and allowed(gate) == {london[0]}
    inside = ReasoningGate.for_prompt(engine.grammar_compiler.matcher(grammar), [5, start],
                                      (start, end), starts_inside=True)
    assert allowed(inside) == {start, end, london[0], 7}
    # Thinking off in the prompt (the template closes the think block): constrained at once.
    [out] = llm.chat(messages, SamplingParams(temperature=0, max_tokens=20, structured_outputs=(
        StructuredOutputsParams(choice=["London", "Rome"]))), use_tqdm=False,
        chat_template_kwargs={"enable_thinking": False})
    assert out.outputs[0].text in ("London", "Rome")


@pytest.mark.parametrize("flags, reasoning", [(["--reasoning-parser", "qwen3"], "Let me see."),
                                              ([], None)])
def test_run_batch_takes_the_reasoning_parser(thinking_model_dir, tmp_path, flags, reasoning):
    """`jaxpaged run-batch --reasoning-parser` (one option: the engine's gate and the server's
    split both follow the engine's config) returns the thinking apart and records the parser in
    the manifest; without it the whole chain is the content."""
    model = tmp_path / "model"
    shutil.copytree(thinking_model_dir, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"messages": [{"role": "user", "content": "Capital?"}],
                                        "temperature": 0}}) + "\n")
    assert cli.main(["run-batch", "-i", str(src), "-o", str(out), "--model", str(model),
                     "--no-precompile", "--max-model-len", "256", "--num-kv-blocks", "64",
                     *flags]) == 0
    message = json.loads(out.read_text())["response"]["body"]["choices"][0]["message"]
    assert message.get("reasoning_content") == reasoning
    assert message["content"] == ("Paris" if reasoning else CHAIN)
    manifest = json.loads((tmp_path / "out.jsonl.manifest.json").read_text())
    assert manifest["engine_options"]["reasoning_parser"] == (flags[-1] if flags else None)


def test_engine_reasoning_parser_checked(thinking_model_dir, default_model_dir):
    with pytest.raises(ValueError, match="reasoning_parser 'o1' is not one of"):
        LLM(thinking_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False,
            reasoning_parser="o1")
    # Tags of several tokens: no gate (the server splits the text, refuses constraints).
    llm = LLM(default_model_dir, max_model_len=256, num_kv_blocks=64, precompile=False,
              reasoning_parser="qwen3")
    assert llm.llm_engine.think_token_ids is None
    with ServerThread(llm, "smollm2") as server:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "guided_choice": ["a", "b"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"
