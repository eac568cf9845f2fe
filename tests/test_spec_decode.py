"""Speculative decoding (`jaxpaged.spec_decode`): n-gram and draft-model proposals verified in
one packed step give the target's own outputs: greedy ids equal to decoding without
speculation (across batches, chunked prefill, preemption and the prefix cache), seeded samples
equal too in batch-invariant mode, and the sampled distribution is the target's on a small
vocabulary. KV blocks are all free after each engine (`make_llm`'s leak check)."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.spec_decode import SpeculativeConfig, ngram_proposal

from conftest import TINY_CONFIG, copy_tokenizer
from output_utils import assert_idle

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
PROMPTS = [{"prompt_token_ids": ids} for ids in (
    [5, 6, 7, 8, 9, 10, 5, 6, 7, 8], [10, 20, 30, 10, 20, 30, 10],
    list(range(3, 43)), [42] * 9, [7, 8, 9, 10, 11, 12, 13, 7, 8])]


def test_ngram_proposal_takes_the_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 4, 5, 1, 2]
    # "1 2" occurs at 0 and 4; the latest (4) is followed by 4 5 1 2
    assert ngram_proposal(tokens, 3, 2, 1) == [4, 5, 1]
    # a 3-gram "5 1 2" has no earlier occurrence; n = 2 matches
    assert ngram_proposal(tokens, 2, 3, 2) == [4, 5]
    assert ngram_proposal([1, 2, 3, 4], 3, 2, 1) == []  # nothing repeats
    assert ngram_proposal([1, 2, 1], 5, 1, 1) == [2, 1]  # fewer than k follow


def test_rejection_sampler_outputs_draws_up_to_the_first_that_differs():
    from jaxpaged.sample.rejection_sampler import rejection_sample

    spec = [[5, 6, 7], [], [3], [4, 4]]
    # row 0: 5 6 accepted, 9 replaces 7, the draw after 7 is not output; row 1: two
    # completions' first draws (no proposals); row 2: all accepted plus the draw after them;
    # row 3: the first draw differs.
    rows = [0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3]
    positions = [0, 1, 2, 3, 0, 0, 0, 1, 0, 1, 2]
    tokens = [5, 6, 9, 4, 1, 2, 3, 8, 1, 4, 4]
    assert rejection_sample(tokens, rows, positions, spec).tolist() == [
        True, True, True, False, True, True, True, True, True, False, False]


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown keys ['lookup']"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min 4"),
    ("{not json", "not JSON"),
])
def test_bad_config_is_named(config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SpeculativeConfig.from_dict(config)


def test_config_defaults_follow_vllm():
    c = SpeculativeConfig.from_dict('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_dict({"num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 2)
    assert SpeculativeConfig.from_dict({"model": "x", "num_speculative_tokens": 2}).method \
        == "draft_model"


def _ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def _save_tiny(tmp_path_factory, tokenizer_dir, name: str, seed: int, **config):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    path = tmp_path_factory.mktemp(name)
    LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, **config})).save_pretrained(path)
    copy_tokenizer(tokenizer_dir, path)
    return path


@pytest.fixture(scope="module")
def vocab64_model_dir(tmp_path_factory, tiny_model_dir):
    """A random tiny Llama over 64 tokens: its greedy outputs fall into repeats that n-gram
    proposals predict."""
    return _save_tiny(tmp_path_factory, tiny_model_dir, "tiny-vocab64", 0, vocab_size=64)


@pytest.fixture(scope="module")
def plain_llm(vocab64_model_dir):
    """The 64-token model without speculation (make_llm's limits): the reference outputs."""
    from jaxpaged import LLM

    return LLM(vocab64_model_dir, max_model_len=256, num_kv_blocks=256, precompile=False)


@pytest.fixture(scope="module")
def greedy_reference(plain_llm):
    outs = plain_llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0,
                                                      ignore_eos=True), use_tqdm=False)
    assert_idle(plain_llm)
    return _ids(outs)


@pytest.mark.parametrize("case", ["chunked batch", "preempted", "prefix cache"])
def test_ngram_greedy_ids_equal_no_speculation(vocab64_model_dir, make_llm, greedy_reference,
                                               case):
    kw = dict(speculative_config=NGRAM)
    if case == "chunked batch":  # the five prompts' chunks share steps
        kw["max_num_batched_tokens"] = 16
    if case == "preempted":
        kw.update(num_kv_blocks=12, max_model_len=96)  # five sequences of up to 80 tokens
    llm = make_llm(vocab64_model_dir, **kw)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    if case == "prefix cache":  # the prompts computed once, then again from the cache
        llm.generate(PROMPTS, params, use_tqdm=False)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(outs) == greedy_reference
    stats = llm.stats()
    assert stats["num_spec_accepted_tokens"] > 0, stats
    if case == "preempted":
        assert stats["num_preemptions"] > 0, stats
    if case == "prefix cache":
        assert stats["num_prefix_cache_hits"] > 0, stats
    m = max((o.metrics for o in outs), key=lambda m: m.spec_num_accepted_tokens)
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs) \
        == stats["num_spec_accepted_tokens"] - (stats["num_spec_accepted_tokens"] // 2
                                                if case == "prefix cache" else 0)
    assert m.spec_num_draft_tokens >= m.spec_num_accepted_tokens > 0
    assert m.spec_mean_accepted_length == 1 + m.spec_num_accepted_tokens / m.spec_num_drafts


