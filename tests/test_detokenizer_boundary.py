"""Incremental detokenization where the prompt ends inside a multi-byte character (a byte-level
BPE splits an emoji over several tokens): no output text repeats the prompt's, and the deltas add
up to the final text.

The expected text comes from the tokenizer alone, as vLLM defines an output's text:
`decode(prompt + output)` from the length (in characters) of `decode(prompt)` on (the prompt's
incomplete character, U+FFFD in `decode(prompt)`, is the prompt's).
"""

from __future__ import annotations

import pytest

from jaxpaged import RequestOutputKind, SamplingParams
from jaxpaged.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Say 😀😀 ok", "Hello 🎉 there, 中文 and 𝄞 music"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def expected_text(tokenizer, prompt: list[int], output: list[int]) -> str:
    return tokenizer.decode(prompt + output, skip_special_tokens=True)[
        len(tokenizer.decode(prompt, skip_special_tokens=True)):]


def mid_character_cuts(tokenizer, ids: list[int]) -> list[int]:
    """The cut points of `ids` whose prefix's text ends inside a character."""
    return [cut for cut in range(1, len(ids))
            if tokenizer.decode(ids[:cut]).endswith("\ufffd")]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_after_a_prompt_that_ends_mid_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    cuts = mid_character_cuts(tokenizer, ids)
    assert cuts  # the tokenizer splits some character over tokens
    for cut in cuts + [1, len(ids) - 1]:  # and prompts that end on a whole character
        prompt, output = ids[:cut], ids[cut:]
        detok = IncrementalDetokenizer(tokenizer, prompt)
        deltas = [detok.add_token(t) for t in output]
        want = expected_text(tokenizer, prompt, output)
        assert "".join(deltas) == detok.text == want, (cut, deltas)


@pytest.fixture(scope="module")
def mid_character_prompt(tokenizer) -> list[int]:
    ids = tokenizer.encode("The face: 😀", add_special_tokens=False)
    cut = mid_character_cuts(tokenizer, ids)[0]
    return ids[:cut]


def run(engine, prompt_ids: list[int], params: SamplingParams, request_id: str) -> list:
    engine.add_request({"prompt_token_ids": prompt_ids}, params, request_id=request_id)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_engine_outputs_after_a_prompt_that_ends_mid_character(tiny_llm, tokenizer,
                                                               mid_character_prompt):
    """Every output kind: the final text (FINAL_ONLY, CUMULATIVE) and the concatenated deltas
    (DELTA) equal the tokenizer's text of the output tokens; no delta holds the prompt's text."""
    engine = tiny_llm.llm_engine
    prompt_text = tokenizer.decode(mid_character_prompt).rstrip("\ufffd")
    texts = {}
    for kind in RequestOutputKind:
        params = SamplingParams(seed=3, max_tokens=8, ignore_eos=True, output_kind=kind)
        outputs = run(engine, mid_character_prompt, params, f"mid-{kind.name}")
        token_ids = sum((o.outputs[0].token_ids for o in outputs), []) \
            if kind == RequestOutputKind.DELTA else outputs[-1].outputs[0].token_ids
        want = expected_text(tokenizer, mid_character_prompt, token_ids)
        if kind == RequestOutputKind.DELTA:
            deltas = [o.outputs[0].text for o in outputs]
            assert not any(prompt_text in d for d in deltas if d), deltas
            texts[kind] = "".join(deltas)
        else:
            texts[kind] = outputs[-1].outputs[0].text
        assert texts[kind] == want, kind
        assert prompt_text not in texts[kind]
    assert len(set(texts.values())) == 1
