"""vLLM's sampling and output semantics: logprobs and penalties against HF, stops, text."""

import numpy as np
import pytest
import torch
from output_utils import assert_idle
from transformers import AutoTokenizer, LlamaForCausalLM as HFLlama

from jaxpaged import SamplingParams
from jaxpaged.engine.detokenizer import IncrementalDetokenizer

PROMPTS = ["The capital of France is", "Write a short list of fruits:", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def shared():
    """`get(model_dir) -> (engine, HF reference)`: one `LLM` (`make_llm`'s limits) and one
    transformers model per model, built on first use and shared by the module's tests."""
    from jaxpaged import LLM

    built = {}

    def get(model_dir):
        if model_dir not in built:
            built[model_dir] = (
                LLM(model_dir, max_model_len=256, num_kv_blocks=256, precompile=False),
                HFLlama.from_pretrained(model_dir, dtype=torch.float32).eval())
        return built[model_dir]

    get.built = built
    yield get
    built.clear()


@pytest.fixture(autouse=True)
def shared_left_idle(request):
    """After each test that used `shared`: every engine's blocks free, nothing queued."""
    yield
    if "shared" in request.fixturenames:
        for llm, _ in request.getfixturevalue("shared").built.values():
            assert_idle(llm)


@pytest.mark.parametrize("model", ["tiny", pytest.param("default", marks=pytest.mark.slow)])
def test_logprobs_equal_hf_log_softmax(model, shared, tiny_model_dir, default_model_dir):
    model_dir = tiny_model_dir if model == "tiny" else default_model_dir
    llm, reference = shared(model_dir)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        c = out.outputs[0]
        ids = out.prompt_token_ids + c.token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0].double()
        want = torch.log_softmax(logits, -1).numpy()[len(out.prompt_token_ids) - 1:-1]
        assert len(c.logprobs) == len(c.token_ids)
        for step, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            top5 = np.argsort(-want[step])[:5]
            assert set(entry) == set(top5.tolist()) | {token}
            for t, lp in entry.items():
                assert abs(lp.logprob - want[step, t]) < 1e-4, (step, t)
            assert entry[token].rank == 1  # greedy
        assert abs(c.cumulative_logprob - sum(want[i, t] for i, t in enumerate(c.token_ids))) < 1e-3


@pytest.mark.parametrize("model, penalty", [
    ("tiny", 0.3),  # < 1 favours seen tokens: a random model otherwise rarely repeats
    pytest.param("default", 1.3, marks=pytest.mark.slow)])
def test_repetition_penalty_equals_hf(model, penalty, shared, tiny_model_dir,
                                      default_model_dir):
    model_dir = tiny_model_dir if model == "tiny" else default_model_dir
    llm, reference = shared(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = SamplingParams(temperature=0, max_tokens=16, repetition_penalty=penalty,
                            ignore_eos=True)
    plain = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    differs = False
    for prompt, out, base in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False),
                                 llm.generate(PROMPTS, plain, use_tqdm=False)):
        ids = tokenizer(prompt).input_ids
        with torch.no_grad():
            want = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                      repetition_penalty=penalty, pad_token_id=2,
                                      eos_token_id=None)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == want
        differs |= want != base.outputs[0].token_ids
    assert differs  # the penalty changed something, so the comparison means something


def test_stop_string_spanning_two_tokens(tiny_llm):
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    full = tiny_llm.generate("stop strings", base, use_tqdm=False)[0].outputs[0]
    tokenizer = tiny_llm.get_tokenizer()
    boundary = len(tokenizer.decode(full.token_ids[:4]))  # between tokens 4 and 5
    stop = full.text[boundary - 2:boundary + 2]
    assert full.text.find(stop) == boundary - 2  # first occurrence straddles the boundary
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        out = tiny_llm.generate("stop strings", params, use_tqdm=False)[0].outputs[0]
        assert out.text == full.text[:boundary + (2 if include else -2)]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.token_ids == full.token_ids[:5]


def test_partial_text_holds_back_a_possible_stop_string(make_llm, tiny_model_dir):
    # One token a step, as a server streams them (`num_scheduler_steps` 1: `jaxpaged serve`'s).
    tiny_llm = make_llm(tiny_model_dir, max_num_seqs=8, num_scheduler_steps=1)
    engine = tiny_llm.llm_engine
    full = tiny_llm.generate("held back", SamplingParams(temperature=0, max_tokens=6,
                                                        ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    after_four = tiny_llm.get_tokenizer().decode(full.token_ids[:4])
    stop = after_four[-2:] + "\x00"  # its start ends the 4th partial text; never completed
    engine.add_request("held back", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                   stop=[stop]), request_id="h")
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step()]
    assert len(texts) == 6 and all(full.text.startswith(t) for t in texts)
    assert texts[3] == after_four[:-2]  # held back while it could still become the stop string
    assert texts[4] == tiny_llm.get_tokenizer().decode(full.token_ids[:5])  # then released
    assert texts[-1] == full.text