def test_ngram_with_logprobs_stop_strings_and_n(vocab64_model_dir, make_llm, plain_llm):
    """Logprobs, a stop string met inside a step's accepted tokens, and n > 1 come out as
    without speculation."""
    plain = plain_llm
    spec = make_llm(vocab64_model_dir, speculative_config=NGRAM)
    tokenizer = plain.get_tokenizer()
    stop = "#####"  # PROMPTS[1] goes on with a run of "#" tokens, which n-grams predict
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[stop]),
              SamplingParams(max_tokens=20, ignore_eos=True, n=2, temperature=0.8, seed=3)]
    a = plain.generate([PROMPTS[1]] * 3, params, use_tqdm=False)
    b = spec.generate([PROMPTS[1]] * 3, params, use_tqdm=False)
    assert spec.stats()["num_spec_accepted_tokens"] > 0
    assert _ids(a[:2]) == _ids(b[:2])
    for x, y in zip(a[0].outputs[0].logprobs, b[0].outputs[0].logprobs):
        assert x.keys() == y.keys()
        np.testing.assert_allclose([v.logprob for v in x.values()],
                                   [v.logprob for v in y.values()], atol=1e-4)
    assert b[1].outputs[0].text == a[1].outputs[0].text and b[1].outputs[0].stop_reason == stop
    assert len(tokenizer.decode(b[1].outputs[0].token_ids)) >= len(b[1].outputs[0].text)
    assert len(b[2].outputs) == 2 and all(len(c.token_ids) == 20 for c in b[2].outputs)
    assert_idle(plain)


def test_seeded_sampling_is_the_same_draw_in_batch_invariant_mode(vocab64_model_dir, make_llm):
    """Each output token is the target's draw with its own key, so with batch invariance (a
    token's logits do not depend on the step computing it) a seeded request draws exactly
    the tokens and logprobs it draws without speculation."""
    params = [SamplingParams(max_tokens=24, temperature=0.7, seed=s, logprobs=1,
                             ignore_eos=True) for s in range(2)]
    outs = []
    for kw in ({}, {"speculative_config": NGRAM}):
        llm = make_llm(vocab64_model_dir, batch_invariant=True, **kw)
        outs.append(llm.generate(PROMPTS[1:3], params, use_tqdm=False))
    assert _ids(outs[0]) == _ids(outs[1])
    assert [[lp for c in o.outputs for lp in c.logprobs] for o in outs[0]] \
        == [[lp for c in o.outputs for lp in c.logprobs] for o in outs[1]]
    assert sum(o.metrics.spec_num_accepted_tokens for o in outs[1]) > 0


@pytest.fixture(scope="module")
def perturbed_model_dir(tmp_path_factory, vocab64_model_dir):
    """The 64-token model with noise on every weight: a draft that agrees with it only
    sometimes."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    model = LlamaForCausalLM.from_pretrained(vocab64_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.15)
    path = tmp_path_factory.mktemp("tiny-perturbed")
    model.save_pretrained(path)
    copy_tokenizer(vocab64_model_dir, path)
    return path


def test_draft_model_greedy_ids_equal(vocab64_model_dir, perturbed_model_dir, make_llm,
                                      greedy_reference):
    """Drafting for itself, the tiny model has every proposal accepted; a perturbed copy has
    some accepted; both give the target's greedy ids, with chunked prefill."""
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    rates = []
    for draft in (vocab64_model_dir, perturbed_model_dir):
        llm = make_llm(vocab64_model_dir, max_num_batched_tokens=32,
                       speculative_config={"model": str(draft), "num_speculative_tokens": 3})
        assert _ids(llm.generate(PROMPTS, params, use_tqdm=False)) == greedy_reference
        stats = llm.stats()
        rates.append(stats["spec_acceptance_rate"])
        assert not llm.llm_engine.proposer.drafts  # the draft's sequences were all freed
        bm = llm.llm_engine.proposer.block_manager
        assert bm.num_free_blocks == bm.num_blocks
    assert rates[0] == 1.0 and 0 < rates[1] < 1, rates


def test_draft_model_with_another_vocabulary_is_refused(tiny_model_dir, vocab64_model_dir,
                                                        make_llm):
    with pytest.raises(ValueError, match="vocab_size 64"):
        make_llm(tiny_model_dir, speculative_config={"model": str(vocab64_model_dir),
                                                     "num_speculative_tokens": 2})


