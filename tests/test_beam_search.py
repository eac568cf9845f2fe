"""Beam search: HF `generate(num_beams=4, do_sample=False)` parity, and beams sharing blocks."""

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM as HFLlama

from jaxpaged import BeamSearchParams
from jaxpaged.entrypoints.beam_search import beam_search


def hf_best(model_dir, ids, width, max_new_tokens, length_penalty=1.0):
    model = HFLlama.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), num_beams=width, do_sample=False,
                             max_new_tokens=max_new_tokens, length_penalty=length_penalty,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0].tolist()
    while len(tokens) > len(ids) and tokens[-1] == 0:  # padding after an early EOS
        tokens.pop()
    return tokens, float(out.sequences_scores[0])


def check(make_llm, model_dir, prompts, max_tokens, length_penalty=1.0, chat=False):
    llm = make_llm(model_dir, block_size=8, num_kv_blocks=256)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    params = BeamSearchParams(beam_width=4, max_tokens=max_tokens, length_penalty=length_penalty)
    for prompt in prompts:
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                 tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompt = {"prompt_token_ids": ids}
        else:
            ids = tokenizer(prompt).input_ids
        best = llm.beam_search(prompt, params)[0].sequences[0]
        want_tokens, want_score = hf_best(model_dir, ids, 4, max_tokens, length_penalty)
        assert best.tokens == want_tokens
        assert abs(best.score - want_score) < 1e-4


def test_tiny_model_matches_hf(make_llm, tiny_model_dir):
    check(make_llm, tiny_model_dir, ["The capital of France is", "Once upon a time"], 10)
    check(make_llm, tiny_model_dir, ["length penalty"], 8, length_penalty=0.5)


@pytest.mark.slow
def test_default_model_matches_hf(make_llm, default_model_dir):
    # The real model's beams over a 37-token prompt; the reply ends with EOS well before
    # max_tokens: the finished pool and early stop decide.
    check(make_llm, default_model_dir, ["What is the capital of France?"], 24, chat=True)


def test_beams_share_blocks_and_free_them(make_llm, tiny_model_dir):
    # Each round's beams are requests whose common prefix comes from the prefix cache: in the
    # steps that run them, they hold the prompt's full blocks once between them.
    llm = make_llm(tiny_model_dir, block_size=8, num_kv_blocks=256)
    engine = llm.llm_engine
    ids = engine.tokenize_prompt("a prompt long enough to fill a few blocks of eight tokens")[1]
    usage = []

    def watch(out):  # at the start of each step, with its sequences' blocks allocated
        if len(out.seqs) > 1:
            unshared = sum(len(s.block_table) for s in out.seqs)
            usage.append((engine.stats()["num_used_blocks"], unshared,
                          engine.stats()["num_shared_blocks"]))

    engine.runner.fault_hook = watch
    [out] = beam_search(engine, [ids], BeamSearchParams(beam_width=4, max_tokens=12,
                                                        ignore_eos=True))
    assert len(out.sequences) == 4
    assert len(usage) >= 10  # rounds 2..12 run their 4 beams in one step
    assert all(used < unshared and shared >= len(ids) // 8 for used, unshared, shared in usage)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_prefix_cache_hits"] >= 10 * 4 * (len(ids) // 8)


def test_prompts_beams_run_in_the_same_steps(make_llm, tiny_model_dir):
    # Two prompts searched together give what each gives alone, in the steps of one search.
    llm = make_llm(tiny_model_dir, block_size=8, num_kv_blocks=256)
    params = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)
    prompts = ["The capital of France is", "Once upon a time"]
    steps = []
    llm.llm_engine.runner.fault_hook = lambda out: steps.append(len(out.seqs))
    together = llm.beam_search(prompts, params)
    assert max(steps) == 6 and len(steps) == 6  # one step a round, both prompts' beams in it
    for prompt, got in zip(prompts, together):
        [alone] = llm.beam_search(prompt, params)
        assert [s.tokens for s in got.sequences] == [s.tokens for s in alone.sequences]


def test_bad_beam_params_raise_value_error(make_llm, tiny_model_dir):
    for kwargs in (dict(beam_width=0, max_tokens=4), dict(beam_width=11, max_tokens=4),
                   dict(beam_width=2, max_tokens=0)):
        with pytest.raises(ValueError, match="BeamSearchParams"):
            BeamSearchParams(**kwargs)
    llm = make_llm(tiny_model_dir, block_size=8, num_kv_blocks=32)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.beam_search("x", BeamSearchParams(beam_width=8, max_tokens=200))
    assert len(llm.beam_search("x", BeamSearchParams(2, 3))[0].sequences) == 2