def test_min_tokens_holds_against_an_early_eos(tiny_llm):
    eos = 2
    forced = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0})
    assert tiny_llm.generate("x", forced, use_tqdm=False)[0].outputs[0].token_ids == [eos]
    params = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0}, min_tokens=4)
    out = tiny_llm.generate("x", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]
    assert out.finish_reason == "stop"


def test_allowed_token_ids_and_best_of(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8, allowed_token_ids=[7, 8, 9],
                            ignore_eos=True)
    out = tiny_llm.generate("only these", params, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= {7, 8, 9}
    best = tiny_llm.generate("best of", SamplingParams(n=2, best_of=5, temperature=1.0, seed=9,
                                                       max_tokens=5, ignore_eos=True),
                             use_tqdm=False)[0].outputs
    everyone = tiny_llm.generate("best of", SamplingParams(n=5, temperature=1.0, seed=9,
                                                           max_tokens=5, ignore_eos=True),
                                 use_tqdm=False)[0].outputs
    ranked = sorted(everyone, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]


def test_incremental_text_never_shows_a_broken_character(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    text = "Emoji 🙂🚀👩‍💻 and CJK 漢字かな交じり文, Türkçe ğüşiöç."
    ids = tokenizer(text).input_ids
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, tokenizer("Prompt:").input_ids)
    deltas = [detok.add_token(t) for t in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == detok.text == text


@pytest.mark.parametrize("field, value", [
    ("n", 0), ("best_of", 1), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -2),
    ("min_p", 1.5), ("presence_penalty", 2.5), ("frequency_penalty", -3.0),
    ("repetition_penalty", 0.0), ("seed", -1), ("stop", [""]), ("stop_token_ids", [-1]),
    ("max_tokens", 0), ("min_tokens", 20), ("logprobs", 21), ("prompt_logprobs", -1),
    ("logit_bias", {5: 200.0}), ("allowed_token_ids", []), ("ignore_eos", "yes"),
])
def test_invalid_field_raises_value_error(tiny_llm, field, value):
    kwargs = {field: value, **({"n": 2} if field == "best_of" else {})}
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match="49152"):
        tiny_llm.generate("x", SamplingParams(stop_token_ids=[49152]), use_tqdm=False)
    assert len(tiny_llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False)[0]
               .outputs[0].token_ids) >= 1


@pytest.mark.parametrize("model", ["tiny", pytest.param("default", marks=pytest.mark.slow)])
def test_prompt_logprobs_equal_hf_log_softmax(model, shared, tiny_model_dir,
                                              default_model_dir):
    model_dir = tiny_model_dir if model == "tiny" else default_model_dir
    llm, reference = shared(model_dir)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        ids = out.prompt_token_ids
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0].double()
        want = torch.log_softmax(logits, -1).numpy()
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i, entry in enumerate(out.prompt_logprobs[1:]):
            top3 = np.argsort(-want[i])[:3].tolist()
            assert set(entry) == set(top3) | {ids[i + 1]}
            for t, lp in entry.items():
                assert abs(lp.logprob - want[i, t]) < 1e-4, (i, t)
            assert entry[ids[i + 1]].rank == 1 + int((want[i] > want[i, ids[i + 1]]).sum())
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


@pytest.mark.slow
def test_streamed_partial_texts_of_emoji_and_cjk_output(shared, default_model_dir):
    """The default model answers these with Japanese and emoji: partial texts are prefixes of
    the final text and never show U+FFFD for a character split across tokens."""
    llm, _ = shared(default_model_dir)  # the other tests' engine
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()
    questions = {"cjk": "How do you say hello in Japanese and in Chinese? Answer with the words "
                        "and a smiley emoji.",
                 "emoji": "Write three emojis about the sea 🌊"}
    for rid, question in questions.items():
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             tokenize=False, add_generation_prompt=True)
        engine.add_request({"prompt": text, "prompt_token_ids": tokenizer(
            text, add_special_tokens=False).input_ids},
            SamplingParams(temperature=0, max_tokens=40), request_id=rid)
    partials = {rid: [] for rid in questions}
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            partials[out.request_id].append(out.outputs[0].text)
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    assert any("\u3040" <= ch <= "\u9fff" for ch in finals["cjk"].text)  # kana or CJK
    assert any(ord(ch) >= 0x1F300 for ch in finals["emoji"].text)  # emoji
    for rid, texts in partials.items():
        final = finals[rid]
        # A character cut off by max_tokens is never shown, not even as U+FFFD (as in vLLM).
        full = tokenizer.decode(final.token_ids, skip_special_tokens=True)
        assert final.text == full.rstrip("\ufffd")
        assert not any("\ufffd" in t for t in texts)
        assert all(final.text.startswith(t) for t in texts) and texts[-1] == final.text