def test_draft_model_served_from_a_gguf_file(tmp_path, monkeypatch, make_llm):
    """A draft model given as a GGUF file loads as a target from one does (its weights read
    from the file) and gives the target's greedy ids. The target is the same model imported
    from that file, so every proposal is accepted."""
    pytest.importorskip("gguf")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from test_gguf_import import N_BPE, write_gguf

    from jaxpaged.model_loader.gguf_import import import_gguf
    from jaxpaged.model_loader.model_store import jaxpaged_home

    # The GGUF's serving folder is made under $JAXPAGED_HOME; executables stay in the shared cache.
    monkeypatch.setenv("JAXPAGED_COMPILATION_CACHE_DIR", str(jaxpaged_home() / "compile-cache"))
    monkeypatch.setenv("JAXPAGED_HOME", str(tmp_path / "home"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "vocab_size": N_BPE,
                                            "bos_token_id": 0, "eos_token_id": 2}))
    write_gguf(tmp_path / "draft.gguf", "llama", model, tokenizer="gpt2")
    import_gguf(tmp_path / "draft.gguf", tmp_path / "target", progress=False)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % N_BPE for j in range(5 + i)]}
               for i in range(3)]
    plain = make_llm(tmp_path / "target")
    spec = make_llm(tmp_path / "target", speculative_config={
        "model": str(tmp_path / "draft.gguf"), "num_speculative_tokens": 3})
    assert _ids(spec.generate(prompts, params, use_tqdm=False)) \
        == _ids(plain.generate(prompts, params, use_tqdm=False))
    stats = spec.stats()
    assert stats["num_spec_draft_tokens"] > 0 and stats["spec_acceptance_rate"] == 1.0, stats


@pytest.fixture(scope="module")
def small_vocab_model_dir(tmp_path_factory, tiny_model_dir):
    """A random tiny Llama over 8 tokens (weights large enough for uneven distributions)."""
    return _save_tiny(tmp_path_factory, tiny_model_dir, "tiny-vocab8", 2, vocab_size=8,
                      initializer_range=0.5)


def test_speculative_sampling_keeps_the_target_distribution(small_vocab_model_dir, make_llm):
    """The joint distribution of output tokens 2 and 3 (each verified against n-gram
    proposals) over 2000 seeds matches the target's exact one, computed from its full
    next-token distributions; accepting every proposal instead would not."""
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
    V, N = 8, 2000
    llm = make_llm(small_vocab_model_dir, max_num_seqs=250, max_num_batched_tokens=4096,
                   num_kv_blocks=1024,
                   speculative_config={**NGRAM, "num_speculative_tokens": 2,
                                       "disable_by_batch_size": None})
    outs = []
    for start in range(0, N, 250):  # each batch admitted at once, then verifying every step
        outs += llm.generate([{"prompt_token_ids": prompt}] * 250,
                             [SamplingParams(max_tokens=3, temperature=1.0, seed=s,
                                             ignore_eos=True) for s in range(start, start + 250)],
                             use_tqdm=False)
    stats = llm.stats()
    assert 0 < stats["num_spec_accepted_tokens"] < stats["num_spec_draft_tokens"], stats
    assert stats["num_spec_drafts"] > N // 2, stats
    counts = np.zeros((V, V))
    for o in outs:
        _, a, b = o.outputs[0].token_ids
        counts[a, b] += 1

    def dist(prompts):  # the target's next-token distribution after each prompt, f[n, V]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=1, logprobs=V, ignore_eos=True),
                            use_tqdm=False)
        return np.array([[np.exp(o.outputs[0].logprobs[0][t].logprob) for t in range(V)]
                         for o in outs])

    p0 = dist([prompt])[0]
    p1 = dist([prompt + [t] for t in range(V)])  # [t0, t1]
    p2 = dist([prompt + [t, u] for t in range(V) for u in range(V)]).reshape(V, V, V)
    exact = np.einsum("a,ab,abc->bc", p0, p1, p2)
    tv = 0.5 * np.abs(counts / N - exact).sum()
    # sampling noise alone: E[TV] ~ 0.5 * sum sqrt(p / N) (about 0.03-0.05 here)
    noise = 0.5 * np.sqrt(exact / N).sum()
    assert tv < 2.5 * noise, (tv, noise)


def test_server_metrics_count_speculation(vocab64_model_dir):
    """`/metrics` carries vLLM's spec_decode counters, equal to the engine's totals."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    from server_utils import ServerThread

    from jaxpaged import LLM

    llm = LLM(vocab64_model_dir, max_model_len=256, num_kv_blocks=256, precompile=False,
              speculative_config=NGRAM)
    with ServerThread(llm, "tiny") as server:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": PROMPTS[1]["prompt_token_ids"], "max_tokens": 30,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        text = httpx.get(f"{server.url}/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    stats = llm.stats()
    assert stats["num_spec_accepted_tokens"] > 0
    assert values["jaxpaged:spec_decode_num_drafts_total"] == stats["num_spec_drafts"]
    assert values["jaxpaged:spec_decode_num_draft_tokens_total"] == stats["num_spec_draft_tokens"]
    assert values["jaxpaged:spec_decode_num_accepted_tokens_total"] \
        == stats["num_spec_accepted_tokens"]


def test_cli_names_a_bad_speculative_config(capsys):
    from jaxpaged.entrypoints.cli import main

    assert main(["generate", "Hi", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": -1}']) == 2
    assert "num_speculative_tokens must be an int >= 1" in capsys.readouterr().err
